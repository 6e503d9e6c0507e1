"""The one weight receiver (engine/weight_receiver.py): every verdict a pushed bucket can get, against the
version held, in full and as XOR deltas. The actors' own tests run it in the rollout and the drafter."""

from __future__ import annotations

import pytest
import torch

from slipstream.engine.weight_delta import blob_tensor, xor_delta
from slipstream.engine.weight_receiver import XOR_ZSTD, WeightReceiver
from slipstream.protocols.learner import XOR_ZSTD as WIRE_XOR_ZSTD
from slipstream.runtime.codec import checksum

NAMES = ["a", "b"]


def receiver(held: dict[str, torch.Tensor], version: int = 3) -> WeightReceiver:
    return WeightReceiver(
        expected={n: (t.shape, t.dtype) for n, t in held.items()},
        base=lambda n: held[n],
        checksum=checksum,
        version=version,
    )


def bucket(tensors: list[torch.Tensor], version: int, **fields: object) -> dict[str, object]:
    out = {
        "version": version, "bucket": 0, "num_buckets": 2, "names": NAMES, "tensors": tensors,
        "checksum": checksum(NAMES, tensors),
    }  # fmt: skip
    return out | fields


@pytest.fixture
def held() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"a": torch.randn(4, 3, generator=gen), "b": torch.randn(5, generator=gen)}


def test_the_wire_and_the_engine_name_the_delta_encoding_alike() -> None:
    assert XOR_ZSTD == WIRE_XOR_ZSTD


def test_full_buckets(held: dict[str, torch.Tensor]) -> None:
    r = receiver(held)
    new = [held["a"] + 1, held["b"] + 1]
    verdict = r.receive(**bucket(new, 4))
    assert verdict.kind == "accepted" and not verdict.decoded and verdict.tensors is not None
    assert all(torch.equal(x, y) for x, y in zip(verdict.tensors, new, strict=True))
    assert r.receive(**bucket(new, 3)).kind == "duplicate"  # the version held: a re-push after a restart
    for fields, why in (
        ({"version": 2}, "version 2 is not newer than the loaded version 3"),
        ({"bucket": 2}, "out of range for num_buckets 2"),
        ({"checksum": "0" * 64}, "checksum mismatch"),
        ({"names": ["a", "c"]}, "'c' is not one of ['a', 'b']"),
        ({"tensors": [held["a"][:1] + 1, held["b"] + 1]}, "a: got (1, 3)"),
        (
            {"tensors": [held["a"].double() + 1, held["b"] + 1]},
            "torch.float64, expected (4, 3) torch.float32",
        ),
        ({"names": ["a"]}, "1 names for 2 tensors"),
    ):
        version = fields.pop("version", 5)
        tensors = fields.get("tensors", new)
        verdict = r.receive(**(bucket(tensors, version) | fields))  # type: ignore[arg-type]
        assert verdict.kind == "refused" and not verdict.want_full and why in (verdict.error or ""), why
    r.applied(4)
    assert r.version == 4 and r.receive(**bucket(new, 4)).kind == "duplicate"


def test_delta_buckets(held: dict[str, torch.Tensor]) -> None:
    r = receiver(held)
    new = [held["a"] + 1, held["b"] - 1]
    blobs = [blob_tensor(xor_delta(held[n], t)) for n, t in zip(NAMES, new, strict=True)]
    delta = bucket(blobs, 4, encoding=XOR_ZSTD, base_version=3, checksum=checksum(NAMES, new))
    verdict = r.receive(**delta)
    assert verdict.kind == "accepted" and verdict.decoded and verdict.tensors is not None
    assert all(torch.equal(x, y) for x, y in zip(verdict.tensors, new, strict=True))
    # Decoding it again would XOR a base that may be overwritten by now: dropped.
    assert r.receive(**delta).kind == "dropped"
    # Against another base, or decoding to other bits (a wrong base the version numbers missed): refused
    # with want_full, once; the version's later deltas are dropped, a full push of it is taken.
    other = receiver(held, version=2)
    verdict = other.receive(**delta)
    assert (
        verdict.kind == "refused"
        and verdict.want_full
        and "against v3, this rollout holds v2" in (verdict.error or "")
    )
    assert other.receive(**(delta | {"bucket": 1})).kind == "dropped"
    assert other.receive(**bucket(new, 4, bucket=1)).kind == "accepted"
    wrong_bits = receiver({n: t + 7 for n, t in held.items()})
    verdict = wrong_bits.receive(**delta)
    assert verdict.kind == "refused" and verdict.want_full and "checksum mismatch" in (verdict.error or "")
    for fields, why in (
        ({"encoding": "lz4"}, "unknown weight encoding 'lz4'"),
        ({"tensors": [torch.zeros(3, dtype=torch.uint8), blobs[1]]}, "undecodable delta"),
        ({"names": ["a", "zz"]}, "'zz' is not one of"),
    ):
        fresh = receiver(held)
        verdict = fresh.receive(**(delta | fields))  # type: ignore[arg-type]
        assert verdict.kind == "refused" and verdict.want_full and why in (verdict.error or ""), why
    # A delta of a version not newer than the one held: refused, the full version would not help.
    stale = receiver(held, version=5)
    verdict = stale.receive(**delta)
    assert verdict.kind == "refused" and not verdict.want_full


def test_held_names_shape_the_messages(held: dict[str, torch.Tensor]) -> None:
    r = WeightReceiver(
        expected={n: (t.shape, t.dtype) for n, t in held.items()}, base=lambda n: held[n], checksum=checksum,
        version=3, held_as="the head's {}", holds="the head is v{}",
    )  # fmt: skip
    assert "not newer than the head's 3" in (r.receive(**bucket([held["a"], held["b"]], 1)).error or "")
