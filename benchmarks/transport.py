"""Transport benchmark: tensor-message throughput vs memcpy, small-message round trip and rate.

    slipstream bench transport --json

Two real processes over ipc:// with the production socket factory and codec: this process connects a
DEALER, a child process (`serve`, started by `_serve` through `python -c`) binds a ROUTER and decodes
everything it receives. Large tensors are timed sender to decoded-at-receiver on the same-host production
path (the shared-memory lane), against an in-process memcpy of the same buffer with the same count and
warm-up, and again as plain ZeroMQ frames (the cross-host path). Then the paths between the nodes of a
multi-node run, side by side in the same run: tcp:// on loopback, plaintext and with CURVE (what every
socket of such a run uses), round trip and tensor frames (`across`). A node agent relays nothing
(runtime/agent.py), so these are the whole cost of crossing nodes, less the wire. The result is
`TransportResult` (fields documented there); measured figures: docs/benchmarks.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch
import zmq

from slipstream.protocols.control import Heartbeat, Ping, Pong, Status
from slipstream.protocols.learner import WeightUpdate
from slipstream.runtime.codec import Codec
from slipstream.runtime.shm import ShmArena, ShmReader, cleanup
from slipstream.runtime.transport import CurveKeys, make_socket, start_authenticator

TENSOR_MIB = 64
_SERVE = "import sys; from slipstream.benchmarks.transport import serve; serve(*sys.argv[1:])"
"""The receiving child's program (`python -c _SERVE ENDPOINT KEY_FILE`): `serve`, nothing else."""


class PathResult(msgspec.Struct, frozen=True, kw_only=True):
    """One path between nodes: the same messages as above, without the shared-memory lane."""

    rtt_us_p50: float
    rtt_us_p99: float
    zmq_frames_gbps: float  # 64 MiB WeightUpdates as frames, sent -> decoded at the receiver


class TransportResult(msgspec.Struct, frozen=True, kw_only=True):
    """What `bench transport --json` prints; GB/s are 10^9 bytes per second."""

    tensor_msg_gbps: float  # 64 MiB float32 WeightUpdates, sent → decoded at the receiver, shared-memory lane
    memcpy_gbps: float  # an in-process torch copy of the same buffer, as many times after as much warm-up
    ratio: float  # tensor_msg_gbps / memcpy_gbps
    zmq_frames_gbps: float  # the same messages as plain ZeroMQ frames (the path across hosts)
    rtt_us_p50: float  # Ping → Pong round trip, encode and decode included, microseconds, median
    rtt_us_p99: float  # the same, 99th percentile
    msgs_per_s: int  # one-way Heartbeat stream, decoded at the receiver
    tensor_mib: int  # size of each tensor message
    tensor_msgs: int  # tensor messages timed per path
    rtt_rounds: int  # round trips timed
    transport: str  # "ipc"
    torch_threads: int  # torch threads of the sending process
    # Across nodes, on loopback: "tcp" (plaintext) and "tcp+curve" (the run's keys) -> their PathResult
    across: dict[str, PathResult] = {}


def serve(endpoint: str, key_file: str = "") -> None:
    """The receiving process: echo pings, count heartbeats and tensors, ack on request."""
    ctx = zmq.Context()
    keys = CurveKeys.load(Path(key_file)) if key_file else None
    auth = start_authenticator(ctx, keys) if keys is not None else None
    sock = make_socket(ctx, zmq.ROUTER, bind=endpoint, curve=keys)
    if endpoint.endswith(":*"):
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    print(f"ready {endpoint}", flush=True)
    codec = Codec(shm_reader=ShmReader())
    counts = {"control.heartbeat": 0, "learner.weights": 0}
    while True:
        frames = sock.recv_multipart(copy=False)
        peer, msg = frames[0], codec.decode(frames[1:])
        if isinstance(msg, Ping):
            sock.send_multipart([peer, *codec.encode(Pong(seq=msg.seq, sent_ns=msg.sent_ns))])
        elif isinstance(msg, Status):
            if msg.topic == "stop":
                break
            sock.send_multipart([peer, *codec.encode(Status(topic="count", fields=dict(counts)))])
        else:
            counts[msg.kind] = counts.get(msg.kind, 0) + 1
            del msg  # tensors alias their frames: drop them as a consumer that is done would
    sock.close(0)
    if auth is not None:
        auth.stop()
    ctx.term()


def _ask_count(sock: zmq.Socket, codec: Codec, kind: str) -> int:
    sock.send_multipart(codec.encode(Status(topic="count", fields={})))
    msg = codec.decode(sock.recv_multipart(copy=False))
    assert isinstance(msg, Status)
    return int(msg.fields[kind])  # type: ignore[arg-type]


def _tensor_rate(
    sock: zmq.Socket, sender: Codec, control: Codec, msg: WeightUpdate, n: int, nbytes: int
) -> float:
    """GB/s of `n` tensor messages encoded by `sender`, counted as decoded by the receiver."""
    for _ in range(n):  # warm-up to steady state: connection, allocator, the lane's slots all mapped
        sock.send_multipart(sender.encode(msg), copy=False)
    before = _ask_count(sock, control, "learner.weights")
    t0 = time.perf_counter()
    trackers = [sock.send_multipart(sender.encode(msg), copy=False, track=True) for _ in range(n)]
    got = _ask_count(sock, control, "learner.weights") - before
    elapsed = time.perf_counter() - t0
    for tr in trackers:
        tr.wait()
    return got * nbytes / elapsed / 1e9


