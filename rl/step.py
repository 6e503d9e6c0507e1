"""The rollout half of one synchronous RL step, shared by `slipstream train` and `bench rollout`.

`rollout_step` deals the step's requests through the coordinator, hands each completion to the caller the
moment it arrives (train sends it to a verifier at once, so rewards overlap the rollout's tail), then
waits until every drafter lease is released and every rollout is idle, and returns the completions by
(group, sample) with the step's metrics (`StepMetrics`, which the coordinator fills). Restarts, requeues
and duplicates are the coordinator's; what comes back here is each (group, sample) once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from slipstream.protocols.rollout import Completion, GenerateRequest

__all__ = ["BATCH_BUCKETS", "StepMetrics", "batch_bucket", "rollout_step"]

T = TypeVar("T")


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
    ) -> None:
        """One decode iteration's IterationStats (a prefill-only pass, batch 0, says nothing here)."""
        if batch_size <= 0:
            return
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


async def rollout_step(
    coord: Any,
    requests: Sequence[GenerateRequest],
    on_completion: Callable[[Completion], Awaitable[None]] | None = None,
) -> tuple[dict[tuple[int, int], Completion], StepMetrics]:
    """Rolls `requests` out on `coord` (a `Coordinator`); see the module docstring."""
    completions: dict[tuple[int, int], Completion] = {}
    async for completion in coord.rollout(requests):
        completions[(completion.group_id, completion.sample_index)] = completion
        if on_completion is not None:
            await on_completion(completion)
    metrics: StepMetrics = await coord.finish_step()  # every lease released, every rollout idle
    return completions, metrics
