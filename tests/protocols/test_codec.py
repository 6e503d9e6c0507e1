"""Codec: round trips for every message and dtype, golden bytes per message, exact frame counts."""

import msgspec
import pytest
import torch

from slipstream.runtime.codec import DTYPES, Codec, registry
from tests.protocols.samples import equal, samples

# The MessagePack body of each sample message. A change here is a wire-format change: bump
# PROTOCOL_VERSION and update deliberately.
GOLDEN = {
    "control.hello": "98a7726f6c6c6f757401cd1092a66e6f64652d61ac6970633a2f2f2f746d702f780100a0",
    "control.init": (
        "9881a26c72cb3eb0c6f7a0b5ed8da82f72756e732f723181a9726f6c6c6f75743a30ad6970633a2f2f2f746d702f7230"
        "cb3fe000000000000002c20000"
    ),
    "control.ready": "92a7726f6c6c6f757401",
    "control.heartbeat": "9507ce075bcd15030100",
    "control.ping": "920163",
    "control.pong": "920163",
    "control.status": (
        "92a870726f677265737385a47374657003a46c6f7373cb3fe0000000000000a26f6bc3a46e6f7465a178a46e6f6e65c0"
    ),
    "control.idle": "93a7726f6c6c6f75740004",
    "control.lease": "9409a56370753a30019100",
    "control.preempt": "9309a97374657020646f6e6505",
    "control.released": "9209cd03e8",
    "control.shutdown": "91a4646f6e65",
    "control.checkpoint": "9204d92172756e2f636865636b706f696e74732f737465702d342f6c6561726e65722e7074",
    "control.dead": "94a76472616674657200a34f4f4dcc89",
    "rollout.sampling": "95cb3fe6666666666666cb3feccccccccccccd14cc809102",
    "rollout.generate": (
        "9a0393a5696e7436349106c4300000000000000000010000000000000002000000000000000300000000000000040000"
        "00000000000500000000000000040b95cb3fe6666666666666cb3feccccccccccccd14cc8091020290ae7b22616e7377"
        "6572223a2232227da96c6561726e65723a3001"
    ),
    "rollout.completion": (
        "9f030193a5696e7436349103c41805000000000000000600000000000000070000000000000093a7666c6f6174333291"
        "03c40c000000bf00000000000080bea473746f7002cb400400000000000093a4626f6f6c9103c40301000193a5696e74"
        "36349102c4100100000000000000020000000000000002cb3fe8000000000000cb3ff0000000000000c0b23c616e7377"
        "65723e323c2f616e737765723e01"
    ),
    "rollout.iteration": "9b000a04a86e6772616d3a643410090dcb3fa999999999999a9090cb0000000000000000",
    "reward.score": "960301a4312b313fb23c616e737765723e323c2f616e737765723eae7b22616e73776572223a2232227d02",
    "reward.reward": "960301c0b374696d656f757420616674657220322e302073cb400000000000000002",
    "reward.calls": "9181a56a7564676595020ccb3ff80000000000000801",
    "learner.receipt": (
        "9d030103a473746f7002cb4004000000000000b23c616e737765723e323c2f616e737765723eb0303066663030666630"
        "3066663030666602cb3fd0000000000000cb3ff0000000000000c001"
    ),
    "learner.weights": "9903000191a1779193a862666c6f61743136920202c408803f803f803f803fa3616263a00090",
    "learner.weights_ack": "9603a7726f6c6c6f757400c3c0c2",
    "learner.push": "940391a9726f6c6c6f75743a3191a9647261667465723a3181a9726f6c6c6f75743a3102",
    "learner.train": (
        "98010291930393a5696e7436349104c42000000000000000000100000000000000020000000000000003000000000000"
        "0092cb3ff0000000000000c0cb3fe6666666666666cb3feccccccccccccd14b872756e2f73616d706c65732f73746570"
        "2d312e6a736f6e6cc2"
    ),
    "learner.step": (
        "970103cb3fd0000000000000cb3ff800000000000064cb400000000000000081aa726174696f5f6d65616ecb3f"
        "f0000000000000"
    ),
    "drafter.hidden": (
        "96030193a5696e7436349103c41800000000000000000100000000000000020000000000000093a862666c6f61"
        "743136920302c40c003f003f003f003f003f003f0102"
    ),
    "drafter.update": "95010291a266639193a7666c6f617431369102c40400000000a164",
    "drafter.stats": "9600010acb3fe0000000000000cd03e8cb3ff0000000000000",
    "drafter.delta": "9901040203cd012ccb3fe0000000000000c291a266639193a7666c6f617433329102c408000000bf000000bf",
    "control.peers": "9181a9726f6c6c6f75743a31ad6970633a2f2f2f746d702f7231",
    "node.hello": "9701a66e6f64652d62a831302e302e302e324d100805",
    "node.launch": (
        "97a9726f6c6c6f75743a33d926736c697073747265616d2e6163746f72732e726f6c6c6f75743a526f6c6c6f75744163746f72"
        "0381af4f4d505f4e554d5f54485245414453a1319103cd734fcb405e000000000000"
    ),
    "node.launched": "93a9726f6c6c6f75743a33cd10e1a0",
    "node.exited": "93a9726f6c6c6f75743a33cd10e1f7",
    "node.kill": "92a9726f6c6c6f75743a3309",
    "node.stop": "91a4646f6e65",
    "control.checkpoint_saved": (
        "9404d92172756e2f636865636b706f696e74732f737465702d342f6c6561726e65722e707404a0"
    ),
    "control.failed": "92b2636f6e74726f6c2e636865636b706f696e74b456616c75654572726f723a206261642070617468",
    "learner.pushed": "9603c264286401",
    "drafter.head_ack": "950003c2b26275636b657420303a20636865636b73756da0",
    "environment.answer": (
        "99af726f6c6c6f75743a302f333a312f3001b23c726573756c743e323c2f726573756c743ea4746f6f6cc3cb3ff00000"
        "00000000c0c2cb3fe0000000000000"
    ),
    "environment.close": ("91af726f6c6c6f75743a302f333a312f30"),
    "environment.open": ("92af726f6c6c6f75743a302f333a312f30b37b227175657374696f6e223a22312b313f227d"),
    "environment.opened": (
        "95af726f6c6c6f75743a302f333a312f309182a4726f6c65a475736572a7636f6e74656e74a4312b313f91a73c2f6361"
        "6c633ec0a534312d6162"
    ),
    "environment.turn": ("94af726f6c6c6f75743a302f333a312f3001b03c63616c633e312b313c2f63616c633e920506"),
    "environment.up": ("91a534312d6162"),
    "environment.rollout_up": ("92a9726f6c6c6f75743a30a534322d6364"),
}


