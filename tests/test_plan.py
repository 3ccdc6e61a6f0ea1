"""`zerotron plan` against the literature (REFERENCES.md), bad input, the JSON schema and the search.

Published figures: ZeRO Table 1 (Rajbhandari et al. SC20), DeepSpeed's estimator examples (t5-3b),
Korthikanti et al. Table 2 (activation bytes per layer) and Narayanan et al. SC21 Table 1 (TFLOP/s per
GPU on Selene, one A100 profile for every row).
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from zerotron.cli import main
from zerotron.config_load import load_config
from zerotron.layout import ParallelDims
from zerotron.plan import PROFILES, PlanError, get_hardware, plan_config, plan_layout
from zerotron.plan import activations as act
from zerotron.plan import memory as mem
from zerotron.plan.layout import Layout, Workload, check, from_config
from zerotron.plan.search import search
from zerotron.shapes import ModelShape, flops_per_token, recompute_flops_per_token

# -- ZeRO Table 1: GB (1e9) per device, model states only, K = 12 ---------------------------------------
ZERO_TABLE1 = {  # dp: [(7.5B os, os+g, os+g+p), (128B ...), (1T ...)]
    1: ["120", "120", "120", "2048", "2048", "2048", "16000", "16000", "16000"],
    4: ["52.5", "41.3", "30", "896", "704", "512", "7000", "5500", "4000"],
    16: ["35.6", "21.6", "7.5", "608", "368", "128", "4750", "2875", "1000"],
    64: ["31.4", "16.6", "1.88", "536", "284", "32", "4187", "2218", "250"],
    256: ["30.4", "15.4", "0.47", "518", "263", "8", "4046", "2054", "62.5"],
    1024: ["30.1", "15.1", "0.12", "513", "257", "2", "4011", "2013", "15.6"],
}


@pytest.mark.parametrize("dp", sorted(ZERO_TABLE1))
def test_zero_table1_to_printed_precision(dp: int) -> None:
    """Every cell within one unit of its last printed digit (the paper rounds some cells, truncates others)."""
    for i, printed in enumerate(ZERO_TABLE1[dp]):
        psi = (7.5e9, 128e9, 1e12)[i // 3]
        stage = i % 3 + 1
        places = mem.model_states(int(psi), 0, mem.StateLayout(dp, stage), "mixed", "fp16")
        got = sum(places["device"].values()) / 1e9
        unit = 10.0 ** -(len(printed.split(".")[1]) if "." in printed else 0)
        assert abs(got - float(printed)) < unit, (dp, psi, stage, got, printed)


def test_deepspeed_estimator_t5_3b() -> None:
    """DeepSpeed's documented t5-3b example (2851M params, largest layer 32M: the 32128 x 1024 embedding)."""
    p, largest, n = 2851_000_000, 32128 * 1024, 8
    gib = 2**30
    assert round(mem.deepspeed_estimate(p, largest, n, 3) / gib, 2) == 6.10
    assert round(mem.deepspeed_estimate(p, largest, n, 3, "cpu") / gib, 2) == 0.79
    assert round(mem.deepspeed_estimate(p, largest, n, 3, "cpu", "cpu") / gib, 2) == 0.12
    assert round(mem.deepspeed_estimate(p, largest, n, 2, "cpu") / gib, 2) == 5.31


def _gpt(h: int, layers: int, heads: int, vocab: int = 51200) -> ModelShape:
    return ModelShape(
        h, layers, heads, heads, h // heads, 4 * h, vocab, gated=False, tied=True, qkv_bias=False
    )


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_korthikanti_table2(t: int) -> None:
    """Per-layer activation bytes equal Korthikanti Table 2 for GPT-3 175B shapes (b=1, s=2048)."""
    m, b, s = _gpt(12288, 96, 96), 1, 2048
    h, a = m.hidden, m.heads
    sbh = s * b * h

    def got(recompute: str, sp: bool) -> float:
        return act.split_bytes(act.megatron_layer_terms(m, b, s, recompute, flash=False), t, sp)

    assert got("none", False) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert got("none", True) == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)))
    assert got("selective", False) == pytest.approx(sbh * (10 + 24 / t))
    assert got("selective", True) == pytest.approx(34 * sbh / t)
    assert got("full", False) == pytest.approx(2 * sbh)
    if t == 1:
        assert got("none", False) == pytest.approx(sbh * (34 + 5 * a * s / h))
        flash = act.split_bytes(act.megatron_layer_terms(m, b, s, "none", flash=True), t, False)
        assert flash == pytest.approx(34 * sbh)


