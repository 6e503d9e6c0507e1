"""Several drafter actors train one drafter: real processes under the Supervisor.

Rank 0 owns the drafter; other ranks send it deltas, it folds them in and sends back the global weights.
Each test checks the group ends up holding one drafter, bitwise, and that every step trained is counted
once in its version.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from pathlib import Path

import msgspec
import pytest
import torch
import uvloop

from slipstream.actors.drafter import OWNER, DrafterActor
from slipstream.protocols.control import Lease, Preempt, Released, Status
from slipstream.protocols.drafter import DrafterDelta, DrafterStats, DrafterUpdate
from slipstream.runtime.actor import COORDINATOR, Actor, handler
from slipstream.runtime.codec import checksum
from slipstream.runtime.inbox import Inbox
from slipstream.runtime.supervisor import ActorSpec, Supervisor
from tests.actors.test_drafter_actor import HEARTBEAT_S, drafter_spec, feed, wait_for
from tests.engine.conftest import build_checkpoint

GROUP = {"world_size": 2, "checkpoint_every_steps": 0, "publish_every_steps": 1}


async def drain_until_quiet(sup: Supervisor, quiet_s: float = 1.5, timeout: float = 30.0) -> list:
    """Every message the coordinator gets until none has come for `quiet_s`."""
    got = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got.append((await asyncio.wait_for(sup.inbox.get(), timeout=quiet_s))[1])
        except TimeoutError:
            return got
    raise AssertionError(f"still busy after {timeout}s")


async def record_until(sup: Supervisor, seen: list, kind: type, pred=lambda m: True, timeout: float = 30.0):
    """Like `wait_for`, but keeps every message it reads in `seen`."""
    deadline = time.monotonic() + timeout
    while True:
        _, msg = await asyncio.wait_for(sup.inbox.get(), timeout=max(0.01, deadline - time.monotonic()))
        seen.append(msg)
        if isinstance(msg, kind) and pred(msg):
            return msg


def last_synced(messages: list, rank: int) -> Status:
    synced = [m for m in messages if isinstance(m, Status) and m.topic == "drafter_synced"]
    return [m for m in synced if m.fields["rank"] == rank][-1]


@pytest.mark.timeout(120)
def test_two_leased_ranks_train_one_drafter(tmp_path: Path) -> None:
    model = build_checkpoint(tmp_path / "model")

    async def main() -> list:
        sup = Supervisor(tmp_path / "run", heartbeat_s=HEARTBEAT_S)
        seen = []
        try:
            await sup.start([drafter_spec(model, rank=r, sync_every_steps=5, **GROUP) for r in (0, 1)])
            for rank in (0, 1):  # different data on each rank
                feed(sup.endpoints()[f"drafter:{rank}"], 30, 64, 160, seed=rank)
            for rank in (0, 1):
                await sup.send(f"drafter:{rank}", Lease(lease_id=rank + 1, device="cpu:0", threads=1))
            for _ in range(6):  # rank 1 reports stats with every delta it sends
                await record_until(sup, seen, DrafterStats, lambda m: m.rank == 1)
            for rank in (0, 1):
                preempt = Preempt(lease_id=rank + 1, reason="test", sent_ns=time.time_ns())
                await sup.send(f"drafter:{rank}", preempt)
                released = await record_until(sup, seen, Released, lambda m, lid=rank + 1: m.lease_id == lid)
                assert released.latency_ns < 100e6
            seen += await drain_until_quiet(sup)
            assert sup.alive() == ["drafter:0", "drafter:1"]
            return seen
        finally:
            await sup.shutdown(grace_s=5.0)

    seen = uvloop.run(main())
    updates = [m for m in seen if isinstance(m, DrafterUpdate)]
    final = updates[-1]
    synced = last_synced(seen, rank=1)
    # One drafter: rank 1 ends on the owner's final weights, bitwise.
    assert synced.fields["version"] == final.version
    assert synced.fields["checksum"] == final.checksum == checksum(final.names, final.tensors)
    # Every step either rank trained is folded in once: version = owner's steps + rank 1's steps.
    steps = {m.rank: m.steps for m in seen if isinstance(m, DrafterStats)}
    assert final.version == steps[0] + steps[1] and steps[0] > 0 and steps[1] >= 30
    versions = [u.version for u in updates]
    assert versions == sorted(versions)
    assert any(b - a >= 5 for a, b in itertools.pairwise(versions))  # rank 1's deltas landed
    v0 = next(m for m in seen if isinstance(m, Status) and m.topic == "drafter_synced")
    assert v0.fields["version"] == 0 and v0.fields["checksum"] != final.checksum
    losses = [m.loss for m in seen if isinstance(m, DrafterStats) and m.rank == 0 and math.isfinite(m.loss)]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(
        f"version {final.version} (owner {steps[0]} + rank 1 {steps[1]} steps), loss {first:.3f} → {last:.3f}"
    )
    assert last < first


@pytest.mark.timeout(120)
def test_a_preempted_rank_delta_is_folded_in_by_a_dormant_owner(tmp_path: Path) -> None:
    model = build_checkpoint(tmp_path / "model")

    async def main() -> list:
        sup = Supervisor(tmp_path / "run", heartbeat_s=HEARTBEAT_S)
        try:
            # rank 1 never syncs on its own: only its preemption sends what it trained
            await sup.start([drafter_spec(model, rank=r, sync_every_steps=10_000, **GROUP) for r in (0, 1)])
            feed(sup.endpoints()["drafter:1"], 30, 64, 160, policy_version=3)
            seen: list = []
            await record_until(sup, seen, Status, lambda m: m.topic == "drafter_synced")
            await sup.send("drafter:1", Lease(lease_id=7, device="cpu:0", threads=1))
            await asyncio.sleep(1.0)
            await sup.send("drafter:1", Preempt(lease_id=7, reason="test", sent_ns=time.time_ns()))
            await record_until(sup, seen, Released)
            return seen + await drain_until_quiet(sup)
        finally:
            await sup.shutdown(grace_s=5.0)

    seen = uvloop.run(main())
    start = next(m for m in seen if isinstance(m, Status) and m.topic == "drafter_synced")
    assert next(m for m in seen if isinstance(m, Released)).latency_ns < 100e6
    updates = [m for m in seen if isinstance(m, DrafterUpdate)]
    assert len(updates) == 1  # one merge: the preempted rank's one delta
    (final,) = updates
    trained = [m for m in seen if isinstance(m, DrafterStats) and m.rank == 1][-1].steps
    print(f"rank 1 trained {trained} steps before its preemption")
    assert trained > 0 and final.version == trained
    assert final.policy_version == 3  # the owner never trained: the version came with rank 1's delta
    synced = last_synced(seen, rank=1)
    assert synced.fields == {"rank": 1, "version": final.version, "checksum": final.checksum}
    assert start.fields["version"] == 0 and start.fields["checksum"] != final.checksum


class FakeRank(Actor):
    """Rank 1 of a drafter group that sends the owner malformed deltas, then one good one."""

    role = "drafter"

    def on_start(self) -> None:
        self.global_weights: dict[str, torch.Tensor] = {}
        self._send(steps=0, names=[], tensors=[], final=True)  # asks the owner for its weights

    def _send(self, *, steps: int, names: list[str], tensors: list[torch.Tensor], **fields: object) -> None:
        msg = {"rank": 1, "base_version": 0, "policy_version": 0, "tokens": 100, "elapsed_s": 0.1,
               "final": False, **fields}  # fmt: skip
        self.send(OWNER, DrafterDelta(steps=steps, names=names, tensors=tensors, **msg))  # type: ignore[arg-type]

    @handler
    def on_update(self, msg: DrafterUpdate, sender: str) -> None:
        self.global_weights = {n: t.clone() for n, t in zip(msg.names, msg.tensors, strict=True)}
        self.send(COORDINATOR, Status(topic="fake_ready", fields={"version": msg.version}))

    @handler
    def on_lease(self, msg: Lease, sender: str) -> None:
        names = sorted(self.global_weights)
        good = [torch.full_like(self.global_weights[n], 1e-3) for n in names]
        nan = [t.clone() for t in good]
        nan[-1][0] = float("nan")
        wide = [torch.zeros(*good[0].shape[:-1], good[0].shape[-1] + 1), *good[1:]]
        self._send(steps=2, names=names, tensors=wide)
        self._send(steps=2, names=names, tensors=nan)
        self._send(steps=2, names=names[:-1], tensors=good[:-1])
        self._send(steps=2, names=names, tensors=[t.double() for t in good])
        self._send(steps=2, names=names, tensors=good, base_version=999)
        self._send(steps=2, names=names, tensors=good, rank=2)
        self._send(steps=0, names=names, tensors=good)
        self._send(steps=3, names=names, tensors=good)
        expected = [self.global_weights[n] + 1e-3 for n in names]  # the owner is dormant: n = 1
        self.send(COORDINATOR, Status(topic="fake_sent", fields={"checksum": checksum(names, expected)}))


@pytest.mark.timeout(120)
def test_malformed_deltas_are_dropped_and_the_owner_keeps_serving(tmp_path: Path) -> None:
    model = build_checkpoint(tmp_path / "model")
    fake = ActorSpec(actor="tests.actors.test_drafter_group:FakeRank", rank=1, threads=1)

    async def main() -> tuple[DrafterUpdate, Status]:
        sup = Supervisor(tmp_path / "run", heartbeat_s=HEARTBEAT_S)
        try:
            await sup.start([drafter_spec(model, **GROUP), fake])
            await wait_for(sup, Status, lambda m: m.topic == "fake_ready")
            await sup.send("drafter:1", Lease(lease_id=1, device="cpu:0", threads=1))
            sent = await wait_for(sup, Status, lambda m: m.topic == "fake_sent")
            update = await wait_for(sup, DrafterUpdate)
            assert "drafter:0" in sup.alive()
            return update, sent
        finally:
            await sup.shutdown(grace_s=5.0)

    update, sent = uvloop.run(main())
    assert update.version == 3  # only the good delta's 3 steps
    assert update.checksum == sent.fields["checksum"]  # folded in exactly: global + delta / 1
    events = [
        json.loads(line) for line in (tmp_path / "run" / "logs" / "drafter-0.jsonl").read_text().splitlines()
    ]
    dropped = [e["why"] for e in events if e["event"] == "delta_dropped"]
    print("\n".join(dropped))
    assert len(dropped) == 7
    for part in ("expected", "non-finite", "names", "float64", "newer than", "not a rank", "no tensors"):
        assert any(part in why for why in dropped), part


def test_group_config_is_checked_before_anything_loads() -> None:
    with pytest.raises(msgspec.ValidationError, match="world_size"):
        msgspec.convert({"model": "unused", "world_size": 0}, DrafterActor.Config)
    cfg = msgspec.convert({"model": "unused", "world_size": 2}, DrafterActor.Config)
    for rank, peers, why in (
        (0, {"drafter:0": "ipc://a"}, r"\['drafter:1'\] are not in this run"),
        (2, {"drafter:0": "ipc://a", "drafter:2": "ipc://b"}, "this is rank 2"),
    ):
        actor = DrafterActor(cfg, rank=rank, outbox=None, inbox=Inbox(4), peers=peers)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=why):
            actor.on_start()
