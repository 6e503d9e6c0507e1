"""Coordinator mechanics against an in-memory supervisor (a unit double): dealing, leases, deaths, acks."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import torch

from slipstream.protocols.control import (
    CheckpointSaved,
    Failed,
    Idle,
    Lease,
    Preempt,
    Released,
    SaveCheckpoint,
)
from slipstream.protocols.drafter import DrafterStats, HeadAck
from slipstream.protocols.learner import (
    GroupPlan,
    PushWeights,
    SampleReceipt,
    StepStats,
    TrainStep,
    WeightAck,
)
from slipstream.protocols.rollout import Completion, GenerateRequest, IterationStats, SamplingSpec
from slipstream.rl.coordinator import ActorDiedError, Coordinator, RequestFailedError
from slipstream.runtime.actor import Actor, handler
from slipstream.runtime.codec import Codec
from slipstream.runtime.inbox import Inbox
from slipstream.runtime.traffic import Traffic


@dataclass(frozen=True)
class Died:
    name: str
    reason: str


class FakeSupervisor:
    """The Supervisor's surface the coordinator uses: inbox, deaths, send."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.deaths: asyncio.Queue[Died] = asyncio.Queue()
        self.traffic = Traffic()
        self.sent: list[tuple[str, Any]] = []

    async def send(self, name: str, msg: Any) -> None:
        self.sent.append((name, msg))

    def deliver(self, sender: str, msg: Any) -> None:
        self.inbox.put_nowait((sender, msg))


def request(group: int, samples: int = 2, max_tokens: int = 8) -> GenerateRequest:
    return GenerateRequest(
        group_id=group,
        prompt_ids=torch.tensor([1, 2, 3]),
        num_samples=samples,
        seed=group,
        sampling=SamplingSpec(max_tokens=max_tokens),
        policy_version=0,
    )


def completion(group: int, index: int) -> Completion:
    return Completion(
        group_id=group,
        sample_index=index,
        token_ids=torch.tensor([4, 5]),
        logprobs=torch.tensor([-0.1, -0.2]),
        finish_reason="stop",
        policy_version=0,
    )


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=20))


def test_rollout_deals_by_expected_work_leases_idle_devices_and_preempts_at_the_end() -> None:
    async def main() -> None:
        sup = FakeSupervisor()
        coord = Coordinator(
            sup,
            rollouts=["rollout:0", "rollout:1"],
            drafters={"rollout:0": "drafter:0", "rollout:1": "drafter:1"},
        )
        async with coord:
            requests = [request(0, 4, 100), request(1, 1, 100), request(2, 1, 100), request(3, 2, 100)]
            got = []
            stream = coord.rollout(requests).__aiter__()
            first = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0)
            dealt = {m.group_id: name for name, m in sup.sent if isinstance(m, GenerateRequest)}
            # Greedy by work: the 4-sample group alone on one device, the other three on the other.
            assert dealt[0] != dealt[1] == dealt[2] == dealt[3]
            sup.deliver("rollout:1", IterationStats(rank=1, iteration=0, batch_size=4, arm="ngram:d3",
                                                    drafted=8, accepted=4, committed=8, iter_s=0.1))  # fmt: skip
            # A plain pass whose 2 decoding rows commit 3 tokens (a prefill finished in it): no speculation.
            sup.deliver("rollout:0", IterationStats(rank=0, iteration=0, batch_size=2, arm="off",
                                                    drafted=0, accepted=0, committed=3, iter_s=0.1))  # fmt: skip
            for g, name in dealt.items():
                if name == "rollout:1":
                    for i in range(requests[g].num_samples):
                        sup.deliver(name, completion(g, i))
            sup.deliver("rollout:1", Idle(role="rollout", rank=1, policy_version=0))
            got.append(await first)
            while len(got) < 4:
                got.append(await stream.__anext__())
            await asyncio.sleep(0.05)  # the dispatcher routes Idle, the lease goes out from a task
            (lease_to, lease), = [(n, m) for n, m in sup.sent if isinstance(m, Lease)]  # fmt: skip
            assert lease_to == "drafter:1"
            for i in range(4):
                sup.deliver(dealt[0], completion(0, i))
            async for c in stream:
                got.append(c)
            assert len(got) == 8 and len({(c.group_id, c.sample_index) for c in got}) == 8
            await asyncio.sleep(0.05)
            (pre_to, pre), = [(n, m) for n, m in sup.sent if isinstance(m, Preempt)]  # fmt: skip
            assert pre_to == "drafter:1" and pre.lease_id == lease.lease_id
            sup.deliver("drafter:1", Released(lease_id=lease.lease_id, latency_ns=5_000_000))
            sup.deliver(
                "drafter:1",
                DrafterStats(rank=1, version=3, steps=3, loss=1.0, buffer_tokens=10, elapsed_s=0.5),
            )
            sup.deliver("rollout:0", Idle(role="rollout", rank=0, policy_version=0))
            metrics = await stream.finish()
            assert metrics.tokens == 16 and metrics.finish_reasons == {"stop": 8}
            # 1 + accepted / sequence-iterations: the prefill-born token does not count as a gain.
            assert metrics.accept_length == 1 + 4 / 6 and metrics.arms == {"ngram:d3": 1, "off": 1}
            # Reclaimed = the drafter's 0.5 training seconds capped by its device's idle window (~0.05 s).
            assert 0 < metrics.reclaimed_s <= metrics.idle_device_s and metrics.reclaimed_s < 0.5
            assert metrics.preempt_ms == [5.0]
            # Per bucket, the arms the rollouts ran; the drafter's loss from the steps it trained (0 -> 3).
            assert metrics.arms_by_batch == {"3-4": {"ngram:d3": 1}, "2": {"off": 1}}
            assert metrics.drafter_loss == 1.0

    run(main())


