"""The same-GPU weight lane (runtime/cuda_ipc.py): the GPU checksum, the ref as a plain message, the
receiver's checks of a malformed ref; on a GPU, a real second process maps three pushes bitwise and
catches a stale bucket. Everything but the handle mapping runs on the CPU."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import msgspec
import pytest
import torch

from slipstream.runtime import cuda_ipc
from slipstream.runtime.cuda_ipc import CudaIpcRef, check, describe, device_checksum

SHARE = (0, b"h" * 64, 4096, 0, b"r" * 32, 8, b"e" * 64, True)
"""A stand-in for `_share_cuda_`'s tuple (device, handle, storage bytes, offset, ref counter handle and
offset, event handle, sync flag)."""


def test_the_checksum_sees_every_byte_and_its_position_and_not_the_chunking(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    a = torch.randn(1000, 3)
    base = device_checksum(["w"], [a])
    assert device_checksum(["w"], [a.clone()]) == base
    flipped = a.clone()
    flipped.view(torch.int32)[123, 1] ^= 1  # one bit
    assert device_checksum(["w"], [flipped]) != base
    swapped = a.clone()
    swapped[[5, 6]] = swapped[[6, 5]]  # the same words in another order
    assert device_checksum(["w"], [swapped]) != base
    assert device_checksum(["v"], [a]) != base  # the name counts
    assert device_checksum(["w"], [a[:, :2]]) != base and len(base) == 32
    odd = torch.arange(7, dtype=torch.uint8)  # a byte count that is not a multiple of 4
    assert device_checksum(["b"], [odd]) != device_checksum(["b"], [torch.arange(8, dtype=torch.uint8)])
    monkeypatch.setattr(cuda_ipc, "_CHUNK_WORDS", 7)  # other summation order: the same value (mod 2^64)
    assert device_checksum(["w"], [a]) == base
    with pytest.raises(ValueError, match="2 names for 1 tensors"):
        device_checksum(["a", "b"], [a])


def test_a_ref_is_a_plain_message_that_round_trips() -> None:
    tensor = torch.zeros(4, 8, dtype=torch.bfloat16)[1:]  # a view: offset and stride travel
    ref = describe(tensor, SHARE)
    wire = msgspec.msgpack.encode(ref)
    assert msgspec.msgpack.decode(wire, type=CudaIpcRef) == ref
    assert ref.dtype == "bfloat16" and ref.shape == [3, 8] and ref.stride == [8, 1] and ref.offset == 8
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(
            msgspec.msgpack.encode({**msgspec.to_builtins(ref), "extra": 1}), type=CudaIpcRef
        )


def test_a_malformed_ref_is_refused_naming_what_is_wrong() -> None:
    expected = torch.zeros(3, 8, dtype=torch.bfloat16)
    good = describe(expected, SHARE)
    check("w", good, expected.shape, expected.dtype)
    bad = {
        "dtype float32, expected bfloat16": msgspec.structs.replace(good, dtype="float32"),
        r"shape \[8, 3\], expected \[3, 8\]": msgspec.structs.replace(good, shape=[8, 3]),
        "bad layout": msgspec.structs.replace(good, stride=[-8, 1]),
        "reaches byte 4098 of a 4096-byte storage": msgspec.structs.replace(good, offset=2025),
        "empty IPC handle": msgspec.structs.replace(good, handle=b""),
        "dtype int64": msgspec.structs.replace(good, dtype="int64"),
    }
    for message, ref in bad.items():
        with pytest.raises(ValueError, match=message):
            check("w", ref, expected.shape, expected.dtype)


def test_export_takes_cuda_weights_only() -> None:
    with pytest.raises(ValueError, match="carries CUDA tensors"):
        cuda_ipc.export("w", torch.zeros(3))


CHILD = textwrap.dedent(
    """
    import sys, msgspec, torch
    from slipstream.runtime.cuda_ipc import CudaIpcRef, check, device_checksum, open_ref
    target = torch.zeros(256, 64, dtype=torch.bfloat16, device="cuda")
    for line in sys.stdin.buffer:
        announced, ref = msgspec.json.decode(line, type=tuple[str, CudaIpcRef])  # the bucket's checksum, its ref
        check("w", ref, target.shape, target.dtype)
        target.copy_(open_ref(ref))  # in place, as a rollout applies a bucket
        torch.cuda.synchronize()
        ok = device_checksum(["w"], [target]) == announced
        print("ok" if ok else "stale", float(target.float().sum()), flush=True)
    """
)


@pytest.mark.gpu
def test_a_second_process_maps_three_pushes_bitwise_and_catches_a_stale_bucket() -> None:
    bucket = torch.zeros(256, 64, dtype=torch.bfloat16, device="cuda")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=False
    )
    try:
        for version in range(1, 4):
            torch.manual_seed(version)
            bucket.copy_(torch.randn(256, 64, device="cuda"))  # the learner's cast of version N, in place
            torch.cuda.synchronize()
            pushed = (device_checksum(["w"], [bucket]), cuda_ipc.export("w", bucket))
            child.stdin.write(msgspec.json.encode(pushed) + b"\n")
            child.stdin.flush()
            status, total = child.stdout.readline().split()
            assert status == b"ok" and float(total) == pytest.approx(float(bucket.float().sum()))
        # Planted: the ref announces version 4's checksum but the bucket still holds version 3.
        stale = (device_checksum(["w"], [bucket + 1]), cuda_ipc.export("w", bucket))
        child.stdin.write(msgspec.json.encode(stale) + b"\n")
        child.stdin.flush()
        assert child.stdout.readline().split()[0] == b"stale"
    finally:
        child.stdin.close()
        assert child.wait(timeout=60) == 0


# ---- the push path: learner's buckets as refs, the receivers' mapping and checks (all but the mapping) ----


class _Stream:
    def synchronize(self) -> None:
        pass


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, mapped: dict[bytes, torch.Tensor]) -> None:
    """CPU stand-ins for the two CUDA-only calls: export (a ref whose handle names the tensor) and open_ref
    (the tensor a handle names)."""

    def export(name: str, tensor: torch.Tensor) -> CudaIpcRef:
        handle = f"h-{id(tensor)}".encode().ljust(64, b"-")
        mapped[handle] = tensor
        share = (0, handle, tensor.untyped_storage().nbytes(), 0, b"r" * 32, 8, b"e" * 64, True)
        return describe(tensor, share)

    monkeypatch.setattr(cuda_ipc, "export", export)
    monkeypatch.setattr(cuda_ipc, "open_ref", lambda ref: mapped[ref.handle])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())


def test_a_learner_bucket_travels_as_refs_and_a_receiver_takes_it_bitwise(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from slipstream.actors.learner import LearnerActor
    from slipstream.engine.weight_receiver import WeightReceiver
    from slipstream.protocols.learner import CUDA_IPC, WeightUpdate
    from slipstream.runtime.codec import Codec, checksum

    mapped: dict[bytes, torch.Tensor] = {}
    _fake_gpu(monkeypatch, mapped)
    torch.manual_seed(0)
    params = [("a.w", torch.nn.Parameter(torch.randn(4, 6))), ("b.w", torch.nn.Parameter(torch.randn(3)))]
    learner = SimpleNamespace(_ipc_buffers={}, push_dtype=torch.bfloat16)
    held = {n: torch.zeros(p.shape, dtype=torch.bfloat16) for n, p in params}
    receiver = WeightReceiver(
        expected={n: (t.shape, t.dtype) for n, t in held.items()}, base=held.__getitem__,
        checksum=checksum, map_refs=cuda_ipc.map_refs, device_checksum=device_checksum,
    )  # fmt: skip

    def push(version: int) -> WeightUpdate:
        update = LearnerActor._ipc_update(learner, 0, version, 1, params)  # type: ignore[arg-type]
        wire = Codec().decode(Codec().encode(update))  # a plain message: the refs survive the codec
        assert isinstance(wire, WeightUpdate) and wire.encoding == CUDA_IPC and wire.tensors == []
        return wire

    buffers = None
    for version in (1, 2, 3):
        with torch.no_grad():
            for _, p in params:
                p.add_(1.0)  # a step's update of the masters
        update = push(version)
        verdict = receiver.receive(
            version=version, bucket=0, num_buckets=1, names=update.names, tensors=update.tensors,
            checksum=update.checksum, encoding=update.encoding, ipc=update.ipc,
        )  # fmt: skip
        assert verdict.kind == "accepted"
        for name, tensor in zip(update.names, verdict.tensors or [], strict=True):
            held[name].copy_(tensor)
        receiver.applied(version)
        assert all(torch.equal(held[n], p.detach().to(torch.bfloat16)) for n, p in params)
        now = [t.data_ptr() for _, t in learner._ipc_buffers[0]]
        assert buffers in (None, now)  # allocated once, rewritten in place: the receivers' mappings hold
        buffers = now
    # Planted: version 4 announced with its checksum, but the buffers still hold version 3's bytes.
    with torch.no_grad():
        for _, p in params:
            p.add_(1.0)
    stale = msgspec.structs.replace(
        push(4),
        checksum=device_checksum(
            [n for n, _ in params], [p.detach().to(torch.bfloat16) + 1 for _, p in params]
        ),
    )
    verdict = receiver.receive(
        version=4, bucket=0, num_buckets=1, names=stale.names, tensors=stale.tensors,
        checksum=stale.checksum, encoding=stale.encoding, ipc=stale.ipc,
    )  # fmt: skip
    assert verdict.kind == "refused" and verdict.error == "checksum mismatch"


def test_a_bucket_whose_refs_cannot_be_mapped_is_refused_naming_them() -> None:
    from slipstream.engine.weight_receiver import WeightReceiver
    from slipstream.runtime.codec import checksum

    expected = {"w": (torch.Size([3, 8]), torch.bfloat16)}
    ref = describe(torch.zeros(3, 8, dtype=torch.bfloat16), SHARE)
    for names, refs, message in [
        (["w"], [], "1 names, 0 IPC refs"),
        (["v"], [ref], "v: not a weight of this model"),
        (["w"], [msgspec.structs.replace(ref, shape=[8, 3])], r"w: shape \[8, 3\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            cuda_ipc.map_refs(names, refs, expected)
    # The receiver refuses such a bucket naming it, and one it has no way to map (a receiver without GPU).
    receiver = WeightReceiver(
        expected=expected, base=lambda n: torch.zeros(3, 8), checksum=checksum,
        map_refs=cuda_ipc.map_refs, device_checksum=device_checksum,
    )  # fmt: skip
    bad = receiver.receive(
        version=1, bucket=0, num_buckets=1, names=["v"], tensors=[], checksum="", ipc=[ref]
    )
    assert bad.kind == "refused" and bad.error == "v: not a weight of this model"
    plain = WeightReceiver(expected=expected, base=lambda n: torch.zeros(3, 8), checksum=checksum)
    unmappable = plain.receive(
        version=1, bucket=0, num_buckets=1, names=["w"], tensors=[], checksum="", ipc=[ref]
    )
    assert unmappable.kind == "refused" and "cannot map" in (unmappable.error or "")
