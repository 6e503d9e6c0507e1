"""What a generator is asked and answers: `Request`, `Completion`, `StepOutput`, and `run_requests`, the loop
that drives a `Generator` (generator.py) over a list of requests.

Kept apart from the generator so that code which only carries completions (the drafter's buffer, the
rollout's messages) does not import the engine's scheduler. generator.py re-exports all four.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor

from slipstream.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from slipstream.engine.generator import Generator

__all__ = ["Completion", "Request", "StepOutput", "run_requests"]


@dataclass(frozen=True, kw_only=True)
class Request:
    """One prompt to complete."""

    request_id: str
    prompt_ids: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    group_id: str | None = None
    """GRPO group (siblings sampled from the same prompt); carried through to the completion."""
    pause_on_stop: bool = False
    """A multi-turn episode's: a stop id ends the turn, not the request, and so does its budget (it pauses,
    as `Generator.pause` does: the environment answers, then `resume` or `finish`)."""


@dataclass(frozen=True, kw_only=True)
class Completion:
    """A finished request."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    """Log-prob of each sampled token under the processed sampling distribution (0 for greedy)."""
    finish_reason: str
    """"stop" or "length"."""
    group_id: str | None = None
    hidden: Tensor | None = None
    """[len(token_ids), hidden] last-layer pre-norm state at the position that sampled each token (CPU)."""
    target_passes: int = 0
    """Target forward passes (decode or verify) that produced its tokens; len(token_ids) / target_passes
    is the request's mean accept length (1 without speculation)."""
    drafted: int = 0
    """Draft tokens sent to verification for this request."""
    accepted: int = 0
    """Draft tokens accepted and emitted."""
    policy_mask: list[bool] | None = None
    """Per token of `token_ids`: sampled by the policy (True) or the environment's (False, log-prob 0, no
    hidden row: `hidden` then holds the policy's tokens' rows only); None for a single turn (all True)."""


@dataclass(frozen=True, kw_only=True)
class StepOutput:
    """What one iteration produced for one request."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    completion: Completion | None = None
    """Set when the request finished in this iteration."""
    paused: bool = False
    """A `pause_on_stop` request stopped (`finish_reason`: "stop", a stop id, its last token; "length", its
    max_tokens or max_len): it is paused, for its caller to end the turn or the request (`finish`)."""


def run_requests(
    generator: Generator,
    requests: Sequence[Request],
    *,
    on_done: Callable[[int, Completion], None] | None = None,
    on_tokens: Callable[[int], None] | None = None,
) -> list[Completion]:
    """Drive `generator` over `requests`; completions in request order.

    `on_done(i, completion)` is called in request order, as soon as request i and all before it are done;
    `on_tokens(n)` after each iteration with the tokens it produced (for progress).
    """
    for request in requests:  # all added first: a bad prompt fails before anything is produced
        generator.add(request)
    index = {r.request_id: i for i, r in enumerate(requests)}
    done: dict[int, Completion] = {}
    next_out = 0
    while generator.has_unfinished():
        outputs = generator.step()
        if on_tokens is not None:
            on_tokens(sum(len(o.token_ids) for o in outputs))
        for output in outputs:
            if output.completion is not None:
                done[index[output.request_id]] = output.completion
        while next_out in done:
            if on_done is not None:
                on_done(next_out, done[next_out])
            next_out += 1
    return [done[i] for i in range(len(requests))]