def test_a_death_makes_the_pending_wait_raise_naming_the_actor() -> None:
    async def main() -> None:
        sup = FakeSupervisor()
        async with Coordinator(sup, rollouts=["rollout:0"]) as coord:
            stream = coord.rollout([request(0)])
            sup.deaths.put_nowait(Died("rollout:0", "SIGKILL"))
            with pytest.raises(ActorDiedError, match=r"rollout:0 died .*SIGKILL"):
                async for _ in stream:
                    pass

    run(main())


def test_weights_applied_waits_for_every_rollout_and_raises_on_a_refusal() -> None:
    async def main() -> None:
        sup = FakeSupervisor()
        async with Coordinator(sup, rollouts=["rollout:0", "rollout:1"]) as coord:
            waiter = asyncio.ensure_future(coord.weights_applied(1))
            sup.deliver("rollout:0", WeightAck(version=1, role="rollout", rank=0, ok=True))
            await asyncio.sleep(0.05)
            assert not waiter.done()
            sup.deliver("rollout:1", WeightAck(version=1, role="rollout", rank=1, ok=True))
            await waiter
            sup.deliver("rollout:1", WeightAck(version=2, role="rollout", rank=1, ok=False, error="checksum"))
            with pytest.raises(RuntimeError, match="rollout:1 refused weights v2: checksum"):
                await coord.weights_applied(2)

    run(main())


def test_train_asks_each_learner_rank_and_gathers_their_stats() -> None:
    async def main() -> None:
        sup = FakeSupervisor()
        async with Coordinator(sup, rollouts=["rollout:0"], learners=["learner:0", "learner:1"]) as coord:
            plan = GroupPlan(group_id=0, prompt_ids=torch.tensor([1]), rewards=[1.0, 0.0])
            asks = {
                "learner:0": TrainStep(step=4, version=5, groups=[plan]),
                "learner:1": TrainStep(step=4, version=5),
            }
            task = asyncio.ensure_future(coord.train(4, asks))
            await asyncio.sleep(0)
            steps = {n: m for n, m in sup.sent if isinstance(m, TrainStep)}
            assert steps == asks  # each rank its own ask, nothing else: samples never pass the coordinator
            assert not [m for _, m in sup.sent if not isinstance(m, TrainStep)]
            for r in (1, 0):
                sup.deliver(
                    f"learner:{r}",
                    StepStats(step=4, version=5, loss=0.0, grad_norm=1.0, tokens=r, elapsed_s=0.1),
                )
            stats = await task
            assert [s.tokens for s in stats] == [0, 1]

    run(main())


