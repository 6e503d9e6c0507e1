"""A sandbox that runs a completion's code against hidden tests, isolated with what Linux offers.

`Sandbox().run(code, entry_point, tests)` runs `code` in a fresh interpreter and calls `entry_point(*args)`
for each test. Three processes: a launcher in its own process group (killed whole at the wall-clock limit
and after); the first process of a new PID namespace (when it dies, the kernel kills everything in it,
whatever session a process made), in new network (a loopback, down) and mount namespaces (empty tmpfs on
/tmp, /var/tmp, /dev/shm and `hide`); below it the code, as a uid of its own (so RLIMIT_NPROC binds per
run) under rlimits (CPU, address space, processes, file size, open files, no core). An empty environment;
a temp working dir, removed after (by the launcher if its caller dies). Stdlib only (-I -S): PRELOAD is
imported before the uid drops, as the interpreter's files may be closed to it (a Python under /root).
It needs root: `Sandbox()` runs a probe and raises SandboxUnavailable naming what failed.

Tests are data, {"args": [...], "expected": ...}, compared as canonical JSON of exact builtin types (a
result whose __eq__ always says True passes nothing). The verdict carries a nonce the code never sees as
text, so exiting early or printing passes nothing; code that reads the harness's memory could forge it.
"""

from __future__ import annotations

import ctypes
import importlib
import itertools
import json
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["PRELOAD", "Limits", "Sandbox", "SandboxError", "SandboxResult", "SandboxUnavailable"]

