"""The planner's step times against published runs it was not fitted on, and the tools around them.

``zerotron.plan.published`` holds two disjoint sets of published training runs. The shipped efficiency
constants are re-derived here from the calibration set alone; the validation set's error is asserted.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from zerotron.cli import main
from zerotron.config_load import load_config, save_config
from zerotron.layout import ParallelDims
from zerotron.plan import PROFILES, PlanError, plan_config, plan_layout, tensor_parallel, timing
from zerotron.plan.accuracy import errors, fit_profiles, predict, run_inputs, summary
from zerotron.plan.hardware import MEASURED
from zerotron.plan.interval import step_range
from zerotron.plan.layout import Layout, Workload, check, from_config
from zerotron.plan.published import CALIBRATION, HELD_OUT, VALIDATION
from zerotron.shapes import ModelShape, flops_per_token


def test_validation_error_under_10_percent_mean_20_worst() -> None:
    """Runs never used for fitting: mean |error| < 10%, worst < 20% (the table is in BENCHMARKS.md)."""
    s = summary(errors(VALIDATION))
    assert s["runs"] >= 20
    assert s["mean"] < 0.10, s
    assert s["worst"] < 0.20, s


def test_calibration_set_is_fitted() -> None:
    """The calibration set, reported beside the validation set, is fitted to the same standard. Its worst
    run (Megatron-Bridge's FP8 Llama-3-8B under Megatron's FSDP, +15%) is the one ZeRO-3 run whose
    collectives do not show the contention fitted on llm-foundry's FSDP runs: docs/planning.md."""
    s = summary(errors(CALIBRATION))
    assert s["mean"] < 0.10, s
    assert s["worst"] < 0.20, s


def test_shipped_constants_are_the_fit_of_the_calibration_set() -> None:
    """Re-running the fit on the calibration runs alone gives the shipped profiles' constants: no
    validation run took part in choosing them."""
    fitted = fit_profiles(CALIBRATION)
    assert set(fitted) == {"a100-80g", "h100-sxm"}
    for kind, values in fitted.items():
        for key, value in values.items():
            assert getattr(PROFILES[kind], key) == pytest.approx(value), (kind, key)
    # the H100's GEMM law and eager factor come from microbenchmarks: kept, never fitted
    assert not set(fitted["h100-sxm"]) & set(MEASURED["h100-sxm"])
    for key, value in MEASURED["h100-sxm"].items():
        assert getattr(PROFILES["h100-sxm"], key) == value
        assert getattr(PROFILES["h200"], key) == value
    assert PROFILES["a100-40g"].gemm_efficiency == PROFILES["a100-80g"].gemm_efficiency  # same chip
    assert PROFILES["h200"].fp8_efficiency == PROFILES["h100-sxm"].fp8_efficiency


def test_sets_are_disjoint_and_physically_possible() -> None:
    """No run is in both sets, and no published figure implies more than the hardware's peak."""
    key = lambda r: (r.hardware, r.gpus, r.hidden, r.layers, r.seq_len, r.global_batch, r.recompute)  # noqa: E731
    assert not {key(r) for r in CALIBRATION} & {key(r) for r in VALIDATION}
    for run in (*CALIBRATION, *VALIDATION):
        m, layout, work = run_inputs(run)
        model_flops = flops_per_token(m, work.seq_len) * work.tokens
        peak = PROFILES[run.hardware].flops(run.precision) * run.gpus
        mfu = model_flops / run.published_step_s() / peak
        assert 0.2 < mfu < 0.75, (run.name, mfu)
        assert run.source


def test_published_units_agree_with_the_papers() -> None:
    """Korthikanti Table 5's iteration times give its published MFU (41.5%, 51.4%, 56.0%, 56.3%)."""
    runs = [r for r in VALIDATION if r.name.endswith("sel+sp")]
    mfus = []
    for run in runs:
        m, _, work = run_inputs(run)
        flops = flops_per_token(m, work.seq_len) * work.tokens
        mfus.append(flops / run.published_step_s() / (run.gpus * 312e12))
    # 1.10 s is printed to three digits: +-0.5% of 41.5 is 0.2 points
    assert [round(100 * x, 1) for x in mfus] == pytest.approx([41.5, 51.4, 56.0, 56.3], abs=0.25)


