"""The fork server: actor processes forked from a process that has already imported torch and the runtime.

An exec'd actor spends ~1 s of CPU importing torch before it can shake hands: five starting at once on a
2-core host wait ~3 s for that, and each restart pays again. A fork server (`python -m slipstream.runtime
--fork-server FD`) imports them once, then forks an actor per request: the child takes the caller's
stdout/stderr (passed over the socket), its own session, its cores, the caller's cwd, and its argv, which
ps and /proc/PID/cmdline show as the exec'd command line would be; then it runs `host.main`. The
non-obvious choices: one server per distinct environment, so whatever is read at interpreter or library
start (PYTHONPATH, OMP_*, LD_PRELOAD, a sitecustomize) is what an exec'd actor would have seen; servers
belong to the process, not to one launcher (a test session's supervisors, a bench's runs share them); and
a server starts no Python thread and never initialises CUDA, so a child may. It reaps its children and
reports each exit with asyncio's return-code convention (-N: killed by signal N). Off Linux, or with
SLIPSTREAM_FORK_SERVER=0, every actor is exec'd (runtime/launcher.py `spawn`).

    proc = await ForkServers(log).spawn(cmd, env=env, cpus=[0])   # None: not forked here (exec it)
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from slipstream.runtime.process import die_with_parent, parent_pid

__all__ = [
    "ENV_SWITCH",
    "ForkServers",
    "ForkedProcess",
    "is_fork_server",
    "launcher_pid",
    "serve",
    "stop_servers",
]

ENV_SWITCH = "SLIPSTREAM_FORK_SERVER"  # "0": exec every actor
MODULE = "slipstream.runtime"  # what an actor's command line runs: `python -m slipstream.runtime …`
_CMDLINE_ROOM = 4096  # bytes of argv the server starts with, which a child overwrites with its own
_START_TIMEOUT_S = 120.0  # importing torch on a loaded host


class _Fork(msgspec.Struct, tag=True, array_like=True, frozen=True):
    req: int
    argv: list[str]  # after `python -m slipstream.runtime`
    cwd: str
    cpus: list[int]


class _Ready(msgspec.Struct, tag=True, array_like=True, frozen=True):
    pid: int


class _Forked(msgspec.Struct, tag=True, array_like=True, frozen=True):
    req: int
    pid: int


class _Refused(msgspec.Struct, tag=True, array_like=True, frozen=True):
    req: int
    why: str


class _Exited(msgspec.Struct, tag=True, array_like=True, frozen=True):
    pid: int
    code: int


_encode = msgspec.msgpack.Encoder().encode
_down = msgspec.msgpack.Decoder(_Fork)
_up = msgspec.msgpack.Decoder(_Ready | _Forked | _Refused | _Exited)


def forkable(cmd: list[str]) -> bool:
    """Whether `cmd` is an actor's command line this interpreter could fork instead (runtime/launcher.py)."""
    return cmd[:3] == [sys.executable, "-m", MODULE] and sys.platform.startswith("linux")


def is_fork_server(pid: int) -> bool:
    """Whether process `pid` is a fork server (from its command line); False if it is gone."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return argv[2:4] == [MODULE.encode(), b"--fork-server"]


def launcher_pid(pid: int) -> int | None:
    """The process that started actor `pid`: its parent, or where that is a fork server, the server's parent
    (a supervisor or node agent). None if either is gone. For tools that must only touch a live run's actors."""
    parent = parent_pid(pid)
    if parent is None:
        return None
    return parent_pid(parent) if is_fork_server(parent) else parent


class ForkedProcess:
    """A child of a fork server, as the supervisor watches it (runtime/launcher.py `ProcessHandle`)."""

    def __init__(self, pid: int, loop: asyncio.AbstractEventLoop) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._loop = loop
        self._exited: asyncio.Future[int] = loop.create_future()

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            raise ProcessLookupError(self.pid)  # as asyncio's Process does once it has seen the exit
        with contextlib.suppress(ProcessLookupError):  # reaped by the server, its report on the way
            os.kill(self.pid, sig)

    def _exit(self, code: int) -> None:
        """From the server's reader thread: the exit, seen now, and told to the waiters in their loop."""
        if self.returncode is None:
            self.returncode = code
            _in_loop(self._loop, self._exited, code)


def _in_loop(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], value: Any) -> None:
    def resolve() -> None:
        if not fut.done():
            fut.set_result(value)

    with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits any more
        loop.call_soon_threadsafe(resolve)


# A server is started from this thread, which lives as long as the process: the kernel's PDEATHSIG follows
# the thread that forked a process, and a server outlives the event loop (or worker thread) that asked first.
_keeper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fork-server-keeper")
_servers: dict[tuple[tuple[str, str], ...], _Server] = {}  # by environment; shared by every launcher here
_lock = threading.Lock()
_MAX_IDLE = 4  # servers without children kept for later launches; past it the oldest idle one stops


