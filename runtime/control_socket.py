"""The head's end of the control channel: the supervisor's ROUTER and what crosses it, counted by kind.

One ROUTER at the run's `control` ipc endpoint, also bound on the head's TCP port in a multi-node run; with
the run's key it is CURVE, its ZAP handler refuses every other key and each refusal is reported. A
restarted actor connects with its predecessor's identity and takes the name over at once
(ROUTER_HANDOVER). Sends to one actor keep their call order and wait while its queue is full
(`send_waiting`: never a drop); what is decoded and what is sent are counted by kind (`traffic`,
`outbound`). Who the senders are, and whether one is alive, is the supervisor's business, not this one's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq
import zmq.asyncio

from slipstream.protocols import Message
from slipstream.runtime.codec import Codec, ProtocolError
from slipstream.runtime.traffic import Traffic
from slipstream.runtime.transport import (
    CurveKeys,
    make_socket,
    send_waiting,
    start_authenticator,
    watch_handshakes,
)

__all__ = ["ControlSocket"]


class ControlSocket:
    """The ROUTER the actors' control sockets connect to. `emit(event, level=…, **fields)` hears of
    refused keys, failed handshakes and malformed messages (each skipped)."""

    def __init__(
        self, endpoint: str, *, tcp: str = "", curve: CurveKeys | None, emit: Callable[..., None]
    ) -> None:
        self._emit = emit
        self.ctx = zmq.asyncio.Context()
        self._auth = start_authenticator(self.ctx, curve, self._refused) if curve else None
        self.router = make_socket(self.ctx, zmq.ROUTER, bind=endpoint, curve=curve)
        if tcp:  # the other nodes' actors reach the head here
            self.router.bind(tcp)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted actor takes its name over at once
        self._codec = Codec()
        self.traffic = Traffic()  # what `recv` decoded, by kind (runtime/traffic.py)
        self.outbound = Traffic()  # what `send` handed to the socket, by kind (bench scale reads it)
        # Per actor: a send that waits for a full queue keeps the order of the sends after it.
        self._send_locks: dict[str, asyncio.Lock] = {}

    async def send(
        self, name: str, msg: Message, gone: Callable[[], bool], *, wait: bool = True
    ) -> str | None:
        """Sends `msg` to actor `name` after its earlier sends, waiting while its queue is full until
        `gone()`; returns None once sent, or why not. With `wait` False it is skipped (None) while an
        earlier send to `name` still waits."""
        lock = self._send_locks.setdefault(name, asyncio.Lock())
        if not wait and lock.locked():
            return None
        frames = self._codec.encode(msg)
        self.outbound.add(msg.kind, sum(memoryview(f).nbytes for f in frames))  # bytes or tensor buffers
        async with lock:
            return await send_waiting(self.router, [name.encode(), *frames], gone, copy=len(frames) <= 2)

    async def recv(self) -> tuple[str, Message]:
        """The next well-formed message and its sender's name ("role:rank")."""
        while True:
            frames = await self.router.recv_multipart(copy=False)
            sender = frames[0].bytes.decode(errors="replace")
            try:
                msg = self._codec.decode(frames[1:])
            except ProtocolError as e:
                self._emit("dropped_malformed", sender=sender, error=str(e), level="warning")
                continue
            self.traffic.add(msg.kind, sum(len(f) for f in frames[1:]))
            return sender, msg

    async def watch_handshakes(self) -> None:
        """Reports who knocks on the head's TCP port and is turned away, until cancelled."""
        await watch_handshakes(self.router, self._handshake_failed)

    def close(self) -> None:
        self.router.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()

    def _refused(self, client_key: str) -> None:
        self._emit("peer_refused", client_key=client_key[:8], level="warning")

    def _handshake_failed(self, endpoint: str, why: str) -> None:
        self._emit("handshake_failed", endpoint=endpoint, why=why, level="warning")
