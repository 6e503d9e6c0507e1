"""Reward channel: completions to score in, a reward or the reason there is none out.

Every `ScoreRequest` gets exactly one `Reward`. A reward function that raised, timed out or returned
something other than a finite number makes that one sample *invalid*: `reward` is None and `error`
says why, and the sample is masked out of its group's baseline and the loss — never scored 0. Row
fields travel as JSON text because dataset rows are arbitrary JSON. `RewardCalls` says what the reward
calls cost, per term (time, batch sizes), ahead of the Rewards they scored.
"""

import sys
from enum import StrEnum
from typing import Annotated

import msgspec

from slipstream.protocols.base import Message, NonNeg, NonNegF

# NaN fails both bounds, so a non-finite reward cannot even be decoded.
Finite = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]


class RewardKind(StrEnum):
    SCORE = "reward.score"
    REWARD = "reward.reward"
    CALLS = "reward.calls"


class ScoreRequest(Message, frozen=True, kw_only=True):
    """→ verifier: score one completion as `reward(prompt, completion, **row)`."""

    kind = RewardKind.SCORE
    group_id: NonNeg
    sample_index: NonNeg
    prompt: str  # the prompt as text
    completion: str  # the response as text
    row_json: str = "{}"  # the dataset row's fields (answer, metadata, …) as one JSON object
    policy_version: NonNeg


class Reward(Message, frozen=True, kw_only=True):
    """Verifier → coordinator: the reward, or None and the reason the sample is invalid."""

    kind = RewardKind.REWARD
    group_id: NonNeg
    sample_index: NonNeg
    reward: Finite | None  # None: invalid (masked out), never a silent 0
    error: str | None = None  # e.g. "raised: ZeroDivisionError: …", "timeout after 2.0 s"
    elapsed_s: NonNegF
    policy_version: NonNeg

    def __post_init__(self) -> None:
        if (self.reward is None) == (self.error is None):
            raise ValueError("a Reward carries either a reward or an error, exactly one of them")


class CallTotals(msgspec.Struct, frozen=True, kw_only=True, array_like=True, forbid_unknown_fields=True):
    """One reward term's calls over a window: a batched term's call scores a batch, any other's one sample."""

    calls: NonNeg
    samples: NonNeg  # the calls' sizes summed
    seconds: NonNegF  # their wall time summed (a call killed at its deadline counts up to its kill)
    max_batch: NonNeg  # the largest call
    invalid: NonNeg  # samples this term made invalid (raised, None, garbage, timed out, crashed)


class RewardCalls(Message, frozen=True, kw_only=True):
    """Verifier → coordinator: its reward calls since its previous RewardCalls, per term name.

    Sent before the Reward that empties the verifier's pool (and at least every second while it is busy),
    on the Rewards' channel, so the calls behind a step's rewards are in by the step's last Reward."""

    kind = RewardKind.CALLS
    terms: dict[str, CallTotals]


MESSAGES: tuple[type[Message], ...] = (ScoreRequest, Reward, RewardCalls)

__all__ = [m.__name__ for m in MESSAGES] + ["MESSAGES", "CallTotals", "RewardKind"]
