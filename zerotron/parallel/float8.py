"""FP8 training (``train.precision=fp8``): the blocks' linears multiply in float8, with the single
process's scales on every layout.

The casts and GEMMs are torchao's (``torchao.float8``: ``Float8LinearConfig.from_recipe_name``, its
float8 tensor and ``torch._scaled_mm`` on GPUs that have float8 GEMMs, its fp32 emulation elsewhere),
recipe ``tensorwise`` (e4m3 forward, e5m2 gradients, one dynamic scale per tensor) or ``rowwise``
(e4m3 throughout, one power-of-two scale per row of the contracted axis). Everything else computes in
bf16 under autocast; the fp32 masters and AdamW moments are unchanged (DESIGN contract 9). Layers
converted: the attention and MLP projections of the transformer blocks (``q/k/v/o_proj``,
``gate/up/down_proj``, a MoE block's shared expert included; the routed experts' GEMMs are cast the
same way by :mod:`zerotron.parallel.float8_experts`); the embedding, the head, routers and norms stay
bf16. ``train.fp8_skip`` keeps more of them in bf16 (``fnmatch`` patterns on module names).

**An fp8 scale belongs to the whole tensor of one micro-batch, not to a shard** (layout invariance):
torchao computes each amax on the tensor it sees; here each of the three operands of a linear names
which of its axes other ranks hold pieces of —

- ``x`` (tokens, in) and the output gradient (tokens, out): the tokens of one micro-batch are split
  over context parallelism;
- the weight (in, out): a row-parallel layer splits ``in`` over tensor parallelism, a column-parallel
  one ``out`` (as do its input gradient's ``out`` and its output gradient's);

and the amax behind a scale is all-reduced (max, through :mod:`zerotron.distributed.collectives`) over
the groups that split the axes it is taken over: every axis for a tensorwise scale, the contracted axis
for a rowwise one. So tensor parallelism, sequence parallelism, context parallelism, pipelines, ZeRO-3
(which gathers whole weights) and data parallelism (one micro-batch per forward, as in the single
process with accumulation) all multiply with the single process's scales. What differs is only the
summation order of the split GEMMs, as in bf16.

Casts start from the autocast dtype (the bf16 working weights ZeRO-3 gathers are the fp32 masters
rounded once), so a single process with fp32 parameters and a ZeRO-3 rank with bf16 working copies cast
the same bits.

**ZeRO-3's float8 gathers** (``parallel.zero_fp8_gather``, tensorwise only): a unit of float8 weights
is cast before its all-gather instead of after it. Each rank takes the amax of every weight's part of
its bf16 shard, the ranks agree on each weight's whole amax (max over the shard group, then over the
tensor-parallel group as above), and each rank casts its part with that scale
(:func:`cast_weight_shard`): the gather moves float8 bytes, half of bf16's, and every rank ends up with
the very float8 values (and scales) that casting the whole gathered weight would give. The layer then
multiplies with them (:data:`GATHERED`, :func:`gathered_weight`) in its forward and, a tensorwise
recipe casting the weight alike for the input gradient, in its backward. Routed experts' stacked
weights are gathered alike, each expert with its own scale (:func:`weight_parts`). Rowwise casts the
weight along a different axis for each GEMM (two float8 copies would move as many bytes as bf16), so
it gathers bf16, as torchao's float8 all-gather for FSDP2 does.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any, cast

import torch
from torch import nn

from zerotron.distributed import collectives
from zerotron.distributed.mesh import Group
from zerotron.shapes import FLOAT8_TARGETS

RECIPES = ("tensorwise", "rowwise")
TARGETS = FLOAT8_TARGETS

# the three operands' axes, by name: which groups split each
X_AXES, W_AXES, G_AXES = ("tokens", "in"), ("in", "out"), ("tokens", "out")

# the attribute a ZeRO-3 parameter gathered as float8 carries: a call giving its float8 weight now
GATHERED = "_zerotron_float8_gathered"


_AO: SimpleNamespace | None = None


def _ao() -> SimpleNamespace:
    """torchao's pieces the casts use, resolved once (the casts run on the training step's hot path).
    A plain global, not ``functools.cache``: ``torch.compile`` traces through a cache wrapper into the
    resolution, whose logging calls break the graph at every cast (a compiled float8 block ran as
    dozens of small graphs, slower than eager)."""
    global _AO
    if _AO is None:
        _AO = _resolve_ao()
    return _AO


def _resolve_ao() -> SimpleNamespace:
    torchao_float8()
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_training_tensor import (
        Float8TrainingTensor,
        GemmInputRole,
        hp_tensor_and_scale_to_float8,
    )
    from torchao.float8.float8_utils import amax_to_scale

    tensorwise = ScalingGranularity.TENSORWISE
    return SimpleNamespace(
        role=GemmInputRole,
        tensorwise=tensorwise,
        to_float8=hp_tensor_and_scale_to_float8,
        scale=amax_to_scale,
        tensor=Float8TrainingTensor,
    )


def torchao_float8() -> Any:
    """torchao's float8 package (imported on first use; its notices about CUDA-only kernels silenced)."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # torchao registers enums the old way
    import torchao.float8 as float8

    return float8


