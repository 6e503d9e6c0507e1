"""Online drafter buffer: byte bound and eviction, bf16 storage, newest-first order with the long responses
of earlier policy versions mixed in, cropping, the completion window's alignment, and batches moving to the
training device."""

from __future__ import annotations

import itertools

import pytest
import torch

from slipstream.engine.buffer import OnlineBuffer, completion_window
from slipstream.engine.generator import Completion

D = 8


def seq(length: int, fill: float, response_start: int = 1) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A sequence whose tokens are `fill` rounded and whose states all equal `fill` (easy to trace)."""
    return torch.full((length,), int(fill), dtype=torch.int64), torch.full((length, D), fill), response_start


def test_eviction_by_bytes_oldest_first() -> None:
    per_token = 4 + 2 * D  # int32 token + bf16 state
    buffer = OnlineBuffer(max_bytes=10 * 10 * per_token)  # room for ten sequences of ten tokens
    for i in range(12):
        buffer.add(*seq(10, i), policy_version=0)
    stats = buffer.stats()
    assert (stats.sequences, stats.tokens, stats.bytes) == (10, 100, 100 * per_token)
    batch = buffer.sample_batch(10_000)
    assert batch is not None and sorted(set(batch.token_ids.tolist())) == list(range(2, 12))  # 0 and 1 left
    buffer.add(*seq(45, 99), policy_version=0)  # one big arrival evicts several small ones
    assert buffer.stats().bytes <= buffer.max_bytes and buffer.stats().sequences == 6
    with pytest.raises(ValueError, match="exceeds"):
        buffer.add(*seq(101, 1), policy_version=0)


def test_bf16_storage_and_explicit_dtype() -> None:
    hidden = torch.randn(6, D)
    small, full = OnlineBuffer(1 << 20), OnlineBuffer(1 << 20, dtype=torch.float32)
    for buffer in (small, full):
        buffer.add(torch.arange(6), hidden, 2, policy_version=3)
    a, b = small.sample_batch(64), full.sample_batch(64)
    assert a is not None and b is not None
    assert a.hidden.dtype == torch.bfloat16 and torch.equal(a.hidden, hidden.to(torch.bfloat16))
    assert b.hidden.dtype == torch.float32 and torch.equal(b.hidden, hidden)
    assert small.stats().bytes == 6 * 4 + 6 * D * 2 and full.stats().bytes == 6 * 4 + 6 * D * 4
    assert a.token_ids.dtype == torch.int64 and a.response_starts == (2,) and a.policy_versions == (3,)
    hidden.zero_()  # the buffer holds its own copy
    assert small.sample_batch(64).hidden.abs().sum() > 0  # type: ignore[union-attr]


def test_newest_first_then_walks_back_and_restarts_on_arrival() -> None:
    buffer = OnlineBuffer(1 << 20)
    for i in range(6):
        buffer.add(*seq(10, i), policy_version=0)

    def order(batch) -> list[int]:
        return [int(batch.token_ids[a]) for a in batch.cu_seqlens[:-1]]

    assert order(buffer.sample_batch(30)) == [5, 4, 3]
    assert order(buffer.sample_batch(30)) == [2, 1, 0]
    assert order(buffer.sample_batch(30)) == [5, 4, 3]  # wraps around
    buffer.add(*seq(10, 6), policy_version=0)
    assert order(buffer.sample_batch(20)) == [6, 5]  # new data first again
    batch = buffer.sample_batch(25)
    assert batch.cu_seqlens == (0, 10, 20, 25) and batch.num_seqs == 3 and batch.num_tokens == 25


def test_long_responses_of_previous_versions_are_mixed_in() -> None:
    buffer = OnlineBuffer(1 << 20, long_share=0.4)
    lengths_v0 = [12, 80, 30, 60, 20]
    for i, length in enumerate(lengths_v0):
        buffer.add(*seq(length, 100 + i), policy_version=0)
    for i in range(20):
        buffer.add(*seq(10, i), policy_version=1)  # the current version: short responses, newest last
    batch = buffer.sample_batch(200)
    assert batch is not None
    versions = batch.policy_versions
    sizes = [b - a for a, b in itertools.pairwise(batch.cu_seqlens)]
    old_tokens = sum(n for n, v in zip(sizes, versions, strict=True) if v == 0)
    assert old_tokens == 80  # 40% of 200 rows: the longest earlier response, whole
    assert int(batch.token_ids[0]) == 101  # (index 1: length 80)
    fresh = [int(batch.token_ids[a]) for a, v in zip(batch.cu_seqlens, versions, strict=False) if v == 1]
    assert fresh == list(range(19, 7, -1))  # then the current version, newest first
    # The next batch takes the next-longest earlier responses.
    nxt = buffer.sample_batch(200)
    assert int(nxt.token_ids[0]) == 103  # length 60
    # Without an earlier version every row is current.
    only = OnlineBuffer(1 << 20, long_share=0.4)
    only.add(*seq(10, 1), policy_version=5)
    assert only.sample_batch(100).policy_versions == (5,)


def test_current_version_short_of_rows_is_filled_from_earlier_ones() -> None:
    buffer = OnlineBuffer(1 << 20, long_share=0.1)
    for i, length in enumerate([40, 50]):
        buffer.add(*seq(length, 100 + i), policy_version=0)
    buffer.add(*seq(10, 1), policy_version=1)
    batch = buffer.sample_batch(100)
    # 10 rows (the long share) cropped from the longest, the current sequence, then the rest of version 0;
    # a sequence appears at most once per batch.
    assert batch.policy_versions == (0, 1, 0) and batch.cu_seqlens == (0, 10, 20, 60)


def test_long_sequences_are_cropped_to_the_batch() -> None:
    buffer = OnlineBuffer(1 << 20, seed=1)
    tokens, hidden = torch.arange(50), torch.arange(50.0)[:, None].repeat(1, D)
    buffer.add(tokens, hidden, 20, policy_version=0)
    for _ in range(5):
        batch = buffer.sample_batch(16)
        assert batch.num_tokens == 16
        first = int(batch.token_ids[0])
        assert batch.token_ids.tolist() == list(range(first, first + 16))
        assert torch.equal(batch.hidden[:, 0].float(), torch.arange(first, first + 16.0))
        assert batch.response_starts == (max(20 - first, 0),)


def test_completion_window_is_row_aligned() -> None:
    hidden = torch.arange(4.0)[:, None].repeat(1, D)  # state j sampled response token j
    completion = Completion(
        request_id="a", prompt_ids=[7, 8, 9], token_ids=[10, 11, 12, 13], logprobs=[0.0] * 4,
        finish_reason="length", hidden=hidden,
    )  # fmt: skip
    window = completion_window(completion)
    assert window is not None
    tokens, states, response_start = window
    # Row i holds the state at token i: the last prompt token's state sampled the first response token.
    assert tokens.tolist() == [9, 10, 11, 12] and torch.equal(states, hidden) and response_start == 1
    buffer = OnlineBuffer(1 << 20)
    assert buffer.add_completion(completion, policy_version=2)
    no_states = Completion(
        request_id="b", prompt_ids=[1], token_ids=[2, 3], logprobs=[0.0, 0.0], finish_reason="stop"
    )
    assert not buffer.add_completion(no_states, policy_version=2) and len(buffer) == 1


def test_validation() -> None:
    buffer = OnlineBuffer(1 << 20)
    with pytest.raises(ValueError, match="hidden must be"):
        buffer.add(torch.arange(4), torch.zeros(3, D), 1, policy_version=0)
    with pytest.raises(ValueError, match="at least 2"):
        buffer.add(torch.arange(1), torch.zeros(1, D), 0, policy_version=0)
    with pytest.raises(ValueError, match="response_start"):
        buffer.add(torch.arange(4), torch.zeros(4, D), 4, policy_version=0)
    buffer.add(torch.arange(4), torch.zeros(4, D), 1, policy_version=0)
    with pytest.raises(ValueError, match="width"):
        buffer.add(torch.arange(4), torch.zeros(4, D + 1), 1, policy_version=0)
    assert OnlineBuffer(1 << 20).sample_batch(8) is None
    with pytest.raises(ValueError):
        OnlineBuffer(0)


def test_batches_move_to_the_training_device_while_the_buffer_stays_on_the_host(device: torch.device) -> None:
    buf = OnlineBuffer(1 << 20)
    buf.add(*seq(6, 1.0), policy_version=0)
    buf.add(torch.arange(5), torch.randn(5, D, device=device), 2, policy_version=1)
    assert all(e.hidden.device.type == "cpu" for e in buf._entries)  # host memory, whatever the device
    batch = buf.sample_batch(16)
    assert batch is not None and batch.hidden.device.type == "cpu"
    moved = batch.to(device)
    assert moved.token_ids.device == moved.hidden.device == device
    assert torch.equal(moved.hidden.cpu(), batch.hidden) and torch.equal(
        moved.token_ids.cpu(), batch.token_ids
    )
    assert (moved.cu_seqlens, moved.response_starts, moved.policy_versions) == (
        batch.cu_seqlens,
        batch.response_starts,
        batch.policy_versions,
    )
