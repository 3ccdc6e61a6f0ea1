"""Tensor and sequence parallelism (Megatron-style), *apply* part: parallel layers and the plan.

A single-device model is turned into its tensor-parallel shard, on each rank of a TP group of size t,
by :func:`apply_tensor_parallel` following a :class:`TensorParallelPlan`: a small, documented mapping
from the model's module names to what happens to them. Nothing in the model's code changes; modules
are replaced in place under the same names, so parameter names (and checkpoints) stay the global ones.

Layers
------
- :class:`ColumnParallelLinear`: ``W`` (out, in) split by output rows; the output stays split.
- :class:`RowParallelLinear`: ``W`` split by input columns; partial outputs are summed by an
  all-reduce (or a reduce-scatter onto sequence shards under sequence parallelism).
- :class:`VocabParallelEmbedding`: the embedding table split by vocabulary rows; each rank looks up
  the ids it owns, zeros the rest, and the partial embeddings are summed the same way.

A *TP region* is a module (attention, MLP) whose input is replicated (or all-gathered from sequence
shards) on entry, whose column-parallel layers work on that input, and whose row-parallel layer
leaves it. Entering happens once per region (a forward pre-hook applying Megatron's f, or the
all-gather), so q, k and v share one backward all-reduce: two all-reduces forward and two backward
per transformer layer, ``8·b·s·h·(t−1)/t`` elements under NCCL's bus convention.

Plan format
-----------
A plain dict (see :meth:`TensorParallelPlan.from_dict`); names are attribute paths (dots allowed)::

    {
        "embedding": "embed_tokens",     # nn.Embedding -> VocabParallelEmbedding (optional)
        "output": "lm_head",             # nn.Linear to the vocabulary -> vocab-split logits (optional)
        "norms": ["norm"],               # replicated modules that run on sequence shards under SP
        "blocks": "layers",              # a ModuleList of transformer blocks
        "block": {                       # everything below is relative to one block
            "norms": ["input_layernorm", "post_attention_layernorm"],
            "regions": {
                "self_attn": {
                    "colwise": ["q_proj", "k_proj", "v_proj"],
                    "rowwise": ["o_proj"],
                    # region attribute holding a head count -> the colwise layers producing those heads
                    "heads": {"num_heads": ["q_proj"], "kv_heads": ["k_proj", "v_proj"]},
                },
                "mlp": {"colwise": ["gate_proj", "up_proj"], "rowwise": ["down_proj"]},
            },
        },
    }

A region's input is the first positional argument of its ``forward``; the layers named under
``colwise`` and ``rowwise`` must be ``nn.Linear`` (a rowwise bias is added once, after the sum).

Head counts: a count divisible by t is split (rank k keeps heads ``[k·n/t, (k+1)·n/t)`` and the
attribute becomes ``n/t``). A count that t is a multiple of (GQA with more ranks than KV heads) is
*replicated*: every rank keeps the whole weight but uses only the rows of head ``k·n/t`` and the
attribute becomes 1; its gradient, partial on each rank, is summed over the group by a hook (an extra
all-reduce of those weights per micro-batch). Only heads that feed attention, not a rowwise layer
directly, may be replicated. The model's forward must read its head counts from those attributes
(``x.view(b, s, self.num_heads, head_dim)``), and under sequence parallelism it must treat the hidden
states between regions as (b, s/t, h) shards (residual adds and norms do; a slice along s does not).

Logits: with an ``output`` entry the model returns this rank's vocabulary columns (b, s, V/t); the
loss is :func:`zerotron.parallel.tensor_comm.vocab_parallel_cross_entropy`. Tied embeddings stay
tied: the output layer shares the embedding's vocabulary shard.

Sequence parallelism (``sequence_parallel=True``): between regions the hidden states are split along
the sequence (dim 1); the embedding reduce-scatters into shards, regions all-gather on entry and
reduce-scatter on exit, so norms (and their saved activations) work on 1/t of the tokens. The
column-parallel layers save the (b, s/t, h) shard of their input, not the gather, and all-gather it
again in backward, once per region (:class:`~zerotron.parallel.tensor_comm.SequenceGather`). Replicated
parameters used on shards (norm gains, row-parallel biases) get their gradient summed over the group.

Every split parameter has a :class:`ShardSpec` (global shape, offsets; DESIGN contract 5), listed by
:func:`shard_specs`. Initialisation is layout-independent because the plan slices a model that was
initialised whole with the global seed (or loaded).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from zerotron.distributed import collectives
from zerotron.distributed.mesh import Group
from zerotron.parallel.float8 import Float8Spec, float8_linear
from zerotron.parallel.tensor_comm import (
    SequenceGather,
    all_reduce_grad_hook,
    copy_to_tp,
    gather_from_sequence,
    linear_saving_shard,
    reduce_from_tp,
    reduce_scatter_to_sequence,
)

INPUT_MODES = ("replicated", "sequence", "none")
OUTPUT_MODES = ("reduce", "sequence", "none")


@dataclass(frozen=True)
class ShardSpec:
    """Where a tensor-parallel shard lies in its global tensor.

    ``dim`` is the split dimension (None: replicated over the TP group); ``offsets`` the shard's start
    in every dimension; ``shape`` its own shape.
    """

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    dim: int | None

    @property
    def sharded(self) -> bool:
        """Whether the shard is a proper part of the global tensor."""
        return self.dim is not None

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        """This shard's part of the global tensor ``full``."""
        if self.dim is None:
            return full
        return full.narrow(self.dim, self.offsets[self.dim], self.shape[self.dim])


