"""Time per optimizer step: compute, collectives (α–β per link), overlap, pipeline bubble, offload.

- Compute: each block's GEMMs (q/k/v, output projection, MLP in and out; MoE experts and router) at
  ``peak × gemm_efficiency(shape)``, which rises with the geometric mean of the GEMM's dimensions
  (:func:`gemm_efficiency`); the attention core at the profile's ``attention_efficiency`` (fused,
  causal: half the scores) or as batched GEMMs (unfused); FP8 GEMMs at the FP8 peak and
  ``fp8_efficiency``; element-wise kernels memory-bound, fused (Megatron, Transformer Engine) or eager
  (one kernel per operation: the profile's ``eager_elementwise`` times the fused block's time); the
  loss's fp32 log-softmax at :data:`LOSS_BYTES_PER_LOGIT`. Recomputation repeats the forward.
- A collective over n ranks moving S bytes costs ``α·steps + bus_bytes / (bw·comm_efficiency)`` with
  NCCL's bus convention (all-reduce 2S(n−1)/n, all-gather and reduce-scatter S(n−1)/n). Its link is the
  node's (``intra_bw``) when the group fits in a node, else the network: ``k × inter_bw`` for k group
  members per node (NCCL drives one NIC per GPU), capped by the intra-node link.
- Overlap: tensor-parallel collectives are exposed unless ``tp_comm_overlap``: then as Transformer
  Engine's userbuffers run them (copy-engine all-gathers under their GEMMs, reduce-scatters in chunks
  on 16 SMs that the GEMM gives up: :mod:`zerotron.plan.tensor_parallel`); data-parallel gradient
  reduction runs under the backward of the last micro-batch (ZeRO-2: of every micro-batch); ZeRO-3's
  parameter all-gathers are prefetched under each micro-batch's compute; context-parallel K/V exchange
  under the attention core; every such NCCL collective still lengthens the step by at least
  ``overlap_contention`` of its time at the node's link speed (:func:`_exposed`: its kernels take SMs
  and memory bandwidth from the compute they hide under); pipeline sends are exposed. On a
  ``shared_host`` (CPU ranks) nothing overlaps: the same cores run both.
- Pipeline sends: a stage's output, split over its tp ranks (Megatron's scatter/gather) unless
  ``pp_scatter_gather`` is off (DeepSpeed's pipeline engine: every tp rank sends all of it).
- Pipeline bubble: ``(p − 1)/m`` of the stage time for GPipe and 1F1B, ``(p − 1)/(v·m)`` interleaved,
  a third of 1F1B's for the zero-bubble schedule (ZB-H1).
- Optimizer step: memory-bound on the device (reads and writes every state byte once), or the host's
  CPU Adam plus PCIe transfers (and NVMe reads/writes) when offloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from zerotron.layout import hybrid, ulysses_size
from zerotron.plan.hardware import Hardware
from zerotron.plan.layout import ACT_BYTES, Layout, Workload, micro_batches
from zerotron.shapes import ModelShape


def gemm_efficiency(hw: Hardware, rows: float, cols: float, inner: float, precision: str = "bf16") -> float:
    """Fraction of peak a (rows × inner)·(inner × cols) matrix multiply reaches: e·g/(g + knee), where g
    is the geometric mean of its three dimensions (the work per output tile and the number of tiles
    both grow with it; small or thin GEMMs leave the tensor cores idle between tiles and waves).
    ``e`` is ``fp8_efficiency`` for FP8 GEMMs (of the FP8 peak), else ``gemm_efficiency``."""
    g = (max(rows, 1.0) * max(cols, 1.0) * max(inner, 1.0)) ** (1.0 / 3.0)
    top = hw.fp8_efficiency if precision == "fp8" else hw.gemm_efficiency
    return cast(float, top * g / (g + hw.gemm_knee))


def _cover(hw: Hardware, seconds: float) -> float:
    """Compute time a collective can hide under: none on a ``shared_host`` (CPU ranks: the same cores
    run the collective and the kernels, with no copy engine to overlap them)."""
    return 0.0 if hw.shared_host else seconds


def _exposed(hw: Hardware, traffic: float, compute: float, share: float = 1.0) -> float:
    """Seconds a collective of ``traffic`` seconds adds to a step when it runs under ``compute`` seconds
    of kernels: what the compute cannot cover, and at least ``overlap_contention`` of the time it would
    take at the node's link speed (``share`` of its time: :func:`node_share`). Its kernels take SMs and
    memory bandwidth from the ones it hides under in proportion to the bytes they move, not to how long
    the link makes them wait."""
    return max(0.0, traffic - _cover(hw, compute), hw.overlap_contention * share * traffic)


def node_share(stride: int, size: int, hw: Hardware) -> float:
    """A group's link bandwidth as a fraction of the node's (1 inside a node; the network's share of
    it across nodes): the part of an overlapped collective's time in which it loads the GPU as a
    collective inside a node would."""
    if size <= 1:
        return 1.0
    return min(1.0, link(stride, size, hw)[0] / (hw.intra_bw * hw.comm_efficiency))


def members_per_node(stride: int, size: int, hw: Hardware) -> int:
    """Members of a group (ranks ``stride`` apart, ``size`` of them) that share one node."""
    if stride >= hw.gpus_per_node:
        return 1
    return max(1, min(size, hw.gpus_per_node // stride))


def link(stride: int, size: int, hw: Hardware) -> tuple[float, float]:
    """(bandwidth, latency) of a group of ``size`` ranks ``stride`` apart in the rank grid."""
    k = members_per_node(stride, size, hw)
    if k >= size:
        return hw.intra_bw * hw.comm_efficiency, hw.intra_latency_s
    return min(hw.intra_bw, k * hw.inter_bw) * hw.comm_efficiency, hw.inter_latency_s


def collective_time(op: str, nbytes: float, size: int, stride: int, hw: Hardware) -> float:
    """Seconds of one ``all_reduce``/``all_gather``/``reduce_scatter``/``send`` of ``nbytes`` (α–β, ring)."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    bw, alpha = link(stride, size, hw)
    if op == "send":
        return alpha + nbytes / bw
    if op == "all_to_all":  # every rank to every rank directly: no ring that crosses a node once
        return (size - 1) * alpha + _all_to_all_wire(nbytes, size, stride, hw)
    factor = 2.0 if op == "all_reduce" else 1.0
    return factor * (size - 1) * alpha + factor * nbytes * (size - 1) / size / bw


