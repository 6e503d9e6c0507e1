"""Drafter channel: hidden states of finished responses in, versioned drafter weights out.

Hidden states are the bulk of this channel (response_len × hidden per sample), so they travel as
zero-copy frames and may be bf16 (raw bytes on the wire).
"""

from enum import StrEnum
from typing import Annotated

import msgspec
import torch

from slipstream.protocols.base import Message, NonNeg


class DrafterKind(StrEnum):
    HIDDEN = "drafter.hidden"
    UPDATE = "drafter.update"
    STATS = "drafter.stats"


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
    version: NonNeg
    policy_version: NonNeg
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
    elapsed_s: Annotated[float, msgspec.Meta(ge=0.0)]


MESSAGES: tuple[type[Message], ...] = (HiddenStates, DrafterUpdate, DrafterStats)

__all__ = [m.__name__ for m in MESSAGES] + ["MESSAGES", "DrafterKind"]
