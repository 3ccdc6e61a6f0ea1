"""Context parallelism's blocks on a CUDA GPU: correctness and one rank's cost (no second GPU needed).

Run:  python benchmarks/context_gpu.py      (on a machine with a CUDA GPU)

1. Every cp rank's blocks, simulated in one process (each rank's queries against every rank's K/V with
   the block functions the ring runs, merged by log-sum-exp; backward from the merged output), against
   SDPA over the whole sequence: output and dQ/dK/dV, fp32 (the memory-efficient kernel) and bf16 (the
   flash kernel), GQA included.
2. One rank's attention forward + backward over all ring steps (no transfers), bf16, 32 heads, 8 KV
   heads, head dim 128: time and peak memory above the inputs, fused-kernel blocks vs plain masked
   blocks (what a packed-document mask runs on), and SDPA (flash) over the whole sequence on one GPU.
"""

from __future__ import annotations

import json
import time
from typing import Optional

import torch
import torch.nn.functional as F

from zerotron.parallel.context.blocks import Block, block_backward, block_forward, merge
from zerotron.parallel.context.split import runs_of, shard

DEV = "cuda"


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def correctness(dtype: torch.dtype, heads: int, kvh: int, cp: int, seq: int, d: int = 64) -> dict[str, float]:
    """Largest relative error of every rank's output and of every gradient against SDPA in fp32."""
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(2, h, seq, d, device=DEV, dtype=dtype, requires_grad=True) for h in (heads, kvh, kvh)
    )
    grad = torch.randn(2, heads, seq, d, device=DEV, dtype=dtype)
    ref = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True, enable_gqa=kvh != heads
    )
    ref.backward(grad.float())
    runs = [runs_of(seq, cp, r) for r in range(cp)]
    ks, vs = (
        [shard(k.detach(), cp, j, 2) for j in range(cp)],
        [shard(v.detach(), cp, j, 2) for j in range(cp)],
    )
    dks = [torch.zeros(2, kvh, seq // cp, d, device=DEV) for _ in range(cp)]
    dvs = [torch.zeros(2, kvh, seq // cp, d, device=DEV) for _ in range(cp)]
    worst = {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
    for r in range(cp):
        qr, gr = shard(q.detach(), cp, r, 2), shard(grad, cp, r, 2)
        out = torch.zeros_like(qr, dtype=torch.float32)
        lse = torch.full(qr.shape[:-1], float("-inf"), device=DEV)
        for j in range(cp):
            o, lb = block_forward(qr, ks[j], vs[j], Block(runs[r], runs[j], None, d**-0.5))
            out, lse = merge(out, lse, o, lb)
        worst["out"] = max(worst["out"], _rel(out, shard(ref.detach(), cp, r, 2)))
        dq = torch.zeros_like(qr, dtype=torch.float32)
        for j in range(cp):
            dq_b, dk_b, dv_b = block_backward(
                qr, ks[j], vs[j], out.to(dtype), gr, lse, Block(runs[r], runs[j], None, d**-0.5)
            )
            dq += dq_b
            dks[j] += dk_b
            dvs[j] += dv_b
        worst["dq"] = max(worst["dq"], _rel(dq, shard(q.grad, cp, r, 2)))  # type: ignore[arg-type]
    for j in range(cp):
        worst["dk"] = max(worst["dk"], _rel(dks[j], shard(k.grad, cp, j, 2)))  # type: ignore[arg-type]
        worst["dv"] = max(worst["dv"], _rel(dvs[j], shard(v.grad, cp, j, 2)))  # type: ignore[arg-type]
    return worst


def _measure(run: object) -> dict[str, float]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    run()  # type: ignore[operator]
    torch.cuda.synchronize()
    return {
        "time_s": time.perf_counter() - start,
        "peak_above_inputs_mib": (torch.cuda.max_memory_allocated() - base) / 2**20,
    }


def one_rank(seq: int, cp: int, rank: int, documents: Optional[torch.Tensor], b: int = 1) -> dict[str, float]:
    """Rank ``rank``'s queries through all cp ring steps, forward and backward, bf16."""
    heads, kvh, d, dt = 32, 8, 128, torch.bfloat16
    torch.manual_seed(0)
    runs = [runs_of(seq, cp, r) for r in range(cp)]
    n = seq // cp
    q = torch.randn(b, heads, n, d, device=DEV, dtype=dt)
    kv = [torch.randn(b, kvh, n, d, device=DEV, dtype=dt) for _ in range(2)]  # the block in hand, the next
    grad = torch.randn_like(q)

    def run() -> None:
        out = torch.zeros_like(q, dtype=torch.float32)
        lse = torch.full(q.shape[:-1], float("-inf"), device=DEV)
        for j in range(cp):
            src = runs[(rank - j) % cp]
            o, lb = block_forward(q, kv[j % 2], kv[(j + 1) % 2], Block(runs[rank], src, documents, d**-0.5))
            out, lse = merge(out, lse, o, lb)
        dq = torch.zeros_like(q, dtype=torch.float32)
        for j in range(cp):
            src = runs[(rank - j) % cp]
            args = (
                q,
                kv[j % 2],
                kv[(j + 1) % 2],
                out.to(dt),
                grad,
                lse,
                Block(runs[rank], src, documents, d**-0.5),
            )
            dq += block_backward(*args)[0]

    run()  # warm-up
    return _measure(run)


def whole(seq: int, b: int = 1) -> dict[str, float]:
    """SDPA (flash) forward + backward over the whole sequence on one GPU."""
    heads, kvh, d, dt = 32, 8, 128, torch.bfloat16
    q, k, v = (torch.randn(b, h, seq, d, device=DEV, dtype=dt, requires_grad=True) for h in (heads, kvh, kvh))
    grad = torch.randn(b, heads, seq, d, device=DEV, dtype=dt)

    def run() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(grad)

    run()
    return _measure(run)


def main() -> None:
    result: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for dtype in (torch.float32, torch.bfloat16):
        for heads, kvh, cp, seq in ((8, 8, 2, 512), (8, 2, 4, 1024), (16, 4, 4, 4096)):
            result[f"{dtype} h{heads} kv{kvh} cp{cp} s{seq}"] = correctness(dtype, heads, kvh, cp, seq)
    for seq, cp in ((32768, 8), (131072, 8)):
        result[f"{seq} cp{cp} rank 0, fused blocks"] = one_rank(seq, cp, 0, None)
        result[f"{seq} cp{cp} rank 3, fused blocks"] = one_rank(seq, cp, 3, None)
        result[f"{seq} whole sequence, SDPA flash"] = whole(seq)
    one_document = torch.zeros(1, 32768, dtype=torch.long, device=DEV)  # the masked path, nothing masked out
    result["32768 cp8 rank 0, plain masked blocks"] = one_rank(32768, 8, 0, one_document)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
