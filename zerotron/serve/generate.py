"""Autoregressive generation with a preallocated KV cache: prefill once, then one token per step.

:func:`generate` works on any :class:`~zerotron.models.llama.LlamaForCausalLM` and returns the new ids
with timings; :func:`run_generate` is ``zerotron generate``: load a model file, optionally apply its chat
template, and stream the decoded text as tokens arrive.

Tensor-parallel generation (``zerotron generate --nproc N parallel.tp=N``): every rank holds its shard
of the model (:mod:`zerotron.parallel.tensor`) and a KV cache of its own KV heads; each step's logits
of the last position are all-gathered over the vocabulary, the group's first rank picks the token and
broadcasts it, and only global rank 0 prints.
"""

from __future__ import annotations

import dataclasses
import io
import sys
import time
from collections.abc import Callable
from typing import Any, Optional, TextIO

import torch

from zerotron.distributed import collectives
from zerotron.distributed.mesh import Group, Mesh
from zerotron.models.llama import KVCache, LlamaForCausalLM
from zerotron.models.loading import ModelLoadError, load_pretrained
from zerotron.parallel.tensor_comm import gather_last_dim
from zerotron.serve.sampling import SamplingParams, filter_logits


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: Optional[torch.Generator]
) -> int:
    """One token id from logits (V,): greedy at temperature 0, else top-k / nucleus (top-p) sampling."""
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    probs = torch.softmax(filter_logits(logits.float(), params), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.inference_mode()
def generate(
    model: LlamaForCausalLM,
    tokenizer: Any,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: Optional[int] = None,
    stop_ids: Optional[list[int]] = None,
    on_token: Optional[Callable[[int], None]] = None,
    tp_group: Optional[Group] = None,
    agree_group: Optional[Group] = None,
) -> dict[str, Any]:
    """Continue ``prompt_ids`` by up to ``max_new_tokens`` tokens (batch of one).

    Args:
        model: a LlamaForCausalLM (its dtype and device are used for the cache).
        tokenizer: supplies the default ``stop_ids`` (its EOS); may be None.
        temperature: 0 is greedy; otherwise sampling with ``top_k`` (0: off) and ``top_p`` (1: off).
        seed: seeds the sampling generator (None: nondeterministic).
        stop_ids: generation ends after emitting one of these (default: the tokenizer's EOS).
        on_token: called with each new id as soon as it is chosen (streaming).
        tp_group: the tensor-parallel group when ``model`` is a tensor-parallel shard (every rank of
            the group calls this with the same arguments).
        agree_group: the ranks that must emit the same tokens (default ``tp_group``): under ZeRO-3 every
            data-parallel rank runs the same forwards, so they all take the first rank's choice.

    Returns:
        ``{"ids": new ids (stop id included), "prompt_tokens", "new_tokens", "prefill_s", "decode_s",
        "prefill_tokens_per_s", "decode_tokens_per_s"}``. Decode covers the steps after the first new
        token (the prefill produces that one).
    """
    if not prompt_ids:
        raise ValueError("generate: the prompt is empty; give at least one token (e.g. BOS)")
    if stop_ids is None:
        stop_ids = list(getattr(tokenizer, "stop_ids", []) or [])
    stops = set(stop_ids)
    param = next(model.parameters())
    generator = None
    if temperature > 0.0:
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed) if seed is not None else generator.seed()
    cfg = model.config
    if tp_group is not None and tp_group.size > 1:  # this rank's KV heads only
        local_kv_heads = int(getattr(model.layers[0].self_attn, "kv_heads"))  # noqa: B009 - set by the plan
        cfg = dataclasses.replace(cfg, num_key_value_heads=local_kv_heads)
    cache = KVCache(cfg, 1, len(prompt_ids) + max_new_tokens, dtype=param.dtype, device=param.device)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=param.device)  # (1, s)
    step_input = torch.empty((1, 1), dtype=torch.long, device=param.device)  # reused every decode step

    t0 = time.perf_counter()
    logits = _whole_logits(model(ids, kv_cache=cache, logits_to_keep=1)[0, -1], tp_group)  # (V,)
    out: list[int] = []
    t1 = time.perf_counter()
    for _ in range(max_new_tokens):
        token = sample_next(
            logits.cpu() if generator is not None else logits, temperature, top_k, top_p, generator
        )
        token = _agree(token, agree_group or tp_group, param.device)
        out.append(token)
        if on_token is not None:
            on_token(token)
        if token in stops or len(out) == max_new_tokens:
            break
        step_input.fill_(token)
        logits = _whole_logits(model(step_input, kv_cache=cache)[0, -1], tp_group)  # (V,)
    t2 = time.perf_counter()
    prefill_s, decode_s = t1 - t0, t2 - t1
    steps = max(len(out) - 1, 0)
    return {
        "ids": out,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": len(out),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "prefill_tokens_per_s": len(prompt_ids) / prefill_s if prefill_s > 0 else float("inf"),
        "decode_tokens_per_s": steps / decode_s if decode_s > 0 and steps else 0.0,
    }


