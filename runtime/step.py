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
from typing import Any

from slipstream.protocols.rollout import Completion, GenerateRequest

__all__ = ["StepMetrics", "rollout_step"]


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
    requeued: int = 0  # samples and score requests dealt again after their actor died
    duplicates: int = 0  # completions and rewards dropped: their (group, sample) had come back already

    @property
    def accept_length(self) -> float:
        """Tokens per decoding sequence per target pass: 1 + accepted draft tokens per sequence-iteration
        (exactly 1.0 without speculation; counting committed tokens would include first tokens born of prefill)."""
        return 1.0 + self.accepted / self.sequence_iterations if self.sequence_iterations else 0.0


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
