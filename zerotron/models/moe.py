"""Mixture-of-experts blocks for the Llama-family model (Mixtral, Qwen2/3-MoE, OLMoE), one device first.

A :class:`MoEBlock` replaces a block's MLP when ``model.num_local_experts > 0``. Parameter names are
transformers' in-memory names: ``mlp.gate.weight`` (router, (E, h)), ``mlp.experts.gate_up_proj``
((E, 2I, h): each expert's gate rows then its up rows), ``mlp.experts.down_proj`` ((E, h, I)) and, with a
shared expert (Qwen2-MoE), ``mlp.shared_expert.{gate,up,down}_proj.weight`` and
``mlp.shared_expert_gate.weight``.

Routing: softmax over the router logits in fp32, top-k, optionally renormalised (``norm_topk_prob``).
Every token reaches its k experts (dropless). The experts run as one grouped GEMM over the tokens sorted
by expert (``torch._grouped_mm``) where the shapes allow it, else as a loop over experts; both give the
same values. Expert parallelism swaps the dispatch (:attr:`MoEBlock.dispatch`) for one that sends each
token slot to the rank holding its expert and back (:mod:`zerotron.parallel.expert`).

Load balancing: each block records the statistics of its last forward (:class:`RouterStats`); the caller
turns the whole model's into the auxiliary loss with :func:`router_losses` — transformers'
``load_balancing_loss_func`` (the Switch/Mixtral form, counts and probabilities pooled over all layers
and tokens), with the counts summed over the ranks that hold other tokens of the same batch, so a
data-parallel step gets the single process's loss — plus the optional router z-loss (ST-MoE).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from zerotron.config import ModelConfig


@dataclass
class RouterStats:
    """One block's routing on its last forward: top-k assignments per expert (E,) (no gradient), summed
    router probabilities per expert (E,) (in the graph), the tokens routed and Σ logsumexp(logits)²."""

    counts: torch.Tensor
    probs: torch.Tensor
    tokens: int
    z_sum: torch.Tensor


def _grouped_ok(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands: CPU or CUDA, 16-byte aligned rows."""
    if x.device.type not in ("cpu", "cuda") or not hasattr(torch, "_grouped_mm"):
        return False
    size = x.element_size()
    return all(
        w.dtype == x.dtype and (w.shape[-1] * size) % 16 == 0 and (w.shape[-2] * size) % 16 == 0
        for w in weights
    )


def expert_mlp(
    x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, grouped: bool
) -> torch.Tensor:
    """SwiGLU of each expert on its rows: x (n, h) sorted by expert, ``counts`` (E,) rows per expert,
    gate_up (E, 2I, h), down (E, h, I) -> (n, h). Grouped GEMM when ``grouped`` and the shapes allow.
    Under autocast both paths compute in its dtype (autocast casts ``F.linear``'s operands, not
    ``torch._grouped_mm``'s, so they are cast here)."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, gate_up, down = x.to(dtype), gate_up.to(dtype), down.to(dtype)
    if grouped and _grouped_ok(x, gate_up, down):
        offs = counts.cumsum(0).to(torch.int32)
        h1 = torch._grouped_mm(x, gate_up.transpose(1, 2), offs=offs)  # (n, 2I)
        gate, up = h1.chunk(2, dim=-1)
        act = (F.silu(gate) * up).contiguous()
        out: torch.Tensor = torch._grouped_mm(act, down.transpose(1, 2), offs=offs)  # (n, h)
        return out
    parts = []
    for e, part in enumerate(x.split(counts.tolist())):
        gate, up = F.linear(part, gate_up[e]).chunk(2, dim=-1)
        parts.append(F.linear(F.silu(gate) * up, down[e]))
    return torch.cat(parts) if parts else x.new_zeros((0, down.shape[1]))


ExpertsMlp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(x (n, h), counts (E,) or (E, S), gate_up (E, 2I, h), down (E, h, I)) -> (n, h)."""


class Experts(nn.Module):
    """The routed experts' stacked weights (``num_local`` of them on this rank)."""

    def __init__(self, num_local: int, hidden: int, intermediate: int, grouped: bool) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_local, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_local, hidden, intermediate))
        self.grouped = grouped
        # train.precision=fp8: the experts' MLP in float8 (zerotron.parallel.float8_experts), given the
        # rows per expert and source rank, whose scales it keeps apart
        self.float8_mlp: Optional[ExpertsMlp] = None

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (n, h) sorted by local expert (then by source rank under expert parallelism), ``counts``
        (num_local,) rows per expert or (num_local, sources) rows per expert and source -> (n, h)."""
        if self.float8_mlp is not None:
            return self.float8_mlp(x, counts, self.gate_up_proj, self.down_proj)
        per = counts.reshape(counts.shape[0], -1).sum(1)
        return expert_mlp(x, per, self.gate_up_proj, self.down_proj, self.grouped)


class Router(nn.Module):
    """Linear scores of each token for each expert (``weight`` (E, h)); with aux-loss-free balancing,
    the per-expert bias added to the scores for the top-k choice (``e_score_correction_bias`` (E,), fp32,
    moved outside autograd by :func:`update_router_bias`)."""

    def __init__(self, experts: int, hidden: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        if bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (n, h) -> logits (n, E)."""
        return F.linear(x, self.weight)


