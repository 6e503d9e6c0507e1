"""A checkpoint writer off the compute thread: one job queued at most, atomic files, the newest two kept.

The drafter's owner checkpoints every few optimizer steps; `torch.save` of a head and its AdamW state on
the thread that trains would stall a preemption behind the disk. A job is a version and a state dict
that the caller already copied (it is written later). With a write still running, `submit` either skips
the new job (a cadence checkpoint: the next one is due soon) or waits for room (a run checkpoint, which
must not be skipped). A file is written as `.tmp` and renamed, so a reader never sees half of one. The
thread inherits the niceness of the thread that creates it (Linux), which is the point: start it there.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

KEEP = 2  # checkpoints left on disk, the newest


class CheckpointWriter:
    """Writes `ckpt-<version>.pt` files into `directory` on a thread of its own; `on_written` is called
    (on that thread) after each, so the owner can wake up and report it."""

    def __init__(self, directory: Path, *, on_written: Callable[[], None]) -> None:
        self.directory = directory
        self._on_written = on_written
        self._jobs: queue.Queue[tuple[int, dict[str, Any]] | None] = queue.Queue(maxsize=1)
        self._done: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="checkpoint", daemon=True)
        self._thread.start()

    def submit(self, version: int, state: dict[str, Any], *, wait: bool = False) -> bool:
        """Queues a write; `wait`: behind a write still running (at most 60 s), else skipped then. True if
        queued."""
        try:
            self._jobs.put((version, state), block=wait, timeout=60.0 if wait else None)
        except queue.Full:
            return False
        return True

    def written(self) -> list[tuple[int, str]]:
        """The (version, path) of each write finished since the last call."""
        done = []
        while not self._done.empty():
            done.append(self._done.get())
        return done

    def close(self, timeout_s: float = 30.0) -> None:
        """Lets the queued write finish, then ends the thread (waiting at most `timeout_s` for it)."""
        self._jobs.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            version, state = job
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.directory / f"ckpt-{version:08d}.pt"
            tmp = path.with_suffix(".tmp")
            torch.save(state, tmp)
            os.replace(tmp, path)  # atomic: a reader never sees a half-written checkpoint
            for old in checkpoints(self.directory)[:-KEEP]:
                old.unlink(missing_ok=True)
            self._done.put((version, str(path)))
            self._on_written()


def checkpoints(directory: Path) -> list[Path]:
    """The checkpoints in `directory`, oldest first (the zero-padded version sorts them)."""
    return sorted(directory.glob("ckpt-*.pt"))


__all__ = ["CheckpointWriter", "checkpoints"]