class RestartingSupervisor(FakeSupervisor):
    """A double whose restart brings the actor back (the real one respawns the process)."""

    def __init__(self) -> None:
        super().__init__()
        self.restarted: list[str] = []
        self.killed: list[str] = []

    async def restart(self, name: str, *, config: Any = None) -> None:  # as the Supervisor Protocol
        self.restarted.append(name)

    def kill(self, name: str) -> None:  # the real one SIGKILLs; the death then arrives like any other
        self.killed.append(name)
        self.deaths.put_nowait(Died(name, "killed by SIGKILL"))

    def sent_any(self, kind: type) -> bool:
        return any(isinstance(m, kind) for _, m in self.sent)


async def until(ready: Any, seconds: float = 1.0) -> None:
    """Lets the coordinator's tasks run until `ready()` (the test's own timeout bounds a hang)."""
    for _ in range(int(seconds / 0.01)):
        if ready():
            return
        await asyncio.sleep(0.01)


def test_a_duplicate_completion_is_dropped_and_counted() -> None:
    async def main() -> None:
        sup = FakeSupervisor()
        async with Coordinator(sup, rollouts=["rollout:0"]) as coord:
            stream = coord.rollout([request(0, 2)])
            sup.deliver("rollout:0", completion(0, 0))
            sup.deliver("rollout:0", completion(0, 0))  # the same sample again (a presumed-dead original)
            sup.deliver("rollout:0", completion(9, 0))  # never dealt in this step: a stray
            sup.deliver("rollout:0", completion(0, 1))
            got = [(c.group_id, c.sample_index) async for c in stream]
            assert got == [(0, 0), (0, 1)]
            assert coord.metrics.duplicates == 2

    run(main())


def test_a_dead_rollout_is_restarted_given_the_weights_and_dealt_what_it_owed() -> None:
    async def main() -> None:
        sup = RestartingSupervisor()
        coord = Coordinator(
            sup, rollouts=["rollout:0", "rollout:1"], learners=["learner:0"], restart=True, policy_version=3
        )
        async with coord:
            stream = coord.rollout([request(0, 3), request(1, 3)]).__aiter__()
            first = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0)
            dealt = {m.group_id: name for name, m in sup.sent if isinstance(m, GenerateRequest)}
            victim = dealt[0]
            sup.deliver(victim, completion(0, 1))  # one sample came back before the death
            assert (await first).sample_index == 1
            sup.deaths.put_nowait(Died(victim, "killed by SIGKILL"))
            nxt = asyncio.ensure_future(stream.__anext__())
            await until(lambda: sup.sent_any(PushWeights))  # restarted, then the learner asked for weights
            push = next(m for _, m in sup.sent if isinstance(m, PushWeights))
            assert sup.restarted == [victim] and push.version == 3 and push.to == [victim]
            sup.deliver(
                victim, WeightAck(version=3, role="rollout", rank=int(victim[-1]), ok=True, error=None)
            )
            await until(lambda: any(isinstance(m, GenerateRequest) and m.sample_indices for _, m in sup.sent))
            requeued = [m for _, m in sup.sent if isinstance(m, GenerateRequest) and m.sample_indices]
            assert [(m.group_id, m.sample_indices, m.seed) for m in requeued] == [(0, [0, 2], 0)]
            for i in (0, 2):
                sup.deliver(victim, completion(0, i))
            for i in range(3):
                sup.deliver(dealt[1], completion(1, i))
            got = [await nxt] + [c async for c in stream]
            assert sorted((c.group_id, c.sample_index) for c in got) == [
                (0, 0),
                (0, 2),
                (1, 0),
                (1, 1),
                (1, 2),
            ]
            assert coord.restarted == [victim] and coord.metrics.requeued == 2

    run(main())


