"""Run observability: metrics.jsonl, memory accounting, progress display, loss plot, TensorBoard.

metrics.jsonl has one JSON object per optimizer step with exactly the keys of DESIGN.md:
``step, loss, lr, grad_norm, tokens, n_params, step_time_s, tokens_per_s, mfu, comm_bytes,
model_state_bytes, activation_bytes, layout, rank`` (plus ``skipped`` and ``loss_scale`` under fp16, and
for a mixture-of-experts model ``active_params``, ``aux_loss``, ``z_loss`` and ``expert_load``; for a
LoRA/QLoRA run ``frozen_base_bytes``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerotron.plan.hardware import peak_flops_of_device


class _Saved:
    """What the meter's pack hook stores in the graph: the tensor, un-counted when autograd drops it."""

    __slots__ = ("meter", "ptr", "t")

    def __init__(self, meter: ActivationMeter, t: torch.Tensor, ptr: int) -> None:
        self.meter, self.t, self.ptr = meter, t, ptr

    def __del__(self) -> None:
        meter = getattr(self, "meter", None)  # a copy torch.compile made without __init__ counted nothing
        if meter is not None:
            meter._release(self.ptr)


class ActivationMeter:
    """Counts the bytes autograd holds for backward, excluding parameters (a saved-tensors hook).

    Bytes are counted while they are alive: a tensor is added when the forward saves it and removed
    when autograd frees it (after its backward), each storage once however often it is saved. ``peak``
    is the largest total alive at any moment of the step, so it covers every micro-batch a pipeline
    schedule keeps in flight; without a pipeline it is one micro-batch's saved activations. Under full
    recomputation only the checkpointed blocks' inputs are saved.
    """

    def __init__(self, model: nn.Module, is_weight: Callable[[torch.Tensor], bool] | None = None) -> None:
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        # Weights that live outside the parameters' storages (ZeRO-3's gathered buffers) are not activations.
        self._is_weight = is_weight
        self._refs: dict[int, tuple[int, int]] = {}  # storage ptr -> (saved count, bytes)
        self.current = 0
        self.peak = 0

    def _pack(self, t: torch.Tensor) -> Any:
        if t.device.type == "meta":
            return t
        ptr = t.untyped_storage().data_ptr()
        if ptr in self._param_ptrs or isinstance(t, nn.Parameter):
            return t
        if self._is_weight is not None and self._is_weight(t):
            return t
        count, nbytes = self._refs.get(ptr, (0, t.untyped_storage().nbytes()))
        if count == 0:
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        self._refs[ptr] = (count + 1, nbytes)
        return _Saved(self, t, ptr)

    def _release(self, ptr: int) -> None:
        count, nbytes = self._refs.get(ptr, (0, 0))
        if count <= 1:
            self._refs.pop(ptr, None)
            self.current -= nbytes if count == 1 else 0
        else:
            self._refs[ptr] = (count - 1, nbytes)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.t if isinstance(saved, _Saved) else saved

    @contextmanager
    def forward(self) -> Iterator[None]:
        """Wrap one micro-batch's forward pass (nesting several in flight is fine)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def take_peak(self) -> int:
        """Peak of the step so far; resets for the next step (to what is still alive)."""
        peak, self.peak = self.peak, self.current
        return peak


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop the records after ``step`` from ``metrics.jsonl`` (and per-rank files, and ``samples.jsonl``): a resume from the
    checkpoint of ``step`` runs the later steps again and their new records replace the abandoned ones."""
    for path in [run_dir / "metrics.jsonl", *run_dir.glob("metrics.rank*.jsonl"), run_dir / "samples.jsonl"]:
        if not path.is_file():
            continue
        kept = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                if int(json.loads(line)["step"]) <= step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a crash
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
        os.replace(tmp, path)


class MetricsWriter:
    """Appends one JSON line per step to ``metrics.jsonl`` (rank 0) or ``metrics.rank{R}.jsonl``."""

    def __init__(self, run_dir: Path, rank: int, per_rank: bool, tensorboard: bool) -> None:
        self.enabled = rank == 0 or per_rank
        name = "metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl"
        self.path = run_dir / name
        # Held open for the whole run and closed by close(): a context manager cannot span the loop.
        self._file = open(self.path, "a", encoding="utf-8") if self.enabled else None  # noqa: SIM115
        self._tb = _tensorboard(run_dir) if tensorboard and rank == 0 else None

    def write(self, record: dict[str, Any]) -> None:
        """Write one step's record."""
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._tb is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
                if record.get(key) is not None:
                    self._tb.add_scalar(f"train/{key}", record[key], record["step"])

    def close(self) -> None:
        """Flush and close."""
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def _tensorboard(run_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise RuntimeError(
            "log.tensorboard=true needs the tensorboard package: pip install tensorboard"
        ) from e
    return SummaryWriter(str(run_dir / "tensorboard"))


class Progress:
    """A rich progress bar on a terminal, plain lines otherwise (or nothing)."""

    def __init__(self, total: int, start: int, mode: str, every: int) -> None:
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "lines"
        self.mode, self.every, self.total = mode, max(1, every), total
        self._bar: Any = None
        if mode == "bar":
            from rich.progress import BarColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
            )
            self._bar.start()
            self._task = self._bar.add_task("train", total=total, completed=start, info="")

    def update(self, record: dict[str, Any]) -> None:
        """Show one step."""
        info = f"loss {record['loss']:.4f}  lr {record['lr']:.2e}  {record['tokens_per_s']:.0f} tok/s"
        if self.mode == "bar":
            self._bar.update(self._task, completed=record["step"], info=info)
        elif self.mode == "lines" and (record["step"] % self.every == 0 or record["step"] == self.total):
            print(f"step {record['step']}/{self.total}  {info}", flush=True)

    def close(self) -> None:
        """Stop the bar."""
        if self._bar is not None:
            self._bar.stop()


