"""The rollout half of one synchronous RL step, shared by `slipstream train` and `bench rollout`.

`rollout_step` deals the step's requests through the coordinator, hands each completion to the caller the
moment it arrives (train sends it to a verifier at once, so rewards overlap the rollout's tail), then
waits until every drafter lease is released and every rollout is idle, and returns the completions by
(group, sample) with the step's metrics. Restarts, requeues and duplicates are the coordinator's; what
comes back here is each (group, sample) once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from slipstream.protocols.rollout import Completion, GenerateRequest
from slipstream.runtime.coordinator import StepMetrics

__all__ = ["rollout_step"]


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
