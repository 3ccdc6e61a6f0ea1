"""Model arithmetic shared by the engine and the planner (torch-free): shapes, parameter and FLOP counts.

:class:`ModelShape` holds a model's dimensions with the defaults resolved; the counts follow the
engine's model (:mod:`zerotron.models.llama`) exactly: per block two RMSNorm gains, q/k/v/o projections
(q/k/v biases with ``attention_bias``), the MLP (gate+up+down for ``gated``, up+down for ``plain``, no
biases); an embedding, a final norm and an output head (the embedding's tensor when tied).

Mixture-of-experts blocks (``num_local_experts`` E > 0, Mixtral's layout) replace the MLP by E expert
MLPs (``intermediate`` is then the experts' width, ``moe_intermediate_size`` where set) and a router
(h × E, no bias), plus an optional shared expert with its gate (Qwen2-MoE, counted with the router);
each token runs ``num_experts_per_tok`` k of the experts, so a block holds E MLPs' parameters but
computes with k.

:func:`flops_per_token` is the one FLOP count of the project (the trainer's MFU, the planner's
throughput); :func:`block_forward_flops` and :func:`head_forward_flops` weigh pipeline stages, which
:func:`balance_stages` splits for the engine and the planner alike.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    shared: int = 0  # MoE: inner width of the always-on shared expert (0: none)
    norm_topk: bool = True  # MoE: the top-k weights renormalised
    sigmoid: bool = False  # MoE: sigmoid router scores (softmax otherwise)

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
        """Elements of one block's router (h × E; 0 when dense) and of its shared expert with its gate
        (3·h·I_shared + h): what every token runs besides attention and its k experts."""
        shared = 3 * self.hidden * self.shared + self.hidden if self.shared else 0
        return self.hidden * self.experts + shared


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


def flops_per_token(m: ModelShape, seq_len: int) -> float:
    """Forward + backward model FLOPs per token, without recomputation (Korthikanti eq. 7, generalised).

    6 FLOPs per weight of every matrix multiply (blocks and head) plus the attention scores
    12·L·s·(heads·head_dim) (QKᵀ and AV, forward and backward, causal mask not halved); an MoE block
    counts its router and the k experts a token runs. For a GPT model, 72·s·L·h²(1 + s/(6h) +
    V/(12hL)) per sequence. The trainer's MFU, the pipeline's stage balance and the planner all use
    this count.
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


def block_forward_flops(m: ModelShape, seq_len: int) -> float:
    """Forward FLOPs per token of one block, as the engine weighs blocks to balance pipeline stages."""
    attn = 2 * m.hidden * m.head_dim * (2 * m.heads + 2 * m.kv_heads) + 4 * seq_len * m.heads * m.head_dim
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
