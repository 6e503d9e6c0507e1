"""Ragged batch layout: where each sequence's new tokens sit in the flat batch and in the KV cache.

The model runs on FLAT tokens (`input_ids [num_tokens]`, no padding), so a long prefill chunk and many
single-token decodes share one pass through the weight matrices; only attention needs per-sequence
structure. `BatchLayout.build` turns (slot, number of new tokens, optional tree mask) per sequence into an
attention plan, computed once per pass and reused by every layer.

Non-obvious choices (the reasons: docs/engine.md, "Batch layout"):
- Sequences are bucketed by query length (1, 2, 3–4, 5–8, … ≤ 64), one padded attention call per bucket;
  longer chunks (prefill) run alone, unpadded.
- Keys come straight from the cache: a strided view when a bucket's slots are compact, else a gather.
- Masks are boolean [rows, 1, q_len, kv_len]; padding rows see key 0 only, so no row is fully masked.
- Tree verification: draft nodes in topological order at cache positions start..start+n-1, an
  ancestor-or-self mask (`tree.tree_attention_mask`), RoPE position start + depth.
- The plan is made on the cache's device from host ints (one small copy per index tensor); no
  tensor is built on the CPU and moved, and nothing is read back.
- Planning a pass reserves its positions in the cache (`KVCache.reserve`): a grown cache gets its room
  before the model writes, and every write path goes through a plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from slipstream.engine.kv_cache import KVCache

BATCHED_MAX_QUERY = 64
"""Sequences with at most this many new tokens share padded attention calls; longer ones run alone."""


@dataclass(frozen=True, eq=False)
class AttentionGroup:
    """One padded scaled_dot_product_attention call over `rows` sequences of up to `q_len` new tokens."""

    rows: int
    """Padded batch rows (including dummy rows for slots outside the group in view mode)."""
    q_len: int
    """Padded queries per row."""
    kv_len: int
    """Keys read per row: the longest live length among the group's sequences."""
    slot_start: int
    """View mode: row r reads cache slot slot_start + r."""
    slot_index: Tensor | None
    """Gather mode: [rows] cache slot per row (None in view mode)."""
    token_slice: slice | None
    """The padded queries are exactly these flat tokens, in order (no gather or scatter needed)."""
    query_index: Tensor | None
    """[rows * q_len] flat token feeding each padded query (used when token_slice is None)."""
    token_rows: Tensor | None
    """[n] flat tokens this group produces outputs for (used when token_slice is None)."""
    output_index: Tensor | None
    """[n] padded query row holding each of token_rows' outputs."""
    mask: Tensor
    """[rows, 1, q_len, kv_len] bool, True = may attend."""