PRELOAD = (
    "array", "bisect", "collections", "copy", "dataclasses", "datetime", "decimal", "enum", "fractions",
    "encodings.idna", "functools", "heapq", "itertools", "json", "math", "operator", "random", "re", "socket",
    "statistics", "string", "textwrap", "typing", "unicodedata",
)  # fmt: skip
HIDE = ("/home", "/root", "/work")  # host directories the code finds empty (those that exist)
_UID_BASE = 1 << 30  # sandbox uids: base + 16 × the caller's pid + a counter, unique among live runs
_CLONE_NEWNS, _CLONE_NEWPID, _CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x4000, 0x40000
_PR_SET_PDEATHSIG = 1
_SETUP_FAILED = 111  # exit code of a launcher that could not isolate (its reason is on the verdict pipe)
_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
_JOB = ".job.json"
_TAIL = 400  # characters of the code's output kept in a result's detail
_runs = itertools.count()


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the code): the sample cannot be judged."""


class SandboxUnavailable(SandboxError):
    """This host cannot isolate code (no root, no namespaces): nothing is run."""


@dataclass(frozen=True, kw_only=True)
class Limits:
    wall_s: float = 5.0  # the whole run, start-up included; keep it under the verifier's timeout_s
    cpu_s: int = 3  # RLIMIT_CPU of the code's process (SIGXCPU, then SIGKILL a second later)
    memory_mb: int = 512  # RLIMIT_AS of each of its processes
    processes: int = 16  # RLIMIT_NPROC of its uid: processes and threads, all of them together
    file_mb: int = 8  # RLIMIT_FSIZE: the largest file it may write
    open_files: int = 32  # RLIMIT_NOFILE
    tmp_mb: int = 16  # size of each tmpfs it may write in (/tmp, /var/tmp, /dev/shm)


@dataclass(frozen=True, kw_only=True)
class SandboxResult:
    status: str  # "passed" (every test), "failed", "timeout" (wall clock) or "crashed" (no verdict)
    passed: int
    total: int
    detail: str  # the first failure, or how it ended, with the tail of its output
    elapsed_s: float


class Sandbox:
    """Runs code isolated; `check` (default) probes the host once and refuses one that cannot isolate."""

    def __init__(
        self, limits: Limits | None = None, *, hide: Sequence[str] = HIDE, check: bool = True
    ) -> None:
        self.limits = limits or Limits()
        self.hide = tuple(d for d in hide if os.path.isdir(d))
        if check:
            self.check()

    def check(self) -> None:
        """Raises SandboxUnavailable, naming what is missing, unless a trivial run passes isolated."""
        if not sys.platform.startswith("linux"):
            raise SandboxUnavailable(f"the code sandbox needs Linux namespaces; this is {sys.platform}")
        if os.geteuid() != 0:
            raise SandboxUnavailable(
                "the code sandbox needs root (CAP_SYS_ADMIN for network, PID and mount namespaces; "
                "CAP_SETUID to run code as a uid of its own, so RLIMIT_NPROC binds)"
            )
        result = self.run("def f():\n    return 1\n", "f", [{"args": [], "expected": 1}])
        if result.status != "passed":
            raise SandboxUnavailable(
                f"the code sandbox's probe did not pass: {result.status}: {result.detail}"
            )

    def run(self, code: str, entry_point: str, tests: Sequence[dict[str, Any]]) -> SandboxResult:
        """Runs `code`, then `entry_point(*test["args"])` against each test's "expected"."""
        uid = _UID_BASE + 16 * os.getpid() + next(_runs) % 16
        _kill_uid(uid)  # a run of an earlier process of the same pid, somehow left
        workdir = tempfile.mkdtemp(prefix="slipstream-sandbox-")
        nonce = secrets.token_hex(16)
        read_end = -1
        try:
            os.chown(workdir, uid, uid)
            os.chmod(workdir, 0o700)
            job = {
                "code": code, "entry_point": entry_point, "tests": list(tests), "nonce": nonce, "uid": uid,
                "parent": os.getpid(), "limits": asdict(self.limits), "hide": self.hide, "preload": PRELOAD,
            }  # fmt: skip
            fd = os.open(os.path.join(workdir, _JOB), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:  # root's, read and removed by the launcher before any code runs
                json.dump(job, f)
            read_end, write_end = os.pipe()
            with open(os.path.join(workdir, ".output"), "wb") as output:
                started = time.monotonic()
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", os.path.abspath(__file__), str(write_end)],
                    cwd=workdir, env=_ENV, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                    pass_fds=(write_end,), process_group=0,
                )  # fmt: skip
            os.close(write_end)
            timed_out = False
            try:
                proc.wait(self.limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _killpg(proc.pid)
                proc.wait()
            elapsed = time.monotonic() - started
            if survivors := _kill_uid(uid):
                raise SandboxError(f"processes {survivors} of sandbox uid {uid} survived SIGKILL")
            verdict = _verdict(_read_all(read_end), nonce)
            output_tail = _tail(Path(workdir, ".output"))
        finally:
            if read_end >= 0:
                os.close(read_end)
            shutil.rmtree(workdir, ignore_errors=True)
        if os.path.exists(workdir):
            raise SandboxError(f"the sandbox's working dir {workdir} could not be removed")
        total = len(tests)
        if verdict is not None and "error" in verdict:
            raise SandboxUnavailable(f"the code sandbox could not isolate the code: {verdict['error']}")
        if verdict is not None:
            passed = int(verdict["passed"])
            status = "passed" if passed == total else "failed"
            return SandboxResult(status=status, passed=passed, total=total,
                                 detail=_with(verdict["detail"], output_tail), elapsed_s=elapsed)  # fmt: skip
        if timed_out:
            why, status = f"still running after {self.limits.wall_s} s: killed", "timeout"
        else:
            why, status = f"ended with no verdict ({_exit_text(proc.returncode)})", "crashed"
        return SandboxResult(
            status=status, passed=0, total=total, detail=_with(why, output_tail), elapsed_s=elapsed
        )


# -- the host side's helpers ---------------------------------------------------------------------


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_uid(uid: int, timeout_s: float = 2.0) -> list[int]:
    """SIGKILLs every live process whose real uid is `uid`; returns those still there after `timeout_s`."""
    # The PID namespace already takes them all when its first process dies; this is the check that it
    # did, and the net for a run whose namespaces never came up. A sandbox uid is this run's alone.
    deadline = time.monotonic() + timeout_s
    while True:
        found = _processes_of(uid)
        if not found or time.monotonic() > deadline:
            return found
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _processes_of(uid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path("/proc", entry, "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        zombie = fields.get("State", "").strip().startswith("Z")  # gone, only not yet reaped
        if fields.get("Uid", "").split()[:1] == [str(uid)] and not zombie:
            found.append(int(entry))
    return found


def _read_all(fd: int, limit: int = 1 << 20) -> bytes:
    # Every writer is dead by now, so this ends at EOF; the limit bounds what a solution spews into it.
    chunks, size = [], 0
    while size < limit and (chunk := os.read(fd, 65536)):
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _verdict(data: bytes, nonce: str) -> dict[str, Any] | None:
    """The last line on the pipe that carries the run's nonce; lines the code wrote there are ignored."""
    found = None
    for line in data.splitlines():
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if isinstance(message, dict) and message.get("nonce") == nonce:
            found = message
    return found


def _tail(path: Path) -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - _TAIL))
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _with(detail: str, output: str) -> str:
    return f"{detail}; output: …{output[-_TAIL:]}" if output else detail


def _exit_text(code: int | None) -> str:
    if code is not None and code > 128:  # the launcher relays a signal that ended the code as 128 + n
        code = -(code - 128)
    if code is None or code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


# -- the launcher, run as `python -I -S sandbox.py FD` in the working dir ---------------------------


def _launch(fd: int) -> None:
    """Launcher (root, host namespaces): reads the job, forks the first process of a new PID namespace,
    waits for it. If its caller dies (a verifier's deadline SIGKILLs its worker), it kills the run and
    removes the working dir, which nobody else is left to do."""
    first = [0]

    def abandon(*_: Any) -> None:
        if first[0]:
            os.kill(first[0], signal.SIGKILL)  # PID 1 of the namespace: the kernel kills the rest
            os.waitpid(first[0], 0)
        shutil.rmtree(os.getcwd(), ignore_errors=True)
        os._exit(1)

    signal.signal(signal.SIGTERM, abandon)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)  # the caller dies, even SIGKILLed: `abandon`
    job = json.loads(Path(_JOB).read_text())
    os.unlink(_JOB)  # the hidden tests never lie where the code could read them
    if os.getppid() != job["parent"]:  # the caller died before prctl: nobody waits for this run
        abandon()

    def fail(what: str) -> None:
        os.write(fd, ("\n" + json.dumps({"nonce": job["nonce"], "error": what}) + "\n").encode())
        os._exit(_SETUP_FAILED)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            fail(f"{what}: {os.strerror(ctypes.get_errno())}")

    for module in job["preload"]:
        importlib.import_module(module)
    check(libc.unshare(_CLONE_NEWPID), "unshare(PID namespace)")
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        # The network and mount namespaces are this process's, so the launcher keeps the host's /tmp
        # (and can remove the working dir in `abandon`).
        check(libc.unshare(_CLONE_NEWNET | _CLONE_NEWNS), "unshare(network and mount namespaces)")
        check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "making / a private mount")
        size = f"size={job['limits']['tmp_mb']}m".encode()
        for where in ("/tmp", "/var/tmp", "/dev/shm", *job["hide"]):
            if os.path.isdir(where):
                mode = b",mode=1777" if where in ("/tmp", "/var/tmp", "/dev/shm") else b",mode=755"
                flags = _MS_NOSUID | _MS_NODEV
                check(libc.mount(b"tmpfs", where.encode(), b"tmpfs", flags, size + mode), f"tmpfs on {where}")
        _reap(libc, job, fd, fail)
    first[0] = pid
    _, status = os.waitpid(pid, 0)
    os._exit(_relayed(status))


