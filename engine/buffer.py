"""Online buffer of completed sequences for drafter training: bounded bytes, newest first, long ones mixed in.

Each entry is one sequence's tokens with the target's pre-norm last-layer states, row-aligned: hidden[i]
is the state at token_ids[i], the one that predicted token_ids[i + 1]. A completion enters as the window
[last prompt token, …, second-to-last response token] (`completion_window`), which holds every pair the
drafter trains on.

Non-obvious choices (the reasons: docs/engine.md, "Drafter buffer"):
- `sample_batch` fills batches newest first from the current policy version, plus a share taken from the
  longest responses of earlier versions: newest-first alone would bias the drafter towards short answers.
- Memory is bounded in bytes (adding past the bound evicts the oldest arrivals); states are stored in
  `dtype` (bf16 by default), in host memory whatever device trains: only a batch moves (`PackedBatch.to`).
  Sequences longer than a batch are cropped to a random window of it.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor

from slipstream.engine.request import Completion

__all__ = ["BufferStats", "OnlineBuffer", "PackedBatch", "completion_window"]


@dataclass(frozen=True)
class PackedBatch:
    """Several sequences concatenated without padding (positions restart per sequence)."""

    token_ids: Tensor
    """[N] int64."""
    hidden: Tensor
    """[N, hidden] target last-layer states (pre final norm), row-aligned with token_ids."""
    cu_seqlens: tuple[int, ...]
    """[S + 1] offsets of each sequence's rows."""
    response_starts: tuple[int, ...]
    """[S] index within each sequence of its first response token (0 if it starts inside the response)."""
    policy_versions: tuple[int, ...]
    """[S] policy version that produced each sequence."""

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens[-1]

    def to(self, device: torch.device | str) -> PackedBatch:
        """The batch with its tensors on `device` (itself when they are there already)."""
        return dataclasses.replace(self, token_ids=self.token_ids.to(device), hidden=self.hidden.to(device))


@dataclass(frozen=True)
class BufferStats:
    sequences: int
    tokens: int
    bytes: int
    newest_version: int | None


@dataclass(frozen=True, eq=False)
class _Entry:
    token_ids: Tensor  # [T] int32
    hidden: Tensor  # [T, hidden] in the buffer's dtype
    response_start: int
    policy_version: int
    arrival: int
    nbytes: int

    @property
    def response_len(self) -> int:
        return self.token_ids.numel() - self.response_start


def completion_window(completion: Completion) -> tuple[Tensor, Tensor, int] | None:
    """(token_ids [T], hidden [T, d], response_start) of a completion kept with hidden states, or None.

    Completion.hidden[j] sampled response token j, so it is the state at the token before it: the window
    runs from the last prompt token to the second-to-last response token, and the response starts at 1.
    None when there are no states or fewer than two rows (no training pair).
    """
    hidden = completion.hidden
    if hidden is None or hidden.shape[0] < 2:
        return None
    tokens = [completion.prompt_ids[-1], *completion.token_ids[:-1]]
    return torch.tensor(tokens, dtype=torch.int64), hidden, 1


