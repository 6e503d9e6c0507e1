"""One RL step's rollout: its handle (`RolloutStep`, what `Coordinator.rollout` returns) and its metrics.

The handle owns the step's state: the requests, the ledger of what was dealt to whom and what came back
(each (group, sample) taken once), the completions routed to it, and its `StepMetrics`, which the
coordinator fills from IterationStats, leases and DrafterStats. Iterating it deals the groups (the least
loaded rollout first, by expected work) and yields each completion as it arrives; `finish()` waits until
every drafter lease is released and every rollout is idle. A rollout, drafter, verifier or environment
actor that dies meanwhile is recovered (rl/recovery.py); a learner rank that holds the step's samples
ends the step (ActorDiedError): the loop recovers it and rolls the step out again. `rollout_step` is the whole half-step, shared by
`slipstream train` and `bench rollout`: train sends each completion to a verifier at once (rewards overlap
the tail).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from slipstream.engine.history import prompt_key
from slipstream.protocols.learner import SampleReceipt
from slipstream.protocols.reward import CallTotals
from slipstream.protocols.rollout import Completion, GenerateRequest, IterationStats
from slipstream.rl import recovery
from slipstream.rl.ledger import Ledger
from slipstream.rl.recovery import ActorDiedError

if TYPE_CHECKING:
    from slipstream.rl.coordinator import Coordinator

__all__ = [
    "BATCH_BUCKETS",
    "Arrival",
    "RolloutStep",
    "StepMetrics",
    "arm_cells",
    "batch_bucket",
    "deal_plan",
    "pool_arm_tables",
    "rollout_step",
]

T = TypeVar("T")

Arrival = Completion | SampleReceipt
"""What comes back of a sample: the learner's receipt (it holds the sample), or where a request names no
learner (`bench rollout`) the completion itself."""


def length(arrival: Arrival) -> int:
    """The response's tokens."""
    return arrival.tokens if isinstance(arrival, SampleReceipt) else len(arrival.token_ids)


