"""The Actor base class: a small object with a typed handler per message type.

    class Echo(Actor):
        role = "echo"

        @handler
        def on_ping(self, msg: Ping, sender: str) -> None:
            self.send(sender, Pong(seq=msg.seq, sent_ns=msg.sent_ns))

An actor never touches a socket (its host's IO thread does: runtime/host.py). `Actor.serve` drains the
inbox, control first, to the handler whose annotation names each message's type, and calls `step()` in
between; a long step polls `control_pending()`, so a preemption waits at most one step.

A handler that raises is a bug in that handler: the exception is logged with the message kind, the
message is dropped, the coordinator (when it sent the message) is answered `Failed` naming the error, so
no waiter hangs, and the actor keeps serving. `Fatal` ends the actor (it sends `Dead` first).
"""

from __future__ import annotations

import inspect
import time
import typing
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import msgspec
import structlog
import zmq

from slipstream.protocols.base import Message
from slipstream.protocols.control import Failed, Peers, Shutdown
from slipstream.runtime.codec import Codec
from slipstream.runtime.inbox import Inbox
from slipstream.runtime.shm import MAX_READERS
from slipstream.runtime.spans import NULL_RECORDER, SpanRecorder
from slipstream.runtime.transport import actor_name

COORDINATOR = "coordinator"  # destination name of the control socket


class Fatal(Exception):
    """Raised by a handler or step to end the actor: it reports Dead with this reason and exits."""


class EmptyConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Config of an actor that takes none."""


def handler(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Marks a method as the handler for the message type its `msg` parameter is annotated with."""
    fn.__slipstream_handler__ = True  # type: ignore[attr-defined]
    return fn


class Outbox(typing.Protocol):
    """What an actor sends through: the host's IO thread, or a test harness."""

    def send(self, dest: str, frames: list[Any]) -> zmq.MessageTracker | None: ...


