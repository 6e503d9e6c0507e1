"""KV cache: slot bookkeeping, rollback of rejected tokens, and tree commit equal to a never-branched cache.

Models run in float64 here, so "equal" can be checked to 1e-10 even where two caches reached the same
state through differently shaped passes. The model tests run on every `device`, with the cache, the batch
layout and the tree masks made on it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from slipstream.engine.batch import BatchLayout
from slipstream.engine.kv_cache import KVCache
from slipstream.engine.model import Transformer
from slipstream.engine.tree import tree_attention_mask, tree_depths
from slipstream.engine.weights import load_model


@pytest.fixture
def model(make_checkpoint: Callable[..., Path], device: torch.device) -> Transformer:
    return load_model(make_checkpoint("llama"), dtype=torch.float64, device=device)


def feed(
    model: Transformer, cache: KVCache, slot: int, tokens: list[int], parents: list[int] | None = None
) -> torch.Tensor:
    """Append tokens to one slot in one pass (a tree when parents are given); logits for every token."""
    device = cache.device
    masks = None if parents is None else [tree_attention_mask(torch.tensor(parents, device=device))]
    layout = BatchLayout.build(cache, [slot], [len(tokens)], tree_masks=masks, logit_rows=range(len(tokens)))
    tensors = [layout.positions, layout.write_slots, layout.write_positions, layout.logit_rows]
    tensors += [group.mask for group in layout.groups]
    assert all(t.device.type == device.type for t in tensors if t is not None)
    logits, _ = model(torch.tensor(tokens, device=device), layout.positions, layout, cache)
    return logits


def slot_state(cache: KVCache, slot: int) -> list[torch.Tensor]:
    length = cache.length(slot)
    return [layer[slot, :, :length] for layer in (*cache.keys, *cache.values)]


def assert_same_state(a: KVCache, slot_a: int, b: KVCache, slot_b: int, exact: bool = False) -> None:
    assert a.length(slot_a) == b.length(slot_b)
    for x, y in zip(slot_state(a, slot_a), slot_state(b, slot_b), strict=True):
        if exact:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, atol=1e-10, rtol=0)


def new_cache(model: Transformer, num_slots: int = 2, max_len: int = 64) -> KVCache:
    device = model.embed_tokens.weight.device
    return KVCache.for_model(
        model.config, num_slots=num_slots, max_len=max_len, dtype=torch.float64, device=device
    )


def test_slots_allocate_lowest_first_and_run_out() -> None:
    cache = KVCache(num_layers=1, num_slots=3, max_len=8, num_kv_heads=2, head_dim=4)
    assert [cache.allocate() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="no free slot"):
        cache.allocate()
    cache.free(1)
    cache.free(0)
    assert cache.allocate() == 0
    with pytest.raises(ValueError, match="not allocated"):
        cache.free(1)
    with pytest.raises(IndexError):
        cache.length(7)


def test_memory_per_token() -> None:
    cache = KVCache(num_layers=30, num_slots=2, max_len=16, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    assert cache.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46_080
    assert cache.nbytes == 46_080 * 2 * 16
    assert sum(t.numel() * t.element_size() for t in (*cache.keys, *cache.values)) == cache.nbytes


def test_rollback_equals_never_seen(model: Transformer) -> None:
    prompt, rejected, accepted = [5, 9, 13, 2, 77, 31], [40, 41, 42, 43, 44], [8, 120]
    seen = new_cache(model)
    slot = seen.allocate()
    feed(model, seen, slot, prompt)
    feed(model, seen, slot, rejected)
    seen.rollback(slot, len(prompt))
    after_rollback = feed(model, seen, slot, accepted)

    clean = new_cache(model)
    clean_slot = clean.allocate()
    feed(model, clean, clean_slot, prompt)
    expected = feed(model, clean, clean_slot, accepted)
    # Same pass shapes on the kept prefix, and stale entries are never read: bitwise equal.
    assert_same_state(seen, slot, clean, clean_slot, exact=True)
    assert torch.equal(after_rollback, expected)
    with pytest.raises(ValueError, match="cannot roll back"):
        seen.rollback(slot, seen.length(slot) + 1)


def test_copy_prefix_equals_feeding_the_prefix(model: Transformer) -> None:
    """A slot given another's first positions continues exactly as one that was fed them (a grown cache
    grows for it); what the source holds past them is not copied, and bad calls name the problem."""
    prompt, rest = [5, 9, 13, 2, 77, 31], [8, 120, 3]
    for grow in (False, True):
        device = model.embed_tokens.weight.device
        cache = KVCache.for_model(
            model.config, num_slots=3, max_len=32, dtype=torch.float64, device=device, grow=grow
        )
        source, target = cache.allocate(), cache.allocate()
        feed(model, cache, source, [*prompt, 40, 41])
        cache.copy_prefix(source, target, len(prompt) - 1)
        assert cache.length(target) == len(prompt) - 1
        copied = feed(model, cache, target, [*prompt[-1:], *rest])

        clean = new_cache(model)
        clean_slot = clean.allocate()
        expected = feed(model, clean, clean_slot, [*prompt, *rest])[len(prompt) - 1 :]
        assert_same_state(cache, target, clean, clean_slot)
        torch.testing.assert_close(copied, expected, atol=1e-10, rtol=0)
        with pytest.raises(ValueError, match="cannot copy 9 positions of slot 0"):
            cache.copy_prefix(source, target, 9)
        with pytest.raises(ValueError, match="cannot copy"):
            cache.copy_prefix(source, source, 2)
        with pytest.raises(ValueError, match="not allocated"):
            cache.copy_prefix(source, 2, 2)


def test_commit_path_equals_cache_that_saw_only_the_path(model: Transformer) -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    # Tree: 0 → {1, 2}; 2 → {3, 4}; 4 → {5}; 1 → {6}. Accepted path: 0, 2, 4, 5.
    tokens = [11, 60, 12, 61, 13, 14, 62]
    parents = [-1, 0, 0, 2, 2, 4, 1]
    path = [0, 2, 4, 5]
    assert tree_depths(torch.tensor(parents)).tolist() == [0, 1, 1, 2, 2, 3, 2]

    tree_cache = new_cache(model)
    slot = tree_cache.allocate()
    feed(model, tree_cache, slot, prompt)
    tree_logits = feed(model, tree_cache, slot, tokens, parents)
    assert tree_cache.length(slot) == len(prompt) + len(tokens)
    tree_cache.commit_path(slot, len(prompt), path)

    chain_cache = new_cache(model)
    chain_slot = chain_cache.allocate()
    feed(model, chain_cache, chain_slot, prompt)
    chain_logits = feed(model, chain_cache, chain_slot, [tokens[i] for i in path])
    assert_same_state(tree_cache, slot, chain_cache, chain_slot)
    # A node's logits only depend on its ancestors, so the path's rows agree with the chain's.
    torch.testing.assert_close(tree_logits[path], chain_logits, atol=1e-10, rtol=0)
    # And decoding continues identically.
    torch.testing.assert_close(
        feed(model, tree_cache, slot, [99]), feed(model, chain_cache, chain_slot, [99]), atol=1e-10, rtol=0
    )


def test_commit_path_chain_prefix_and_validation(model: Transformer) -> None:
    cache = new_cache(model)
    slot = cache.allocate()
    feed(model, cache, slot, [1, 2, 3])
    before = [t.clone() for t in slot_state(cache, slot)]
    feed(model, cache, slot, [4, 5, 6], [-1, 0, 1])
    cache.commit_path(slot, 3, [0, 1])  # a chain prefix: nothing moves
    assert cache.length(slot) == 5
    for old, new in zip(before, slot_state(cache, slot), strict=True):
        assert torch.equal(old, new[:, :3])
    with pytest.raises(ValueError, match="only 2 written"):
        cache.commit_path(slot, 3, [0, 1, 2])
    with pytest.raises(ValueError, match="must increase"):
        cache.commit_path(slot, 3, [1, 0])


# ---- a grown cache -------------------------------------------------------------------------------------


def test_grown_cache_reserves_in_chunks_keeps_content_and_releases_when_idle() -> None:
    cache = KVCache(num_layers=2, num_slots=16, max_len=1000, num_kv_heads=2, head_dim=4, grow=True)
    assert cache.nbytes == 0 and cache.max_nbytes == cache.bytes_per_token * 16 * 1000
    slots = [cache.allocate() for _ in range(5)]
    cache.reserve(5, 10)
    assert (cache.slot_capacity, cache.capacity) == (8, 64)  # rounded up to the chunks
    content = [torch.randn(5, 2, 10, 4) for _ in range(4)]
    for layer, data in zip((*cache.keys, *cache.values), content, strict=True):
        layer[:5, :, :10] = data
    cache.reserve(5, 65)  # past the length: half again (96), rounded up to the chunk
    assert (cache.slot_capacity, cache.capacity) == (8, 128)
    cache.set_length(slots[4], 130)  # a length claimed is a length stored
    assert cache.capacity == 192
    for layer, data in zip((*cache.keys, *cache.values), content, strict=True):
        assert torch.equal(layer[:5, :, :10], data)
        assert layer[:5, :, 10:].eq(0).all() and layer[5:].eq(0).all()  # new room is zeros, never garbage
    cache.reserve(9, 990)  # slots: half again (12); length: capped at max_len
    assert (cache.slot_capacity, cache.capacity) == (12, 1000)
    cache.reserve(15, 1)
    assert cache.slot_capacity == 16  # capped at num_slots
    with pytest.raises(ValueError, match="cannot reserve"):
        cache.reserve(17, 1)
    with pytest.raises(ValueError, match="cannot reserve"):
        cache.reserve(1, 1001)
    for slot in slots[:-1]:
        cache.free(slot)
    assert cache.capacity == 1000  # a slot still lives
    cache.free(slots[-1])
    assert cache.nbytes == 0 and cache.allocate() == 0

    static = KVCache(num_layers=2, num_slots=16, max_len=1000, num_kv_heads=2, head_dim=4)
    static.reserve(16, 1000)  # always fits
    static.free(static.allocate())
    assert static.nbytes == static.max_nbytes  # paid up front, kept


def test_compact_moves_live_slots_lowest_and_shrinks_a_grown_cache() -> None:
    cache = KVCache(num_layers=2, num_slots=16, max_len=100, num_kv_heads=2, head_dim=4, grow=True)
    slots = [cache.allocate() for _ in range(13)]
    cache.reserve(13, 10)
    for slot in slots:
        cache.set_length(slot, 1 + slot % 7)
    layers = lambda: (*cache.keys, *cache.values)  # noqa: E731
    for layer in layers():
        layer.normal_()
    kept = {slot: [layer[slot, :, : cache.length(slot)].clone() for layer in layers()] for slot in (5, 12)}
    for slot in slots:
        if slot not in kept:
            cache.free(slot)
    assert cache.sparse and cache.slot_capacity == 16
    assert cache.compact() == {5: 0, 12: 1}
    assert not cache.sparse and (cache.slot_capacity, cache.capacity) == (4, 64)
    for old, new in ((5, 0), (12, 1)):
        assert cache.length(new) == 1 + old % 7
        for layer, data in zip(layers(), kept[old], strict=True):
            assert torch.equal(layer[new, :, : cache.length(new)], data)
    with pytest.raises(ValueError, match="not allocated"):
        cache.length(5)
    assert [cache.allocate(), cache.allocate()] == [2, 3]
    assert cache.compact() == {} and cache.slot_capacity == 4  # nothing to move: unchanged

    static = KVCache(num_layers=2, num_slots=16, max_len=100, num_kv_heads=2, head_dim=4)
    slots = [static.allocate() for _ in range(13)]
    for slot in slots[:-1]:
        static.free(slot)
    assert not static.sparse  # a static cache keeps its slots (CUDA graphs want stable addresses)


def test_grown_cache_computes_exactly_what_a_static_one_does(model: Transformer) -> None:
    """Prefill past a chunk, a tree pass and its commit, two-slot decodes across growth: bitwise equal
    logits and state (only the storage's size differs)."""
    device = model.embed_tokens.weight.device
    caches = [
        new_cache(model, num_slots=8, max_len=400),
        KVCache.for_model(
            model.config, num_slots=8, max_len=400, dtype=torch.float64, device=device, grow=True
        ),
    ]
    logits: list[list[torch.Tensor]] = [[], []]
    for cache, out in zip(caches, logits, strict=True):
        a, b = cache.allocate(), cache.allocate()
        out.append(feed(model, cache, a, [(7 * i) % 150 for i in range(70)]))
        out.append(feed(model, cache, b, [3, 1, 4, 1, 5]))
        out.append(feed(model, cache, b, [11, 60, 12, 61, 13], [-1, 0, 0, 2, 2]))
        cache.commit_path(b, 5, [0, 2, 4])
        for step in range(60):  # a and b decode together: one padded call reading both slots
            layout = BatchLayout.build(cache, [a, b], [1, 1], logit_rows=[0, 1])
            ids = torch.tensor([step % 150, (step * 3) % 150], device=device)
            out.append(model(ids, layout.positions, layout, cache)[0])
    static, grown = caches
    assert grown.capacity < static.capacity and grown.slot_capacity < static.slot_capacity
    for x, y in zip(*logits, strict=True):
        assert torch.equal(x, y)
    for slot in (0, 1):
        assert_same_state(static, slot, grown, slot, exact=True)