@dataclass
class StepMetrics:
    """What one RL step's rollout did, reduced from IterationStats, leases and DrafterStats."""

    rollout_s: float = 0.0
    tokens: int = 0
    accepted: int = 0  # draft tokens accepted over the step's decode iterations
    sequence_iterations: int = 0  # sum of batch sizes over decode iterations
    iterations: int = 0
    arms: dict[str, int] = field(default_factory=dict)
    idle_device_s: float = 0.0
    reclaimed_s: float = 0.0
    preempt_ms: list[float] = field(default_factory=list)
    finish_reasons: dict[str, int] = field(default_factory=dict)
    # batch-size bucket ("1", "2", "3-4", "5-8", ...) -> [sequence-iterations, accepted draft tokens] over the
    # iterations that speculated (any arm but "off"): what a drafter buys where it is used
    speculated: dict[str, list[int]] = field(default_factory=dict)
    # batch-size bucket -> arm -> decode iterations: what the tuner chose where
    arms_by_batch: dict[str, dict[str, int]] = field(default_factory=dict)
    # batch-size bucket -> [decode device-seconds, committed tokens], summed over rollouts: where the
    # rollout's time went by batch size (the long tail is the small buckets), speculating or not
    decode_by_batch: dict[str, list[float]] = field(default_factory=dict)
    # per draft depth: [sequence-passes whose draft reached it, of those accepted there]
    positions: list[list[int]] = field(default_factory=list)
    # the drafters' newest training loss as reported in the step (owner rank's last step), None if none trained
    drafter_loss: float | None = None
    committed: int = 0  # tokens committed by decode iterations
    speculated_committed: int = 0  # of those, by iterations that speculated (any arm but "off")
    requeued: int = 0  # samples and score requests dealt again after their actor died
    duplicates: int = 0  # completions and rewards dropped: their (group, sample) had come back already
    # reward term -> [calls, samples, seconds, largest call, invalid], summed over the verifiers' RewardCalls
    reward_calls: dict[str, list[float]] = field(default_factory=dict)
    # arm -> batch-size bucket -> [iterations, sequence-iterations, accepted, drafted, committed, seconds,
    # drafting seconds]: what each arm bought and cost where the tuner ran it
    by_arm: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    @property
    def accept_length(self) -> float:
        """Tokens per decoding sequence per target pass: 1 + accepted draft tokens per sequence-iteration
        (exactly 1.0 without speculation; counting committed tokens would include first tokens born of prefill)."""
        return 1.0 + self.accepted / self.sequence_iterations if self.sequence_iterations else 0.0

    def add_iteration(
        self,
        batch_size: int,
        arm: str,
        accepted: int,
        offered_at: Sequence[int] = (),
        accepted_at: Sequence[int] = (),
        iter_s: float = 0.0,
        committed: int = 0,
        drafted: int = 0,
        draft_s: float = 0.0,
    ) -> None:
        """One decode iteration's IterationStats (a prefill-only pass, batch 0, says nothing here)."""
        if batch_size <= 0:
            return
        cell = self.by_arm.setdefault(arm, {}).setdefault(batch_bucket(batch_size), [0, 0, 0, 0, 0, 0.0, 0.0])
        for i, value in enumerate((1, batch_size, accepted, drafted, committed, iter_s, draft_s)):
            cell[i] += value
        self.iterations += 1
        self.accepted += accepted
        self.sequence_iterations += batch_size
        self.arms[arm] = self.arms.get(arm, 0) + 1
        bucket = batch_bucket(batch_size)
        arms = self.arms_by_batch.setdefault(bucket, {})
        arms[arm] = arms.get(arm, 0) + 1
        spent = self.decode_by_batch.setdefault(bucket, [0.0, 0])
        spent[0] += iter_s
        spent[1] += committed
        self.committed += committed
        if arm != "off":
            cell = self.speculated.setdefault(bucket, [0, 0])
            cell[0] += batch_size
            cell[1] += accepted
            self.speculated_committed += committed
        for depth, (offered, took) in enumerate(zip(offered_at, accepted_at, strict=False)):
            if depth == len(self.positions):
                self.positions.append([0, 0])
            self.positions[depth][0] += offered
            self.positions[depth][1] += took

    def add_reward_calls(self, terms: Mapping[str, CallTotals]) -> None:
        """One verifier's `RewardCalls`: its reward calls since its last, per term."""
        for name, t in terms.items():
            cell = self.reward_calls.setdefault(name, [0, 0, 0.0, 0, 0])
            cell[0] += t.calls
            cell[1] += t.samples
            cell[2] += t.seconds
            cell[3] = max(cell[3], t.max_batch)
            cell[4] += t.invalid

    @property
    def reward_call_s(self) -> float:
        """Seconds the step's reward calls took, summed over terms and workers (calls in parallel add up)."""
        return sum(cell[2] for cell in self.reward_calls.values())

    def reward_terms(self) -> dict[str, dict[str, float]]:
        """Per reward term: calls, samples, seconds, batch_mean, batch_max (samples per call) and invalid."""
        return {
            name: {
                "calls": int(calls), "samples": int(samples), "seconds": round(seconds, 4),
                "batch_mean": round(samples / calls, 2) if calls else 0.0, "batch_max": int(top),
                "invalid": int(invalid),
            }
            for name, (calls, samples, seconds, top, invalid) in sorted(self.reward_calls.items())
        }  # fmt: skip

    def arm_table(self) -> dict[str, dict[str, dict[str, float]]]:
        """Per arm and batch-size bucket, `arm_cells`: what each arm bought and cost where it ran."""
        raw = {
            arm: {label: dict(zip(ARM_COUNTS, cell, strict=True)) for label, cell in _in_bucket_order(cells)}
            for arm, cells in sorted(self.by_arm.items())
        }
        return arm_cells(raw)

    def accept_by_position(self) -> list[float]:
        """Per draft depth: the share of sequence-passes whose draft reached it that accepted its token."""
        return [round(took / offered, 4) if offered else 0.0 for offered, took in self.positions]

    def decode_seconds_by_batch(self) -> dict[str, list[float]]:
        """Per batch-size bucket, in bucket order: [decode device-seconds, committed tokens]."""
        cells = _in_bucket_order(self.decode_by_batch)
        return {label: [round(seconds, 3), int(tokens)] for label, (seconds, tokens) in cells}

    @property
    def spec_accept_length(self) -> float:
        """Tokens per sequence per target pass over the iterations that speculated (0.0: none did): what
        the drafts bought where they were used, which `accept_length` dilutes with the plain iterations."""
        seqs = sum(cell[0] for cell in self.speculated.values())
        return 1.0 + sum(cell[1] for cell in self.speculated.values()) / seqs if seqs else 0.0

    @property
    def spec_token_share(self) -> float:
        """The share of decoded tokens that iterations which speculated committed."""
        return self.speculated_committed / self.committed if self.committed else 0.0

    def speculated_accept_length(self) -> dict[str, float]:
        """Per batch-size bucket: tokens per sequence per target pass over the iterations that speculated."""
        cells = _in_bucket_order(self.speculated)
        return {label: round(1.0 + accepted / seqs, 3) for label, (seqs, accepted) in cells if seqs}