def test_gemm_efficiency_rises_with_gemm_size() -> None:
    hw = PROFILES["h100-sxm"]
    small, large = timing.gemm_efficiency(hw, 512, 512, 512), timing.gemm_efficiency(hw, 8192, 8192, 8192)
    assert 0 < small < large < hw.gemm_efficiency
    assert timing.gemm_efficiency(hw, 8192, 8192, 8192, "fp8") == pytest.approx(
        large * hw.fp8_efficiency / hw.gemm_efficiency
    )


def test_h100_gemm_law_reproduces_the_matmul_microbenchmarks() -> None:
    """The H100's GEMM law (measured, not fitted) against matrix-product measurements: the maximum
    achievable bf16 matmul, 792 TFLOP/s at 6144x17920x2816 (Bekman's ml-engineering table) and
    787-793 TFLOP/s at 8192^3 on the H100 lent to this project; and the GEMMs of an eager 1B Llama step
    on that card (152 ms in the profiler, BENCHMARKS.md "bf16 MFU of a ~1B Llama")."""
    hw = PROFILES["h100-sxm"]
    peak = hw.flops("bf16")
    assert timing.gemm_efficiency(hw, 6144, 17920, 2816) * peak == pytest.approx(792e12, rel=0.02)
    assert timing.gemm_efficiency(hw, 8192, 8192, 8192) * peak == pytest.approx(790e12, rel=0.02)
    m = ModelShape(2048, 16, 32, 8, 64, 8192, 128256, True, True, False)  # Llama-3.2-1B
    layout = Layout(ParallelDims.of(1), micro_batch=4, kernels="eager")
    work = Workload(2048, 8, "bf16")
    block = timing.gemm_seconds(hw, "bf16", timing.block_gemms(m, layout, work))
    head = timing.gemm_seconds(hw, "bf16", [(4 * 2048, m.vocab, m.hidden, 1.0)])
    gemm_s = 2 * 3 * (16 * block + head)  # two micro-batches, forward and two backward GEMMs
    assert gemm_s == pytest.approx(0.152, rel=0.08)


def test_eager_elementwise_reproduces_the_h100_profile() -> None:
    """The same 1B Llama step's element-wise kernels took 133-144 ms (the profile's kernel time less
    its matrix products, attention, log-softmax and optimizer); the model's eager blocks give that, the
    fused blocks a fifth of it; a zerotron job is planned as eager."""
    hw = PROFILES["h100-sxm"]
    m = ModelShape(2048, 16, 32, 8, 64, 8192, 128256, True, True, False)
    work = Workload(2048, 8, "bf16")
    tokens = 8 * 2048
    eager = Layout(ParallelDims.of(1), micro_batch=4, kernels="eager")
    fused = dataclasses.replace(eager, kernels="fused")
    per = timing.elementwise_bytes_per_token(m, eager, work, True, hw.eager_elementwise)
    assert 0.120 < per * 16 * tokens / hw.memory_bw < 0.150
    assert timing.elementwise_bytes_per_token(m, fused, work, True, hw.eager_elementwise) == pytest.approx(
        per / hw.eager_elementwise
    )
    cfg = load_config(None, ["model.preset=llama3.2-1b", "train.seq_len=2048", "train.global_batch=8"])
    assert plan_config(cfg, hw, 1).layout.kernels == "eager"


def test_overlap_contention_exposes_zero3_collectives() -> None:
    """ZeRO-3's per-block collectives hide under compute, less ``overlap_contention`` of their time:
    0 hides them all when compute is longer, 1 exposes them all."""
    hw = dataclasses.replace(PROFILES["h100-sxm"], overlap_contention=0.0)
    layout = Layout(ParallelDims.of(8, zero=3))
    group = timing.DataGroup.of(layout)
    args = (layout, hw, group, 4e9, 2e9, 10.0, 2, 32)
    assert timing.data_parallel_time(*args)["dp_param_gather"] == 0.0
    full = timing.data_parallel_time(layout, hw, group, 4e9, 2e9, 0.0, 2, 32)["dp_param_gather"]
    contended = dataclasses.replace(hw, overlap_contention=1.0)
    assert timing.data_parallel_time(layout, contended, group, 4e9, 2e9, 10.0, 2, 32)[
        "dp_param_gather"
    ] == pytest.approx(full)
    half = dataclasses.replace(hw, overlap_contention=0.5)
    assert timing.data_parallel_time(layout, half, group, 4e9, 2e9, 10.0, 2, 32)[
        "dp_param_gather"
    ] == pytest.approx(full / 2)