@pytest.fixture
def codec() -> Codec:
    return Codec()


def test_every_registered_kind_has_a_sample() -> None:
    assert set(registry()) == set(samples())


@pytest.mark.parametrize("kind", sorted(samples()))
def test_round_trip(codec: Codec, kind: str) -> None:
    msg = samples()[kind]
    frames = codec.encode(msg)
    assert bytes(frames[0]) == kind.encode()
    assert equal(codec.decode(frames), msg)


@pytest.mark.parametrize("kind", sorted(samples()))
def test_golden_bytes(codec: Codec, kind: str) -> None:
    assert bytes(codec.encode(samples()[kind])[1]).hex() == GOLDEN[kind]


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (600, 3)])
def test_every_dtype_round_trips(codec: Codec, name: str, shape: tuple[int, ...]) -> None:
    dtype = DTYPES[name]
    raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8)  # fmt: skip
    t = raw.view(dtype).reshape(shape)  # arbitrary bit patterns: NaNs too, compared bitwise below
    msg = msgspec.structs.replace(samples()["learner.weights"], tensors=[t])
    frames = codec.encode(msg)
    out = codec.decode(frames).tensors[0]
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out.reshape(-1).view(torch.uint8), raw)
    big = raw.numel() > codec.inline_bytes
    assert len(frames) == 2 + big  # exact frame count: inline below the threshold, own frame above


def test_non_contiguous_and_large(codec: Codec) -> None:
    base = torch.randn(512, 1024)
    views = [base.t(), base[:, ::2], base[100:300]]  # [1024, 512], strided, offset
    msg = msgspec.structs.replace(samples()["learner.weights"], tensors=views, names=["a", "b", "c"])
    frames = codec.encode(msg)
    assert len(frames) == 2 + 3
    out = codec.decode(frames).tensors
    for o, v in zip(out, views, strict=True):
        assert torch.equal(o, v) and o.is_contiguous()


def test_huge_tensor_zero_copy(codec: Codec) -> None:
    t = torch.randn(64 << 18)  # 64 MiB
    frames = codec.encode(msgspec.structs.replace(samples()["learner.weights"], tensors=[t]))
    assert len(frames) == 3 and memoryview(frames[2]).nbytes == t.numel() * 4
    assert frames[2].ctypes.data == t.data_ptr()  # the sender hands zmq the tensor's own memory
    out = codec.decode(frames).tensors[0]
    assert torch.equal(out, t)


def test_decoded_tensor_aliases_received_frame(codec: Codec) -> None:
    t = torch.arange(1000, dtype=torch.float32)
    frames = [
        bytes(f) for f in codec.encode(msgspec.structs.replace(samples()["learner.weights"], tensors=[t]))
    ]
    buf = bytearray(frames[2])
    out = codec.decode([frames[0], frames[1], buf]).tensors[0]
    buf[0:4] = b"\x00\x00\x80\x3f"  # 1.0f
    assert out[0].item() == 1.0  # documented contract: clone what you keep


def test_codec_rejects_unregistered_message(codec: Codec) -> None:
    class Stray(msgspec.Struct):
        x: int = 0

    with pytest.raises(TypeError, match="not a registered message"):
        codec.encode(Stray())  # type: ignore[arg-type]


def test_a_generate_request_without_sample_indices_decodes_to_all_samples(codec: Codec) -> None:
    from slipstream.protocols.rollout import GenerateRequest

    # The golden bytes of a GenerateRequest from before `sample_indices` (six fields, no trailing list).
    body = bytes.fromhex(
        "960393a5696e7436349106c4300000000000000000010000000000000002000000000000000300000000000000"
        "04000000000000000500000000000000040b95cb3fe6666666666666cb3feccccccccccccd14cc80910202"
    )
    msg = codec.decode([b"rollout.generate", body])
    assert isinstance(msg, GenerateRequest) and msg.sample_indices == [] and msg.num_samples == 4


def test_iteration_stats_from_before_draft_s_decode_as_plain_drafting_time(codec: Codec) -> None:
    body = bytes.fromhex("9a000a04a86e6772616d3a643410090dcb3fa999999999999a9090")  # ten fields
    msg = codec.decode([b"rollout.iteration", body])
    assert msg.arm == "ngram:d4" and msg.draft_s == 0.0


def test_sample_indices_must_be_distinct_and_below_num_samples(codec: Codec) -> None:
    import msgspec

    from tests.protocols.samples import samples

    good = samples()["rollout.generate"]
    for bad in ([4], [1, 1]):
        with pytest.raises(ValueError, match="sample_indices"):
            msgspec.structs.replace(good, sample_indices=bad)
