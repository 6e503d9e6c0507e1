"""The shared-memory tensor lane: round trips in one process and across real processes, slot reuse and
release through views, backpressure, hostile descriptors, peer death, cleanup.

Children get descriptors only (MessagePack over a pipe or an ipc:// socket), never pickled tensors.
Measure the lane against memcpy (64 MiB float32, steady state) with:

    python -m tests.runtime.test_shm [--mib 64] [--messages 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from slipstream.runtime.shm import SHM_DIR, ShmArena, ShmFullError, ShmReader, ShmRef, cleanup
from slipstream.runtime.transport import make_socket

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
_BOOT = "import sys; from tests.runtime.test_shm import _child; _child(sys.argv[1:])"
_WIRE = msgspec.msgpack.Decoder(tuple[ShmRef, list[int], str])


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.fixture
def tag() -> Iterator[str]:
    run_tag = f"test{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield run_tag
    cleanup(run_tag)
    assert not list(SHM_DIR.glob(f"slipstream-{run_tag}-*"))


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _BOOT, *args],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def ask(proc: subprocess.Popen[str], ref: ShmRef, shape: list[int], action: str) -> dict:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(msgspec.msgpack.encode((ref, shape, action)).hex() + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def _child(argv: list[str]) -> None:
    """Receiver process. `pipe`: descriptors as hex MessagePack lines on stdin, one JSON answer per
    line. `bench ENDPOINT`: the measurement peer on a PAIR socket."""
    reader = ShmReader()
    if argv[0] == "bench":
        _bench_peer(reader, argv[1])
        return
    held = []
    for line in sys.stdin:
        ref, shape, action = _WIRE.decode(bytes.fromhex(line))
        t = reader.get(ref, torch.float32, shape)
        answer = {"sum": float(t.double().sum()), "pid": os.getpid()}
        if action == "hold":
            held.append(t[1:])  # a view: the slot must stay claimed
        del t
        print(json.dumps(answer), flush=True)


# -- in one process -----------------------------------------------------------------------------------


def test_round_trip_aliases_the_slot_and_frees_it_when_dropped(tag: str) -> None:
    with ShmArena(tag, slot_bytes_max=16 * MIB, capacity_bytes=64 * MIB) as arena:
        reader = ShmReader()
        x = torch.randn(300, 700)  # [rows, cols]
        ref = arena.put(as_bytes(x))
        assert ref is not None and ref.name.startswith(f"slipstream-{tag}-{os.getpid()}-")
        assert (SHM_DIR / ref.name).stat().st_mode & 0o777 == 0o600
        y = reader.get(ref, torch.float32, [300, 700])
        assert torch.equal(x, y) and arena.busy_slots() == 1
        x.zero_()  # put copied: the sender may reuse its tensor at once
        assert y.abs().sum() > 0
        z = reader.get(arena.put(as_bytes(torch.ones(8, dtype=torch.bfloat16))), torch.bfloat16, [2, 4])
        assert torch.equal(z, torch.ones(2, 4, dtype=torch.bfloat16))
        del y, z
        assert arena.busy_slots() == 0
        reader.close()


def test_slots_are_reused_without_growth_or_page_faults(tag: str) -> None:
    with ShmArena(tag, slot_bytes_max=8 * MIB, capacity_bytes=64 * MIB) as arena:
        reader = ShmReader()
        x = as_bytes(torch.randn(MIB))  # [4 MiB]
        refs = []
        for i in range(12):
            if i == 2:  # steady state from here: every put lands in memory already faulted in
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            ref = arena.put(x)
            assert ref is not None
            refs.append(ref)
            t = reader.get(ref, torch.uint8, [x.numel()])
            assert t.data_ptr() != x.data_ptr() and bool((t[:64] == x[:64]).all())
            del t
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        assert {(r.name, r.slot) for r in refs} == {(refs[0].name, refs[0].slot)}
        assert [r.generation for r in refs] == list(range(1, 13))
        assert arena.used_bytes == 4 * MIB and len(arena.segment_names) == 1
        assert faults < 10 * 1024 // 4 // 8, f"{faults} page faults for 10 puts of 4 MiB"


def test_views_keep_the_slot_claimed(tag: str) -> None:
    with ShmArena(tag, slot_bytes_max=MIB, capacity_bytes=MIB) as arena:
        reader = ShmReader()
        t = reader.get(arena.put(as_bytes(torch.arange(64.0))), torch.float32, [8, 8])
        row, col, ints = t[3], t[:, 2], t.view(torch.int32)
        clone = t.clone()
        del t
        assert arena.busy_slots() == 1
        del row, col
        assert arena.busy_slots() == 1 and int(ints[0, 1]) == torch.tensor(1.0).view(torch.int32).item()
        del ints
        assert arena.busy_slots() == 0 and clone[7, 7] == 63.0


def test_too_large_or_empty_is_left_to_frames_and_bad_input_is_refused(tag: str) -> None:
    with ShmArena(tag, slot_bytes_max=MIB, capacity_bytes=2 * MIB) as arena:
        assert arena.put(torch.zeros(MIB + 1, dtype=torch.uint8)) is None
        assert arena.put(torch.zeros(0, dtype=torch.uint8)) is None
        with pytest.raises(TypeError, match="uint8"):
            arena.put(torch.zeros(16))
        with pytest.raises(TypeError, match="contiguous"):
            arena.put(torch.zeros(4, 4, dtype=torch.uint8)[:, 0])
    with pytest.raises(ValueError, match="capacity_bytes"):
        ShmArena(tag, slot_bytes_max=4 * MIB, capacity_bytes=MIB)
    with pytest.raises(ValueError, match="run_tag"):
        ShmArena("../etc", slot_bytes_max=MIB, capacity_bytes=MIB)


def test_full_arena_blocks_until_a_release_then_times_out_clearly(tag: str) -> None:
    with ShmArena(tag, slot_bytes_max=MIB, capacity_bytes=2 * MIB) as arena:
        reader = ShmReader()
        x = torch.ones(MIB, dtype=torch.uint8)
        held = [reader.get(arena.put(x), torch.uint8, [MIB]) for _ in range(2)]
        assert arena.used_bytes == 2 * MIB
        threading.Timer(0.2, held.pop).start()  # a receiver drops one tensor a little later
        start = time.monotonic()
        ref = arena.put(x, timeout_s=10)
        assert ref is not None and 0.15 < time.monotonic() - start < 5
        start = time.monotonic()
        with pytest.raises(ShmFullError, match=r"lane full: no slot for 1048576 bytes freed within 0.3 s"):
            arena.put(x, timeout_s=0.3)
        assert time.monotonic() - start >= 0.3 and arena.used_bytes == 2 * MIB


def test_a_new_size_evicts_idle_segments_of_other_sizes(tag: str) -> None:
    with ShmArena(tag, slot_bytes_max=2 * MIB, capacity_bytes=2 * MIB) as arena:
        reader = ShmReader()
        small = arena.put(torch.ones(MIB, dtype=torch.uint8))
        assert small is not None
        del reader  # descriptor lost with its receiver: slot stays WRITTEN until reclaimed
        big = torch.ones(2 * MIB, dtype=torch.uint8)
        with pytest.raises(ShmFullError):
            arena.put(big, timeout_s=0.1)
        assert arena.reclaim() == 0 and arena.reclaim(older_than_s=0) == 1
        with pytest.raises(ValueError, match="stale shm descriptor"):
            ShmReader().get(small, torch.uint8, [MIB])
        ref = arena.put(big)
        assert ref is not None and ref.name != small.name and not (SHM_DIR / small.name).exists()
        assert arena.used_bytes == 2 * MIB


# -- descriptors from the wire ------------------------------------------------------------------------


def test_descriptor_is_a_small_frozen_msgpack_array(tag: str) -> None:
    ref = ShmRef("slipstream-x-1-2", 4096, 1024, 0, 7)
    wire = msgspec.msgpack.encode(ref)
    assert msgspec.msgpack.decode(wire) == ["slipstream-x-1-2", 4096, 1024, 0, 7] and len(wire) < 32
    assert msgspec.convert(msgspec.msgpack.decode(wire), ShmRef) == ref
    with pytest.raises(AttributeError):
        ref.slot = 1  # type: ignore[misc]


def test_bad_descriptors_raise_value_errors_naming_the_problem(tag: str) -> None:
    with ShmArena(tag, slot_bytes_max=MIB, capacity_bytes=4 * MIB) as arena:
        reader = ShmReader()
        x = torch.arange(256.0)
        ref = arena.put(as_bytes(x))
        assert ref is not None

        def bad(match: str, shape: tuple[int, ...] = (256,), **changes: object) -> None:
            with pytest.raises(ValueError, match=match):
                reader.get(msgspec.structs.replace(ref, **changes), torch.float32, shape)

        bad("not slipstream-", name=f"other-{tag}-1-0")
        bad("not slipstream-", name="slipstream-../../etc/passwd-1-0")
        bad("does not exist", name=f"slipstream-{tag}-1-999")
        bad("out of range", slot=9)
        bad("out of bounds", offset=ref.offset + MIB - 512)
        bad("aligned", offset=ref.offset + 4)
        bad("holds 1024 bytes but .* needs 1028", shape=(257,))
        bad("not a non-negative int", offset=-1)
        bad("stale shm descriptor: generation 2", generation=2)
        t = reader.get(ref, torch.float32, [256])
        bad("already claimed")
        del t
        bad("free, not written")
        ref2 = arena.put(as_bytes(x))
        assert ref2 is not None and (ref2.name, ref2.slot) == (ref.name, ref.slot)
        bad("stale shm descriptor: generation 1, but slot 0 .* is at generation 2")

        fake = SHM_DIR / f"slipstream-{tag}-1-0"
        fake.write_bytes(bytes(2 * 4096))
        bad("not a private", name=fake.name)  # others could have written it
        fake.chmod(0o600)
        bad("no valid slipstream header", name=fake.name)
    bad("retired", generation=2)  # the reader still maps the closed segment; the sender retired it


def test_cleanup_removes_this_runs_segments_only(tag: str) -> None:
    arena = ShmArena(tag, slot_bytes_max=MIB, capacity_bytes=4 * MIB)
    arena.put(torch.ones(10, dtype=torch.uint8))
    crashed = SHM_DIR / f"slipstream-{tag}-999999-0"  # left by a peer that died
    crashed.write_bytes(b"x")
    other = SHM_DIR / f"slipstream-{tag}-other-1-0"  # another run whose tag extends ours
    other.write_bytes(b"x")
    try:
        assert cleanup(tag) == sorted([*arena.segment_names, crashed.name])
        assert not crashed.exists() and other.exists()
        assert not any((SHM_DIR / n).exists() for n in arena.segment_names)
        arena.close()
        with pytest.raises(RuntimeError, match="closed"):
            arena.put(torch.ones(10, dtype=torch.uint8))
        with pytest.raises(ValueError, match="run_tag"):
            cleanup("*")
    finally:
        other.unlink()


# -- across processes ---------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_round_trip_across_processes_releases_through_the_header(tag: str) -> None:
    proc = spawn("pipe")
    try:
        with ShmArena(tag, slot_bytes_max=8 * MIB, capacity_bytes=32 * MIB) as arena:
            for i in range(6):
                x = torch.arange(MIB, dtype=torch.float32) * i  # [1M] = 4 MiB
                ref = arena.put(as_bytes(x))
                assert ref is not None
                answer = ask(proc, ref, [MIB], "sum")
                assert answer["sum"] == float(x.double().sum()) and answer["pid"] == proc.pid
                assert arena.busy_slots() == 0  # freed by the child, with no message back about it
            assert len(arena.segment_names) == 1 and arena.used_bytes == 4 * MIB
    finally:
        stop(proc)


def test_one_slot_written_for_several_readers_frees_when_the_last_releases(tag: str) -> None:
    """A broadcast: one copy for `readers` receivers, each claiming the same descriptor once; the slot is
    reused only after every reader released it, and a claim beyond `readers` is refused."""
    with ShmArena(tag, slot_bytes_max=MIB, capacity_bytes=MIB) as arena:  # one slot in all
        x = torch.arange(MIB // 4, dtype=torch.float32)  # [256K] = 1 MiB
        ref = arena.put(as_bytes(x), readers=3)
        assert ref is not None
        got = [ShmReader().get(ref, torch.float32, [MIB // 4]) for _ in range(3)]
        assert all(torch.equal(g, x) for g in got)
        with pytest.raises(ValueError, match=r"already claimed \(by all 3 of its reader"):
            ShmReader().get(ref, torch.float32, [MIB // 4])
        view = got[0][10:]  # a view keeps its reader's claim
        del got[0]
        got.pop()
        assert arena.busy_slots() == 1
        with pytest.raises(ShmFullError):
            arena.put(as_bytes(x), timeout_s=0.1)
        got.clear()
        assert arena.busy_slots() == 1  # the view still holds it
        del view
        assert arena.busy_slots() == 0
        again = arena.put(as_bytes(x * 2), readers=2)
        assert again is not None and again.slot == ref.slot and again.generation == ref.generation + 1
        for bad in (0, 9, True):
            with pytest.raises(ValueError, match="readers="):
                arena.put(as_bytes(x), readers=bad)


@pytest.mark.timeout(60)
def test_a_broadcast_slot_survives_a_dead_reader_and_a_lost_descriptor(tag: str) -> None:
    proc = spawn("pipe")
    try:
        with ShmArena(tag, slot_bytes_max=MIB, capacity_bytes=MIB) as arena:
            x = torch.ones(MIB // 4)
            ref = arena.put(as_bytes(x), readers=3)
            assert ref is not None
            ask(proc, ref, [MIB // 4], "hold")  # reader 1: another process, holding it
            mine = ShmReader().get(ref, torch.float32, [MIB // 4])  # reader 2: this one
            # Reader 3's descriptor is lost, reader 1 dies: neither frees the slot while reader 2 holds it.
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            assert arena.reclaim(older_than_s=0) == 0 and arena.busy_slots() == 1
            with pytest.raises(ValueError, match="already claimed"):  # the lost claim is void now
                ShmReader().get(ref, torch.float32, [MIB // 4])
            assert float(mine.sum()) == MIB // 4  # ... and reader 2's tensor is still whole
            del mine
            assert arena.busy_slots() == 0
            late = arena.put(as_bytes(x))
            assert late is not None and late.slot == ref.slot
            with pytest.raises(ValueError, match="stale shm descriptor"):
                ShmReader().get(ref, torch.float32, [MIB // 4])
    finally:
        stop(proc)


@pytest.mark.timeout(60)
def test_slots_held_by_a_dead_receiver_are_reclaimed(tag: str) -> None:
    proc = spawn("pipe")
    try:
        with ShmArena(tag, slot_bytes_max=MIB, capacity_bytes=MIB) as arena:
            x = torch.ones(MIB // 4)  # [256K] = 1 MiB: the arena's only slot
            held = arena.put(as_bytes(x))
            assert held is not None
            ask(proc, held, [MIB // 4], "hold")
            assert arena.reclaim() == 0 and arena.busy_slots() == 1  # alive and holding
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            ref = arena.put(as_bytes(x), timeout_s=5)  # put notices the claimer is gone
            assert ref is not None and ref.slot == held.slot and ref.generation == held.generation + 2
    finally:
        stop(proc)


@pytest.mark.timeout(60)
def test_measurement_runs() -> None:
    result = measure(nbytes=4 * MIB, messages=3, repeats=1)
    assert set(result) == {"memcpy", "shm", "shm_read", "zmq"} and all(v > 0 for v in result.values())


# -- measurement --------------------------------------------------------------------------------------


def _bench_peer(reader: ShmReader, endpoint: str) -> None:
    warnings.filterwarnings("ignore", "The given buffer is not writable")  # zmq frames are read-only
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.PAIR, connect=endpoint)
    while True:
        frames = sock.recv_multipart(copy=False)
        kind = frames[0].bytes
        if kind == b"shm":
            ref, shape, action = _WIRE.decode(frames[1].buffer)
            t = reader.get(ref, torch.float32, shape)
        elif kind == b"zmq":
            action = frames[1].bytes.decode()
            t = torch.frombuffer(frames[2].buffer, dtype=torch.float32)
        elif kind == b"sync":
            sock.send(b"sync")
            continue
        else:
            break
        if action == "read":
            t.sum()  # the receiver reads every byte once
        del t
    sock.close()
    ctx.term()


def measure(*, nbytes: int = 64 * MIB, messages: int = 8, repeats: int = 5) -> dict[str, float]:
    """GB/s, best of `repeats`: in-process torch memcpy, and sender→receiver process over the shm lane
    (receiver takes the aliasing tensor; `shm_read`: and reads it), and plain zmq ipc frames."""
    x = torch.randn(nbytes // 4)  # [n] float32
    dst = torch.empty_like(x).fill_(0)
    best = {k: float("inf") for k in ("memcpy", "shm", "shm_read", "zmq")}
    for _ in range(repeats * messages):
        start = time.perf_counter()
        dst.copy_(x)
        best["memcpy"] = min(best["memcpy"], time.perf_counter() - start)
    best["memcpy"] *= messages  # per-message time → time for `messages`, like the others
    tag = f"bench{os.getpid()}"
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="slipstream-bench-") as tmp:
        sock = make_socket(ctx, zmq.PAIR, bind=f"ipc://{tmp}/bench")
        proc = subprocess.Popen([sys.executable, "-c", _BOOT, "bench", f"ipc://{tmp}/bench"], cwd=ROOT)
        arena = ShmArena(tag, slot_bytes_max=nbytes, capacity_bytes=4 * nbytes)
        try:

            def send(mode: str) -> None:
                if mode == "zmq":
                    sock.send_multipart([b"zmq", b"keep", as_bytes(x).numpy()], copy=False)
                else:
                    ref = arena.put(as_bytes(x))
                    body = (ref, [x.numel()], "read" if mode == "shm_read" else "keep")
                    sock.send_multipart([b"shm", msgspec.msgpack.encode(body)])

            def sync() -> None:
                sock.send(b"sync")
                assert sock.poll(60_000), "bench peer did not answer"
                sock.recv()

            for mode in ("shm", "shm_read", "zmq"):
                for _ in range(4):  # warm up: segments created and mapped on both sides
                    send(mode)
                sync()
                for _ in range(repeats):
                    start = time.perf_counter()
                    for _ in range(messages):
                        send(mode)
                    sync()
                    best[mode] = min(best[mode], time.perf_counter() - start)
            sock.send(b"stop")
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            arena.close()
            cleanup(tag)
            sock.close()
            ctx.term()
    return {k: messages * nbytes / t / 1e9 for k, t in best.items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--messages", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    gbps = measure(nbytes=args.mib * MIB, messages=args.messages, repeats=args.repeats)
    print(f"{args.mib} MiB float32 tensors, {args.messages} messages, best of {args.repeats}:")
    print(f"  torch memcpy (in process)            {gbps['memcpy']:6.2f} GB/s")
    print(
        f"  shm lane, receiver aliases           {gbps['shm']:6.2f} GB/s  ({gbps['shm'] / gbps['memcpy']:.2f}×)"
    )
    print(f"  shm lane, receiver reads every byte  {gbps['shm_read']:6.2f} GB/s")
    print(f"  zmq ipc frames, receiver aliases     {gbps['zmq']:6.2f} GB/s")