def test_without_restart_a_dead_rollout_ends_the_wait_naming_it() -> None:
    async def main() -> None:
        sup = RestartingSupervisor()
        async with Coordinator(sup, rollouts=["rollout:0"]) as coord:
            stream = coord.rollout([request(0, 2)]).__aiter__()
            sup.deaths.put_nowait(Died("rollout:0", "exited with code 1"))
            with pytest.raises(ActorDiedError, match=r"rollout:0 died .*exited with code 1"):
                await stream.__anext__()
            assert sup.restarted == []

    run(main())


def test_a_dead_verifier_is_restarted_and_sent_its_requests_again() -> None:
    from slipstream.protocols.reward import Reward, ScoreRequest

    def score(group: int, index: int) -> ScoreRequest:
        return ScoreRequest(
            group_id=group, sample_index=index, prompt="p", completion="c", row_json="{}", policy_version=0
        )

    def reward(group: int, index: int) -> Reward:
        return Reward(group_id=group, sample_index=index, reward=1.0, elapsed_s=0.1, policy_version=0)

    async def main() -> None:
        sup = RestartingSupervisor()
        async with Coordinator(sup, rollouts=[], verifiers=["verifier:0"], restart=True) as coord:
            for i in range(3):
                await coord.score(score(0, i))
            sup.deliver("verifier:0", reward(0, 0))
            assert (await coord.reward()).sample_index == 0
            sup.deaths.put_nowait(Died("verifier:0", "killed by SIGKILL"))
            pending = asyncio.ensure_future(coord.reward())
            await until(lambda: bool(sup.restarted))
            resent = [m.sample_index for _, m in sup.sent if isinstance(m, ScoreRequest)][3:]
            assert sup.restarted == ["verifier:0"] and resent == [1, 2]
            sup.deliver("verifier:0", reward(0, 1))
            sup.deliver("verifier:0", reward(0, 1))  # a duplicate: dropped
            sup.deliver("verifier:0", reward(0, 2))
            assert (await pending).sample_index == 1
            assert (await coord.reward()).sample_index == 2
            assert coord.metrics.duplicates == 1

    run(main())


def test_a_rollout_dealt_nothing_is_idle_from_the_start_and_its_device_is_leased() -> None:
    async def main() -> None:
        sup = FakeSupervisor()
        coord = Coordinator(
            sup,
            rollouts=["rollout:0", "rollout:1"],
            drafters={"rollout:0": "drafter:0", "rollout:1": "drafter:1"},
        )
        async with coord:
            stream = coord.rollout([request(0, 1)])  # one group, two rollouts
            first = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.05)
            dealt = next(name for name, m in sup.sent if isinstance(m, GenerateRequest))
            other = "rollout:1" if dealt == "rollout:0" else "rollout:0"
            leases = [(name, m) for name, m in sup.sent if isinstance(m, Lease)]
            assert [name for name, _ in leases] == [other.replace("rollout", "drafter")]
            sup.deliver(dealt, completion(0, 0))
            await first
            await asyncio.sleep(0.05)  # the preemption goes out
            sup.deliver(dealt, Idle(role="rollout", rank=int(dealt[-1]), policy_version=0))
            drafter = other.replace("rollout", "drafter")
            sup.deliver(drafter, Released(lease_id=leases[0][1].lease_id, latency_ns=1000))
            sup.deliver(
                drafter, DrafterStats(rank=0, version=0, steps=1, loss=1.0, buffer_tokens=0, elapsed_s=0.5)
            )
            metrics = await stream.finish(timeout_s=5)  # returns: no wait for an Idle that never comes
            assert metrics.idle_device_s > 0

    run(main())


