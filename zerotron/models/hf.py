"""Hugging Face directories: config.json <-> ModelConfig, safetensors weights, and the weight-name map.

zerotron names are HF's ``LlamaForCausalLM`` names without the ``model.`` prefix
(``layers.0.self_attn.q_proj.weight`` <-> ``model.layers.0.self_attn.q_proj.weight``); ``lm_head.weight``
is the same in both and absent from the files of tied models. Qwen2 and Mistral use the same names.
Errors are :class:`ModelLoadError` with one line naming the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Optional

import torch

from zerotron.config import ModelConfig
from zerotron.config_check import check_architecture
from zerotron.config_load import ConfigError
from zerotron.models.hf_bnb import BnbFormatError, check_quantization, group_keys
from zerotron.models.hf_bnb import dequantize as dequantize_bnb
from zerotron.models.hf_moe import MIXTRAL_ROLES, PLAIN_ROLES, fuse_stream, rename_block, split_experts
from zerotron.models.hf_packed import (
    PackedFormat,
    PackedFormatError,
    group_packed,
    packed_shape,
    read_format,
    unpack,
)
from zerotron.models.hf_packed import dequantize as dequantize_packed

DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
_QK_NORM = {"Qwen3ForCausalLM": "head", "Qwen3MoeForCausalLM": "head", "OlmoeForCausalLM": "full"}
_MODEL_TYPE = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}
_ARCH_OF_TYPE = {t: a for a, t in _MODEL_TYPE.items()} | {"mistral": "MistralForCausalLM"}


class ModelLoadError(ValueError):
    """A model file or directory that cannot be read: the message names the file and what is wrong."""


def checked_architecture(cfg: ModelConfig, where: object) -> ModelConfig:
    """``cfg`` as read from ``where`` (a config.json, a GGUF file, a checkpoint's trainer.json), refused
    in one line naming the file when its architecture cannot be built (zero heads, heads that do not
    divide the hidden size...)."""
    try:
        check_architecture(cfg)
    except ConfigError as e:
        raise ModelLoadError(f"{where}: {e}") from None
    return cfg


def to_hf_name(name: str, arch: str = "LlamaForCausalLM") -> str:
    """zerotron parameter name -> HF name (Mixtral's MoE block is ``block_sparse_moe``)."""
    if name.startswith("lm_head."):
        return name
    if arch == "MixtralForCausalLM":
        name = name.replace(".mlp.", ".block_sparse_moe.")
    return "model." + name


def from_hf_name(name: str) -> str:
    """HF parameter name -> zerotron name."""
    return rename_block(name[len("model.") :] if name.startswith("model.") else name)


def _refuse_unsupported(hf: dict[str, Any], arch: str, source: str) -> None:
    try:
        check_quantization(hf, source)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: unsupported architecture {arch!r}; zerotron reads {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if arch not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") and hf.get("attention_bias"):
        raise ModelLoadError(f"{source}: attention_bias=true (bias on o_proj too) is not supported")
    checks = (
        ("mlp_bias", bool(hf.get("mlp_bias")), "mlp_bias=true"),
        ("clip_qkv", hf.get("clip_qkv") is not None, f"clip_qkv={hf.get('clip_qkv')}"),
        ("router_jitter_noise", bool(hf.get("router_jitter_noise")), "router jitter noise"),
        ("decoder_sparse_step", hf.get("decoder_sparse_step", 1) != 1, "dense layers between MoE layers"),
        ("mlp_only_layers", bool(hf.get("mlp_only_layers")), "dense layers between MoE layers"),
    )
    for _, bad, what in checks:
        if bad:
            raise ModelLoadError(f"{source}: {what} is not supported")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported (gated MLP needs silu)")


def _moe_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """ModelConfig's expert fields from a HF MoE config (none for a dense one)."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    return {
        "num_local_experts": hf.get("num_local_experts") or hf["num_experts"],
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "moe_intermediate_size": hf.get("moe_intermediate_size"),
        "shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size") or 0,
        "norm_topk_prob": True if arch == "MixtralForCausalLM" else bool(hf.get("norm_topk_prob", False)),
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
    }


def config_from_hf(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """ModelConfig from the dict of a HF ``config.json`` (the architectures of SUPPORTED_ARCHITECTURES)."""
    archs = hf.get("architectures") or [hf.get("model_type", "?")]
    arch = _ARCH_OF_TYPE.get(archs[0], archs[0])  # a config without architectures names its model_type
    _refuse_unsupported(hf, arch, source)
    rope_scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type", "default")) == "default":
        rope_theta = rope_scaling.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_scaling = None
    else:
        rope_theta = hf.get("rope_theta") or (rope_scaling or {}).get("rope_theta", 10000.0)
        if rope_scaling:
            rope_scaling = {k: v for k, v in rope_scaling.items() if k != "rope_theta"}
    eos = hf.get("eos_token_id")
    bias = arch == "Qwen2ForCausalLM" or (arch == "Qwen2MoeForCausalLM" and hf.get("qkv_bias", True))
    return ModelConfig(
        preset=None,
        hidden_size=hf["hidden_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"),
        intermediate_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(bias),
        mlp="gated",
        qk_norm=_QK_NORM.get(arch, "none"),
        initializer_range=float(hf.get("initializer_range", 0.02)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) and eos else (eos if isinstance(eos, int) else None),
        **_moe_fields(hf, arch),
    )


def hf_architecture(cfg: ModelConfig) -> str:
    """The transformers architecture that holds exactly this model (one-line error when none does)."""
    if cfg.mlp != "gated":
        raise ModelLoadError("model.mlp=plain has no Hugging Face Llama equivalent; export needs mlp=gated")
    bias, shared = cfg.attention_bias, cfg.shared_expert_intermediate_size > 0
    if cfg.scoring_func != "softmax" or cfg.routed_scaling_factor != 1.0 or cfg.router_bias:
        raise ModelLoadError(
            "no Hugging Face architecture zerotron writes routes by sigmoid scores, a routed scaling factor "
            "or a balancing bias (DeepSeek-V3 has them, with attention zerotron does not build); keep the "
            "zerotron checkpoint"
        )
    if not cfg.num_local_experts:
        table = {("none", False): "LlamaForCausalLM", ("none", True): "Qwen2ForCausalLM"}
        table[("head", False)] = "Qwen3ForCausalLM"
        arch = table.get((cfg.qk_norm, bias))
    elif shared:
        arch = "Qwen2MoeForCausalLM" if cfg.qk_norm == "none" else None
    elif cfg.qk_norm == "full":
        arch = None if bias else "OlmoeForCausalLM"
    elif cfg.qk_norm == "head":
        arch = None if bias else "Qwen3MoeForCausalLM"
    else:
        arch = "MixtralForCausalLM" if cfg.norm_topk_prob and not bias else None
    if arch is None:
        raise ModelLoadError(
            f"no Hugging Face architecture holds this model (qk_norm={cfg.qk_norm}, attention_bias={bias}, "
            f"experts={cfg.num_local_experts}, shared expert={shared}, norm_topk_prob={cfg.norm_topk_prob})"
        )
    return arch


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A HF ``config.json`` dict for the architecture :func:`hf_architecture` picks."""
    arch = hf_architecture(cfg)
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": _MODEL_TYPE[arch],
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.dim_per_head,
        "intermediate_size": cfg.expert_intermediate if arch in _SAME_WIDTH else cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "initializer_range": cfg.initializer_range,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "torch_dtype": "float32",
    }
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        out.update(attention_bias=False, mlp_bias=False)
    if cfg.num_local_experts:
        out.update(_moe_to_hf(cfg, arch))
    return out


_SAME_WIDTH = ("MixtralForCausalLM", "OlmoeForCausalLM")  # intermediate_size is the experts' width


def _moe_to_hf(cfg: ModelConfig, arch: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": False,
    }
    if arch == "MixtralForCausalLM":
        out.update(num_local_experts=cfg.num_local_experts, router_jitter_noise=0.0)
        return out
    out.update(num_experts=cfg.num_local_experts, norm_topk_prob=cfg.norm_topk_prob)
    if arch != "OlmoeForCausalLM":
        out.update(moe_intermediate_size=cfg.expert_intermediate, decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "Qwen2MoeForCausalLM":
        out.update(
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, qkv_bias=cfg.attention_bias
        )
    if arch in ("Qwen3MoeForCausalLM", "OlmoeForCausalLM"):
        out.update(attention_bias=False, clip_qkv=None)
    return out


def read_hf_config(directory: str | Path) -> ModelConfig:
    """ModelConfig of a HF model directory (reads ``config.json``)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such file (a Hugging Face model directory needs config.json)")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
    try:
        cfg = config_from_hf(hf, str(path))
    except KeyError as e:
        raise ModelLoadError(f"{path}: missing field {e.args[0]!r}") from e
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ModelLoadError(f"{path}: not a usable model config ({e})") from e
    return checked_architecture(cfg, path)


def _name_shards(out: Path, shards: list[dict[str, str]], total: int) -> None:
    """Rename the written shards as transformers names them, with an index when there are several."""
    if len(shards) == 1:
        os.replace(out / ".shard0.safetensors", out / "model.safetensors")
        return
    weight_map = {}
    for k, names in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(out / f".shard{k}.safetensors", out / file)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def path_inside(folder: Path, name: Any) -> Path | None:
    """``folder / name`` for a file name read from a file of ``folder`` (an index, a manifest), or None
    unless it is a relative path that stays inside ``folder``, symbolic links followed: a crafted index
    must not make a reader open a file elsewhere."""
    if not isinstance(name, str) or not name or "\x00" in name:
        return None
    if Path(name).is_absolute() or ".." in Path(name).parts:
        return None
    try:
        (folder / name).resolve().relative_to(folder.resolve())
    except ValueError:
        return None
    return folder / name


def _shard_inside(directory: Path, name: Any, index: Path) -> Path:
    """A shard file named by the index, refused unless it lies inside the model's directory."""
    path = path_inside(directory, name)
    if path is None:
        raise ModelLoadError(f"{index}: shard {name!r} lies outside {directory}")
    return path


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index}: not a safetensors index ({e})") from e
        files = [_shard_inside(directory, name, index) for name in names]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: no such file (listed in {index.name})")
        return files
    raise ModelLoadError(f"{directory}: no model.safetensors or model.safetensors.index.json")


def read_hf_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF directory under zerotron names (single or sharded safetensors)."""
    return dict(iter_hf_weights(directory))


def iter_hf_weights(directory: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of :func:`read_hf_weights` one at a time, read from the files as needed."""
    fmt = packed_format_of(Path(directory))
    pairs = (
        (from_hf_name(key), tensor)
        for path in _weight_files(Path(directory))
        for key, tensor in iter_safetensors(path, fmt)
    )
    yield from fuse_stream(pairs, _experts_in(Path(directory)))


def _experts_in(directory: Path) -> int:
    """Routed experts per block said by the directory's config.json (0: dense, or no config)."""
    try:
        hf = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0
    return int(hf.get("num_local_experts") or hf.get("num_experts") or 0)


def packed_format_of(directory: Path) -> PackedFormat | None:
    """The GPTQ/AWQ/compressed-tensors format a directory's config.json names (None: none), refused in one line when
    zerotron cannot read it."""
    try:
        return read_format(directory)
    except PackedFormatError as e:
        raise ModelLoadError(str(e)) from None


def iter_safetensors(path: Path, packed: PackedFormat | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of one safetensors file, one tensor in memory at a time; errors name the file.
    A weight saved quantised by bitsandbytes (4-bit) comes out dequantised to fp32, its quantisation
    state's tensors folded into it (:mod:`zerotron.models.hf_bnb`); so does a GPTQ, AWQ or compressed-tensors linear of the
    format ``packed`` (:mod:`zerotron.models.hf_packed`)."""
    from safetensors import safe_open

    try:
        handle = safe_open(str(path), framework="pt")
        keys, states = group_keys(list(handle.keys()))
        keys, linears = group_packed(keys) if packed is not None else (keys, {})
    except Exception as e:  # safetensors raises its own SafetensorError/OSError for damaged files
        raise ModelLoadError(f"{path}: cannot read safetensors ({str(e).splitlines()[0]})") from e

    def get(key: str) -> torch.Tensor:
        try:
            tensor: torch.Tensor = handle.get_tensor(key)
        except Exception as e:
            raise ModelLoadError(f"{path}: tensor {key} cannot be read ({str(e).splitlines()[0]})") from e
        return tensor

    for key in keys:
        tensor = get(key)
        if key in states:
            parts = {part: get(k) for part, k in states[key].items()}
            try:
                tensor = dequantize_bnb(tensor, parts, f"{path}: {key}")
            except BnbFormatError as e:
                raise ModelLoadError(str(e)) from None
        yield key, tensor
    for key, names in linears.items():
        assert packed is not None
        parts = {part: get(k) for part, k in names.items()}
        try:
            unpacked = unpack(packed, parts, packed_shape(packed, parts["qweight"]), f"{path}: {key}")
        except PackedFormatError as e:
            raise ModelLoadError(str(e)) from None
        yield key, dequantize_packed(unpacked)


def write_hf_directory(
    model: torch.nn.Module,
    directory: str | Path,
    tokenizer_files: Optional[dict[str, str]] = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write config.json, generation_config.json, model.safetensors and tokenizer files.

    ``transformers.AutoModelForCausalLM.from_pretrained(directory)`` loads the result.

    Args:
        model: a :class:`~zerotron.models.llama.LlamaForCausalLM`.
        directory: created if absent.
        tokenizer_files: file name -> text (e.g. tokenizer.json, tokenizer_config.json).
        dtype: dtype of the stored weights.
    """
    cfg: ModelConfig = model.config  # type: ignore[assignment]
    tensors = (
        (name, tensor)
        for name, tensor in model.state_dict().items()
        if not (cfg.tie_word_embeddings and name == "lm_head.weight")
    )
    return write_hf_files(cfg, tensors, directory, tokenizer_files, dtype)


def write_hf_files(
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    directory: str | Path,
    tokenizer_files: Optional[dict[str, str]] = None,
    dtype: torch.dtype = torch.float32,
    shard_bytes: int = 2 * 2**30,
) -> Path:
    """Write a HF directory from ``(zerotron name, tensor)`` pairs, streaming them into shards.

    At most ``shard_bytes`` of tensors are held before a shard is written, so memory stays near one
    shard plus one tensor whatever the model size. One shard is ``model.safetensors``; more are
    ``model-0000K-of-0000N.safetensors`` with ``model.safetensors.index.json``, as transformers writes.
    """
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    hf_cfg = config_to_hf(cfg)
    hf_cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    shards: list[dict[str, str]] = []  # per shard: hf name -> (later) file
    pending: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal pending, size
        if pending:
            save_file(pending, str(out / f".shard{len(shards)}.safetensors"), metadata={"format": "pt"})
            shards.append(dict.fromkeys(pending, ""))
            pending, size = {}, 0

    arch = hf_cfg["architectures"][0]
    roles = MIXTRAL_ROLES if arch == "MixtralForCausalLM" else PLAIN_ROLES
    for fused_name, fused in tensors:
        for name, tensor in split_experts(fused_name, fused, roles):  # per-expert, as save_pretrained
            t = tensor.detach().to("cpu", dtype).contiguous()
            if pending and size + t.nbytes > shard_bytes:
                flush()
            pending[to_hf_name(name, arch)] = t
            size += t.nbytes
            total += t.nbytes
    flush()
    _name_shards(out, shards, total)
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n", encoding="utf-8")
    mode = (out / "config.json").stat().st_mode & 0o777  # safetensors writes 0600; match the others
    for shard in out.glob("*.safetensors"):
        os.chmod(shard, mode)
    gen = {
        k: v
        for k, v in (("bos_token_id", cfg.bos_token_id), ("eos_token_id", cfg.eos_token_id))
        if v is not None
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")
    for name, text in (tokenizer_files or {}).items():
        (out / name).write_text(text, encoding="utf-8")
    return out
