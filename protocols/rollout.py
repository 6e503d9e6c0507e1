"""Rollout channel: generation requests in, completions and per-iteration statistics out.

Requests and completions carry their group id and the policy version that produced them (each sample
is recorded with its version, and the drafter's buffer takes the newest version's samples first).
`IterationStats` is a rollout's record of one decode iteration, which the coordinator reduces per step.
"""

from enum import StrEnum
from typing import Annotated, Literal

import msgspec
import torch

from slipstream.protocols.base import Message, NonNeg

FinishReason = Literal["stop", "length", "abort", "error"]


class RolloutKind(StrEnum):
    SAMPLING = "rollout.sampling"
    GENERATE = "rollout.generate"
    COMPLETION = "rollout.completion"
    ITERATION = "rollout.iteration"


class SamplingSpec(Message, frozen=True, kw_only=True):
    """Sampling parameters as they travel (the engine validates them again on its side)."""

    kind = RolloutKind.SAMPLING
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: NonNeg = 0
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 256
    stop_token_ids: list[int] = []


class GenerateRequest(Message, frozen=True, kw_only=True):
    """Coordinator → rollout: decode `num_samples` responses for one prompt (one GRPO group)."""

    kind = RolloutKind.GENERATE
    group_id: NonNeg
    prompt_ids: torch.Tensor  # [prompt_len] int64
    num_samples: Annotated[int, msgspec.Meta(ge=1)]
    seed: int
    sampling: SamplingSpec
    policy_version: NonNeg
    # Which samples to decode (empty: all of 0 .. num_samples - 1). Sample i draws from sample_seed(seed, i)
    # whatever else is asked, so a requeue after a rollout died re-decodes the missing ones alone, the same.
    sample_indices: list[NonNeg] = []

    def __post_init__(self) -> None:
        bad = [i for i in self.sample_indices if i >= self.num_samples]
        if bad or len(set(self.sample_indices)) != len(self.sample_indices):
            raise ValueError(
                f"sample_indices {self.sample_indices} must be distinct and below num_samples {self.num_samples}"
            )


class Completion(Message, frozen=True, kw_only=True):
    """Rollout → verifier/coordinator: one finished response, streamed the moment it finishes."""

    kind = RolloutKind.COMPLETION
    group_id: NonNeg
    sample_index: NonNeg
    token_ids: torch.Tensor  # [response_len] int64
    logprobs: torch.Tensor  # [response_len] float32, under the sampling distribution
    finish_reason: FinishReason
    policy_version: NonNeg
    accept_length: float = 0.0  # mean tokens committed per target pass for this response


class IterationStats(Message, frozen=True, kw_only=True):
    """Rollout → coordinator, per decode iteration: what the tuner chose and what it bought."""

    kind = RolloutKind.ITERATION
    rank: NonNeg
    iteration: NonNeg
    batch_size: NonNeg
    arm: str
    drafted: NonNeg
    accepted: NonNeg
    committed: NonNeg
    iter_s: Annotated[float, msgspec.Meta(ge=0.0)]
    # Per draft depth (index 0 = the first draft token): sequences of this iteration whose draft reached it,
    # and those whose token there was accepted.
    offered_at: list[NonNeg] = []
    accepted_at: list[NonNeg] = []


MESSAGES: tuple[type[Message], ...] = (SamplingSpec, GenerateRequest, Completion, IterationStats)

__all__ = [m.__name__ for m in MESSAGES] + ["MESSAGES", "FinishReason", "RolloutKind"]
