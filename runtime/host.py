"""Entry point of an actor process: handshake, then the actor's compute loop beside its IO thread.

The supervisor (or a node agent on another host) starts it as

    python -m slipstream.runtime --actor pkg.mod:Class --rank 0 --control ipc://… --run-dir RUN

Handshake: connect the control DEALER (identity "role:rank") and bind the data ROUTER; send Hello;
wait for Init (the actor's config, its peers, the heartbeat interval, its thread budget); build the
actor and run `on_start`; send Ready. Any failure on the way is sent as `Dead` with the reason (a bad
config names its field) and the process exits non-zero.

The thread budget is applied before torch does any work — oversubscribing cores on a small host is
catastrophic (DESIGN §2) — and the process dies with its parent (PR_SET_PDEATHSIG on Linux). Freed
heap memory is kept for reuse (`keep_freed_memory`) before anything allocates: docs/training.md.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq

from slipstream.protocols import PROTOCOL_VERSION
from slipstream.protocols.control import Dead, Hello, Init, Ready, Shutdown
from slipstream.runtime import logs
from slipstream.runtime.actor import COORDINATOR, Actor
from slipstream.runtime.codec import Codec, ProtocolError
from slipstream.runtime.config import ConfigError, convert
from slipstream.runtime.inbox import Inbox
from slipstream.runtime.io_thread import ActorIO, PushOutbox
from slipstream.runtime.process import (
    die_with_parent,
    fresh_random_state,
    keep_freed_memory,
    peak_gpu_mb,
    peak_rss_mb,
)
from slipstream.runtime.shm import ShmArena
from slipstream.runtime.spans import SpanRecorder, span_path
from slipstream.runtime.transport import (
    CurveKeys,
    actor_name,
    ipc_endpoint,
    make_socket,
    run_tag,
    start_authenticator,
)

# The shared-memory lane for same-host bulk tensors grows on demand up to this much per actor. Not smaller:
# a receiver may hold a slot for long (the drafters kept their head bucket's slot), and a lane capped at
# 256 MiB filled with two such slots and failed a push (docs/training.md).
SHM_SLOT_MAX = 1 << 30
SHM_CAPACITY = 2 << 30


def actor_path(cls: type[Actor]) -> str:
    """The import path "pkg.module:Class" of an Actor subclass, as `import_actor` reads it back."""
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        raise ValueError(f"{cls.__qualname__} in {cls.__module__}: an actor class must be importable by path")
    return f"{cls.__module__}:{cls.__qualname__}"


def import_actor(path: str) -> type[Actor]:
    """The Actor subclass named by "pkg.module:Class"."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"actor path {path!r} must look like 'package.module:Class'")
    cls: Any = importlib.import_module(module_name)
    for part in attr.split("."):  # a nested class: "pkg.mod:Outer.Inner"
        cls = getattr(cls, part, None)
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise ValueError(f"{path!r} is not an Actor subclass")
    return cls


EXIT_OUT_OF_MEMORY = 12
"""The exit code of an actor whose loop ran out of device memory (torch.OutOfMemoryError): ENOMEM's."""