def test_deepspeed_pipeline_sends_whole_activations() -> None:
    """Megatron's pipeline sends 1/tp of a stage's output from each tp rank (scatter/gather); DeepSpeed's
    engine (MT-NLG) sends all of it from each: tp times the bytes, the same link."""
    m = ModelShape(20480, 105, 128, 128, 160, 81920, 51200, False, True, False)
    split = Layout(ParallelDims.of(8, tp=8, pp=35), recompute="full")
    whole = dataclasses.replace(split, pp_scatter_gather=False)
    work = Workload(2048, 1920, "bf16")
    hw = PROFILES["a100-80g"]
    sends = [timing.pipeline_times(m, lay, work, hw, 1.0)["pipeline_p2p"] for lay in (split, whole)]
    n_mb = 1920 // 8
    nbytes = 2048 * 20480 * 2
    per = [timing.collective_time("send", b, 35, 8, hw) for b in (nbytes / 8, nbytes)]
    assert sends == pytest.approx([2 * n_mb * per[0], 2 * n_mb * per[1]])
    run = next(r for r in VALIDATION if r.name.startswith("mt-nlg"))
    assert not run.pp_scatter_gather and not run_inputs(run)[1].pp_scatter_gather


def _llama70b(precision: str, hw: object = None, **layout: object) -> float:
    m = ModelShape(8192, 80, 64, 8, 128, 28672, 128256, True, False, False)
    lay = Layout(ParallelDims.of(2, tp=4, pp=8), micro_batch=1, sequence_parallel=True, **layout)  # type: ignore[arg-type]
    profile = hw or PROFILES["h100-sxm"]
    return plan_layout(m, lay, Workload(8192, 128, precision), profile, "mixed").step_time_s  # type: ignore[arg-type]


def test_fp8_and_tp_comm_overlap() -> None:
    """FP8 GEMMs make a step faster; overlapping tp collectives makes it faster too; no FP8 on A100."""
    assert _llama70b("fp8") < 0.8 * _llama70b("bf16")
    assert _llama70b("bf16", tp_comm_overlap=True) < _llama70b("bf16")
    run = next(r for r in VALIDATION if r.precision == "fp8")
    with pytest.raises(PlanError, match="no peak FLOP/s for fp8"):
        predict(run, PROFILES["a100-80g"])