class _Server:
    """One fork server process, for one environment, shared by every launcher of this process. A reader
    thread takes its messages and hands each answer to the event loop that asked."""

    def __init__(self, key: tuple[tuple[str, str], ...], env: dict[str, str]) -> None:
        self.key = key
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        try:
            self.proc = _keeper.submit(_start, env, theirs.fileno()).result()
        finally:
            theirs.close()
        self.ready = threading.Event()
        self.why_not = ""
        self.next_req = 0
        self.pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[int]]] = {}
        self.children: dict[int, ForkedProcess] = {}
        self.early: dict[int, int] = {}  # exits read before the launcher registered the child
        threading.Thread(target=self._read, name=f"fork-server-{self.proc.pid}", daemon=True).start()

    async def fork(self, argv: list[str], cpus: Collection[int]) -> ForkedProcess | None:
        if not self.ready.is_set() and not await asyncio.to_thread(self.ready.wait, _START_TIMEOUT_S):
            self._lost("did not start in time")
        if self.why_not:
            return None
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[int] = loop.create_future()
        with _lock:
            self.next_req += 1
            req = self.next_req
            self.pending[req] = (loop, answer)
        body = _encode(_Fork(req=req, argv=argv, cwd=os.getcwd(), cpus=sorted(cpus)))
        try:
            socket.send_fds(self.sock, [body], [1, 2])  # what an exec'd child inherits (not sys.stderr's)
        except OSError as e:  # the server is gone, or fd 1 or 2 is closed (then exec)
            with _lock:
                self.pending.pop(req, None)
            self.why_not = self.why_not or f"fork request failed: {e}"
            return None
        pid = await answer
        if pid <= 0:
            return None  # refused, or the server was lost meanwhile
        child = ForkedProcess(pid, loop)
        with _lock:
            code = self.early.pop(pid, None)
            if code is None and not self.why_not:
                self.children[pid] = child
        if code is not None or self.why_not:
            child._exit(-signal.SIGKILL if code is None else code)
        return child

    def idle(self) -> bool:
        return not self.children and not self.pending

    def _read(self) -> None:
        while True:
            try:
                body = self.sock.recv(4096)
            except OSError as e:
                self._lost(f"its socket failed: {e}")
                break
            if not body:
                self._lost("exited")
                break
            try:
                msg = _up.decode(body)
            except msgspec.DecodeError as e:
                self._lost(f"sent a malformed message: {e}")
                break
            self._dispatch(msg)
        self.proc.wait()  # reaped

    def _dispatch(self, msg: _Ready | _Forked | _Refused | _Exited) -> None:
        if isinstance(msg, _Ready):
            self.ready.set()
        elif isinstance(msg, _Forked | _Refused):
            if isinstance(msg, _Refused):
                self.why_not = msg.why
            with _lock:
                waiter = self.pending.pop(msg.req, None)
            if waiter is not None:
                _in_loop(*waiter, msg.pid if isinstance(msg, _Forked) else 0)
        elif isinstance(msg, _Exited):
            with _lock:
                child = self.children.pop(msg.pid, None)
                if child is None:
                    self.early[msg.pid] = msg.code
            if child is not None:
                child._exit(msg.code)

    def _lost(self, why: str) -> None:
        """The server is gone: its children die with it (PDEATHSIG), waiters hear so; the next launch
        with its environment starts a new one."""
        with _lock:
            self.why_not = self.why_not or f"the fork server {why}"
            if _servers.get(self.key) is self:
                del _servers[self.key]
            pending, self.pending = list(self.pending.values()), {}
            children, self.children = list(self.children.values()), {}
        self.ready.set()
        for waiter in pending:
            _in_loop(*waiter, 0)
        for child in children:
            child._exit(-signal.SIGKILL)

    def stop(self) -> None:
        """EOF to the server, which exits (taking any child still alive with it); the reader reaps it."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


def _start(env: dict[str, str], fd: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", MODULE, "--fork-server", str(fd), "-" * _CMDLINE_ROOM],
        env=env,
        pass_fds=[fd],
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # Ctrl-C reaches the coordinator alone, as for an exec'd actor
    )


def _server_for(env: dict[str, str]) -> _Server:
    """This process's server for `env`, started if there is none; idle ones past `_MAX_IDLE` stopped."""
    key = tuple(sorted(env.items()))
    with _lock:
        server = _servers.get(key)
        idle = [s for k, s in _servers.items() if k != key and s.idle()]
    if server is None:
        ours = _Server(key, env)
        with _lock:
            server = _servers.setdefault(key, ours)
        if server is not ours:  # another launch started one meanwhile
            ours.stop()
    for old in idle[: max(0, len(idle) - _MAX_IDLE + 1)]:
        old.stop()
    return server


