"""Routed experts in float8 (``train.precision=fp8``): each expert's two GEMMs (``gate_up_proj``,
``down_proj``) cast and multiply as :mod:`zerotron.parallel.float8` casts a linear, with torchao's
recipes, **one scale per expert and source micro-batch**.

In one process an expert's GEMM of one micro-batch takes that micro-batch's rows routed to it, so an
activation's (or gradient's) tensorwise scale is the amax of those rows, and a rowwise scale along the
token axis (the weight gradient's) the amax of each column over them. Other layouts must not mix other
micro-batches' rows into it:

- expert parallelism gathers on one rank the rows of several source ranks (EP is folded over data and
  context parallelism). The experts receive their rows as segments, (expert, source micro-batch)
  (:class:`Segments`; :class:`zerotron.parallel.expert.ExpertDispatch` passes them, a micro-batch's
  context-parallel ranks as one source), and every segment is cast with its own scale: its own float8
  GEMMs, the weight gradient the sum over segments (in fp32);
- context parallelism without expert parallelism, and sequence parallelism without expert tensor
  parallelism, split a micro-batch's tokens over ranks that each hold the experts: the amax of each
  segment is reduced (max) over those groups (``tokens``), as a linear's is;
- expert tensor parallelism splits ``gate_up_proj``'s outputs and ``down_proj``'s inputs over tp (the
  experts see all the tp group's tokens): the weights' and ``down_proj``'s input's amaxes are reduced
  over tp (``outer`` / ``inner``).

When ``parallel.cp`` does not divide ``parallel.ep`` (> 1), a micro-batch's rows for one expert land in
several EP groups, on that expert's replicas inside one block of lcm(cp, ep) dp×cp ranks
(:func:`zerotron.parallel.expert.expert_sources`): the dispatch numbers the sources alike on
every EP group of the block, so the replicas' segments line up and their amaxes are reduced over them
(``tokens``, the ``edp_batch`` group). All amaxes of one operand travel in one all-reduce.
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
import torch.nn.functional as F

from zerotron.distributed import collectives
from zerotron.parallel.float8 import G_AXES, GATHERED, W_AXES, X_AXES, Float8Spec, _ao


@dataclass(frozen=True)
class Segments:
    """Rows of an expert GEMM's input grouped by (expert, source), expert-major: ``bounds``
    ``(expert, start, stop)`` per segment, ``ids`` (n,) each row's segment."""

    bounds: list[tuple[int, int, int]]
    ids: torch.Tensor

    @classmethod
    def of(cls, counts: torch.Tensor) -> Segments:
        """``counts``: rows per expert (E,), or per expert and source (E, S)."""
        per = counts.reshape(counts.shape[0], -1)
        flat = per.flatten().tolist()
        sources = per.shape[1]
        bounds, at = [], 0
        for k, n in enumerate(flat):
            bounds.append((k // sources, at, at + int(n)))
            at += int(n)
        ids = torch.repeat_interleave(torch.arange(len(flat), device=counts.device), per.flatten().long())
        return cls(bounds, ids)


def _reduce(amax: torch.Tensor, groups: list[Any]) -> torch.Tensor:
    for group in groups:  # a few bytes for ranks to agree on scales: counted apart from data traffic
        collectives.all_reduce(amax, group, "max", kind="control")
    return amax


def _token_amax(
    t: torch.Tensor, axes: tuple[str, str], how: Any, dim: int, seg: Segments, spec: Float8Spec
) -> Any:
    """The amaxes behind the scales of ``t`` (rows: tokens), reduced over the ranks holding the rest:
    tensorwise (K,) per segment; rowwise along the features (n, 1) per row; rowwise along the tokens
    (K, cols) per segment and column."""
    a = t.detach().abs().float()
    count = len(seg.bounds)
    if how.scaling_granularity is _ao().tensorwise:
        rows = a.amax(dim=1) if a.shape[1] else a.new_zeros(a.shape[0])
        amax = a.new_zeros(count).scatter_reduce(0, seg.ids, rows, "amax")
        return _reduce(amax, spec.groups(axes))
    if dim == -1:
        return _reduce(a.amax(dim=-1, keepdim=True), spec.groups((axes[1],)))
    index = seg.ids[:, None].expand_as(a)
    amax = a.new_zeros(count, a.shape[1]).scatter_reduce(0, index, a, "amax")
    return _reduce(amax, spec.groups((axes[0],)))


def _weight_amax(wt: torch.Tensor, how: Any, dim: int, spec: Float8Spec) -> torch.Tensor:
    """The amaxes behind each expert's weight scale; ``wt`` (E, in, out): (E,) tensorwise, else along
    ``dim`` of each (in, out) matrix, reduced over the ranks holding the rest of the weight."""
    a = wt.detach().abs().float()
    if how.scaling_granularity is _ao().tensorwise:
        return _reduce(a.amax(dim=(1, 2)), spec.groups(W_AXES))
    return _reduce(a.amax(dim=1 if dim == 0 else 2, keepdim=True), spec.groups((W_AXES[dim],)))


def _to_float8(
    t: torch.Tensor, amax: torch.Tensor, how: Any, role: Any, axis: int | None, spec: Float8Spec
) -> Any:
    ao = _ao()
    scale = ao.scale(amax, how.target_dtype, spec.config.round_scales_to_power_of_2)
    return ao.to_float8(t, scale, how.target_dtype, spec.mm, role, axis)


def _rowwise(how: Any) -> bool:
    return how.scaling_granularity is not _ao().tensorwise


def _part(amax: torch.Tensor, how: Any, k: int, a: int, b: int, along_tokens: bool) -> torch.Tensor:
    """Segment ``k``'s (rows ``a:b``) share of :func:`_token_amax`'s result."""
    if not _rowwise(how):
        return amax[k]
    return amax[k : k + 1] if along_tokens else amax[a:b]


class _ExpertFloat8Mm(torch.autograd.Function):
    """Each segment's rows of ``x`` (n, in) times its expert's ``w`` (E, out, in) transposed, with
    torchao's three float8 GEMMs per segment (module docstring) -> (n, out)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, w: torch.Tensor, seg: Segments, spec: Float8Spec, gathered: Any = None
    ) -> torch.Tensor:
        role, c = _ao().role, spec.config
        # a stack ZeRO-3 gathered as float8 (``gathered``: its experts' float8 matrices now) is not
        # read nor saved: backward asks for the matrices again, gathered again by then
        ctx.save_for_backward(x, *(() if gathered is not None else (w,)))
        ctx.seg, ctx.spec, ctx.gathered, ctx.w = seg, spec, gathered, (w.shape, w.dtype, w.device)
        x_amax = _token_amax(x, X_AXES, c.cast_config_input, -1, seg, spec)
        if gathered is not None:
            ws = gathered()

            def w8(e: int) -> Any:
                return ws[e].t()  # (in, out), laid out as the cast below would lay it out

        else:
            wt = w.transpose(1, 2)  # (E, in, out)
            w_amax = _weight_amax(wt, c.cast_config_weight, 0, spec)
            w8 = _per_expert(wt, w_amax, c.cast_config_weight, role.WEIGHT, 0, spec)
        parts = []
        for k, (e, a, b) in enumerate(seg.bounds):
            if b > a:
                x8 = _to_float8(x[a:b], _part(x_amax, c.cast_config_input, k, a, b, False),
                                c.cast_config_input, role.INPUT, -1 if _rowwise(c.cast_config_input) else None, spec)  # fmt: skip
                parts.append(torch.mm(x8, w8(e)))
        return torch.cat(parts) if parts else x.new_zeros((0, w.shape[1]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None, None, None]:
        role, c = _ao().role, ctx.spec.config
        x, *saved = ctx.saved_tensors
        seg: Segments = ctx.seg
        spec: Float8Spec = ctx.spec
        grad = grad.contiguous()
        how_g = c.cast_config_grad_output
        g_amax = _token_amax(grad, G_AXES, how_g, -1, seg, spec)
        if ctx.gathered is not None:  # tensorwise: the input gradient's weight cast is the forward's
            ws = ctx.gathered()

            def w8(e: int) -> Any:
                return ws[e].t()

        else:
            wt = saved[0].transpose(1, 2)
            w_amax = _weight_amax(wt, c.cast_config_weight_for_grad_input, -1, spec)
            w8 = _per_expert(wt, w_amax, c.cast_config_weight_for_grad_input, role.WEIGHT, -1, spec)
        axis_g = -1 if _rowwise(how_g) else None
        g8s: dict[int, Any] = {}
        grad_x = []
        for k, (e, a, b) in enumerate(seg.bounds):
            if b > a:
                g8s[k] = _to_float8(
                    grad[a:b], _part(g_amax, how_g, k, a, b, False), how_g, role.GRAD_OUTPUT, axis_g, spec
                )
                grad_x.append(torch.mm(g8s[k], w8(e).t()))
        gx = torch.cat(grad_x) if grad_x else x.new_zeros(x.shape)
        if not ctx.needs_input_grad[1]:
            return gx, None, None, None, None
        # tensorwise: the weight gradient takes the same cast of the output gradient
        how_gw, how_xw = c.cast_config_grad_output_for_grad_weight, c.cast_config_input_for_grad_weight
        reuse = how_gw == how_g and not _rowwise(how_g)
        gw_amax = None if reuse else _token_amax(grad, G_AXES, how_gw, 0, seg, spec)
        xw_amax = _token_amax(x, X_AXES, how_xw, 0, seg, spec)
        shape, dtype, device = ctx.w
        grad_w = torch.zeros(shape, dtype=torch.float32, device=device)
        axis = 0 if _rowwise(how_gw) else None
        for k, (e, a, b) in enumerate(seg.bounds):
            if b <= a:
                continue
            g8 = (
                g8s[k]
                if gw_amax is None
                else _to_float8(
                    grad[a:b], _part(gw_amax, how_gw, k, a, b, True), how_gw, role.GRAD_OUTPUT, axis, spec
                )
            )
            x8 = _to_float8(x[a:b], _part(xw_amax, how_xw, k, a, b, True), how_xw, role.INPUT,
                            0 if _rowwise(how_xw) else None, spec)  # fmt: skip
            grad_w[e] += torch.mm(g8.t(), x8).float()
        return gx, grad_w.to(dtype), None, None, None


def _per_expert(wt: torch.Tensor, amax: torch.Tensor, how: Any, role: Any, dim: int, spec: Float8Spec) -> Any:
    """Expert ``e``'s float8 weight (in, out), cast on first use."""

    @functools.cache
    def get(e: int) -> Any:
        return _to_float8(wt[e], amax[e], how, role, dim if _rowwise(how) else None, spec)

    return get


def _bf16_mm(x: torch.Tensor, w: torch.Tensor, seg: Segments) -> torch.Tensor:
    """The bf16 form of :class:`_ExpertFloat8Mm` (a GEMM ``train.fp8_skip`` keeps): one per expert."""
    per = [0] * w.shape[0]
    for e, a, b in seg.bounds:
        per[e] += b - a
    parts = [F.linear(part, w[e]) for e, part in enumerate(x.split(per))]
    return torch.cat(parts) if parts else x.new_zeros((0, w.shape[1]))


def _mm(
    x: torch.Tensor, w: torch.Tensor, seg: Segments, spec: Float8Spec | None, dtype: torch.dtype
) -> torch.Tensor:
    """Each segment's rows times its expert; ``w`` as ZeRO-3 gathered it as float8 (its float8 matrices
    then, :data:`~zerotron.parallel.float8.GATHERED`), or cast to ``dtype`` first."""
    if spec is None:
        return _bf16_mm(x, w.to(dtype), seg)
    gathered = getattr(w, GATHERED, None)
    if gathered is None:
        w = w.to(dtype)
    return cast(torch.Tensor, _ExpertFloat8Mm.apply(x, w, seg, spec, gathered))  # type: ignore[no-untyped-call]


@dataclass(frozen=True)
class ExpertsFloat8:
    """A block's routed experts in float8: the spec of each GEMM (None: kept in bf16 by
    ``train.fp8_skip``). Called as the experts' MLP: ``(x (n, h), counts (E,) or (E, S), gate_up
    (E, 2I, h), down (E, h, I)) -> (n, h)``, in the autocast dtype."""

    gate_up: Float8Spec | None
    down: Float8Spec | None

    def __call__(
        self, x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
    ) -> torch.Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        with torch.autocast(device, enabled=False):
            x, seg = x.to(dtype), Segments.of(counts)
            gate, up = _mm(x, gate_up, seg, self.gate_up, dtype).chunk(2, dim=-1)
            return _mm(F.silu(gate) * up, down, seg, self.down, dtype)


def apply_float8_experts(
    model: torch.nn.Module,
    recipe: str,
    skip: tuple[str, ...],
    emulate: bool,
    tokens: tuple[Any, ...] = (),
    split: Any = None,
) -> list[str]:
    """Make the routed experts of ``model``'s blocks compute in float8, in place (any device): each
    ``layers.N.mlp.experts`` holding stacked ``gate_up_proj`` / ``down_proj`` gets an
    :class:`ExpertsFloat8` MLP. ``tokens``: the groups splitting a micro-batch's tokens among ranks that
    hold the same experts; ``split``: the group splitting each expert's intermediate width (expert
    tensor parallelism). A GEMM matched by a ``skip`` pattern (``layers.N.mlp.experts.down_proj``)
    stays bf16. Returns the float8 GEMMs' names."""
    whole = Float8Spec.create(recipe, emulate, pad=True, tokens=tokens)
    outer = whole if split is None else replace(whole, outer=(split,))
    inner = whole if split is None else replace(whole, inner=(split,))
    done = []
    for name, module in model.named_modules():
        if not (name.endswith("mlp.experts") and hasattr(module, "float8_mlp")):
            continue
        in_block = name.startswith("layers.") or ".layers." in name
        keep = {
            leaf: in_block and not _skipped(f"{name}.{leaf}", skip) for leaf in ("gate_up_proj", "down_proj")
        }
        specs = {
            "gate_up": outer if keep["gate_up_proj"] else None,
            "down": inner if keep["down_proj"] else None,
        }
        if any(specs.values()):
            module.float8_mlp = ExpertsFloat8(**specs)
            done += [f"{name}.{leaf}" for leaf, on in keep.items() if on]
    return done


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in skip)