def _whole_logits(logits: torch.Tensor, tp_group: Optional[Group]) -> torch.Tensor:
    """(V/t,) vocabulary shard -> (V,) on every rank of the group (unchanged without one)."""
    return logits if tp_group is None else gather_last_dim(logits, tp_group)


def _agree(token: int, tp_group: Optional[Group], device: torch.device) -> int:
    """The token chosen by the group's first rank (sampling may differ between ranks)."""
    if tp_group is None or tp_group.size == 1:
        return token
    t = torch.tensor([token], dtype=torch.long, device=device)
    collectives.broadcast(t, tp_group.ranks[0], tp_group)
    return int(t)


class TextStream:
    """Prints the growth of the decoded text, so multi-token characters and BPE pieces appear whole."""

    def __init__(self, tokenizer: Any, out: TextIO) -> None:
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, token: int) -> None:
        """Add one id and print what became final."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an unfinished UTF-8 sequence: wait for its remaining bytes
            return
        self._emit(text)

    def flush(self) -> None:
        """Print whatever is left (even a dangling partial character)."""
        self._emit(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _emit(self, text: str) -> None:
        if len(text) > self.printed:
            self.out.write(text[self.printed :])
            self.out.flush()
            self.printed = len(text)


def model_config(path: str) -> Any:
    """The architecture at ``path``: a HF directory, a GGUF file, or a zerotron checkpoint or run."""
    from pathlib import Path

    from zerotron.checkpoint import store
    from zerotron.config import ModelConfig
    from zerotron.models.loading import read_model_config

    try:
        ckpt = store.checkpoint_dir(Path(path)) if Path(path).is_dir() else None
    except store.CheckpointError as e:
        raise ModelLoadError(str(e)) from e
    if ckpt is None:
        return read_model_config(path)
    return ModelConfig(**store.read_json(ckpt / "trainer.json")["config"]["model"])


def check_options(model_path: str, tp: int, options: dict[str, Any]) -> None:
    """Every generate option in range and ``tp`` able to split the model: one-line errors before any rank."""
    from zerotron.config import Config
    from zerotron.config_check import check_tensor_parallel
    from zerotron.config_load import ConfigError

    checks = [
        ("--max-new-tokens", options["max_new_tokens"] >= 1, "at least 1"),
        ("--temperature", options["temperature"] >= 0, ">= 0 (0 is greedy)"),
        ("--top-k", options["top_k"] >= 0, ">= 0 (0 keeps every token)"),
        ("--top-p", 0 < options["top_p"] <= 1, "in (0, 1] (1 keeps every token)"),
    ]
    for flag, ok, what in checks:
        value = options[flag[2:].replace("-", "_")]
        if not ok or value != value:  # NaN fails every comparison
            raise ConfigError(f"{flag} {value}: must be {what}")
    cfg = Config(model=model_config(model_path))
    cfg.parallel.tp = tp
    check_tensor_parallel(cfg)


def check_device(command: str, device: str, nproc: int) -> torch.device:
    """``--device`` of generate/serve as a torch device, or a one-line error: a CUDA device must exist
    here; with ``nproc`` > 1 tensor-parallel ranks each take one: on the CPU they talk over Gloo, on
    CUDA over NCCL with rank ``LOCAL_RANK`` on ``cuda:LOCAL_RANK`` (:func:`rank_device`), so the
    machine needs a device per local rank and ``--device`` names no index."""
    import os

    from zerotron.config_load import ConfigError

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"{command} --device {device!r}: not a device; use cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"{command} --device {device}: runs on cpu or cuda[:N]")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(
                f"{command} --device {device}: this machine has no CUDA device; leave --device out"
            )
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"{command} --device {device}: this machine has {count} CUDA device(s)")
        if nproc > 1 and dev.index is not None:
            raise ConfigError(
                f"{command} --device {device} with --nproc {nproc}: each tensor-parallel rank takes the "
                "device of its local rank (cuda:LOCAL_RANK); pass --device cuda"
            )
        local = int(os.environ.get("LOCAL_WORLD_SIZE", nproc))  # a torchrun job's ranks on this node
        if nproc > 1 and local > count:
            raise ConfigError(
                f"{command} --device cuda --nproc {local}: this machine has {count} CUDA device(s) and "
                f"each tensor-parallel rank needs one of its own; use --nproc {count} or fewer"
            )
    return dev


def rank_backend(device: str) -> str:
    """The process-group backend of tensor-parallel generate/serve ranks on ``device``: NCCL for CUDA,
    Gloo for the CPU (also on a machine that has GPUs, where ``auto`` would pick NCCL)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: str) -> str:
    """This rank's device for ``device``: on CUDA the one :func:`~zerotron.distributed.launch.init_distributed`
    made current (``cuda:LOCAL_RANK``); the CPU as it is."""
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return device


