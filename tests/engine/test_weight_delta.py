"""XOR deltas (engine/weight_delta.py): bitwise round trips for every float width, special values included
(NaN payloads, -0.0, infinities, subnormals), a small update costs far less than the tensor, and a blob
that does not fit or is corrupt fails with an error naming the problem."""

from __future__ import annotations

import pytest
import torch

from slipstream.engine.weight_delta import apply_xor_delta, blob_tensor, xor_delta

FLOATS = [torch.float32, torch.bfloat16, torch.float16]
INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def specials(dtype: torch.dtype) -> torch.Tensor:
    """NaNs with distinct payloads and signs, ±0.0, ±inf, the smallest subnormal, ordinary values."""
    width = torch.finfo(dtype).bits
    itype = INT_OF[dtype]
    exp_all_ones = {32: 0x7F800000, 16: 0x7C00 if dtype == torch.float16 else 0x7F80}[width]
    sign = -(1 << (width - 1))  # the sign bit, as a negative number of the signed view
    payloads = [exp_all_ones | 1, exp_all_ones | 3, exp_all_ones | (exp_all_ones >> 1 & ~exp_all_ones)]
    raw = [*payloads, sign | payloads[0], 0, sign, 1, exp_all_ones, sign | exp_all_ones]
    nans = torch.tensor(raw, dtype=torch.int64).to(itype).view(dtype)
    return torch.cat([nans, torch.tensor([1.5, -2.25, 3e-3], dtype=dtype)])


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_random_bit_patterns_round_trip_bitwise(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    size = 4096 * torch.empty((), dtype=dtype).element_size()
    prev, new = (torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).view(dtype) for _ in "ab")
    assert prev.isnan().any() and new.isnan().any()  # arbitrary bits: NaNs of many payloads on both sides
    out = apply_xor_delta(prev, xor_delta(prev, new))
    assert out.dtype == dtype and out.shape == new.shape == (4096,)
    assert torch.equal(bits(out), bits(new))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_special_values_survive_in_both_directions(dtype: torch.dtype) -> None:
    values = specials(dtype)
    assert values.isnan().sum() == 4 and len(set(values[:4].view(INT_OF[dtype]).tolist())) == 4  # 4 payloads
    ordinary = torch.linspace(-1, 1, values.numel()).to(dtype)
    for prev, new in ((ordinary, values), (values, ordinary), (values, values.flip(0))):
        out = apply_xor_delta(prev, xor_delta(prev, new))
        assert torch.equal(bits(out), bits(new))
    # -0.0 and +0.0 compare equal as floats: only the bits tell them apart.
    zero, neg_zero = torch.zeros(3, dtype=dtype), torch.full((3,), -0.0, dtype=dtype)
    out = apply_xor_delta(zero, xor_delta(zero, neg_zero))
    assert torch.equal(bits(out), bits(neg_zero)) and not torch.equal(bits(out), bits(zero))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_a_small_update_costs_a_fraction_of_the_tensor(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    prev = (0.05 * torch.randn(256, 1024, generator=gen)).to(dtype)
    new = (prev.float() + 2e-5 * torch.randn(256, 1024, generator=gen).sign()).to(dtype)
    raw = prev.numel() * prev.element_size()
    blob = xor_delta(prev, new)
    assert torch.equal(bits(apply_xor_delta(prev, blob)), bits(new))
    assert len(blob) < 0.6 * raw, (len(blob), raw)  # only low mantissa bits differ
    assert len(xor_delta(prev, prev)) < raw / 100  # nothing changed: all-zero planes


def test_non_contiguous_empty_and_wire_tensors() -> None:
    base = torch.randn(32, 16)
    prev, new = base.t(), (base + 1).t()  # [16, 32] views, not contiguous
    blob = xor_delta(prev, new, threads=2)
    assert torch.equal(apply_xor_delta(prev, blob), new)
    assert torch.equal(apply_xor_delta(prev, blob_tensor(blob)), new)  # as it arrives on the wire
    empty = torch.empty(0, 4, dtype=torch.bfloat16)
    assert apply_xor_delta(empty, xor_delta(empty, empty)).shape == (0, 4)


def test_mismatched_tensors_are_refused_naming_both() -> None:
    a = torch.zeros(4, 4)
    with pytest.raises(ValueError, match=r"base is torch.float32 \(4, 4\), new is torch.bfloat16 \(4, 4\)"):
        xor_delta(a, a.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"base is torch.float32 \(4, 4\), new is torch.float32 \(16,\)"):
        xor_delta(a, a.reshape(-1))
    with pytest.raises(ValueError, match="complex128 elements are 16 bytes"):
        xor_delta(torch.zeros(2, dtype=torch.complex128), torch.ones(2, dtype=torch.complex128))


def test_a_blob_that_does_not_fit_or_is_corrupt_fails_naming_the_problem() -> None:
    prev = torch.randn(1000)
    blob = xor_delta(prev, prev + 1e-3)
    with pytest.raises(ValueError, match=r"the blob holds 4000 bytes, the base torch.float32 \(10,\) has 40"):
        apply_xor_delta(prev[:10], blob)
    with pytest.raises(
        ValueError, match=r"the blob holds 4000 bytes, the base torch.bfloat16 \(1000,\) has 2000"
    ):
        apply_xor_delta(prev.to(torch.bfloat16), blob)
    with pytest.raises(ValueError, match="not a zstd frame"):
        apply_xor_delta(prev, b"not a delta at all")
    with pytest.raises(ValueError, match="corrupt blob"):
        apply_xor_delta(prev, blob[:-8])  # truncated
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0x04  # one bit in the compressed body: zstd's content checksum sees it
    with pytest.raises(ValueError, match="corrupt blob"):
        apply_xor_delta(prev, bytes(flipped))
    with pytest.raises(ValueError, match="a blob tensor is 1-D uint8"):
        apply_xor_delta(prev, torch.zeros(4, dtype=torch.int32))


def test_a_delta_applies_on_the_bases_device(device: torch.device) -> None:
    """A rollout on a GPU decodes against the weights it holds there: the result stays on that device."""
    prev = torch.randn(64, 32).to(torch.bfloat16)
    new = (prev.float() + 1e-2).to(torch.bfloat16)
    out = apply_xor_delta(prev.to(device), blob_tensor(xor_delta(prev, new)))
    assert out.device == device and torch.equal(bits(out.cpu()), bits(new))
