"""The zig-zag sequence split of context parallelism (causal load balancing).

A sequence of ``S`` tokens is cut into ``2·cp`` chunks of ``c = S / (2·cp)`` tokens; context-parallel
rank ``r`` holds chunks ``r`` and ``2·cp − 1 − r``, in that order. Under a causal mask a chunk's cost
grows with its index, so every rank gets one cheap and one dear chunk and the same work (Megatron's
and ring-flash-attention's zig-zag). Tokens, labels and positions are split alike; the global position
of each local token (:func:`local_index`) travels with the batch, so RoPE and the attention masks see
the positions of the unsplit sequence. Packed documents' ids are not split: every rank keeps the whole
row's ids, so a mask between any two tokens can be computed anywhere.

A rank's tokens are described as *runs*: ``(start, length)`` of each contiguous stretch of global
positions it holds, in its local order (two runs here; a group that gathers several ranks' tokens
concatenates their runs).
"""

from __future__ import annotations

import torch

Runs = tuple[tuple[int, int], ...]  # (first global position, length) of each contiguous stretch


def check_split(seq_len: int, cp: int) -> None:
    """ValueError (one line) unless the zig-zag split of ``seq_len`` over ``cp`` ranks is even."""
    if cp < 1 or seq_len % (2 * cp):
        raise ValueError(
            f"train.seq_len={seq_len} is not a multiple of 2*parallel.cp = {2 * cp} (the zig-zag split "
            f"gives every rank two equal chunks); use a seq_len that is, e.g. {_round_up(seq_len, 2 * cp)}"
        )


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def runs_of(seq_len: int, cp: int, rank: int) -> Runs:
    """The two chunks rank ``rank`` of ``cp`` holds, as runs (its local order)."""
    check_split(seq_len, cp)
    c = seq_len // (2 * cp)
    if cp == 1:
        return ((0, seq_len),)
    return ((rank * c, c), ((2 * cp - 1 - rank) * c, c))


def positions(runs: Runs, device: torch.device | str = "cpu") -> torch.Tensor:
    """The global positions of a list of runs, in order (int64)."""
    return torch.cat([torch.arange(start, start + n, device=device) for start, n in runs])


def local_index(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global positions of rank ``rank``'s tokens (``seq_len / cp``,), in its local order."""
    return positions(runs_of(seq_len, cp, rank), device)


def shard(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s tokens of ``x`` along sequence dimension ``dim`` (the whole sequence)."""
    return x.index_select(dim, local_index(x.shape[dim], cp, rank, x.device))


def unshard(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's part (rank order), the inverse of :func:`shard`."""
    cp = len(parts)
    seq_len = parts[0].shape[dim] * cp
    index = torch.cat([local_index(seq_len, cp, r, parts[0].device) for r in range(cp)])
    out = torch.empty_like(torch.cat(parts, dim))
    return out.index_copy_(dim, index, torch.cat(parts, dim))
