"""The fused attention kernels context parallelism runs its blocks on, with their log-sum-exp.

A ring or a zig-zag split needs, for each pair of query and key chunks, the attention output *and* the
row log-sum-exp (to merge the pairs) in forward, and in backward a kernel that takes the final output
and log-sum-exp (flash-attention's backward). PyTorch exposes such kernels as aten ops:

=======  =========================  ===================================================================
device   dtype                      kernel
=======  =========================  ===================================================================
CPU      any                        ``_scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``)
CUDA     bf16, fp16                 ``_scaled_dot_product_flash_attention`` (+ ``_backward``), GQA native
CUDA     fp32                       ``_scaled_dot_product_efficient_attention`` (+ ``_backward``); K/V
                                    repeated per query head, the log-sum-exp padded to its 32-row tiles
=======  =========================  ===================================================================

``causal`` is the top-left-aligned mask of equal-length chunks (the diagonal pair); otherwise every key
is visible. No dropout. Outputs are in the inputs' dtype, the log-sum-exp fp32.
"""

from __future__ import annotations

import torch

ops = torch.ops.aten


def supported(device: torch.device) -> bool:
    """Whether blocks on ``device`` have a fused kernel here (else plain matrix products)."""
    return device.type in ("cpu", "cuda")


def _repeat(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _efficient(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cuda" and dtype not in (torch.float16, torch.bfloat16)


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (b, h, n, d), k/v (b, kv_h, m, d) -> output (b, h, n, d), log-sum-exp (b, h, n) fp32."""
    if q.device.type == "cpu":
        out, lse = ops._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    if _efficient(q.device, q.dtype):
        heads = q.shape[1]
        out, lse, _, _ = ops._scaled_dot_product_efficient_attention(
            q, _repeat(k, heads), _repeat(v, heads), None, True, 0.0, causal, scale=scale
        )
        return out, lse[..., : q.shape[2]]
    res = ops._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1]


def backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pair's (dQ, dK, dV) from the *final* output and log-sum-exp of q's rows (b, h, n)."""
    grad_out = grad_out.to(q.dtype).contiguous()
    out, lse = out.to(q.dtype), lse.contiguous()  # a slice of rows: the kernels assume dense heads
    if q.device.type == "cpu":
        dq, dk, dv = ops._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=scale
        )
        return dq, dk, dv
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    if _efficient(q.device, q.dtype):
        heads, kvh, n = q.shape[1], k.shape[1], q.shape[2]
        tiles = torch.zeros((*lse.shape[:-1], -(-n // 32) * 32), dtype=lse.dtype, device=lse.device)
        tiles[..., :n] = lse
        dq, dk, dv, _ = ops._scaled_dot_product_efficient_attention_backward(
            grad_out, q, _repeat(k, heads), _repeat(v, heads), None, out, tiles, zero, zero, 0.0,
            [True, True, True, False], causal, scale=scale,
        )  # fmt: skip
        if kvh != heads:  # the repeated heads' gradients summed back onto their KV head
            dk = dk.view(dk.shape[0], kvh, heads // kvh, *dk.shape[2:]).sum(2)
            dv = dv.view(dv.shape[0], kvh, heads // kvh, *dv.shape[2:]).sum(2)
        return dq, dk, dv
    n, m = q.shape[2], k.shape[2]
    dq, dk, dv = ops._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, None, None, n, m, 0.0, causal, zero, zero, scale=scale
    )
    return dq, dk, dv
