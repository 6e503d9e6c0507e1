"""The fork server: actor processes forked from a process that has already imported torch and the runtime.

An exec'd actor spends ~1 s of CPU importing torch before it can shake hands: five starting at once on a
2-core host wait ~3 s for that, and each restart pays again. A fork server (`python -m slipstream.runtime
--fork-server FD`) imports them once, then forks an actor per request: the child takes the caller's
stdout/stderr (passed over the socket), its own session, its cores, the caller's cwd, and its argv, which
ps and /proc/PID/cmdline show as the exec'd command line would be; then it runs `host.main`. The
non-obvious choices: one server per distinct environment, so whatever is read at interpreter or library
start (PYTHONPATH, OMP_*, LD_PRELOAD, a sitecustomize) is what an exec'd actor would have seen; and the
server starts no Python thread and never initialises CUDA, so a child may. The server reaps its children
and reports each exit with asyncio's return-code convention (-N: killed by signal N). Off the Linux
platform, or with SLIPSTREAM_FORK_SERVER=0, every actor is exec'd (runtime/launcher.py `spawn`).

    forks = ForkServers(log)
    proc = await forks.spawn(cmd, env=env, cpus=[0])   # None: not forked (exec it), `forks.why_not` says why
    await forks.close()                                # after its actors have exited
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
from pathlib import Path
from typing import Any

import msgspec

from slipstream.runtime.process import parent_pid

__all__ = ["ENV_SWITCH", "ForkServers", "ForkedProcess", "launcher_pid", "serve"]

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


def launcher_pid(pid: int) -> int | None:
    """The process that started actor `pid`: its parent, or where that is a fork server, the server's parent
    (a supervisor or node agent). None if either is gone. For tools that must only touch a live run's actors."""
    parent = parent_pid(pid)
    if parent is None:
        return None
    try:
        argv = Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return parent_pid(parent) if argv[2:4] == [MODULE.encode(), b"--fork-server"] else parent


class ForkedProcess:
    """A child of a fork server, as the supervisor watches it (runtime/launcher.py `ProcessHandle`)."""

    def __init__(self, pid: int, loop: asyncio.AbstractEventLoop) -> None:
        self.pid = pid
        self.returncode: int | None = None
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
        if self.returncode is None:
            self.returncode = code
            self._exited.set_result(code)