def apply_threads(threads: int) -> None:
    """Pins torch/OpenMP to this actor's lease of cores (env for libraries not yet imported)."""
    if threads <= 0:
        return
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        torch.set_num_threads(threads)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="slipstream-actor", description=__doc__.splitlines()[0])
    p.add_argument("--actor", required=True, help="pkg.module:Class")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--control", required=True, help="the coordinator's control endpoint")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--events", default=None, help="the coordinator's event-stream endpoint (XSUB)")
    p.add_argument("--curve-key", default=None, help="the run's key file (tcp across hosts)")
    p.add_argument("--data-host", default=None, help="also bind data on tcp://HOST (multi-node runs)")
    p.add_argument("--data-port", type=int, default=0, help="with --data-host: the port (0: any)")
    p.add_argument("--node", type=int, default=0, help="the node of the run this process is on")
    p.add_argument("--handshake-timeout", type=float, default=60.0)
    p.add_argument("--parent-pid", type=int, default=0)
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Runs one actor process from its command line: handshake, build, serve; returns its exit code."""
    args = _parse(argv)
    die_with_parent(args.parent_pid)
    # Every role allocates and frees large buffers per step (activations, weight pushes): reuse the pages.
    keep_freed_memory()
    cls = import_actor(args.actor)
    fresh_random_state()  # after the imports: torch's generator exists from its import on
    keys = CurveKeys.load(Path(args.curve_key)) if args.curve_key else None
    log = logs.configure(
        role=cls.role,
        rank=args.rank,
        run_dir=Path(args.run_dir),
        events_endpoint=args.events,
        level=args.log_level,
        curve=keys,
    )
    wire = _open_wire(args, cls.role, keys, log)
    codec = Codec()

    def report_dead(reason: str, code: int) -> None:
        log.error("dead", reason=reason)
        wire.send(codec.encode(Dead(role=cls.role, rank=args.rank, reason=reason, exit_code=code)))

    try:
        handshake = _handshake(wire, codec, cls.role, args, log)
        if handshake is None:
            log.error("handshake_timeout", seconds=args.handshake_timeout)
            return 4
        init, clock_offset_ns = handshake
        if (refused := _apply_budget(init.threads)) is not None:
            report_dead(refused, 2)
            return 2
        name = actor_name(cls.role, args.rank)
        try:
            config = convert(msgspec.msgpack.decode(init.config), cls.Config, where=f"{name} config")
        except (ConfigError, msgspec.DecodeError) as e:
            report_dead(f"bad config: {e}", 2)
            return 2
        log.info("config", config=msgspec.to_builtins(config))  # the resolved config, once
        actor = _build_actor(cls, config, args, init, wire, keys, log)
        if init.trace:
            _record_spans(actor, args, clock_offset_ns)
        return _serve(actor, wire, init.threads, report_dead, log)
    except Exception as e:  # anything before serving: the coordinator must hear why
        log.exception("start_failed")
        report_dead(f"start-up failed: {type(e).__name__}: {e}", 1)
        return 1
    finally:
        wire.close()
        logs.close()
        wire.ctx.term()


@dataclass
class _Wire:
    """The process's sockets, and the IO thread that takes them over once the actor is built."""

    ctx: zmq.Context
    control: zmq.Socket
    data: zmq.Socket
    data_endpoint: str  # what peers are told: tcp:// on a multi-node run
    local_endpoint: str  # beside a tcp:// data endpoint, the ipc:// one for peers on this node
    auth: Any = None
    io: ActorIO | None = None
    outbox: PushOutbox | None = None
    arena: ShmArena | None = None

    def send(self, frames: list[Any]) -> None:
        """Sends to the coordinator: through the IO thread while it runs (it owns the socket), else directly."""
        if self.io is not None and self.io.is_alive() and self.outbox is not None:
            self.outbox.send(COORDINATOR, frames)
        else:
            self.control.send_multipart(frames)

    def close(self) -> None:
        """Stops the IO thread (which closes the sockets it owns) or closes them here; then the arena and auth."""
        if self.io is not None and self.io.is_alive():
            if self.outbox is not None:
                self.outbox.close()
            self.io.stop()
        else:
            self.control.close(linger=500)
            self.data.close(linger=0)
        if self.arena is not None:
            self.arena.close()
        if self.auth is not None:
            self.auth.stop()


def _open_wire(args: argparse.Namespace, role: str, keys: CurveKeys | None, log: Any) -> _Wire:
    """Connects the control DEALER and binds the data ROUTER (ipc://, and tcp:// with --data-host)."""
    ctx = zmq.Context()
    # With the run's key every socket is CURVE (a multi-node run); a refused peer is logged, nothing more.
    refused = (lambda key: log.warning("peer_refused", client_key=key[:8])) if keys is not None else None
    auth = start_authenticator(ctx, keys, refused) if keys is not None else None
    name = actor_name(role, args.rank)
    control = make_socket(ctx, zmq.DEALER, identity=name, connect=args.control, curve=keys)
    local = ipc_endpoint(args.run_dir, f"data-{role}-{args.rank}", args.node)
    data = make_socket(ctx, zmq.ROUTER, bind=local, curve=keys)
    data_endpoint, local_endpoint = local, ""
    if args.data_host:  # peers on other nodes reach it here; those on its own node at `local`
        data.bind(f"tcp://{args.data_host}:{args.data_port or '*'}")
        data_endpoint, local_endpoint = data.getsockopt(zmq.LAST_ENDPOINT).decode(), local
    return _Wire(ctx, control, data, data_endpoint, local_endpoint, auth=auth)


def _handshake(
    wire: _Wire, codec: Codec, role: str, args: argparse.Namespace, log: Any
) -> tuple[Init, int | None] | None:
    """Sends Hello and waits for Init: Init and the supervisor's clock minus ours (None: not estimated)."""
    hello = Hello(
        role=role,
        rank=args.rank,
        pid=os.getpid(),
        host=socket.gethostname(),
        data_endpoint=wire.data_endpoint,
        protocol_version=PROTOCOL_VERSION,
        clock_ns=time.monotonic_ns(),
        local_endpoint=wire.local_endpoint,
    )
    wire.control.send_multipart(codec.encode(hello))
    init = _await_init(wire.control, codec, args.handshake_timeout, log)
    init_recv_ns = time.monotonic_ns()
    if init is None:
        return None
    # Same host (ipc://): one CLOCK_MONOTONIC, offset 0 exactly; an estimate would only add the
    # asymmetry of the two legs' delays (docs/benchmarks.md). Across hosts, NTP-style:
    # ((t1 - t0) + (t2 - t3)) / 2, the supervisor's clock minus ours.
    offset = None
    if init.sent_ns and args.control.startswith("tcp://"):
        offset = ((init.hello_recv_ns - hello.clock_ns) + (init.sent_ns - init_recv_ns)) // 2
    return init, offset