def test_tp_overlap_follows_transformer_engines_userbuffers_design() -> None:
    """``tp_comm_overlap`` as Transformer Engine's defaults run it (initialize_ub): per block and
    micro-batch, the two pipelined reduce-scatters after the row-parallel GEMMs leave their last of 4
    chunks exposed; the four copy-engine all-gathers hide under their GEMMs; and the GEMMs beside a
    reduce-scatter (attention out and MLP out forward; q/k/v and MLP in, dgrad and wgrad, backward)
    run on the 116 of an H100's 132 SMs that the collective's 16 leave. The NCCL contention fitted on
    FSDP runs does not apply (these collectives run on copy engines or on SMs set aside)."""
    h100 = PROFILES["h100-sxm"]
    m = ModelShape(8192, 80, 64, 64, 128, 32768, 51200, False, False, False)  # GPT, 4h MLP, MHA
    layout = Layout(ParallelDims.of(1, tp=4), sequence_parallel=True, tp_comm_overlap=True)
    work = Workload(4096, 8, "bf16")
    t, h, tp = 4096, 8192, 4
    ag = timing.collective_time("all_gather", t * h * 2, tp, 1, h100)
    shapes = (("qkv", 3 * h / tp, h), ("out", h, h / tp), ("fc1", 4 * h / tp, h), ("fc2", h, 4 * h / tp))
    gemm = {name: 2 * t * c * k / (989e12 * timing.gemm_efficiency(h100, t, c, k)) for name, c, k in shapes}
    assert min(gemm.values()) > ag  # every all-gather shorter than its GEMM here
    # the all-gathers' GEMMs (q/k/v and MLP in forward, attention out and MLP out dgrad) in tp chunks
    chunks = sum(2 * t * c * k / (989e12 * timing.gemm_efficiency(h100, t / tp, c, k)) - gemm[name]
                 for name, c, k in shapes)  # fmt: skip
    slowed = gemm["out"] + gemm["fc2"] + 2 * gemm["qkv"] + 2 * gemm["fc1"]
    expected = 2 * ag / 4 + 16 / 116 * slowed + chunks
    assert tensor_parallel.tensor_parallel_time(m, layout, work, h100, 1) == pytest.approx(expected, rel=1e-9)
    # without the SM split (a profile with no SM count) only the last chunks and the chunking remain
    bare = dataclasses.replace(h100, sms=0)
    assert tensor_parallel.tensor_parallel_time(m, layout, work, bare, 1) == pytest.approx(
        2 * ag / 4 + chunks, rel=1e-9
    )
    # far less than the eight collectives exposed, and no function of the NCCL contention
    exposed = tensor_parallel.tensor_parallel_time(
        m, dataclasses.replace(layout, tp_comm_overlap=False), work, h100, 1
    )
    assert exposed == pytest.approx(4 * timing.collective_time("all_reduce", t * h * 2, tp, 1, h100))
    assert tensor_parallel.tensor_parallel_time(m, layout, work, h100, 1) < 0.5 * exposed
    for contention in (0.0, 1.0):
        other = dataclasses.replace(h100, overlap_contention=contention)
        assert tensor_parallel.tensor_parallel_time(
            m, layout, work, other, 1
        ) == tensor_parallel.tensor_parallel_time(m, layout, work, h100, 1)
    # CPU ranks overlap nothing
    cpu = PROFILES["cpu"]
    assert tensor_parallel.tensor_parallel_time(m, layout, work, cpu, 1) == pytest.approx(
        4 * timing.collective_time("all_reduce", t * h * 2, tp, 1, cpu)
    )


def test_overlapped_collectives_contend_by_their_bytes_not_their_link_time() -> None:
    """An overlapped NCCL collective takes GPU time in proportion to the bytes it moves (its kernels'
    memory traffic and SMs), not to how long a slower link keeps it waiting: its floor is
    ``overlap_contention`` of its time at the node's link speed. Across nodes an H100's share is its
    400 Gb/s NIC against 450 GB/s of NVLink."""
    h100 = PROFILES["h100-sxm"]
    assert timing.node_share(1, 8, h100) == 1.0  # inside a node
    assert timing.node_share(8, 48, h100) == pytest.approx(50 / 450)  # one rank per node
    assert timing.node_share(1, 16, h100) == pytest.approx(8 * 50 / 450)  # eight per node: eight NICs
    assert timing.node_share(4, 16, h100) == pytest.approx(2 * 50 / 450)
    layout = Layout(ParallelDims.of(48, zero=1), micro_batch=1)
    grads = 8e9
    for stride, share in ((1, 8 * 50 / 450), (8, 50 / 450)):
        group = timing.DataGroup(48, 48, stride)
        times = timing.data_parallel_time(layout, h100, group, grads, grads, t_mb=100.0, n_mb=4)
        reduce = timing.collective_time("reduce_scatter", grads, 48, stride, h100)
        assert times["dp_grad_reduce"] == pytest.approx(h100.overlap_contention * share * reduce)


def test_overlap_param_gather_hides_zero1_gathers_under_the_first_forward() -> None:
    """Megatron-Core's ``--overlap-param-gather`` (distrib_optimizer.py: one bucket's all-gather at a time,
    each launched from the forward pre-hook of the bucket before it): ZeRO-1/2's gather of the updated
    shards runs under the next step's first micro-batch's forward (a third of its compute), what that
    forward cannot cover exposed, and never less than the contention floor of overlapped collectives.
    Without it the gather follows the step, exposed whole. ZeRO-3 and ZeRO-0 are refused with it."""
    h100 = PROFILES["h100-sxm"]
    grads = params = 8e9
    for zero in (1, 2):
        plain = Layout(ParallelDims.of(48, zero=zero))
        overlap = dataclasses.replace(plain, overlap_param_gather=True)
        group = timing.DataGroup(48, 48, 8)  # one rank per node: the NIC's pace
        gather = timing.collective_time("all_gather", params, 48, 8, h100)
        floor = h100.overlap_contention * timing.node_share(8, 48, h100) * gather
        for t_mb in (0.03, 0.3, 30.0):
            whole = timing.data_parallel_time(plain, h100, group, grads, params, t_mb, 4)
            hidden = timing.data_parallel_time(overlap, h100, group, grads, params, t_mb, 4)
            assert whole["dp_param_gather"] == pytest.approx(gather)
            assert hidden["dp_param_gather"] == pytest.approx(max(gather - t_mb / 3, floor))
            assert hidden["dp_grad_reduce"] == whole["dp_grad_reduce"]
    m = ModelShape(64, 2, 4, 4, 16, 256, 128, gated=True, tied=True, qkv_bias=False)
    for zero in (0, 3):
        layout = Layout(ParallelDims.of(8, zero=zero), overlap_param_gather=True)
        with pytest.raises(PlanError, match="overlap_param_gather=true with zero="):
            check(m, layout, Workload(64, 8), h100, 8)


