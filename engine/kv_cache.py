"""Slot-based KV cache: per-layer K/V, one slot per live sequence, fixed or grown to the live batch.

Per layer K and V are `[slots, num_kv_heads, length, head_dim]` in the model's dtype, zero-filled (padded
attention rows over unused slots never see NaN garbage). A slot's visible content is positions
`[0, length)`; everything past is masked out by the attention plan, so `rollback` only moves the length
back. The head-major layout lets a decode step over contiguous slots read `cache[lo:hi, :, :max_live_len]`
as a strided view (the allocator hands out the lowest free slot).

Tree verification writes a pass's draft nodes at positions base..base+n-1; `commit_path` moves the
accepted nodes' K/V to base..base+a-1, so the cache equals one that only ever saw the accepted tokens.

Two sizings (2 × layers × kv_heads × head_dim × dtype bytes per token; a worked example: docs/engine.md):
- static (`grow=False`): num_slots × max_len tokens allocated once. What CUDA wants: a fixed footprint
  that the caching allocator never fragments, stable addresses for CUDA graphs.
  A static cache is one tensor [2, layers, slots, kv_heads, length, head_dim] (`storage`) with per-layer
  views, so a fixed-shape step commits a tree path in every layer with one gather and one scatter; its
  length may be rounded up to a page (`page_size`) so attention can address it by pages, and it may hold a
  `dummy_slot` that padding rows of a fixed-shape step write to (never allocated).
- grown (`grow=True`): storage covers the lowest slots in use and the longest length any pass has
  reserved (`reserve`, which `BatchLayout.build` calls before a pass writes), grown by half again in
  chunks, and released when the last slot frees. RL responses are mostly far shorter than max_len, so
  this holds a fraction of the static bytes; growing copies the cache a handful of times per batch.
  One length for all slots keeps the strided-view reads: a single long sequence sizes every slot, and
  `compact` moves the live slots lowest once the batch has shrunk from below (the tail in a high slot).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from slipstream.engine.config import ModelConfig

GROW_LENGTH_CHUNK = 64
"""A grown cache's length is a multiple of this many positions (or max_len)."""
GROW_SLOT_CHUNK = 4
"""A grown cache's slot count is a multiple of this (or num_slots)."""


