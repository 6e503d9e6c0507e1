"""The codec's shared-memory lane: large tensors as descriptors, small ones unchanged, bad refs rejected."""

import os

import msgspec
import pytest
import torch

from slipstream.runtime.codec import Codec, ProtocolError
from slipstream.runtime.shm import ShmArena, ShmReader, cleanup
from tests.protocols.samples import samples


@pytest.fixture
def arena():
    tag = f"test-codec-{os.getpid()}"
    with ShmArena(tag, slot_bytes_max=16 << 20, capacity_bytes=64 << 20) as a:
        yield a
    cleanup(tag)


def weights(*tensors: torch.Tensor) -> object:
    names = [f"t{i}" for i in range(len(tensors))]
    return msgspec.structs.replace(samples()["learner.weights"], tensors=list(tensors), names=names)


def test_large_tensors_take_the_lane_small_ones_do_not(arena: ShmArena) -> None:
    sender, receiver = Codec(shm=arena, shm_min_bytes=1 << 20), Codec(shm_reader=ShmReader())
    big, mid, small = (
        torch.randn(1 << 19).bfloat16(),
        torch.randn(1 << 16),
        torch.randn(8),
    )  # 1 MiB, 256 KiB, 32 B
    frames = sender.encode(weights(big, mid, small))
    assert len(frames) == 3  # kind, body, and one zmq frame for `mid`; `big` is a descriptor in the body
    out = receiver.decode(frames).tensors
    assert all(torch.equal(o, t) for o, t in zip(out, (big, mid, small), strict=True))
    assert arena.busy_slots() == 1
    del out
    assert arena.busy_slots() == 0  # freeing the received tensor released the slot: no message needed


def test_lane_reference_without_reader_is_a_protocol_error(arena: ShmArena) -> None:
    frames = Codec(shm=arena, shm_min_bytes=1 << 10).encode(weights(torch.randn(1 << 12)))
    with pytest.raises(ProtocolError, match="without a shared-memory reader"):
        Codec().decode(frames)


def test_forged_lane_reference_is_a_protocol_error() -> None:
    body = msgspec.msgpack.encode([1, 0, 1, ["w"], [["float32", [4], ["/etc/passwd", 0, 16, 0, 1]]], "x"])
    with pytest.raises(ProtocolError, match="bad shared-memory tensor reference"):
        Codec(shm_reader=ShmReader()).decode([b"learner.weights", body])