def _serve(endpoint: str, key_file: str = "") -> tuple[subprocess.Popen, str]:
    """A receiving child process at `endpoint` ("tcp://127.0.0.1:*": a free port); its bound endpoint."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-c", _SERVE, endpoint, key_file]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env)
    assert child.stdout is not None
    ready, _, bound = child.stdout.readline().decode().strip().partition(" ")
    assert ready == "ready", ready
    return child, bound


def _rtt(sock: zmq.Socket, codec: Codec, rounds: int) -> tuple[float, float]:
    """Ping -> Pong round trips, encode and decode included: (p50, p99) in microseconds."""
    samples = []
    for i in range(rounds + 200):
        t0 = time.perf_counter_ns()
        sock.send_multipart(codec.encode(Ping(seq=i, sent_ns=t0)))
        codec.decode(sock.recv_multipart(copy=False))
        if i >= 200:
            samples.append(time.perf_counter_ns() - t0)
    samples.sort()
    return samples[len(samples) // 2] / 1000, samples[int(len(samples) * 0.99)] / 1000


def _stop(sock: zmq.Socket, codec: Codec, child: subprocess.Popen) -> None:
    sock.send_multipart(codec.encode(Status(topic="stop", fields={})))
    sock.close(linger=1000)
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        child.kill()


def _stream_rate(sock: zmq.Socket, codec: Codec, msgs: int) -> float:
    """Small messages per second, one way: `msgs` heartbeats sent, then the server's count of them."""
    t0 = time.perf_counter()
    for i in range(msgs):
        sock.send_multipart(codec.encode(Heartbeat(seq=i, sent_ns=0)))
    got = _ask_count(sock, codec, "control.heartbeat")
    return got / (time.perf_counter() - t0)


def _memcpy_rate(tensor: torch.Tensor, copies: int) -> float:
    """GB/s of copying `tensor` in one process: the tensor messages' statistic (the mean over as many
    copies, after as many warm-up copies), into a fresh destination like a receiver's."""
    dst = torch.empty_like(tensor)
    for _ in range(copies):
        dst.copy_(tensor)
    c0 = time.perf_counter()
    for _ in range(copies):
        dst.copy_(tensor)
    return copies * tensor.numel() * tensor.element_size() / (time.perf_counter() - c0) / 1e9


def _across(rtt_rounds: int, tensor_msgs: int, msg: WeightUpdate, nbytes: int) -> dict[str, PathResult]:
    """The node-to-node paths on loopback: plaintext tcp and tcp with CURVE, as a multi-node run has it."""
    out = {}
    tmp = Path(tempfile.mkdtemp(prefix="ssbench-"))
    keys = CurveKeys.generate()
    key_file = keys.save(tmp)
    for path, curve in (("tcp", None), ("tcp+curve", keys)):
        child, endpoint = _serve("tcp://127.0.0.1:*", str(key_file) if curve else "")
        ctx = zmq.Context()
        try:
            sock = make_socket(ctx, zmq.DEALER, identity="bench:0", connect=endpoint, curve=curve)
            codec = Codec()
            p50, p99 = _rtt(sock, codec, rtt_rounds)
            gbps = _tensor_rate(sock, codec, codec, msg, tensor_msgs, nbytes)
            _stop(sock, codec, child)
        finally:
            if child.poll() is None:
                child.kill()
            ctx.destroy(linger=0)
        out[path] = PathResult(
            rtt_us_p50=round(p50, 1), rtt_us_p99=round(p99, 1), zmq_frames_gbps=round(gbps, 3)
        )
    return out


def run(
    *, rtt_rounds: int = 5000, stream_msgs: int = 50_000, tensor_msgs: int = 8, across: bool = True
) -> TransportResult:
    tmp = tempfile.mkdtemp(prefix="ssbench-")
    child, endpoint = _serve(f"ipc://{tmp}/transport")
    ctx = zmq.Context()
    try:
        sock = make_socket(ctx, zmq.DEALER, identity="bench:0", connect=endpoint)
        codec = Codec()

        # Round trips of small control messages, then a one-way stream of them.
        p50, p99 = _rtt(sock, codec, rtt_rounds)
        msgs_per_s = _stream_rate(sock, codec, stream_msgs)

        # Large tensor messages: the shared-memory lane, then plain frames.
        tensor = torch.randn(TENSOR_MIB << 18)  # float32
        nbytes = tensor.numel() * 4
        msg = WeightUpdate(version=1, bucket=0, num_buckets=1, names=["w"], tensors=[tensor], checksum="")
        run_tag = f"bench-{os.getpid()}"
        with ShmArena(run_tag, slot_bytes_max=nbytes, capacity_bytes=4 * nbytes) as arena:
            tensor_gbps = _tensor_rate(sock, Codec(shm=arena), codec, msg, tensor_msgs, nbytes)
        cleanup(run_tag)
        frames_gbps = _tensor_rate(sock, codec, codec, msg, tensor_msgs, nbytes)
        memcpy_gbps = _memcpy_rate(tensor, tensor_msgs)  # what the tensor messages are measured against
        _stop(sock, codec, child)
    finally:
        if child.poll() is None:
            child.kill()
        ctx.destroy(linger=0)
    paths = _across(rtt_rounds, tensor_msgs, msg, nbytes) if across else {}
    return TransportResult(
        tensor_msg_gbps=round(tensor_gbps, 3),
        memcpy_gbps=round(memcpy_gbps, 3),
        ratio=round(tensor_gbps / memcpy_gbps, 3),
        zmq_frames_gbps=round(frames_gbps, 3),
        rtt_us_p50=round(p50, 1),
        rtt_us_p99=round(p99, 1),
        msgs_per_s=round(msgs_per_s),
        tensor_mib=TENSOR_MIB,
        tensor_msgs=tensor_msgs,
        rtt_rounds=rtt_rounds,
        transport="ipc",
        torch_threads=torch.get_num_threads(),
        across=paths,
    )