Dispatch = Callable[[torch.Tensor, torch.Tensor, Experts], torch.Tensor]
"""(token rows (n·k, h) sorted by global expert, tokens per global expert (E,), the local experts) -> the
experts' outputs for those rows, in the same order."""


def local_dispatch(x: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
    """Every expert is here: run them on their rows."""
    out: torch.Tensor = experts(x, counts)
    return out


class ExpertRegion(Protocol):
    """Expert tensor parallelism's tp region around the routed experts (set by the parallel layer)."""

    def enter(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's tokens, top-k weights and ids -> those every expert slice runs on."""
        ...

    def leave(self, out: torch.Tensor) -> torch.Tensor:
        """The experts' partial combined outputs -> this rank's tokens' outputs."""
        ...


class SharedExpert(nn.Module):
    """Qwen2-MoE's always-on expert: a SwiGLU MLP scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (n, h) -> (n, h)."""
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class MoEBlock(nn.Module):
    """Router, top-k routed experts and an optional shared expert, in place of a block's MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, e = cfg.hidden_size, cfg.num_local_experts
        self.num_experts, self.top_k, self.norm_topk = e, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.sigmoid, self.scaling = cfg.scoring_func == "sigmoid", cfg.routed_scaling_factor
        self.capacity_factor = cfg.expert_capacity_factor
        self.gate = Router(e, h, cfg.router_bias)
        self.experts = Experts(e, h, cfg.expert_intermediate, cfg.moe_grouped_gemm)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(h, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        self.dispatch: Dispatch = local_dispatch
        self.tp_region: Optional[ExpertRegion] = None  # expert tensor parallelism's (parallel/expert.py)
        self.stats: Optional[RouterStats] = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (n, h) -> (top-k weights (n, k) in x's dtype, expert ids (n, k)); records :attr:`stats`.

        Scores in fp32: softmax, or sigmoid (whose balancing statistics use the scores normalised per
        token, as Megatron does). The top-k choice adds the balancing bias when there is one; the
        weights are the chosen scores (renormalised with ``norm_topk_prob``, then scaled)."""
        logits = self.gate(x)  # (n, E)
        if self.sigmoid:
            scores = torch.sigmoid(logits.float())
            probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            scores = probs = torch.softmax(logits.float(), dim=-1)
        bias = getattr(self.gate, "e_score_correction_bias", None)
        choice = scores if bias is None else scores.detach() + bias
        ids = torch.topk(choice, self.top_k, dim=-1).indices  # (n, k)
        weights = scores.gather(1, ids)
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if self.sigmoid else 0.0))
        if self.scaling != 1.0:
            weights = weights * self.scaling
        with torch.no_grad():
            counts = torch.bincount(ids.flatten(), minlength=self.num_experts).float()
        z_sum = torch.logsumexp(logits.float(), dim=-1).square().sum()
        self.stats = RouterStats(counts, probs.sum(0), x.shape[0], z_sum)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, s, h) -> (b, s, h)."""
        shape = x.shape
        mine = x.reshape(-1, shape[-1])  # (n, h)
        weights, ids = self.route(mine)
        flat = mine  # the tokens the experts see: under expert tensor parallelism, the tp group's
        if self.tp_region is not None:
            flat, weights, ids = self.tp_region.enter(mine, weights, ids)
        slot_weight, slot_expert = weights.flatten(), ids.flatten()  # per (token, choice) slot
        slots = torch.arange(slot_expert.numel(), device=x.device)
        if self.capacity_factor:  # the slots each expert keeps, per sequence
            seq = shape[-2] if x.dim() == 3 else flat.shape[0]
            capacity = math.ceil(self.capacity_factor * seq * self.top_k / self.num_experts)
            keep = capacity_keep(
                slot_weight.detach(), slot_expert, seq * self.top_k, self.num_experts, capacity
            )
            slots = slots[keep]
        order = torch.argsort(slot_expert[slots], stable=True)
        sorted_slots = slots[order]
        counts = torch.bincount(slot_expert[slots], minlength=self.num_experts)
        token = sorted_slots // self.top_k  # the token of each sorted slot
        rows = flat[token]
        if torch.is_autocast_enabled(x.device.type):  # tokens travel and meet the experts in 16 bits
            rows = rows.to(torch.get_autocast_dtype(x.device.type))
        out_sorted = self.dispatch(rows, counts, self.experts)  # (slots, h)
        out_sorted = out_sorted * slot_weight[sorted_slots, None]
        out = torch.zeros_like(flat).index_add_(0, token, out_sorted.to(flat.dtype))
        if self.tp_region is not None:
            out = self.tp_region.leave(out)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(mine)) * self.shared_expert(mine)
        return out.reshape(shape)


def capacity_keep(
    weight: torch.Tensor, expert: torch.Tensor, slots_per_seq: int, experts: int, capacity: int
) -> torch.Tensor:
    """Which slots (token, choice) survive a per-sequence expert capacity: of each sequence's slots
    routed to an expert, the ``capacity`` with the highest weights (ties: the earlier slot). ``weight``
    and ``expert`` are (n·k,), sequences are consecutive runs of ``slots_per_seq`` slots."""
    n = weight.numel()
    group = torch.arange(n, device=weight.device) // slots_per_seq * experts + expert
    order = torch.argsort(weight, descending=True, stable=True)
    order = order[torch.argsort(group[order], stable=True)]  # by group, heaviest first within it
    grouped = group[order]
    sizes = torch.bincount(grouped, minlength=int(grouped.max()) + 1 if n else 0)
    rank = torch.arange(n, device=weight.device) - (sizes.cumsum(0) - sizes)[grouped]
    keep = torch.empty(n, dtype=torch.bool, device=weight.device)
    keep[order] = rank < capacity
    return keep


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """The model's MoE blocks, in order."""
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