def test_a_rollout_that_dies_during_the_weight_sync_is_restarted_and_sent_that_version() -> None:
    async def main() -> None:
        sup = RestartingSupervisor()
        coord = Coordinator(sup, rollouts=["rollout:0", "rollout:1"], learners=["learner:0"], restart=True)
        async with coord:
            waiting = asyncio.ensure_future(coord.weights_applied(5, timeout_s=5))
            sup.deliver("rollout:0", WeightAck(version=5, role="rollout", rank=0, ok=True, error=None))
            sup.deaths.put_nowait(Died("rollout:1", "killed by SIGKILL"))
            await until(lambda: sup.sent_any(PushWeights))
            push = next(m for _, m in sup.sent if isinstance(m, PushWeights))
            assert sup.restarted == ["rollout:1"] and (push.version, push.to) == (5, ["rollout:1"])
            sup.deliver("rollout:1", WeightAck(version=5, role="rollout", rank=1, ok=True, error=None))
            await waiting
            assert coord.policy_version == 5

    run(main())


def test_a_rollout_restarted_owing_nothing_counts_as_idle() -> None:
    async def main() -> None:
        sup = RestartingSupervisor()
        coord = Coordinator(sup, rollouts=["rollout:0", "rollout:1"], restart=True)
        async with coord:
            stream = coord.rollout([request(0, 1), request(1, 1)]).__aiter__()
            first = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.01)
            dealt = {m.group_id: name for name, m in sup.sent if isinstance(m, GenerateRequest)}
            sup.deliver(dealt[0], completion(0, 0))
            await first
            sup.deliver(dealt[0], Idle(role="rollout", rank=int(dealt[0][-1]), policy_version=0))
            sup.deaths.put_nowait(Died(dealt[0], "killed by SIGKILL"))  # dies after finishing its share
            await asyncio.sleep(0.05)
            sup.deliver(dealt[1], completion(1, 0))
            await stream.__anext__()  # the rollout's wait restarts the dead one, which owes nothing
            sup.deliver(dealt[1], Idle(role="rollout", rank=int(dealt[1][-1]), policy_version=0))
            await stream.finish(timeout_s=5)  # no wait for an Idle the restarted one never sends
            assert sup.restarted == [dealt[0]]

    run(main())


def test_a_drafter_that_never_releases_its_lease_is_killed_and_restarted_not_waited_on() -> None:
    async def main() -> None:
        sup = RestartingSupervisor()
        coord = Coordinator(
            sup, rollouts=["rollout:0", "rollout:1"], drafters={"rollout:1": "drafter:1"}, restart=True
        )
        async with coord:
            stream = coord.rollout([request(0, 1), request(1, 1)]).__aiter__()
            first = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.01)
            dealt = {m.group_id: name for name, m in sup.sent if isinstance(m, GenerateRequest)}
            sup.deliver("rollout:1", completion(1 if dealt[1] == "rollout:1" else 0, 0))
            await first
            sup.deliver("rollout:1", Idle(role="rollout", rank=1, policy_version=0))
            await until(lambda: sup.sent_any(Lease))
            other = 0 if dealt[1] == "rollout:1" else 1
            sup.deliver("rollout:0", completion(other, 0))
            await stream.__anext__()
            sup.deliver("rollout:0", Idle(role="rollout", rank=0, policy_version=0))
            # drafter:1 is preempted but never answers (alive, stuck): killed at the deadline, restarted.
            metrics = await stream.finish(timeout_s=0.3)
            assert sup.killed == ["drafter:1"] and sup.restarted == ["drafter:1"]
            assert metrics.rollout_s > 0 and not coord.leases.active

    run(main())


def recovering(sup: RestartingSupervisor, recovered: list[int]) -> Coordinator:
    """A coordinator at v3 with one rollout and one learner, whose learner recovery (the run's: restart from
    the checkpoint, replay to v3) appends the policy version it recovers to `recovered`."""

    async def recover_learners() -> None:
        recovered.append(coord.policy_version)
        del coord.dead["learner:0"]

    coord = Coordinator(
        sup, rollouts=["rollout:0"], learners=["learner:0"], restart=True, policy_version=3,
        recover_learners=recover_learners,
    )  # fmt: skip
    return coord