BATCH_BUCKETS = ("1", "2", "3-4", "5-8", "9-16", "17-32", "33+")
ARM_COUNTS = ("iterations", "sequences", "accepted", "drafted", "committed", "seconds", "draft_s")
"""What an arm table's cell counts: decode iterations, sequence-iterations, accepted and drafted tokens,
committed tokens, decode seconds and, of those, drafting seconds."""


def arm_cells(raw: Mapping[str, Mapping[str, Mapping[str, float]]]) -> dict[str, dict[str, dict[str, float]]]:
    """Arm -> bucket -> its counts (`ARM_COUNTS`) and what they say: accept_length (tokens per sequence per
    target pass), draft_ms_per_token (drafting time per drafted token), token_share (of every arm's
    committed tokens) and tokens_per_s (committed per decode second). Tables of several steps pool by
    summing their counts first."""
    total = sum(cell["committed"] for cells in raw.values() for cell in cells.values())
    out: dict[str, dict[str, dict[str, float]]] = {}
    for arm, cells in raw.items():
        out[arm] = {}
        for label, c in cells.items():
            counts = {k: round(float(c[k]), 4) for k in ARM_COUNTS}
            counts.update(
                accept_length=round(1.0 + c["accepted"] / c["sequences"], 3) if c["sequences"] else 0.0,
                draft_ms_per_token=round(1e3 * c["draft_s"] / c["drafted"], 4) if c["drafted"] else 0.0,
                token_share=round(c["committed"] / total, 4) if total else 0.0,
                tokens_per_s=round(c["committed"] / c["seconds"], 2) if c["seconds"] else 0.0,
            )
            out[arm][label] = counts
    return out