def _reap(libc: Any, job: dict[str, Any], fd: int, fail: Any) -> None:
    """PID 1 of the namespace (root): forks the code's process and reaps until it ends, then exits,
    which kills whatever is left in the namespace. The code never runs as PID 1, which ignores signals."""
    code_pid = os.fork()
    if code_pid == 0:
        try:
            _confine(libc, job)
        except OSError as e:
            fail(f"confining the code: {e}")
        _harness(job, fd)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(1)
        if pid == code_pid:
            os._exit(_relayed(status))


def _confine(libc: Any, job: dict[str, Any]) -> None:
    uid, limits = job["uid"], job["limits"]
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    mb = 1 << 20
    for which, value in (
        (resource.RLIMIT_CPU, limits["cpu_s"]),
        (resource.RLIMIT_AS, limits["memory_mb"] * mb),
        (resource.RLIMIT_NPROC, limits["processes"]),
        (resource.RLIMIT_FSIZE, limits["file_mb"] * mb),
        (resource.RLIMIT_NOFILE, limits["open_files"]),
        (resource.RLIMIT_CORE, 0),
    ):
        hard = value + 1 if which == resource.RLIMIT_CPU else value  # SIGXCPU first, SIGKILL a second on
        resource.setrlimit(which, (value, hard))


def _harness(job: dict[str, Any], fd: int) -> None:
    """Runs the code and the tests; writes the verdict with the nonce; never returns."""
    nonce, tests = job.pop("nonce"), job.pop("tests")
    passed, detail = 0, ""
    namespace: dict[str, Any] = {"__name__": "__solution__"}
    try:
        exec(compile(job["code"], "<solution>", "exec"), namespace)
        fn = namespace.get(job["entry_point"])
        if not callable(fn):
            raise NameError(f"the code defines no function {job['entry_point']!r}")
    except BaseException as e:  # SystemExit too: exiting is not passing
        detail = f"the code raised {type(e).__name__}: {str(e)[:200]}"
    else:
        for i, test in enumerate(tests):
            try:
                got = _canonical(fn(*test["args"]))
                ok = got == _canonical(test["expected"])
                why = f"test {i}: returned {got[:200]}"
            except BaseException as e:
                ok, why = False, f"test {i}: {type(e).__name__}: {str(e)[:200]}"
            passed += ok
            detail = detail or ("" if ok else why)
        detail = detail or f"{passed}/{len(tests)} tests passed"
    message = json.dumps({"nonce": nonce, "passed": passed, "detail": detail})
    for stream in (sys.stdout, sys.stderr):  # os._exit flushes nothing, and the output helps a reader
        try:
            stream.flush()
        except BaseException:
            pass
    os.write(fd, ("\n" + message + "\n").encode())
    os._exit(0)


def _canonical(value: Any) -> str:
    return json.dumps(_plain(value), sort_keys=True, allow_nan=False)


def _plain(value: Any) -> Any:
    """`value` rebuilt from exact builtin types; anything else (a subclass, another object) is refused."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind in (list, tuple):
        return [_plain(v) for v in value]
    if kind is dict:
        return {str(_plain(k)): _plain(v) for k, v in dict.items(value)}
    raise TypeError(f"a {kind.__name__} is not a plain JSON value")


def _relayed(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    _launch(int(sys.argv[1]))
