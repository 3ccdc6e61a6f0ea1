"""Model arithmetic shared by the engine and the planner (torch-free): shapes, parameter and FLOP counts.

:class:`ModelShape` holds a model's dimensions with the defaults resolved; the counts follow the
engine's model (:mod:`zerotron.models.llama`) exactly: per block two RMSNorm gains, q/k/v/o projections
(q/k/v biases with ``attention_bias``), the MLP (gate+up+down for ``gated``, up+down for ``plain``, no
biases); an embedding, a final norm and an output head (the embedding's tensor when tied).

Mixture-of-experts blocks (``num_local_experts`` E > 0, Mixtral's layout) replace the MLP by E expert
MLPs (``intermediate`` is then the experts' width, ``moe_intermediate_size`` where set) and a router
(h × E, no bias), plus an optional shared expert with its gate (Qwen2-MoE, counted with the router);
each token runs ``num_experts_per_tok`` k of the experts, so a block holds E MLPs' parameters but
computes with k. DeepSeek-V3's variants (``zerotron plan`` only; the engine refuses them): the first
``dense_layers`` blocks keep a dense MLP of ``dense_intermediate``, and the shared expert may be ungated.

Multi-head latent attention (``kv_lora`` > 0, DeepSeek-V2/V3; ``zerotron plan`` only) replaces the
q/k/v projections by down-projections (h × q_lora for queries, h × (kv_lora + rope) for the joint
latent and the shared rotary key), RMSNorms on both latents and up-projections (q_lora × heads·d_qk,
kv_lora × heads·(d_nope + d_v)); ``head_dim`` is then the query/key head width d_nope + d_rope and
``v_dim`` the value head width. The down-projections are replicated over tensor parallelism (as in
Megatron), the up-projections and the output projection split by heads.

:func:`flops_per_token` is the one FLOP count of the project (the trainer's MFU, the planner's
throughput); :func:`block_forward_flops` and :func:`head_forward_flops` weigh pipeline stages, which
:func:`balance_stages` splits for the engine and the planner alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zerotron.config import ModelConfig

# a block's projections, by module name: what train.precision=fp8 multiplies in float8
FLOAT8_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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
    shared: int = 0  # MoE: inner width of the always-on shared expert (0: none)
    norm_topk: bool = True  # MoE: the top-k weights renormalised
    sigmoid: bool = False  # MoE: sigmoid router scores (softmax otherwise)
    shared_gate: bool = True  # MoE: the shared expert has a sigmoid gate (Qwen2-MoE; not DeepSeek-V3)
    dense_layers: int = 0  # MoE: the first blocks keep a dense MLP (DeepSeek-V3's first_k_dense_replace)
    dense_intermediate: int = 0  # their MLP width
    q_lora: int = 0  # MLA: query down-projection rank (0: queries projected directly)
    kv_lora: int = 0  # MLA: joint key/value latent rank (0: ordinary attention)
    rope_dim: int = 0  # MLA: per-head width of the decoupled rotary query/key part
    v_dim: int = 0  # value head width (0: head_dim)

    @classmethod
    def from_config(cls, m: ModelConfig) -> ModelShape:
        """Dimensions of a (preset-applied) :class:`ModelConfig`."""
        return cls(
            hidden=m.hidden_size,
            layers=m.num_hidden_layers,
            heads=m.num_attention_heads,
            kv_heads=m.kv_heads,
            head_dim=m.dim_per_head,
            intermediate=m.expert_intermediate if m.num_local_experts else m.intermediate_size,
            vocab=m.vocab_size,
            gated=m.mlp == "gated",
            tied=m.tie_word_embeddings,
            qkv_bias=m.attention_bias,
            experts=m.num_local_experts,
            top_k=m.num_experts_per_tok if m.num_local_experts else 0,
            shared=m.shared_expert_intermediate_size if m.num_local_experts else 0,
            norm_topk=m.norm_topk_prob,
            sigmoid=m.scoring_func == "sigmoid",
            shared_gate=m.shared_expert_gate,
            dense_layers=m.first_k_dense_replace if m.num_local_experts else 0,
            dense_intermediate=m.intermediate_size if m.num_local_experts else 0,
            q_lora=m.q_lora_rank if m.kv_lora_rank else 0,
            kv_lora=m.kv_lora_rank,
            rope_dim=m.qk_rope_head_dim if m.kv_lora_rank else 0,
            v_dim=m.v_head_dim,
        )

    @property
    def q_width(self) -> int:
        """Width of all query heads together."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of all key heads together (of the values too, unless ``v_dim`` differs)."""
        return self.kv_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        """Per-head width of the values."""
        return self.v_dim or self.head_dim

    @property
    def v_width(self) -> int:
        """Width of all value heads together."""
        return self.kv_heads * self.value_dim

    @property
    def o_width(self) -> int:
        """Width of the attention output (the output projection's input)."""
        return self.heads * self.value_dim

    @property
    def core_width(self) -> int:
        """heads · (d_qk + d_v): the attention core's FLOPs per token pair are 2 · core_width forward."""
        return self.heads * (self.head_dim + self.value_dim)

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention."""
        return self.kv_lora > 0

    @property
    def moe_layers(self) -> int:
        """Blocks whose MLP is a mixture of experts."""
        return self.layers - self.dense_layers if self.experts else 0

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
        """Elements of one block's router (h × E; 0 when dense) and of its shared expert with its gate
        (3·h·I_shared + h): what every token runs besides attention and its k experts."""
        shared = (
            3 * self.hidden * self.shared + (self.hidden if self.shared_gate else 0) if self.shared else 0
        )
        return self.hidden * self.experts + shared


def attention_split_params(m: ModelShape) -> tuple[int, int]:
    """(elements tensor parallelism splits by heads, elements it replicates) of one block's attention
    weight matrices. Ordinary attention: q, k, v and o split (k/v replication under tp > kv_heads is the
    caller's); MLA: the up-projections and o split, the two down-projections are replicated."""
    h = m.hidden
    if not m.mla:
        return h * (m.q_width + m.kv_width + m.v_width) + m.o_width * h, 0
    nope = m.head_dim - m.rope_dim
    split = m.kv_lora * m.heads * (nope + m.value_dim) + m.o_width * h
    replicated = h * (m.kv_lora + m.rope_dim)
    if m.q_lora:
        split += m.q_lora * m.q_width
        replicated += h * m.q_lora
    else:
        split += h * m.q_width
    return split, replicated


def attention_matrix_params(m: ModelShape) -> int:
    """Elements of one block's attention projection weights (q/k/v/o, or MLA's five)."""
    return sum(attention_split_params(m))


def attention_norm_params(m: ModelShape) -> int:
    """Elements of MLA's latent RMSNorm gains (0 for ordinary attention)."""
    return (m.q_lora + m.kv_lora) if m.mla else 0


def mlp_params(m: ModelShape) -> int:
    """Elements of one MLP (one expert)."""
    return m.mlp_matrices * m.hidden * m.intermediate


def dense_mlp_params(m: ModelShape) -> int:
    """Elements of a dense-first block's MLP (DeepSeek-V3's first blocks; 0 when there are none)."""
    return m.mlp_matrices * m.hidden * m.dense_intermediate if m.dense_layers else 0


def layer_matrix_params(m: ModelShape) -> int:
    """Elements of the weight matrices of one block (attention, every MLP or expert, the router)."""
    return attention_matrix_params(m) + m.mlps * mlp_params(m) + m.router


def layer_active_matrix_params(m: ModelShape) -> int:
    """Weight elements one token multiplies in a block: attention, its k experts (or the MLP), router."""
    return attention_matrix_params(m) + m.active_mlps * mlp_params(m) + m.router


def _blocks_active_matrix_params(m: ModelShape) -> int:
    """Weight elements one token multiplies in all blocks (dense-first blocks with their own MLP)."""
    dense = m.dense_layers * (attention_matrix_params(m) + dense_mlp_params(m))
    return (m.layers - m.dense_layers) * layer_active_matrix_params(m) + dense


def flops_per_token(m: ModelShape, seq_len: int) -> float:
    """Forward + backward model FLOPs per token, without recomputation (Korthikanti eq. 7, generalised).

    6 FLOPs per weight of every matrix multiply (blocks and head) plus the attention scores
    6·L·s·heads·(d_qk + d_v) (QKᵀ and AV, forward and backward, causal mask not halved: 12·L·s·q for
    equal head widths); an MoE block counts its router and the k experts a token runs. For a GPT model,
    72·s·L·h²(1 + s/(6h) + V/(12hL)) per sequence. The trainer's MFU, the pipeline's stage balance and
    the planner all use this count.
    """
    n_matmul = _blocks_active_matrix_params(m) + m.hidden * m.vocab
    return 6.0 * n_matmul + 6.0 * m.layers * seq_len * m.core_width


def recompute_flops_per_token(m: ModelShape, seq_len: int, recompute: str) -> float:
    """Extra FLOPs per token that recomputation adds: a block's forward (full) or the attention core's."""
    if recompute == "full":
        return 2.0 * _blocks_active_matrix_params(m) + 2.0 * m.layers * seq_len * m.core_width
    if recompute == "selective":
        return 2.0 * m.layers * seq_len * m.core_width
    return 0.0


def block_forward_flops(m: ModelShape, seq_len: int, dense: bool = False) -> float:
    """Forward FLOPs per token of one block, as the engine weighs blocks to balance pipeline stages
    (``dense``: a dense-first block of an MoE model)."""
    attn = 2 * attention_matrix_params(m) + 2 * seq_len * m.core_width
    if dense:
        return float(attn + 2 * dense_mlp_params(m))
    return float(attn + 2 * m.active_mlps * mlp_params(m) + 2 * m.router)


def head_forward_flops(m: ModelShape) -> float:
    """Forward FLOPs per token of the output head (the last stage's extra work)."""
    return 2.0 * m.hidden * m.vocab


def balance_stages(
    costs: Sequence[float], n_stages: int, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[int]:
    """Blocks per stage of the contiguous split minimising the largest stage cost.

    ``costs[i]`` is block i's cost; ``first_extra``/``last_extra`` weigh on the first and last stage
    (embedding; output head and loss); every stage gets a block. Exact dynamic programming; the
    pipeline engine and the planner both split with it, so the planner's stages are the engine's.
    """
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot split {n} layers into {n_stages} pipeline stages; use at most {n} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        extra = (first_extra if k == 1 else 0.0) + (last_extra if k == n_stages else 0.0)
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