@dataclass(frozen=True, eq=False)
class BatchLayout:
    """A forward pass over flat ragged tokens: per-sequence placement plus the attention plan."""

    slots: tuple[int, ...]
    """Cache slot of each sequence."""
    num_new: tuple[int, ...]
    """New tokens of each sequence in this pass."""
    starts: tuple[int, ...]
    """Cache length of each slot before the pass: its first new token is written there."""
    cu_seqlens: tuple[int, ...]
    """[num_seqs + 1] offsets of each sequence's tokens in the flat batch."""
    tree_masks: tuple[Tensor | None, ...]
    """Per sequence [n, n] bool visibility among its new tokens, None for causal."""
    positions: Tensor
    """[num_tokens] int64 RoPE positions: start + index (causal) or start + depth (tree)."""
    write_slots: Tensor
    """[num_tokens] int64 cache slot each token's K/V is written to."""
    write_positions: Tensor
    """[num_tokens] int64 cache position each token's K/V is written to."""
    logit_rows: Tensor | None
    """[num_logits] int64 flat rows that need logits; None means every row, in order."""
    num_logits: int
    groups: tuple[AttentionGroup, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @classmethod
    def build(
        cls,
        cache: KVCache,
        slots: Sequence[int],
        num_new: Sequence[int],
        *,
        tree_masks: Sequence[Tensor | None] | None = None,
        logit_rows: Sequence[int] | None = None,
    ) -> BatchLayout:
        """Plan a pass appending `num_new[i]` tokens to `slots[i]` (at its current cache length), reserving
        their positions in `cache`.

        `logit_rows` are flat token indices needing logits (default: the last token of each sequence).
        """
        slots = tuple(int(s) for s in slots)
        num_new = tuple(int(n) for n in num_new)
        if len(slots) != len(num_new) or not slots:
            raise ValueError(f"need one num_new per slot and at least one sequence, got {slots} / {num_new}")
        if len(set(slots)) != len(slots):
            raise ValueError(f"a slot appears twice in one pass: {slots}")
        masks = tuple(tree_masks) if tree_masks is not None else (None,) * len(slots)
        if len(masks) != len(slots):
            raise ValueError(f"{len(masks)} tree masks for {len(slots)} sequences")
        starts = tuple(cache.length(s) for s in slots)
        offsets = _offsets(cache, slots, num_new, starts, masks)
        num_tokens = offsets[-1]
        # The pass writes every new token's K/V: a grown cache makes room first (static: a no-op).
        cache.reserve(max(slots) + 1, max(start + n for start, n in zip(starts, num_new, strict=True)))

        device = cache.device
        # output_size: the repeat's length is known on the host, so the device is never asked for it.
        seq_of_token = torch.repeat_interleave(
            torch.arange(len(slots), device=device), _ints(num_new, device), output_size=num_tokens
        )  # [num_tokens]
        write_positions, positions = _positions(seq_of_token, num_new, starts, offsets, masks, device)
        rows_list = _logit_rows(logit_rows, offsets)
        all_rows = rows_list == list(range(num_tokens))

        return cls(
            slots=slots,
            num_new=num_new,
            starts=starts,
            cu_seqlens=tuple(offsets),
            tree_masks=masks,
            positions=positions,
            write_slots=_ints(slots, device)[seq_of_token],
            write_positions=write_positions,
            logit_rows=None if all_rows else _ints(rows_list, device),
            num_logits=len(rows_list),
            groups=tuple(_plan_groups(slots, num_new, starts, offsets, masks, device)),
        )


def _offsets(
    cache: KVCache,
    slots: tuple[int, ...],
    num_new: tuple[int, ...],
    starts: tuple[int, ...],
    masks: tuple[Tensor | None, ...],
) -> list[int]:
    """[num_seqs + 1] offsets of each sequence's tokens in the flat batch; ValueError naming the slot whose
    new tokens are none, past max_len, or do not fit its tree mask."""
    offsets = [0]
    for slot, start, n, mask in zip(slots, starts, num_new, masks, strict=True):
        if n < 1:
            raise ValueError(f"slot {slot}: a sequence needs at least one new token, got {n}")
        if start + n > cache.max_len:
            raise ValueError(f"slot {slot}: {start} cached + {n} new tokens exceed max_len {cache.max_len}")
        if mask is not None and (mask.shape != (n, n) or mask.dtype != torch.bool):
            raise ValueError(f"slot {slot}: tree mask must be bool [{n}, {n}], got {mask.dtype} {mask.shape}")
        offsets.append(offsets[-1] + n)
    return offsets


def _positions(
    seq_of_token: Tensor,
    num_new: tuple[int, ...],
    starts: tuple[int, ...],
    offsets: list[int],
    masks: tuple[Tensor | None, ...],
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """[num_tokens] cache positions the tokens' K/V are written to, and their RoPE positions: start +
    index, or start + depth for a tree's nodes."""
    num_tokens = offsets[-1]
    index_in_seq = torch.arange(num_tokens, device=device) - _ints(offsets[:-1], device)[seq_of_token]
    token_starts = _ints(starts, device)[seq_of_token]
    write_positions = token_starts + index_in_seq
    positions = write_positions
    if any(m is not None for m in masks):
        # A tree node's position is start + depth; its depth is its number of visible ancestors.
        depth = torch.cat(
            [
                m.to(device).sum(-1) - 1 if m is not None else torch.arange(n, device=device)
                for m, n in zip(masks, num_new, strict=True)
            ]
        )
        positions = token_starts + depth
    return write_positions, positions


def _logit_rows(logit_rows: Sequence[int] | None, offsets: list[int]) -> list[int]:
    """The flat rows that need logits: `logit_rows` checked, or each sequence's last token."""
    if logit_rows is None:
        return [o - 1 for o in offsets[1:]]
    num_tokens = offsets[-1]
    rows_list = [int(r) for r in logit_rows]
    if rows_list and not 0 <= min(rows_list) <= max(rows_list) < num_tokens:
        raise ValueError(f"logit rows {rows_list} outside [0, {num_tokens})")
    return rows_list


def _ints(values: Sequence[int], device: torch.device) -> Tensor:
    """Host ints as an int64 tensor made on `device` (one small copy)."""
    return torch.tensor(values, dtype=torch.int64, device=device)


def _bucket(n: int) -> int:
    """Query-length bucket: 1, 2, 3–4, 5–8, … (padding within a bucket is less than 2×)."""
    return (n - 1).bit_length()


def _plan_groups(
    slots: tuple[int, ...],
    num_new: tuple[int, ...],
    starts: tuple[int, ...],
    offsets: list[int],
    masks: tuple[Tensor | None, ...],
    device: torch.device,
) -> list[AttentionGroup]:
    buckets: dict[int, list[int]] = {}
    singles: list[int] = []
    for i, n in enumerate(num_new):
        if n <= BATCHED_MAX_QUERY:
            buckets.setdefault(_bucket(n), []).append(i)
        else:
            singles.append(i)
    groups = [
        _padded_group(sorted(m, key=lambda i: slots[i]), slots, num_new, starts, offsets, masks, device)
        for m in buckets.values()
    ]
    for i in singles:
        n, start = num_new[i], starts[i]
        groups.append(
            AttentionGroup(
                rows=1,
                q_len=n,
                kv_len=start + n,
                slot_start=slots[i],
                slot_index=None,
                token_slice=slice(offsets[i], offsets[i] + n),
                query_index=None,
                token_rows=None,
                output_index=None,
                mask=_visibility([start], [n], [masks[i]], n, start + n, device)[:, None],
            )
        )
    return groups


def _padded_group(
    members: list[int],
    slots: tuple[int, ...],
    num_new: tuple[int, ...],
    starts: tuple[int, ...],
    offsets: list[int],
    masks: tuple[Tensor | None, ...],
    device: torch.device,
) -> AttentionGroup:
    """One call for `members` (sorted by slot): view over a compact slot range, else a gather."""
    member_slots = [slots[i] for i in members]
    lo, hi = member_slots[0], member_slots[-1] + 1
    # A view reads every slot in [lo, hi); past 2× the members a gather of just the members is cheaper.
    view = hi - lo <= 2 * len(members)
    rows = hi - lo if view else len(members)
    row_of = [s - lo for s in member_slots] if view else list(range(len(members)))
    q_len = max(num_new[i] for i in members)
    kv_len = max(starts[i] + num_new[i] for i in members)

    row_starts = [0] * rows
    row_new = [0] * rows  # 0 marks a dummy row
    row_masks: list[Tensor | None] = [None] * rows
    query_index = [0] * (rows * q_len)  # padding queries read flat token 0; their outputs are dropped
    token_rows: list[int] = []
    output_index: list[int] = []
    for r, i in zip(row_of, members, strict=True):
        row_starts[r], row_new[r], row_masks[r] = starts[i], num_new[i], masks[i]
        tokens = range(offsets[i], offsets[i] + num_new[i])
        query_index[r * q_len : r * q_len + num_new[i]] = tokens
        token_rows.extend(tokens)
        output_index.extend(range(r * q_len, r * q_len + num_new[i]))

    # Fast path (every decode step of a compact batch): queries are the flat tokens themselves, in order.
    in_order = (
        rows == len(members)
        and q_len == 1
        and token_rows == list(range(offsets[members[0]], offsets[members[0]] + rows))
    )
    mask = _visibility(row_starts, row_new, row_masks, q_len, kv_len, device)[:, None]
    return AttentionGroup(
        rows=rows,
        q_len=q_len,
        kv_len=kv_len,
        slot_start=lo,
        slot_index=None if view else _ints(member_slots, device),
        token_slice=slice(token_rows[0], token_rows[0] + rows) if in_order else None,
        query_index=None if in_order else _ints(query_index, device),
        token_rows=None if in_order else _ints(token_rows, device),
        output_index=None if in_order else _ints(output_index, device),
        mask=mask,
    )


def _visibility(
    starts: list[int],
    num_new: list[int],
    masks: list[Tensor | None],
    q_len: int,
    kv_len: int,
    device: torch.device,
) -> Tensor:
    """[rows, q_len, kv_len] bool on `device`: query k of row r sees its cached prefix and its allowed new
    tokens."""
    start_t = _ints(starts, device)[:, None]  # [rows, 1]
    new_t = _ints(num_new, device)[:, None]
    query = torch.arange(q_len, device=device)[None, :]  # [1, q_len]
    real = query < new_t  # [rows, q_len]
    # Causal: query k sees keys < start + k + 1. Padding and dummy rows see key 0 only.
    limit = torch.where(real, start_t + query + 1, 1)
    visible = torch.arange(kv_len, device=device)[None, None, :] < limit[:, :, None]  # [rows, q_len, kv_len]
    for r, mask in enumerate(masks):
        if mask is not None:
            n, start = num_new[r], starts[r]
            visible[r, :n, start : start + n] = mask
    return visible
