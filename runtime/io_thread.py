"""An actor process's IO thread: the only code that touches the actor's sockets.

It owns the DEALER to the coordinator (control, and the coordinator's work and results), the data
ROUTER (peers send here), one DEALER per peer it sends to, and the PULL end of an inproc pipe whose PUSH
end is the compute thread's `Outbox`. Incoming frames are decoded here (malformed ones are logged and
dropped) and queued in the `Inbox`: the coordinator's control kinds in its control lane, all else in the
data lane; outgoing frames are forwarded without copies.

Backpressure, both ways: with the inbox's data lane full the thread stops reading the data socket
(ZeroMQ's high-water marks push back on the senders); a slow peer's message (EAGAIN) is parked and
nothing more is taken from the compute thread until it drains, so `send` blocks instead of growing memory.

Liveness: a heartbeat goes to the coordinator every interval from this thread (it proves the process is
alive; `handled`/`queued`/`ticks` in it show whether the compute loop moves). If the coordinator falls
silent for `supervisor_timeout_s`, the actor is told to shut down: an orphan never outlives its run.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Any

import zmq

from slipstream.protocols.control import Heartbeat, Peers, Ping, Pong, Shutdown
from slipstream.runtime.actor import COORDINATOR
from slipstream.runtime.codec import Codec, ProtocolError
from slipstream.runtime.inbox import Inbox
from slipstream.runtime.shm import ShmReader
from slipstream.runtime.transport import CurveKeys, SocketOptions, make_socket

_DEST_CONTROL = COORDINATOR.encode()


class PushOutbox:
    """The compute thread's end of the outbound pipe (its socket belongs to that thread alone)."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self._sock = make_socket(ctx, zmq.PUSH, connect=endpoint, options=SocketOptions(sndhwm=64))

    def send(self, dest: str, frames: list[Any]) -> zmq.MessageTracker | None:
        zero_copy = len(frames) > 2
        tracker = self._sock.send_multipart([dest.encode(), *frames], copy=not zero_copy, track=zero_copy)
        return tracker if zero_copy else None

    def close(self) -> None:
        self._sock.close(linger=1000)  # let the IO thread take what is queued


