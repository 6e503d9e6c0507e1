"""The coordinator: the one reader of the supervisor's inbox, and the RL step's verbs.

One dispatcher task takes every message and death from the supervisor and hands each message to the
handler its type names (`_handlers`): completions and reward calls' totals to the step that dealt them
(`RolloutStep`, rl/step.py: the learners' `SampleReceipt`s, or whole completions where no learner takes
them), rewards, acks, learner stats and checkpoint answers to their waiters,
Idle/Released/DrafterStats to the `LeaseTable`. Verbs: `rollout` (returns the step's handle),
`score`/`reward`, `train`, `push_weights`, `weights_applied`, `heads_applied`, `save_checkpoint`. Clients:
rl/run.py and `bench rollout`.

Non-obvious choices:
- Nothing is lost for lack of room: a full inbox blocks the supervisor's receive loop (backpressure, never
  a drop); the queues here are bounded by what was dealt.
- No fixed deadline on a learner step, a push or a checkpoint: a wait ends when its peers answer, fail
  (`Failed`: a handler raised) or die; a hung peer is killed by its hang deadline (the supervisor).
- It owns the policy version the rollouts hold (`policy_version`): only `weights_applied` moves it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import msgspec

from slipstream.protocols.base import Message
from slipstream.protocols.control import CheckpointSaved, Failed, Idle, Released, SaveCheckpoint, Status
from slipstream.protocols.drafter import DrafterStats, HeadAck
from slipstream.protocols.learner import (
    PushWeights,
    SampleReceipt,
    StepStats,
    TrainStep,
    WeightAck,
    WeightsPushed,
)
from slipstream.protocols.reward import Reward, RewardCalls, ScoreRequest
from slipstream.protocols.rollout import Completion, GenerateRequest, IterationStats
from slipstream.rl import recovery
from slipstream.rl.leases import LeaseTable
from slipstream.rl.ledger import Ledger
from slipstream.rl.recovery import ActorDiedError
from slipstream.rl.step import RolloutStep, StepMetrics
from slipstream.runtime.spans import NULL_RECORDER, SpanRecorder
from slipstream.runtime.traffic import Traffic

__all__ = ["ActorDiedError", "Coordinator", "RequestFailedError", "Supervisor"]


class RequestFailedError(RuntimeError):
    """An actor answered a request with `Failed`: its handler raised; the message names it and the error."""


class Supervisor(Protocol):
    """What the coordinator needs of runtime/supervisor.py's `Supervisor` (tests pass a double)."""

    inbox: asyncio.Queue[tuple[str, Message]]
    deaths: asyncio.Queue[Any]  # runtime/spec.py ActorDied: .name, .reason
    traffic: Traffic  # what crossed the control socket, by kind (logged a step: `inbound`)

    async def send(self, name: str, msg: Message) -> None: ...

    async def restart(self, name: str, *, config: msgspec.Struct | None = None) -> None: ...

    def config(self, name: str) -> Any: ...

    def kill(self, name: str) -> None: ...


