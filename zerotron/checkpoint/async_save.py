"""Asynchronous checkpoint writing (``checkpoint.async_save=true``): files on a thread, training goes on.

The training step is blocked only while the state is gathered (collectives, on the main thread) and
copied into host memory (offloaded NVMe state is not: each store's file is snapshotted on disk by the
kernel and the thread reads its ranges from the snapshot, one at a time); a :class:`CheckpointWriter`
then writes this rank's files into the temporary
folder on a background thread, with the same fsyncs as a synchronous save. No collective runs on the
thread: instead of the barrier of a synchronous save, each rank leaves a marker file when its files are
on disk (:func:`zerotron.checkpoint.store.mark_written`), and the thread of the publishing rank (rank 0)
waits for every marker before it seals the folder with its manifest, renames it into place, moves
``latest`` and prunes to the newest K, exactly as :func:`zerotron.checkpoint.store.publish` does for a
synchronous save. The files are therefore byte for byte those of a synchronous save of the same state.

One write is in flight at a time: the next save, the end of training and an exception first wait for
the previous one (:meth:`CheckpointWriter.wait`). A process killed while the thread writes leaves an
unpublished ``.tmp-step_*`` folder, so the previous checkpoint stays the newest complete one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from zerotron.checkpoint import store

# How long the publishing rank waits for the other ranks' files before it gives the checkpoint up.
PUBLISH_TIMEOUT_S = 3600.0


class CheckpointWriter:
    """One rank's background writer of checkpoint folders (see the module docstring).

    Args:
        rank: this rank in the world; rank 0 publishes.
        world_size: how many ranks write into each checkpoint folder.
    """

    def __init__(self, rank: int, world_size: int, window_bytes: int = store.IO_BUFFER_BYTES) -> None:
        self.rank, self.world_size, self.window_bytes = rank, world_size, window_bytes
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._give_up_at = 0.0

    def submit(
        self,
        root: Path,
        step: int,
        tensors: Mapping[str, Mapping[str, store.Storable]],
        json_files: dict[str, Any],
        keep: int,
        cleanup: Sequence[Callable[[], None]] = (),
    ) -> None:
        """Write ``tensors`` (file name -> host tensors, or deferred reads of snapshots, that nobody
        changes any more) and ``json_files`` into the temporary folder of ``step`` on a thread; rank 0
        then publishes it, keeping ``keep``. ``cleanup`` runs on the thread once the files are written
        (removing the snapshots they were read from), whether or not the write succeeded.

        The folder must exist (created before a barrier on the main thread). Waits for the previous write.
        """
        self.wait()
        self._give_up_at = time.monotonic() + PUBLISH_TIMEOUT_S
        self._thread = threading.Thread(
            target=self._write,
            args=(root, step, tensors, json_files, keep, cleanup),
            name=f"zerotron-checkpoint-{step}",
            daemon=True,  # a killed run leaves an unpublished folder, never a half-published one
        )
        self._thread.start()

    def _write(
        self,
        root: Path,
        step: int,
        tensors: Mapping[str, Mapping[str, store.Storable]],
        json_files: dict[str, Any],
        keep: int,
        cleanup: Sequence[Callable[[], None]],
    ) -> None:
        try:
            tmp = store.temp_dir(root, step)
            try:
                for name, named in tensors.items():
                    store.write_tensors(tmp / name, named, self.window_bytes)
            finally:
                for release in cleanup:
                    release()
            for name, data in json_files.items():
                store.write_json(tmp / name, data)
            store.record_checksums(tmp, self.rank, [*tensors, *json_files])
            store.mark_written(root, step, self.rank)
            if self.rank == 0:
                if not store.wait_written(root, step, self.world_size, lambda: self._give_up_at):
                    raise store.CheckpointError(
                        f"{store.temp_dir(root, step)}: not every rank wrote its files of step {step}; "
                        "the checkpoint was not published"
                    )
                store.publish(root, step, keep)
        except BaseException as e:  # handed to the main thread by wait()
            self._error = e

    @property
    def busy(self) -> bool:
        """Whether a write is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self, grace_s: float | None = None) -> None:
        """Block until the write in flight (if any) is on disk and, on rank 0, published.

        A write that failed raises its error here. ``grace_s`` (used while an exception unwinds) bounds how
        long rank 0 still waits for the other ranks' files, so that a dead rank cannot hang the exit.
        """
        if self._thread is None:
            return
        if grace_s is not None:
            self._give_up_at = min(self._give_up_at, time.monotonic() + grace_s)
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