def _apply_budget(threads: int) -> str | None:
    """Applies the thread budget and any GPU memory share: why that failed, or None."""
    apply_threads(threads)
    if os.environ.get("SLIPSTREAM_GPU_MEMORY"):  # placement.GPU_MEMORY_ENV; that module imports torch
        from slipstream.runtime.placement import apply_gpu_memory

        try:
            apply_gpu_memory()  # before the actor allocates anything on its GPU
        except (ValueError, RuntimeError) as e:
            return f"gpu memory share: {e}"
    return None


def _build_actor(
    cls: type[Actor],
    config: Any,
    args: argparse.Namespace,
    init: Init,
    wire: _Wire,
    keys: CurveKeys | None,
    log: Any,
) -> Actor:
    """Builds the IO thread (not yet started), the shared-memory lane, and the actor on them."""
    inbox = Inbox(capacity=256)
    wire.io = ActorIO(
        ctx=wire.ctx, name=actor_name(cls.role, args.rank), control=wire.control, data=wire.data,
        inbox=inbox, log=log, heartbeat_s=init.heartbeat_s,
        supervisor_timeout_s=max(10 * init.heartbeat_s, 5.0), peers=init.peers, curve=keys,
    )  # fmt: skip
    wire.outbox = wire.io.outbox()
    wire.arena = ShmArena(
        run_tag(args.run_dir, args.node), slot_bytes_max=SHM_SLOT_MAX, capacity_bytes=SHM_CAPACITY
    )
    return cls(
        config,
        rank=args.rank,
        outbox=wire.outbox,
        inbox=inbox,
        run_dir=args.run_dir,
        peers=init.peers,
        log=log,
        local_codec=Codec(shm=wire.arena),
    )


def _record_spans(actor: Actor, args: argparse.Namespace, clock_offset_ns: int | None) -> None:
    """Gives the actor a span recorder beside its log, on the supervisor's clock where that is known."""
    label = f"{actor.role}-{args.rank}"  # as its log file is named
    actor.spans = SpanRecorder(
        span_path(Path(args.run_dir), label), actor=label, role=actor.role, rank=args.rank
    )
    if clock_offset_ns is not None:
        actor.spans.set_clock_offset(clock_offset_ns)


def _serve(actor: Actor, wire: _Wire, threads: int, report_dead: Callable[[str, int], None], log: Any) -> int:
    """Starts the IO thread, runs on_start, says Ready, serves until shut down, then stops: the exit code."""
    assert wire.io is not None  # _build_actor made it
    wire.io.progress = actor
    wire.io.start()
    signal.signal(
        signal.SIGTERM, lambda *_: actor.inbox.put_control((COORDINATOR, Shutdown(reason="SIGTERM")))
    )
    try:
        actor.on_start()
    except Exception as e:
        log.exception("on_start_failed")
        report_dead(f"on_start failed: {type(e).__name__}: {e}", 1)
        return 1
    actor.send(COORDINATOR, Ready(role=actor.role, rank=actor.rank))
    log.info("ready", pid=os.getpid(), data=wire.data_endpoint, threads=threads, rss_mb=_rss_mb())
    exit_code = 0
    try:
        actor.serve()
    except Exception as e:  # Fatal, or a bug in the loop itself
        log.exception("serve_failed")
        # Out of device memory is an event with a recovery (a smaller batch cap), not a bug: its own
        # code. By name: this module never imports torch (reward workers run without it).
        exit_code = EXIT_OUT_OF_MEMORY if type(e).__name__ == "OutOfMemoryError" else 1
        report_dead(f"{type(e).__name__}: {e}", exit_code)
    finally:
        try:
            actor.on_stop()
        except Exception:
            log.exception("on_stop_failed")
        actor.spans.close()
    # Peak resident memory: what a co-located actor really costs its host (the drafter's budget).
    gpu = {} if (mb := peak_gpu_mb()) is None else {"peak_gpu_mb": mb}
    log.info(
        "stopped", handled=actor.handled, dropped=wire.io.dropped, peak_rss_mb=round(peak_rss_mb(), 1), **gpu
    )
    return exit_code


def _await_init(control: zmq.Socket, codec: Codec, timeout_s: float, log: Any) -> Init | None:
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if not control.poll(int(left * 1000)):
            return None
        try:
            msg = codec.decode(control.recv_multipart(copy=False))
        except ProtocolError as e:
            log.warning("dropped_malformed", lane="control", error=str(e))
            continue
        if isinstance(msg, Init):
            return msg
        if isinstance(msg, Shutdown):
            log.info("shutdown_before_init", reason=msg.reason)
            return None
    return None


def _rss_mb() -> float:
    """This process's resident memory now, MB (Linux /proc; 0 where it cannot be read)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


if __name__ == "__main__":
    sys.exit(main())
