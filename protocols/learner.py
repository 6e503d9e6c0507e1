"""Learner channel: samples and a step's plan in, receipts, stats and versioned exact weight updates out.

Bulk data never crosses the coordinator: a rollout sends each `Completion` (tokens, log-probs, its text) to
the learner rank that trains its group (`GenerateRequest.learn_at`); the learner keeps it and answers the
coordinator a `SampleReceipt` (lengths, finish reason, version, the text to score). `TrainStep` then names
the rank's groups with their prompts and rewards (`GroupPlan`); the learner assembles the `ScoredGroup`s,
writes the step's samples record and trains.

A weight update is bucketed (a large model does not travel as one message) and every bucket carries
a checksum of its raw tensor bytes, which the receiver checks before applying anything. Across hosts a
bucket may travel as a delta against the version its receiver acknowledged (`encoding`: engine/weight_delta.py);
the checksum is still over the new tensors, checked after decoding. On one node's GPUs a bucket travels
as CUDA IPC refs instead (`CUDA_IPC`): receivers map the sender's memory and copy from it.
"""

from enum import StrEnum
from typing import Annotated

import msgspec
import torch

from slipstream.protocols.base import Message, NonNeg, NonNegF
from slipstream.protocols.rollout import FinishReason, Finite


class LearnerKind(StrEnum):
    RECEIPT = "learner.receipt"
    WEIGHTS = "learner.weights"
    WEIGHTS_ACK = "learner.weights_ack"
    STEP = "learner.step"
    TRAIN = "learner.train"
    PUSH = "learner.push"
    PUSHED = "learner.pushed"