def test_pipeline_inflight_microbatches() -> None:
    """1F1B: the first stage holds p micro-batches (L layers' worth); interleaving × (1 + (p−1)/(p·v))."""
    p, v, layers = 8, 4, 96
    assert act.inflight_microbatches("1f1b", p, 64, 0, 1) * layers / p == layers
    assert act.inflight_microbatches("1f1b", p, 64, p - 1, 1) == 1
    assert act.inflight_microbatches("gpipe", p, 64, 0, 1) == 64
    inter = act.inflight_microbatches("interleaved", p, 64, 0, v) * layers / p
    assert inter == pytest.approx(layers * (1 + (p - 1) / (p * v)))


def test_flops_match_narayanan() -> None:
    """Model FLOPs with full recomputation equal 96·B·s·L·h²(1 + s/(6h) + V/(16Lh)) for GPT shapes."""
    m, s = _gpt(8192, 48, 64), 2048
    per_seq = (flops_per_token(m, s) + recompute_flops_per_token(m, s, "full")) * s
    h, L, V = m.hidden, m.layers, m.vocab
    assert per_seq == pytest.approx(96 * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h)))
    assert flops_per_token(m, s) * s == pytest.approx(
        72 * s * L * h**2 * (1 + s / (6 * h) + V / (12 * h * L))
    )