def test_megatron_bf16_runs_reduce_fp32_gradients() -> None:
    """Megatron under --bf16 reduces its fp32 gradient buffer (r0.8.0's arguments.py forces
    accumulate_allreduce_grads_in_fp32; its docs' distributed-optimizer table: 'float16 param, fp32
    grads'): the held-out runs say so, and their data-parallel reduction moves 4 bytes an element where
    the mixed convention's default moves 2; with no overlap to hide it (a CPU profile) the reduction of a
    dp-only layout's gradients takes the time of twice the bytes."""
    assert all(r.grad_bytes == 4 and r.overlap_param_gather for r in HELD_OUT)
    assert not any(r.grad_bytes or r.overlap_param_gather for r in (*CALIBRATION, *VALIDATION))
    cpu = PROFILES["cpu"]
    m = ModelShape(64, 2, 4, 4, 16, 256, 128, gated=True, tied=True, qkv_bias=False)
    layout, work = Layout(ParallelDims.of(4, zero=1)), Workload(64, 8)
    t16 = plan_layout(m, layout, work, cpu, convention="mixed").time["dp_grad_reduce"]
    t32 = plan_layout(m, dataclasses.replace(layout, mixed_grad_bytes=4), work, cpu, convention="mixed").time[
        "dp_grad_reduce"
    ]
    alpha = 3 * timing.link(1, 4, cpu.per_rank(4))[1]  # the ring's latency, paid once either way
    assert t32 - alpha == pytest.approx(2 * (t16 - alpha))


def test_shared_host_splits_the_node_and_overlaps_nothing() -> None:
    """CPU ranks share the node's cores: two ranks each get half the peak, and a collective adds to
    the compute instead of hiding under it."""
    cpu = PROFILES["cpu"]
    half = cpu.per_rank(2)
    assert half.flops("fp32") == cpu.flops("fp32") / 2 and half.memory_bw == cpu.memory_bw / 2
    assert PROFILES["h100-sxm"].per_rank(8) is PROFILES["h100-sxm"]
    layout = Layout(ParallelDims.of(2))
    group = timing.DataGroup.of(layout)
    hidden = timing.data_parallel_time(
        layout, dataclasses.replace(cpu, shared_host=False), group, 4 * 10**6, 4 * 10**6, 1.0, 1
    )
    exposed = timing.data_parallel_time(layout, cpu, group, 4 * 10**6, 4 * 10**6, 1.0, 1)
    assert hidden["dp_grad_reduce"] == 0.0
    assert exposed["dp_grad_reduce"] == pytest.approx(timing.collective_time("all_reduce", 4e6, 2, 1, cpu))