def stop_servers(timeout_s: float = 10.0) -> None:
    """Stops every fork server of this process and waits for each to exit (their children die with them);
    the next launch starts afresh. For a bench that times a cold start, and a test that needs none."""
    with _lock:
        servers = list(_servers.values())
        _servers.clear()
    for server in servers:
        server.stop()
    for server in servers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(timeout_s)


class ForkServers:
    """How a launcher forks its actors: from this process's fork server for each actor's environment,
    started on first use and shared with every other launcher here (a test session's supervisors, a
    bench's runs)."""

    def __init__(self, log: Any = None) -> None:
        self.log = log
        self.why_not = "" if sys.platform.startswith("linux") else "fork servers run on Linux only"
        if os.environ.get(ENV_SWITCH, "1") == "0":
            self.why_not = f"{ENV_SWITCH}=0"

    async def spawn(
        self, cmd: list[str], *, env: Mapping[str, str], cpus: Collection[int]
    ) -> ForkedProcess | None:
        """Forks actor command line `cmd` with this process's environment plus `env`, pinned to `cpus`; None
        where it cannot be forked (the caller execs it)."""
        if self.why_not or not forkable(cmd):
            return None
        try:
            server = _server_for({**os.environ, **env})
        except OSError as e:
            self._unavailable(f"the fork server did not start: {e}")
            return None
        proc = await server.fork(cmd[3:], cpus)
        if proc is None:
            self._unavailable(server.why_not)
        return proc

    def _unavailable(self, why: str) -> None:
        if self.log is not None:
            self.log.warning("fork_server_unavailable", why=why)


# -- the server process ------------------------------------------------------------------------------


def serve(fd: int) -> int:
    """The fork server's loop (`python -m slipstream.runtime --fork-server FD`): preload, then fork on request
    until the socket closes; returns the exit code."""
    sock = socket.socket(fileno=fd)
    die_with_parent(os.getppid())
    import slipstream.runtime.host  # noqa: F401  the runtime, msgspec, zmq

    try:
        import torch  # most of an actor's start-up
    except ImportError:
        torch = None  # type: ignore[assignment]
    unsafe = ""
    if threading.active_count() != 1:
        unsafe = f"the fork server runs {threading.active_count()} Python threads after its imports"
    elif torch is not None and torch.cuda.is_initialized():
        unsafe = "the fork server initialised CUDA"
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD wakes the select below
    sock.send(_encode(_Ready(pid=os.getpid())))
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 512)
            _reap(sock)
        if sock in readable:
            try:
                body, fds, _, _ = socket.recv_fds(sock, 65536, 2)
            except ConnectionError:
                return 0
            if not body:
                return 0  # the launcher closed it, or died (then PDEATHSIG ends us first)
            req = _down.decode(body)
            if unsafe or len(fds) != 2:
                sock.send(_encode(_Refused(req=req.req, why=unsafe or "no stdout/stderr passed")))
            else:
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(req, fds, closing=[sock.fileno(), wake_r, wake_w])
                sock.send(_encode(_Forked(req=req.req, pid=pid)))
            for f in fds:
                os.close(f)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(_encode(_Exited(pid=pid, code=os.waitstatus_to_exitcode(status))))


def _child(req: _Fork, fds: list[int], *, closing: list[int]) -> None:
    """In the forked child: become the actor process `req` describes, run it, exit. Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for f in closing:
            os.close(f)
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        for src, dst in ((devnull, 0), (fds[0], 1), (fds[1], 2)):
            os.dup2(src, dst)
        os.close(devnull)
        os.chdir(req.cwd)
        if req.cpus:
            os.sched_setaffinity(0, req.cpus)
        argv = list(req.argv)
        if "--parent-pid" in argv[:-1]:  # the server is this process's parent: it dies with the server
            argv[argv.index("--parent-pid") + 1] = str(os.getppid())
        _set_cmdline([sys.executable, "-m", MODULE, *argv])
        sys.argv = [sys.argv[0], *argv]
        sys.orig_argv = [sys.executable, "-m", MODULE, *argv]
        from slipstream.runtime.host import main

        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        _finish(code)


def _finish(code: int) -> None:
    """What the interpreter's exit would do (join threads, atexit), then exit without unwinding into the server."""
    try:
        getattr(threading, "_shutdown", lambda: None)()
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


def _set_cmdline(argv: list[str]) -> None:
    """Shows `argv` in /proc/self/cmdline (ps, pgrep, tooling that labels actors by it): the server started
    with room for it, which this overwrites in place, as setproctitle does. Cosmetic where it fails."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49 of proc(5)
        if start and end > start:
            data = "\0".join(argv).encode()[: end - start - 1].ljust(end - start, b"\0")
            ctypes.memmove(start, data, len(data))
