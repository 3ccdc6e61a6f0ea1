"""The peak memory of each phase of a run, per rank: what ``summary.json``'s ``phase_peak_memory_bytes``
measures (materialise, steps, save, load, sample), predicted from a plan.

A phase holds the states a rank keeps between steps (its parameters and optimizer states on the device,
and those offloaded to host memory; NVMe files are not memory) plus the phase's own working set:

- **materialise**: the largest tensor a weight source builds at once, in fp32 (a model is built one
  tensor at a time and each rank keeps its part: :func:`zerotron.parallel.placement.materialize`);
- **steps**: the plan's step memory (device total) plus its host bytes — activations of a micro-batch and
  every gradient counted as if held at once, a bound that a single micro-batch's backward stays under
  (activations are freed as gradients appear);
- **save** and **load**: one segment of the largest parameter (a ZeRO rank's range of it; the whole
  tensor without ZeRO, and for ZeRO-1/2's load, which reads whole parameters), at most
  ``checkpoint.io_buffer_mb`` of it where ZeRO's states are offloaded (read and written window by
  window);
- **sample**: ZeRO-3's gathered units (the step's buffers), the KV cache of one sequence of
  ``train.seq_len`` tokens and one row of logits.

Not modelled: the runtime's own memory (the interpreter, the framework's libraries, the communication
library's buffers), which ``memory_at_start_bytes`` measures and every phase adds to, nor the
allocator's fragmentation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zerotron.plan.layout import ACT_BYTES, Workload
from zerotron.shapes import ModelShape

if TYPE_CHECKING:  # the planner calls this module
    from zerotron.plan.planner import Plan

PHASES = ("materialise", "steps", "save", "load", "sample")


def phase_memory(
    plan: Plan, m: ModelShape, work: Workload, io_buffer_bytes: float, layers: int, zero_ranks: int
) -> dict[str, float]:
    """Bytes of each phase's peak on one rank (the plan's peak stage, of ``layers`` blocks; ZeRO's states
    split over ``zero_ranks``), above the runtime's own."""
    layout, mem, d = plan.layout, plan.memory, plan.detail
    resident = mem["params"] + mem["optimizer"] + d["host_params"] + d["host_optimizer"]
    largest = max(m.vocab * m.hidden, m.hidden * m.intermediate, m.hidden * m.q_width)  # elements
    local = largest // layout.tp
    segment = 4.0 * (-(-local // zero_ranks) if layout.zero >= 1 else local)
    if layout.offload_params != "none" or layout.offload_optimizer != "none":
        segment = min(segment, io_buffer_bytes)  # read and written window by window
    load = segment if layout.zero >= 3 or layout.zero == 0 else 4.0 * local
    act = ACT_BYTES[work.precision]
    kv_cache = 2.0 * layers * (m.kv_width // layout.tp) * work.seq_len * act
    sample_buffers = mem["buffers"] if layout.zero >= 3 else 0.0
    return {
        "materialise": resident + 4.0 * largest,
        "steps": mem["total"] + plan.host_bytes,
        "save": resident + segment,
        "load": resident + load,
        "sample": resident + sample_buffers + kv_cache + 4.0 * m.vocab,
    }