def test_cli_explain_terms_add_up(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "plan",
        "model.preset=llama3-8b",
        "train.precision=bf16",
        "train.seq_len=4096",
        "train.global_batch=64",
        "train.micro_batch=1",
        "parallel.tp=2",
        "parallel.pp=2",
        "parallel.zero=1",
        "--hardware",
        "h100-sxm",
        "--gpus",
        "16",
        "--explain",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    terms = [line.split()[:2] for line in out.splitlines() if " s = " in line and not line.startswith(" ")]
    total = next(float(line.split()[1]) for line in out.splitlines() if line.startswith("total"))
    assert {t[0] for t in terms} >= {"compute", "tp_comm", "pipeline_bubble", "dp_param_gather"}
    assert sum(float(t[1]) for t in terms) == pytest.approx(total, rel=1e-3)
    assert "eff = e*g/(g+knee)" in out and "2(n-1)a + 2S(n-1)/n" in out


def test_step_range_comes_from_similar_validation_runs() -> None:
    """The printed range is the spread of published/predicted over the validation runs of the same chip
    and layout class: A100 tp 8 with pipelines draws on the Megatron rows, an H200 on the H100's, and a
    chip no run used gets none."""
    layout = Layout(ParallelDims.of(4, tp=8, pp=4))
    span = step_range("a100-80g", layout, 10.0)
    assert span is not None and span["basis"] == f"{span['runs']} validation runs on A100, tp 8+, pp > 1"
    rows = [r for r in errors(VALIDATION) if r["hardware"].startswith("a100") and "tp8" in r["layout"]]
    rows = [r for r in rows if " pp1 " not in r["layout"]]
    ratios = [r["published_s"] / r["predicted_s"] for r in rows]
    assert span["runs"] == len(rows)
    assert span["low_s"] == pytest.approx(10.0 * min(1.0, *ratios))
    assert span["high_s"] == pytest.approx(10.0 * max(1.0, *ratios))
    h200 = step_range("h200", Layout(ParallelDims.of(8)), 1.0)
    assert h200 is not None and "on H100, tp 1, pp 1" in h200["basis"]
    assert step_range("h100-sxm+mine", Layout(ParallelDims.of(8)), 1.0) == h200
    assert step_range("cpu", layout, 1.0) is None


def test_cli_prints_the_range_and_the_dominant_uncertainty(capsys: pytest.CaptureFixture[str]) -> None:
    """``zerotron plan`` prints the range; ``--explain`` moves each uncertain constant and names the one
    that moves the step most, which is the one an independent recomputation finds."""
    argv = ["plan", "model.preset=llama3-8b", "train.precision=bf16", "train.seq_len=4096",
            "train.global_batch=64", "parallel.zero=3", "--hardware", "h100-sxm", "--gpus", "16"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    low, high = out["step_time_range_s"]
    assert low <= out["step_time_s"] <= high and "validation runs on H100" in out["step_time_range_basis"]
    assert main([*argv, "--explain"]) == 0
    text = capsys.readouterr().out
    assert "range    " in text and "uncertainty" in text
    dominant = next(line.split()[1] for line in text.splitlines() if "dominant:" in line)
    cfg = load_config(None, argv[1:6])
    m, layout, work = from_config(cfg, 16)
    hw = PROFILES["h100-sxm"]
    base = plan_layout(m, layout, work, hw).step_time_s
    moved = {
        key: max(
            abs(plan_layout(m, layout, work, dataclasses.replace(hw, **{key: v})).step_time_s - base)
            for v in values
        )
        for key, values in {
            "gemm_efficiency": (hw.gemm_efficiency * 0.92, min(1.0, hw.gemm_efficiency * 1.08)),
            "attention_efficiency": (hw.attention_efficiency * 0.75, hw.attention_efficiency * 1.25),
            "eager_elementwise": (hw.eager_elementwise * 0.8, hw.eager_elementwise * 1.2),
            "comm_efficiency": (hw.comm_efficiency * 0.85, min(1.0, hw.comm_efficiency * 1.15)),
            "overlap_contention": (
                max(0.0, hw.overlap_contention - 0.5),
                min(1.0, hw.overlap_contention + 0.5),
            ),
        }.items()
    }
    assert dominant == max(moved, key=lambda k: moved[k])


def test_fused_blocks_reproduce_the_compiled_h100_run() -> None:
    """An independent check of the GEMM law and the eager factor: the compiled 1B Llama run on the
    H100 (train.compile: each block's element-wise work fused; BENCHMARKS.md, 54.3% MFU at micro-batch 4,
    56.6% at 8) was not used to set any constant; planned with fused blocks it comes out within 3
    points of MFU, and the eager run (38.3-39.9%) within 2."""
    m = ModelShape(2048, 16, 32, 8, 64, 8192, 128256, True, True, False)
    work = Workload(2048, 8, "bf16")
    hw = PROFILES["h100-sxm"]
    for kernels, mb, measured, tol in (("fused", 4, 0.543, 0.03), ("fused", 8, 0.566, 0.03),
                                       ("eager", 4, 0.383, 0.02), ("eager", 8, 0.399, 0.02)):  # fmt: skip
        plan = plan_layout(m, Layout(ParallelDims.of(1), micro_batch=mb, kernels=kernels), work, hw)
        assert plan.mfu == pytest.approx(measured, abs=tol), (kernels, mb, plan.mfu)


def test_cli_accuracy_prints_both_sets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--accuracy"]) == 0
    out = capsys.readouterr().out
    assert out.count("| run | hardware |") == 4  # calibration, validation, held out, out of model
    assert f"calibration: {len(CALIBRATION)} runs" in out and f"validation: {len(VALIDATION)} runs" in out
    held = "held out (Megatron-Core's H100 weak scaling; never fitted, assumptions in published.py)"
    assert f"{held}: {len(HELD_OUT)} runs" in out
    assert "out of model (in neither set): 6 runs" in out


def test_held_out_megatron_h100_runs() -> None:
    """Megatron-Core r0.8.0's H100 weak-scaling table, the runs an outside check measured the planner
    on: in no other set and no fit, its per-GPU teraFLOP/s turned into steps that give the table's own
    MFU column under zerotron's independent FLOP count (41, 47, 49, 46, 42, 43, 44, 48, 47%); and the
    planner's error on them (BENCHMARKS.md) held: worst under the issue's 25% (it was 34%, 2.3x before
    the H100 changes, when tp overlap was fitted, not modelled), mean as measured."""
    key = lambda r: (r.hardware, r.gpus, r.hidden, r.layers, r.seq_len, r.global_batch)  # noqa: E731
    assert not {key(r) for r in HELD_OUT} & {key(r) for r in (*CALIBRATION, *VALIDATION)}
    mfus = []
    for run in HELD_OUT:
        m, _, work = run_inputs(run)
        mfus.append(
            flops_per_token(m, work.seq_len) * work.tokens / run.published_step_s() / (run.gpus * 989e12)
        )
    assert [round(100 * x) for x in mfus] == [41, 47, 49, 46, 42, 43, 44, 48, 47]
    s = summary(errors(HELD_OUT))
    assert s["worst"] < 0.25, s
    assert s["mean"] < 0.14, s


def _synthetic_run(tmp_path: Path, name: str, overrides: list[str], world: int, hw: object) -> str:
    cfg = load_config(None, ["train.global_batch=8", "train.micro_batch=2", *overrides])
    run = tmp_path / name
    run.mkdir()
    save_config(cfg, run / "config.yaml")
    step = plan_config(cfg, hw, world).step_time_s  # type: ignore[arg-type]
    p = cfg.parallel
    layout = {"dp": world // (p.tp * p.pp), "pp": p.pp, "cp": 1, "tp": p.tp, "ep": 1, "zero": p.zero}
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "step_time_s": step, "layout": layout}) + "\n")
    return str(run)


