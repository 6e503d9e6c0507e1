"""Drafter channel: hidden states of finished responses in, versioned drafter weights out.

Hidden states are the bulk of this channel (response_len × hidden per sample), so they travel as
zero-copy frames and may be bf16 (raw bytes on the wire). Drafter ranks that train one drafter together
exchange `DrafterDelta` (rank → rank 0, the owner) and `DrafterUpdate` (owner → ranks): weights and
weight differences are tensors in frames too, never pickled.
"""

from enum import StrEnum
from typing import Annotated

import msgspec
import torch

from slipstream.protocols.base import Message, NonNeg, NonNegF


class DrafterKind(StrEnum):
    HIDDEN = "drafter.hidden"
    UPDATE = "drafter.update"
    STATS = "drafter.stats"
    DELTA = "drafter.delta"
    HEAD_ACK = "drafter.head_ack"


class HiddenStates(Message, frozen=True, kw_only=True):
    """Rollout → drafter buffer: one completed sequence's tokens and the target's last hidden states."""

    kind = DrafterKind.HIDDEN
    group_id: NonNeg
    sample_index: NonNeg
    token_ids: torch.Tensor  # [seq_len] int64, prompt + response
    hidden: torch.Tensor  # [seq_len, hidden] target last-layer states (pre final norm)
    response_start: NonNeg
    policy_version: NonNeg


class DrafterUpdate(Message, frozen=True, kw_only=True):
    """Drafter → rollout: trainable drafter weights of version `version` (swapped in between iterations)."""

    kind = DrafterKind.UPDATE
    version: NonNeg  # optimizer steps folded into the drafter
    policy_version: NonNeg  # the newest policy version whose hidden states the drafter has trained on
    names: list[str]
    tensors: list[torch.Tensor]
    checksum: str


class DrafterStats(Message, frozen=True, kw_only=True):
    """Drafter → coordinator: training progress while leased."""

    kind = DrafterKind.STATS
    rank: NonNeg
    version: NonNeg
    steps: NonNeg
    loss: float
    buffer_tokens: NonNeg
    elapsed_s: Annotated[float, msgspec.Meta(ge=0.0)]  # training device-seconds: seconds × leases held


class DrafterDelta(Message, frozen=True, kw_only=True):
    """Drafter rank → drafter rank 0 (the owner of the one drafter): what this rank trained since its base.

    tensors[i] = local − base of trainable weight names[i], in the weight's dtype; the owner folds it into
    the global drafter. With steps 0, names and tensors are empty: the rank is not training (starting up,
    or preempted with nothing unsent) and asks for the current global weights.
    """

    kind = DrafterKind.DELTA
    rank: NonNeg
    base_version: NonNeg  # the newest global version this rank had adopted when it trained these steps
    policy_version: NonNeg  # the newest policy version whose hidden states this rank's weights trained on
    steps: NonNeg  # optimizer steps behind the delta
    tokens: NonNeg  # training tokens behind the delta
    elapsed_s: NonNegF  # training time behind the delta
    final: bool  # the rank stops training after this (preempted, or not leased yet)
    names: list[str]
    tensors: list[torch.Tensor]


class HeadAck(Message, frozen=True, kw_only=True):
    """Drafter → coordinator: the head parts of policy `version` applied (`ok`), or refused (`why`).
    `checksum`: the applied parts re-hashed, when the drafter is asked to (`verify_applied_head`)."""

    kind = DrafterKind.HEAD_ACK
    rank: NonNeg
    version: NonNeg
    ok: bool
    why: str = ""
    checksum: str = ""


MESSAGES: tuple[type[Message], ...] = (HiddenStates, DrafterUpdate, DrafterStats, DrafterDelta, HeadAck)

__all__ = [m.__name__ for m in MESSAGES] + ["MESSAGES", "DrafterKind"]