def load_model(
    path: str, dtype: torch.dtype, device: str, mesh: Optional[Mesh] = None
) -> tuple[LlamaForCausalLM, Any]:
    """Model and tokenizer from a HF directory, a GGUF file, or a zerotron checkpoint or run directory.

    With a ``mesh`` of tensor parallelism this rank's shard only (:func:`load_shard`)."""
    from pathlib import Path

    from zerotron.checkpoint.convert import open_source
    from zerotron.models.loading import build_from_state

    if mesh is not None and mesh.dims.tp > 1:
        from zerotron.models.gguf import read_once

        with read_once(path):  # a GGUF file's metadata parsed once for config, weights and tokenizer
            return load_shard(path, dtype, device, mesh), load_tokenizer_of(path)
    if Path(path).is_dir() and not (Path(path) / "config.json").is_file():
        cfg, tensors, tokenizer = open_source(Path(path))  # a checkpoint or run: whole tensors by name
        return build_from_state(cfg, dict(tensors), path, dtype, device), tokenizer
    return load_pretrained(path, dtype=dtype, device=device)


def load_shard(path: str, dtype: torch.dtype, device: str, mesh: Mesh) -> LlamaForCausalLM:
    """This rank's tensor-parallel shard of the model at ``path`` in ``dtype`` on ``device``, laid out
    by the one parallelize path on the meta device and materialised box by box from its weight source
    (DESIGN contract 4, as training builds it): a rank reads and holds its shard plus one tensor at a
    time, never the whole model."""
    from zerotron.config import Config
    from zerotron.models.loading import cast_parameters
    from zerotron.models.parallelize import parallelize_llama
    from zerotron.parallel.placement import materialize
    from zerotron.train.run import resolve_model
    from zerotron.train.state import model_placements
    from zerotron.train.trainer import weight_source

    cfg = Config()
    cfg.model.path = path
    cfg = resolve_model(cfg)  # the architecture read from the file or checkpoint
    cfg.model.path = path  # where the weights come from (a file's config does not name it)
    cfg.parallel.tp = mesh.dims.tp
    model = parallelize_llama(cfg, mesh)
    assert isinstance(model, LlamaForCausalLM)
    cast_parameters(model, dtype)  # on the meta device: each box is cast as it is materialised
    with weight_source(cfg, model) as source:
        materialize(model, source.box, device, model_placements(model, mesh.dims.tp))
    return model.eval()