def test_calibrate_check_reports_held_out_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Runs made at known constants: fitted on dp 1 and dp 2, the held-out ZeRO-3, tp 2 and pp 2 runs are
    predicted to within a few percent and reported as held out."""
    cpu = PROFILES["cpu"]
    truth = dataclasses.replace(
        cpu, gemm_efficiency=0.2, attention_efficiency=cpu.attention_efficiency * 0.2 / cpu.gemm_efficiency
    )
    fit = [_synthetic_run(tmp_path, f"dp{n}", [f"parallel.dp={n}"], n, truth) for n in (1, 2)]
    held = [
        _synthetic_run(tmp_path, "z3", ["parallel.dp=2", "parallel.zero=3"], 2, truth),
        _synthetic_run(tmp_path, "tp2", ["parallel.tp=2", "model.vocab_size=260"], 2, truth),
        _synthetic_run(tmp_path, "pp2", ["parallel.pp=2"], 2, truth),
    ]
    assert main(["plan", "--calibrate", *fit, "--check", *held, "--hardware", "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["check"]["runs"]) == 3
    assert result["check"]["worst"] < 0.03, result["check"]
    assert main(["plan", "--calibrate", *fit, "--check", *held, "--hardware", "cpu"]) == 0
    assert "# held out (not fitted): 3 runs" in capsys.readouterr().out
    assert main(["plan", "--check", held[0], "--hardware", "cpu"]) == 2
    assert "goes with --calibrate" in capsys.readouterr().err