class Coordinator:
    """Routes every message of a started `Supervisor`; see the module docstring.

    `restart`: a dead rollout, verifier or drafter is restarted and dealt its work again (rl/recovery.py);
    off, a death ends the wait that sees it (ActorDiedError). `recover_learners`: the loop's way back to
    the current policy after a learner death (checkpoint, replay). `policy_version`: what every rollout
    holds at the start."""

    def __init__(
        self,
        sup: Supervisor,
        *,
        rollouts: Sequence[str],
        drafters: dict[str, str] | None = None,
        lease_cpus: dict[str, list[int]] | None = None,
        verifiers: Sequence[str] = (),
        learners: Sequence[str] = (),
        environments: Sequence[str] = (),
        lease_threads: int = 1,
        restart: bool = False,
        policy_version: int = 0,
        homes: dict[str, str] | None = None,
        recover_learners: Callable[[], Awaitable[None]] | None = None,
        spans: SpanRecorder = NULL_RECORDER,
        log: Any = None,
    ) -> None:
        self.sup = sup
        self.rollouts, self.verifiers, self.learners = list(rollouts), list(verifiers), list(learners)
        self.environments = list(environments)  # multi-turn episodes' actors: the rollouts talk to them
        self.leases = LeaseTable(
            drafter_of=dict(drafters or {}), threads=lease_threads, cpus_of=dict(lease_cpus or {})
        )
        self.restart = restart
        self.policy_version = policy_version  # the version every rollout holds (what a restarted one needs)
        # Prompt key -> the rollout that decoded it last (it holds the prompt's history): where it is dealt next.
        self.homes: dict[str, str] = dict(homes or {})
        self.recover_learners = recover_learners
        self.spans = spans  # the step's phases and device windows (runtime/spans.py)
        self.log = log
        self.dead: dict[str, str] = {}
        self.failed: dict[str, str] = {}  # actor -> its last `Failed` answer not yet raised to a waiter
        self.restarted: list[str] = []  # every restart of the run, in order (a step reports its slice)
        self.drafter_steps: dict[str, int] = {}  # drafter -> training steps at its last DrafterStats
        self.scores = Ledger()  # score requests: which verifier holds which (group, sample)
        self.score_requests: dict[tuple[int, int], ScoreRequest] = {}
        # Version -> what the learner's pushes of it moved ("full_bytes", "wire_bytes", "push_bytes").
        self.pushed: dict[int, dict[str, int]] = defaultdict(dict)
        self._rewards: asyncio.Queue[Reward] = asyncio.Queue()
        self._acks: dict[int, dict[str, WeightAck]] = defaultdict(dict)
        self._head_acks: dict[int, dict[str, bool]] = defaultdict(dict)  # version -> drafter -> applied
        # Newest version each rollout (weights) or drafter (head) acked: a re-push of it gets no answer.
        self._holds: dict[str, int] = {}
        self._stats: dict[int, dict[str, StepStats]] = defaultdict(dict)
        self._saved: dict[int, str] = {}  # step -> "" once the learner's checkpoint is on disk, else why not
        self._changed = asyncio.Event()  # set on every routed message or death: waiters re-check
        self._step: RolloutStep | None = None  # the step reports without a step id go to (the newest)
        self._idle_metrics = StepMetrics()  # where they go before the first step
        self._task: asyncio.Task[None] | None = None
        self._handlers = self._routes()

    def _routes(self) -> dict[type[Message], Callable[[str, Any], None]]:
        """The handler of each message type the dispatcher routes (an unlisted one is logged, unrouted)."""
        return {
            Completion: self._on_completion,
            SampleReceipt: self._on_completion,
            Reward: self._on_reward,
            RewardCalls: self._on_reward_calls,
            WeightAck: self._on_weight_ack,
            HeadAck: self._on_head_ack,
            WeightsPushed: self._on_pushed,
            StepStats: self._on_step_stats,
            CheckpointSaved: self._on_checkpoint_saved,
            IterationStats: self._on_iteration,
            Idle: self._on_idle_msg,
            Released: self._on_released,
            DrafterStats: self._on_drafter_stats,
            Failed: self._on_failed,
            Status: self._on_status,
        }

    @property
    def metrics(self) -> StepMetrics:
        """The newest step's metrics so far (rewards' requeues and duplicates count there too)."""
        return self._step.metrics if self._step is not None else self._idle_metrics

    # -- lifecycle --------------------------------------------------------------------------------------

    async def __aenter__(self) -> Coordinator:
        self._task = asyncio.create_task(self._dispatch(), name="coordinator-dispatch")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.log_inbound()  # the last step's cycle

    async def _dispatch(self) -> None:
        sup = self.sup
        while True:
            inbox = asyncio.ensure_future(sup.inbox.get())
            death = asyncio.ensure_future(sup.deaths.get())
            done, _ = await asyncio.wait({inbox, death}, return_when=asyncio.FIRST_COMPLETED)
            for fut in (inbox, death):
                if fut not in done:
                    fut.cancel()
                elif fut is death:
                    died = fut.result()
                    self.dead[died.name] = died.reason
                    self._holds.pop(died.name, None)  # its successor holds what it loads
                    self.emit("actor_died", actor=died.name, reason=died.reason, level="error")
                else:
                    sender, msg = fut.result()
                    route = self._handlers.get(type(msg))
                    if route is None:
                        self.emit("unrouted", sender=sender, kind=msg.kind, level="warning")
                    else:
                        route(sender, msg)
            self._changed.set()

    # -- the handlers, one per message type --------------------------------------------------------------

    def _on_completion(self, sender: str, msg: Completion | SampleReceipt) -> None:
        if self._step is not None:  # a stray before any step has nobody to go to
            self._step.completions.put_nowait(msg)

    def _on_reward(self, sender: str, msg: Reward) -> None:
        self._rewards.put_nowait(msg)

    def _on_reward_calls(self, sender: str, msg: RewardCalls) -> None:
        self.metrics.add_reward_calls(msg.terms)  # ahead of the Rewards they scored: in by the step's last

    def _on_weight_ack(self, sender: str, msg: WeightAck) -> None:
        self._acks[msg.version][sender] = msg
        if msg.ok:
            self._holds[sender] = max(self._holds.get(sender, 0), msg.version)

    def _on_head_ack(self, sender: str, msg: HeadAck) -> None:
        self._head_acks[msg.version][sender] = msg.ok
        if msg.ok:
            self._holds[sender] = max(self._holds.get(sender, 0), msg.version)

    def _on_pushed(self, sender: str, msg: WeightsPushed) -> None:
        moved = self.pushed[msg.version]
        for key in ("full_bytes", "wire_bytes"):  # summed over the version's pushes
            moved[key] = moved.get(key, 0) + getattr(msg, key)
        if not msg.head_only:  # one copy of the policy in the push dtype, however often it was sent
            moved["push_bytes"] = max(moved.get("push_bytes", 0), msg.bytes)

    def _on_step_stats(self, sender: str, msg: StepStats) -> None:
        self._stats[msg.step][sender] = msg

    def _on_checkpoint_saved(self, sender: str, msg: CheckpointSaved) -> None:
        self._saved[msg.step] = msg.error

    def _on_iteration(self, sender: str, msg: IterationStats) -> None:
        self.metrics.add_iteration(
            msg.batch_size, msg.arm, msg.accepted, msg.offered_at, msg.accepted_at,
            iter_s=msg.iter_s, committed=msg.committed, drafted=msg.drafted, draft_s=msg.draft_s,
        )  # fmt: skip
        if self._step is not None and self._step.on_iteration is not None:
            self._step.on_iteration(sender, msg)

    def _on_idle_msg(self, sender: str, msg: Idle) -> None:
        self.on_idle(sender, time.monotonic())

    def _on_released(self, sender: str, msg: Released) -> None:
        self.leases.released(sender, msg.lease_id, msg.latency_ns / 1e6)

    def _on_drafter_stats(self, sender: str, msg: DrafterStats) -> None:
        self.leases.stats(sender, msg.elapsed_s)
        # Only a loss from steps trained since its last report is this step's (one that did not train
        # repeats its last one).
        if msg.steps > self.drafter_steps.get(sender, 0) and math.isfinite(msg.loss):
            self.metrics.drafter_loss = msg.loss
        self.drafter_steps[sender] = msg.steps

    def _on_failed(self, sender: str, msg: Failed) -> None:
        self.failed[sender] = f"{msg.request}: {msg.error}"
        self.emit("request_failed", sender=sender, request=msg.request, error=msg.error, level="error")

    def _on_status(self, sender: str, msg: Status) -> None:  # reports for the log (verifier, drafter)
        self.emit("status", sender=sender, topic=msg.topic, **msg.fields)

    # -- leases ---------------------------------------------------------------------------------------

    def on_idle(self, rollout: str, now: float) -> None:
        """The line where an idle rollout device goes to drafter training (while others still decode)."""
        decoding = self._step is not None and self._step.decoding
        granted = self.leases.idle(rollout, now, grant=decoding, dead=self.dead)
        if granted is not None:
            self._send_soon(*granted)

    def preempt_all(self, reason: str) -> None:
        for drafter, preempt in self.leases.preempts(reason):
            self._send_soon(drafter, preempt)

    def _send_soon(self, name: str, msg: Message) -> None:
        asyncio.get_running_loop().create_task(self.sup.send(name, msg))

    # -- the verbs ----------------------------------------------------------------------------------------

    def rollout(
        self,
        requests: Sequence[GenerateRequest],
        *,
        expected_tokens: Callable[[GenerateRequest], float] | None = None,
        on_iteration: Callable[[str, IterationStats], None] | None = None,
    ) -> RolloutStep:
        """The step's handle: iterating it deals whole groups (the least loaded rollout first, by
        `expected_tokens`) and yields every completion once; `finish()` then settles the leases.
        `on_iteration`: each of the step's IterationStats as it arrives (bench rollout's figures)."""
        return RolloutStep(self, requests, expected_tokens, on_iteration)

    def begin(self, step: RolloutStep) -> None:
        """`step` starts dealing: untagged reports (IterationStats, DrafterStats, Idle) are its from now."""
        self._step = step
        self.leases.begin_step()
        self.log_inbound()

    def log_inbound(self) -> None:
        """Logs what reached the coordinator since the last call, by kind (an `inbound` event: messages,
        bytes): called as each step begins, so an event holds the previous step's whole cycle, and at the
        run's end."""
        kinds = self.sup.traffic.take()
        if kinds:
            self.emit(
                "inbound",
                messages=sum(n for n, _ in kinds.values()),
                bytes=sum(b for _, b in kinds.values()),
                kinds=kinds,
            )

    async def score(self, request: ScoreRequest) -> None:
        """Sends one completion to the verifier with the fewest outstanding requests; its `Reward` comes
        back through `reward()` (a reward may fail: `Reward.reward` None, never a silent 0)."""
        if not self.verifiers:
            raise ValueError("no verifier actors to score with")
        key = (request.group_id, request.sample_index)
        held = {name: 0 for name in self.verifiers if name not in self.dead}
        for holder in self.scores.holder.values():
            if holder in held:
                held[holder] += 1
        target = min(held or dict.fromkeys(self.verifiers, 0), key=lambda name: (held.get(name, 0), name))
        self.scores.deal(target, [key])
        self.score_requests[key] = request
        await self.sup.send(target, request)

    async def reward(self) -> Reward:
        """The next reward to arrive, once per (group, sample). A verifier that died holding requests is
        restarted (with `restart`) and they are sent again: a reward is never lost, never counted twice."""
        while True:
            while self._rewards.empty():
                for name in [v for v in self.verifiers if v in self.dead]:
                    self.metrics.requeued += await recovery.recover_verifier(self, name)
                if self._rewards.empty():
                    await self.changed()
            reward = self._rewards.get_nowait()
            key = (reward.group_id, reward.sample_index)
            if self.scores.take(key):
                self.score_requests.pop(key, None)
                return reward
            self.metrics.duplicates += 1
            self.emit(
                "duplicate_dropped", group_id=key[0], sample_index=key[1], what="reward", level="warning"
            )

    async def train(self, step: int, asks: dict[str, TrainStep]) -> list[StepStats]:
        """Asks each learner rank for its `TrainStep` of `step` (its groups, which it holds: their samples
        came to it from the rollouts) and waits for every rank's stats. Pushing the result is
        `push_weights`', saving it `save_checkpoint`'s."""
        if not self.learners:
            raise ValueError("no learner actors to train with")
        for rank in self.learners:
            await self.sup.send(rank, asks[rank])
        # No fixed deadline: a step takes what its batch takes. A rank that stops making progress is killed
        # by its hang deadline (the supervisor) and this wait raises ActorDiedError naming it.
        await self.wait_until(
            lambda: len(self._stats[step]) == len(self.learners), self.learners, "learner stats"
        )
        stats = self._stats.pop(step)
        return [stats[name] for name in self.learners]

    async def settle_scores(self) -> None:
        """Waits for every reward still owed and drops them (a step given up after its learner died: its
        samples are rolled out again, scored again), then starts the ledger afresh."""
        while self.scores.outstanding:
            await self.reward()
        self.scores = Ledger()

    def forget_stats(self) -> None:
        """The learner ranks were restarted: the stats of a step in flight died with them."""
        self._stats.clear()

    async def save_checkpoint(self, step: int, path: str, *, drafters: Sequence[str] = ()) -> None:
        """The learner's rank 0 saves the policy and optimizer after step `step` to `path`, and each drafter in
        `drafters` (the owner) its own; returns once the learner's file is on disk (drafters are not waited
        on: they change speed, never samples). Raises ActorDiedError if the learner dies, RuntimeError if it
        could not save (its error: a full disk)."""
        if not self.learners:
            raise ValueError("no learner actors to checkpoint")
        self._saved.pop(step, None)
        for learner in self.learners:  # sharded ranks each write their shards; rank 0 answers
            await self.sup.send(learner, SaveCheckpoint(step=step, path=path))
        for drafter in drafters:
            if drafter not in self.dead:
                await self.sup.send(drafter, SaveCheckpoint(step=step))
        await self.wait_until(lambda: step in self._saved, self.learners, f"checkpoint of step {step}")
        if error := self._saved.pop(step):
            raise RuntimeError(f"{self.learners[0]} could not save checkpoint {step} to {path}: {error}")

    async def push_weights(
        self,
        version: int,
        *,
        to: Sequence[str],
        head_to: Sequence[str] = (),
        deltas: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        """The line where weights are pushed: the learner's rank 0 sends its policy, version `version`, to
        `to` (and the head parts alone to `head_to`); returns when every actor in `to` acknowledged it.
        With `deltas`, a cross-host destination gets XOR deltas against the version it acked; one that
        refuses (it lost that base) is sent the version in full. A rollout that dies meanwhile is restarted
        (with `restart`) and sent `version` alone."""
        if not self.learners:
            raise ValueError("no learner actors to push weights from")
        # What each destination holds: the base the learner may send a delta against (a stale entry, say of
        # a restarted actor whose death is not seen yet, is refused by it and answered in full).
        bases = {d: self._holds[d] for d in [*to, *head_to] if d in self._holds} if deltas else {}
        push = PushWeights(version=version, to=list(to), head_to=list(head_to), delta_base=bases)
        for learner in self.learners:  # sharded ranks gather each bucket with rank 0, which sends it
            await self.sup.send(learner, push)
        await self._applied(version, list(to), timeout_s, full=not deltas)

    async def weights_applied(
        self, version: int, *, heads: Sequence[str] = (), timeout_s: float | None = None
    ) -> None:
        """Waits until every rollout acknowledged `version` (raises if one refused it), then `heads_applied`
        for `heads`; as `push_weights` does, a dead rollout is revived and a refused delta sent in full.
        Then the rollouts hold `version`: it is the run's `policy_version`."""
        await self._applied(version, list(self.rollouts), timeout_s)
        self.policy_version = version
        if heads:
            await self.heads_applied(version, heads, timeout_s=timeout_s)

    async def _applied(
        self, version: int, names: list[str], timeout_s: float | None, full: bool = False
    ) -> None:
        """Until each of `names` acknowledged `version`; see `push_weights`. `full`: what they were sent was
        full buckets, so a refusal for want of a base is a bug (raised, not answered with another push)."""
        pending = list(names)
        while True:
            try:
                wanted = await self._wait_acks(version, pending, timeout_s)
                if wanted and full:
                    raise RuntimeError(f"{wanted[0]} answered the full push of v{version} with want_full")
                if wanted:
                    self.emit("delta_refused", actors=wanted, version=version, level="warning")
                    await self.push_weights(version, to=wanted, timeout_s=timeout_s)
                return
            except ActorDiedError:
                dead = [r for r in pending if r in self.dead]
                if full or not dead or not self.restart:  # a full push's caller recovers (revive_rollout)
                    raise
                for name in dead:
                    await recovery.revive_rollout(self, name, f"acks of weights v{version}", version)
                    pending.remove(name)

    async def heads_applied(
        self, version: int, heads: Sequence[str], *, timeout_s: float | None = None
    ) -> None:
        """Waits until every live drafter in `heads` answered the head push of `version` (a refused head is
        logged: drafters change speed, not samples), or the learner that pushes it died (its recovery pushes
        again). The sync waits for it, so that no process copies weights during a rollout."""
        answers = self._head_acks[version]
        learner = self.learners[0] if self.learners else None
        await self.wait_until(
            lambda: (
                learner in self.dead
                or all(d in answers or d in self.dead or self._holds.get(d, -1) >= version for d in heads)
            ),
            [],
            f"head v{version}",
            timeout_s,
        )
        for drafter in heads:  # another waiter's answers stay
            if answers.pop(drafter, None) is False:
                self.emit("head_refused", actor=drafter, version=version, level="warning")
        if not answers:
            self._head_acks.pop(version, None)

    async def _wait_acks(self, version: int, names: list[str], timeout_s: float | None) -> list[str]:
        """Waits until each of `names` answered `version`; returns those that refused a delta (`want_full`)."""
        acks = self._acks[version]

        def done() -> bool:
            refused = [a for a in acks.values() if not a.ok and not a.want_full]
            if refused:
                raise RuntimeError(
                    f"{refused[0].role}:{refused[0].rank} refused weights v{version}: {refused[0].error}"
                )
            return all(name in acks or self._holds.get(name, -1) >= version for name in names)

        await self.wait_until(done, [*names, *self.learners[:1]], f"acks of weights v{version}", timeout_s)
        wanted = [name for name in names if (ack := acks.get(name)) is not None and ack.want_full]
        for name in names:
            acks.pop(name, None)
        if not acks:
            del self._acks[version]
        return wanted

    # -- waiting ----------------------------------------------------------------------------------------

    async def changed(self, timeout_s: float | None = None) -> None:
        """Until the next routed message or death (TimeoutError past `timeout_s`). Check, then call this,
        with no await between: nothing routed in between is missed."""
        self._changed.clear()
        await asyncio.wait_for(self._changed.wait(), timeout=timeout_s)

    async def wait_until(
        self, ready: Callable[[], bool], peers: Sequence[str], what: str, timeout_s: float | None = None
    ) -> None:
        """Waits until `ready()`; raises ActorDiedError as soon as one of `peers` is dead, RequestFailedError
        when one answered `Failed`, TimeoutError past `timeout_s` (None: no deadline, the peers' hang
        deadlines bound the wait)."""
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else math.inf)
        while not ready():
            self._raise_if_lost(peers, what)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {what} within {timeout_s} s")
            try:
                await self.changed(timeout_s=min(left, 1.0))
            except TimeoutError:
                continue

    def _raise_if_lost(self, peers: Sequence[str], what: str) -> None:
        for name in peers:
            if name in self.dead:
                raise ActorDiedError(
                    f"{name} died while the coordinator waited for {what}: {self.dead[name]}"
                )
            if name in self.failed:
                raise RequestFailedError(
                    f"{name} failed while the coordinator waited for {what}: {self.failed.pop(name)}"
                )

    def emit(self, event: str, level: str = "info", **fields: Any) -> None:
        if self.log is not None:
            getattr(self.log, level)(event, **fields)
