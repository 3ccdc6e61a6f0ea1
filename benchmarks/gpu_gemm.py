"""The planner's GEMM law against a GPU: bf16 (and fp8) matrix products of a tensor-parallel GPT layer.

Run:  python benchmarks/gpu_gemm.py [--out FILE] [--hidden 4096,8192,12288,16384] [--tp 1,2,4,8]
                                    [--rows 2048,4096,8192] [--hardware h100-sxm]   (on a CUDA GPU)

For each hidden size h, tensor-parallel degree tp and token count (micro-batch × sequence), the four
matrix products of a Megatron GPT layer on one rank (QKV h -> 3h/tp, attention output h/tp -> h, MLP
up h -> 4h/tp, MLP down 4h/tp -> h) and the logits (h -> 256,000/tp), each in its three passes
(forward; the input gradient; the weight gradient, whose inner dimension is the tokens), timed with
CUDA events on random normal data, the median of repeats after a warm-up. Beside each: the fraction of
the card's dense peak it reached and the fraction ``zerotron plan``'s law predicts for it
(:func:`zerotron.plan.timing.gemm_efficiency`, e·g/(g + knee), g the geometric mean of the three
dimensions). ``--fp8``: the forward products again as float8 e4m3 ``torch._scaled_mm`` (tensor-wise
scales), against the fp8 peak and the planner's ``fp8_efficiency``.

Prints a summary (measured / predicted by g band) and writes every product to ``--out`` as JSON.
``--cpu-smoke``: tiny shapes in fp32 on the CPU, to check the script only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

VOCAB = 256_000


def layer_products(h: int, tp: int, rows: int) -> list[tuple[str, int, int, int]]:
    """(name, m, n, k) of one rank's products: forward (rows × k)·(k × n), input gradient, weight
    gradient."""
    out = []
    for name, k, n in (
        ("qkv", h, 3 * h // tp),
        ("proj", h // tp, h),
        ("fc1", h, 4 * h // tp),
        ("fc2", 4 * h // tp, h),
        ("logits", h, VOCAB // tp),
    ):
        out += [(f"{name}.fwd", rows, n, k), (f"{name}.dgrad", rows, k, n), (f"{name}.wgrad", k, n, rows)]
    return out


def time_mm(m: int, n: int, k: int, dtype: torch.dtype, device: str, fp8: bool = False) -> float:
    """Median seconds of one (m × k)·(k × n) product over repeats lasting about 60 ms in all."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(n, k, device=device).to(dtype)
    if fp8:
        a, bt = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # column-major second operand
        one = torch.ones((), device=device)

        def run() -> Any:
            return torch._scaled_mm(a, bt, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    else:
        bt = b.t()

        def run() -> Any:
            return a @ bt

    cuda = device == "cuda"
    for _ in range(2):
        run()
    if cuda:
        torch.cuda.synchronize()
    times: list[float] = []
    spent = 0.0
    while len(times) < 3 or (spent < 0.06 and len(times) < 50):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            t = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            run()
            t = time.perf_counter() - t0
        times.append(t)
        spent += t
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", default="4096,8192,12288,16384")
    ap.add_argument("--tp", default="1,2,4,8")
    ap.add_argument("--rows", default="2048,4096,8192")
    ap.add_argument("--hardware", default="h100-sxm")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--out", default="gemm.json")
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    from zerotron.plan.hardware import get_hardware, peak_flops_of_device
    from zerotron.plan.timing import gemm_efficiency

    if args.cpu_smoke:
        device, dtype, hiddens, tps, rowss = "cpu", torch.float32, [64, 128], [1, 2], [32]
    elif torch.cuda.is_available():
        device, dtype = "cuda", torch.bfloat16
        hiddens = [int(x) for x in args.hidden.split(",")]
        tps = [int(x) for x in args.tp.split(",")]
        rowss = [int(x) for x in args.rows.split(",")]
    else:
        print("gpu_gemm.py needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    hw = get_hardware(args.hardware)
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    peak = {
        "bf16": peak_flops_of_device(name) or hw.flops("bf16"),
        "fp8": peak_flops_of_device(name, "fp8") or hw.flops("fp8"),
    }
    result: dict[str, Any] = {
        "device": name,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "hardware": args.hardware,
        "law": {"gemm_efficiency": hw.gemm_efficiency, "gemm_knee": hw.gemm_knee, "fp8": hw.fp8_efficiency},
        "peak_tflops": {k: v / 1e12 for k, v in peak.items()},
        "products": [],
    }
    seen: dict[tuple[int, int, int, bool], float] = {}
    precisions = [False, True] if (args.fp8 and device == "cuda") else [False]
    for fp8 in precisions:
        for h in hiddens:
            for tp in tps:
                for rows in rowss:
                    for name_, m, n, k in layer_products(h, tp, rows):
                        if fp8 and not name_.endswith(".fwd"):
                            continue
                        key = (m, n, k, fp8)
                        if key not in seen:
                            seen[key] = time_mm(m, n, k, dtype, device, fp8)
                        s = seen[key]
                        prec = "fp8" if fp8 else "bf16"
                        eff = 2 * m * n * k / s / peak[prec]
                        pred = gemm_efficiency(hw, m, n, k, prec)
                        g = (m * n * k) ** (1 / 3)
                        result["products"].append(
                            dict(
                                precision=prec,
                                hidden=h,
                                tp=tp,
                                rows=rows,
                                product=name_,
                                m=m,
                                n=n,
                                k=k,
                                g=round(g),
                                seconds=s,
                                efficiency=eff,
                                predicted=pred,
                            )
                        )
                Path(args.out).write_text(json.dumps(result, indent=0))
    bands = [(0, 1024), (1024, 2048), (2048, 4096), (4096, 8192), (8192, 1 << 30)]
    summary = []
    for prec in ("bf16", "fp8"):
        for lo, hi in bands:
            got = [p for p in result["products"] if p["precision"] == prec and lo <= p["g"] < hi]
            if got:
                ratio = [p["efficiency"] / p["predicted"] for p in got]
                summary.append(
                    dict(
                        precision=prec,
                        g=f"{lo}-{hi}",
                        n=len(got),
                        measured=statistics.mean(p["efficiency"] for p in got),
                        predicted=statistics.mean(p["predicted"] for p in got),
                        ratio_min=min(ratio),
                        ratio_mean=statistics.mean(ratio),
                        ratio_max=max(ratio),
                    )
                )
    result["summary"] = summary
    Path(args.out).write_text(json.dumps(result, indent=0))
    for row in summary:
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