# Narayanan et al. Table 1: heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU.
NARAYANAN_TABLE1 = [
    (24, 2304, 24, 1, 1, 32, 512, 137),
    (32, 3072, 30, 2, 1, 64, 512, 138),
    (32, 4096, 36, 4, 1, 128, 512, 142),
    (48, 6144, 40, 8, 1, 256, 1024, 135),
    (64, 8192, 48, 8, 2, 512, 1536, 138),
    (80, 10240, 60, 8, 4, 1024, 1792, 140),
    (96, 12288, 80, 8, 8, 1536, 2304, 148),
    (128, 16384, 96, 8, 16, 1920, 2160, 155),
    (128, 20480, 105, 8, 35, 2520, 2520, 163),
    (160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def narayanan_plan(row: tuple[int, ...]) -> float:
    """Predicted TFLOP/s per GPU of one Table 1 row on the shipped a100-80g profile.

    The paper's setup: s = 2048, V = 51,200, full recomputation, micro-batch 1, interleaved 1F1B with
    the most model chunks (4, 3 or 2) that divide the stage's layers, attention without flash.
    """
    heads, h, layers, tp, pp, gpus, batch, _ = row
    m = _gpt(h, layers, heads)
    dp = gpus // (tp * pp)
    v = next((c for c in (4, 3, 2) if pp > 1 and layers % (pp * c) == 0 and (batch // dp) % pp == 0), 1)
    layout = Layout(
        ParallelDims.of(dp, tp=tp, pp=pp),
        micro_batch=1,
        recompute="full",
        pp_schedule="interleaved" if v > 1 else "1f1b",
        virtual_stages=v,
    )
    work = Workload(2048, batch, "bf16")
    hw = PROFILES["a100-80g"]
    check(m, layout, work, hw, gpus)
    return plan_layout(m, layout, work, hw, "mixed", flash=False).tflops_per_gpu


@pytest.mark.parametrize("row", NARAYANAN_TABLE1, ids=lambda r: f"h{r[1]}")
def test_narayanan_table1_within_10_percent(row: tuple[int, ...]) -> None:
    predicted = narayanan_plan(row)
    assert predicted == pytest.approx(row[-1], rel=0.10), (row, predicted)


# -- bad input -------------------------------------------------------------------------------------------


def _cfg(*overrides: str):  # type: ignore[no-untyped-def]
    base = [
        "model.preset=llama3-8b",
        "train.precision=bf16",
        "train.seq_len=4096",
        "train.global_batch=64",
        "train.micro_batch=1",
    ]
    return load_config(None, [*base, *overrides])


@pytest.mark.parametrize(
    ("overrides", "gpus", "expected"),
    [
        (["parallel.tp=16"], 16, "tp=16 exceeds the 8 GPUs of a node of h100-sxm"),
        (["parallel.tp=3"], 3, "tp=3 does not divide model.num_attention_heads=32"),
        (["parallel.dp=3", "parallel.tp=2"], 8, "but --gpus is 8"),
        (["parallel.pp=40"], 40, "pp*virtual_stages = 40 exceeds model.num_hidden_layers=32"),
        (["parallel.pp=2", "parallel.pp_layers=[10, 10]"], 2, "pp_layers=[10, 10] must have"),
        (
            ["parallel.tp=8", "model.num_key_value_heads=6", "model.num_attention_heads=48"],
            8,
            "neither divides",
        ),
        (["train.global_batch=12"], 8, "not divisible by the data-parallel size 8"),
        (["parallel.offload_params=cpu", "parallel.zero=2"], 8, "needs parallel.zero=3"),
        (["parallel.offload_optimizer=cpu"], 8, "needs parallel.zero >= 1"),
        (["parallel.ep=2"], 8, "the model has no experts"),
        (["parallel.zero=3", "parallel.pp=2"], 8, "does not model ZeRO-2/3 under pipeline parallelism"),
        (
            [
                "parallel.pp=2",
                "parallel.pp_schedule=interleaved",
                "parallel.virtual_stages=2",
                "train.global_batch=12",
                "parallel.dp=4",
            ],
            8,
            "to be a multiple of parallel.pp=2",
        ),
        (["parallel.cp=3"], 3, "train.seq_len=4096 is not a multiple of 2*parallel.cp = 6"),
        (["train.compile=true"], 8, "zerotron plan models eager blocks only"),
    ],
)
def test_impossible_layouts_are_explained(overrides: list[str], gpus: int, expected: str) -> None:
    with pytest.raises(PlanError, match=re.escape(expected)) as err:
        plan_config(_cfg(*overrides), PROFILES["h100-sxm"], gpus)
    assert "\n" not in str(err.value)


def test_unknown_hardware_lists_the_profiles() -> None:
    with pytest.raises(PlanError) as err:
        get_hardware("h100")
    for name in (
        "a100-40g",
        "a100-80g",
        "h100-sxm",
        "h200",
        "h100-pcie",
        "l40s",
        "rtx4090",
        "mi250x-gcd",
        "cpu",
    ):
        assert name in str(err.value)


def test_user_profile_file(tmp_path: Path) -> None:
    """A YAML profile inheriting a shipped one; a JSON one standing alone; bad keys named."""
    path = tmp_path / "mine.yaml"
    path.write_text("base: h100-sxm\nmemory_bytes: 96.0e9\ngpus_per_node: 4\npeak_flops: {bf16: 900.0e12}\n")
    hw = get_hardware(str(path))
    assert hw.memory_bytes == 96e9 and hw.gpus_per_node == 4 and hw.flops("bf16") == 900e12
    assert hw.flops("fp32") == PROFILES["h100-sxm"].flops("fp32")
    with pytest.raises(PlanError, match="tp=8 exceeds the 4 GPUs"):
        plan_config(_cfg("parallel.tp=8"), hw, 8)
    full = dataclasses.asdict(PROFILES["l40s"])
    (tmp_path / "l.json").write_text(json.dumps({**full, "name": "my-l40s"}))
    assert get_hardware(str(tmp_path / "l.json")).name == "my-l40s"
    (tmp_path / "bad.yaml").write_text("base: a100-80g\nmemory_gb: 80\n")
    with pytest.raises(PlanError, match="unknown key.*memory_gb"):
        get_hardware(str(tmp_path / "bad.yaml"))
    with pytest.raises(PlanError, match="no such profile file"):
        get_hardware(str(tmp_path / "missing.yaml"))
    (tmp_path / "sms.yaml").write_text("base: h100-sxm\nsms: 114\n")  # an H100 PCIe's, say
    assert get_hardware(str(tmp_path / "sms.yaml")).sms == 114
    (tmp_path / "neg.yaml").write_text("base: h100-sxm\nsms: -1\n")
    with pytest.raises(PlanError, match="sms .* must be >= 0"):
        get_hardware(str(tmp_path / "neg.yaml"))


# -- the plan and its JSON ---------------------------------------------------------------------------------


def test_json_schema() -> None:
    plan = plan_config(_cfg("parallel.zero=1", "train.recompute=selective"), PROFILES["h100-sxm"], 8)
    out = json.loads(json.dumps(plan.to_json()))
    assert set(out) == {
        "memory_bytes",
        "step_time_s",
        "step_time_range_s",
        "step_time_range_basis",
        "tokens_per_s",
        "mfu",
        "phase_peak_memory_bytes",
        "breakdown",
    }
    assert set(out["phase_peak_memory_bytes"]) == {"materialise", "steps", "save", "load", "sample"}
    assert set(out["memory_bytes"]) == {"params", "grads", "optimizer", "activations", "buffers", "total"}
    parts = sum(v for k, v in out["memory_bytes"].items() if k != "total")
    assert out["memory_bytes"]["total"] == pytest.approx(parts)
    assert out["step_time_s"] == pytest.approx(sum(out["breakdown"]["time_s"].values()))
    assert out["tokens_per_s"] == pytest.approx(64 * 4096 / out["step_time_s"])
    assert 0 < out["mfu"] < 1
    assert out["breakdown"]["layout"]["zero"] == 1


def test_memory_responds_to_each_technique() -> None:
    """ZeRO stages shrink states by the ZeRO ratios; recompute and SP shrink activations."""
    hw = PROFILES["h100-sxm"]
    z = {k: plan_config(_cfg(f"parallel.zero={k}"), hw, 8).memory for k in range(4)}
    assert z[1]["optimizer"] == pytest.approx(z[0]["optimizer"] / 8, rel=1e-6)
    assert z[2]["grads"] == pytest.approx(z[0]["grads"] / 8, rel=1e-6)
    # bf16: data parallelism holds 16-bit weights (2) beside whole fp32 masters (4); ZeRO-3 1/8 of the masters
    assert z[3]["params"] == pytest.approx(z[0]["params"] * 4 / 6 / 8, rel=1e-6)
    act = {
        r: plan_config(_cfg(f"train.recompute={r}"), hw, 8).memory["activations"]
        for r in ("none", "selective", "full")
    }
    assert act["full"] < act["none"]
    # The engine's selective recomputation keeps the core's inputs (RoPE-rotated q/k in the weights'
    # dtype, 16-bit under bf16) and drops its output and log-sum-exp (flash saves no scores).
    assert act["selective"] < act["none"]
    fp32 = {
        r: plan_config(_cfg(f"train.recompute={r}", "train.precision=fp32"), hw, 8).memory["activations"]
        for r in ("none", "selective")
    }
    assert fp32["selective"] < fp32["none"]
    tp = plan_config(_cfg("parallel.tp=4"), hw, 8).memory["activations"]
    tp_sp = plan_config(_cfg("parallel.tp=4", "parallel.sequence_parallel=true"), hw, 8).memory["activations"]
    assert tp_sp < tp < act["none"]
    mixed = plan_config(_cfg(), hw, 8, convention="mixed").memory
    assert mixed["params"] == z[0]["params"] / 3  # 16-bit parameters only (the masters go with the optimizer)
    assert mixed["optimizer"] > z[0]["optimizer"]  # the fp32 master copy joins m and v
    off = plan_config(_cfg("parallel.zero=1", "parallel.offload_optimizer=cpu"), hw, 8)
    assert off.memory["optimizer"] == 0 and off.host_bytes > 0
    assert off.time["offload_transfer"] > 0


def test_offloaded_parameters_cross_the_link_in_16_bits_under_bf16() -> None:
    """ZeRO-3 parameter offload to NVMe: under bf16 the offloaded parameters are the engine's 16-bit
    copy of the shards, so the plan stores half the parameter bytes there, moves the fp32 master to the
    optimizer's place, and the parameter fetches take half fp32's time (less of it is exposed)."""
    hw = PROFILES["h100-sxm"]
    off = ["parallel.zero=3", "parallel.offload_params=nvme", "parallel.offload_optimizer=cpu"]
    off += ["train.seq_len=128"]  # little compute to hide the fetches under
    plans = {p: plan_config(_cfg(*off, f"train.precision={p}"), hw, 8) for p in ("bf16", "fp32")}
    assert plans["bf16"].nvme_bytes == pytest.approx(plans["fp32"].nvme_bytes / 2, rel=1e-6)
    # the fp32 master leaves the parameter file (fp32's is the master) for the optimizer's place
    master = plans["fp32"].nvme_bytes
    assert plans["bf16"].host_bytes == pytest.approx(plans["fp32"].host_bytes + master, rel=1e-6)
    assert plans["fp32"].time["param_offload"] > 0
    # exposed: micro-batches x (fetch - the compute that covers it); the fetch halves
    assert plans["bf16"].time["param_offload"] < plans["fp32"].time["param_offload"]


def test_float8_gathers_halve_the_planned_gathered_bytes() -> None:
    """ZeRO-3 in fp8 over 32 H100s: gathering the blocks' float8 weights as a byte each (the default)
    shrinks the gathered working copies the planner holds (a block's weights at half their bf16
    bytes: then the embedding is the largest unit) and shortens the gathers the step time exposes;
    rowwise (bf16 gathers) plans as ``never`` does."""
    hw = PROFILES["h100-sxm"]
    base = ["parallel.zero=3", "train.precision=fp8", "train.global_batch=32", "train.seq_len=1024"]
    base += ["model.vocab_size=32000"]  # a block, not the embedding, is the largest unit gathered
    auto = plan_config(_cfg(*base), hw, 32)
    never = plan_config(_cfg(*base, "parallel.zero_fp8_gather=never"), hw, 32)
    rowwise = plan_config(_cfg(*base, "train.fp8_recipe=rowwise"), hw, 32)
    assert auto.detail["zero3_gathered_params"] < 0.65 * never.detail["zero3_gathered_params"]
    assert auto.time["dp_param_gather"] < never.time["dp_param_gather"]
    assert rowwise.time["dp_param_gather"] == never.time["dp_param_gather"]
    assert auto.memory["optimizer"] == never.memory["optimizer"]


def test_float8_gathers_of_routed_experts_are_planned_as_bytes() -> None:
    """ZeRO-3 in fp8 over 32 H100s, an MoE model: the experts' stacks are gathered as float8 too (a
    byte an element, over their replicas), so what gathering in float8 saves grows with the experts
    (with only the attention's weights in float8 it would not: the same for 16 and 32 experts)."""
    hw = PROFILES["h100-sxm"]
    base = ["parallel.zero=3", "train.precision=fp8", "train.global_batch=32", "train.seq_len=1024"]
    base += ["parallel.ep=4", "model.moe_intermediate_size=2048"]
    saved = []
    for experts in (16, 32):
        moe = [*base, f"model.num_local_experts={experts}"]
        auto = plan_config(_cfg(*moe), hw, 32)
        never = plan_config(_cfg(*moe, "parallel.zero_fp8_gather=never"), hw, 32)
        saved.append(never.time["dp_param_gather"] - auto.time["dp_param_gather"])
    assert 0 < saved[0] < 0.8 * saved[1], saved


def test_hybrid_sharding_keeps_zero3_gathers_inside_a_node() -> None:
    """ZeRO-3 over 32 H100s (4 nodes): sharding over each node's 8 GPUs (``zero_shard_size=8``) holds
    8-way states instead of 32-way, and trades the gathers' inter-node traffic for one all-reduce of
    the gradient shard across nodes, which the step-time model puts on the network link."""
    hw = PROFILES["h100-sxm"]
    base = ["parallel.zero=3", "train.precision=bf16", "train.global_batch=32", "train.seq_len=1024"]
    flat = plan_config(_cfg(*base), hw, 32)
    hsdp = plan_config(_cfg(*base, "parallel.zero_shard_size=8"), hw, 32)
    assert hsdp.memory["optimizer"] == pytest.approx(4 * flat.memory["optimizer"], rel=1e-3)
    assert hsdp.time["dp_param_gather"] < flat.time["dp_param_gather"]  # NVLink instead of the network
    assert hsdp.time["dp_grad_reduce"] > 0 == flat.time["dp_grad_reduce"]  # the cross-node all-reduce
    with pytest.raises(PlanError, match="zero_shard_size=3 must divide"):
        plan_config(_cfg(*base, "parallel.zero_shard_size=3"), hw, 32)


def test_pipeline_bubble_follows_schedule() -> None:
    hw = PROFILES["h100-sxm"]
    times = {}
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)):
        cfg = _cfg("parallel.pp=4", f"parallel.pp_schedule={schedule}", f"parallel.virtual_stages={v}")
        times[schedule] = plan_config(cfg, hw, 8).time["pipeline_bubble"]
    assert times["gpipe"] == pytest.approx(times["1f1b"])
    assert times["interleaved"] == pytest.approx(times["1f1b"] / 2)
    assert 0 < times["zb"] < times["interleaved"]


# -- search ------------------------------------------------------------------------------------------------


def test_search_ranks_fitting_layouts(tmp_path: Path) -> None:
    cfg = _cfg("train.global_batch=256")
    hw = PROFILES["a100-40g"]
    model, _, work = from_config(cfg, 16)
    result = search(model, work, hw, 16, top=50)
    speeds = [p.tokens_per_s for p in result.plans]
    assert speeds == sorted(speeds, reverse=True)
    for p in result.plans:
        assert p.fits and p.memory["total"] <= hw.memory_bytes
        check(model, p.layout, work, hw, 16)
    # A hand-picked layout that fits can be no faster than the best found.
    mine = Layout(ParallelDims.of(4, tp=4, zero=1), micro_batch=1, recompute="full", sequence_parallel=True)
    check(model, mine, work, hw, 16)
    hand = plan_layout(model, mine, work, hw)
    assert hand.fits and hand.tokens_per_s <= result.plans[0].tokens_per_s
    from zerotron.plan.report import draw_breakdowns, format_table

    table = format_table(result)
    assert result.plans[0].layout.short() in table.splitlines()[2]
    png = draw_breakdowns(result, tmp_path / "s.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_search_nothing_fits() -> None:
    model, _, work = from_config(_cfg("model.preset=llama3-70b"), 1)
    with pytest.raises(PlanError, match="no layout of .* fits 1 x rtx4090"):
        search(model, work, PROFILES["rtx4090"], 1)
    # 32 heads, 4 layers, 4096 tokens: only dp=7 fits 7 devices, and it does not divide 64 sequences.
    model, _, work = from_config(_cfg("model.num_hidden_layers=4"), 7)
    with pytest.raises(PlanError, match="no layout splits train.global_batch=64 over 7 devices"):
        search(model, work, PROFILES["h100-sxm"], 7)


# -- command line ------------------------------------------------------------------------------------------


def test_cli_plan_json_and_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = [
        "plan",
        "model.preset=llama3-8b",
        "train.global_batch=64",
        "train.micro_batch=1",
        "train.precision=bf16",
        "parallel.zero=3",
        "--hardware",
        "h100-sxm",
        "--gpus",
        "16",
    ]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["breakdown"]["layout"]["dp"] == 16
    assert main(args) == 0
    assert "tokens/s" in capsys.readouterr().out
    assert main(["plan", "parallel.tp=16", "--hardware", "h100-sxm", "--gpus", "16"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("zerotron: error: tp=16 exceeds the 8 GPUs") and "\n" not in err
    assert main(["plan", "--hardware", "tpu"]) == 2
    assert "h100-sxm" in capsys.readouterr().err
    assert main(["plan", "--gpus", "8"]) == 2
    assert "--hardware is required" in capsys.readouterr().err
    png = tmp_path / "s.png"
    assert (
        main(["plan", *args[1:5], "--hardware", "h100-sxm", "--gpus", "16", "--search", "--png", str(png)])
        == 0
    )
    assert png.is_file() and "candidate layouts fit" in capsys.readouterr().out


def test_plan_does_not_import_torch() -> None:
    code = (
        "import sys; import zerotron.plan.search, zerotron.plan.calibrate, zerotron.plan.report;"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_calibrate_recovers_efficiency(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Metrics made by the planner at a known efficiency: the fit finds it, and the output is a profile."""
    from zerotron.config_load import save_config

    cfg = load_config(None, ["train.global_batch=8", "train.micro_batch=4", "parallel.dp=2"])
    save_config(cfg, tmp_path / "config.yaml")
    cpu = PROFILES["cpu"]  # the fit keeps attention efficiency in proportion to GEMM efficiency
    truth = dataclasses.replace(
        cpu,
        gemm_efficiency=0.137,
        attention_efficiency=cpu.attention_efficiency * 0.137 / cpu.gemm_efficiency,
    )
    step = plan_config(cfg, truth, 2).step_time_s
    layout = {"dp": 2, "pp": 1, "cp": 1, "tp": 1, "ep": 1, "zero": 0}
    lines = [
        json.dumps({"step": i, "step_time_s": step * (1.5 if i == 1 else 1.0), "layout": layout})
        for i in range(1, 6)
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["plan", "--calibrate", str(tmp_path), "--hardware", "cpu"]) == 0
    (tmp_path / "fitted.yaml").write_text(capsys.readouterr().out)
    fitted = get_hardware(str(tmp_path / "fitted.yaml"))
    assert fitted.gemm_efficiency == pytest.approx(0.137, rel=1e-4)
    assert main(["plan", "--calibrate", str(tmp_path / "nowhere")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_cli_plan_reads_architecture_from_model_path(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``model.path`` (a Hugging Face directory): the architecture comes from its config.json."""
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        "vocab_size": 1000,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    args = [
        "plan",
        f"model.path={tmp_path}",
        "train.micro_batch=1",
        "--hardware",
        "cpu",
        "--gpus",
        "1",
        "--json",
    ]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    per_layer = 256 * (256 + 2 * 64) + 256 * 256 + 3 * 256 * 512 + 2 * 256
    n_params = 3 * per_layer + 2 * 1000 * 256 + 256
    assert out["memory_bytes"]["params"] == 4 * n_params


def test_calibrate_several_runs_fits_compute_and_communication(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Runs of two layouts made at known constants: both constants are recovered, the output is a profile."""
    from zerotron.config_load import save_config

    cpu = PROFILES["cpu"]
    truth = dataclasses.replace(
        cpu,
        gemm_efficiency=0.137,
        attention_efficiency=cpu.attention_efficiency * 0.137 / cpu.gemm_efficiency,
        comm_efficiency=0.3,
    )
    base = [
        "model.hidden_size=1024",
        "model.intermediate_size=2816",
        "model.num_attention_heads=8",
        "train.seq_len=16",
        "train.global_batch=8",
        "train.micro_batch=1",
    ]
    dirs = []
    for dp in (1, 8):
        cfg = load_config(None, [*base, f"parallel.dp={dp}"])
        run = tmp_path / f"dp{dp}"
        run.mkdir()
        save_config(cfg, run / "config.yaml")
        step = plan_config(cfg, truth, dp).step_time_s
        layout = {"dp": dp, "pp": 1, "cp": 1, "tp": 1, "ep": 1, "zero": 0}
        (run / "metrics.jsonl").write_text(
            json.dumps({"step": 1, "step_time_s": step, "layout": layout}) + "\n"
        )
        dirs.append(str(run))
    assert main(["plan", "--calibrate", *dirs, "--hardware", "cpu"]) == 0
    (tmp_path / "fitted.yaml").write_text(capsys.readouterr().out)
    fitted = get_hardware(str(tmp_path / "fitted.yaml"))
    assert fitted.gemm_efficiency == pytest.approx(0.137, rel=0.02)
    assert fitted.comm_efficiency == pytest.approx(0.3, rel=0.02)