class _Server:
    """One fork server process, for one environment, and the children it forked."""

    def __init__(self, env: dict[str, str]) -> None:
        self.loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        self.proc = subprocess.Popen(
            [sys.executable, "-m", MODULE, "--fork-server", str(theirs.fileno()), "-" * _CMDLINE_ROOM],
            env=env,
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches the coordinator alone, as for an exec'd actor
        )
        theirs.close()
        self.sock.setblocking(False)
        self.ready: asyncio.Future[int] = self.loop.create_future()
        self.pending: dict[int, asyncio.Future[ForkedProcess]] = {}
        self.children: dict[int, ForkedProcess] = {}
        self.next_req = 0
        self.why_not = ""
        self.loop.add_reader(self.sock.fileno(), self._on_readable)

    async def fork(self, argv: list[str], cpus: Collection[int]) -> ForkedProcess | None:
        if not self.why_not:
            try:
                await asyncio.wait_for(asyncio.shield(self.ready), _START_TIMEOUT_S)
            except (TimeoutError, OSError) as e:
                self._lost(f"did not start: {e or type(e).__name__}")
        if self.why_not:
            return None
        self.next_req += 1
        req = self.next_req
        answer: asyncio.Future[ForkedProcess] = self.loop.create_future()
        self.pending[req] = answer
        body = _encode(_Fork(req=req, argv=argv, cwd=os.getcwd(), cpus=sorted(cpus)))
        try:
            socket.send_fds(self.sock, [body], [1, 2])  # what an exec'd child inherits (not sys.stderr's)
            return await answer
        except OSError as e:  # the server is gone, or fd 1 or 2 is closed (then exec)
            self.pending.pop(req, None)
            self.why_not = self.why_not or f"fork request failed: {e}"
            return None

    def _on_readable(self) -> None:
        while True:
            try:
                body = self.sock.recv(4096)
            except BlockingIOError:
                return
            except OSError as e:
                self._lost(f"its socket failed: {e}")
                return
            if not body:
                self._lost(f"exited ({self.proc.poll()})")
                return
            try:
                msg = _up.decode(body)
            except msgspec.DecodeError as e:
                self._lost(f"sent a malformed message: {e}")
                return
            self._dispatch(msg)

    def _dispatch(self, msg: _Ready | _Forked | _Refused | _Exited) -> None:
        if isinstance(msg, _Ready) and not self.ready.done():
            self.ready.set_result(msg.pid)
        elif isinstance(msg, _Forked):
            child = self.children[msg.pid] = ForkedProcess(msg.pid, self.loop)
            if (answer := self.pending.pop(msg.req, None)) is not None and not answer.done():
                answer.set_result(child)
        elif isinstance(msg, _Refused):
            self.why_not = msg.why
            if (answer := self.pending.pop(msg.req, None)) is not None and not answer.done():
                answer.set_exception(OSError(msg.why))
        elif isinstance(msg, _Exited) and (child := self.children.pop(msg.pid, None)) is not None:
            child._exit(msg.code)

    def _lost(self, why: str) -> None:
        """The server is gone: its children die with it (PDEATHSIG), waiters hear so."""
        self.why_not = self.why_not or f"the fork server {why}"
        with contextlib.suppress(ValueError, OSError):
            self.loop.remove_reader(self.sock.fileno())
        if not self.ready.done():
            self.ready.set_exception(OSError(self.why_not))
            self.ready.exception()  # retrieved: a server closed before any fork is no error to report
        for answer in self.pending.values():
            if not answer.done():
                answer.set_exception(OSError(self.why_not))
        self.pending.clear()
        for child in self.children.values():
            child._exit(-signal.SIGKILL)
        self.children.clear()

    async def close(self) -> None:
        self._lost("was closed")
        self.sock.close()  # EOF: the server exits (and any child still alive dies with it)
        for _ in range(100):
            if self.proc.poll() is not None:
                return
            await asyncio.sleep(0.05)
        self.proc.kill()
        await asyncio.to_thread(self.proc.wait)


class ForkServers:
    """A launcher's fork servers, one per environment its actors run with; started on first use."""

    def __init__(self, log: Any = None) -> None:
        self.log = log
        self.why_not = "" if sys.platform.startswith("linux") else "fork servers run on Linux only"
        if os.environ.get(ENV_SWITCH, "1") == "0":
            self.why_not = f"{ENV_SWITCH}=0"
        self._servers: dict[tuple[tuple[str, str], ...], _Server] = {}

    async def spawn(
        self, cmd: list[str], *, env: Mapping[str, str], cpus: Collection[int]
    ) -> ForkedProcess | None:
        """Forks actor command line `cmd` with this process's environment plus `env`, pinned to `cpus`; None
        where it cannot be forked (the caller execs it)."""
        if self.why_not or not forkable(cmd):
            return None
        full = {**os.environ, **env}
        key = tuple(sorted(full.items()))
        server = self._servers.get(key)
        if server is None:
            try:
                server = self._servers[key] = _Server(full)
            except OSError as e:
                self.why_not = f"the fork server did not start: {e}"
                return None
        proc = await server.fork(cmd[3:], cpus)
        if proc is None:
            if self.log is not None:
                self.log.warning("fork_server_unavailable", why=server.why_not)
            self.why_not = server.why_not  # every later actor is exec'd: one warning, no retries
        return proc

    async def close(self) -> None:
        """Stops every server (each takes any child still alive with it)."""
        servers, self._servers = list(self._servers.values()), {}
        await asyncio.gather(*(s.close() for s in servers))


# -- the server process ------------------------------------------------------------------------------


def serve(fd: int) -> int:
    """The fork server's loop (`python -m slipstream.runtime --fork-server FD`): preload, then fork on request
    until the socket closes; returns the exit code."""
    sock = socket.socket(fileno=fd)
    parent = os.getppid()
    _set_pdeathsig()
    if os.getppid() != parent:
        return 3  # the launcher died before prctl took effect
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
        if "numpy" in sys.modules:  # an exec'd process seeds numpy's global generator afresh
            sys.modules["numpy"].random.seed()
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


def _set_pdeathsig() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