def test_a_rollout_revived_while_the_learner_is_dead_waits_for_the_learners_recovery() -> None:
    async def main() -> None:
        sup = RestartingSupervisor()
        recovered: list[int] = []
        coord = recovering(sup, recovered)
        async with coord:
            stream = coord.rollout([request(0, 1)]).__aiter__()
            nxt = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.01)
            sup.deaths.put_nowait(Died("learner:0", "killed by SIGKILL"))
            sup.deaths.put_nowait(Died("rollout:0", "killed by SIGKILL"))
            # The revived rollout needs v3 from a dead learner: recovered first, then asked to push.
            await until(lambda: sup.sent_any(PushWeights), seconds=2.0)
            assert recovered == [3] and sup.restarted == ["rollout:0"]
            sup.deliver("rollout:0", WeightAck(version=3, role="rollout", rank=0, ok=True, error=None))
            await until(lambda: any(isinstance(m, GenerateRequest) and m.sample_indices for _, m in sup.sent))
            sup.deliver("rollout:0", completion(0, 0))
            assert (await nxt).sample_index == 0

    run(main())


def test_a_version_synced_again_after_a_learner_death_is_not_waited_on() -> None:
    """A step retrained after the learner died in its sync re-pushes a version the rollouts and drafters
    already hold; they ignore it without an answer, so the wait must count what they acknowledged before."""

    async def main() -> None:
        sup = RestartingSupervisor()
        coord = Coordinator(sup, rollouts=["rollout:0", "rollout:1"], learners=["learner:0"], restart=True)
        async with coord:
            first = asyncio.ensure_future(coord.weights_applied(5, heads=["drafter:0"]))
            for rank in (0, 1):
                sup.deliver(
                    f"rollout:{rank}", WeightAck(version=5, role="rollout", rank=rank, ok=True, error=None)
                )
            sup.deliver("drafter:0", HeadAck(rank=0, version=5, ok=True))
            await first
            await asyncio.wait_for(coord.weights_applied(5, heads=["drafter:0"]), timeout=1.0)  # no answers
            # A restarted rollout holds only what it loaded: it is waited on again.
            sup.deaths.put_nowait(Died("rollout:1", "killed by SIGKILL"))
            await until(lambda: "rollout:1" in coord.dead)
            again = asyncio.ensure_future(coord.weights_applied(5))
            await until(lambda: sup.restarted == ["rollout:1"])
            await asyncio.sleep(0.05)
            assert not again.done()
            sup.deliver("rollout:1", WeightAck(version=5, role="rollout", rank=1, ok=True, error=None))
            await asyncio.wait_for(again, timeout=1.0)

    run(main())


def test_rollouts_alone_end_the_sync_and_heads_are_awaited_later() -> None:
    """`weights_applied` without heads returns on the rollouts' acks while a drafter's head answer is still
    out; `heads_applied` waits for it, or for the learner's death (its recovery pushes the head again)."""

    async def main() -> None:
        sup = RestartingSupervisor()
        coord = Coordinator(sup, rollouts=["rollout:0"], learners=["learner:0"], restart=True)
        async with coord:
            sup.deliver("rollout:0", WeightAck(version=3, role="rollout", rank=0, ok=True, error=None))
            await asyncio.wait_for(coord.weights_applied(3), timeout=1.0)
            heads = asyncio.ensure_future(coord.heads_applied(3, ["drafter:0", "drafter:1"]))
            sup.deliver("drafter:0", HeadAck(rank=0, version=3, ok=True))
            await asyncio.sleep(0.05)
            assert not heads.done()  # drafter:1 has not answered
            sup.deliver("drafter:1", HeadAck(rank=1, version=3, ok=False, why="checksum"))
            await asyncio.wait_for(heads, timeout=1.0)
            # A learner that dies before pushing the head ends the wait: nobody would answer.
            orphan = asyncio.ensure_future(coord.heads_applied(4, ["drafter:0"]))
            await asyncio.sleep(0.05)
            assert not orphan.done()
            sup.deaths.put_nowait(Died("learner:0", "killed by SIGKILL"))
            await asyncio.wait_for(orphan, timeout=1.0)

    run(main())


