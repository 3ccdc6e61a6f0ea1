"""Model arithmetic: parameter counts (whole model, per layer, per rank) and FLOPs per token.

Counts follow the engine's model (:mod:`zerotron.models.llama`) exactly: per block two RMSNorm gains,
q/k/v/o projections (q/k/v biases with ``attention_bias``), the MLP (gate+up+down for ``gated``,
up+down for ``plain``, no biases); an embedding, a final norm and an output head (the embedding's
tensor when ``tie_word_embeddings``).

Mixture-of-experts blocks (``num_local_experts`` E > 0, Mixtral's layout) replace the MLP by E expert
MLPs of the same shape and a router (h × E, no bias); each token runs ``num_experts_per_tok`` k of
them, so a block holds E MLPs' parameters but computes with k. Expert parallelism (``ep``) gives each
rank E/ep experts; each expert's matrices split over tp like a dense MLP; the router is replicated.
The trainer has no MoE layers yet, so these counts are checked against the published totals only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from zerotron.config import ModelConfig


@dataclass(frozen=True)
class ModelShape:
    """The dimensions the planner needs, defaults resolved."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated: bool
    tied: bool
    qkv_bias: bool
    experts: int = 0  # MoE experts per block (0: dense MLP)
    top_k: int = 0  # experts each token runs

    @classmethod
    def from_config(cls, m: ModelConfig) -> ModelShape:
        """Dimensions of a (preset-applied) :class:`ModelConfig`."""
        return cls(
            hidden=m.hidden_size,
            layers=m.num_hidden_layers,
            heads=m.num_attention_heads,
            kv_heads=m.kv_heads,
            head_dim=m.dim_per_head,
            intermediate=m.intermediate_size,
            vocab=m.vocab_size,
            gated=m.mlp == "gated",
            tied=m.tie_word_embeddings,
            qkv_bias=m.attention_bias,
            experts=m.num_local_experts,
            top_k=m.num_experts_per_tok if m.num_local_experts else 0,
        )

    @property
    def q_width(self) -> int:
        """Width of all query heads together."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of all key (or value) heads together."""
        return self.kv_heads * self.head_dim

    @property
    def mlp_matrices(self) -> int:
        """Matrices of size hidden × intermediate in one MLP."""
        return 3 if self.gated else 2

    @property
    def mlps(self) -> int:
        """MLPs (experts) one block holds."""
        return self.experts or 1

    @property
    def active_mlps(self) -> int:
        """MLPs one token runs through in a block."""
        return self.top_k if self.experts else 1

    @property
    def router(self) -> int:
        """Elements of one block's router (h × E; 0 when dense)."""
        return self.hidden * self.experts


def attention_matrix_params(m: ModelShape) -> int:
    """Elements of one block's q/k/v/o projection weights."""
    return m.hidden * (m.q_width + 2 * m.kv_width) + m.q_width * m.hidden


def mlp_params(m: ModelShape) -> int:
    """Elements of one MLP (one expert)."""
    return m.mlp_matrices * m.hidden * m.intermediate


def layer_matrix_params(m: ModelShape) -> int:
    """Elements of the weight matrices of one block (attention, every MLP or expert, the router)."""
    return attention_matrix_params(m) + m.mlps * mlp_params(m) + m.router


def layer_active_matrix_params(m: ModelShape) -> int:
    """Weight elements one token multiplies in a block: attention, its k experts (or the MLP), router."""
    return attention_matrix_params(m) + m.active_mlps * mlp_params(m) + m.router


def layer_params(m: ModelShape) -> int:
    """Every parameter element of one block (matrices, norm gains, q/k/v biases)."""
    bias = (m.q_width + 2 * m.kv_width) if m.qkv_bias else 0
    return layer_matrix_params(m) + 2 * m.hidden + bias


def layer_tensors(m: ModelShape, ep: int = 1) -> int:
    """Parameter tensors of one block on one expert-parallel rank (Adam keeps a ``step`` per tensor)."""
    mlp = m.mlp_matrices * m.experts // ep + 1 if m.experts else m.mlp_matrices
    return 2 + 4 + (3 if m.qkv_bias else 0) + mlp


def embedding_params(m: ModelShape) -> int:
    """Elements of the input embedding."""
    return m.vocab * m.hidden


def head_params(m: ModelShape) -> int:
    """Elements of the output head that are not the embedding's (0 when tied) plus the final norm."""
    return (0 if m.tied else m.vocab * m.hidden) + m.hidden


def total_params(m: ModelShape) -> int:
    """Distinct parameter elements of the whole model (a tied embedding counts once)."""
    return embedding_params(m) + m.layers * layer_params(m) + head_params(m)


def largest_layer_params(m: ModelShape) -> int:
    """Elements of the largest single module (what ZeRO-3 gathers at once): a block or the embedding."""
    return max(layer_params(m), embedding_params(m))


@dataclass(frozen=True)
class StageParams:
    """Parameters one rank holds before any ZeRO sharding (after TP/PP/EP splits)."""

    elements: int
    tensors: int
    layers: int
    expert_elements: int = 0  # of ``elements``: the experts' (sharded by ZeRO over dp·cp/ep, not dp)
    expert_tensors: int = 0  # of ``tensors``: the experts'


def block_forward_flops(m: ModelShape, seq_len: int) -> float:
    """Forward FLOPs per token of one block, as the engine weighs blocks to balance pipeline stages."""
    attn = 2 * m.hidden * m.head_dim * (2 * m.heads + 2 * m.kv_heads) + 4 * seq_len * m.heads * m.head_dim
    return float(attn + 2 * m.active_mlps * mlp_params(m) + 2 * m.router)