def pool_arm_tables(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """The `arm_table`s of several steps' records pooled: their counts summed, then read again."""
    sums: dict[str, dict[str, dict[str, float]]] = {}
    for record in records:
        for arm, buckets in (record.get("arm_table") or {}).items():
            for bucket, cell in buckets.items():
                into = sums.setdefault(arm, {}).setdefault(bucket, dict.fromkeys(ARM_COUNTS, 0.0))
                for key in ARM_COUNTS:
                    into[key] += cell.get(key, 0.0)
    return arm_cells(sums)


def deal_plan(
    requests: Sequence[GenerateRequest],
    rollouts: Sequence[str],
    cost: Callable[[GenerateRequest], float],
    homes: Mapping[int, str],
) -> dict[int, str]:
    """Group id -> the rollout it is dealt to: longest first to the least loaded (greedy LPT), except that a
    group goes to its home (`homes`: the rollout that decoded its prompt last, which holds the prompt's
    history) when that keeps the home within the plain deal's largest load. If the homes' plan ends above
    that load, the plain one is used: affinity never costs balance by the cost model."""
    order = sorted(requests, key=cost, reverse=True)

    def plan(use_homes: bool) -> tuple[dict[int, str], float]:
        load = dict.fromkeys(rollouts, 0.0)
        out: dict[int, str] = {}
        for request in order:
            c = cost(request)
            home = homes.get(request.group_id, "") if use_homes else ""
            if home in load and load[home] + c <= bound:
                target = home
            else:
                target = min(load, key=lambda name: (load[name], name))
            load[target] += c
            out[request.group_id] = target
        return out, max(load.values(), default=0.0)

    bound = float("inf")
    plain, bound = plan(use_homes=False)
    if not any(homes.get(r.group_id, "") in rollouts for r in requests):
        return plain
    near, top = plan(use_homes=True)
    return near if top <= bound else plain


def _in_bucket_order(cells: dict[str, T]) -> list[tuple[str, T]]:
    """A per-bucket map's items, smallest batch sizes first (unknown labels last)."""
    order = {label: i for i, label in enumerate(BATCH_BUCKETS)}
    return sorted(cells.items(), key=lambda kv: order.get(kv[0], len(order)))


def batch_bucket(batch_size: int) -> str:
    """The label of `batch_size`'s bucket in `BATCH_BUCKETS` (powers of two: where speculation pays moves
    with the batch, so a step's acceptance is reported per bucket)."""
    edges = (1, 2, 4, 8, 16, 32)
    for label, top in zip(BATCH_BUCKETS, edges, strict=False):
        if batch_size <= top:
            return label
    return BATCH_BUCKETS[-1]


class RolloutStep:
    """One step's rollout; see the module docstring. Iterate it (once), then `finish()`."""

    def __init__(
        self,
        coord: Coordinator,
        requests: Sequence[GenerateRequest],
        expected_tokens: Callable[[GenerateRequest], float] | None = None,
        on_iteration: Callable[[str, IterationStats], None] | None = None,
    ) -> None:
        self.coord = coord
        self.on_iteration = on_iteration
        self.requests = {request.group_id: request for request in requests}  # group id -> its request
        self.cost = expected_tokens or (lambda r: float(r.num_samples * r.sampling.max_tokens))
        self.ledger = Ledger()
        self.metrics = StepMetrics()
        self.completions: asyncio.Queue[Arrival] = asyncio.Queue()  # bounded by what was dealt
        # The learner ranks that hold the step's samples: one that dies loses them, and the step with them.
        self.learners = sorted({r.learn_at for r in requests if r.learn_at})
        self.started = 0.0
        self.decoding = False  # until the last completion is in: idle devices are lent meanwhile
        # The step's try (its requests'): a step given up when its learner died is rolled out again as the
        # next try, and a sample of an earlier try that comes back meanwhile is not this one's.
        self.attempt = max((r.attempt for r in requests), default=0)
        self._stream_of: AsyncIterator[Arrival] | None = None

    def __aiter__(self) -> RolloutStep:
        return self

    async def __anext__(self) -> Arrival:
        if self._stream_of is None:  # the first call deals
            self._stream_of = self._stream()
        return await anext(self._stream_of)

    async def _deal(self) -> None:
        """Whole groups to the rollout actors (`deal_plan`: balanced, each prompt where it was decoded last)."""
        coord = self.coord
        keys = {g: prompt_key(r.prompt_ids.tolist()) for g, r in self.requests.items()}
        plan = deal_plan(list(self.requests.values()), coord.rollouts, self.cost,
                         {g: coord.homes.get(k, "") for g, k in keys.items()})  # fmt: skip
        load = dict.fromkeys(coord.rollouts, 0.0)
        for group_id, target in plan.items():
            request = self.requests[group_id]
            load[target] += self.cost(request)
            coord.homes[keys[group_id]] = target
            self.ledger.deal(target, [(request.group_id, i) for i in range(request.num_samples)])
            await coord.sup.send(target, request)
        for name in [r for r, work in load.items() if work == 0]:
            # Dealt nothing (fewer groups than rollouts): idle from the start, and it never says Idle itself.
            coord.on_idle(name, self.started)

    async def _stream(self) -> AsyncIterator[Arrival]:
        coord, ledger, m = self.coord, self.ledger, self.metrics
        self.started, self.decoding = time.monotonic(), True
        coord.begin(self)
        await self._deal()
        expected = sum(request.num_samples for request in self.requests.values())
        received = 0
        try:
            while received < expected:
                while self.completions.empty():
                    if lost := [n for n in self.learners if n in coord.dead]:
                        raise ActorDiedError(
                            f"{lost[0]} died holding samples of the step: {coord.dead[lost[0]]}"
                        )
                    for name in [r for r in coord.rollouts if r in coord.dead]:
                        await recovery.recover_rollout(coord, name, self)
                    for name in [e for e in coord.environments if e in coord.dead]:
                        await recovery.recover_environment(coord, name)
                    if self.completions.empty():
                        await coord.changed()
                completion = self.completions.get_nowait()
                if completion.attempt != self.attempt:  # an earlier try's (its learner died): not counted
                    coord.emit("stale_dropped", group_id=completion.group_id, attempt=completion.attempt)
                    continue
                if not ledger.take((completion.group_id, completion.sample_index)):
                    coord.emit("duplicate_dropped", group_id=completion.group_id,
                               sample_index=completion.sample_index, what="completion", level="warning")  # fmt: skip
                    continue
                received += 1
                m.tokens += length(completion)
                reason = completion.finish_reason
                m.finish_reasons[reason] = m.finish_reasons.get(reason, 0) + 1
                if received == expected:
                    m.rollout_s = time.monotonic() - self.started
                    self.decoding = False
                    coord.preempt_all("rollout done")  # every idle device goes back to the rollouts
                yield completion
        finally:
            if self.decoding:  # given up (its learner died): the devices lent meanwhile go back
                coord.preempt_all("step given up")
            self.decoding = False
            m.requeued += ledger.requeued
            m.duplicates += ledger.duplicates

    async def finish(self, timeout_s: float = 60.0) -> StepMetrics:
        """Waits until every lease is released and every rollout has reported Idle, then returns the step's
        metrics (idle device-seconds and the share drafter training reclaimed). A drafter or rollout that
        has not settled `timeout_s` after the last completion is killed and handled as dead (restarted;
        drafters change speed, never samples), not waited on for ever."""
        coord, table = self.coord, self.coord.leases
        ended = self.started + self.metrics.rollout_s

        def unsettled() -> list[str]:
            return table.unsettled(r for r in coord.rollouts if r not in coord.dead)

        deadline = time.monotonic() + timeout_s
        while unsettled():
            for drafter in [d for d in table.drafters if d in coord.dead]:
                await recovery.recover_drafter(coord, drafter)
            for name in [e for e in coord.environments if e in coord.dead]:
                await recovery.recover_environment(coord, name)
            for rollout in [r for r in coord.rollouts if r in coord.dead]:
                # Its share was in (the rollout is over): back up with the current weights, and idle.
                await recovery.revive_rollout(coord, rollout, "leases released", coord.policy_version)
                coord.on_idle(rollout, ended)
            if time.monotonic() >= deadline:
                for name in unsettled():
                    if name not in coord.dead:
                        coord.emit("unsettled_killed", actor=name, after_s=timeout_s, level="error")
                        coord.sup.kill(name)
                deadline = time.monotonic() + timeout_s
            with contextlib.suppress(TimeoutError):
                await coord.changed(timeout_s=1.0)
        self._record_devices(ended)
        account = table.account(ended)
        m = self.metrics
        m.idle_device_s, m.reclaimed_s, m.preempt_ms = (
            account.idle_device_s,
            account.reclaimed_s,
            account.preempt_ms,
        )
        return m

    def _record_devices(self, ended: float) -> None:
        """The device tracks of the trace: each rollout's idle window, and whether it was lent."""
        table = self.coord.leases
        for rollout, idle_at in table.idle_at.items():
            if ended > idle_at:
                self.coord.spans.add(
                    "device_idle",
                    int(idle_at * 1e9),  # time.monotonic() seconds: the same clock as monotonic_ns
                    int((ended - idle_at) * 1e9),
                    self.coord.policy_version,
                    device=rollout,
                    lent_to=d if (d := table.drafter_of.get(rollout)) in table.trained_at_lease else None,
                )


async def rollout_step(
    coord: Any,
    requests: Sequence[GenerateRequest],
    on_completion: Callable[[Arrival], Awaitable[None]] | None = None,
    *,
    on_iteration: Callable[[str, IterationStats], None] | None = None,
) -> tuple[dict[tuple[int, int], Arrival], StepMetrics]:
    """Rolls `requests` out on `coord` (a `Coordinator`); see the module docstring."""
    completions: dict[tuple[int, int], Arrival] = {}
    step = coord.rollout(requests, on_iteration=on_iteration)
    async for completion in step:
        completions[(completion.group_id, completion.sample_index)] = completion
        if on_completion is not None:
            await on_completion(completion)
    metrics: StepMetrics = await step.finish()  # every lease released, every rollout idle
    return completions, metrics
