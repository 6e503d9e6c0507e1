"""The coordinator's side of weight deltas, against an in-memory supervisor: `train` names the version each
destination acknowledged (`delta_base`), a rollout that refuses a delta for want of its base (`want_full`)
is sent the version in full, any other refusal still fails the sync, and the learner's push reports are
summed per version."""

from __future__ import annotations

import asyncio

import pytest

from slipstream.protocols.drafter import HeadAck
from slipstream.protocols.learner import PushWeights, WeightAck, WeightsPushed
from slipstream.rl.coordinator import Coordinator
from tests.rl.test_coordinator import FakeSupervisor, run

ROLLOUTS = ["rollout:0", "rollout:1"]


def ack(rank: int, version: int, ok: bool = True, **fields: object) -> WeightAck:
    return WeightAck(version=version, role="rollout", rank=rank, ok=ok, **fields)  # type: ignore[arg-type]


def test_train_names_the_version_each_destination_acknowledged() -> None:
    async def main() -> None:
        sup = FakeSupervisor()
        learners = ["learner:0", "learner:1"]
        async with Coordinator(sup, rollouts=ROLLOUTS, learners=learners) as coord:
            sup.deliver("rollout:0", ack(0, 1))
            sup.deliver("rollout:0", ack(0, 2))
            sup.deliver("rollout:1", ack(1, 2, ok=False, error="checksum"))  # refused: holds nothing known
            sup.deliver("drafter:0", HeadAck(rank=0, version=2, ok=True))
            await asyncio.sleep(0.05)
            task = asyncio.ensure_future(
                coord.push_weights(3, to=ROLLOUTS, head_to=["drafter:0"], deltas=True)
            )
            await asyncio.sleep(0.05)
            pushes = [(n, m) for n, m in sup.sent if isinstance(m, PushWeights)]
            # Every rank is asked (sharded ranks gather each bucket with rank 0, which alone sends), alike.
            assert [n for n, _ in pushes] == ["learner:0", "learner:1"]
            assert pushes[0][1] == pushes[1][1]
            assert pushes[0][1].delta_base == {"rollout:0": 2, "drafter:0": 2}
            for rank in (0, 1):
                sup.deliver(f"rollout:{rank}", ack(rank, 3))
            await task

    run(main())


def test_a_refused_delta_is_answered_with_the_version_in_full() -> None:
    async def main() -> None:
        sup = FakeSupervisor()
        async with Coordinator(sup, rollouts=ROLLOUTS, learners=["learner:0"]) as coord:
            waiter = asyncio.ensure_future(coord.weights_applied(4))
            sup.deliver("rollout:0", ack(0, 4))
            sup.deliver("rollout:1", ack(1, 4, ok=False, error="delta base mismatch", want_full=True))
            await asyncio.sleep(0.05)
            pushes = [(n, m) for n, m in sup.sent if isinstance(m, PushWeights)]
            assert pushes == [("learner:0", PushWeights(version=4, to=["rollout:1"]))]
            assert not waiter.done()  # until the full push is acknowledged
            sup.deliver("rollout:1", ack(1, 4))
            await asyncio.wait_for(waiter, 5)
            assert coord.policy_version == 4

            # Any other refusal still fails the sync, naming it.
            waiter = asyncio.ensure_future(coord.weights_applied(5))
            sup.deliver("rollout:0", ack(0, 5, ok=False, error="checksum mismatch"))
            sup.deliver("rollout:1", ack(1, 5, ok=False, error="delta base mismatch", want_full=True))
            with pytest.raises(RuntimeError, match="rollout:0 refused weights v5: checksum mismatch"):
                await asyncio.wait_for(waiter, 5)

    run(main())


def test_a_full_push_refused_as_a_delta_fails_rather_than_loops() -> None:
    async def main() -> None:
        sup = FakeSupervisor()
        async with Coordinator(sup, rollouts=ROLLOUTS, learners=["learner:0"]) as coord:
            waiter = asyncio.ensure_future(coord.push_weights(3, to=["rollout:0"]))
            await asyncio.sleep(0.05)
            sup.deliver("rollout:0", ack(0, 3, ok=False, error="delta base mismatch", want_full=True))
            with pytest.raises(RuntimeError, match="rollout:0 answered the full push of v3 with want_full"):
                await asyncio.wait_for(waiter, 5)

    run(main())


def test_push_reports_are_summed_per_version() -> None:
    async def main() -> None:
        sup = FakeSupervisor()
        async with Coordinator(sup, rollouts=ROLLOUTS, learners=["learner:0"]) as coord:
            for head_only, full, wire in ((False, 100, 40), (True, 20, 5), (False, 100, 100)):
                report = WeightsPushed(
                    version=7, head_only=head_only, full_bytes=full, wire_bytes=wire, deltas=1
                )
                sup.deliver("learner:0", report)
            await asyncio.sleep(0.05)
            assert coord.pushed[7] == {"full_bytes": 220, "wire_bytes": 145, "push_bytes": 0}  # bytes unsaid

    run(main())