def balance_stages(costs: list[float], n_stages: int, last_extra: float = 0.0) -> list[int]:
    """Blocks per stage of the contiguous split minimising the largest stage cost (the engine's rule).

    ``last_extra`` (the output head and loss) weighs on the last stage; every stage gets a block. Exact
    dynamic programming with the engine's tie-breaking, so the planner's stages are the engine's.
    """
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        extra = last_extra if k == n_stages else 0.0
        before, row, cuts = best[k - 1], best[k], cut[k]
        for e in range(k, n - (n_stages - k) + 1):
            top, here, at = prefix[e] + extra, row[e], cuts[e]
            for start in range(k - 1, e):
                value = before[start]
                stage = top - prefix[start]
                if stage > value:
                    value = stage
                if value < here - 1e-12:
                    here, at = value, start
            row[e], cuts[e] = here, at
    sizes, e = [], n
    for k in range(n_stages, 0, -1):
        sizes.append(e - cut[k][e])
        e = cut[k][e]
    return sizes[::-1]


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
        block, head = block_forward_flops(m, seq_len), 2.0 * m.hidden * m.vocab
        per_stage = balance_stages([block] * m.layers, n_stages, head)
    return tuple(sum(per_stage[r::pp]) for r in range(pp))


@functools.lru_cache(maxsize=16384)
def stage_params(
    m: ModelShape, tp: int, pp: int, stage: int, layers: int | None = None, ep: int = 1
) -> StageParams:
    """Parameters on pipeline stage ``stage`` of ``pp`` with tensor parallel degree ``tp``.

    ``layers``: the blocks this stage holds (default an even split, ``num_hidden_layers / pp``).

    Matrices, q/k/v biases, the embedding and the head are split over ``tp`` (vocabulary-parallel
    embedding and head, as Megatron); norm gains are replicated, and so are the k/v projections when tp
    is a multiple of the KV heads rather than a divisor (the engine's GQA rule). The first stage holds the embedding,
    the last the final norm and head (and, when tied, a second copy of the embedding, as Megatron does
    for pp > 1). MoE blocks hold E/ep experts (each split over tp) and the whole router.
    """
    per_stage = m.layers // pp if layers is None else layers
    kv_split = tp if m.kv_heads % tp == 0 else 1  # KV heads replicated when tp exceeds them
    kv = 2 * m.kv_width * (m.hidden + (1 if m.qkv_bias else 0))
    rest = attention_matrix_params(m) - 2 * m.hidden * m.kv_width + (m.q_width if m.qkv_bias else 0)
    rest += 0 if m.experts else mlp_params(m)
    experts = per_stage * (m.experts // ep) * mlp_params(m) // tp if m.experts else 0
    elements = per_stage * (rest // tp + kv // kv_split + 2 * m.hidden + m.router) + experts
    tensors = per_stage * layer_tensors(m, ep)
    if stage == 0:
        elements += embedding_params(m) // tp
        tensors += 1
    if stage == pp - 1:
        elements += m.hidden
        tensors += 1
        if not m.tied or pp > 1:
            elements += m.vocab * m.hidden // tp
            tensors += 1
    expert_tensors = per_stage * m.mlp_matrices * (m.experts // ep)
    return StageParams(elements, tensors, per_stage, experts, expert_tensors)


def flops_per_token(m: ModelShape, seq_len: int) -> float:
    """Forward + backward model FLOPs per token, without recomputation (Korthikanti eq. 7, generalised).

    6 FLOPs per weight of every matrix multiply (blocks and head) plus the attention scores
    12·L·s·(heads·head_dim) (QKᵀ and AV, forward and backward, causal mask not halved); an MoE block
    counts its router and the k experts a token runs. Equal to
    :func:`zerotron.models.llama.model_flops_per_token` and, for a GPT model, to
    72·s·L·h²(1 + s/(6h) + V/(12hL)) per sequence.
    """
    n_matmul = m.layers * layer_active_matrix_params(m) + m.hidden * m.vocab
    return 6.0 * n_matmul + 12.0 * m.layers * seq_len * m.q_width


def recompute_flops_per_token(m: ModelShape, seq_len: int, recompute: str) -> float:
    """Extra FLOPs per token that recomputation adds: a block's forward (full) or the attention core's."""
    if recompute == "full":
        return 2.0 * m.layers * layer_active_matrix_params(m) + 4.0 * m.layers * seq_len * m.q_width
    if recompute == "selective":
        return 4.0 * m.layers * seq_len * m.q_width
    return 0.0


@dataclass(frozen=True)
class ParamList:
    """Element counts of one rank's parameter tensors in the engine's registration order.

    ``head`` before the blocks (the embedding), ``blocks`` one tuple per block, ``tail`` after them
    (final norm, output head). ZeRO's flat buckets and units are cut from these.
    """

    head: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]
    tail: tuple[int, ...]

    def ordered(self) -> list[int]:
        """Every tensor in registration order."""
        return [*self.head, *(n for block in self.blocks for n in block), *self.tail]


@functools.lru_cache(maxsize=4096)
def param_list(m: ModelShape, tp: int, pp: int, stage: int, layers: int) -> ParamList:
    """The tensors of pipeline stage ``stage`` on one tensor-parallel rank (see :func:`stage_params`).

    Dense models only: it mirrors the engine's registration order for the exact ZeRO accounting, and the
    engine has no MoE blocks.
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
