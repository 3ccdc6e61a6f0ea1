"""Per-rank parameter counts: what each pipeline stage and tensor/expert-parallel rank holds.

The shapes and whole-model counts are :mod:`zerotron.shapes`' (shared with the engine). Expert
parallelism (``ep``) gives each rank E/ep experts, whole on every tp rank (expert tp = 1) or split over
it (``etp`` = tp: each rank a 1/tp slice of every expert's intermediate width);
the router is replicated. The MoE counts are checked against the published totals and against the
engine's own (tests/test_plan_engine.py).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from dataclasses import dataclass

from zerotron.shapes import (
    FLOAT8_TARGETS,
    ModelShape,
    attention_matrix_params,
    attention_norm_params,
    attention_split_params,
    balance_stages,
    block_forward_flops,
    dense_mlp_params,
    head_forward_flops,
    layer_matrix_params,
    mlp_params,
)


def layer_params(m: ModelShape) -> int:
    """Every parameter element of one block (matrices, norm gains, q/k/v biases); an MoE model's
    dense-first blocks are :func:`dense_layer_params`."""
    bias = (m.q_width + m.kv_width + m.v_width) if m.qkv_bias else 0
    return layer_matrix_params(m) + 2 * m.hidden + attention_norm_params(m) + bias


def dense_layer_params(m: ModelShape) -> int:
    """Every parameter element of one dense-first block of an MoE model (DeepSeek-V3's first blocks)."""
    return layer_params(m) - layer_matrix_params(m) + attention_matrix_params(m) + dense_mlp_params(m)


def _attention_tensors(m: ModelShape) -> int:
    """Attention weight tensors of one block: q, k, v, o (and biases), or MLA's projections and norms."""
    if m.mla:
        return 5 + (2 if m.q_lora else 0)  # [q_a, q_a_norm,] q_b | kv_a, kv_a_norm, kv_b, o
    return 4 + (3 if m.qkv_bias else 0)


def layer_tensors(m: ModelShape, ep: int = 1, dense: bool = False) -> int:
    """Parameter tensors of one block on one expert-parallel rank (Adam keeps a ``step`` per tensor)."""
    # MoE: the router, the experts' two stacked tensors, a shared expert's three and its gate
    if m.experts and not dense:
        mlp = 3 + (3 + (1 if m.shared_gate else 0) if m.shared else 0)
    else:
        mlp = m.mlp_matrices
    return 2 + _attention_tensors(m) + mlp


def embedding_params(m: ModelShape) -> int:
    """Elements of the input embedding."""
    return m.vocab * m.hidden


def head_params(m: ModelShape) -> int:
    """Elements of the output head that are not the embedding's (0 when tied) plus the final norm."""
    return (0 if m.tied else m.vocab * m.hidden) + m.hidden


def total_params(m: ModelShape) -> int:
    """Distinct parameter elements of the whole model (a tied embedding counts once)."""
    blocks = (m.layers - m.dense_layers) * layer_params(m) + m.dense_layers * dense_layer_params(m)
    return embedding_params(m) + blocks + head_params(m)


def inactive_params(m: ModelShape) -> int:
    """Parameters a token does not run: in every MoE block, the E − k experts it is not routed to."""
    return m.moe_layers * (m.experts - m.top_k) * mlp_params(m) if m.experts else 0


def active_params(m: ModelShape) -> int:
    """Parameters each token runs (the model's size for a dense model)."""
    return total_params(m) - inactive_params(m)


@dataclass(frozen=True)
class StageParams:
    """Parameters one rank holds before any ZeRO sharding (after TP/PP/EP splits)."""

    elements: int
    tensors: int
    layers: int
    expert_elements: int = 0  # of ``elements``: the experts' (sharded by ZeRO over dp·cp/ep, not dp)
    expert_tensors: int = 0  # of ``tensors``: the experts'


@functools.lru_cache(maxsize=1024)
def pipeline_layers(
    m: ModelShape, seq_len: int, pp: int, virtual: int = 1, sizes: tuple[int, ...] | None = None
) -> tuple[int, ...]:
    """Blocks of each pipeline rank (its chunks summed): ``parallel.pp_layers`` or balanced by FLOPs.

    Cached: the dynamic programme costs O(stages · layers²) and the search asks for the same splits.
    """
    n_stages = pp * virtual
    if pp == 1 and virtual == 1:
        return (m.layers,)
    if sizes:
        per_stage = list(sizes)
    else:
        block, head = block_forward_flops(m, seq_len), head_forward_flops(m)
        dense = [block_forward_flops(m, seq_len, dense=True)] * m.dense_layers
        per_stage = balance_stages(dense + [block] * (m.layers - m.dense_layers), n_stages, last_extra=head)
    return tuple(sum(per_stage[r::pp]) for r in range(pp))


@functools.lru_cache(maxsize=16384)
def stage_params(
    m: ModelShape, tp: int, pp: int, stage: int, layers: int | None = None, ep: int = 1, etp: int = 1
) -> StageParams:
    """Parameters on pipeline stage ``stage`` of ``pp`` with tensor parallel degree ``tp``.

    ``layers``: the blocks this stage holds (default an even split, ``num_hidden_layers / pp``).

    Matrices, q/k/v biases, the embedding and the head are split over ``tp`` (vocabulary-parallel
    embedding and head, as Megatron); norm gains are replicated, and so are the k/v projections when tp
    is a multiple of the KV heads rather than a divisor (the engine's GQA rule). The first stage holds the embedding,
    the last the final norm and head (and, when tied, a second copy of the embedding, as Megatron does
    for pp > 1). MoE blocks hold E/ep experts, whole on every tp rank (expert tp = 1) or with 1/etp of
    their intermediate width (``etp`` = tp), and the whole router (and shared expert). An MoE model's dense-first blocks are counted on the first
    stage (exact without interleaving when the first stage holds at least that many blocks).
    """
    per_stage = m.layers // pp if layers is None else layers
    dense = min(m.dense_layers, per_stage) if stage == 0 else 0  # dense-first blocks: the first stage's
    moe = per_stage - dense if m.experts else 0
    experts = moe * (m.experts // ep) * mlp_params(m) // etp  # whole on every tp rank unless etp > 1
    if m.experts:
        elements = moe * _block_elements(m, tp, 0, m.router) + experts
        elements += dense * _block_elements(m, tp, dense_mlp_params(m), 0)
    else:
        elements = per_stage * _block_elements(m, tp, mlp_params(m), 0)
    tensors = (per_stage - dense) * layer_tensors(m, ep) + dense * layer_tensors(m, ep, dense=True)
    if stage == 0:
        elements += embedding_params(m) // tp
        tensors += 1
    if stage == pp - 1:
        elements += m.hidden
        tensors += 1
        if not m.tied or pp > 1:
            elements += m.vocab * m.hidden // tp
            tensors += 1
    expert_tensors = moe * 2  # gate_up_proj and down_proj, E/ep stacked
    return StageParams(elements, tensors, per_stage, experts, expert_tensors)


def _block_elements(m: ModelShape, tp: int, mlp_split: int, replicated_mlp: int) -> int:
    """Elements of one block on one tensor-parallel rank: attention (MLA's down-projections and latent
    norms replicated; k/v replicated when tp exceeds the KV heads), ``mlp_split`` split over tp,
    ``replicated_mlp`` (router, shared expert) whole, and the two norm gains."""
    split, replicated = attention_split_params(m)
    norms = 2 * m.hidden
    if m.mla:
        return (split + mlp_split) // tp + replicated + attention_norm_params(m) + norms + replicated_mlp
    bias = 1 if m.qkv_bias else 0
    kv_split = tp if m.kv_heads % tp == 0 else 1  # KV heads replicated when tp exceeds them
    kv = (m.kv_width + m.v_width) * (m.hidden + bias)
    rest = split - m.hidden * (m.kv_width + m.v_width) + m.q_width * bias + mlp_split
    return rest // tp + kv // kv_split + norms + replicated_mlp


@dataclass(frozen=True)
class ParamList:
    """Element counts of one rank's parameter tensors in the engine's registration order.

    ``head`` before the blocks (the embedding), ``blocks`` one tuple per block, ``tail`` after them
    (final norm, output head). ZeRO's flat buckets and units are cut from these.
    """

    head: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]
    tail: tuple[int, ...]
    # per block, per tensor: gathered as float8 under ZeRO-3 (parallel.zero_fp8_gather; empty: none)
    float8: tuple[tuple[bool, ...], ...] = ()

    def ordered(self) -> list[int]:
        """Every tensor in registration order."""
        return [*self.head, *(n for block in self.blocks for n in block), *self.tail]


@functools.lru_cache(maxsize=4096)
def param_list(m: ModelShape, tp: int, pp: int, stage: int, layers: int) -> ParamList:
    """The tensors of pipeline stage ``stage`` on one tensor-parallel rank (see :func:`stage_params`).

    Dense models only: it mirrors the engine's registration order for the exact ZeRO accounting (an MoE
    model's states are counted without it: AdamW's per-segment step scalars are then approximate).
    """
    h, q, kv, i = m.hidden, m.q_width, m.kv_width, m.intermediate
    kv_split = tp if m.kv_heads % tp == 0 else 1
    block = [h, h * q // tp]
    block += [q // tp] if m.qkv_bias else []
    for _ in ("k", "v"):
        block += [h * kv // kv_split] + ([kv // kv_split] if m.qkv_bias else [])
    block += [q * h // tp, h] + [h * i // tp] * m.mlp_matrices
    head = (m.vocab * h // tp,) if stage == 0 else ()
    tail: tuple[int, ...] = ()
    if stage == pp - 1:
        tail = (h,) + ((m.vocab * h // tp,) if not m.tied or pp > 1 else ())
    return ParamList(head, tuple(tuple(block) for _ in range(layers)), tail)


def block_tensor_names(m: ModelShape) -> tuple[str, ...]:
    """The names of a dense block's tensors in :func:`param_list`'s order (a linear's weight by its
    module's name, e.g. ``self_attn.q_proj``)."""
    attn = [f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    biases = [f"{name}.bias" for name in attn] if m.qkv_bias else []
    mlp = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"][3 - m.mlp_matrices :]
    return (
        "input_layernorm.weight",
        *(n for i, name in enumerate(attn) for n in (name, *biases[i : i + 1])),
        "self_attn.o_proj",
        "post_attention_layernorm.weight",
        *mlp,
    )


def with_float8(params: ParamList, m: ModelShape, skip: tuple[str, ...]) -> ParamList:
    """``params`` (one pipeline stage holding every block, as ZeRO-3 runs) with each block's float8
    weights marked: the block projections that no ``train.fp8_skip`` pattern keeps in bf16, as the
    engine converts them (:func:`zerotron.parallel.float8.is_target`)."""
    names = block_tensor_names(m)
    mask = tuple(
        tuple(
            n.rpartition(".")[2] in FLOAT8_TARGETS
            and not any(fnmatch.fnmatchcase(f"layers.{i}.{n}", p) for p in skip)
            for n in names
        )
        for i in range(len(params.blocks))
    )
    return dataclasses.replace(params, float8=mask)