def split_spec(global_shape: tuple[int, ...], dim: int, start: int, size: int) -> ShardSpec:
    """The spec of a shard of ``size`` along ``dim`` starting at ``start``."""
    offsets = tuple(start if d == dim else 0 for d in range(len(global_shape)))
    shape = tuple(size if d == dim else n for d, n in enumerate(global_shape))
    return ShardSpec(tuple(global_shape), offsets, shape, dim)


def replicated_spec(global_shape: tuple[int, ...]) -> ShardSpec:
    """The spec of a tensor whole on every tensor-parallel rank."""
    return ShardSpec(tuple(global_shape), (0,) * len(global_shape), tuple(global_shape), None)


def _even_split(n: int, group: Group, what: str) -> tuple[int, int]:
    if n % group.size:
        raise ValueError(f"tensor parallelism: {what}={n} is not divisible by tp={group.size}")
    size = n // group.size
    return group.rank_in_group * size, size


def _enter(x: torch.Tensor, mode: str, group: Group) -> torch.Tensor:
    if mode == "replicated":
        return copy_to_tp(x, group)
    if mode == "sequence":
        return gather_from_sequence(x, group, dim=1)
    return x


def enter_region(x: torch.Tensor, mode: str, group: Group) -> torch.Tensor:
    """A column-parallel input into the region: ``replicated`` through f (identity; the gradient
    all-reduced), ``sequence`` all-gathered from sequence shards, ``none`` as it is."""
    return _enter(x, mode, group)


def leave_region(y: torch.Tensor, mode: str, group: Group) -> torch.Tensor:
    """A row-parallel output's partial sums out of the region: all-reduced (``reduce``),
    reduce-scattered onto sequence shards (``sequence``) or left as they are (``none``)."""
    if mode == "reduce":
        return reduce_from_tp(y, group)
    if mode == "sequence":
        return reduce_scatter_to_sequence(y, group, dim=1)
    return y


