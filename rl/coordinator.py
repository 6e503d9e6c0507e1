"""Coordinator mechanics: the one reader of the supervisor's inbox, and the RL step's building blocks.

A `Coordinator` runs one dispatcher task that takes every message and every death from the supervisor and
routes them by type: completions and rewards to the step that waits for them, weight acks, learner stats
and checkpoint answers to their waiters, Idle/Released/DrafterStats to the `LeaseTable` (rl/leases.py),
IterationStats to the step's metrics. Its verbs: `rollout` (deal, stream completions), `finish_step`,
`score`/`reward`, `train`, `push_weights`, `weights_applied`, `save_checkpoint`, `restart_learners`. The RL
loop (`rl/loop.py`) and `bench rollout` are its clients; it imports protocols/ and runtime/ only.

Non-obvious choices:
- Nothing is lost for lack of room: the supervisor's receive loop blocks on a full inbox (backpressure to
  the actors' IO threads, never a drop), and the queues here are bounded by what was dealt.
- Exactly once: each `rollout()` owns its step's state (`_Rollout`: a `Ledger` keyed (group, sample), the
  requests, the metrics); a result whose key is back already is dropped and counted. With `restart`, a dead
  rollout, verifier or drafter is restarted by the supervisor (within its budget), a rollout is handed the
  current weights first, and each is dealt again what it owed; otherwise a death raises `ActorDiedError`.
- No fixed deadline on a learner step, a weight sync or a checkpoint: a wait ends when its peers answer
  (a failure too) or die; a hung peer is killed by its hang deadline (the supervisor). A step's end has
  one: a drafter or rollout that does not settle within `finish_step`'s timeout is killed and restarted.
- Leases: a rollout that reports Idle while others still decode lends its device to its drafter at once;
  the last completion of the step preempts every lease (bounded latency, measured from `Released`).
- Weight deltas: `train` tells the learner the version each destination last acked (`delta_base`); a
  rollout on another host then gets XOR deltas against it. One that refuses a delta (`want_full`: it lost
  that base) is sent the version in full by `weights_applied`; a drafter's refused head heals at the next
  push (its ack is missing, so that push is full).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from slipstream.protocols.base import Message
from slipstream.protocols.control import Idle, Released, SaveCheckpoint, Status
from slipstream.protocols.drafter import DrafterStats
from slipstream.protocols.learner import PushWeights, ScoredGroup, StepStats, TrainStep, WeightAck
from slipstream.protocols.reward import Reward, ScoreRequest
from slipstream.protocols.rollout import Completion, GenerateRequest, IterationStats
from slipstream.rl.leases import LeaseTable
from slipstream.rl.ledger import Ledger
from slipstream.rl.step import StepMetrics
from slipstream.runtime.spans import NULL_RECORDER, SpanRecorder


class ActorDiedError(RuntimeError):
    """An actor the coordinator was waiting on died; the message names it and why."""


@dataclass
class _Rollout:
    """The state of one step's rollout, replaced by each `rollout()`: what was dealt to whom and what came
    back (the ledger), the requests to deal again, its metrics, and whether it still decodes."""

    requests: dict[int, GenerateRequest] = field(default_factory=dict)  # group id -> its request
    ledger: Ledger = field(default_factory=Ledger)
    metrics: StepMetrics = field(default_factory=StepMetrics)
    started: float = 0.0
    decoding: bool = False


class Coordinator:
    """Routes every message of a started `Supervisor`; see the module docstring."""

    def __init__(
        self,
        sup: Any,
        *,
        rollouts: Sequence[str],
        drafters: dict[str, str] | None = None,
        lease_cpus: dict[str, list[int]] | None = None,
        verifiers: Sequence[str] = (),
        learners: Sequence[str] = (),
        lease_threads: int = 1,
        on_iteration: Callable[[str, IterationStats], None] | None = None,
        restart: bool = False,
        policy_version: int = 0,
        log: Any = None,
    ) -> None:
        self.sup = sup
        self.rollouts = list(rollouts)
        self.verifiers = list(verifiers)
        self.learners = list(learners)
        self.leases = LeaseTable(
            drafter_of=dict(drafters or {}), threads=lease_threads, cpus_of=dict(lease_cpus or {})
        )
        self.on_iteration = on_iteration
        self.log = log
        self.spans: SpanRecorder = NULL_RECORDER  # the step's phases and device windows (runtime/spans.py)
        self._drafter_steps: dict[str, int] = {}  # drafter -> training steps at its last DrafterStats
        self.dead: dict[str, str] = {}
        # Restart a dead rollout or verifier through the supervisor (its budget) and deal its work again;
        # off, a death ends the wait that sees it (ActorDiedError).
        self.restart = restart
        self.policy_version = policy_version  # the version every rollout holds (what a restarted one needs)
        self.restarted: list[str] = []  # every restart of the run, in order (a step reports its slice)
        self.recover_learners: Callable[[], Awaitable[None]] | None = None  # the loop: checkpoint, replay
        self._completions: asyncio.Queue[tuple[str, Completion]] = asyncio.Queue()
        self._rewards: asyncio.Queue[tuple[str, Reward]] = asyncio.Queue()
        self._scores = Ledger()  # score requests: which verifier holds which (group, sample)
        self._score_requests: dict[tuple[int, int], ScoreRequest] = {}
        self._acks: dict[int, dict[str, WeightAck]] = defaultdict(dict)
        self._head_acks: dict[int, dict[str, bool]] = defaultdict(dict)  # version -> drafter -> applied
        # Newest version each rollout (weights) or drafter (head) acked: a re-push of it gets no answer.
        self._holds: dict[str, int] = {}
        # Version -> what the learner's pushes of it moved across hosts ("full_bytes": as full buckets,
        # "wire_bytes": as sent), its "weights_pushed" and "head_pushed" reports summed: for the loop to record.
        self.pushed: dict[int, dict[str, int]] = defaultdict(dict)
        self._stats: dict[int, dict[str, StepStats]] = defaultdict(dict)
        self._saved: dict[int, str] = {}  # step -> "" once the learner's checkpoint is on disk, else why not
        self._changed = asyncio.Event()  # set on every routed message or death: waiters re-check
        self._step = _Rollout()  # the current (or last) step's rollout
        self._task: asyncio.Task[None] | None = None

    @property
    def metrics(self) -> StepMetrics:
        """The current (or last) step's metrics so far: `finish_step` completes them."""
        return self._step.metrics

    # -- lifecycle --------------------------------------------------------------------------------------

    async def __aenter__(self) -> Coordinator:
        self._task = asyncio.create_task(self._dispatch(), name="coordinator-dispatch")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _dispatch(self) -> None:
        sup = self.sup
        while True:
            inbox = asyncio.ensure_future(sup.inbox.get())
            death = asyncio.ensure_future(sup.deaths.get())
            done, _ = await asyncio.wait({inbox, death}, return_when=asyncio.FIRST_COMPLETED)
            for fut in (inbox, death):
                if fut not in done:
                    fut.cancel()
                    continue
                if fut is death:
                    died = fut.result()
                    self.dead[died.name] = died.reason
                    self._holds.pop(died.name, None)  # its successor holds what it loads
                    self._emit("actor_died", actor=died.name, reason=died.reason, level="error")
                else:
                    sender, msg = fut.result()
                    self._route(sender, msg)
            self._changed.set()

    def _route(self, sender: str, msg: Message) -> None:
        now = time.monotonic()
        if isinstance(msg, Completion):
            self._completions.put_nowait((sender, msg))  # unbounded here; bounded by what was requested
        elif isinstance(msg, Reward):
            self._rewards.put_nowait((sender, msg))
        elif isinstance(msg, WeightAck):
            self._acks[msg.version][sender] = msg
            if msg.ok:
                self._holds[sender] = max(self._holds.get(sender, 0), msg.version)
        elif isinstance(msg, StepStats):
            self._stats[msg.step][sender] = msg
        elif isinstance(msg, IterationStats):
            self._step.metrics.add_iteration(
                msg.batch_size,
                msg.arm,
                msg.accepted,
                msg.offered_at,
                msg.accepted_at,
                iter_s=msg.iter_s,
                committed=msg.committed,
            )
            if self.on_iteration is not None:
                self.on_iteration(sender, msg)
        elif isinstance(msg, Idle):
            self._on_idle(sender, now)
        elif isinstance(msg, Released):
            self._on_released(sender, msg)
        elif isinstance(msg, DrafterStats):
            self.leases.stats(sender, msg.elapsed_s)
            # Only a loss from steps trained since its last report is this step's (a drafter that did not
            # train repeats its last one).
            if msg.steps > self._drafter_steps.get(sender, 0) and math.isfinite(msg.loss):
                self._step.metrics.drafter_loss = msg.loss
            self._drafter_steps[sender] = msg.steps
        elif isinstance(msg, Status):
            if msg.topic in ("head_synced", "head_refused"):  # a drafter's answer to a head push
                version = int(msg.fields.get("version", -1))
                self._head_acks[version][sender] = msg.topic == "head_synced"
                if msg.topic == "head_synced":
                    self._holds[sender] = max(self._holds.get(sender, 0), version)
            elif msg.topic in ("checkpoint_saved", "checkpoint_failed"):  # the answers to save_checkpoint
                self._saved[int(msg.fields.get("step", -1))] = str(msg.fields.get("error", ""))
            elif msg.topic in ("weights_pushed", "head_pushed"):
                moved = self.pushed[int(msg.fields.get("version", -1))]
                for key in ("full_bytes", "wire_bytes"):
                    moved[key] = moved.get(key, 0) + int(msg.fields.get(key, 0))
            self._emit("status", sender=sender, topic=msg.topic, **msg.fields)
        else:
            self._emit("unrouted", sender=sender, kind=msg.kind, level="warning")

    # -- leases ---------------------------------------------------------------------------------------

    def _on_idle(self, rollout: str, now: float) -> None:
        # The line where an idle rollout device goes to drafter training (while others still decode).
        granted = self.leases.idle(rollout, now, grant=self._step.decoding, dead=self.dead)
        if granted is not None:
            self._send_soon(*granted)

    def _on_released(self, drafter: str, msg: Released) -> None:
        self.leases.released(drafter, msg.lease_id, msg.latency_ns / 1e6)

    def _preempt_all(self, reason: str) -> None:
        for drafter, preempt in self.leases.preempts(reason):
            self._send_soon(drafter, preempt)

    def _send_soon(self, name: str, msg: Message) -> None:
        asyncio.get_running_loop().create_task(self.sup.send(name, msg))

    # -- the step's building blocks ---------------------------------------------------------------------

    async def rollout(
        self,
        requests: Sequence[GenerateRequest],
        *,
        expected_tokens: Callable[[GenerateRequest], float] | None = None,
    ) -> AsyncIterator[Completion]:
        """Deals whole groups to the rollout actors (the least loaded first, by expected work), yields every
        completion as it arrives, once per (group, sample), and preempts all drafter leases when the last
        one is in. A rollout that dies meanwhile is restarted (with `restart`) and handed the current
        weights, then the samples it still owed: same seeds, so the same tokens in reproducible mode."""
        step = self._step = _Rollout(
            requests={request.group_id: request for request in requests},
            started=time.monotonic(),
            decoding=True,
        )
        self.leases.begin_step()
        started, ledger = step.started, step.ledger
        cost = expected_tokens or (lambda r: float(r.num_samples * r.sampling.max_tokens))
        load = dict.fromkeys(self.rollouts, 0.0)
        for request in sorted(requests, key=cost, reverse=True):  # longest first: a greedy balance
            target = min(load, key=lambda name: (load[name], name))
            load[target] += cost(request)
            ledger.deal(target, [(request.group_id, i) for i in range(request.num_samples)])
            await self.sup.send(target, request)
        expected = sum(request.num_samples for request in requests)
        for name in [r for r, work in load.items() if work == 0]:
            # Dealt nothing (fewer groups than rollouts): idle from the start, and it never says Idle itself.
            self._on_idle(name, started)
        received = 0
        try:
            while received < expected:
                while self._completions.empty():
                    for name in [r for r in self.rollouts if r in self.dead]:
                        await self._recover_rollout(name, step)
                    if self._completions.empty():
                        self._changed.clear()
                        await self._changed.wait()
                _, completion = self._completions.get_nowait()
                if not ledger.take((completion.group_id, completion.sample_index)):
                    self._emit("duplicate_dropped", group_id=completion.group_id,
                               sample_index=completion.sample_index, what="completion", level="warning")  # fmt: skip
                    continue
                received += 1
                m = step.metrics
                m.tokens += len(completion.token_ids)
                m.finish_reasons[completion.finish_reason] = (
                    m.finish_reasons.get(completion.finish_reason, 0) + 1
                )
                if received == expected:
                    ended = time.monotonic()
                    m.rollout_s = ended - started
                    step.decoding = False
                    self._preempt_all("rollout done")  # every idle device goes back to the rollouts
                yield completion
        finally:
            step.decoding = False
            step.metrics.requeued += ledger.requeued
            step.metrics.duplicates += ledger.duplicates

    async def _recover_rollout(self, name: str, step: _Rollout) -> None:
        """Restarts dead rollout `name`, gives it the current weights, and deals it what it owed."""
        # A fresh process holds the checkpoint's weights (version 0): it gets the current ones first.
        await self._revive_rollout(name, "a completion", self.policy_version)
        self.leases.busy(name)
        ledger = step.ledger
        owed: dict[int, list[int]] = defaultdict(list)
        for group, sample in ledger.held_by(name):
            owed[group].append(sample)
        for group, samples in sorted(owed.items()):
            ledger.deal(name, [(group, i) for i in samples], requeue=True)
            request = msgspec.structs.replace(step.requests[group], sample_indices=samples)
            await self.sup.send(name, request)
        self._emit("requeued", actor=name, samples=sum(len(v) for v in owed.values()), groups=len(owed))
        if not owed:  # it had finished its share before it died: idle, and it will not say so itself
            self._on_idle(name, time.monotonic())

    async def _restart(self, name: str, what: str) -> None:
        """Restarts dead actor `name` through the supervisor (its budget), or raises ActorDiedError."""
        reason = self.dead[name]
        if not self.restart:
            raise ActorDiedError(f"{name} died while the coordinator waited for {what}: {reason}")
        self._emit("restarting", actor=name, reason=reason, level="warning")
        try:
            await self.sup.restart(name)
        except Exception as exc:  # the budget is spent, or the restart failed: final, not another death
            raise RuntimeError(f"{name} died ({reason}) and was not restarted: {exc}") from exc
        del self.dead[name]
        self.restarted.append(name)

    async def _revive_rollout(self, name: str, what: str, version: int) -> None:
        """Restarts dead rollout `name` and hands it weights `version` (none for 0, what it loads); again if
        it dies meanwhile (the supervisor's budget bounds the tries)."""
        while True:
            try:
                if name in self.dead:
                    await self._restart(name, what)
                if version > 0:
                    await self.push_weights(version, to=[name])
                return
            except ActorDiedError:
                if not self.restart:
                    raise
                if any(n in self.dead for n in self.learners):
                    # The weights' source died too. The current policy can be rebuilt (the owner's
                    # `recover_learners`: its checkpoint, then a replay); a version being synced cannot
                    # (the caller retrains it).
                    if self.recover_learners is None or version != self.policy_version:
                        raise
                    await self.recover_learners()
                elif name not in self.dead:
                    raise

    async def finish_step(self, timeout_s: float = 60.0) -> StepMetrics:
        """After `rollout`: waits until every lease is released and every rollout has reported Idle, then
        returns the step's metrics (idle device-seconds and the share drafter training reclaimed). A drafter
        or rollout that has not settled `timeout_s` after the last completion is killed and handled as dead
        (restarted; drafters change speed, never samples), not waited on for ever."""
        table, step = self.leases, self._step
        ended = step.started + step.metrics.rollout_s

        def unsettled() -> list[str]:
            return table.unsettled(r for r in self.rollouts if r not in self.dead)

        deadline = time.monotonic() + timeout_s
        while unsettled():
            # A drafter that died is restarted (from its checkpoint) and handed the policy's head; its lease
            # is void. Drafters change speed, never samples: the step goes on meanwhile.
            for drafter in [d for d in table.drafters if d in self.dead]:
                await self._recover_drafter(drafter)
            for rollout in [r for r in self.rollouts if r in self.dead]:
                # Its share was in (the rollout is over): back up with the current weights, and idle.
                await self._revive_rollout(rollout, "leases released", self.policy_version)
                self._on_idle(rollout, ended)
            if time.monotonic() >= deadline:
                for name in unsettled():
                    if name not in self.dead:
                        self._emit("unsettled_killed", actor=name, after_s=timeout_s, level="error")
                        self.sup.kill(name)
                deadline = time.monotonic() + timeout_s
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=1.0)
        for rollout, idle_at in table.idle_at.items():  # the device tracks: idle, and lent or not
            if ended > idle_at:
                self.spans.add(
                    "device_idle",
                    int(idle_at * 1e9),  # time.monotonic() seconds: the same clock as monotonic_ns
                    int((ended - idle_at) * 1e9),
                    self.policy_version,
                    device=rollout,
                    lent_to=d if (d := table.drafter_of.get(rollout)) in table.trained_at_lease else None,
                )
        account = table.account(ended)
        m = step.metrics
        m.idle_device_s, m.reclaimed_s, m.preempt_ms = (
            account.idle_device_s,
            account.reclaimed_s,
            account.preempt_ms,
        )
        return m

    async def _recover_drafter(self, drafter: str) -> None:
        await self._restart(drafter, "leases released")
        self.leases.void(drafter)
        self._drafter_steps.pop(drafter, None)  # it counts again from its checkpoint's steps
        version = self.policy_version
        if version > 0 and self.learners:  # the restarted process loaded the step-0 head
            await self.sup.send(self.learners[0], PushWeights(version=version, to=[], head_to=[drafter]))
            # A learner that dies meanwhile is the train loop's to restart; the head then comes with the next push.
            await self.heads_applied(version, [drafter])

    async def restart_learners(self, configs: dict[str, msgspec.Struct]) -> None:
        """Restarts every learner rank with `configs` (e.g. the newest checkpoint to resume from). Ranks still
        alive are killed first: one lost rank breaks the process group, and the ranks rendezvous together."""
        if not self.restart:
            dead = [n for n in self.learners if n in self.dead]
            raise ActorDiedError(f"{dead[0]} died: {self.dead[dead[0]]}" if dead else "no learner died")
        for name in self.learners:
            if name not in self.dead:
                self.sup.kill(name)
        await self._until(
            lambda: all(n in self.dead for n in self.learners), [], "learner ranks to stop", 30.0
        )
        reasons = {n: self.dead[n] for n in self.learners}
        self._emit("restarting_learners", reasons=reasons, level="warning")
        try:
            await asyncio.gather(*(self.sup.restart(n, config=configs[n]) for n in self.learners))
        except Exception as exc:  # final: not an ActorDiedError, which a caller would answer with a restart
            raise RuntimeError(f"learner ranks died ({reasons}) and were not restarted: {exc}") from exc
        for name in self.learners:
            del self.dead[name]
        self._stats.clear()  # stats of the step in flight died with the ranks
        self.restarted.extend(self.learners)

    async def score(self, request: ScoreRequest) -> None:
        """Sends one completion to the verifier with the fewest outstanding requests; its `Reward` comes
        back through `reward()` (a reward may fail: `Reward.reward` None, never a silent 0)."""
        if not self.verifiers:
            raise ValueError("no verifier actors to score with")
        key = (request.group_id, request.sample_index)
        held = {name: 0 for name in self.verifiers if name not in self.dead}
        for holder in self._scores.holder.values():
            if holder in held:
                held[holder] += 1
        target = min(held or dict.fromkeys(self.verifiers, 0), key=lambda name: (held.get(name, 0), name))
        self._scores.deal(target, [key])
        self._score_requests[key] = request
        await self.sup.send(target, request)

    async def reward(self) -> Reward:
        """The next reward to arrive, once per (group, sample). A verifier that died holding requests is
        restarted (with `restart`) and they are sent again: a reward is never lost, never counted twice."""
        while True:
            while self._rewards.empty():
                for name in [v for v in self.verifiers if v in self.dead]:
                    await self._restart(name, "a reward")
                    owed = self._scores.held_by(name)
                    self._scores.deal(name, owed, requeue=True)
                    for key in owed:
                        await self.sup.send(name, self._score_requests[key])
                    self._step.metrics.requeued += len(owed)
                    self._emit("requeued", actor=name, scores=len(owed))
                if self._rewards.empty():
                    self._changed.clear()
                    await self._changed.wait()
            _, reward = self._rewards.get_nowait()
            key = (reward.group_id, reward.sample_index)
            if self._scores.take(key):
                self._score_requests.pop(key, None)
                return reward
            self._step.metrics.duplicates += 1
            self._emit(
                "duplicate_dropped", group_id=key[0], sample_index=key[1], what="reward", level="warning"
            )

    async def train(
        self,
        step: int,
        groups: Sequence[ScoredGroup],
        *,
        version: int,
        push_to: Sequence[str] = (),
        push_head_to: Sequence[str] = (),
    ) -> list[StepStats]:
        """Deals the groups over the learner ranks, asks each for one step, waits for every rank's stats.

        Rank 0 then pushes the policy to `push_to` and its embedding, final norm and LM head alone to
        `push_head_to` (drafters). Outside a step, `push_weights` is the verb; checkpoints are
        `save_checkpoint`'s, after the sync."""
        if not self.learners:
            raise ValueError("no learner actors to train with")
        shares: dict[str, int] = dict.fromkeys(self.learners, 0)
        for i, group in enumerate(groups):
            rank = self.learners[i % len(self.learners)]
            shares[rank] += 1
            await self.sup.send(rank, group)
        # What each destination holds: the base the learner may send a delta against (a stale entry, say of
        # a restarted actor whose death is not seen yet, is refused by it and answered in full).
        bases = {d: self._holds[d] for d in [*push_to, *push_head_to] if d in self._holds}
        for i, rank in enumerate(self.learners):
            lead = i == 0
            msg = TrainStep(
                step=step,
                num_groups=shares[rank],
                version=version,
                push_to=list(push_to) if lead else [],
                push_head_to=list(push_head_to) if lead else [],
                delta_base=bases if lead else {},
            )
            await self.sup.send(rank, msg)
        # No fixed deadline: a step takes what its batch takes. A rank that stops making progress is killed
        # by its hang deadline (the supervisor) and this wait raises ActorDiedError naming it.
        await self._until(
            lambda: len(self._stats[step]) == len(self.learners), self.learners, "learner stats"
        )
        stats = self._stats.pop(step)
        return [stats[name] for name in self.learners]

    async def save_checkpoint(self, step: int, path: str, *, drafters: Sequence[str] = ()) -> None:
        """The learner's rank 0 saves the policy and optimizer after step `step` to `path`, and each drafter in
        `drafters` (the owner) its own; returns once the learner's file is on disk (drafters are not waited
        on: they change speed, never samples). Raises ActorDiedError if the learner dies, RuntimeError if it
        could not save (its error: a full disk)."""
        if not self.learners:
            raise ValueError("no learner actors to checkpoint")
        self._saved.pop(step, None)
        await self.sup.send(self.learners[0], SaveCheckpoint(step=step, path=path))
        for drafter in drafters:
            if drafter not in self.dead:
                await self.sup.send(drafter, SaveCheckpoint(step=step))
        await self._until(lambda: step in self._saved, self.learners[:1], f"checkpoint of step {step}")
        if error := self._saved.pop(step):
            raise RuntimeError(f"{self.learners[0]} could not save checkpoint {step} to {path}: {error}")

    async def push_weights(
        self,
        version: int,
        *,
        to: Sequence[str],
        head_to: Sequence[str] = (),
        timeout_s: float | None = None,
    ) -> None:
        """The learner's rank 0 sends its policy, version `version`, to `to` (and the head parts to
        `head_to`) outside a step; returns when every actor in `to` has acknowledged it."""
        if not self.learners:
            raise ValueError("no learner actors to push weights from")
        await self.sup.send(
            self.learners[0], PushWeights(version=version, to=list(to), head_to=list(head_to))
        )
        if wanted := await self._wait_acks(version, list(to), timeout_s):  # never for full buckets: a bug
            raise RuntimeError(f"{wanted[0]} answered the full push of v{version} with want_full")

    async def weights_applied(
        self, version: int, *, heads: Sequence[str] = (), timeout_s: float | None = None
    ) -> None:
        """Waits until every rollout acknowledged `version` (raises if one refused it), then `heads_applied`
        for `heads`. A rollout that dies meanwhile is restarted (with `restart`) and sent `version` alone;
        one that refused a delta for want of its base is sent `version` in full."""
        pending = list(self.rollouts)
        while True:
            try:
                if wanted := await self._wait_acks(version, pending, timeout_s):
                    self._emit("delta_refused", actors=wanted, version=version, level="warning")
                    await self.push_weights(version, to=wanted, timeout_s=timeout_s)
                break
            except ActorDiedError:
                dead = [r for r in pending if r in self.dead]
                if not dead or not self.restart:
                    raise
                for name in dead:
                    await self._revive_rollout(name, f"acks of weights v{version}", version)  # acked
                    pending.remove(name)
        self.policy_version = version
        if heads:
            await self.heads_applied(version, heads, timeout_s=timeout_s)

    async def heads_applied(
        self, version: int, heads: Sequence[str], *, timeout_s: float | None = None
    ) -> None:
        """Waits until every live drafter in `heads` answered the head push of `version` (a refused head is
        logged: drafters change speed, not samples), or the learner that pushes it died (its recovery pushes
        again). `train` waits for it in the step's sync, so that no process copies weights during a rollout."""
        answers = self._head_acks[version]
        learner = self.learners[0] if self.learners else None
        await self._until(
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
                self._emit("head_refused", actor=drafter, version=version, level="warning")
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

        await self._until(done, [*names, *self.learners[:1]], f"acks of weights v{version}", timeout_s)
        wanted = [name for name in names if (ack := acks.get(name)) is not None and ack.want_full]
        for name in names:
            acks.pop(name, None)
        if not acks:
            del self._acks[version]
        return wanted

    # -- waiting ----------------------------------------------------------------------------------------

    async def _next(self, queue: asyncio.Queue[Any], peers: Sequence[str], what: str) -> Any:
        while queue.empty():
            self._raise_if_dead(peers, what)
            self._changed.clear()
            await self._changed.wait()
        return queue.get_nowait()

    async def _until(
        self, ready: Callable[[], bool], peers: Sequence[str], what: str, timeout_s: float | None = None
    ) -> None:
        """Waits until `ready()`; raises ActorDiedError as soon as one of `peers` is dead, TimeoutError past
        `timeout_s` (None: no deadline, the peers' hang deadlines bound the wait)."""
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else math.inf)
        while not ready():
            self._raise_if_dead(peers, what)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {what} within {timeout_s} s")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=min(left, 1.0))
            except TimeoutError:
                continue

    def _raise_if_dead(self, peers: Sequence[str], what: str) -> None:
        for name in peers:
            if name in self.dead:
                raise ActorDiedError(
                    f"{name} died while the coordinator waited for {what}: {self.dead[name]}"
                )

    def _emit(self, event: str, level: str = "info", **fields: Any) -> None:
        if self.log is not None:
            getattr(self.log, level)(event, **fields)


__all__ = ["ActorDiedError", "Coordinator", "LeaseTable", "StepMetrics"]  # LeaseTable: rl/leases.py