def device_has_float8_gemm(device: torch.device) -> bool:
    """Whether ``device`` multiplies float8 natively (CUDA compute capability 8.9 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@dataclass(frozen=True)
class Float8Spec:
    """One linear's float8 recipe and the groups that split its axes.

    ``config``: torchao's ``Float8LinearConfig``; ``mm``: its ``LinearMMConfig`` (emulated or not);
    ``tokens`` / ``inner`` / ``outer``: the groups holding other pieces of the token, in-feature and
    out-feature axes."""

    config: Any
    mm: Any
    tokens: tuple[Group, ...] = ()
    inner: tuple[Group, ...] = ()
    outer: tuple[Group, ...] = ()

    @classmethod
    def create(cls, recipe: str, emulate: bool, pad: bool = False, **groups: tuple[Group, ...]) -> Float8Spec:
        """The spec of ``recipe`` (``tensorwise`` or ``rowwise``); ``emulate``: fp32 GEMMs on the
        float8 values (CPUs, GPUs without float8 GEMMs); ``pad``: zero-pad each GEMM's contracted
        dimension to the multiple of 16 float8 GEMMs take (an expert's rows, which the weight gradient
        contracts, come in any number)."""
        if recipe not in RECIPES:
            raise ValueError(f"train.fp8_recipe={recipe!r}: use one of {', '.join(RECIPES)}")
        f8 = torchao_float8()
        _ao()  # resolved here, outside any compiled region (see _ao)
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

        config = f8.Float8LinearConfig.from_recipe_name(recipe)
        gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
        mm = LinearMMConfig(
            *(ScaledMMConfig(emulate, g.use_fast_accum, False, config.pad_inner_dim or pad) for g in gemms)
        )
        return cls(config, mm, **groups)

    def groups(self, axes: tuple[str, ...]) -> list[Group]:
        """The groups splitting any of ``axes`` (``tokens``, ``in``, ``out``)."""
        by_axis = {"tokens": self.tokens, "in": self.inner, "out": self.outer}
        return [g for axis in axes for g in by_axis[axis] if g.size > 1]


def _cast(t: torch.Tensor, axes: tuple[str, str], how: Any, role: Any, dim: int, spec: Float8Spec) -> Any:
    """``t`` (2-D) as torchao's float8 tensor for GEMM ``role``, its amax taken over the whole tensor
    (tensorwise) or along ``dim`` (rowwise) and reduced over the ranks holding the rest of it."""
    ao = _ao()
    axis: int | None
    if how.scaling_granularity is ao.tensorwise:
        amax, axis, groups = torch.max(torch.abs(t)), None, spec.groups(axes)
    else:
        amax, axis = torch.amax(torch.abs(t), dim=dim, keepdim=True), dim
        groups = spec.groups((axes[dim],))
    for group in groups:  # a few bytes for ranks to agree on one scale: counted apart from data traffic
        collectives.all_reduce(amax, group, "max", kind="control")
    scale = ao.scale(amax, how.target_dtype, spec.config.round_scales_to_power_of_2)
    return ao.to_float8(t, scale, how.target_dtype, spec.mm, role, axis)


class _Float8Matmul(torch.autograd.Function):
    """``x @ w_t`` (2-D) with torchao's three float8 GEMMs (forward, input gradient, weight gradient),
    each operand cast with its whole tensor's scale. With ``gathered`` (ZeRO-3 gathered the weight as
    float8) ``w_t`` is the weight parameter itself, (out, in), only for its gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w_t: torch.Tensor | None,
        spec: Float8Spec,
        gathered: Any = None,
        dequantize: Any = None,
    ) -> torch.Tensor:
        role, c = _ao().role, spec.config
        # a weight ZeRO-3 gathered as float8 (``gathered``: its float8 copy now) is not saved: backward
        # asks for the copy again, gathered again by then; nor is a frozen NF4 base's dequantised weight
        # (``dequantize``: makes it again), as QLoRA keeps only 4-bit weights until backward
        again = gathered is not None or dequantize is not None
        ctx.save_for_backward(x, *(() if again else (w_t,)))
        ctx.spec, ctx.gathered, ctx.dequantize = spec, gathered, dequantize
        x8 = _cast(x, X_AXES, c.cast_config_input, role.INPUT, -1, spec)
        if gathered is not None:
            w8 = gathered().t()  # (in, out), laid out as the cast below would lay it out
        else:
            w = dequantize().t() if dequantize is not None else w_t
            assert w is not None
            w8 = _cast(w, W_AXES, c.cast_config_weight, role.WEIGHT, 0, spec)
        return torch.mm(x8, w8)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None, None, None]:
        role, c = _ao().role, ctx.spec.config
        x, *saved = ctx.saved_tensors
        spec: Float8Spec = ctx.spec
        grad = grad.contiguous()
        g8 = _cast(grad, G_AXES, c.cast_config_grad_output, role.GRAD_OUTPUT, -1, spec)
        if ctx.gathered is not None:  # tensorwise: the input gradient's weight cast is the forward's
            grad_x = torch.mm(g8, ctx.gathered())
        else:
            w = ctx.dequantize().t() if ctx.dequantize is not None else saved[0]
            w8 = _cast(w, W_AXES, c.cast_config_weight_for_grad_input, role.WEIGHT, -1, spec)
            grad_x = torch.mm(g8, w8.t())
        if not ctx.needs_input_grad[1]:  # a frozen base (LoRA)
            return grad_x, None, None, None, None
        # tensorwise: both GEMMs take the same cast of the output gradient (one amax reduction, not two)
        same = c.cast_config_grad_output_for_grad_weight == c.cast_config_grad_output
        reuse = g8 if same and c.cast_config_grad_output.scaling_granularity is _ao().tensorwise else None
        grad_w = _weight_grad(x, grad, spec, reuse)  # (out, in)
        return grad_x, grad_w if ctx.gathered is not None else grad_w.t(), None, None, None