def plot_loss(metrics_path: Path, out_path: Path) -> None:
    """Draw loss against step from metrics.jsonl into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses = [], []
    for line in metrics_path.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        if rec.get("loss") is not None:
            steps.append(rec["step"])
            losses.append(rec["loss"])
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, losses)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("zerotron training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)


_EARLIER_PEAK = 0  # the high-water mark before the last reset (MemoryPhases): the process's peak so far


def _status_bytes(field: str) -> int | None:
    """A memory field of /proc/self/status (``VmHWM``, ``VmRSS``) in bytes; None off Linux."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return None


def _high_water(device: torch.device) -> int:
    """The peak since the last reset: CUDA's max allocated bytes, or the process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def peak_memory_bytes(device: torch.device) -> int:
    """This rank's peak memory so far: CUDA's max allocated bytes, or on CPU the process's peak RSS.

    On Linux the peak is ``VmHWM`` of /proc/self/status, this process image's own: ``ru_maxrss`` also
    keeps the RSS of the process that spawned it (Linux carries it over fork and exec), so a rank
    started by a large parent (a test runner, a notebook) would report the parent's size. Resets of the
    high-water mark by :class:`MemoryPhases` do not lower it: the peak before a reset is kept."""
    return max(_EARLIER_PEAK, _high_water(device))


def _resident(device: torch.device) -> int:
    """What the process holds now: CUDA's allocated bytes, or its resident set (``VmRSS``)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return _status_bytes("VmRSS") or 0


def _reset_high_water(device: torch.device) -> bool:
    """Start a new high-water mark (keeping the old one in ``_EARLIER_PEAK``); False where the system
    cannot (the peak then stays the process's)."""
    global _EARLIER_PEAK
    _EARLIER_PEAK = peak_memory_bytes(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:  # Linux >= 4.0: "5" resets VmHWM
            f.write("5")
    except OSError:
        return False
    return True


class MemoryPhases:
    """Peak memory per phase of a run (``materialise``, ``steps``, ``save``, ``sample``): the high-water
    mark is reset when a phase begins and read when it ends, so each phase's figure is its own peak
    (what was resident when it began included), not the run's so far. Where the system cannot reset
    it (no ``/proc/self/clear_refs``), :attr:`exact` is False and each figure is the peak so far."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peaks: dict[str, int] = {}
        self.exact = True
        self.at_start = _resident(device)  # what the process held before the run's first phase

    def begin(self) -> None:
        """A phase begins now."""
        self.exact = _reset_high_water(self.device) and self.exact

    def end(self, name: str) -> int:
        """Phase ``name`` ends now; its peak (the largest of its occurrences so far) is returned."""
        self.peaks[name] = max(self.peaks.get(name, 0), _high_water(self.device))
        return self.peaks[name]

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the body as (one occurrence of) phase ``name``."""
        self.begin()
        try:
            yield
        finally:
            self.end(name)


@contextlib.contextmanager
def return_freed_host_memory(nvme: bool = False) -> Iterator[None]:
    """While the model is materialised, have glibc give freed tensors back to the OS at once.

    By default glibc raises its mmap threshold to the largest block freed so far (up to 32 MiB) and
    serves later tensors below it from heap arenas, which fragment and are not returned: materialising
    a model one global tensor at a time then grows the RSS by a good part of the model (measured: +190
    to +280 MiB for 345 MiB of fp32 weights under ZeRO-3, none of it held). Inside, the threshold is
    1 MiB; on leaving, the heap is trimmed (``malloc_trim``) and the threshold set to 4 MiB for
    training: 1 MiB there (every tensor of 1 MiB or more mapped afresh) cost about 30% more CPU time per
    step on benchmarks/zero.py's model, and 32 MiB (glibc's ceiling) let ZeRO-3's working set fragment
    the heap by 180 MiB in tests/test_memory_scale.py. ``nvme`` (ZeRO offload to NVMe): training keeps
    64 KiB, and heap tops above 1 MiB are trimmed: I/O threads read and free segment-sized windows (a
    few KiB to a few MiB) in arenas of their own, which fragment. At 4 MiB (and before saves streamed)
    a ZeRO-3 + NVMe run at dp 2 grew its step peak by 1.13x the added fp32 weights from 2 to 24 layers
    of hidden 1024; at 1 MiB by 0.63x, but at hidden 512 (smaller segments) by 0.87x from 4 to 24
    layers; at 64 KiB by 0.61x at hidden 1024 and within 0.6x at hidden 512 (BENCHMARKS.md). The steps,
    waiting on the disk, were not slower (14.4-17.0 s against 16.5-17.5 s at 1 MiB). Offload to host
    memory keeps 4 MiB (its steps are not measured at 64 KiB). An explicit ``MALLOC_MMAP_THRESHOLD_``
    in the environment is left alone; elsewhere than glibc this does nothing.
    """
    import ctypes
    import os
    import sys

    libc: Any = None
    if sys.platform.startswith("linux") and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        try:
            libc = ctypes.CDLL(None)
            libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc has both (musl has neither)
        except (OSError, AttributeError):
            libc = None
    if libc is not None:
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    try:
        yield
    finally:
        if libc is not None:
            libc.malloc_trim(0)
            libc.mallopt(-3, 64 << 10 if nvme else 4 << 20)  # M_MMAP_THRESHOLD
            if nvme:
                libc.mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD


def peak_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of one device, when known."""
    if device.type != "cuda":
        return None
    return peak_flops_of_device(torch.cuda.get_device_name(device))