class ActorIO(threading.Thread):
    def __init__(
        self,
        *,
        ctx: zmq.Context,
        name: str,
        control: zmq.Socket,
        data: zmq.Socket,
        inbox: Inbox,
        log: Any,
        heartbeat_s: float,
        supervisor_timeout_s: float,
        peers: dict[str, str],
        curve: CurveKeys | None = None,
        options: SocketOptions | None = None,
        progress: Any = None,
    ) -> None:
        super().__init__(name=f"io:{name}", daemon=True)
        self.ctx, self.identity = ctx, name
        self.control, self.data, self.inbox, self.log = control, data, inbox, log
        self.heartbeat_s, self.supervisor_timeout_s = heartbeat_s, supervisor_timeout_s
        self.peers, self.curve, self.options = dict(peers), curve, options or SocketOptions()
        self.progress = progress  # object with `.handled`, read for heartbeats
        self.outbox_endpoint = f"inproc://outbox-{os.getpid()}-{id(self)}"
        self._pull = make_socket(ctx, zmq.PULL, bind=self.outbox_endpoint, options=SocketOptions(rcvhwm=64))
        self._peer_socks: dict[str, zmq.Socket] = {}
        self._pending: dict[zmq.Socket, deque[list[Any]]] = {}
        self._codec = Codec(shm_reader=ShmReader())
        self._halt = threading.Event()
        self._seq = 0
        self.dropped = 0  # malformed messages logged and dropped

    def outbox(self) -> PushOutbox:
        """A new compute-thread outbox (call from the thread that will use it)."""
        return PushOutbox(self.ctx, self.outbox_endpoint)

    def stop(self, timeout: float = 5.0) -> None:
        self._halt.set()
        self.join(timeout)

    # -- the loop -----------------------------------------------------------------------------------

    def run(self) -> None:
        poller = zmq.Poller()
        last_heard = time.monotonic()
        next_beat = 0.0
        told_to_stop = False
        try:
            while not self._halt.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    self._heartbeat()
                    next_beat = now + self.heartbeat_s
                if not told_to_stop and now - last_heard > self.supervisor_timeout_s:
                    self.log.error("supervisor_silent", seconds=round(now - last_heard, 3))
                    self.inbox.put_control((COORDINATOR, Shutdown(reason="supervisor silent")))
                    told_to_stop = True

                poller = zmq.Poller()
                poller.register(self.control, zmq.POLLIN)
                room = self.inbox.has_room()
                if room:
                    poller.register(self.data, zmq.POLLIN)
                if not self._pending:
                    poller.register(self._pull, zmq.POLLIN)
                for sock in self._pending:
                    poller.register(sock, zmq.POLLOUT)
                wait_ms = max(0.0, (next_beat - time.monotonic()) * 1000)
                if not room:
                    wait_ms = min(wait_ms, 5.0)  # re-check for inbox room soon
                # Not shorter: every wakeup of an idle actor costs the learner's threads (runtime/actor.py).
                events = dict(poller.poll(min(wait_ms, 250.0)))

                if self.control in events:
                    last_heard = time.monotonic()
                    self._on_control()
                if self.data in events:
                    self._on_data()
                if self._pull in events:
                    self._on_outbound()
                for sock in [s for s in self._pending if events.get(s, 0) & zmq.POLLOUT]:
                    self._flush(sock)
        except zmq.ContextTerminated:
            pass
        except Exception:
            self.log.exception("io_thread_failed")
            self.inbox.put_control((COORDINATOR, Shutdown(reason="io thread failed")))
        finally:
            self._final_flush()
            self._close()

    def _final_flush(self, deadline_s: float = 1.0) -> None:
        """Forwards what the compute thread sent before stopping (a last Status or Dead)."""
        end = time.monotonic() + deadline_s
        try:
            while time.monotonic() < end:
                for sock in list(self._pending):
                    self._flush(sock)
                if self._pending:
                    time.sleep(0.005)
                    continue
                if not self._pull.poll(0):
                    return
                self._on_outbound()
        except zmq.ZMQError:
            pass

    def _heartbeat(self) -> None:
        self._seq += 1
        beat = Heartbeat(
            seq=self._seq,
            sent_ns=time.time_ns(),
            handled=getattr(self.progress, "handled", 0),
            queued=len(self.inbox),
            ticks=getattr(self.progress, "ticks", 0),
        )
        self._send(self.control, self._codec.encode(beat))

    def _drain(self, sock: zmq.Socket) -> list[list[zmq.Frame]]:
        batch = []
        for _ in range(256):  # bounded: the loop must come back to heartbeats and control
            try:
                batch.append(sock.recv_multipart(flags=zmq.NOBLOCK, copy=False))
            except zmq.Again:
                break
        return batch

    def _on_control(self) -> None:
        for frames in self._drain(self.control):
            try:
                msg = self._codec.decode(frames)
            except ProtocolError as e:
                self.dropped += 1
                self.log.warning("dropped_malformed", lane="control", error=str(e))
                continue
            if isinstance(msg, Heartbeat):
                continue
            if isinstance(
                msg, Peers
            ):  # the IO thread owns the peer sockets: reconnect here, then tell the actor
                self._repoint(msg.peers)
            if isinstance(msg, Ping):  # answered here: measures the transport, not the compute loop
                self._send(self.control, self._codec.encode(Pong(seq=msg.seq, sent_ns=msg.sent_ns)))
                continue
            if str(msg.kind).startswith("control."):
                self.inbox.put_control((COORDINATOR, msg))
            else:  # work from the coordinator (requests, groups, scores) queues behind control, never ahead
                self.inbox.put_data((COORDINATOR, msg), force=True)

    def _on_data(self) -> None:
        while self.inbox.has_room():
            batch = self._drain_one(self.data)
            if batch is None:
                return
            sender, frames = batch
            try:
                msg = self._codec.decode(frames)
            except ProtocolError as e:
                self.dropped += 1
                self.log.warning("dropped_malformed", lane="data", sender=sender, error=str(e))
                continue
            self.inbox.put_data((sender, msg))

    def _drain_one(self, sock: zmq.Socket) -> tuple[str, list[zmq.Frame]] | None:
        try:
            frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return frames[0].bytes.decode(errors="replace"), frames[1:]

    def _on_outbound(self) -> None:
        for frames in self._drain(self._pull):
            dest = frames[0].bytes
            sock = self.control if dest == _DEST_CONTROL else self._peer(dest.decode())
            if sock is None:
                self.log.error("unknown_destination", dest=dest.decode(errors="replace"))
                continue
            # Every drained message is sent or parked (never dropped); while anything is parked the loop
            # stops reading the pipe, which is what pushes back on the compute thread.
            self._send(sock, frames[1:])

    def _send(self, sock: zmq.Socket, frames: list[Any]) -> None:
        if sock in self._pending:
            self._pending[sock].append(frames)
            return
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._pending.setdefault(sock, deque()).append(frames)

    def _flush(self, sock: zmq.Socket) -> None:
        queue = self._pending[sock]
        while queue:
            try:
                sock.send_multipart(queue[0], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            queue.popleft()
        del self._pending[sock]

    def _peer(self, dest: str) -> zmq.Socket | None:
        sock = self._peer_socks.get(dest)
        if sock is None:
            endpoint = self.peers.get(dest)
            if endpoint is None:
                return None
            sock = make_socket(  # with the run's keys (a multi-node run) every data socket is CURVE, ipc too
                self.ctx,
                zmq.DEALER,
                identity=self.identity,
                connect=endpoint,
                options=self.options,
                curve=self.curve,
            )
            self._peer_socks[dest] = sock
        return sock

    def _repoint(self, peers: dict[str, str]) -> None:
        """Peers that moved (restarted on another node) are reached at their new endpoints; what was parked
        for an old address is dropped (it was for a process that is gone: its owner deals the work again)."""
        for dest, endpoint in peers.items():
            if self.peers.get(dest) == endpoint:
                continue
            self.peers[dest] = endpoint
            sock = self._peer_socks.pop(dest, None)
            if sock is not None:
                self._pending.pop(sock, None)
                sock.close(linger=0)
            self.log.info("peer_moved", peer=dest, endpoint=endpoint)

    def _close(self) -> None:
        for sock in [self._pull, *self._peer_socks.values(), self.data]:
            sock.close(linger=0)
        # The control socket gets a moment so a final Dead/Ready reaches the coordinator.
        self.control.close(linger=500)