class OnlineBuffer:
    """Completed sequences with hidden states for drafter training; see the module docstring."""

    def __init__(
        self, max_bytes: int, *, dtype: torch.dtype = torch.bfloat16, long_share: float = 0.25, seed: int = 0
    ) -> None:
        """max_bytes: bound on stored tokens + hidden states; dtype: hidden-state storage dtype;
        long_share: fraction of each batch's tokens taken from the longest responses of earlier versions;
        seed: for the crop windows of sequences longer than a batch."""
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if not 0 <= long_share <= 1:
            raise ValueError(f"long_share must be in [0, 1], got {long_share}")
        self.max_bytes = max_bytes
        self.dtype = dtype
        self.long_share = long_share
        self._entries: deque[_Entry] = deque()  # arrival order: the left end is evicted first
        self._bytes = 0
        self._tokens = 0
        self._arrivals = 0
        self._rng = random.Random(seed)
        self._fresh_cursor = 0
        self._long_cursor = 0

    def add(self, token_ids: Tensor, hidden: Tensor, response_start: int, policy_version: int) -> None:
        """Store one sequence (copied; hidden cast to the buffer dtype), evicting the oldest past max_bytes."""
        token_ids = torch.as_tensor(token_ids).reshape(-1)
        length = token_ids.numel()
        if hidden.dim() != 2 or hidden.shape[0] != length:
            raise ValueError(f"hidden must be [{length}, d] for {length} tokens, got {tuple(hidden.shape)}")
        if length < 2:
            raise ValueError(f"a sequence needs at least 2 tokens to give a training pair, got {length}")
        if not 0 <= response_start < length:
            raise ValueError(f"response_start {response_start} outside [0, {length})")
        if self._entries and hidden.shape[1] != self._entries[0].hidden.shape[1]:
            raise ValueError(f"hidden width {hidden.shape[1]} != buffer's {self._entries[0].hidden.shape[1]}")
        stored = hidden.detach().to(device="cpu", dtype=self.dtype).contiguous().clone()
        ids = token_ids.to(device="cpu", dtype=torch.int32).clone()  # vocabularies fit in int32
        nbytes = ids.numel() * ids.element_size() + stored.numel() * stored.element_size()
        if nbytes > self.max_bytes:
            raise ValueError(
                f"one sequence of {nbytes} bytes exceeds the buffer's max_bytes {self.max_bytes}"
            )
        self._entries.append(_Entry(ids, stored, response_start, policy_version, self._arrivals, nbytes))
        self._arrivals += 1
        self._bytes += nbytes
        self._tokens += length
        while self._bytes > self.max_bytes:
            old = self._entries.popleft()
            self._bytes -= old.nbytes
            self._tokens -= old.token_ids.numel()
        # New data goes first: the next batch starts again from the newest sequence.
        self._fresh_cursor = 0

    def add_completion(self, completion: Completion, policy_version: int) -> bool:
        """Store a completion's window (`completion_window`); False if it has no usable hidden states."""
        window = completion_window(completion)
        if window is None:
            return False
        self.add(*window, policy_version=policy_version)
        return True

    def stats(self) -> BufferStats:
        newest = max((e.policy_version for e in self._entries), default=None)
        return BufferStats(len(self._entries), self._tokens, self._bytes, newest)

    def __len__(self) -> int:
        return len(self._entries)

    def sample_batch(self, max_tokens: int) -> PackedBatch | None:
        """A packed batch of at most max_tokens rows (None when empty); see the module docstring."""
        if max_tokens < 2:
            raise ValueError(f"max_tokens must be at least 2, got {max_tokens}")
        if not self._entries:
            return None
        newest = max(e.policy_version for e in self._entries)
        fresh = sorted((e for e in self._entries if e.policy_version == newest), key=lambda e: -e.arrival)
        long = sorted(
            (e for e in self._entries if e.policy_version < newest),
            key=lambda e: (-e.response_len, -e.arrival),
        )
        chosen: list[tuple[_Entry, int, int]] = []  # (entry, first row, rows)
        taken: set[int] = set()
        budget = max_tokens
        if long:
            share = round(self.long_share * max_tokens)
            used, self._long_cursor = self._take(long, self._long_cursor, share, chosen, taken)
            budget -= used
        used, self._fresh_cursor = self._take(fresh, self._fresh_cursor, budget, chosen, taken)
        budget -= used
        if budget >= 2 and long:  # the current version ran short: older data fills the rest
            used, self._long_cursor = self._take(long, self._long_cursor, budget, chosen, taken)
        if not chosen:
            return None
        return self._pack(chosen)

    def _take(
        self,
        pool: list[_Entry],
        cursor: int,
        budget: int,
        chosen: list[tuple[_Entry, int, int]],
        taken: set[int],
    ) -> tuple[int, int]:
        """Append entries from pool (cyclically from cursor) until budget rows; returns (rows, new cursor)."""
        used, after = 0, cursor
        for step in range(len(pool)):
            if budget - used < 2:
                break
            index = (cursor + step) % len(pool)
            entry = pool[index]
            if entry.arrival in taken:
                continue
            length = entry.token_ids.numel()
            rows = min(length, budget - used)
            first = self._rng.randrange(length - rows + 1) if rows < length else 0
            chosen.append((entry, first, rows))
            taken.add(entry.arrival)
            used += rows
            after = index + 1
        return used, after % max(len(pool), 1)

    @staticmethod
    def _pack(chosen: list[tuple[_Entry, int, int]]) -> PackedBatch:
        offsets = [0]
        for _, _, rows in chosen:
            offsets.append(offsets[-1] + rows)
        return PackedBatch(
            token_ids=torch.cat([e.token_ids[a : a + n] for e, a, n in chosen]).to(torch.int64),
            hidden=torch.cat([e.hidden[a : a + n] for e, a, n in chosen]),
            cu_seqlens=tuple(offsets),
            response_starts=tuple(max(e.response_start - a, 0) for e, a, _ in chosen),
            policy_versions=tuple(e.policy_version for e, _, _ in chosen),
        )
