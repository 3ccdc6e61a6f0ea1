"""The heaps of a serving process: freed activation memory kept for the next step (glibc), and the
objects that live as long as the server left out of Python's garbage collections.

Every engine step allocates its activations afresh (a prompt chunk of 2,048 tokens through a
SmolLM2-sized model: hundreds of MB) and frees them at its end. glibc hands blocks above its mmap
threshold back to the kernel when they are freed and trims its heap's top once more than its trim
threshold lies free there; either way the next step's activations come back as new pages, each
faulted in and zeroed by the kernel. Measured on SmolLM2 in bf16 (2-core AMD Zen 5): a step of one
2,048-token prompt took ~60,000 page faults (~240 MB of fresh pages) and 0.93-0.98 s; with the heap
kept, 2-69 faults and 0.86-0.89 s (BENCHMARKS.md, "Bursts gathered from the edge on, and the heap
kept between steps").

:func:`keep_freed` raises both thresholds, as a long-running server wants: blocks below 1 GiB come from
the heap, and the heap is not trimmed below 2 GiB of free top. The process then holds its largest
step's activations between steps, and the fragments glibc's aligned allocations leave at first (the
same three large blocks a step: the heap grew for three steps, then served every later one from what
it held; the serving engine over 30 steps of mixed prompts: 140 MB more resident than without, flat
from its first step). It changes where memory comes from, never a number a step computes. On a C
library other than glibc it does nothing (and ``zerotron serve``'s start-up line says so).

:func:`settle_objects` freezes the objects alive when the server starts (the model's modules, the
tokenizer, the web framework: ~340,000 for SmolLM2): Python's full collections, which come now and
then as requests make and drop objects, scanned them all, holding the GIL for ~185 ms each (measured
on the same Zen 5), a pause of every request in flight and of the engine's steps. vLLM freezes its
start-up heap in the same way. Objects made later are collected as before, and :func:`release_objects`
hands the frozen ones back as the server stops.

:func:`zeroed` makes the KV pool's zeros on the CPU from ``calloc``: pages the kernel zeroes as they
are first touched, so a pool of gigabytes costs nothing to make (``torch.zeros`` writes every byte at
start-up: 0.56 s for a 1 GB pool on a Zen 4). A server then faults the pool in behind its start
(:func:`prefault`: one thread in the kernel, no Python). Without it the pages a step writes are
fresh until the pool has been gone through once (the blocks a request frees are kept for prefix
caching, so new requests take untouched blocks first): SmolLM2 bf16 on the AMX Xeon prefilled 8
prompts of 2,048 tokens in 5.5-6.1 s over the first 46,000 tokens of a 1 GiB pool, in 4.6-5.0 s once
it had been written through, and in 4.7-4.9 s from the first over a pool faulted in. The thread costs
about a second of one core per GiB (its time varies with the host); the pool then holds its memory
from the start, as vLLM's does.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import math
import mmap
import platform
import threading
from collections.abc import Iterator
from typing import Optional

import numpy as np
import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MADV_POPULATE_WRITE = 23  # madvise: fault pages in writable (Linux 5.14 on; EINVAL before)
MMAP_THRESHOLD = 1 << 30  # blocks at least this large still come from (and go back to) the kernel
TRIM_THRESHOLD = 2**31 - 1  # the largest value mallopt takes (an int)


def keep_freed() -> Optional[str]:
    """Make glibc keep freed blocks for reuse (see the module); None when it does, else why not."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "freed memory not kept (the C library is not glibc)"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        ok = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    except (OSError, AttributeError):
        ok = False
    return None if ok else "freed memory not kept (glibc's mallopt refused)"


def settle_objects() -> int:
    """Collect once, then freeze every object alive (see the module); how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def release_objects() -> None:
    """The frozen objects handed back to the collections, as a server stops: frozen ones outlive the
    interpreter's teardown, where the compiler bindings torch loads (triton's) report each of theirs
    as leaked, a screen of warnings after every Ctrl-C."""
    gc.unfreeze()


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """Python's garbage collections paused inside the block (a model's load: the GGUF reader's
    ~150,000 metadata objects alive made each of its collections long, 8.7% of a 1.7B Q4_K_M file's
    load on the Zen 4), resumed after it as they were; what the block leaves in cycles is collected
    later as usual."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``; on the CPU its bytes from ``calloc`` (numpy's
    zeros), 64-byte aligned as torch aligns its own: the kernel zeroes each page as it is first
    touched, not all of them now."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * dtype.itemsize
    raw = np.zeros(size + 64, np.uint8)
    skip = -raw.ctypes.data % 64
    return torch.from_numpy(raw[skip : skip + size]).view(dtype).view(shape)


def prefault(tensors: list[torch.Tensor]) -> Optional[threading.Thread]:
    """Fault in the pages of CPU ``tensors`` (the KV pool's, from :func:`zeroed`) in a background
    thread: ``madvise(MADV_POPULATE_WRITE)`` over each, the kernel's zeroing without the GIL (ctypes
    releases it), never writing a byte (a page a step has written meanwhile is left as it is), and no
    more than four fifths of the memory the system has available (a pool given more than the machine
    holds keeps the rest lazy, as before, instead of the kernel killing the server for it). The thread
    (a daemon), or None where there is nothing to do or the system is not Linux."""
    held = [t for t in tensors if t.device.type == "cpu" and t.nbytes > 0]
    if not held or platform.system() != "Linux":
        return None
    try:
        madvise = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE

    def run(held: list[torch.Tensor]) -> None:  # the tensors held (mapped) until it is done
        left = available_bytes() * 4 // 5 // page * page  # a pool larger than that: its first part only
        for t in held:
            start = t.data_ptr() // page * page  # whole pages (the first may hold other bytes: left alone)
            size = min(-(-(t.data_ptr() + t.nbytes - start) // page) * page, left)
            if size <= 0 or madvise(start, size, MADV_POPULATE_WRITE) != 0:
                return  # a kernel before 5.14 (EINVAL): pages come as they are written, as before
            left -= size

    thread = threading.Thread(target=run, args=(held,), name="kv-prefault", daemon=True)
    thread.start()
    return thread


def available_bytes() -> int:
    """The memory Linux says a new allocation can have without swapping (``MemAvailable``); 0 if
    unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0
