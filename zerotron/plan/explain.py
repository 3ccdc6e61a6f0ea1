"""``zerotron plan --explain``: every time term of a plan with its formula and the inputs it used.

The numbers are recomputed with the same functions :func:`zerotron.plan.planner.step_times` calls,
so the explanation and the plan cannot drift apart (``tests/test_plan_accuracy.py`` checks that the
terms printed here add up to the plan's step time).
"""

from __future__ import annotations

import dataclasses

from zerotron.plan import timing
from zerotron.plan.hardware import Hardware
from zerotron.plan.layout import Layout, Workload, micro_batches
from zerotron.plan.planner import Plan, rank_layers, step_times
from zerotron.shapes import ModelShape


def _gemms(m: ModelShape, layout: Layout, work: Workload, hw: Hardware) -> list[str]:
    lines = []
    peak = hw.flops(work.precision)
    for name, (r, c, k, n) in zip(timing.block_gemm_names(m), timing.block_gemms(m, layout, work)):
        eff = timing.gemm_efficiency(hw, r, c, k, work.precision)
        seconds = 2 * r * c * k * n / (peak * eff)
        count = f" x{n:g}" if n != 1 else ""
        lines.append(
            f"    {name:<9} {r:,.0f} x {c:,.0f} x {k:,.0f}{count}: g = {(r * c * k) ** (1 / 3):,.0f}, "
            f"eff = e*g/(g+knee) = {eff:.3f} -> {seconds * 1e3:.4g} ms forward"
        )
    return lines


# How far each constant may be off, either way (docs/planning.md): relative for efficiencies and
# factors, absolute for the contention fraction.
UNCERTAINTY: dict[str, tuple[float, bool]] = {
    "gemm_efficiency": (0.08, False),  # MAMF shapes vs a model's; the H100 profile check holds to 8%
    "attention_efficiency": (0.25, False),  # cuDNN measured 0.26 on an H100; fits 0.2-0.275 by kernel
    "eager_elementwise": (0.2, False),  # measured 5.2-5.6 on one eager implementation
    "comm_efficiency": (0.15, False),  # NCCL bus bandwidth by message size and topology
    "overlap_contention": (0.5, True),  # 0 for Megatron's FSDP, 1 fitted on torch FSDP (H100)
}


def _moves(value: float, amount: float, absolute: bool, fraction: bool) -> list[tuple[str, float]]:
    if absolute:
        return [
            (f"{sign}{amount:g}", min(1.0, max(0.0, value + k * amount))) for sign, k in (("-", -1), ("+", 1))
        ]
    cap = 1.0 if fraction else float("inf")
    return [(f"{sign}{amount:.0%}", min(cap, value * (1 + k * amount))) for sign, k in (("-", -1), ("+", 1))]


def uncertainty(
    m: ModelShape, layout: Layout, work: Workload, hw: Hardware, convention: str, flash: bool = True
) -> list[tuple[str, str, float]]:
    """Each constant of :data:`UNCERTAINTY` moved by its stated amount either way, the others held:
    (constant, the move that changes the step most, the seconds it adds or takes), largest change
    first; a constant the plan does not use changes nothing."""
    hw = hw.per_rank(layout.world)
    base = sum(step_times(m, layout, work, hw, convention, flash).values())
    out = []
    for key, (amount, absolute) in UNCERTAINTY.items():
        fraction = key != "eager_elementwise"
        best = ("", 0.0)
        for label, moved in _moves(getattr(hw, key), amount, absolute, fraction):
            changed = dataclasses.replace(hw, **{key: moved})  # type: ignore[arg-type]
            delta = sum(step_times(m, layout, work, changed, convention, flash).values()) - base
            if abs(delta) > abs(best[1]) or not best[0]:
                best = (label, delta)
        out.append((key, best[0], best[1]))
    return sorted(out, key=lambda x: -abs(x[2]))


_TP_EXPOSED = "(4, or 6 with full recompute) all-reduces of b*s/cp*h*bytes over tp: 2(n-1)a + 2S(n-1)/n / (bw*comm_efficiency)"
_TP_OVERLAPPED = (
    "Transformer Engine's overlap (tp_comm_overlap) of the all-gathers and reduce-scatters of b*s/cp*h*bytes "
    "over tp: copy-engine all-gathers beyond their GEMMs and their GEMMs in tp chunks, each reduce-scatter's "
    "last of 4 chunks, and the GEMMs beside them on sms-16 SMs"
)


