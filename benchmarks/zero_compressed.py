"""ZeRO++'s compressed collectives (qwZ, qgZ) beside the uncompressed run (BENCHMARKS.md).

Run:  python benchmarks/zero_compressed.py
      [--part train|onebit|onebit_zero|zero_one|zero_one_zero|ranks|plan|all]
      [--steps 200] [--out DIR]

- ``train``: the default job (``zerotron train`` with no arguments: the tiny preset, 2 ranks) under
  ZeRO-3 (and ZeRO-2 for qgZ), uncompressed and with each technique, ``--steps`` steps each. Prints
  bytes per step by op (``metrics.jsonl``'s ``comm_bytes``, the last step), the ratio to the
  uncompressed run's data-parallel bytes, mean step time past the first 5 steps, and the last loss and
  its relative difference; writes ``zero_compressed.png`` (the loss curves) into ``--out``.
- ``onebit``: the default job on 2 ranks with AdamW and with 1-bit Adam (warm-ups of a fifth of the
  run, as the paper's 15-25%, and of half of it), all without clipping: bytes per step after the
  warm-up, step time, the loss (mean of the last 20 steps); ``onebit.png`` the curves.
- ``onebit_zero``: the default job on 2 ranks under ZeRO-2 (fp32 and bf16), AdamW against 1-bit Adam
  (warm-up of half the run): bytes per step after the warm-up, the gradient bytes' ratio, step time,
  the loss (mean of the last 20 steps).
- ``zero_one``: the default job on 2 ranks with AdamW, 1-bit Adam (warm-up 1/2) and 0/1 Adam (the
  variance frozen at 1/2; synchronising every step as DeepSpeed's defaults do in a run this short, and
  with intervals that grow to 4 and to 16 steps): the data-parallel bytes of the whole run, step time,
  the loss (mean of the last 20 steps); ``zero_one.png`` the curves.
- ``zero_one_zero``: 0/1 Adam in ZeRO's engine: the default job on 2 ranks under bf16 data
  parallelism, ZeRO-1 (fp32) and ZeRO-2 (bf16), AdamW against 0/1 Adam (frozen at 1/2: DeepSpeed's
  other defaults, and the variance updated every step until the freeze with intervals that grow to 4
  steps): the data-parallel bytes of the whole run, the optimizer state at the end, step time, the loss
  (mean of the last 20 steps).
- ``ranks``: 2, 4 and 8 ranks, 20 steps of the default job (global batch 8 sequences): ZeRO-3 against
  ZeRO-3 with qwZ, qgZ int4 and (4 and 8 ranks) hpZ in blocks of 2; AdamW against 1-bit Adam (warm-up
  of 5 steps); bytes per step by group (the last step) and mean step time past the first 5.
- ``plan``: ``zerotron plan`` of a 70B Llama on 64 H100s (8 nodes), ZeRO-3 over all 64, sequence
  4096, global batch 512, bf16, over a 100 Gb/s and a 400 Gb/s network per GPU, with and without each
  technique: the predicted step time and the ratio to ZeRO-3's; and of Llama-3.2-1B under data
  parallelism on the same 64 GPUs (one 4096-token sequence per GPU and step), AdamW against 1-bit
  Adam after its warm-up.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

VARIANTS = [
    ("ZeRO-3", ["parallel.zero=3"]),
    ("ZeRO-3 + qwZ", ["parallel.zero=3", "parallel.zero_quantized_weights=true"]),
    ("ZeRO-3 + qgZ int8", ["parallel.zero=3", "parallel.zero_quantized_gradients=true"]),
    (
        "ZeRO-3 + qgZ int4",
        [
            "parallel.zero=3",
            "parallel.zero_quantized_gradients=true",
            "parallel.zero_quantized_gradient_bits=4",
        ],
    ),
    (
        "ZeRO-3 + qwZ + qgZ int4",
        [
            "parallel.zero=3",
            "parallel.zero_quantized_weights=true",
            "parallel.zero_quantized_gradients=true",
            "parallel.zero_quantized_gradient_bits=4",
        ],
    ),
    ("ZeRO-2", ["parallel.zero=2"]),
    ("ZeRO-2 + qgZ int8", ["parallel.zero=2", "parallel.zero_quantized_gradients=true"]),
]


def _run(label: str, overrides: list[str], steps: int, out: Path) -> dict:
    run = out / label.replace(" ", "_").replace("+", "p").replace("/", "-")
    cmd = [
        sys.executable,
        "-m",
        "zerotron",
        "train",
        *overrides,
        f"train.steps={steps}",
        "checkpoint.every=0",
    ]
    cmd += ["log.progress=none", "train.sample_every=0", "--out", str(run), "--overwrite"]
    print("<!--", " ".join(cmd[1:]), "-->", flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps_s = [r["step_time_s"] for r in records[5:]] or [r["step_time_s"] for r in records]
    return {
        "losses": [r["loss"] for r in records],
        "comm_bytes": records[-1]["comm_bytes"],
        "step_s": sum(steps_s) / len(steps_s),
        # every step's data bytes over dp, the loss's few-byte scalars left out
        "run_dp_bytes": sum(_dp_bytes(r["comm_bytes"], True) for r in records),
        "optimizer_bytes": records[-1]["model_state_bytes"]["optimizer"],
    }


def _dp_bytes(comm: dict, scalars_out: bool = False) -> int:
    """The dp group's data bytes: ZeRO's gathers and reductions (``scalars_out``: every op, the loss
    and norm scalars' all-reduce of a few bytes taken out)."""
    ops = comm.get("dp", {})
    if scalars_out:
        return sum(n for n in ops.values() if n > 64)
    return sum(n for op, n in ops.items() if op != "all_reduce")


def _plot(results: dict, title: str, path: Path, marks: tuple[int, ...] = ()) -> None:
    """The loss curves of ``results`` (vertical lines at ``marks``) into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, r in results.items():
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=label, linewidth=1)
    for step in marks:
        ax.axvline(step, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def train(steps: int, out: Path) -> None:
    results = {label: _run(label, overrides, steps, out) for label, overrides in VARIANTS}
    (out / "zero_compressed.json").write_text(json.dumps(results, indent=1))
    print("| job | bytes / step by op | bytes vs uncompressed | step (s) | step vs uncompressed | last loss "
          "| loss vs uncompressed |\n|---|---|---:|---:|---:|---:|---:|")  # fmt: skip
    for label, r in results.items():
        base = results["ZeRO-2" if label.startswith("ZeRO-2") else "ZeRO-3"]
        ops = ", ".join(f"{op} {n / 1e6:.3f} MB" for op, n in sorted(r["comm_bytes"].get("dp", {}).items()))
        ratio = _dp_bytes(r["comm_bytes"]) / _dp_bytes(base["comm_bytes"])
        loss, base_loss = r["losses"][-1], base["losses"][-1]
        print(
            f"| {label} | {ops} | {ratio:.3f}× | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f}× | "
            f"{loss:.4f} | {100 * (loss - base_loss) / base_loss:+.2f}% |"
        )
    _plot(results, "The default job on 2 ranks: ZeRO++ compression vs none", out / "zero_compressed.png")


def onebit(steps: int, out: Path) -> None:
    import statistics

    onebit_adam = ["train.grad_clip=0", "train.optimizer=onebit_adam"]
    runs = {
        "AdamW": ["train.grad_clip=0"],
        "1-bit Adam, warm-up 1/5": [*onebit_adam, f"train.onebit_freeze_step={steps // 5}"],
        "1-bit Adam, warm-up 1/2": [*onebit_adam, f"train.onebit_freeze_step={steps // 2}"],
    }
    results = {label: _run(label, overrides, steps, out) for label, overrides in runs.items()}
    (out / "onebit.json").write_text(json.dumps(results, indent=1))
    base = results["AdamW"]
    print(
        "| job | bytes / step (after warm-up) | bytes vs AdamW | step (s) | loss, last 20 steps | vs AdamW |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for label, r in results.items():
        ops = ", ".join(f"{op} {n / 1e6:.3f} MB" for op, n in sorted(r["comm_bytes"].get("dp", {}).items()))
        loss, base_loss = statistics.mean(r["losses"][-20:]), statistics.mean(base["losses"][-20:])
        ratio = _dp_bytes(r["comm_bytes"], True) / _dp_bytes(base["comm_bytes"], True)
        print(
            f"| {label} | {ops} | {ratio:.4f}× | {r['step_s']:.3f} | {loss:.4f} | "
            f"{100 * (loss - base_loss) / base_loss:+.2f}% |"
        )
    title = "The default job on 2 ranks: 1-bit Adam vs AdamW"
    _plot(results, title, out / "onebit.png", marks=(steps // 5, steps // 2))


def onebit_zero(steps: int, out: Path) -> None:
    import statistics

    onebit_adam = [
        "train.grad_clip=0",
        "train.optimizer=onebit_adam",
        f"train.onebit_freeze_step={steps // 2}",
    ]
    pairs = {
        "ZeRO-2": ["train.grad_clip=0", "parallel.zero=2"],
        "ZeRO-2, bf16": ["train.grad_clip=0", "parallel.zero=2", "train.precision=bf16"],
    }
    print("| layout | job | bytes / step after the warm-up | gradient bytes vs AdamW | step (s) | loss, last 20 "
          "steps | vs AdamW |\n|---|---|---|---:|---:|---:|---:|")  # fmt: skip
    for layout, args in pairs.items():
        base = _run(f"{layout} AdamW", args, steps, out)
        ours = _run(f"{layout} 1-bit Adam", [*args, *onebit_adam[1:]], steps, out)
        base_loss = statistics.mean(base["losses"][-20:])
        full = base["comm_bytes"]["dp"]["reduce_scatter"]
        for label, r in (("AdamW", base), ("1-bit Adam, warm-up 1/2", ours)):
            ops = ", ".join(
                f"{op} {n / 1e6:.3f} MB" for op, n in sorted(r["comm_bytes"]["dp"].items()) if n > 64
            )
            dp = r["comm_bytes"]["dp"]
            grads = dp.get("reduce_scatter", 0) + dp.get("all_to_all", 0)
            loss = statistics.mean(r["losses"][-20:])
            print(
                f"| {layout} | {label} | {ops} | {grads / full:.4f}× | {r['step_s']:.3f} | {loss:.4f} | "
                f"{100 * (loss - base_loss) / base_loss:+.2f}% |"
            )


def zero_one(steps: int, out: Path) -> None:
    import statistics

    common = ["train.grad_clip=0"]
    zero_one_adam = [*common, "train.optimizer=zero_one_adam", f"train.zero_one_var_freeze_step={steps // 2}"]
    runs = {
        "AdamW": common,
        "1-bit Adam, warm-up 1/2": [
            *common,
            "train.optimizer=onebit_adam",
            f"train.onebit_freeze_step={steps // 2}",
        ],
        "0/1 Adam, freeze 1/2, H = 1": zero_one_adam,
        "0/1 Adam, freeze 1/2, variance every step for 50 updates, H = 1": [
            *zero_one_adam,
            f"train.zero_one_var_update_scaler={steps // 4}",
        ],
        "0/1 Adam, freeze 1/2, H up to 4": [
            *zero_one_adam,
            f"train.zero_one_local_step_scaler={steps // 8}",
            "train.zero_one_local_step_clipper=4",
        ],
        "0/1 Adam, freeze 1/2, H up to 16": [
            *zero_one_adam,
            f"train.zero_one_local_step_scaler={steps // 20}",
            "train.zero_one_local_step_clipper=16",
        ],
    }
    results = {label: _run(label, overrides, steps, out) for label, overrides in runs.items()}
    (out / "zero_one.json").write_text(json.dumps(results, indent=1))
    base = results["AdamW"]
    print("| job | dp bytes over the run | vs AdamW | step (s) | loss, last 20 steps | vs AdamW |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, r in results.items():
        loss, base_loss = statistics.mean(r["losses"][-20:]), statistics.mean(base["losses"][-20:])
        print(
            f"| {label} | {r['run_dp_bytes'] / 1e6:.1f} MB | {r['run_dp_bytes'] / base['run_dp_bytes']:.3f}× | "
            f"{r['step_s']:.3f} | {loss:.4f} | {100 * (loss - base_loss) / base_loss:+.2f}% |"
        )
    _plot(
        results,
        "The default job on 2 ranks: 0/1 Adam vs 1-bit Adam and AdamW",
        out / "zero_one.png",
        (steps // 2,),
    )


def zero_one_zero(steps: int, out: Path) -> None:
    import statistics

    zero_one_adam = ["train.optimizer=zero_one_adam", f"train.zero_one_var_freeze_step={steps // 2}"]
    jobs = {
        "AdamW": [],
        "0/1 Adam, DeepSpeed's defaults": zero_one_adam,
        "0/1 Adam, variance every step, H up to 4": [
            *zero_one_adam,
            f"train.zero_one_var_update_scaler={steps // 2}",
            f"train.zero_one_local_step_scaler={steps // 8}",
            "train.zero_one_local_step_clipper=4",
        ],
    }
    layouts = {
        "data parallelism, bf16": ["train.precision=bf16"],
        "ZeRO-1, fp32": ["parallel.zero=1"],
        "ZeRO-2, bf16": ["parallel.zero=2", "train.precision=bf16"],
    }
    print("| layout | job | dp bytes over the run | vs AdamW | optimizer state (rank 0) | step (s) | loss, last "
          "20 steps | vs AdamW |\n|---|---|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for layout, args in layouts.items():
        results = {
            job: _run(f"{layout} {job}", ["train.grad_clip=0", *args, *extra], steps, out)
            for job, extra in jobs.items()
        }
        base = results["AdamW"]
        base_loss = statistics.mean(base["losses"][-20:])
        for job, r in results.items():
            loss = statistics.mean(r["losses"][-20:])
            print(
                f"| {layout} | {job} | {r['run_dp_bytes'] / 1e6:.1f} MB | "
                f"{r['run_dp_bytes'] / base['run_dp_bytes']:.3f}× | {r['optimizer_bytes'] / 1e6:.2f} MB | "
                f"{r['step_s']:.3f} | {loss:.4f} | {100 * (loss - base_loss) / base_loss:+.2f}% |",
                flush=True,
            )


def ranks(out: Path) -> None:
    print("| ranks | job | bytes / step by group | bytes vs uncompressed | step (s) | step vs uncompressed |")
    print("|---:|---|---|---:|---:|---:|")
    for n in (2, 4, 8):
        zeropp = [
            "parallel.zero=3",
            "parallel.zero_quantized_weights=true",
            "parallel.zero_quantized_gradients=true",
        ]
        zeropp += ["parallel.zero_quantized_gradient_bits=4"] + (
            ["parallel.zero_hpz_size=2", "parallel.zero_quantized_gradient_node=2"] if n > 2 else []
        )
        pairs = [
            (
                "ZeRO-3",
                ["parallel.zero=3"],
                "ZeRO-3 + qwZ + qgZ int4" + (" + hpZ 2, qgZ in nodes of 2" if n > 2 else ""),
                zeropp,
            ),
            (
                "AdamW",
                ["train.grad_clip=0"],
                "1-bit Adam",
                ["train.grad_clip=0", "train.optimizer=onebit_adam", "train.onebit_freeze_step=5"],
            ),
        ]
        for base_label, base_args, label, args in pairs:
            common = ["train.global_batch=8", "train.micro_batch=1", f"--nproc={n}"]
            base = _run(f"{base_label} {n}", [*base_args, *common], 20, out)
            ours = _run(f"{label} {n}", [*args, *common], 20, out)
            for name, r in ((base_label, base), (label, ours)):
                groups = ", ".join(
                    f"{g} {sum(v for v in ops.values() if v > 64) / 1e6:.3f} MB"
                    for g, ops in sorted(r["comm_bytes"].items())
                )
                total = sum(v for ops in r["comm_bytes"].values() for v in ops.values() if v > 64)
                total_base = sum(v for ops in base["comm_bytes"].values() for v in ops.values() if v > 64)
                print(
                    f"| {n} | {name} | {groups} | {total / total_base:.3f}× | {r['step_s']:.3f} | "
                    f"{r['step_s'] / base['step_s']:.2f}× |"
                )


PLAN = [
    "model.preset=llama3-70b",
    "train.seq_len=4096",
    "train.global_batch=512",
    "train.micro_batch=1",
    "train.precision=bf16",
    "train.recompute=full",
    "parallel.zero=3",
    "parallel.grad_reduce_dtype=bf16",
]
QWZ_QGZ4 = [
    "parallel.zero_quantized_weights=true",
    "parallel.zero_quantized_gradients=true",
    "parallel.zero_quantized_gradient_bits=4",
]
ONE_LEVEL = ["parallel.zero_quantized_gradient_node=1"]  # the default (auto) would take nodes of 8
PLAN_VARIANTS = [
    ("ZeRO-3", []),
    ("+ qwZ", ["parallel.zero_quantized_weights=true"]),
    ("+ qgZ int4, one level", [*QWZ_QGZ4[1:], *ONE_LEVEL]),
    ("+ hpZ (blocks of 8: a node)", ["parallel.zero_hpz_size=8"]),
    ("+ qwZ + qgZ int4, one level", [*QWZ_QGZ4, *ONE_LEVEL]),
    ("+ qwZ + qgZ int4, one level + hpZ", [*QWZ_QGZ4, "parallel.zero_hpz_size=8", *ONE_LEVEL]),
    ("+ qgZ int4 in two levels (nodes of 8)", [*QWZ_QGZ4[1:], "parallel.zero_quantized_gradient_node=8"]),
    (
        "+ qwZ + qgZ int4 in two levels + hpZ",
        [*QWZ_QGZ4, "parallel.zero_hpz_size=8", "parallel.zero_quantized_gradient_node=8"],
    ),
]


def plan(out: Path) -> None:
    print(
        "| network per GPU | job | predicted step (s) | speed-up | memory / GPU (GiB) |\n|---|---|---:|---:|---:|"
    )
    for gbits in (100, 400):
        profile = out / f"h100_{gbits}g.json"
        profile.write_text(json.dumps({"base": "h100-sxm", "inter_bw": gbits / 8 * 1e9}))
        base = None
        for label, extra in PLAN_VARIANTS:
            cmd = [sys.executable, "-m", "zerotron", "plan", *PLAN, *extra, "--hardware", str(profile)]
            cmd += ["--gpus", "64", "--json"]
            report = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            step, memory = float(report["step_time_s"]), report["memory_bytes"]["total"] / 2**30
            base = base or step
            print(f"| {gbits} Gb/s | {label} | {step:.2f} | {base / step:.2f}× | {memory:.1f} |")
        dp_only = ["model.preset=llama3.2-1b", "train.seq_len=4096", "train.global_batch=64"]
        dp_only += [
            "train.micro_batch=1",
            "train.precision=fp32",
            "train.recompute=full",
            "train.grad_clip=0",
        ]
        zero2 = ["train.precision=bf16", "parallel.zero=2", "parallel.grad_reduce_dtype=fp32"]
        for family in (
            [
                ("Llama-3.2-1B, DP, AdamW", []),
                ("Llama-3.2-1B, DP, 1-bit Adam", ["train.optimizer=onebit_adam"]),
                ("Llama-3.2-1B, DP, 0/1 Adam (H = 16)", ["train.optimizer=zero_one_adam"]),
            ],
            [
                ("Llama-3.2-1B, ZeRO-2 bf16, AdamW", zero2),
                ("Llama-3.2-1B, ZeRO-2 bf16, 1-bit Adam", [*zero2, "train.optimizer=onebit_adam"]),
                ("Llama-3.2-1B, ZeRO-2 bf16, 0/1 Adam (H = 16)", [*zero2, "train.optimizer=zero_one_adam"]),
            ],
        ):
            base = None
            for label, extra in family:
                cmd = [sys.executable, "-m", "zerotron", "plan", *dp_only, *extra, "--hardware", str(profile)]
                run = subprocess.run(
                    [*cmd, "--gpus", "64", "--json"], check=True, capture_output=True, text=True
                )
                report = json.loads(run.stdout)
                step, memory = float(report["step_time_s"]), report["memory_bytes"]["total"] / 2**30
                base = base or step
                print(f"| {gbits} Gb/s | {label} | {step:.2f} | {base / step:.2f}× | {memory:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part",
        choices=("train", "onebit", "onebit_zero", "zero_one", "zero_one_zero", "ranks", "plan", "all"),
        default="all",
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("runs/zero_compressed"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part in ("plan", "all"):
        plan(args.out)
    if args.part in ("train", "all"):
        train(args.steps, args.out)
    if args.part in ("onebit", "all"):
        onebit(args.steps, args.out)
    if args.part in ("onebit_zero", "all"):
        onebit_zero(args.steps, args.out)
    if args.part in ("zero_one", "all"):
        zero_one(args.steps, args.out)
    if args.part in ("zero_one_zero", "all"):
        zero_one_zero(args.steps, args.out)
    if args.part in ("ranks", "all"):
        ranks(args.out)


if __name__ == "__main__":
    main()