@dataclass
class RouterLosses:
    """A micro-step's router losses (fp32 scalars in the graph) and the global expert load (E,)."""

    aux: torch.Tensor
    z: torch.Tensor
    load: torch.Tensor
    block_counts: torch.Tensor  # (blocks, E) this rank's assignments per block (not reduced)


def router_losses(
    model: nn.Module, all_reduce: Callable[[torch.Tensor], None] | None = None
) -> Optional[RouterLosses]:
    """The auxiliary load-balancing loss and the z-loss of the model's last forward (None without MoE).

    ``aux = E · Σ_e (c_e / R)(p_e / R)`` with ``c_e`` the top-k assignments of expert e and ``p_e`` its
    summed router probability over all blocks and tokens, ``R`` the routed rows summed over blocks: what
    transformers computes. ``all_reduce`` sums a tensor over the ranks holding the batch's other
    tokens: the counts and rows are summed there (no gradient), so each rank's ``p_e`` term is its part
    of the global loss and the ranks' gradients add up to the single process's. ``z`` is
    Σ_blocks mean_tokens logsumexp(logits)², each rank's part likewise.
    """
    blocks = [b for b in moe_blocks(model) if b.stats is not None]
    if not blocks:
        return None
    stats = [b.stats for b in blocks if b.stats is not None]
    counts = torch.stack([s.counts for s in stats]).sum(0)  # (E,)
    totals = torch.cat([counts, counts.new_tensor([float(sum(s.tokens for s in stats))])])
    block_counts = torch.stack([s.counts for s in stats])  # (blocks, E)
    z_sum = torch.stack([s.z_sum for s in stats]).sum()
    if all_reduce is not None:
        all_reduce(totals)
    counts, rows = totals[:-1], totals[-1]
    probs = torch.stack([s.probs for s in stats]).sum(0)  # (E,) this rank's, in the graph
    experts = counts.shape[0]
    aux = experts * (counts / rows * probs / rows).sum()
    z = z_sum * len(stats) / rows  # Σ_blocks of the mean over the global tokens of each block
    for b in blocks:
        b.stats = None
    return RouterLosses(aux, z, counts, block_counts)


def update_router_bias(model: nn.Module, block_load: torch.Tensor, rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): each block's bias moves by ``rate`` toward balance, up for
    an expert that got fewer than the mean assignments of the step, down for one that got more.
    ``block_load`` (blocks, E) is the step's assignments over the global batch, the same on every rank,
    so every replica of a router moves its bias alike."""
    blocks = [b for b in moe_blocks(model) if hasattr(b.gate, "e_score_correction_bias")]
    if len(blocks) != block_load.shape[0]:
        raise ValueError(f"{len(blocks)} routers with a bias, but loads for {block_load.shape[0]} blocks")
    with torch.no_grad():
        for block, load in zip(blocks, block_load):
            bias = block.gate.get_buffer("e_score_correction_bias")
            bias += rate * torch.sign(load.mean() - load).to(bias)