class ColumnParallelLinear(nn.Module):
    """``y_k = x W_kᵀ + b_k``: the weight split by output rows, the output left split (b, s, out/t).

    Args:
        linear: the full layer whose rows are taken.
        group: the tensor-parallel group.
        input_mode: ``replicated`` (apply f: identity forward, all-reduce of the input gradient),
            ``sequence`` (all-gather the input from sequence shards) or ``none`` (the enclosing
            region has already done it).
        rows: (start, size) of the output rows this rank computes; default an even split.
        replicated: keep the whole weight and compute only ``rows`` of it (a replicated KV head); the
            weight gradient is then summed over the group by a hook.
    """

    def __init__(
        self,
        linear: nn.Linear,
        group: Group,
        input_mode: str = "replicated",
        rows: tuple[int, int] | None = None,
        replicated: bool = False,
    ) -> None:
        super().__init__()
        if input_mode not in INPUT_MODES:
            raise ValueError(f"ColumnParallelLinear: input_mode {input_mode!r} not in {INPUT_MODES}")
        out, inp = linear.weight.shape
        start, size = rows if rows is not None else _even_split(out, group, "output features")
        self.group, self.input_mode, self.replicated = group, input_mode, replicated
        self.in_features, self.out_features, self.rows = inp, size, (start, size)
        # Under sequence parallelism inside a region: the region's entry, whose shard is what we save.
        self.region_gather: _GatherSlot | None = None
        self.float8: Float8Spec | None = None  # train.precision=fp8 (zerotron.parallel.float8)
        self.tp_specs: dict[str, ShardSpec] = {}
        keep = (slice(None) if replicated else slice(start, start + size),)
        self.weight = nn.Parameter(linear.weight.detach()[keep].clone())  # (out/t, in) or (out, in)
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach()[keep].clone())
        for name, p in (("weight", linear.weight), ("bias", linear.bias)):
            if p is None:
                continue
            shape = tuple(p.shape)
            self.tp_specs[name] = replicated_spec(shape) if replicated else split_spec(shape, 0, start, size)
            if replicated and group.size > 1:
                sum_grad_over_tp(self, name, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, s, in) [(b, s/t, in) with input_mode=sequence] -> (b, s, out/t)."""
        gather = None
        if self.input_mode == "sequence" and self.group.size > 1 and torch.is_grad_enabled():
            full = gather_from_sequence(x, self.group, dim=1)  # (b, s, in)
            gather, x = SequenceGather(x, full, self.group), full
        else:
            x = _enter(x, self.input_mode, self.group)
            gather = self.region_gather.current if self.region_gather is not None else None
        w: torch.Tensor = self.weight
        b: torch.Tensor | None = self.bias
        if self.replicated:
            start, size = self.rows
            w = w[start : start + size]
            b = b[start : start + size] if b is not None else None
        if self.float8 is not None:
            return float8_linear(x, w, b, self.float8)  # saves the gathered input
        if gather is not None and gather.full is x:
            return linear_saving_shard(x, w, b, gather)  # saves (b, s/t, in), gathers again in backward
        return F.linear(x, w, b)

    @property
    def local_rows(self) -> slice:
        """The rows of ``weight`` (and ``bias``) this rank multiplies by: its rows of a replicated
        weight, all of a split one (which holds only its own)."""
        start, size = self.rows if self.replicated else (0, self.out_features)
        return slice(start, start + size)

    def extra_repr(self) -> str:
        """Shapes and modes, for ``print(model)``."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features} (rows {self.rows[0]}+), "
            f"input={self.input_mode}, replicated={self.replicated}, tp={self.group.size}"
        )


