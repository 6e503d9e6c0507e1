"""The actor IO thread against real sockets: backpressure from a slow peer loses nothing."""

import time
from pathlib import Path

import structlog
import zmq

from slipstream.protocols.control import Ping
from slipstream.runtime.codec import Codec
from slipstream.runtime.inbox import Inbox
from slipstream.runtime.io_thread import ActorIO
from slipstream.runtime.transport import SocketOptions, ipc_endpoint, make_socket


def test_slow_peer_parks_messages_and_delivers_all_in_order(tmp_path: Path) -> None:
    ctx = zmq.Context()
    tiny = SocketOptions(sndhwm=2, rcvhwm=2, sndbuf=4096, rcvbuf=4096)
    coordinator = make_socket(ctx, zmq.ROUTER, bind=ipc_endpoint(tmp_path, "control"))
    peer = make_socket(ctx, zmq.ROUTER, bind=ipc_endpoint(tmp_path, "peer"), options=tiny)
    control = make_socket(ctx, zmq.DEALER, identity="a:0", connect=ipc_endpoint(tmp_path, "control"))
    data = make_socket(ctx, zmq.ROUTER, bind=ipc_endpoint(tmp_path, "data-a"))
    io = ActorIO(
        ctx=ctx, name="a:0", control=control, data=data, inbox=Inbox(8), log=structlog.get_logger(),
        heartbeat_s=0.2, supervisor_timeout_s=60.0, peers={"b:0": ipc_endpoint(tmp_path, "peer")}, options=tiny,
    )  # fmt: skip
    outbox = io.outbox()
    io.start()
    codec = Codec()
    n = 300  # with HWM 2 and 4 KiB kernel buffers, sends hit EAGAIN long before n (the park path)
    for i in range(n):
        outbox.send("b:0", codec.encode(Ping(seq=i, sent_ns=0)))
    time.sleep(0.5)  # the peer has not read anything: the IO thread must be parking, not dropping
    seqs = []
    peer.setsockopt(zmq.RCVTIMEO, 5000)
    while len(seqs) < n:
        frames = peer.recv_multipart()
        assert frames[0] == b"a:0"
        seqs.append(codec.decode(frames[1:]).seq)
    assert seqs == list(range(n))
    outbox.close()
    io.stop()
    for s in (coordinator, peer):
        s.close(0)
    ctx.term()