class ScoredGroup(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One prompt's G responses with behaviour log-probs and rewards, as the learner assembles them from the
    samples it holds and a `GroupPlan`, and as the samples record keeps them (not a wire message)."""

    step: NonNeg
    group_id: NonNeg
    prompt_ids: torch.Tensor  # [prompt_len] int64
    response_ids: list[torch.Tensor]  # G × [response_len] int64
    behaviour_logprobs: list[torch.Tensor]  # G × [response_len] float32, under the sampling distribution
    rewards: list[float | None]  # None: the reward failed for that sample (masked out, never scored 0)
    temperature: NonNegF = 1.0  # how the responses were sampled: the learner scores under the same law
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: NonNeg = 0
    policy_version: NonNeg
    # Per response (G entries, or none: every token the policy's): True where the policy sampled the token,
    # False where a multi-turn episode's environment answered (out of the loss). An entry may be empty.
    policy_masks: list[torch.Tensor] = []

    def __post_init__(self) -> None:
        if self.policy_masks and len(self.policy_masks) != len(self.response_ids):
            raise ValueError(f"{len(self.policy_masks)} policy masks for {len(self.response_ids)} responses")
        for j, (mask, ids) in enumerate(zip(self.policy_masks, self.response_ids, strict=False)):
            if mask.numel() and (mask.dtype != torch.bool or mask.shape != ids.shape):
                raise ValueError(
                    f"response {j}: policy mask must be bool {tuple(ids.shape)}, got {mask.dtype} "
                    f"{tuple(mask.shape)}"
                )


class SampleReceipt(Message, frozen=True, kw_only=True):
    """Learner → coordinator: it holds sample (`group_id`, `sample_index`), the first copy of the newest try to
    arrive (a later one is dropped there and counted). What the coordinator counts, deals, scores and
    records by."""

    kind = LearnerKind.RECEIPT
    group_id: NonNeg
    sample_index: NonNeg
    tokens: NonNeg  # the response's length (an episode's: every token after its opening)
    finish_reason: FinishReason
    policy_version: NonNeg
    accept_length: NonNegF = 0.0
    text: str = ""  # the response as text (special tokens skipped): what the verifier scores
    # An episode's: a digest of its opening (a group's must agree: the learner reads one prompt a group),
    # its policy turns, seconds waiting for the environment, its reward and why it is invalid.
    opening: str = ""
    turns: NonNeg = 0
    env_wait_s: NonNegF = 0.0
    env_reward: Finite | None = None
    error: str | None = None
    attempt: NonNeg = 0  # the step's try that produced it (a newer try's copy replaces an older one's)


class GroupPlan(msgspec.Struct, frozen=True, kw_only=True, array_like=True, forbid_unknown_fields=True):
    """One group of a `TrainStep`: its prompt and its samples' rewards, as the coordinator settled them."""

    group_id: NonNeg
    # The request's prompt; [0]: episodes, whose opening the samples carry (the first one's is the group's).
    prompt_ids: torch.Tensor
    rewards: list[float | None]  # one per sample, in index order; None: invalid (masked, never scored 0)


class TrainStep(Message, frozen=True, kw_only=True):
    """Coordinator → each learner rank: train step `step` on `groups` (this rank's share, possibly none),
    producing policy `version`, once it holds each group's samples; first write them, with their rewards,
    to the samples record `samples_path` (if any). `replay`: the groups are the record at `samples_path`
    (a restarted learner trains again a step it recorded). Pushing the result is `PushWeights`', saving
    it `SaveCheckpoint`'s: each its own message, after the step."""

    kind = LearnerKind.TRAIN
    step: NonNeg
    version: NonNeg
    groups: list[GroupPlan] = []
    temperature: NonNegF = 1.0  # how the step was sampled: the learner scores under the same law
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: NonNeg = 0
    samples_path: str = ""
    replay: bool = False


class PushWeights(Message, frozen=True, kw_only=True):
    """Coordinator → learner rank 0: send the current policy, version `version`, to `to` (every parameter)
    and to `head_to` (the drafter's head parts alone: embedding, final norm, untied LM head), after a step
    or to an actor that lost what it held. A learner holding another version refuses (a WeightAck with
    the reason)."""

    kind = LearnerKind.PUSH
    version: NonNeg
    to: list[str]
    head_to: list[str] = []
    # Destination -> the newest version it acknowledged. A cross-host destination whose entry is the version
    # the learner kept a copy of gets deltas against it; any other gets full buckets.
    delta_base: dict[str, NonNeg] = {}


XOR_ZSTD = "xor-zstd"
"""`WeightUpdate.encoding` of a delta: each tensor is a 1-D uint8 tensor, `engine.weight_delta.xor_delta` of
the parameter at `base_version` and at `version` (zstd of the XOR's byte planes)."""


CUDA_IPC = "cuda-ipc"
"""`WeightUpdate.encoding` on one node's GPUs: `tensors` is empty and `ipc` holds each tensor's CUDA IPC
ref (runtime/cuda_ipc.py); `checksum` is `cuda_ipc.device_checksum`, computed on the GPU."""


class CudaIpcRef(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One tensor in the sender's GPU memory (fields as torch's `_share_cuda_`), mapped by receivers on
    the same node after `cuda_ipc.check`: the bytes never travel."""

    device: NonNeg
    handle: bytes
    storage_size_bytes: NonNeg
    storage_offset_bytes: NonNeg
    ref_counter_handle: bytes
    ref_counter_offset: NonNeg
    event_handle: bytes
    event_sync_required: bool
    dtype: str
    shape: list[NonNeg]
    stride: list[int]
    offset: int
    """Offset of the tensor in its storage, in elements."""


class WeightUpdate(Message, frozen=True, kw_only=True):
    """Learner → rollout: bucket `bucket` of `num_buckets` of policy version `version`."""

    kind = LearnerKind.WEIGHTS
    version: NonNeg
    bucket: NonNeg
    num_buckets: Annotated[int, msgspec.Meta(ge=1)]
    names: list[str]
    tensors: list[torch.Tensor]
    checksum: str  # hex digest over the raw bytes of the new tensors, in order (after decoding a delta)
    encoding: str = ""  # "": `tensors` are the parameters; XOR_ZSTD: deltas against `base_version`; CUDA_IPC
    base_version: NonNeg = 0  # the version a delta is against: the receiver must hold exactly it
    ipc: list[CudaIpcRef] = []  # CUDA_IPC: where each named tensor lies in the sender's GPU memory


class WeightAck(Message, frozen=True, kw_only=True):
    """Rollout → coordinator: version applied (or refused, with the reason)."""

    kind = LearnerKind.WEIGHTS_ACK
    version: NonNeg
    role: str
    rank: NonNeg
    ok: bool
    error: str | None = None
    # Refused a delta whose base it does not hold (restarted, or another version): full weights will do.
    want_full: bool = False


class WeightsPushed(Message, frozen=True, kw_only=True):
    """Learner rank 0 → coordinator, after a push of `version` left: what it moved (`bytes`: one copy of
    its buckets; `full_bytes` across hosts as full buckets would, `wire_bytes` as sent). `head_only`: the
    push went to drafters alone (the head parts)."""

    kind = LearnerKind.PUSHED
    version: NonNeg
    head_only: bool = False
    full_bytes: NonNeg = 0
    wire_bytes: NonNeg = 0
    bytes: NonNeg = 0
    deltas: NonNeg = 0  # destinations sent deltas


class StepStats(Message, frozen=True, kw_only=True):
    """Learner → coordinator: what one optimisation step did (`metrics`: mismatch, ratio and clip stats)."""

    kind = LearnerKind.STEP
    step: NonNeg
    version: NonNeg
    loss: float
    grad_norm: float
    tokens: NonNeg
    elapsed_s: Annotated[float, msgspec.Meta(ge=0.0)]
    metrics: dict[str, float] = {}


MESSAGES: tuple[type[Message], ...] = (
    SampleReceipt,
    TrainStep,
    PushWeights,
    WeightUpdate,
    WeightAck,
    WeightsPushed,
    StepStats,
)

__all__ = [m.__name__ for m in MESSAGES] + [
    "CUDA_IPC", "MESSAGES", "XOR_ZSTD", "CudaIpcRef", "GroupPlan", "LearnerKind", "ScoredGroup",
]  # fmt: skip
