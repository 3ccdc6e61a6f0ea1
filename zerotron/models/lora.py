"""LoRA adapters on a zerotron model, saved and read in PEFT's format.

A targeted ``nn.Linear`` becomes a :class:`LoraLinear`: the same frozen ``weight``/``bias`` (so the base
model's parameter names, checkpoints and conversions are unchanged) plus ``lora_A`` (rank x in) and
``lora_B`` (out x rank); ``y = base(x) + scaling * B(A(dropout(x)))`` with ``scaling = alpha / rank``
(``alpha / sqrt(rank)`` with rsLoRA). As PEFT initialises them: A Kaiming-uniform over the full fan-in,
B zero, so a fresh adapter leaves the model's outputs unchanged.

Target selection follows PEFT so a config means the same thing in both: ``"all-linear"`` is every linear
layer but the output head; a list names module-name suffixes (``q_proj`` matches
``model.layers.0.self_attn.q_proj``); any other string is a regular expression that must match the whole
Hugging Face module name.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from zerotron.config import LORA_NAME_LIST, LoraSection
from zerotron.config_load import ConfigError
from zerotron.models.hf import from_hf_name, to_hf_name
from zerotron.models.lora_tp import MAGNITUDE, TensorParallelLinear, attach_tp_lora
from zerotron.models.nf4 import NF4Linear, NF4ParamLinear
from zerotron.models.nf4_tp import (
    quantize_tp_layer,
    quantize_tp_layer_params,
)
from zerotron.parallel.float8 import Float8Linear, Float8Spec, float8_linear

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
DORA_MAGNITUDE = MAGNITUDE  # DoRA's per-row magnitude (PEFT's name)
# adapter_config.json settings that change what the adapter computes and that zerotron does not build
_UNBUILT_ADAPTER_KEYS = (
    "bias",
    "modules_to_save",
    "fan_in_fan_out",
    "layers_to_transform",
    "rank_pattern",
    "alpha_pattern",
)


@dataclass(frozen=True)
class LoraConfig:
    """The ``lora.*`` settings (PEFT's names in its adapter_config.json in brackets)."""

    rank: int = 8  # [r]
    alpha: float = 16.0  # [lora_alpha]
    dropout: float = 0.0  # [lora_dropout]
    target_modules: Union[str, list[str]] = "all-linear"
    use_rslora: bool = False
    use_dora: bool = False
    base_bits: int = 0  # 0: keep the base's dtype; 4: NF4 (QLoRA)
    double_quant: bool = True  # NF4 base: 8-bit block scales

    def validate(self) -> None:
        if self.rank < 1:
            raise ConfigError(f"lora.rank={self.rank}: give a rank of at least 1")
        if self.alpha <= 0:
            raise ConfigError(f"lora.alpha={self.alpha}: give a positive alpha")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout={self.dropout}: give a probability in [0, 1)")
        if self.base_bits not in (0, 4):
            raise ConfigError(f"lora.base_bits={self.base_bits}: choose 0 (the base's dtype) or 4 (NF4)")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            try:
                re.compile(self.target_modules)
            except re.error as e:
                raise ConfigError(f"lora.target_modules={self.target_modules!r} is not a regex: {e}") from e

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @classmethod
    def from_section(cls, lo: LoraSection) -> LoraConfig:
        """The ``lora.*`` section of a run's config as the adapters' settings (a comma-joined name list
        becomes a list)."""
        targets: str | list[str] = lo.target_modules
        if lo.target_modules != "all-linear" and re.fullmatch(LORA_NAME_LIST, lo.target_modules):
            targets = lo.target_modules.split(",")
        same = ("rank", "alpha", "dropout", "use_rslora", "use_dora", "base_bits", "double_quant")
        return cls(target_modules=targets, **{key: getattr(lo, key) for key in same})


def _attach(
    m: LoraLayer,
    rank: int,
    scaling: float,
    dropout: float,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
) -> None:
    """Give ``m`` (with in_features/out_features) PEFT's adapter parts, initialised."""
    m.lora_A = nn.Linear(m.in_features, rank, bias=False, device=device, dtype=dtype)
    m.lora_B = nn.Linear(rank, m.out_features, bias=False, device=device, dtype=dtype)
    m.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    m.scaling = scaling
    _init_lora(m.lora_A, m.lora_B, m.in_features, generator)


def _delta(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """The update an adapter adds to its weight: ``scaling * B @ A`` in fp32."""
    return (b.float() @ a.float()) * scaling


def _dora_norm(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """DoRA's per-output-row norm of ``W + scaling * B @ A`` (out,)."""
    norm: torch.Tensor = torch.linalg.norm(weight + scaling * (b @ a), dim=1)
    return norm


def _merge(weight: torch.Tensor, delta: torch.Tensor, magnitude: torch.Tensor | None) -> torch.Tensor:
    """The merged weight in fp32: ``W + delta``, and with DoRA's ``magnitude`` each row rescaled to it."""
    merged = weight.float() + delta
    if magnitude is None:
        return merged
    rows: torch.Tensor = magnitude.float() / torch.linalg.norm(merged, dim=1)
    return merged * rows.unsqueeze(1)


def lora_update(m: LoraLayer, x: torch.Tensor) -> torch.Tensor:
    """``scaling * B(A(dropout(x)))``."""
    update: torch.Tensor = m.lora_B(m.lora_A(m.lora_dropout(x)))
    return update * m.scaling


class _LoraParts:
    """What an adapted layer holds besides its base (set by :func:`_attach`)."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module
    scaling: float


class LoraLinear(_LoraParts, nn.Linear):
    """A frozen linear layer plus a low-rank update (see the module's docstring)."""

    def __init__(
        self,
        base: nn.Linear,
        rank: int,
        scaling: float,
        dropout: float,
        generator: torch.Generator | None = None,
        dora: bool = False,
    ) -> None:
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.float8: Float8Spec | None = getattr(base, "float8", None)  # an fp8 base stays float8
        _attach(self, rank, scaling, dropout, base.weight.device, base.weight.dtype, generator)
        self.lora_magnitude_vector: nn.Parameter | None = None
        if dora:  # DoRA: m starts as the row norms of W + s·BA (= W's: B is zero)
            with torch.no_grad():
                norm = _dora_norm(self.weight, self.lora_A.weight, self.lora_B.weight, scaling)
            self.lora_magnitude_vector = nn.Parameter(norm.to(self.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_magnitude_vector is None:
            if self.float8 is not None:
                return float8_linear(x, self.weight, self.bias, self.float8) + lora_update(self, x)
            out: torch.Tensor = super().forward(x)
            return out + lora_update(self, x)
        return _dora_forward(self, x, self.weight, self.bias, self.lora_magnitude_vector)

    def merged(self) -> nn.Linear:
        """A plain linear layer whose weight is ``W + scaling * B @ A`` (DoRA: rescaled to m per row)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        with torch.no_grad():
            delta = _delta(self.lora_A.weight, self.lora_B.weight, self.scaling)
            linear.weight = nn.Parameter(
                _merge(self.weight, delta, self.lora_magnitude_vector).to(self.weight.dtype)
            )
            if self.bias is not None:
                linear.bias = nn.Parameter(self.bias.detach().clone())
        return linear


def _dora_forward(
    m: LoraLayer, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, magnitude: torch.Tensor
) -> torch.Tensor:
    """DoRA (PEFT's form): ``m · (W + s·BA) x / ‖W + s·BA‖`` per output row, the norm a constant in
    backward (DoRA paper, 4.3), with dropout on the adapter's and the rescaled base's input."""
    norm = _dora_norm(weight, m.lora_A.weight.detach(), m.lora_B.weight.detach(), m.scaling)
    scale = magnitude / norm.detach()  # (out,)
    spec: Float8Spec | None = getattr(m, "float8", None)  # an fp8 base: its products in float8

    def linear(a: torch.Tensor) -> torch.Tensor:
        return F.linear(a, weight) if spec is None else float8_linear(a, weight, None, spec)

    base = linear(x)
    dropped = m.lora_dropout(x)
    base_dropped = base if dropped is x else linear(dropped)
    update: torch.Tensor = m.lora_B(m.lora_A(dropped))
    out = base + (scale - 1) * base_dropped + scale * update * m.scaling
    return out + bias if bias is not None else out


class QLoraLinear(_LoraParts, nn.Module):
    """QLoRA: a frozen NF4 linear layer plus a low-rank update in the input's dtype; with ``dora``,
    DoRA on the dequantised base (QDoRA, as peft runs DoRA on a bitsandbytes 4-bit layer)."""

    def __init__(
        self,
        base: NF4Linear | NF4ParamLinear,
        rank: int,
        scaling: float,
        dropout: float,
        generator: torch.Generator | None = None,
        dora: bool = False,
    ) -> None:
        super().__init__()
        self.base_layer = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.float8: Float8Spec | None = base.float8  # an fp8 base: QDoRA's products in float8 too
        meta = isinstance(base, NF4ParamLinear) and base.weight_nf4.is_meta
        _attach(self, rank, scaling, dropout, "meta" if meta else None, generator=generator)
        self.lora_magnitude_vector: nn.Parameter | None = None
        if dora and meta:  # ZeRO-3 fills it (the row norms of the dequantised W)
            self.lora_magnitude_vector = nn.Parameter(torch.empty(self.out_features, device="meta"))
        elif dora:  # m starts as the row norms of the dequantised W (B is zero)
            with torch.no_grad():
                weight = base.quantized.dequantize()
                norm = _dora_norm(weight, self.lora_A.weight, self.lora_B.weight, scaling)
            self.lora_magnitude_vector = nn.Parameter(norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_magnitude_vector is None:
            out: torch.Tensor = self.base_layer(x)
            return out + lora_update(self, x)
        weight = self.base_layer.quantized.dequantize(x.dtype)
        return _dora_forward(self, x, weight, self.base_layer.bias, self.lora_magnitude_vector)

    def merged(self) -> nn.Linear:
        """A plain linear layer: the dequantised weight plus ``scaling * B @ A`` (fp32; DoRA: each row
        rescaled to its magnitude)."""
        bias = self.base_layer.bias
        linear = nn.Linear(self.in_features, self.out_features, bias=bias is not None, device="meta")
        with torch.no_grad():
            delta = _delta(self.lora_A.weight, self.lora_B.weight, self.scaling)
            weight = _merge(self.base_layer.quantized.dequantize(), delta, self.lora_magnitude_vector)
            linear.weight = nn.Parameter(weight)
            if bias is not None:
                linear.bias = nn.Parameter(bias.detach().clone())
        return linear


LoraLayer = Union[LoraLinear, QLoraLinear]


def _init_lora(a: nn.Linear, b: nn.Linear, fan_in: int, generator: torch.Generator | None = None) -> None:
    """PEFT's initialisation: A ~ Kaiming-uniform(a=sqrt(5)) over the full fan-in, B = 0."""
    if a.weight.is_meta:
        return
    bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)) == U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    with torch.no_grad():
        a.weight.uniform_(-bound, bound, generator=generator)
        b.weight.zero_()


def _is_target(name: str, module: nn.Module, cfg: LoraConfig) -> bool:
    if type(module) not in (nn.Linear, Float8Linear) and not isinstance(module, TensorParallelLinear):
        return False
    if cfg.target_modules == "all-linear":  # as PEFT: every linear layer but the output head
        return name != "lm_head"
    if isinstance(cfg.target_modules, str):
        return re.fullmatch(cfg.target_modules, to_hf_name(name)) is not None
    return any(name == t or name.endswith("." + t) for t in cfg.target_modules)


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _generator_for(seed: int, name: str) -> torch.Generator:
    """The generator of one adapter: from the seed and the layer's name alone, so a layer's adapter is
    the same whichever layers a rank holds (pipeline stages) and in whatever order they are visited."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(to_hf_name(name).encode()))


def initial_magnitude(rows: torch.Tensor) -> torch.Tensor:
    """DoRA's initial magnitudes of a layer's output ``rows`` (of its base weight, any dtype): their norms
    in fp32 (B starts at zero), for a model built on the meta device (ZeRO-3)."""
    norm: torch.Tensor = torch.linalg.norm(rows.float(), dim=1)
    return norm


def initial_adapter(name: str, global_shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The whole initial value of adapter parameter ``name`` (``<layer>.lora_A.weight``/``lora_B``) as
    :func:`apply_lora` with ``seed`` draws it: for a model built on the meta device (ZeRO-3), whose
    units materialise their ranges from it."""
    layer, _, part = name.rpartition(".lora_")
    if part == "B.weight":
        return torch.zeros(global_shape)
    if part != "A.weight":
        raise ValueError(f"{name}: not a LoRA A/B weight")
    bound = 1.0 / math.sqrt(global_shape[1])
    return torch.empty(global_shape).uniform_(-bound, bound, generator=_generator_for(seed, layer))


def apply_lora(
    model: nn.Module, cfg: LoraConfig, generator: torch.Generator | None = None, seed: int | None = None
) -> list[str]:
    """Freeze ``model`` and put an adapter on each targeted linear layer; return their names.

    ``seed``: each adapter drawn from its own generator (:func:`_generator_for`), the same on every
    layout; otherwise ``generator`` draws them in module order.

    With ``base_bits=4`` every linear layer but ``lm_head`` is stored in NF4 (as QLoRA loads a base
    model), the targeted ones under their adapters. Raises ConfigError when nothing matches (a typo in
    ``lora.target_modules`` would otherwise train nothing).
    """
    cfg.validate()
    split = any(isinstance(m, TensorParallelLinear) and m.group.size > 1 for m in model.modules())
    if split and cfg.dropout > 0 and cfg.use_dora:
        raise ConfigError(
            "DoRA with lora.dropout > 0 on a tensor-parallel model is not built yet; use lora.dropout=0, "
            "or parallel.tp=1"
        )
    meta = any(p.is_meta for p in model.parameters())  # ZeRO-3 fills it: an NF4 base as byte parameters
    names = [n for n, m in model.named_modules() if _is_target(n, m, cfg)]
    if not names:
        raise ConfigError(
            f"lora.target_modules={cfg.target_modules!r} matches no linear layer of the model; "
            "name module suffixes such as q_proj,v_proj, or use all-linear"
        )
    others = [
        n
        for n, m in model.named_modules()
        if (type(m) in (nn.Linear, Float8Linear) or isinstance(m, TensorParallelLinear))
        and n not in names
        and n != "lm_head"
    ]
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        base = model.get_submodule(name)
        g = _generator_for(seed, name) if seed is not None else generator
        if isinstance(base, TensorParallelLinear):  # this rank's part, the single process's values
            if cfg.base_bits == 4:
                _quantize_tp(base, name, cfg.double_quant, meta)
            attach_tp_lora(base, cfg.rank, cfg.scaling, g, dora=cfg.use_dora, dropout=cfg.dropout)
            continue
        assert isinstance(base, nn.Linear)
        lora: LoraLayer
        if cfg.base_bits == 4:
            nf4 = _nf4_layer(base, cfg.double_quant, meta)
            lora = QLoraLinear(nf4, cfg.rank, cfg.scaling, cfg.dropout, g, dora=cfg.use_dora)
        else:
            lora = LoraLinear(base, cfg.rank, cfg.scaling, cfg.dropout, g, dora=cfg.use_dora)
        _set(model, name, lora)
    if cfg.base_bits == 4:
        for name in others:
            linear = model.get_submodule(name)
            if isinstance(linear, TensorParallelLinear):
                _quantize_tp(linear, name, cfg.double_quant, meta)
                continue
            assert isinstance(linear, nn.Linear)
            _set(model, name, _nf4_layer(linear, cfg.double_quant, meta))
    return names


def _quantize_tp(module: Any, name: str, double: bool, meta: bool) -> None:
    """A tensor-parallel layer's base in NF4: quantised now (collective over tp), or on a meta-device
    model byte parameters of its shard that ZeRO-3 fills."""
    if meta:
        quantize_tp_layer_params(module, name)
    else:
        quantize_tp_layer(module, name, double)


def _nf4_layer(linear: nn.Linear, double: bool, meta: bool) -> NF4Linear | NF4ParamLinear:
    """The NF4 form of a frozen linear layer: quantised now, or on a meta-device model (ZeRO-3) codes and
    scales as parameters that ZeRO-3 shards and fills (:func:`quantized_bytes`)."""
    if not meta:
        return NF4Linear(linear, double=double)
    layer = NF4ParamLinear(linear.in_features, linear.out_features, linear.bias is not None)
    layer.float8 = getattr(linear, "float8", None)  # an fp8 model's: the product in float8
    return layer


def lora_modules(model: nn.Module) -> dict[str, Any]:
    """The adapted layers by name: LoRA/QLoRA layers, and tensor-parallel layers with adapters."""
    return {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, (LoraLinear, QLoraLinear))
        or (isinstance(m, TensorParallelLinear) and hasattr(m, "lora_A"))
    }


def merge_lora(model: nn.Module) -> int:
    """Fold every adapter into its base weight (in place); return how many were merged."""
    found = {n: m for n, m in lora_modules(model).items() if isinstance(m, (LoraLinear, QLoraLinear))}
    if len(found) < len(lora_modules(model)):
        raise ConfigError("merging adapters of a tensor-parallel model is not built; merge the saved adapter")
    for name, module in found.items():
        _set(model, name, module.merged())
    return len(found)


def adapter_state_dict(
    model: nn.Module, full: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's key names (``base_model.model.<hf module>.lora_A.weight``); ``full``
    gives every adapter's whole tensors by parameter name in place of this rank's (gathered over tp and
    pipeline stages)."""
    out: dict[str, torch.Tensor] = {}
    modules = lora_modules(model)
    for name in _adapted_names(model, full):
        hf = to_hf_name(name)
        for part in ("lora_A", "lora_B"):
            key = f"{name}.{part}.weight"
            tensor = full[key] if full is not None else getattr(modules[name], part).weight
            out[f"{PEFT_PREFIX}{hf}.{part}.weight"] = tensor.detach().contiguous()
        key = f"{name}.{DORA_MAGNITUDE}"
        magnitude = full.get(key) if full is not None else getattr(modules[name], DORA_MAGNITUDE, None)
        if magnitude is not None:
            out[f"{PEFT_PREFIX}{hf}.{DORA_MAGNITUDE}"] = magnitude.detach().contiguous()
    return out


def _adapted_names(model: nn.Module, full: Mapping[str, torch.Tensor] | None) -> list[str]:
    if full is None:
        return list(lora_modules(model))
    return sorted({key.rsplit(".lora_", 1)[0] for key in full})


def _target_list(cfg: LoraConfig, names: list[str]) -> Union[str, list[str]]:
    if isinstance(cfg.target_modules, str):
        return cfg.target_modules
    return sorted({n.rsplit(".", 1)[-1] for n in names})


def save_adapter(
    model: nn.Module,
    cfg: LoraConfig,
    directory: str | Path,
    base_model: str = "",
    full: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` that ``peft`` loads.

    Both files are written into a sibling folder first and swapped in whole, so a crash leaves the
    previous adapter in ``directory`` intact.
    """
    out = Path(directory)
    names = _adapted_names(model, full)
    if not names:
        raise ConfigError("the model has no LoRA adapters to save")
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model or None,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": _target_list(cfg, names),
        "use_rslora": cfg.use_rslora,
        "use_dora": cfg.use_dora,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    tmp, old = out.with_name(f".{out.name}.tmp"), out.with_name(f".{out.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: v.cpu() for k, v in adapter_state_dict(model, full).items()}
    save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def read_adapter_config(directory: str | Path) -> LoraConfig:
    """The LoraConfig of a PEFT adapter directory (ours or PEFT's)."""
    path = Path(directory) / ADAPTER_CONFIG
    if not path.is_file():
        raise ConfigError(
            f"{path} not found: an adapter directory holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}"
        )
    raw = json.loads(path.read_text())
    if raw.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{path}: peft_type={raw.get('peft_type')!r}; only LORA adapters are read")
    unbuilt = [k for k in _UNBUILT_ADAPTER_KEYS if raw.get(k) not in (None, False, "none", {}, [])]
    if unbuilt:
        raise ConfigError(
            f"{path}: {', '.join(f'{k}={raw[k]!r}' for k in unbuilt)} is not read yet; "
            "only plain LoRA adapters (bias none, no extra trained modules) are"
        )
    targets = raw.get("target_modules") or "all-linear"
    return LoraConfig(
        rank=int(raw["r"]),
        alpha=float(raw.get("lora_alpha", raw["r"])),
        dropout=float(raw.get("lora_dropout", 0.0)),
        target_modules=targets if isinstance(targets, str) else list(targets),
        use_rslora=bool(raw.get("use_rslora", False)),
        use_dora=bool(raw.get("use_dora", False)),
    )


def _adapter_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """An adapter's tensors under PEFT's saved names (an adapter name such as ``.default.`` dropped)."""
    tensors = load_file(str(Path(directory) / ADAPTER_WEIGHTS))
    return {k.replace(".default.", "."): v for k, v in tensors.items()}


def load_adapter(model: nn.Module, directory: str | Path) -> LoraConfig:
    """Put the adapters of a PEFT directory on ``model`` (which gets them if it has none yet)."""
    cfg = read_adapter_config(directory)
    if not lora_modules(model):
        apply_lora(model, cfg)
    tensors = _adapter_tensors(directory)
    expected = adapter_state_dict(model)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ConfigError(f"{directory}: the adapter lacks {len(missing)} tensors, e.g. {missing[0]}")
    with torch.no_grad():
        for name, module in lora_modules(model).items():
            hf = PEFT_PREFIX + to_hf_name(name)
            for part in ("lora_A", "lora_B"):
                getattr(module, part).weight.copy_(tensors[f"{hf}.{part}.weight"])
            if getattr(module, DORA_MAGNITUDE, None) is not None:
                getattr(module, DORA_MAGNITUDE).copy_(tensors[f"{hf}.{DORA_MAGNITUDE}"])
    return cfg


def merge_adapter_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], directory: str | Path
) -> Iterator[tuple[str, torch.Tensor]]:
    """Weights (zerotron names) with a PEFT adapter folded in: ``W + scaling * B @ A`` (fp32), one
    tensor at a time. Raises ConfigError if a module the adapter names is not among the weights."""
    cfg = read_adapter_config(directory)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in _adapter_tensors(directory).items():
        module, _, part = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if part == "magnitude_vector":  # DoRA
            pairs.setdefault(from_hf_name(module), {})["m"] = value
            continue
        if part not in ("A.weight", "B.weight"):
            raise ConfigError(
                f"{directory}: {key} is not a lora_A/lora_B weight; only LoRA adapters are merged"
            )
        pairs.setdefault(from_hf_name(module), {})[part[0]] = value
    for name, tensor in tensors:
        found = pairs.pop(name.removesuffix(".weight"), None) if name.endswith(".weight") else None
        if found is not None:
            delta = _delta(found["A"], found["B"], cfg.scaling)
            if delta.shape != tensor.shape:
                raise ConfigError(
                    f"{directory}: the adapter of {name} is {tuple(delta.shape)}, the weight "
                    f"{tuple(tensor.shape)}; was it trained on this model?"
                )
            tensor = _merge(tensor, delta, found.get("m")).to(tensor.dtype)
        yield name, tensor
    if pairs:
        raise ConfigError(
            f"{directory}: the model has no {sorted(pairs)[0]}.weight; was it trained on this model?"
        )