class RowParallelLinear(nn.Module):
    """``y = Σ_k x_k W_kᵀ + b``: the weight split by input columns, partial outputs summed over tp.

    Args:
        linear: the full layer whose columns are taken.
        group: the tensor-parallel group.
        output_mode: ``reduce`` (g: all-reduce), ``sequence`` (reduce-scatter onto sequence shards) or
            ``none`` (leave partial sums; the caller reduces).
    """

    def __init__(self, linear: nn.Linear, group: Group, output_mode: str = "reduce") -> None:
        super().__init__()
        if output_mode not in OUTPUT_MODES:
            raise ValueError(f"RowParallelLinear: output_mode {output_mode!r} not in {OUTPUT_MODES}")
        out, inp = linear.weight.shape
        start, size = _even_split(inp, group, "input features")
        self.group, self.output_mode = group, output_mode
        self.in_features, self.out_features = size, out
        self.weight = nn.Parameter(linear.weight.detach()[:, start : start + size].clone())  # (out, in/t)
        self.tp_specs = {"weight": split_spec((out, inp), 1, start, size)}
        self.float8: Float8Spec | None = None  # train.precision=fp8 (zerotron.parallel.float8)
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().clone())  # replicated, added after the sum
            if output_mode == "sequence" and group.size > 1:
                sum_grad_over_tp(self, "bias", group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, s, in/t) -> (b, s, out) [(b, s/t, out) with output_mode=sequence]."""
        y = (
            F.linear(x, self.weight)
            if self.float8 is None
            else float8_linear(x, self.weight, None, self.float8)
        )
        y = leave_region(y, self.output_mode, self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        """Shapes and mode, for ``print(model)``."""
        return (
            f"in_features={self.in_features} (of {self.tp_specs['weight'].global_shape[1]}), "
            f"out_features={self.out_features}, output={self.output_mode}, tp={self.group.size}"
        )


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows; partial lookups summed over tp.

    Rank k owns ids ``[k·V/t, (k+1)·V/t)``; other ids give zeros, so the sum over the group is the full
    lookup. ``output_mode`` is ``reduce`` (all-reduce, (b, s, h)) or ``sequence`` (reduce-scatter onto
    sequence shards, (b, s/t, h)).
    """

    def __init__(self, embedding: nn.Embedding, group: Group, output_mode: str = "reduce") -> None:
        super().__init__()
        if output_mode not in ("reduce", "sequence"):
            raise ValueError(f"VocabParallelEmbedding: output_mode {output_mode!r} not reduce|sequence")
        vocab, dim = embedding.weight.shape
        start, size = _even_split(vocab, group, "vocabulary size")
        self.group, self.output_mode = group, output_mode
        self.vocab_start, self.num_embeddings, self.embedding_dim = start, size, dim
        self.weight = nn.Parameter(embedding.weight.detach()[start : start + size].clone())  # (V/t, h)
        self.tp_specs = {"weight": split_spec((vocab, dim), 0, start, size)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (b, s) -> (b, s, h) [(b, s/t, h) with output_mode=sequence]."""
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)  # (b, s)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (b, s, h)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_region(out, self.output_mode, self.group)

    def extra_repr(self) -> str:
        """Shapes and mode, for ``print(model)``."""
        return f"vocab rows {self.vocab_start}+{self.num_embeddings}, dim={self.embedding_dim}"


# -- the plan --------------------------------------------------------------------------------------------


@dataclass
class RegionPlan:
    """One TP region inside a block: its column- and row-parallel layers and its head counts."""

    colwise: list[str]
    rowwise: list[str]
    heads: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class TensorParallelPlan:
    """How to split one model family; see the module docstring for the dict format."""

    blocks: str
    regions: dict[str, RegionPlan]
    block_norms: list[str] = field(default_factory=list)
    embedding: str | None = None
    output: str | None = None
    norms: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, plan: dict[str, Any]) -> TensorParallelPlan:
        """Parse the documented dict format; unknown keys are errors."""
        known = {"embedding", "output", "norms", "blocks", "block"}
        unknown = set(plan) - known
        if unknown or "blocks" not in plan or "block" not in plan:
            raise ValueError(
                f"tensor-parallel plan: keys {sorted(unknown)} unknown, or 'blocks'/'block' missing; "
                f"expected {sorted(known)}"
            )
        block = plan["block"]
        regions = {}
        for name, region in block.get("regions", {}).items():
            extra = set(region) - {"colwise", "rowwise", "heads"}
            if extra:
                raise ValueError(f"tensor-parallel plan: region {name!r} has unknown keys {sorted(extra)}")
            regions[name] = RegionPlan(
                list(region.get("colwise", [])),
                list(region.get("rowwise", [])),
                dict(region.get("heads", {})),
            )
        return cls(
            blocks=plan["blocks"],
            regions=regions,
            block_norms=list(block.get("norms", [])),
            embedding=plan.get("embedding"),
            output=plan.get("output"),
            norms=list(plan.get("norms", [])),
        )


def _held(plan: TensorParallelPlan, model: nn.Module) -> TensorParallelPlan:
    """``plan`` without the embedding, output and final norms that ``model`` (a pruned pipeline stage)
    does not hold."""

    def held(path: str) -> bool:
        parent, _, name = path.rpartition(".")
        return name in (_get(model, parent) if parent else model)._modules

    return replace(
        plan,
        embedding=plan.embedding if plan.embedding is not None and held(plan.embedding) else None,
        output=plan.output if plan.output is not None and held(plan.output) else None,
        norms=[n for n in plan.norms if held(n)],
    )


def _get(root: nn.Module, path: str) -> nn.Module:
    module: Any = root
    for part in path.split("."):
        if not hasattr(module, part):
            raise ValueError(f"tensor-parallel plan: {type(root).__name__} has no module {path!r}")
        module = getattr(module, part)
    return cast("nn.Module", module)


def _set(root: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(_get(root, parent) if parent else root, name, new)


def _linear(root: nn.Module, path: str) -> nn.Linear:
    module = _get(root, path)
    if not isinstance(module, nn.Linear):
        raise ValueError(f"tensor-parallel plan: {path!r} is a {type(module).__name__}, not an nn.Linear")
    return module


def _head_rows(region: nn.Module, plan: RegionPlan, group: Group) -> dict[str, tuple[int, int, bool]]:
    """For each colwise layer named under ``heads``: (row start, rows, replicated); sets local counts."""
    t, k = group.size, group.rank_in_group
    rows: dict[str, tuple[int, int, bool]] = {}
    for attr, layers in plan.heads.items():
        n = int(getattr(region, attr))
        if n % t == 0:
            first, count, replicated = k * n // t, n // t, False
        elif t % n == 0:
            first, count, replicated = k * n // t, 1, True
        else:
            raise ValueError(
                f"tensor parallelism: tp={t} neither divides nor is a multiple of {attr}={n}; "
                f"choose tp among {', '.join(str(d) for d in range(1, n + 1) if n % d == 0)} "
                "or a multiple of it"
            )
        for path in layers:
            out = _linear(region, path).out_features
            per_head = out // n
            rows[path] = (first * per_head, count * per_head, replicated)
        setattr(region, attr, count)
    return rows


class _GatherSlot:
    """The current forward's :class:`SequenceGather` of one region, read by its column-parallel layers."""

    current: SequenceGather | None = None


def _shard_region(region: nn.Module, plan: RegionPlan, group: Group, sequence_parallel: bool) -> None:
    heads = _head_rows(region, plan, group)
    slot = _GatherSlot() if sequence_parallel else None
    for path in plan.colwise:
        start, size, replicated = heads.get(path, (0, 0, False))
        rows = (start, size) if path in heads else None
        column = ColumnParallelLinear(_linear(region, path), group, "none", rows, replicated)
        column.region_gather = slot
        _set(region, path, column)
    out_mode = "sequence" if sequence_parallel else "reduce"
    for path in plan.rowwise:
        _set(region, path, RowParallelLinear(_linear(region, path), group, out_mode))
    setattr(region, "tp_input_mode", "sequence" if sequence_parallel else "replicated")  # noqa: B010

    def enter(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = _enter(args[0], str(module.tp_input_mode), group)  # (b, s, h)
        if slot is not None:
            slot.current = SequenceGather(args[0], x, group) if torch.is_grad_enabled() else None
        return (x, *args[1:])

    def leave(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if slot is not None:
            slot.current = None  # the saved shard lives on in the graph, not here

    region.register_forward_pre_hook(enter)
    region.register_forward_hook(leave)


def sum_grad_over_tp(module: nn.Module, name: str, group: Group) -> None:
    """Record that ``module.<name>``'s gradient is a partial sum to add up over ``group`` (a parameter
    replicated over tp but used on partial data). The hook is attached at once, or by :func:`attach_grad_sums`
    once the parameter has storage (a model split on the meta device is materialised first)."""
    sums: dict[str, Group] = module.__dict__.setdefault("tp_grad_sums", {})
    sums[name] = group
    attach_grad_sums(module)  # at once when it has storage


def attach_grad_sums(model: nn.Module) -> None:
    """Attach the recorded gradient sums (:func:`sum_grad_over_tp`) to the parameters that have storage
    and do not have theirs yet (idempotent: run after the split and again after materialisation)."""
    for module in model.modules():
        sums = getattr(module, "tp_grad_sums", None)
        if not sums:
            continue
        done = module.__dict__.setdefault("_tp_grad_hooked", set())
        for name, group in sums.items():
            p = getattr(module, name)
            if p is None or p.is_meta or id(p) in done or not p.requires_grad:
                continue
            p.register_hook(all_reduce_grad_hook(group))
            done.add(id(p))


def _sum_grads_over_tp(module: nn.Module, group: Group) -> None:
    """Every parameter of ``module`` and its children is replicated over tp and sees the sequence shard."""
    for owner in module.modules():
        for name, p in owner.named_parameters(recurse=False):
            if p.requires_grad:
                sum_grad_over_tp(owner, name, group)


def apply_tensor_parallel(
    model: nn.Module,
    plan: TensorParallelPlan,
    group: Group,
    sequence_parallel: bool = False,
) -> nn.Module:
    """Replace ``model``'s layers by their tensor-parallel shards on this rank, in place.

    ``model`` holds its full, initialised (or loaded) weights; each rank keeps its slice, so the
    global weights do not depend on the layout. A group of one rank leaves the model unchanged. A
    pipeline stage is the model with what it does not own pruned: the plan's embedding, output and
    final norms that the model does not hold are skipped (a stage without the embedding takes hidden
    states, already (b, s/t, h) shards under sequence parallelism).
    """
    if group.size == 1:
        return model
    if sequence_parallel and plan.embedding is None:
        raise ValueError("sequence parallelism needs an 'embedding' entry in the tensor-parallel plan")
    plan = _held(plan, model)
    tied = (
        plan.embedding is not None
        and plan.output is not None
        and _get(model, plan.output).weight is _get(model, plan.embedding).weight
    )
    embedding = None
    if plan.embedding is not None:
        full = _get(model, plan.embedding)
        if not isinstance(full, nn.Embedding):
            raise ValueError(f"tensor-parallel plan: {plan.embedding!r} is not an nn.Embedding")
        embedding = VocabParallelEmbedding(full, group, "sequence" if sequence_parallel else "reduce")
        _set(model, plan.embedding, embedding)
    if plan.output is not None:
        in_mode = "sequence" if sequence_parallel else "replicated"
        head = ColumnParallelLinear(_linear(model, plan.output), group, in_mode)
        if tied:
            assert embedding is not None
            head.weight = embedding.weight
        _set(model, plan.output, head)
    blocks: Any = _get(model, plan.blocks)
    for block in blocks:
        for name, region_plan in plan.regions.items():
            _shard_region(_get(block, name), region_plan, group, sequence_parallel)
        if sequence_parallel:
            for name in plan.block_norms:
                _sum_grads_over_tp(_get(block, name), group)
    if sequence_parallel:
        for name in plan.norms:
            _sum_grads_over_tp(_get(model, name), group)
    return model


# -- what the rest of the engine needs to know about shards ---------------------------------------------


def shard_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """Every tensor-parallel parameter's :class:`ShardSpec` by global name (a tied weight under each name)."""
    by_id: dict[int, ShardSpec] = {}
    for module in model.modules():
        for pname, spec in getattr(module, "tp_specs", {}).items():
            by_id.setdefault(id(getattr(module, pname)), spec)
    return {
        name: by_id[id(p)] for name, p in model.named_parameters(remove_duplicate=False) if id(p) in by_id
    }


def gather_tensors(
    tensors: dict[str, torch.Tensor], specs: dict[str, ShardSpec], group: Group
) -> dict[str, torch.Tensor]:
    """Full tensors from shards (collective over ``group``; every rank gets every full tensor).

    ``tensors`` maps names to shards laid out like the parameter of the same name in ``specs`` (a
    parameter or its optimizer moments); other entries are returned unchanged.
    """
    out = {}
    for name, t in tensors.items():
        spec = specs.get(name)
        if spec is None or not spec.sharded or tuple(t.shape) != spec.shape:
            out[name] = t
            continue
        dim = spec.dim
        assert dim is not None
        shard = t.detach().movedim(dim, 0).contiguous()  # (n/t, ...)
        full = shard.new_empty((group.size * shard.shape[0], *shard.shape[1:]))
        collectives.all_gather(full, shard, group)
        out[name] = full.movedim(0, dim).contiguous()
    return out
