"""Learner channel: scored GRPO groups in, versioned exact weight updates out.

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


class LearnerKind(StrEnum):
    GROUP = "learner.group"
    WEIGHTS = "learner.weights"
    WEIGHTS_ACK = "learner.weights_ack"
    STEP = "learner.step"
    TRAIN = "learner.train"
    PUSH = "learner.push"
    PUSHED = "learner.pushed"


class ScoredGroup(Message, frozen=True, kw_only=True):
    """Coordinator → learner: one prompt's G responses with behaviour log-probs and rewards."""

    kind = LearnerKind.GROUP
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


class TrainStep(Message, frozen=True, kw_only=True):
    """Coordinator → learner: train on step `step`'s `num_groups` groups, producing policy `version`. Pushing
    it is `PushWeights`', saving it `SaveCheckpoint`'s: each its own message, after the step."""

    kind = LearnerKind.TRAIN
    step: NonNeg
    num_groups: NonNeg  # ScoredGroups this rank receives for the step (may be 0 on one of several ranks)
    version: NonNeg


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
    ScoredGroup,
    TrainStep,
    PushWeights,
    WeightUpdate,
    WeightAck,
    WeightsPushed,
    StepStats,
)

__all__ = [m.__name__ for m in MESSAGES] + ["CUDA_IPC", "MESSAGES", "XOR_ZSTD", "CudaIpcRef", "LearnerKind"]