def explain(
    m: ModelShape,
    layout: Layout,
    work: Workload,
    hw: Hardware,
    plan: Plan,
    flash: bool = True,
    convention: str = "zerotron",
) -> str:
    """Each term of ``plan.time`` with the formula and the inputs behind it."""
    n_mb = micro_batches(layout, work)
    layers = rank_layers(m, layout, work)
    t = layout.micro_batch * work.seq_len / layout.cp
    passes = 4 if layout.recompute == "full" else 3
    top = hw.fp8_efficiency if work.precision == "fp8" else hw.gemm_efficiency
    attn = timing.attention_seconds(m, layout, work, hw, flash)
    ew = timing.elementwise_bytes_per_token(m, layout, work, flash, hw.eager_elementwise)
    lines = [
        f"inputs   {layout.short()} on {layout.world} x {hw.name}; {work.global_batch} x {work.seq_len} tokens "
        f"per step, {n_mb} micro-batches of {layout.micro_batch} per pipeline; blocks per stage {list(layers)}",
        f"profile  peak {hw.flops(work.precision) / 1e12:g} TFLOP/s ({work.precision}), e = {top}, "
        f"knee = {hw.gemm_knee:g}, attention_efficiency = {hw.attention_efficiency}, memory "
        f"{hw.memory_bw / 1e9:g} GB/s, node link {hw.intra_bw / 1e9:g} GB/s, network {hw.inter_bw / 1e9:g} "
        f"GB/s per device x comm_efficiency {hw.comm_efficiency}",
        f"compute  {plan.time['compute']:.4g} s = micro-batches x (blocks x (passes x GEMMs + attention passes x"
        f" attention) + head + element-wise bytes / memory bandwidth); passes = {passes} (forward, 2 backward"
        + (", recompute" if passes == 4 else "")
        + f"); T = b*s/cp = {t:,.0f} tokens per micro-batch",
        *_gemms(m, layout, work, hw),
        f"    attention 2*T*s*heads*(d_qk+d_v)/tp = {2 * t * work.seq_len * m.core_width / layout.tp:.4g} "
        "FLOPs forward, "
        + (
            f"flash: half of it (causal) at attention_efficiency -> {attn * 1e3:.4g} ms"
            if flash
            else f"unfused: every score, GEMMs of depth head_dim -> {attn * 1e3:.4g} ms"
        ),
        f"    element-wise {ew:,.0f} bytes per token and block (norms, activations, residuals"
        + (
            f"; eager blocks: {hw.eager_elementwise:g} x the fused block's"
            if layout.kernels == "eager"
            else ""
        )
        + f") / memory bandwidth; the loss {timing.LOSS_BYTES_PER_LOGIT:g} bytes per logit",
    ]
    formulas = {
        "tp_comm": "micro-batches x blocks x " + (_TP_OVERLAPPED if layout.tp_comm_overlap else _TP_EXPOSED),
        "cp_comm": "ring attention: 3(cp-1) K/V sends per block not hidden under the attention core",
        "ep_comm": "4 (6) all-to-alls of b*s/cp*k*h*bytes per block over ep",
        "pipeline_bubble": f"(pp-1)/(v*m) x m x micro-batch time, pp={layout.pp}, v={layout.virtual_stages}, "
        f"m={n_mb}" + (" / 3 (zero bubble)" if layout.pp_schedule == "zb" else ""),
        "pipeline_p2p": "2 x v x m sends of b*s/cp*h*bytes (/tp: scatter-gather) between stages",
        "dp_grad_reduce": "gradient all-reduce (ZeRO-1/2: reduce-scatter) over dp not hidden under the "
        "backward of the last micro-batch (ZeRO-2: of each)",
        "dp_param_gather": "ZeRO-1/2: all-gather of the updated shard"
        + (" not hidden under the next step's first forward" if layout.overlap_param_gather else "")
        + "; ZeRO-3: per block gathers (forward, backward) and reduce-scatters not hidden under each "
        "micro-batch's compute",
        "optimizer_step": "2 x state bytes / memory bandwidth (device Adam), or shard / cpu_adam_params_per_s",
        "offload_transfer": "gradients down and parameters up over PCIe (and NVMe reads/writes)",
        "param_offload": "ZeRO-3 parameter fetches from host/NVMe not hidden under compute",
    }
    for key, value in plan.time.items():
        if key != "compute" and value > 0:
            lines.append(f"{key:<16} {value:.4g} s = {formulas.get(key, key)}")
    lines.append(f"total    {plan.step_time_s:.4g} s per step = the sum of the terms above")
    moves = uncertainty(m, layout, work, hw, convention, flash)
    lines.append("uncertainty  the step if one constant were off by its stated amount (docs/planning.md):")
    for key, label, added in moves:
        lines.append(f"    {key:<21} {label:>5}: {added:+.4g} s ({added / plan.step_time_s:+.1%})")
    top_key, _, top_change = moves[0]
    lines.append(
        f"    dominant: {top_key} (the {_TERM.get(top_key, top_key)})"
        if top_change != 0
        else "    dominant: none of the stated constants moves this step"
    )
    return "\n".join(lines)


_TERM = {
    "gemm_efficiency": "matrix multiplies of the compute term",
    "attention_efficiency": "attention core of the compute term",
    "eager_elementwise": "eager element-wise kernels of the compute term",
    "comm_efficiency": "collectives' bandwidth",
    "overlap_contention": "collectives overlapped with compute",
}
