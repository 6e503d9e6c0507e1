"""Device leases: which drafter trains on which idle rollout device, and what that reclaimed.

The coordinator owns one `LeaseTable` and tells it what happened (a rollout went idle, a drafter released,
a drafter reported its training seconds, a drafter died); the table answers with the messages to send
(a `Lease`, the `Preempt`s) and, at the end of a step, the idle device-seconds and the share of them that
drafter training reclaimed. Pure bookkeeping: no sockets, no clock of its own (times are passed in), so
`tests/rl/test_coordinator.py` drives it through the coordinator and its arithmetic is plain.

One drafter may hold several leases at once: on a CPU host one drafter process trains on whichever
rollout cores are idle (runtime/placement.py), so `drafter_of` maps many rollouts to it, and each lease
carries its rollout's cores (`cpus_of`) for the drafter to pin its threads to.

The non-obvious rule: a drafter's reclaimed time is its training device-seconds during its leases (seconds
of training × devices held, as it reports them), capped by the idle windows of the devices it was lent. A
step it finishes after the last completion (the preemption latency) reclaims nothing, and a drafter that
died mid-lease counts nothing for that step.
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
    """Which drafter holds which devices, when each rollout went idle, and each drafter's training seconds."""

    drafter_of: dict[str, str]  # rollout name -> the drafter actor its device is lent to (many to one)
    threads: int = 1  # threads a drafter may use per device leased
    cpus_of: dict[str, list[int]] = field(default_factory=dict)  # rollout -> its cores (pinning; empty: none)
    active: dict[int, tuple[str, str]] = field(default_factory=dict)  # lease id -> (drafter, rollout)
    idle_at: dict[str, float] = field(default_factory=dict)  # rollout name -> when it went idle this step
    trained: dict[str, float] = field(default_factory=dict)  # drafter -> training device-seconds so far
    trained_at_lease: dict[str, float] = field(default_factory=dict)  # drafter -> that, at its first lease
    awaiting_stats: set[str] = field(default_factory=set)  # released, DrafterStats not in yet
    preempt_ms: list[float] = field(default_factory=list)

    @property
    def drafters(self) -> list[str]:
        """Every drafter leases can go to, once each, in rollout order."""
        return list(dict.fromkeys(self.drafter_of.values()))

    def leased(self, drafter: str) -> list[int]:
        """The ids of the leases `drafter` holds now."""
        return [lease_id for lease_id, (d, _) in self.active.items() if d == drafter]

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
        lease = Lease(
            lease_id=next(_lease_ids),
            device=rollout,
            threads=self.threads,
            cpus=self.cpus_of.get(rollout, []),
        )
        self.active[lease.lease_id] = (drafter, rollout)
        self.trained_at_lease.setdefault(drafter, self.trained.get(drafter, 0.0))
        return drafter, lease

    def busy(self, rollout: str) -> None:
        """Rollout `rollout` has work again (a restarted one dealt what it owed)."""
        self.idle_at.pop(rollout, None)

    def released(self, drafter: str, lease_id: int, latency_ms: float) -> None:
        if self.active.get(lease_id, ("",))[0] == drafter:
            del self.active[lease_id]
        self.awaiting_stats.add(drafter)  # a drafter reports its training seconds right after each release
        self.preempt_ms.append(latency_ms)

    def stats(self, drafter: str, elapsed_s: float) -> None:
        self.trained[drafter] = elapsed_s
        self.awaiting_stats.discard(drafter)

    def void(self, drafter: str) -> None:
        """Drafter `drafter` died: its leases and its pending report are void, and reclaim nothing."""
        for lease_id in self.leased(drafter):
            del self.active[lease_id]
        self.awaiting_stats.discard(drafter)
        self.trained_at_lease.pop(drafter, None)

    def preempts(self, reason: str) -> list[tuple[str, Preempt]]:
        """A Preempt for every active lease: the last completion is in, every device goes back."""
        now = time.time_ns()
        return [
            (drafter, Preempt(lease_id=lease_id, reason=reason, sent_ns=now))
            for lease_id, (drafter, _) in self.active.items()
        ]

    def unsettled(self, live_rollouts: Iterable[str]) -> list[str]:
        """Drafters still leased or owing their stats, and live rollouts not idle: what a step's end waits on."""
        leased = dict.fromkeys(d for d, _ in self.active.values())
        return [*leased, *self.awaiting_stats, *(r for r in live_rollouts if r not in self.idle_at)]

    def account(self, ended: float) -> Reclaimed:
        """The step's idle device-seconds up to `ended` (its last completion) and what drafters reclaimed."""
        idle = {r: max(0.0, ended - t) for r, t in self.idle_at.items()}
        reclaimed = sum(
            min(
                sum(idle.get(r, 0.0) for r, d in self.drafter_of.items() if d == drafter),
                max(0.0, self.trained.get(drafter, 0.0) - at_lease),
            )
            for drafter, at_lease in self.trained_at_lease.items()
        )
        self.trained_at_lease.clear()
        return Reclaimed(sum(idle.values()), reclaimed, list(self.preempt_ms))