def _all_to_all_wire(nbytes: float, size: int, stride: int, hw: Hardware) -> float:
    """Seconds on the wire of an all-to-all of ``nbytes`` per rank: of the ``(size-1)/size`` that leave
    a rank, the part for ranks on other nodes goes out through the rank's own network link
    (``inter_bw``) while the part for its node's ranks crosses the node's fabric, at the same time. A
    ring collective over nodes crosses each node boundary once, on all of a node's links (:func:`link`:
    ``k * inter_bw``); an all-to-all sends ``(size-k)/size`` of every rank's bytes across, which is why
    ZeRO++'s qgZ reduces inside a node first."""
    k = members_per_node(stride, size, hw)
    inside = nbytes * (min(k, size) - 1) / size / (hw.intra_bw * hw.comm_efficiency)
    if k >= size:
        return inside
    return max(inside, nbytes * (size - k) / size / (hw.inter_bw * hw.comm_efficiency))


def strides(layout: Layout) -> dict[str, int]:
    """Distance between neighbours of each mesh axis in the (dp, pp, cp, tp) rank grid."""
    return {"tp": 1, "cp": layout.tp, "pp": layout.tp * layout.cp, "dp": layout.tp * layout.cp * layout.pp}


def block_gemms(m: ModelShape, layout: Layout, work: Workload) -> list[tuple[float, float, float, float]]:
    """``(rows, cols, inner, count)`` of one block's forward matrix multiplies on one rank.

    Tokens ``T = b·s/cp``; q/k/v (one fused GEMM) and the output projection split their heads over tp;
    the MLP (gate and up fused) splits its inner width. An MoE block runs E/ep whole experts per rank,
    each on the ``T'·k·ep/E`` tokens routed to it on average (``T' = T/tp`` under sequence parallelism,
    ``T`` without: every tp rank routes the tokens it holds; with expert tp, a 1/tp slice of each expert
    on the ``T·k·ep/E`` tokens of the whole tp group), plus the router and any shared expert.
    """
    t, tp, h = layout.micro_batch * work.seq_len / layout.cp, layout.tp, m.hidden
    width = m.intermediate * (2 if m.gated else 1)
    shapes = attention_gemms(m, t, tp)
    if m.experts:  # whole experts on every tp rank, on its sequence shard under SP (all tokens without)
        routed = t / tp if layout.sequence_parallel else t
        etp = layout.etp  # expert tp: a 1/tp slice of every expert on all the tp group's tokens
        dispatched = t if etp > 1 else routed
        per_expert = max(1.0, dispatched * m.top_k * layout.ep / m.experts)
        local = m.experts / layout.ep
        shapes += [(per_expert, width / etp, h, local), (per_expert, h, m.intermediate / etp, local)]
        shapes.append((routed, m.router // h, h, 1.0))  # router (and shared expert, as one GEMM)
    else:
        shapes += [(t, width / tp, h, 1.0), (t, h, m.intermediate / tp, 1.0)]
    return shapes


def block_gemm_names(m: ModelShape) -> list[str]:
    """Names of :func:`block_gemms`' entries, in order."""
    if m.mla:
        attn = (["q-down", "q-up"] if m.q_lora else ["q"]) + ["kv-down", "kv-up", "out-proj"]
    else:
        attn = ["q/k/v", "out-proj"]
    return attn + ["mlp-in", "mlp-out"] + (["router"] if m.experts else [])


def attention_gemms(m: ModelShape, t: float, tp: int) -> list[tuple[float, float, float, float]]:
    """The attention projections of one block: q/k/v fused and o, split by heads; MLA's replicated
    down-projections (queries, then the joint key/value latent with the rotary key) and its split
    up-projections and o."""
    h = m.hidden
    if not m.mla:
        return [(t, (m.q_width + m.kv_width + m.v_width) / tp, h, 1.0), (t, h, m.o_width / tp, 1.0)]
    if m.q_lora:
        shapes = [(t, float(m.q_lora), h, 1.0), (t, m.q_width / tp, m.q_lora, 1.0)]
    else:
        shapes = [(t, m.q_width / tp, h, 1.0)]
    up = m.heads * (m.head_dim - m.rope_dim + m.value_dim) / tp
    shapes += [(t, float(m.kv_lora + m.rope_dim), h, 1.0), (t, up, m.kv_lora, 1.0)]
    return shapes + [(t, h, m.o_width / tp, 1.0)]


def gemm_seconds(hw: Hardware, precision: str, shapes: list[tuple[float, float, float, float]]) -> float:
    """Seconds of the forward GEMMs ``shapes`` (2·rows·cols·inner FLOPs each)."""
    peak = hw.flops(precision)
    return sum(
        2.0 * r * c * k * n / (peak * gemm_efficiency(hw, r, c, k, precision)) for r, c, k, n in shapes
    )


def _attention_dtype(precision: str) -> str:
    """FP8 recipes (Transformer Engine) keep the attention core in bf16."""
    return "bf16" if precision == "fp8" else precision


def attention_seconds(m: ModelShape, layout: Layout, work: Workload, hw: Hardware, flash: bool) -> float:
    """Seconds of one block's attention core (QKᵀ and AV) forward on one rank, for one micro-batch.

    Fused (flash) attention skips the masked half of a causal score matrix and runs at the profile's
    ``attention_efficiency``; unfused attention computes every score with batched GEMMs of head_dim
    depth (their efficiency from the same GEMM law). The FLOP count is Megatron's 4·T·s·q/tp
    (2·T·s·heads·(d_qk + d_v)/tp when value heads are narrower, as MLA's).
    """
    t = layout.micro_batch * work.seq_len / layout.cp
    flops = 2.0 * t * work.seq_len * m.core_width / layout.tp
    peak = hw.flops(_attention_dtype(work.precision))
    if flash:
        return 0.5 * flops / (peak * hw.attention_efficiency)
    return flops / (peak * gemm_efficiency(hw, work.seq_len, work.seq_len, m.head_dim))


def microbatch_compute(
    m: ModelShape, layout: Layout, work: Workload, hw: Hardware, layers: int, head: bool, flash: bool = True
) -> float:
    """Seconds of one micro-batch's forward+backward(+recompute) on a rank with ``layers`` blocks (and
    the output head when ``head``).

    A backward pass is two GEMMs of each forward GEMM's size (input and weight gradients): 3 forward
    passes in all, 4 with full recomputation; the attention core is recomputed under selective
    recomputation too. Element-wise work (norms, activations, residual adds, dropout, and the softmax
    over scores without flash attention) is memory-bound: see :func:`elementwise_bytes_per_token`.
    """
    s = work.seq_len
    passes = 4.0 if layout.recompute == "full" else 3.0
    attn_passes = 3.0 if layout.recompute == "none" else 4.0
    block = passes * gemm_seconds(hw, work.precision, block_gemms(m, layout, work))
    block += attn_passes * attention_seconds(m, layout, work, hw, flash)
    tokens = layout.micro_batch * s / layout.cp
    seconds = block * layers
    if head:
        seconds += 3.0 * gemm_seconds(hw, work.precision, [(tokens, m.vocab / layout.tp, m.hidden, 1.0)])
        # the loss's fp32 log-softmax over the logits, forward and backward
        seconds += tokens * m.vocab / layout.tp * LOSS_BYTES_PER_LOGIT / hw.memory_bw
    mem_bytes = elementwise_bytes_per_token(m, layout, work, flash, hw.eager_elementwise) * tokens * layers
    return seconds + mem_bytes / hw.memory_bw


# Passes (reads + writes) over activation tensors per layer and token, forward + backward, of the
# memory-bound kernels of a fused Megatron block: two norms, two residual adds, dropout and bias adds
# over h; the MLP activation over the FFN width; scale-mask-softmax and dropout over the scores when
# attention is not fused (flash).
HIDDEN_PASSES = 40.0
FFN_PASSES = 5.0
SCORE_PASSES = 10.0
# Bytes per logit of the loss (the 16-bit logits cast to fp32, max, exponentials, sums, the softmax's
# gradient, cast back): 22 ms for 8 x 2,048 x 128,256 logits on one H100 (BENCHMARKS.md, "bf16 MFU of a
# ~1B Llama") at the data-sheet 3.35 TB/s is 35 bytes. Megatron's vocab-parallel cross entropy runs
# the same fp32 operations one kernel each on a rank's vocab/tp slice, so the figure holds for both.
LOSS_BYTES_PER_LOGIT = 35.0


def elementwise_bytes_per_token(
    m: ModelShape, layout: Layout, work: Workload, flash: bool = True, eager: float = 1.0
) -> float:
    """Bytes of memory traffic per token and layer of the element-wise kernels on one rank.

    The h-sized tensors are replicated on every tensor-parallel rank unless sequence parallelism
    splits them; full recomputation repeats the forward third; eager blocks (``layout.kernels``) take
    the profile's ``eager_elementwise`` times the fused block's time.
    """
    a = ACT_BYTES[work.precision]
    hidden = HIDDEN_PASSES * m.hidden / (layout.tp if layout.sequence_parallel else 1)
    ffn = FFN_PASSES * m.intermediate * (2 if m.gated else 1) * m.active_mlps / layout.tp
    scores = 0.0 if flash else SCORE_PASSES * m.heads / layout.tp * work.seq_len
    repeat = 4.0 / 3.0 if layout.recompute == "full" else 1.0
    return (hidden + ffn + scores) * a * repeat * (eager if layout.kernels == "eager" else 1.0)


def _cp_groups(layout: Layout) -> tuple[int, int]:
    """(all-to-all group size, ring size) of the layout's ``cp_comm``."""
    u = ulysses_size(layout.cp_comm, layout.cp, layout.cp_ulysses_size)
    return u, layout.cp // u


def context_parallel_calls(
    m: ModelShape, layout: Layout, work: Workload
) -> list[tuple[str, str, float, int]]:
    """Every context-parallel transfer of one block's forward and backward on one rank, as (group,
    op, bytes of the buffer, group size) — the engine's calls (:mod:`zerotron.parallel.context`):
    K/V travel in the compute dtype, their gradients round the ring in fp32; ulysses moves q, k, v and
    the output each way; allgather gathers K/V and reduce-scatters their gradients. Recomputing the core
    (selective or full) runs its forward transfers again in backward."""
    if layout.cp == 1:
        return []
    a = ACT_BYTES[work.precision]
    t = layout.micro_batch * work.seq_len / layout.cp  # this rank's tokens
    kvh_local = max(1, m.kv_heads // layout.tp)
    q, kv = m.q_width / layout.tp, m.kv_width / min(layout.tp, m.kv_heads)
    forwards = 2 if layout.recompute in ("selective", "full") else 1
    if layout.cp_comm == "allgather":
        gathered = layout.cp * t * kv * a
        gather, scatter = (
            ("cp", "all_gather", gathered, layout.cp),
            ("cp", "reduce_scatter", gathered, layout.cp),
        )
        return [gather] * 2 * forwards + [scatter] * 2
    u, r = _cp_groups(layout)
    a2a, ring = ("cp_ulysses", "cp_ring") if layout.cp_comm == "hybrid" else ("cp", "cp")
    calls: list[tuple[str, str, float, int]] = []
    if u > 1:
        kv_sent = kv if kvh_local % u == 0 else q  # repeated per query head when u does not divide them
        one_way = [(a2a, "all_to_all", t * w * a, u) for w in (q, kv_sent, kv_sent)]
        back = [(a2a, "all_to_all", t * q * a, u)]
        calls += (one_way + back) * forwards + (back + one_way)  # backward: dO in, dq/dk/dv out
        kv = kv_sent / u
        t *= u
    if r > 1:
        block = 2 * t * kv
        passes = [(ring, op, block * a, r) for op in ("send", "recv")] * (r - 1)
        grads = [(ring, op, block * 4, r) for op in ("send", "recv")] * r
        calls += passes * (forwards + 1) + grads
    return calls


def context_parallel_bytes(m: ModelShape, layout: Layout, work: Workload) -> dict[str, dict[str, int]]:
    """Bytes one block's forward and backward count on one rank, by group and op (the engine's
    ``comm_bytes`` convention of :mod:`zerotron.distributed.collectives`, floored per call)."""
    out: dict[str, dict[str, int]] = {}
    for group, op, nbytes, size in context_parallel_calls(m, layout, work):
        counted = int(nbytes) if op in ("send", "recv") else int(nbytes) * (size - 1) // size
        out.setdefault(group, {}).setdefault(op, 0)
        out[group][op] += counted
    return out


def context_parallel_time(m: ModelShape, layout: Layout, work: Workload, hw: Hardware, layers: int) -> float:
    """Exposed context-parallel communication of one micro-batch: the ring's point-to-point passes
    hide under the attention they run beside (three attention passes' worth, forward and backward);
    all-to-all, all-gather and reduce-scatter wait for their results (not overlapped)."""
    stride = strides(layout)["cp"]
    u, _ = _cp_groups(layout)
    ring_s, other_s = 0.0, 0.0
    for _group, op, nbytes, size in context_parallel_calls(m, layout, work):
        if op == "recv":
            continue  # a pass is one send and its receive
        if op == "send":
            ring_s += collective_time("send", nbytes, size, stride * u, hw)
        elif op == "all_to_all":
            other_s += all_to_all_time(nbytes, size, stride, hw)
        else:
            other_s += collective_time(op, nbytes, size, stride, hw)
    attn = 3.0 * attention_seconds(m, layout, work, hw, flash=True)
    ring = max(1, layout.cp // u)
    return (_exposed(hw, ring_s, attn, node_share(stride * u, ring, hw)) + other_s) * layers


def all_to_all_time(nbytes: float, size: int, stride: int, hw: Hardware) -> float:
    """Seconds of one all-to-all in which every rank sends ``nbytes`` in all, (size−1)/size of it away."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    bw, alpha = link(stride, size, hw)
    return (size - 1) * alpha + nbytes * (size - 1) / size / bw


def expert_parallel_bytes(m: ModelShape, layout: Layout, work: Workload) -> float:
    """Bytes one rank sends on its ep group in one step, as the engine counts them: per block and
    micro-batch, the per-expert counts (int64, forward) and the dispatch and combine all-to-alls
    (forward and backward; full recomputation repeats the forward ones) of its ``T·k`` token slots
    (``T = b·s/cp``, /tp under sequence parallelism) in the compute dtype, of which, with balanced
    routing, a fraction (ep − 1)/ep leaves the rank."""
    if not m.experts or layout.ep == 1:
        return 0.0
    ep, full = layout.ep, layout.recompute == "full"
    tokens = layout.micro_batch * work.seq_len / layout.cp
    if layout.sequence_parallel and layout.etp == 1:  # expert tp dispatches the tp group's tokens
        tokens /= layout.tp
    slots_out = tokens * m.top_k * (ep - 1) / ep
    counts = 8 * m.experts * (ep - 1) // ep
    per_block = (2 if full else 1) * counts + (6 if full else 4) * slots_out * m.hidden * ACT_BYTES[
        work.precision
    ]
    return per_block * m.moe_layers * micro_batches(layout, work)


def expert_parallel_time(m: ModelShape, layout: Layout, work: Workload, hw: Hardware, layers: int) -> float:
    """Exposed MoE token exchange of one micro-batch: per block a dispatch and a combine all-to-all
    forward and two backward (full recomputation repeats the forward pair), each moving the rank's
    b·s/cp tokens (b·s/(cp·tp) under sequence parallelism) k times (Megatron's all-to-all dispatcher, without overlap). The ep group folds over
    the context-parallel ranks first, then the data-parallel ones, so its link is theirs."""
    if not m.experts or layout.ep == 1:
        return 0.0
    a = ACT_BYTES[work.precision]
    nbytes = layout.micro_batch * work.seq_len / layout.cp * m.top_k * m.hidden * a
    if layout.sequence_parallel and layout.etp == 1:  # each tp rank exchanges its sequence shard's
        nbytes /= layout.tp
    stride = strides(layout)["cp" if layout.cp > 1 else "dp"]
    count = 4 + (2 if layout.recompute == "full" else 0)
    return count * all_to_all_time(nbytes, layout.ep, stride, hw) * layers


def pipeline_times(
    m: ModelShape, layout: Layout, work: Workload, hw: Hardware, t_mb: float
) -> dict[str, float]:
    """Bubble and exposed point-to-point sends of one step (``t_mb``: one micro-batch on a stage)."""
    if layout.pp == 1:
        return {"pipeline_bubble": 0.0, "pipeline_p2p": 0.0}
    n_mb = micro_batches(layout, work)
    v = layout.virtual_stages if layout.pp_schedule == "interleaved" else 1
    bubble = (layout.pp - 1) / (v * n_mb) * n_mb * t_mb
    if layout.pp_schedule == "zb":
        bubble /= 3.0
    nbytes = layout.micro_batch * work.seq_len / layout.cp * m.hidden * ACT_BYTES[work.precision]
    if layout.tp > 1 and (layout.sequence_parallel or layout.pp_scatter_gather):
        nbytes /= layout.tp  # Megatron's scatter/gather: each tp rank sends its slice
    send = collective_time("send", nbytes, layout.pp, strides(layout)["pp"], hw)
    return {"pipeline_bubble": bubble, "pipeline_p2p": 2 * v * n_mb * send}


@dataclass(frozen=True)
class DataGroup:
    """The ranks one class of parameters reduces its gradients over: ``ranks`` of them, ``stride``
    apart in the rank grid, ZeRO sharding over blocks of ``shards`` consecutive ones (``ranks``
    without hybrid sharding)."""

    ranks: int
    shards: int
    stride: int

    @classmethod
    def of(cls, layout: Layout, ranks: int | None = None, stride: int | None = None) -> DataGroup:
        """The data-parallel group of ``layout`` (or ``ranks`` of them, ``stride`` apart: the dp·cp
        ranks of dense parameters, the dp·cp/ep replicas of experts), hybrid sharding's blocks of
        ``zero_shard_size`` ranks where they are smaller."""
        ranks = layout.dp if ranks is None else ranks
        blocks = hybrid(ranks, layout.zero, layout.zero_shard_size)
        return cls(
            ranks,
            layout.zero_shard_size if blocks else ranks,
            strides(layout)["dp"] if stride is None else stride,
        )


def data_parallel_time(
    layout: Layout,
    hw: Hardware,
    group: DataGroup,
    grads: float,
    params: float | tuple[float, float],
    t_mb: float,
    n_mb: int,
    layers: int = 1,
) -> dict[str, float]:
    """Exposed data-parallel traffic of one step for the ZeRO stage (ZeRO paper: 2Ψ, or 3Ψ at stage 3)
    over ``group``, of ``grads`` and ``params`` bytes (a stage's elements in the gradients' and the
    gathered weights' wire dtypes; ``params`` as (forward, backward) when backward gathers other bytes:
    hpZ's second copy, in the working dtype however the forward's gathers are quantised).

    ZeRO-3 gathers and reduce-scatters module by module: ``layers`` collectives per pass, each paying
    the ring's latency. Hybrid sharding (blocks of S < the group's ranks): ZeRO's collectives run inside
    blocks of S consecutive ranks, and each step's gradient shard (1/S of the gradients) is all-reduced
    across the blocks after backward, on the link that spans them (exposed). hpZ (``layout.zero_hpz_size`` > 1):
    backward's gathers run inside blocks of that many consecutive ranks instead of over the whole
    group.
    """
    if group.ranks == 1:
        return {"dp_grad_reduce": 0.0, "dp_param_gather": 0.0}
    stride, n = group.stride, group.shards
    across = 0.0
    if n < group.ranks:
        across = collective_time("all_reduce", grads / n, group.ranks // n, stride * n, hw)
    forward, backward = params if isinstance(params, tuple) else (params, params)
    times = _zero_times(layout, hw, DataGroup(n, n, stride), grads, (forward, backward), t_mb, n_mb, layers)
    times["dp_grad_reduce"] += across
    return times


def _zero_times(
    layout: Layout,
    hw: Hardware,
    block: DataGroup,
    grads: float,
    both: tuple[float, float],
    t_mb: float,
    n_mb: int,
    layers: int,
) -> dict[str, float]:
    """:func:`data_parallel_time` over one ``block`` of ranks (the whole group, or a hybrid block);
    ``both``: the forward's and the backward's gathered bytes."""
    n, stride = block.ranks, block.stride
    params, secondary = both
    if n == 1:
        return {"dp_grad_reduce": 0.0, "dp_param_gather": 0.0}
    backward = t_mb * 2.0 / 3.0
    if layout.zero in (1, 2) and layout.zero_one_interval:  # 0/1 Adam: every H local steps, the change's
        # bits (an all-to-all, then an all-gather) and ZeRO's gather of the weights; nothing between
        h = layout.zero_one_interval
        bits = collective_time("all_to_all", grads, n, stride, hw) + collective_time(
            "all_gather", grads, n, stride, hw
        )
        return {
            "dp_grad_reduce": bits / h,
            "dp_param_gather": collective_time("all_gather", params, n, stride, hw) / h,
        }
    if layout.zero <= 1:
        if layout.zero == 0 and layout.onebit_adam:  # the bits: an all-to-all, then an all-gather
            reduce = collective_time("all_to_all", grads, n, stride, hw)
            reduce += collective_time("all_gather", grads, n, stride, hw)
            reduce /= max(1, layout.zero_one_interval)  # 0/1 Adam: once every H local steps
        elif layout.zero == 0:
            reduce = collective_time("all_reduce", grads, n, stride, hw)
        else:
            reduce = _reduce_scatter(layout, grads, n, stride, hw)
        if not layout.onebit_adam:  # 1-bit Adam averages the momentum after backward, not under it
            reduce = _exposed(hw, reduce, backward, node_share(stride, n, hw))
        gather = _shard_gather(layout, hw, params, block, t_mb) if layout.zero == 1 else 0.0
        return {"dp_grad_reduce": reduce, "dp_param_gather": gather}
    per_mb_reduce = _reduce_scatter(layout, grads, n, stride, hw)
    if layout.zero == 2:
        reduce = n_mb * _exposed(hw, per_mb_reduce, backward, node_share(stride, n, hw))
        return {"dp_grad_reduce": reduce, "dp_param_gather": _shard_gather(layout, hw, params, block, t_mb)}
    per_layer = collective_time("all_gather", params / layers, n, stride, hw)
    gathers = (2 if layout.reshard_after_forward else 1) * layers * per_layer  # forward (and backward)
    if layout.zero_hpz_size > 1:  # hpZ: backward's gathers inside blocks of that many ranks
        inside = collective_time("all_gather", secondary / layers, layout.zero_hpz_size, stride, hw)
        gathers = layers * per_layer + layers * inside
    per_mb_reduce = layers * _reduce_scatter(layout, grads / layers, n, stride, hw)
    share = node_share(stride, n, hw)
    return {
        "dp_grad_reduce": 0.0,
        "dp_param_gather": n_mb * _exposed(hw, gathers + per_mb_reduce, t_mb, share),
    }


def _shard_gather(layout: Layout, hw: Hardware, params: float, block: DataGroup, t_mb: float) -> float:
    """ZeRO-1/2's all-gather of the updated shards after the step: exposed whole, or under
    ``overlap_param_gather`` (Megatron-Core's distributed optimizer: each bucket's gather launched when
    the forward reaches the bucket before it) hidden under the next step's first micro-batch's forward,
    what that forward cannot cover and at least the contention floor (:func:`_exposed`) exposed."""
    gather = collective_time("all_gather", params, block.ranks, block.stride, hw)
    if not layout.overlap_param_gather:
        return gather
    return _exposed(hw, gather, t_mb / 3.0, node_share(block.stride, block.ranks, hw))


def _reduce_scatter(layout: Layout, grads: float, n: int, stride: int, hw: Hardware) -> float:
    """One gradient reduction of ``grads`` bytes over ``n`` ranks: a ring reduce-scatter, or qgZ's
    all-to-all of quantised blocks (:func:`collective_time`'s ``all_to_all``), in two levels under
    ``zero_quantized_gradient_node`` (the whole buffer inside each node, then 1/node of it across the
    nodes, one rank per node in each group)."""
    node = layout.zero_quantized_gradient_node
    if layout.onebit_adam:  # 1-bit Adam under ZeRO-1/2: the signs by one all-to-all
        return collective_time("all_to_all", grads, n, stride, hw)
    if not layout.zero_quantized_gradients:
        return collective_time("reduce_scatter", grads, n, stride, hw)
    if node <= 1 or node >= n or n % node:
        return collective_time("all_to_all", grads, n, stride, hw)
    inside = collective_time("all_to_all", grads, node, stride, hw)
    return inside + collective_time("all_to_all", grads / node, n // node, stride * node, hw)


def optimizer_time(
    layout: Layout,
    hw: Hardware,
    shard_elements: int,
    device_state_bytes: float,
    grad_bytes: int,
    param_bytes: int,
    opt_bytes: int,
    n_mb: int = 1,
) -> dict[str, float]:
    """The optimizer step and the offload traffic around it (``offload_transfer``: what is exposed).

    The engine reads the next bucket's optimizer state from NVMe and writes the previous one back while
    the host AdamW updates the current one, so NVMe traffic shows only where it outlasts the update.
    With ``offload_grads=nvme`` the fp32 gradient shard is read there too, and backward writes it on
    each of the ``n_mb`` micro-batches (reading it back to accumulate after the first): exposed.
    """
    if layout.offload_optimizer == "none":
        return {"optimizer_step": 2.0 * device_state_bytes / hw.memory_bw, "offload_transfer": 0.0}
    cpu = shard_elements / hw.cpu_adam_params_per_s
    transfer = shard_elements * (grad_bytes + param_bytes) / hw.pcie_bw
    if layout.offload_optimizer == "nvme":
        stashed = 4.0 if layout.offload_grads == "nvme" else 0.0  # the fp32 gradient, read at the step
        transfer += max(0.0, shard_elements * (2.0 * opt_bytes + stashed) / hw.nvme_bw - cpu)
        transfer += stashed * shard_elements * (2 * n_mb - 1) / hw.nvme_bw  # backward's writes, re-reads
    return {"optimizer_step": cpu, "offload_transfer": transfer}


def param_offload_time(
    layout: Layout, hw: Hardware, shard_elements: int, param_bytes: int, t_mb: float, n_mb: int
) -> float:
    """Exposed host→device parameter fetches of ZeRO-3 parameter offload (forward and backward)."""
    if layout.offload_params == "none":
        return 0.0
    bw = hw.pcie_bw if layout.offload_params == "cpu" else min(hw.pcie_bw, hw.nvme_bw)
    fetch = 2.0 * shard_elements * param_bytes / bw
    return n_mb * max(0.0, fetch - _cover(hw, t_mb))