def _weight_grad(x: torch.Tensor, grad: torch.Tensor, spec: Float8Spec, g8: Any = None) -> torch.Tensor:
    """The weight gradient GEMM ``gradᵀ x`` (2-D operands) in float8: (out, in); ``g8``: the output
    gradient already cast as this GEMM casts it."""
    role, c = _ao().role, spec.config
    if g8 is None:
        g8 = _cast(grad, G_AXES, c.cast_config_grad_output_for_grad_weight, role.GRAD_OUTPUT, 0, spec)
    x8 = _cast(x, X_AXES, c.cast_config_input_for_grad_weight, role.INPUT, 0, spec)
    return torch.mm(g8.t(), x8)


def float8_weight_grad(x: torch.Tensor, grad: torch.Tensor, spec: Float8Spec) -> torch.Tensor:
    """The weight gradient :func:`float8_linear`'s backward computes, from the layer's input ``x`` and
    its output gradient ``grad`` (any leading dims), for a schedule that defers it (zero-bubble's BW)."""
    with torch.autocast(x.device.type, enabled=False):
        flat_g = grad.reshape(-1, grad.shape[-1]).contiguous()
        return _weight_grad(x.to(grad.dtype).reshape(-1, x.shape[-1]), flat_g, spec)


def float8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: Float8Spec
) -> torch.Tensor:
    """``F.linear`` in float8: ``x`` and ``weight`` first in the autocast dtype (bf16 under
    ``train.precision=fp8``), the output in that dtype."""
    gathered = getattr(weight, GATHERED, None)  # ZeRO-3 gathered it as float8: its values are there
    return _linear(x, weight, weight.shape[0], bias, spec, gathered)


