"""Tensor-parallel collectives of a step: exposed, or overlapped as Transformer Engine's userbuffers
overlap them under the GEMMs (Megatron's ``--tp-comm-overlap``, ``parallel.tp_comm_overlap``)."""

from __future__ import annotations

from zerotron.plan.hardware import Hardware
from zerotron.plan.layout import ACT_BYTES, Layout, Workload
from zerotron.plan.timing import attention_gemms, block_gemms, collective_time, gemm_seconds
from zerotron.shapes import ModelShape

# Transformer Engine's userbuffers overlap as Megatron runs it (``--tp-comm-overlap``), from TE's
# defaults (transformer_engine/pytorch/module/base.py, ``initialize_ub``): the all-gathers that feed
# the column-parallel GEMMs forward and the row-parallel GEMMs' input gradients ("ring_exchange":
# qkv_fprop, fc1_fprop, proj_dgrad, fc2_dgrad) move on copy engines while the GEMM runs chunk by
# chunk, taking no SMs; the reduce-scatters after the row-parallel GEMMs ("pipeline": proj_fprop,
# fc2_fprop) run in UB_SPLITS chunks on UB_SMS SMs; the backward's "bulk" overlaps (qkv and fc1, dgrad
# and wgrad) on UB_SMS SMs too. Both leave the GEMM the rest of the SMs (``set_sm_margin``).
UB_SMS = 16
UB_SPLITS = 4


def tensor_parallel_time(m: ModelShape, layout: Layout, work: Workload, hw: Hardware, layers: int) -> float:
    """Exposed TP (+SP) collectives of one micro-batch on one stage: 2 forward + 2 backward per layer.

    Full recomputation repeats the forward pair. Sequence parallelism replaces each all-reduce by an
    all-gather and a reduce-scatter of the same bus bytes. With ``tp_comm_overlap`` see
    :func:`_userbuffers_block`; on a ``shared_host`` nothing overlaps.
    """
    if layout.tp == 1:
        return 0.0
    nbytes = layout.micro_batch * work.seq_len / layout.cp * m.hidden * ACT_BYTES[work.precision]
    if layout.tp_comm_overlap and not hw.shared_host:
        return _userbuffers_block(m, layout, work, hw, nbytes) * layers
    per = collective_time("all_reduce", nbytes, layout.tp, 1, hw)
    count = 4 + (2 if layout.recompute == "full" else 0)
    return count * per * layers


def _userbuffers_block(m: ModelShape, layout: Layout, work: Workload, hw: Hardware, nbytes: float) -> float:
    """Seconds one block's overlapped tp collectives (Transformer Engine's defaults, :data:`UB_SMS`)
    add to a micro-batch. A copy-engine all-gather ("ring_exchange") adds what its GEMM cannot cover
    and the cost of running that GEMM as tp chunks of a tp-th of the rows (the law's efficiency at the
    chunk's shape). A pipelined reduce-scatter adds its last of :data:`UB_SPLITS` chunks, what the GEMM
    cannot cover of the rest, and the GEMM's slowdown on ``sms - UB_SMS`` SMs; a backward bulk
    reduce-scatter what its dgrad and wgrad GEMMs cannot cover, and their slowdown. The block's GEMMs
    split as attention in (q/k/v), attention out, MLP in and MLP out (an MoE block's experts and router
    as its MLP)."""
    tp = layout.tp
    ag = collective_time("all_gather", nbytes, tp, 1, hw)
    shapes = block_gemms(m, layout, work)
    attention = len(attention_gemms(m, 1.0, 1))
    groups = [shapes[: attention - 1], shapes[attention - 1 : attention], shapes[attention : attention + 1]]
    groups.append(shapes[attention + 1 :])
    whole = [gemm_seconds(hw, work.precision, g) for g in groups]
    chunked = [gemm_seconds(hw, work.precision, [(r / tp, c, k, n * tp) for r, c, k, n in g]) for g in groups]
    qkv, out, fc1, fc2 = whole
    margin = UB_SMS / (hw.sms - UB_SMS) if hw.sms > UB_SMS else 0.0

    def ring(i: int) -> float:  # the all-gather feeding GEMM i, which runs in tp chunks
        return max(0.0, ag - chunked[i]) + chunked[i] - whole[i]

    def pipelined(gemm: float) -> float:
        return ag / UB_SPLITS + max(0.0, ag * (1 - 1 / UB_SPLITS) - gemm) + margin * gemm

    forward = ring(0) + pipelined(out) + ring(2) + pipelined(fc2)
    backward = ring(1) + ring(3) + sum(max(0.0, ag - g) + margin * 2 * g for g in (qkv, fc1))
    return forward * (2 if layout.recompute == "full" else 1) + backward