class Actor:
    """Base class of every actor. Subclasses set `role`, `Config` and handlers."""

    role: ClassVar[str] = "actor"
    Config: ClassVar[type[msgspec.Struct]] = EmptyConfig
    _handlers: ClassVar[dict[type[Message], str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        table: dict[type[Message], str] = {}
        for klass in reversed(cls.__mro__):
            for name, fn in vars(klass).items():
                if not getattr(fn, "__slipstream_handler__", False):
                    continue
                hints = typing.get_type_hints(fn)
                params = list(inspect.signature(fn).parameters)
                if len(params) < 2 or params[1] not in hints:
                    raise TypeError(
                        f"{cls.__name__}.{name}: a handler's message parameter needs a type annotation"
                    )
                tp = hints[params[1]]
                if not (isinstance(tp, type) and issubclass(tp, Message)):
                    raise TypeError(f"{cls.__name__}.{name}: {tp} is not a Message type")
                table[tp] = name
        cls._handlers = table

    def __init__(
        self,
        config: msgspec.Struct,
        *,
        rank: int,
        outbox: Outbox,
        inbox: Inbox,
        run_dir: str = "",
        peers: dict[str, str] | None = None,
        log: Any = None,
        local_codec: Codec | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.name = actor_name(self.role, rank)
        self.run_dir = run_dir
        self.peers = dict(peers or {})
        self.inbox = inbox
        self.log = log if log is not None else structlog.get_logger().bind(role=self.role, rank=rank)
        self._outbox = outbox
        self._codec = Codec()  # the compute thread's own: codecs hold per-call state
        # Same-host peers (ipc://) get large tensors through the shared-memory lane when the host gave one.
        self._local_codec = local_codec or self._codec
        self._stopping = False
        self.handled = 0
        # Turns of the compute loop, plus `tick()` marks from long handlers: the heartbeats carry it, and a
        # supervisor with a hang deadline kills an actor whose ticks stop while its heartbeats arrive.
        self.ticks = 0
        # Spans of the work that costs time (runtime/spans.py); the host installs a recording one when the
        # run traces, so handlers record unconditionally.
        self.spans: SpanRecorder = NULL_RECORDER

    # -- hooks for subclasses -----------------------------------------------------------------------

    def on_start(self) -> None:
        """Called once before the first message; raise (or Fatal) to fail the handshake."""

    def on_stop(self) -> None:
        """Called once on shutdown, before the process exits."""

    def step(self) -> bool:
        """Continuous work between messages. Return True if there is more to do right away."""
        return False

    # -- API for subclasses -------------------------------------------------------------------------

    def send(self, dest: str, msg: Message) -> zmq.MessageTracker | None:
        """Sends `msg` to peer `dest` ("role:rank") or to COORDINATOR.

        Large tensors leave without a copy: do not modify them until the returned tracker is done.
        """
        local = self.peers.get(dest, "").startswith("ipc://")
        return self._outbox.send(dest, (self._local_codec if local else self._codec).encode(msg))

    def broadcast(self, dests: Sequence[str], msg: Message) -> None:
        """Sends `msg` to every one of `dests`, encoded once for those on this host: their large tensors take
        one shared-memory slot that each of them claims (a weight bucket for every rollout of a host is
        one copy, not one per rollout). Up to `MAX_READERS` share a slot; more take another."""
        local = [d for d in dests if self.peers.get(d, "").startswith("ipc://")]
        for dest in dests:
            if dest not in local:
                self.send(dest, msg)
        for start in range(0, len(local), MAX_READERS):
            group = local[start : start + MAX_READERS]
            frames = self._local_codec.encode(msg, readers=len(group))
            for dest in group:
                self._outbox.send(dest, frames)

    def control_pending(self) -> bool:
        """True while a control message (preempt, shutdown, lease) waits: long steps poll this."""
        return self.inbox.control_event.is_set()

    def tick(self) -> None:
        """Marks progress inside one long handler or step (a learner's micro-batch): not a hang."""
        self.ticks += 1

    def stop(self) -> None:
        """Ends `serve` after the current message."""
        self._stopping = True

    # -- the loop -----------------------------------------------------------------------------------

    def dispatch(self, msg: Message, sender: str) -> None:
        name = self._handlers.get(type(msg))
        if name is None:
            if isinstance(msg, Peers):  # the IO thread reconnected; `send` picks the lane by these
                self.peers.update(msg.peers)
                return
            if isinstance(msg, Shutdown):
                self.log.info("shutdown", reason=msg.reason)
                self.stop()
                return
            self.log.warning("no_handler", kind=msg.kind, sender=sender)
            return
        try:
            getattr(self, name)(msg, sender)
        except Fatal:
            raise
        except Exception as exc:
            self.log.exception("handler_failed", kind=msg.kind, sender=sender)
            if sender == COORDINATOR:  # its requests have waiters
                self.send(COORDINATOR, Failed(request=msg.kind, error=f"{type(exc).__name__}: {exc}"))
        finally:
            self.handled += 1

    def serve(self, *, idle_wait_s: float = 1.0) -> None:
        """Runs until shutdown: drain control, then data, then `step()`; block only when idle.

        Idle, it sleeps until a message arrives, `inbox.wake()` (another thread of the actor has work for
        `step`), or `idle_wait_s`. Not a short poll: on a host where the learner's threads hold every core,
        each wakeup of an idle actor preempts one of them and stalls the other at its next barrier (what
        a short poll cost the demo's learner: docs/training.md, "Idle actors")."""
        busy = False
        while not self._stopping:
            self.ticks += 1
            got = self.inbox.get(timeout=0 if busy else idle_wait_s)
            if got is not None:
                _, (sender, msg) = got
                self.dispatch(msg, sender)
                # Drop the references before sleeping: a message's tensors may alias a shared-memory slot of
                # its sender, which stays claimed (and resident here) for as long as anything holds them.
                got = msg = None
                busy = True  # the message may have made work for `step`: run it before sleeping again
                continue
            started = time.perf_counter()
            busy = self.step()
            if busy and time.perf_counter() - started > 1.0:
                self.log.debug("long_step", seconds=time.perf_counter() - started)
        # Shutdown jumps the queue (control lane): what was already delivered is still handed to its handler,
        # so an actor that answers every request (the verifier) answers these too, in on_stop.
        while (got := self.inbox.get(timeout=0)) is not None:
            _, (sender, msg) = got
            if not isinstance(msg, Shutdown):
                self.dispatch(msg, sender)
