"""Turns: runs on one host that take turns, phase by phase, through one small file (a baton).

`slipstream bench e2e` runs Slipstream and its baseline at once, in lockstep: one run's step, then the
other's, then the next step of the first. A shared host's speed drifts over minutes (docs/benchmarks.md),
so two runs timed one after the other carry that drift in their ratio; interleaved step by step, each pair
of steps meets the same minute. While one run has the turn the other's actors wait on their inboxes, so
nothing is timed while the other run computes.

The file holds the name of the party whose turn it is; `release` writes the next one (a rename, so a
reader never sees half a name). Both are idempotent: a party that holds the turn acquires it at once, one
that does not hold it releases nothing. `done` leaves a marker beside it (FILE.NAME.done) that is never
overwritten: the other party stops waiting for good, so a finished or failed run never blocks it.
`acquire` polls every `poll_s`; the wait is not counted in any phase.

    turns = Turns.parse("/tmp/baton:slipstream:baseline")   # FILE:NAME:NEXT (`slipstream train --turns`)
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path


class Turns:
    """One party's end of a baton file: `name` acts when the file says so, then hands over to `next`."""

    def __init__(self, path: str | Path, name: str, next: str, *, poll_s: float = 0.02) -> None:
        if not name or not next or name == next or any(c in name + next for c in ":/"):
            raise ValueError(f"turns: two different party names without ':' or '/', got {name!r}, {next!r}")
        self.path = Path(path)
        self.name = name
        self.next = next
        self.poll_s = poll_s
        self.held = False

    @classmethod
    def parse(cls, spec: str) -> Turns:
        """From "FILE:NAME:NEXT" (the file path may itself hold ':'); ValueError naming the spec."""
        path, sep, rest = spec.rpartition(":")
        path, sep2, name = path.rpartition(":")
        if not (sep and sep2 and path):
            raise ValueError(f"--turns: expected FILE:NAME:NEXT, got {spec!r}")
        return cls(path, name, rest)

    def holder(self) -> str:
        """Whose turn it is now ("" while the file does not exist yet)."""
        try:
            return self.path.read_text().strip()
        except FileNotFoundError:
            return ""

    def done_marker(self, name: str) -> Path:
        return self.path.with_name(f"{self.path.name}.{name}.done")

    async def acquire(self) -> None:
        """Returns once it is this party's turn (at once if it holds it already), or the other party is done."""
        while not self.held and self.holder() != self.name and not self.done_marker(self.next).exists():
            await asyncio.sleep(self.poll_s)
        self.held = True

    def release(self) -> None:
        """Hands the turn to `next` (nothing, if this party does not hold it)."""
        if not self.held:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        tmp.write_text(self.next)
        tmp.replace(self.path)
        self.held = False

    def done(self) -> None:
        """This party takes no more turns: the other one stops waiting for it, for good."""
        self.done_marker(self.name).touch()


__all__ = ["Turns"]
