"""Sockets: the one factory every ZeroMQ socket in Slipstream comes from, endpoints, and CURVE keys.

Topology: the coordinator binds one ROUTER for control and for the work it deals and collects
(requests, completions, stats); each actor connects a DEALER with identity "role:rank" to it, and binds a
ROUTER of its own for the bulk data its peers send it (weights, hidden states) through DEALERs. Every
socket gets finite high-water marks (backpressure instead of unbounded memory), linger 0 (shutdown
never hangs on unsent data) and a receive-size limit (zmq disconnects a peer that sends more).

Same host: ipc:// under a private 0700 directory — the file system is the access control. Across
hosts (runtime/cluster.py): tcp:// with CURVE encryption and authentication on every socket of the run
(ipc ones too: a socket is a CURVE server on all its endpoints or on none); node 0 makes one key pair
per run (`CurveKeys.generate`) that every process loads; a ZAP handler refuses any peer that does not
present the run's public key, so a peer without the run's key cannot connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.auth.base import Authenticator
from zmq.auth.thread import ThreadAuthenticator

S = TypeVar("S", bound=zmq.Socket)

# sun_path is 108 bytes on Linux; leave room for the socket file name.
_MAX_IPC_DIR = 80


@dataclass(frozen=True, kw_only=True)
class SocketOptions:
    """Options applied to every socket the factory makes."""

    sndhwm: int = 1000  # messages queued per peer before send blocks / fails with EAGAIN
    rcvhwm: int = 1000
    max_msg_bytes: int = 2 << 30  # inbound frame limit; a peer sending more is disconnected
    linger_ms: int = 0
    sndbuf: int = 4 << 20  # kernel buffers: fewer syscalls for large tensor frames
    rcvbuf: int = 4 << 20


@dataclass(frozen=True)
class CurveKeys:
    """The run's CURVE key pair (Z85 text). Everyone in a run holds it; nobody else does."""

    public: bytes
    secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    def save(self, directory: Path) -> Path:
        """Writes the key pair to `directory/run.key` (mode 0600) and returns the path."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "run.key"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.public + b"\n" + self.secret + b"\n")
        return path

    @classmethod
    def load(cls, path: Path) -> CurveKeys:
        lines = Path(path).read_bytes().split()
        if len(lines) != 2 or len(lines[0]) != 40 or len(lines[1]) != 40:
            raise ValueError(f"{path}: not a Slipstream CURVE key file (two 40-character Z85 keys)")
        return cls(lines[0], lines[1])


def make_socket(
    ctx: zmq.Context[S],
    kind: int,
    *,
    identity: str | None = None,
    bind: str | None = None,
    connect: str | None = None,
    options: SocketOptions | None = None,
    curve: CurveKeys | None = None,
) -> S:
    """A configured socket, bound or connected. With `curve`, binding makes it a CURVE server."""
    if (bind is None) == (connect is None):
        raise ValueError("make_socket needs exactly one of bind= or connect=")
    o = options or SocketOptions()
    sock = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, o.linger_ms)
        sock.setsockopt(zmq.SNDHWM, o.sndhwm)
        sock.setsockopt(zmq.RCVHWM, o.rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, o.max_msg_bytes)
        sock.setsockopt(zmq.SNDBUF, o.sndbuf)
        sock.setsockopt(zmq.RCVBUF, o.rcvbuf)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity.encode())
        if kind == zmq.ROUTER:
            # An unroutable destination is an error, not a silent drop.
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if curve is not None:
            if bind is not None:
                sock.curve_server = True
                sock.curve_secretkey = curve.secret
                sock.curve_publickey = curve.public
            else:
                sock.curve_serverkey = curve.public
                sock.curve_publickey = curve.public
                sock.curve_secretkey = curve.secret
        if bind is not None:
            sock.bind(bind)
        else:
            sock.connect(connect)
    except Exception:
        sock.close(linger=0)
        raise
    return sock


def start_authenticator(
    ctx: zmq.Context, keys: CurveKeys, on_refused: Callable[[str], None] | None = None
) -> Authenticator:
    """ZAP handler for `ctx`: CURVE clients must present the run's public key; others are refused, and
    `on_refused` hears of each (with the refused client's public key). An asyncio context gets the handler
    in its event loop, a plain one on a thread."""

    class _RunKeyOnly:
        def callback(self, domain: str, z85_key: bytes) -> bool:
            ok = hmac.compare_digest(z85_key, keys.public)
            if not ok and on_refused is not None:
                on_refused(z85_key.decode(errors="replace"))
            return ok

    auth: Authenticator
    if isinstance(ctx, zmq.asyncio.Context):
        auth = AsyncioAuthenticator(ctx)
    else:
        auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_RunKeyOnly())
    return auth


_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


async def watch_handshakes(
    sock: zmq.asyncio.Socket, on_failed: Callable[[str, str], None], every_s: float = 60.0
) -> None:
    """Reports failed handshakes on `sock` (a plaintext client, a wrong server key, a refused key) to
    `on_failed(endpoint, why)`, at most once per `every_s` (a refused client retries every 100 ms). Runs
    until cancelled; the ZAP handler reports refused keys itself, with the key."""
    from zmq.utils.monitor import parse_monitor_message

    monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED)
    last = -every_s
    try:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            now = asyncio.get_running_loop().time()
            if now - last >= every_s:
                last = now
                why = zmq.Event(event["event"]).name.lower()
                on_failed(event["endpoint"].decode(errors="replace"), why)
    finally:
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        monitor.close(linger=0)


PEER_FULL = "the peer's queue is full"
"""What `send_waiting` returns where the peer's queue is full and `gone()` says not to wait."""


async def send_waiting(
    router: zmq.asyncio.Socket, frames: list, gone: Callable[[], bool], *, copy: bool = True
) -> str | None:
    """Send `frames` (the peer's identity first) on a ROUTER_MANDATORY `router`, waiting while the peer's
    queue is full; returns None once sent, or why not. A ROUTER never waits by itself: a peer at its
    high-water mark is EAGAIN, and its POLLOUT says nothing of one peer, so a full queue is retried here
    (1 ms, doubling to 50 ms) until it drains or `gone()` says not to wait (the peer dead, the run closing).
    A message is never dropped for lack of queue room: 8192 score requests sent at once lost 91 that way
    (`bench scale`, 2026-11-28), and the step waited for their rewards forever."""
    delay = 0.001
    while True:
        try:
            await router.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
            return None
        except zmq.Again:
            if gone():
                return PEER_FULL
            await asyncio.sleep(delay)
            delay = min(2 * delay, 0.05)
        except zmq.ZMQError as e:  # EHOSTUNREACH from ROUTER_MANDATORY: not connected (any more)
            return str(e)


def socket_dir(run_dir: Path | str, node: int = 0) -> Path:
    """A private (0700) directory for this run's ipc sockets, short enough for sun_path. Node 0's is in the
    run directory; another node's is under this host's temp directory (a unix socket on a shared
    filesystem is not one every filesystem allows, and it serves only its own node anyway)."""
    run_dir = Path(run_dir).resolve()
    candidate = run_dir / "sock"
    if node or len(str(candidate)) > _MAX_IPC_DIR:
        candidate = Path(tempfile.gettempdir()) / f"slipstream-{os.getuid()}-{run_tag(run_dir, node)}"
    candidate.mkdir(parents=True, exist_ok=True)
    os.chmod(candidate, 0o700)
    return candidate


def run_tag(run_dir: Path | str, node: int = 0) -> str:
    """A short tag unique to a run directory and node (names its shared-memory segments and socket dirs)."""
    tag = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    return f"{tag}n{node}" if node else tag


def ipc_endpoint(run_dir: Path | str, name: str, node: int = 0) -> str:
    """ipc:// endpoint for `name` (e.g. "control", "data-rollout-0") inside the run's socket dir."""
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name)
    return f"ipc://{socket_dir(run_dir, node) / safe}"


def actor_name(role: str, rank: int) -> str:
    """An actor's name, "role:rank": its socket identity, its key in the peer directory, its log topic."""
    if not role or ":" in role:
        raise ValueError(f"actor role {role!r} must be non-empty and contain no ':'")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"actor rank {rank!r} must be a non-negative integer")
    return f"{role}:{rank}"


def parse_actor_name(name: str) -> tuple[str, int]:
    """(role, rank) of an actor name "role:rank"; ValueError naming the name if it is not one."""
    role, sep, rank = name.rpartition(":")
    canonical = rank.isascii() and rank.isdecimal() and str(int(rank)) == rank  # "1", never "01" or "+1"
    if not sep or not role or ":" in role or not canonical:
        raise ValueError(f"{name!r} is not an actor name 'role:rank' (e.g. 'drafter:0')")
    return role, int(rank)
