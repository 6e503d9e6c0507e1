"""Bad input: every malformed message raises ProtocolError naming what was wrong — never anything else."""

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.runtime.codec import Codec, ProtocolError
from tests.protocols.samples import samples

codec = Codec(max_frame_bytes=1 << 20, max_message_bytes=2 << 20)


def big_message() -> list[bytes]:
    msg = msgspec.structs.replace(samples()["learner.weights"], tensors=[torch.randn(4096)])
    return [bytes(f) for f in codec.encode(msg)]


def body(kind: str) -> bytes:
    return bytes(codec.encode(samples()[kind])[1])


CASES = {
    "no frames": ([], "truncated message"),
    "kind only": ([b"control.ping"], "truncated message"),
    "unknown kind": ([b"control.nope", body("control.ping")], "unknown message kind"),
    "truncated body": ([b"control.hello", body("control.hello")[:-3]], "malformed body"),
    "tensor frame missing": (big_message()[:2], "references frame 0"),
    "extra frame": ([*big_message(), b"\x00" * 8], "not referenced"),
    "truncated tensor frame": ([*big_message()[:2], big_message()[2][:-4]], "needs 16384 bytes"),
    "wrong body shape": ([b"control.ping", msgspec.msgpack.encode([1])], "malformed body"),
    "wrong field type": ([b"control.ping", msgspec.msgpack.encode(["one", 2])], "Expected `int`"),
    "negative where >= 0": ([b"control.ping", msgspec.msgpack.encode([-1, 2])], ">= 0"),
    "body is a map": ([b"control.ping", msgspec.msgpack.encode({"seq": 1, "sent_ns": 2})], "malformed body"),
    "oversized tensor header": (
        [
            b"learner.weights",
            msgspec.msgpack.encode([1, 0, 1, ["w"], [["float32", [1 << 20, 1 << 20], 0]], "x"]),
            b"\x00" * 16,
        ],
        "oversized tensor header",
    ),
    "unknown dtype": (
        [
            b"learner.weights",
            msgspec.msgpack.encode([1, 0, 1, ["w"], [["float128", [1], b"\x00" * 16]], "x"]),
        ],
        "unknown tensor dtype",
    ),
    "bad shape": (
        [b"learner.weights", msgspec.msgpack.encode([1, 0, 1, ["w"], [["float32", [-1], b""]], "x"])],
        "bad tensor shape",
    ),
    "inline bytes too short": (
        [b"learner.weights", msgspec.msgpack.encode([1, 0, 1, ["w"], [["float32", [4], b"\x00" * 15]], "x"])],
        "needs 16 bytes, got 15",
    ),
    "frame referenced twice": (
        [
            b"learner.weights",
            msgspec.msgpack.encode([1, 0, 2, ["a", "b"], [["float32", [2], 0], ["float32", [2], 0]], "x"]),
            b"\x00" * 8,
        ],
        "referenced twice",
    ),
    "oversized frame": ([b"control.ping", body("control.ping"), b"\x00" * ((1 << 20) + 1)], "over the limit"),
    "bad enum value": (
        [
            b"rollout.completion",
            msgspec.msgpack.encode([1, 0, ["int64", [0], b""], ["float32", [0], b""], "finished", 1, 0.0]),
        ],
        "Invalid enum value 'finished'",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_raises_protocol_error_naming_problem(case: str) -> None:
    frames, expected = CASES[case]
    with pytest.raises(ProtocolError, match=expected.replace("[", r"\[").replace("(", r"\(")):
        codec.decode(frames)


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(sorted(samples())), st.binary(max_size=256), st.lists(st.binary(max_size=64), max_size=3)
)
def test_random_bytes_never_escape_as_anything_but_protocol_error(
    kind: str, body: bytes, extra: list[bytes]
) -> None:
    try:
        codec.decode([kind.encode(), body, *extra])
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=128), max_size=5))
def test_random_frames_never_escape(frames: list[bytes]) -> None:
    try:
        codec.decode(frames)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(samples())), st.data())
def test_mutated_valid_bodies(kind: str, data: st.DataObject) -> None:
    """Flip bytes inside real bodies: the decoder must reject or accept cleanly, never crash."""
    frames = [bytes(f) for f in codec.encode(samples()[kind])]
    b = bytearray(frames[1])
    for _ in range(data.draw(st.integers(1, 4))):
        b[data.draw(st.integers(0, len(b) - 1))] = data.draw(st.integers(0, 255))
    try:
        codec.decode([frames[0], bytes(b), *frames[2:]])
    except ProtocolError:
        pass