def test_a_checkpoint_the_learner_could_not_save_ends_the_wait_naming_its_error() -> None:
    """A full disk once hung the run: the learner's handler failed and nothing answered save_checkpoint."""

    async def main() -> None:
        sup = FakeSupervisor()
        async with Coordinator(sup, rollouts=["rollout:0"], learners=["learner:0"]) as coord:
            saved = asyncio.ensure_future(coord.save_checkpoint(1, "ckpt/step-1"))
            await asyncio.sleep(0.05)
            sup.deliver("learner:0", CheckpointSaved(step=1, path="ckpt/step-1", version=1))
            await saved
            failed = asyncio.ensure_future(coord.save_checkpoint(2, "ckpt/step-2"))
            await asyncio.sleep(0.05)
            failure = CheckpointSaved(step=2, path="ckpt/step-2", version=2, error="No space left on device")
            sup.deliver("learner:0", failure)
            with pytest.raises(RuntimeError, match=r"learner:0 could not save checkpoint 2 .*No space left"):
                await failed

    run(main())


def test_a_request_whose_handler_raises_is_answered_failed_and_its_waiter_ends() -> None:
    """An actor's handler that raises (a bug, not a death) answers the coordinator `Failed` naming the
    error; the coordinator's wait on that actor then raises it instead of hanging."""

    class Broken(Actor):
        role = "learner"

        @handler
        def on_checkpoint(self, msg: SaveCheckpoint, sender: str) -> None:
            raise ValueError(f"no room for {msg.path}")

    class Outbox:
        def __init__(self) -> None:
            self.sent: list[tuple[str, Any]] = []

        def send(self, dest: str, frames: list[Any]) -> None:
            self.sent.append((dest, Codec().decode(frames)))

    outbox = Outbox()
    actor = Broken(Broken.Config(), rank=0, outbox=outbox, inbox=Inbox(4))
    request = SaveCheckpoint(step=2, path="ckpt/step-2")
    actor.dispatch(request, "coordinator")
    actor.dispatch(request, "rollout:0")  # a peer's message has no waiter: no answer
    ((dest, answer),) = outbox.sent
    assert dest == "coordinator" and answer == Failed(
        request="control.checkpoint", error="ValueError: no room for ckpt/step-2"
    )

    async def main() -> None:
        sup = FakeSupervisor()
        async with Coordinator(sup, rollouts=[], learners=["learner:0"]) as coord:
            saved = asyncio.ensure_future(coord.save_checkpoint(2, "ckpt/step-2"))
            await asyncio.sleep(0.05)
            sup.deliver("learner:0", answer)
            with pytest.raises(RequestFailedError, match=r"learner:0 failed .*checkpoint of step 2.*no room"):
                await asyncio.wait_for(saved, 5)

    run(main())


def test_a_learner_that_dies_while_a_restarted_rollout_is_re_pushed_is_recovered_then_pushes_again() -> None:
    """Mid-step a rollout dies and is restarted; while the learner re-pushes it the current policy, the
    learner dies too. Its recovery (checkpoint, replay) runs, and then the rollout gets its weights."""

    async def main() -> None:
        sup = RestartingSupervisor()
        recovered: list[int] = []
        coord = recovering(sup, recovered)
        async with coord:
            stream = coord.rollout([request(0, 1)])
            nxt = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.01)
            sup.deaths.put_nowait(Died("rollout:0", "killed by SIGKILL"))
            await until(lambda: sup.sent_any(PushWeights))  # restarted, the re-push asked for
            assert sup.restarted == ["rollout:0"] and not recovered
            sup.deaths.put_nowait(Died("learner:0", "killed by SIGKILL"))  # before the rollout's ack
            await until(lambda: len([m for _, m in sup.sent if isinstance(m, PushWeights)]) == 2, seconds=2.0)
            assert recovered == [3] and sup.restarted == ["rollout:0"]  # the rollout is not restarted again
            pushes = [m for _, m in sup.sent if isinstance(m, PushWeights)]
            assert [(p.version, p.to) for p in pushes] == [(3, ["rollout:0"])] * 2
            sup.deliver("rollout:0", WeightAck(version=3, role="rollout", rank=0, ok=True, error=None))
            await until(lambda: any(isinstance(m, GenerateRequest) and m.sample_indices for _, m in sup.sent))
            sup.deliver("rollout:0", completion(0, 0))
            assert (await nxt).sample_index == 0

    run(main())