def float8_linear_frozen(
    x: torch.Tensor, dequantize: Any, out_features: int, bias: torch.Tensor | None, spec: Float8Spec
) -> torch.Tensor:
    """:func:`float8_linear` of a frozen weight that ``dequantize(dtype)`` makes (a QLoRA base's NF4),
    made again in backward rather than kept: the same float8 numbers as :func:`float8_linear` on it."""
    return _linear(x, None, out_features, bias, spec, dequantize=dequantize)


def _linear(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    out_features: int,
    bias: torch.Tensor | None,
    spec: Float8Spec,
    gathered: Any = None,
    dequantize: Any = None,
) -> torch.Tensor:
    """:class:`_Float8Matmul` on ``x`` in the autocast dtype, with the weight as it is (``weight``), as
    ZeRO-3 gathered it (``gathered``) or as ``dequantize(dtype)`` makes it."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    with torch.autocast(device, enabled=False):
        flat = x.to(dtype).reshape(-1, x.shape[-1])
        # gathered: the parameter itself (its buffer holds no bf16 values to view), its gradient (out, in)
        w_t = weight if gathered is not None or weight is None else weight.to(dtype).t()
        again = functools.partial(dequantize, dtype) if dequantize is not None else None
        y = cast(torch.Tensor, _Float8Matmul.apply(flat, w_t, spec, gathered, again))  # type: ignore[no-untyped-call]
        y = y.reshape(*x.shape[:-1], out_features)
        return y if bias is None else y + bias.to(y.dtype)


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` (same parameters, names and state dict) whose forward is :func:`float8_linear`."""

    float8: Float8Spec

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: Float8Spec) -> Float8Linear:
        """``linear``'s own parameters (any device, the meta device included) in a float8 layer."""
        new = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        new.weight, new.bias = linear.weight, linear.bias
        new.float8 = spec
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float8_linear(x, self.weight, self.bias, self.float8)


def is_target(name: str, skip: tuple[str, ...]) -> bool:
    """Whether the module ``name`` (e.g. ``layers.3.mlp.up_proj``) computes in float8: a block's
    projection not matched by a ``train.fp8_skip`` pattern."""
    leaf = name.rpartition(".")[2]
    in_block = name.startswith("layers.") or ".layers." in name
    return in_block and leaf in TARGETS and not any(fnmatch.fnmatchcase(name, p) for p in skip)


def apply_float8(
    model: nn.Module,
    recipe: str,
    skip: tuple[str, ...],
    emulate: bool,
    tp: Group | None = None,
    cp: Group | None = None,
) -> list[str]:
    """Make ``model``'s target linears (:func:`is_target`) compute in float8, in place, on any device
    (the meta device included); ``tp`` / ``cp``: the groups splitting weights and tokens. Returns the
    converted names."""
    from zerotron.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    tokens = (cp,) if cp is not None else ()
    split = (tp,) if tp is not None else ()
    whole = Float8Spec.create(recipe, emulate, tokens=tokens)
    kinds = {
        ColumnParallelLinear: replace(whole, outer=split),
        RowParallelLinear: replace(whole, inner=split),
    }
    done = []
    for name, module in list(model.named_modules()):
        if not is_target(name, skip):
            continue
        if type(module) in kinds:
            module.float8 = kinds[type(module)]
        elif type(module) is nn.Linear:
            parent, _, leaf = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, leaf, Float8Linear.from_linear(module, whole))
        else:
            continue
        done.append(name)
    return done


