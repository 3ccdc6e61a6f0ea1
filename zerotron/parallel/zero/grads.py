"""ZeRO-Infinity's gradient swap (``parallel.offload_grads=nvme``): each ZeRO-3 unit's fp32 gradient
shard waits for the optimizer step in an NVMe file instead of host memory.

Under parameter and optimizer offload to NVMe the rank's fp32 gradient shard is what is left in memory
between backward and the step: half the fp32 weights per rank at dp 2, growing with the model.
DeepSpeed's ZeRO-Infinity swaps it to the optimizer's NVMe folder (``swap_out_gradients``); so does
zerotron with :class:`GradStash`:

- a unit's reduced shard is written to the stash's file as it lands (after the first micro-batch of a
  step; later micro-batches read it back, add theirs in fp32 and write the sum: the arithmetic of the
  in-memory accumulation, ``grad_shard.add_(out)``), and the 2-norm of each of its segments is kept
  (computed by ``torch._foreach_norm``, as :func:`zerotron.components.optim.sharded_grad_norm` computes
  an in-memory gradient's); the segments' ``.grad`` stay None;
- the step's scalar changes (fp16's unscaling, clipping) are recorded, in order, as factors
  (:meth:`GradStash.scale`): the norms see the unscaling, and the optimizer, reading a unit's shard
  back window-free (one unit at a time, on its I/O thread), applies each factor as the in-memory path's
  ``torch._foreach_mul_`` does. With bf16 or fp32 the step is the in-memory step bit for bit; with fp16
  the norm is the scaled gradient's times 1/scale (the in-memory path unscales first: equal to within
  rounding).

The file lives beside the moments' (a private folder under ``parallel.nvme_path``, see
:class:`~zerotron.parallel.zero.offload.ShardStore`).
"""

from __future__ import annotations

import torch

from zerotron.parallel.zero.flat import ShardSegment
from zerotron.parallel.zero.offload import ShardStore


class GradStash:
    """The fp32 gradient shards of ZeRO-3's trained units in one NVMe file: bucket ``i`` for the ``i``-th
    trained unit, whose shard's segments are ``segments[i]`` (the offloaded optimizer's bucket ``i``).

    Args:
        segments: each trained unit's segments; ``sizes``: the elements of its shard.
        nvme_dir: the folder of the offload files; ``rank`` names the file.
    """

    def __init__(
        self, segments: list[list[ShardSegment]], sizes: list[int], nvme_dir: str | None, rank: int
    ) -> None:
        self.segments = segments
        self.store = ShardStore(sizes, "grads", "nvme", nvme_dir, rank)
        self.held: set[int] = set()  # units written this step
        self._norms: dict[int, torch.Tensor] = {}  # id(segment param) -> 2-norm of its gradient as stored
        self._factors: list[torch.Tensor] = []  # applied in order to what is read back

    def add(self, index: int, shard: torch.Tensor) -> None:
        """Accumulate the host fp32 ``shard`` (one micro-batch's reduced gradient) into trained unit
        ``index``'s stored gradient and keep its segments' norms."""
        segments = self.segments[index]
        if index in self.held:
            shard = self.store.read(index).add_(shard)  # the in-memory path's grad_shard.add_(out)
        self.store.write(index, shard)
        self.held.add(index)
        views = [shard[s.at : s.at + s.length] for s in segments]
        for seg, norm in zip(segments, torch._foreach_norm(views, 2.0) if views else []):
            self._norms[id(seg.param)] = norm

    def scale(self, factor: torch.Tensor | float) -> None:
        """Multiply every stored gradient by ``factor`` (applied when the optimizer reads them)."""
        self._factors.append(torch.as_tensor(factor, dtype=torch.float32))

    def norms(self) -> dict[int, torch.Tensor]:
        """Each stored segment's gradient 2-norm by ``id`` of the segment's parameter, the factors
        recorded so far applied."""
        gain = torch.ones(())
        for f in self._factors:
            gain = gain * f.abs()
        return {k: v * gain if self._factors else v for k, v in self._norms.items()}

    def grads(self, index: int) -> list[torch.Tensor | None]:
        """Trained unit ``index``'s gradient per segment on the host (read from the file, the factors
        applied); None for every segment when the unit got no gradient this step."""
        segments = self.segments[index]
        if index not in self.held:
            return [None] * len(segments)
        flat = self.store.read(index)
        views = [flat[s.at : s.at + s.length] for s in segments]
        for f in self._factors:
            torch._foreach_mul_(views, f)  # the in-memory path's unscale and clip, in its order
        return list(views)

    def clear(self) -> None:
        """Forget the step's gradients (the file's bytes are overwritten by the next step's)."""
        self.held.clear()
        self._norms.clear()
        self._factors.clear()

    def nvme_bytes(self) -> int:
        """Bytes of the file."""
        return self.store.nvme_bytes()

    def close(self) -> None:
        """Remove the file."""
        self.store.close()
