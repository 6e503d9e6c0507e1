"""The rollout's request bookkeeping: which sample each request decodes, for whom, and what it becomes.

A request id ("group:sample") stands for one sample of one group, for one learner rank (`learn_at`; ""
when the coordinator takes completions) and one try of its step: a newer try supersedes an older one of
the same id. Its arrival is kept for its "sample" span (arrival to last token: the long-tail view's bar).
A finished request becomes a `Completion` (tokens, behaviour log-probs, accept length; its text for a
learner) and, for the drafters, `HiddenStates`: one per run of policy tokens, so a multi-turn episode's
environment tokens are never trained on. Sample i of a group samples with `sample_seed(seed, i)`.

Not an actor: the rollout's own part, beside it because it builds the rollout's messages (engine/ sees no
messages); the rollout sends them.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from slipstream.engine.buffer import completion_window
from slipstream.engine.episodes import policy_windows
from slipstream.engine.generator import Completion
from slipstream.engine.sampling import SamplingParams, sample_seed
from slipstream.protocols.drafter import HiddenStates
from slipstream.protocols.rollout import Completion as CompletionMsg
from slipstream.protocols.rollout import GenerateRequest, SamplingSpec


class Sample(NamedTuple):
    """What a request decodes: sample `index` of group `group_id`, for `learner`, in try `attempt`."""

    group_id: int
    index: int
    learner: str  # the learner rank that trains the group; "": completions go to the coordinator
    attempt: int  # the try of its step this request belongs to


class InFlight:
    """The requests this rollout holds (decoding, or an episode waiting for its environment)."""

    def __init__(self) -> None:
        self._samples: dict[str, Sample] = {}
        self._queued_ns: dict[str, int] = {}  # request id -> arrival (monotonic ns), for its "sample" span

    def add(self, request_id: str, sample: Sample) -> None:
        self._samples[request_id] = sample
        self._queued_ns[request_id] = time.monotonic_ns()

    def get(self, request_id: str) -> Sample | None:
        return self._samples.get(request_id)

    def pop(self, request_id: str) -> tuple[Sample, int | None]:
        """The request's sample and arrival, no longer held (KeyError if it was not)."""
        return self._samples.pop(request_id), self._queued_ns.pop(request_id, None)


def requested(msg: GenerateRequest) -> dict[str, Sample]:
    """The samples `msg` asks for, by request id: its group's all, or for a requeue after another rollout
    died, the missing ones alone (same seeds, same tokens)."""
    indices = msg.sample_indices or range(msg.num_samples)
    return {f"{msg.group_id}:{i}": Sample(msg.group_id, i, msg.learn_at, msg.attempt) for i in indices}


def sampling_params(sampling: SamplingSpec, seed: int, index: int) -> SamplingParams:
    """Sample `index`'s sampling: in reproducible mode its tokens depend on its seed alone."""
    return SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_tokens=sampling.max_tokens,
        stop_token_ids=tuple(sampling.stop_token_ids),
        seed=sample_seed(seed, index),
    )


def accept_length(completion: Completion) -> float:
    """Policy tokens per target pass (0 without a pass): what speculation bought this sample."""
    passes, mask = completion.target_passes, completion.policy_mask
    return (len(completion.token_ids) if mask is None else sum(mask)) / passes if passes else 0.0


def completion_msg(
    sample: Sample, tokens: list[int], logprobs: list[float], reason: str, accept: float, *,
    policy_version: int, text: str = "", mask: list[bool] | None = None, prompt_ids: list[int] | None = None,
    **episode: object,
) -> CompletionMsg:  # fmt: skip
    """The completion of `sample` (`episode`: turns, env_reward, error); `text` only for a learner."""
    return CompletionMsg(
        group_id=sample.group_id, sample_index=sample.index, token_ids=torch.tensor(tokens, dtype=torch.int64),
        logprobs=torch.tensor(logprobs, dtype=torch.float32), finish_reason=reason,  # type: ignore[arg-type]
        policy_version=policy_version, accept_length=accept,
        policy_mask=torch.tensor(mask or [], dtype=torch.bool),
        prompt_ids=torch.tensor(prompt_ids or [], dtype=torch.int64),
        **episode,  # type: ignore[arg-type]  # turns, env_reward, error
        text=text, attempt=sample.attempt,
    )  # fmt: skip


def hidden_states(
    completion: Completion, sample: Sample, dtype: torch.dtype, policy_version: int
) -> list[HiddenStates]:
    """The drafters' training data of a finished sample: a multi-turn completion's hidden rows are its
    policy tokens', one message per run of them; a single-turn one's, its response."""
    mask = completion.policy_mask
    windows = policy_windows(completion) if mask is not None else [completion_window(completion)]
    return [
        HiddenStates(
            group_id=sample.group_id,
            sample_index=sample.index,
            token_ids=token_ids,
            hidden=hidden.to(dtype),
            response_start=response_start,
            policy_version=policy_version,
        )
        for token_ids, hidden, response_start in [w for w in windows if w is not None]
    ]


__all__ = [
    "InFlight",
    "Sample",
    "accept_length",
    "completion_msg",
    "hidden_states",
    "requested",
    "sampling_params",
]