class KVCache:
    """Per-layer K/V with per-slot lengths, allocation, rollback and tree commit; static or grown."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        grow: bool = False,
        page_size: int = 1,
        dummy_slot: bool = False,
    ) -> None:
        """grow: allocate as passes reserve room (see the module docstring); False: everything up front.
        page_size (static only): storage length rounded up to a multiple of it (max_len stays the limit);
        dummy_slot (static only): one slot more, held back from allocation, for padding rows."""
        for name, value in (
            ("num_layers", num_layers),
            ("num_slots", num_slots),
            ("max_len", max_len),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value <= 0:
                raise ValueError(f"KVCache {name} must be positive, got {value}")
        if page_size < 1 or (grow and (page_size != 1 or dummy_slot)):
            raise ValueError(f"KVCache page_size {page_size} / dummy_slot need a static cache (grow=False)")
        self.storage: Tensor | None = None
        """Static caches: [2, layers, slots, kv_heads, storage length, head_dim]; keys/values are its views."""
        self.page_size = page_size
        self.storage_len = -(-max_len // page_size) * page_size
        self.dummy_slot: int | None = num_slots if dummy_slot else None
        """A slot padding rows of fixed-shape steps write to; never allocated, its content garbage."""
        self.num_slots = num_slots
        self.max_len = max_len
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.grow = grow
        self._num_layers = num_layers
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        if grow:
            self._allocate(0, 0)
        else:
            shape = (2, num_layers, num_slots + dummy_slot, num_kv_heads, self.storage_len, head_dim)
            self.storage = torch.zeros(shape, dtype=dtype, device=self.device)
            self.keys, self.values = list(self.storage[0].unbind(0)), list(self.storage[1].unbind(0))
        # Python ints: the scheduler reads lengths every step, and a tensor here would cost a device sync.
        self.lengths: list[int] = [0] * num_slots
        self._free: list[int] = list(range(num_slots))  # a heap: allocate() takes the lowest
        self._in_use: list[bool] = [False] * num_slots

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        *,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        grow: bool = False,
        page_size: int = 1,
        dummy_slot: bool = False,
    ) -> KVCache:
        """A cache shaped for `config` (dtype defaults to the config's)."""
        return cls(
            num_layers=config.num_hidden_layers,
            num_slots=num_slots,
            max_len=max_len,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            dtype=dtype or config.dtype,
            device=device,
            grow=grow,
            page_size=page_size,
            dummy_slot=dummy_slot,
        )

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def slot_capacity(self) -> int:
        """Slots [0, slot_capacity) have storage now (num_slots for a static cache)."""
        return min(self.keys[0].shape[0], self.num_slots)

    @property
    def capacity(self) -> int:
        """Positions per slot with storage now (max_len for a static cache)."""
        return min(self.keys[0].shape[2], self.max_len)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token occupies across all layers (K and V)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage held now."""
        return self.bytes_per_token * self.keys[0].shape[0] * self.keys[0].shape[2]

    @property
    def max_nbytes(self) -> int:
        """Bytes at full size (num_slots × max_len): what a static cache holds from the start (with its
        page rounding and dummy slot)."""
        if self.storage is not None:
            return self.storage.numel() * self.storage.element_size()
        return self.bytes_per_token * self.num_slots * self.max_len

    def reserve(self, slots: int, length: int) -> None:
        """Make room for slots [0, slots) to hold positions [0, length) before a pass writes there.

        A no-op when they fit (always, for a static cache); a grown cache grows to at least half again its
        size, in chunks, so a sequence growing token by token copies the cache a logarithmic number of
        times. ValueError past num_slots or max_len."""
        if not (0 <= slots <= self.num_slots and 0 <= length <= self.max_len):
            raise ValueError(
                f"cannot reserve {slots} slots x {length} positions in a cache of {self.num_slots} x "
                f"{self.max_len}"
            )
        have_slots, have_length = self.slot_capacity, self.capacity
        if slots <= have_slots and length <= have_length:
            return
        self._allocate(
            _grown(have_slots, slots, self.num_slots, GROW_SLOT_CHUNK),
            _grown(have_length, length, self.max_len, GROW_LENGTH_CHUNK),
        )

    @property
    def sparse(self) -> bool:
        """A grown cache whose live slots reach at least twice as high as its live sequences would need if
        they sat lowest: the batch shrank from below, and growing it now would copy dead slots (`compact`)."""
        live = self.num_slots - len(self._free)
        if not self.grow or live == 0:
            return False
        top = max(s for s, used in enumerate(self._in_use) if used) + 1
        return top >= 2 * _grown(0, live, self.num_slots, GROW_SLOT_CHUNK)

    def compact(self) -> dict[int, int]:
        """Move the slots in use to the lowest ones, in order, and shrink a grown cache's storage to them.

        Returns {old slot: new slot} for the slots that moved: the caller renames its sequences. In a
        long-tail rollout the last sequences often sit in high slots; a grown cache then zero-fills and
        copies every slot below them each time their length grows (docs/engine.md, "KV cache")."""
        live = [s for s, used in enumerate(self._in_use) if used]
        moved = {old: new for new, old in enumerate(live) if old != new}
        # Ascending: a target is free, or held by a sequence that moved down already (new <= old).
        for old, new in moved.items():
            self._copy(old, new, self.lengths[old])
            self.lengths[old] = 0
            self._in_use[new], self._in_use[old] = True, False
        self._free = list(range(len(live), self.num_slots))  # sorted: a valid heap
        if self.grow:
            self._allocate(_grown(0, len(live), self.num_slots, GROW_SLOT_CHUNK), self.capacity)
        return moved

    def allocate(self) -> int:
        """Claim the lowest free slot (empty). Lowest-first keeps live slots contiguous for view reads."""
        if not self._free:
            raise RuntimeError(f"KVCache has no free slot (all {self.num_slots} in use)")
        slot = heapq.heappop(self._free)
        self._in_use[slot] = True
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Return a slot to the pool; its content becomes garbage."""
        self._check(slot)
        self._in_use[slot] = False
        self.lengths[slot] = 0
        heapq.heappush(self._free, slot)
        if self.grow and len(self._free) == self.num_slots:
            self._allocate(0, 0)  # idle: the next batch grows to what it needs, not to this one's size

    def length(self, slot: int) -> int:
        """Tokens whose K/V the slot holds."""
        self._check(slot)
        return self.lengths[slot]

    def set_length(self, slot: int, length: int) -> None:
        """Record that positions [0, length) are valid (the model's forward calls this after writing)."""
        self._check(slot)
        if not 0 <= length <= self.max_len:
            raise ValueError(f"slot {slot}: length {length} outside [0, {self.max_len}]")
        if length > self.lengths[slot] and self.grow:
            self.reserve(slot + 1, length)  # positions a slot claims always have storage (static: always)
        self.lengths[slot] = length

    def rollback(self, slot: int, new_length: int) -> None:
        """Drop the slot's tokens from `new_length` on (rejected drafts); the kept prefix is untouched."""
        self._check(slot)
        if not 0 <= new_length <= self.lengths[slot]:
            raise ValueError(f"slot {slot}: cannot roll back to {new_length}, length is {self.lengths[slot]}")
        self.lengths[slot] = new_length

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Give slot `target` a copy of slot `source`'s first `length` positions (a shared prompt's K/V) and
        that length. Both slots must be allocated and `source` must hold them; `target`'s content goes."""
        self._check(source)
        self._check(target)
        if source == target or not 0 <= length <= self.lengths[source]:
            raise ValueError(
                f"cannot copy {length} positions of slot {source} (length {self.lengths[source]}) to slot {target}"
            )
        self.reserve(target + 1, length)
        self._copy(source, target, length)

    def _copy(self, source: int, target: int, length: int) -> None:
        """Slot `target` takes slot `source`'s first `length` positions and that length (storage in place).
        A slot that holds nothing may lie past a grown cache's storage (admitted, not yet prefilled):
        nothing to copy then."""
        if length:
            for cache in (*self.keys, *self.values):
                cache[target, :, :length] = cache[source, :, :length]
        self.lengths[target] = length

    def commit_path(self, slot: int, base_length: int, accepted_node_indices: Sequence[int] | Tensor) -> None:
        """Keep only the accepted path of a tree-verify pass.

        The pass wrote node i at position base_length + i. `accepted_node_indices` lists the path's nodes
        root first (increasing, since a parent precedes its children); afterwards positions
        base_length..base_length+a-1 hold those nodes' K/V and the length is base_length + a. The indices
        are host data (a tensor is read once); the copy runs on the cache's device.
        """
        self._check(slot)
        if isinstance(accepted_node_indices, Tensor):
            accepted_node_indices = accepted_node_indices.flatten().tolist()
        nodes = [int(node) for node in accepted_node_indices]
        count = len(nodes)
        written = self.lengths[slot] - base_length
        if base_length < 0 or written < count:
            raise ValueError(
                f"slot {slot}: {count} accepted nodes but only {written} written after base {base_length}"
            )
        if count:
            if min(nodes) < 0 or max(nodes) >= written or any(b <= a for a, b in itertools.pairwise(nodes)):
                raise ValueError(f"slot {slot}: accepted nodes {nodes} must increase within [0, {written})")
            # A chain prefix is already in place; only a real branch needs moving.
            if nodes != list(range(count)):
                source = torch.tensor([base_length + node for node in nodes], device=self.device)
                for cache in (*self.keys, *self.values):
                    # index_select copies before the write, so overlapping source and target are safe.
                    cache[slot, :, base_length : base_length + count] = cache[slot].index_select(1, source)
        self.lengths[slot] = base_length + count

    def _allocate(self, slots: int, length: int) -> None:
        """Storage of `slots` x `length` per layer, keeping what fits of the current content."""
        shape = (slots, self.num_kv_heads, length, self.head_dim)
        for caches in (self.keys, self.values):
            for layer in range(self._num_layers):
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if layer == len(caches):
                    caches.append(new)
                    continue
                old = caches[layer]
                keep_slots, keep_length = min(slots, old.shape[0]), min(length, old.shape[2])
                new[:keep_slots, :, :keep_length] = old[:keep_slots, :, :keep_length]
                caches[layer] = new  # one layer at a time: growing never holds two whole caches

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside [0, {self.num_slots})")
        if not self._in_use[slot]:
            raise ValueError(f"slot {slot} is not allocated")


def _grown(have: int, need: int, limit: int, chunk: int) -> int:
    """New size for a dimension holding `have` that must hold `need`: at least half again, in chunks."""
    if need <= have:
        return have
    return min(limit, -(-max(need, have + have // 2) // chunk) * chunk)
