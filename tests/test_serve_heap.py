"""The serving process's heap (:mod:`zerotron.serve.heap`): freed activations kept for the next step,
counted in the page faults the kernel reports (getrusage), against a process that does not keep them."""

from __future__ import annotations

import gc
import platform
import subprocess
import sys
import weakref

import pytest
import torch

from zerotron.serve import heap

STEPS = """
import resource, sys, torch
from zerotron.serve import heap
if sys.argv[1] == "keep":
    assert heap.keep_freed() is None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # a step's activations (fp32: 96, 8 and 40 MiB), alive together, freed at its end
    held = [torch.ones(size) for size in (96 << 18, 8 << 18, 40 << 18)]
    del held
for _ in range(8):  # glibc's aligned allocations leave fragments at first (bounded; see heap.py)
    step()
before = faults()
for _ in range(8):  # the next steps, the same sizes
    step()
print(faults() - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt"
)
def test_a_kept_heap_serves_the_next_step_without_new_pages() -> None:
    """Eight more rounds of the same allocations: every round's large blocks faulted in afresh (new
    pages from the kernel) in a plain process; with the heap kept, a fifth of that at most (none once
    the fragments of glibc's aligned allocations have settled: on this project's machines 0, or one
    96 MiB block's pages in a run where they settled late)."""
    plain, kept = _faults("plain"), _faults("keep")
    pages = 8 * (96 + 40) * 2**20 // 4096  # the blocks above glibc's largest dynamic mmap threshold (32 MiB)
    assert plain >= pages // 2
    assert kept < plain // 5


def test_keep_freed_says_why_not_off_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    from zerotron.serve import heap

    monkeypatch.setattr(heap.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert heap.keep_freed() == "freed memory not kept (the C library is not glibc)"


SETTLE = """
import gc, sys
from zerotron.serve import heap
held = [[i] for i in range(100_000)]  # objects that live as long as the server (tracked: lists)
frozen = heap.settle_objects() if sys.argv[1] == "settle" else (gc.collect(), 0)[1]
scanned = len(gc.get_objects())  # what a full collection walks
cycle: list = []
cycle.append(cycle)
del cycle  # garbage made afterwards
print(frozen, scanned, gc.collect())
"""


@pytest.mark.parametrize("mode", ["settle", "plain"])
def test_settled_objects_leave_full_collections_and_later_garbage_is_still_collected(mode: str) -> None:
    """After settle_objects a full collection walks only the objects made since (a plain process walks
    all 100,000 held ones), and garbage made afterwards is still collected."""
    out = subprocess.run([sys.executable, "-c", SETTLE, mode], capture_output=True, text=True, check=True)
    frozen, scanned, collected = (int(v) for v in out.stdout.split())
    if mode == "settle":
        assert frozen >= 100_000 and scanned < 1_000
    else:
        assert frozen == 0 and scanned >= 100_000
    assert collected >= 1


def test_collections_paused_while_a_model_loads() -> None:
    """Inside the block Python's collections are off (none runs however many objects are made), after
    it as they were before; an error inside still restores them."""
    assert gc.isenabled()
    before = [g["collections"] for g in gc.get_stats()]
    with heap.collections_paused():
        assert not gc.isenabled()
        junk = [[i] for i in range(300_000)]  # enough allocations to start collections if on
        assert [g["collections"] for g in gc.get_stats()] == before
    del junk
    assert gc.isenabled()
    with pytest.raises(RuntimeError), heap.collections_paused():
        raise RuntimeError("a load that fails")
    assert gc.isenabled()
    gc.disable()
    try:
        with heap.collections_paused():
            pass
        assert not gc.isenabled()  # left as it was
    finally:
        gc.enable()


def test_released_objects_are_collected_again() -> None:
    """release_objects (a server's stop) hands the frozen objects back: a cycle frozen at start is
    collected after it, as the interpreter's teardown then finds it."""

    class Node:
        other: object

    gc.collect()
    a, b = Node(), Node()
    a.other, b.other = b, a
    alive = weakref.ref(a)
    gc.freeze()  # frozen while reachable (as the served model's objects are)
    try:
        del a, b
        gc.collect()
        assert alive() is not None  # frozen: no collection looks at it
        heap.release_objects()
        gc.collect()
        assert alive() is None
    finally:
        gc.unfreeze()


ZEROED = """
import resource, sys, torch
from zerotron.serve import heap
if sys.argv[2] == "keep":
    heap.keep_freed()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
before = faults()
make = heap.zeroed if sys.argv[1] == "zeroed" else lambda s, d: torch.zeros(s, dtype=d)
pool = [make((4096, 8, 128), torch.bfloat16) for _ in range(32)]  # 256 MiB, as a KV pool's layers
made = faults() - before
assert all(t.shape == (4096, 8, 128) and t.dtype == torch.bfloat16 and t.data_ptr() % 64 == 0 for t in pool)
pool[3][17] = 2.5  # written like a cache slot: that row alone changes
assert float(pool[3].float().sum()) == 2.5 * 8 * 128 and all(float(t.abs().sum()) == 0 for t in pool[4:])
print(made)
"""


@pytest.mark.skipif(platform.system() != "Linux", reason="the kernel's zeroed pages, counted by getrusage")
@pytest.mark.parametrize("mode", ["plain", "keep"])
def test_a_zeroed_pool_takes_its_pages_as_they_are_written(mode: str) -> None:
    """``heap.zeroed`` (the KV pool's zeros): zeros of the dtype and shape, 64-byte aligned, written and
    read like torch's; making 256 MiB of them faults in almost none of their pages (torch.zeros
    writes, and so faults in, every one), with or without the kept heap."""

    def made(how: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", ZEROED, how, mode], capture_output=True, text=True, check=True
        )
        return int(out.stdout.split()[-1])

    pages = (256 << 20) // 4096
    assert made("torch") >= pages // 2
    assert made("zeroed") < pages // 20


PREFAULT = """
import resource, sys, torch
from zerotron.serve import heap
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
pool = [heap.zeroed((1 << 20, 2, 16), torch.bfloat16) for _ in range(2)]  # 2 x 64 MiB, no page yet
pool[0][5] = 3.0  # a slot written before the pool is faulted in
if sys.argv[1] == "prefault":
    heap.prefault(pool).join()
before = faults()
for t in pool:  # a step's writes, one slot in every 4 KiB page
    t.view(-1)[1::2048] = 1.0
after = faults()
kept = bool((pool[0][5] == 3.0).all()) and bool((pool[1][1] == 0).all())
print(after - before, kept)
"""


def _kernel_at_least(major: int, minor: int) -> bool:
    release = platform.release().split(".")
    try:
        return (int(release[0]), int(release[1].split("-")[0])) >= (major, minor)
    except (IndexError, ValueError):
        return False


needs_populate = pytest.mark.skipif(
    platform.system() != "Linux" or not _kernel_at_least(5, 14), reason="MADV_POPULATE_WRITE (Linux 5.14)"
)


@needs_populate
def test_a_prefaulted_pool_takes_its_first_writes_without_faults_and_keeps_its_bytes() -> None:
    """prefault (the server's KV pool behind its start) leaves the pages in place: a step's writes over
    two 64 MiB pools take (almost) no page fault where a pool not faulted in takes one per page (or
    per huge page), and the bytes already written, and the zeros, are what they were."""
    runs = {}
    for mode in ("plain", "prefault"):
        out = subprocess.run(
            [sys.executable, "-c", PREFAULT, mode], capture_output=True, text=True, check=True
        )
        faults, kept = out.stdout.split()
        runs[mode] = int(faults)
        assert kept == "True", mode
    assert runs["plain"] >= 2 * 64 // 2  # at least one fault per 2 MiB huge page
    assert runs["prefault"] <= runs["plain"] // 8


def test_prefault_has_nothing_to_do_without_cpu_tensors() -> None:
    assert heap.prefault([]) is None


BUDGET = """
import torch
from tests.test_serve_heap import _resident
from zerotron.serve import heap
heap.available_bytes = lambda: 8 << 20  # the system told to have 8 MiB available
pool = [heap.zeroed((1 << 20, 16), torch.bfloat16)]  # 32 MiB, none of it resident yet
before = _resident(pool[0])
heap.prefault(pool).join()
print(before, _resident(pool[0]))
"""


@needs_populate
def test_prefault_stops_at_the_memory_the_system_has() -> None:
    """A pool given more than the machine holds is faulted in only up to four fifths of the available
    memory (here told to be 8 MiB: 6.4 MiB of a 32 MiB pool), the rest left to be faulted as written
    (in a fresh process: one whose heap keeps freed memory, heap.keep_freed, hands out pages in use)."""
    out = subprocess.run([sys.executable, "-c", BUDGET], capture_output=True, text=True, check=True)
    before, resident = (int(v) for v in out.stdout.split())
    assert before <= 2 << 20
    assert (8 << 20) * 4 // 5 - (2 << 20) <= resident <= (8 << 20) * 4 // 5 + (2 << 20), resident


def _resident(t: torch.Tensor) -> int:
    """Bytes of ``t`` in memory now (mincore over its pages)."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    pages = -(-(t.data_ptr() + t.nbytes - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, pages * page, vec) == 0
    return sum(b & 1 for b in vec) * page
