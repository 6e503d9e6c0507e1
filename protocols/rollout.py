"""Rollout channel: generation requests in, completions and per-iteration statistics out.

Requests and completions carry their group id and the policy version that produced them (each sample
is recorded with its version, and the drafter's buffer takes the newest version's samples first).
`IterationStats` is a rollout's record of one decode iteration, which the coordinator reduces per step.
A multi-turn episode's completion (issue 42) holds every token after the opening — the policy's turns and
the environment's rendered answers — with `policy_mask` saying which the policy sampled; an answer's
tokens carry log-prob 0 and are never trained on. Decoding checks the lengths, dtypes and that zero.
It also carries the episode's turns and its seconds waiting for the environment (`env_wait_s`).
"""

import sys
from enum import StrEnum
from typing import Annotated, Literal

import msgspec
import torch

from slipstream.protocols.base import Message, NonNeg, NonNegF

FinishReason = Literal["stop", "length", "abort", "error"]
# NaN fails both bounds, so a non-finite reward cannot even be decoded.
Finite = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]


def _no_bool() -> torch.Tensor:
    return torch.empty(0, dtype=torch.bool)


def _no_ids() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


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
    # The dataset row as one JSON object (question, answer, metadata): non-empty, each sample is an episode of
    # the rollout's environment, which opens it (its first messages are the prompt: `prompt_ids` is unused).
    row_json: str = ""
    # The learner rank that trains this group: each Completion goes there, with its text (the learner
    # answers the coordinator a receipt); "": the Completion to the coordinator (`bench rollout`).
    learn_at: str = ""
    # The step's try: 0, then 1, … each time the step is rolled out again (its learner died with its samples);
    # a completion says its try, so a sample of an earlier one is told apart from the try's own.
    attempt: NonNeg = 0

    def __post_init__(self) -> None:
        bad = [i for i in self.sample_indices if i >= self.num_samples]
        if bad or len(set(self.sample_indices)) != len(self.sample_indices):
            raise ValueError(
                f"sample_indices {self.sample_indices} must be distinct and below num_samples {self.num_samples}"
            )


class Completion(Message, frozen=True, kw_only=True):
    """Rollout → its group's learner rank (or the coordinator): one finished response, streamed the moment
    it finishes."""

    kind = RolloutKind.COMPLETION
    group_id: NonNeg
    sample_index: NonNeg
    token_ids: torch.Tensor  # [response_len] int64
    logprobs: torch.Tensor  # [response_len] float32, under the sampling distribution
    finish_reason: FinishReason
    policy_version: NonNeg
    accept_length: float = 0.0  # mean tokens committed per target pass for this response
    # Per token: sampled by the policy (True) or an environment's answer (False: log-prob 0, never trained
    # on); empty: every token is the policy's (a single turn).
    policy_mask: torch.Tensor = msgspec.field(default_factory=_no_bool)  # [response_len] bool, or [0]
    prompt_ids: torch.Tensor = msgspec.field(
        default_factory=_no_ids
    )  # an episode's opening; [0]: the request's
    turns: NonNeg = 0  # policy turns of an episode (0: a single-turn request)
    # An episode's seconds waiting for its environment's answers: each turn sent to the answer, summed
    env_wait_s: NonNegF = 0.0
    env_reward: Finite | None = None  # the environment's reward at the episode's end (None: the run's reward)
    error: str | None = None  # why the sample is invalid (finish_reason "error"): masked, never scored 0
    text: str = ""  # the response decoded (special tokens skipped), when it goes to a learner: the reward's
    attempt: NonNeg = 0  # its request's try

    def __post_init__(self) -> None:
        ids, logp, mask = self.token_ids, self.logprobs, self.policy_mask
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError(f"token_ids must be 1-D int64, got {ids.dtype} {tuple(ids.shape)}")
        if logp.dtype != torch.float32 or logp.shape != ids.shape:
            raise ValueError(
                f"logprobs must be float32 {tuple(ids.shape)}, got {logp.dtype} {tuple(logp.shape)}"
            )
        if self.prompt_ids.dtype != torch.int64 or self.prompt_ids.dim() != 1:
            raise ValueError(f"prompt_ids must be 1-D int64, got {self.prompt_ids.dtype}")
        if mask.numel() == 0:
            return
        if mask.dtype != torch.bool or mask.shape != ids.shape:
            raise ValueError(
                f"policy_mask must be bool {tuple(ids.shape)} (one entry a token), got {mask.dtype} "
                f"{tuple(mask.shape)}"
            )
        if bool((logp[~mask] != 0).any()):
            raise ValueError("an environment's token (policy_mask False) carries a non-zero log-prob")


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
    draft_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0  # of iter_s, drafting (0: a plain iteration)


MESSAGES: tuple[type[Message], ...] = (SamplingSpec, GenerateRequest, Completion, IterationStats)

__all__ = [m.__name__ for m in MESSAGES] + ["MESSAGES", "FinishReason", "RolloutKind"]
