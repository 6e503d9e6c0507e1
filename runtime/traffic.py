"""What a process's control socket received or sent: messages and bytes by message kind.

The supervisor counts every frame its receive loop decodes (heartbeats and hand-shakes included, malformed
ones not), so the coordinator can say how much crossed it per step (`Coordinator.begin` logs an `inbound`
event a step): the figure behind moving bulk data off the head (issue 39). Counting costs a dict update
a message; bytes are the frames' lengths after the sender's identity, as they arrived (compressed or not).
A second counter holds what the supervisor sent (`Supervisor.outbound`, read by `bench scale`).
"""

from __future__ import annotations

__all__ = ["Traffic"]


class Traffic:
    """Messages and bytes received by kind since the last `take`."""

    def __init__(self) -> None:
        self._by_kind: dict[str, list[int]] = {}

    def add(self, kind: str, nbytes: int) -> None:
        cell = self._by_kind.get(kind)
        if cell is None:
            self._by_kind[kind] = [1, nbytes]
        else:
            cell[0] += 1
            cell[1] += nbytes

    def take(self) -> dict[str, list[int]]:
        """{kind: [messages, bytes]} since the last call (or the start), and start counting afresh."""
        taken, self._by_kind = self._by_kind, {}
        return taken