def test_each_step_logs_what_reached_the_coordinator_by_kind() -> None:
    """`begin` logs the traffic since the previous step began (messages and bytes, by kind), and leaving
    the coordinator logs the last step's; nothing is logged for an interval that received nothing."""
    events: list[tuple[str, dict[str, Any]]] = []

    class Log:
        def info(self, event: str, **fields: Any) -> None:
            events.append((event, fields))

    async def main() -> None:
        sup = FakeSupervisor()
        async with Coordinator(sup, rollouts=["rollout:0"], log=Log()) as coord:
            sup.traffic.add("rollout.completion", 100)
            sup.traffic.add("rollout.completion", 50)
            sup.traffic.add("control.heartbeat", 10)
            coord.begin(coord.rollout([request(0)]))
            coord.begin(coord.rollout([request(1)]))  # nothing arrived in between: no event
            sup.traffic.add("reward.reward", 7)

    run(main())
    inbound = [fields for event, fields in events if event == "inbound"]
    assert inbound == [
        {
            "messages": 3,
            "bytes": 160,
            "kinds": {"rollout.completion": [2, 150], "control.heartbeat": [1, 10]},
        },
        {"messages": 1, "bytes": 7, "kinds": {"reward.reward": [1, 7]}},
    ]


def test_traffic_counts_by_kind_and_starts_afresh_after_a_take() -> None:
    traffic = Traffic()
    assert traffic.take() == {}
    traffic.add("a", 3)
    traffic.add("b", 4)
    traffic.add("a", 5)
    assert traffic.take() == {"a": [2, 8], "b": [1, 4]}
    assert traffic.take() == {}


def test_a_step_whose_learner_dies_is_given_up_and_an_earlier_trys_receipts_are_not_its_own() -> None:
    async def main() -> None:
        sup = FakeSupervisor()
        async with Coordinator(sup, rollouts=["rollout:0"], learners=["learner:0"]) as coord:
            first = coord.rollout([msgspec.structs.replace(request(0, 2), learn_at="learner:0")])
            sup.deliver("learner:0", receipt(0, 0))
            assert (await first.__anext__()).sample_index == 0
            sup.deaths.put_nowait(Died("learner:0", "SIGKILL"))  # it held sample 0: lost with it
            with pytest.raises(ActorDiedError, match="learner:0 died holding samples of the step"):
                await first.__anext__()
            # The step again, as its next try: a receipt of the first try (a copy the restarted learner got
            # before the new try's) is not this try's sample; the new try's are.
            del coord.dead["learner:0"]
            again = msgspec.structs.replace(request(0, 2), learn_at="learner:0", attempt=1)
            second = coord.rollout([again])
            sup.deliver("learner:0", receipt(0, 1, attempt=0))
            sup.deliver("learner:0", receipt(0, 0, attempt=1))
            sup.deliver("learner:0", receipt(0, 1, attempt=1))
            got = [(r.sample_index, r.attempt) async for r in second]
            assert got == [(0, 1), (1, 1)]
            assert [(n, m.attempt) for n, m in sup.sent] == [
                ("rollout:0", 0),
                ("rollout:0", 1),
            ]  # dealt again, try 1

    run(main())


def receipt(group: int, index: int, attempt: int = 0) -> SampleReceipt:
    return SampleReceipt(
        group_id=group, sample_index=index, tokens=2, finish_reason="stop", policy_version=0, text="x",
        attempt=attempt,
    )  # fmt: skip