def load_tokenizer_of(path: str) -> Any:
    """The tokenizer of the model at ``path`` (None when it has none), without reading its weights."""
    from pathlib import Path

    from zerotron.checkpoint import store
    from zerotron.checkpoint.convert import checkpoint_tokenizer
    from zerotron.models.tokenizer import HFTokenizer

    p = Path(path)
    ckpt = store.checkpoint_dir(p, hashes=False) if p.is_dir() else None
    if ckpt is not None:
        return checkpoint_tokenizer(ckpt)
    if p.suffix == ".gguf":
        from zerotron.models.gguf import open_gguf

        reader = open_gguf(p)
        return HFTokenizer.from_gguf(reader, p) if "tokenizer.ggml.tokens" in reader.fields else None
    return HFTokenizer.from_file(p / "tokenizer.json") if (p / "tokenizer.json").is_file() else None


def run_generate(
    model_path: str,
    prompt: str,
    chat: bool = False,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    out: TextIO = sys.stdout,
    stats: Optional[TextIO] = sys.stderr,
    mesh: Optional[Mesh] = None,
) -> dict[str, Any]:
    """``zerotron generate``: load ``model_path`` (HF directory, GGUF, zerotron checkpoint or run), stream the continuation to ``out``.

    With ``chat``, the prompt becomes one user message rendered by the model's chat template. Timings
    go to ``stats`` (None: silent). Returns :func:`generate`'s dict plus ``"text"``. With a ``mesh`` of
    tensor parallelism (every rank of it calls this), each rank loads its shard (:func:`load_shard`)
    and only the group's first rank prints.
    """
    model, tokenizer = load_model(model_path, dtype=dtype, device=device, mesh=mesh)
    tp_group = mesh.group("tp") if mesh is not None and mesh.dims.tp > 1 else None
    if tp_group is not None and tp_group.rank_in_group != 0:
        out, stats = io.StringIO(), None
    if tokenizer is None:
        raise ModelLoadError(
            f"{model_path}: the model has no tokenizer (tokenizer.json); cannot encode a prompt"
        )
    if chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True
        )
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt_ids = tokenizer.encode(prompt)
    stream = TextStream(tokenizer, out)
    result = generate(
        model,
        tokenizer,
        prompt_ids,
        max_new_tokens,
        temperature,
        top_k,
        top_p,
        seed,
        on_token=stream,
        tp_group=tp_group,
    )
    stream.flush()
    out.write("\n")
    result["text"] = tokenizer.decode(result["ids"], skip_special_tokens=True)
    if stats is not None:
        stats.write(
            f"prefill {result['prompt_tokens']} tokens at {result['prefill_tokens_per_s']:.1f} tok/s, "
            f"decode {result['new_tokens']} tokens at {result['decode_tokens_per_s']:.1f} tok/s\n"
        )
    return result


def generate_worker(model_path: str, prompt: str, options: dict[str, Any]) -> dict[str, Any]:
    """Body of one rank of ``zerotron generate --nproc N parallel.tp=N``: all ranks form one TP group
    (on CUDA each rank on its local rank's device)."""
    from zerotron.distributed.launch import current_rank_and_world
    from zerotron.distributed.mesh import ParallelDims

    rank, world = current_rank_and_world()
    mesh = ParallelDims(world, dp=1, tp=world).build(rank)
    options = {**options, "device": rank_device(options.get("device", "cpu"))}
    result = run_generate(model_path, prompt, mesh=mesh, **options)
    return {"ids": result["ids"], "text": result["text"]} if rank == 0 else {}