def gathers_in_float8(spec: Float8Spec) -> bool:
    """Whether ZeRO-3 can gather a weight of ``spec`` as float8: one tensorwise cast of the weight
    serves both GEMMs that read it (the tensorwise recipe; rowwise casts it along each GEMM's axis)."""
    c = spec.config
    tensorwise = c.cast_config_weight.scaling_granularity is _ao().tensorwise
    return tensorwise and c.cast_config_weight_for_grad_input == c.cast_config_weight


def float8_weights(model: nn.Module) -> dict[int, Float8Spec]:
    """The weights ZeRO-3 gathers as float8, by parameter id: those of ``model``'s float8 linears and
    routed experts (a ``float8_mlp`` with a spec per stacked ``gate_up_proj`` / ``down_proj``) whose
    recipe allows it (:func:`gathers_in_float8`)."""
    out = {}
    for module in model.modules():
        spec = getattr(module, "float8", None)
        weight = module._parameters.get("weight")  # none on a QLoRA base (its NF4 bytes gather as they are)
        if isinstance(spec, Float8Spec) and gathers_in_float8(spec) and weight is not None:
            out[id(weight)] = spec
        mlp = getattr(module, "float8_mlp", None)  # routed experts (zerotron.parallel.float8_experts)
        for name in ("gate_up", "down"):
            spec, stacked = getattr(mlp, name, None), module._parameters.get(f"{name}_proj")
            if isinstance(spec, Float8Spec) and gathers_in_float8(spec) and stacked is not None:
                out[id(stacked)] = spec
    return out


def weight_parts(shape: torch.Size) -> int:
    """How many float8 scales a weight gathered as float8 takes: one per expert of a stack (E, out, in),
    else one."""
    return shape[0] if len(shape) == 3 else 1


def cast_weight_shard(
    shard: torch.Tensor, pieces: list[tuple[int, int, int]], specs: list[Float8Spec], group: Group
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's part of a ZeRO-3 unit of float8 weights as float8 bytes, and each weight's scale.

    ``shard``: the rank's working (bf16) shard; ``pieces``: ``(at, length, weight)`` where each weight
    ``specs[weight]`` (or each expert of a stack) lies in it; ``group``: the ranks holding the other shards. The amax of each weight
    is reduced over ``group`` and over the groups splitting the weight's axes (tensor parallelism), so
    the scale and every float8 value equal those of casting the whole weight. Returns ``(bytes, scales)``:
    ``(len(shard),)`` uint8 (zeros where no weight lies) and ``(len(specs),)`` fp32."""
    ao = _ao()
    amax = torch.zeros(len(specs), dtype=torch.float32, device=shard.device)
    for at, length, i in pieces:
        if length:
            amax[i] = torch.max(torch.abs(shard[at : at + length]))
    for g in [group, *specs[0].groups(W_AXES)]:  # a few bytes: counted apart from data traffic
        collectives.all_reduce(amax, g, "max", kind="control")
    how = specs[0].config.cast_config_weight
    scales = ao.scale(amax, how.target_dtype, specs[0].config.round_scales_to_power_of_2)
    out = torch.zeros(shard.numel(), dtype=torch.uint8, device=shard.device)
    for at, length, i in pieces:
        if length:
            part = ao.to_float8(
                shard[at : at + length], scales[i], how.target_dtype, specs[i].mm, ao.role.WEIGHT
            )
            out[at : at + length] = part._data.view(torch.uint8)
    return out, scales


def gathered_weight(
    data: torch.Tensor, shape: torch.Size, scale: torch.Tensor, spec: Float8Spec, dtype: torch.dtype
) -> Any:
    """The float8 weight of ``shape`` whose bytes ZeRO-3 gathered into ``data`` (uint8) with its
    ``scale``, as the cast of the whole ``dtype`` weight would have made it."""
    ao = _ao()
    f8 = data.view(spec.config.cast_config_weight.target_dtype).view(shape)
    return ao.tensor(f8, scale, dtype, spec.mm, ao.role.WEIGHT)
