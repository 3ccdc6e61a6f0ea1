"""Measure the constants of the planner's ``cpu`` profile on this machine (micro-benchmarks, no training).

Run:  python benchmarks/cpu_profile.py

- ``intra_latency_s``: the median time of a 4-element Gloo all-reduce between two local processes, half
  of it per ring step (the planner charges 2(n−1)·α for an all-reduce over n ranks), measured through
  zerotron's own collective wrapper so the Python call is included; ``intra_bw × comm_efficiency``:
  the bus bandwidth of 0.5 MB and 8 MB all-reduces.
- ``attention_efficiency`` / ``gemm_efficiency``: the speed of causal ``scaled_dot_product_attention``
  (counted as half of Megatron's 4·T·s·q FLOPs) over the speed of the model's matrix multiplies, at a
  tiny model's shapes on one thread.
- thread scaling: one matrix multiply on all cores versus one core, per core.

These are the profile's priors; ``zerotron plan --calibrate`` fits GEMM and communication efficiency
and the latency scale to a user's runs on top of them.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn.functional as F


def _best(fn, repeats: int = 20) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _attention_ratio() -> tuple[float, float]:
    torch.set_num_threads(1)
    b, heads, s, d, h = 2, 8, 256, 32, 256
    q = torch.randn(b, heads, s, d)
    x, w = torch.randn(b * s, h), torch.randn(h, 3 * h)
    t_attn = _best(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True))
    t_gemm = _best(lambda: x @ w)
    attn_flops = 0.5 * 4 * b * s * s * heads * d
    gemm_flops = 2 * b * s * h * 3 * h
    return attn_flops / t_attn, gemm_flops / t_gemm


def _thread_scaling() -> float:
    a, bmat = torch.randn(512, 1024), torch.randn(1024, 1024)
    cores = os.cpu_count() or 1
    torch.set_num_threads(1)
    one = _best(lambda: a @ bmat)
    torch.set_num_threads(cores)
    many = _best(lambda: a @ bmat)
    return one / (many * cores)


def _latency_worker() -> None:
    from zerotron.distributed import collectives
    from zerotron.distributed.launch import current_rank_and_world
    from zerotron.distributed.mesh import Mesh, ParallelDims

    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims(world, world, 1, 1, 1, 1, 0), rank)
    for numel, repeats in ((4, 300), (128 * 1024, 100), (2 * 1024 * 1024, 20)):
        t = torch.ones(numel)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            collectives.all_reduce(t, mesh.group("dp"))
            times.append(time.perf_counter() - start)
        median = statistics.median(times[repeats // 5 :])
        if rank == 0:
            # bus bytes of an all-reduce over 2 ranks: 2·S·(n-1)/n = S
            print(f"gloo all-reduce of {4 * numel:,} B, 2 ranks: median {median * 1e6:.0f} us "
                  f"({4 * numel / median / 1e9:.2f} GB/s bus)")  # fmt: skip


def main() -> int:
    """Print each measurement and the profile value it implies."""
    from zerotron.distributed.launch import spawn

    attn, gemm = _attention_ratio()
    print(f"one thread: matmul {gemm / 1e9:.1f} GFLOP/s, causal attention {attn / 1e9:.1f} GFLOP/s "
          f"(attention/gemm = {attn / gemm:.2f})")  # fmt: skip
    print(f"thread scaling: {_thread_scaling():.2f} of linear on {os.cpu_count()} cores")
    spawn(_latency_worker, 2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
