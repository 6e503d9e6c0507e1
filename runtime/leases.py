"""Device leases: which drafter trains on which idle rollout device, and what that reclaimed.

The coordinator owns one `LeaseTable` and tells it what happened (a rollout went idle, a drafter released,
a drafter reported its training seconds, a drafter died); the table answers with the messages to send
(a `Lease`, the `Preempt`s) and, at the end of a step, the idle device-seconds and the share of them that
drafter training reclaimed. Pure bookkeeping: no sockets, no clock of its own (times are passed in), so
`tests/runtime/test_coordinator.py` drives it through the coordinator and its arithmetic is plain.

The non-obvious rule: a drafter's reclaimed time is its training seconds during the lease, capped by its
device's idle window. A step it finishes after the last completion (the preemption latency) reclaims
nothing, and a drafter that died mid-lease counts nothing for that lease.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from slipstream.protocols.control import Lease, Preempt

__all__ = ["LeaseTable", "Reclaimed"]

_lease_ids = itertools.count(1)


@dataclass(frozen=True)
class Reclaimed:
    """One step's account: idle device-seconds, the part drafter training used, preemption latencies."""

    idle_device_s: float
    reclaimed_s: float
    preempt_ms: list[float]


@dataclass
class LeaseTable:
    """Which drafter holds which device, when each rollout went idle, and its drafter's training seconds."""

    drafter_of: dict[str, str]  # rollout name -> the drafter actor sharing its device
    threads: int = 1  # threads a leased drafter may use
    active: dict[str, int] = field(default_factory=dict)  # drafter name -> lease id
    idle_at: dict[str, float] = field(default_factory=dict)  # rollout name -> when it went idle this step
    trained: dict[str, float] = field(default_factory=dict)  # drafter -> training seconds so far
    trained_at_lease: dict[str, float] = field(default_factory=dict)  # drafter -> its training seconds then
    awaiting_stats: set[str] = field(default_factory=set)  # released, DrafterStats not in yet
    preempt_ms: list[float] = field(default_factory=list)

    def begin_step(self) -> None:
        """A new rollout: every device is busy again; nothing is leased or idle yet."""
        self.idle_at.clear()
        self.preempt_ms = []

    def idle(
        self, rollout: str, now: float, *, grant: bool, dead: Collection[str] = ()
    ) -> tuple[str, Lease] | None:
        """Rollout `rollout` went idle at `now`; returns (drafter, Lease) to send when its device goes to drafter
        training (`grant`: others still decode; the drafter exists and is alive). Once per step."""
        if rollout in self.idle_at:
            return None
        self.idle_at[rollout] = now
        drafter = self.drafter_of.get(rollout)
        if not grant or drafter is None or drafter in dead:
            return None
        lease = Lease(lease_id=next(_lease_ids), device=rollout, threads=self.threads)
        self.active[drafter] = lease.lease_id
        self.trained_at_lease[drafter] = self.trained.get(drafter, 0.0)
        return drafter, lease

    def busy(self, rollout: str) -> None:
        """Rollout `rollout` has work again (a restarted one dealt what it owed)."""
        self.idle_at.pop(rollout, None)

    def released(self, drafter: str, latency_ms: float) -> None:
        self.active.pop(drafter, None)
        self.awaiting_stats.add(drafter)  # a drafter reports its training seconds right after releasing
        self.preempt_ms.append(latency_ms)

    def stats(self, drafter: str, elapsed_s: float) -> None:
        self.trained[drafter] = elapsed_s
        self.awaiting_stats.discard(drafter)

    def void(self, drafter: str) -> None:
        """Drafter `drafter` died: its lease and its pending report are void, and reclaim nothing."""
        self.active.pop(drafter, None)
        self.awaiting_stats.discard(drafter)
        self.trained_at_lease.pop(drafter, None)

    def preempts(self, reason: str) -> list[tuple[str, Preempt]]:
        """A Preempt for every active lease: the last completion is in, every device goes back."""
        now = time.time_ns()
        return [
            (drafter, Preempt(lease_id=lease_id, reason=reason, sent_ns=now))
            for drafter, lease_id in self.active.items()
        ]

    def unsettled(self, live_rollouts: Iterable[str]) -> list[str]:
        """Drafters still leased or owing their stats, and live rollouts not idle: what a step's end waits on."""
        return [*self.active, *self.awaiting_stats, *(r for r in live_rollouts if r not in self.idle_at)]

    def account(self, ended: float) -> Reclaimed:
        """The step's idle device-seconds up to `ended` (its last completion) and what drafters reclaimed."""
        idle = {r: max(0.0, ended - t) for r, t in self.idle_at.items()}
        reclaimed = sum(
            min(idle.get(r, 0.0), max(0.0, self.trained.get(d, 0.0) - self.trained_at_lease[d]))
            for r, d in self.drafter_of.items()
            if d in self.trained_at_lease
        )
        self.trained_at_lease.clear()
        return Reclaimed(sum(idle.values()), reclaimed, list(self.preempt_ms))
