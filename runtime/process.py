"""What /proc says about processes: whether a pid still runs, peak resident memory, a process tree's Pss.

`pid_alive` is the one check of whether a pid still runs (shared-memory slots claimed by a receiver that
died: runtime/shm.py). The non-obvious choice: a zombie still answers `kill(pid, 0)` but will never run
again, so where /proc exists its state letter decides. Pids mean something within one pid namespace.
`peak_rss_mb` reads VmHWM, not `ru_maxrss`: Linux carries that across exec, so a child forked from a
large parent would report the parent's size until it outgrew it. `MemorySampler` follows the summed Pss
of a process tree: what the tree holds at once.

`keep_freed_memory` makes glibc's malloc keep freed memory for reuse: with its defaults each buffer over
the (dynamic) mmap threshold is a fresh mmap whose pages fault in, zeroed, on every learner step
(docs/training.md, "The learner's kernel time"). An idle process hands it back with
`release_freed_memory`; `memory_now` reports resident size, heap in use and heap kept. `pin_threads` pins
every thread of the process (`sched_setaffinity(0)` moves only the caller; an OpenMP pool would stay).
`die_with_parent`: an actor dies with its launcher, a fork server with its own. `fresh_random_state`: an
actor's global generators (numpy's, torch's) seeded from the OS, forked or exec'd alike.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import resource
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_PROC = Path("/proc")
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt parameters (glibc malloc.h)
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def pid_alive(pid: int) -> bool:
    """True while `pid` names a process that can still run: not gone, not a zombie, not dead ('X')."""
    if pid <= 0:  # kill(0, …) and kill(-n, …) address process groups, never one process
        return False
    if _PROC.is_dir():
        try:
            stat = (_PROC / str(pid) / "stat").read_text()
        except FileNotFoundError:
            return False
        except OSError:  # unreadable (another user, a hardened /proc): fall back to kill(0)
            pass
        else:
            # "pid (comm) state …": comm may hold spaces and parentheses, so split at the last ")"
            fields = stat.rsplit(")", 1)[-1].split()
            return not fields or fields[0] not in ("Z", "X", "x")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB: VmHWM from /proc/self/status, else `ru_maxrss`."""
    try:
        for line in (_PROC / "self" / "status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # "VmHWM:   123456 kB"
    except (OSError, ValueError, IndexError):
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / (1 << 20) if sys.platform == "darwin" else maxrss / 1024  # bytes on macOS, KiB elsewhere


def peak_gpu_mb() -> float | None:
    """The most GPU memory this process's caching allocator held at once, MiB over its devices (CUDA graph
    pools included; the CUDA context and memory mapped from another process's IPC handles not); None where
    the process never touched CUDA. Never imports torch (reward workers run without it)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    devices = range(torch.cuda.device_count())
    return round(sum(torch.cuda.max_memory_reserved(d) for d in devices) / 2**20, 1)


def keep_freed_memory() -> bool:
    """Keep freed heap memory for reuse (glibc: no mmap-backed chunks, trim only past 2 GiB free at the
    top), so a step's buffers reuse the last step's pages instead of faulting fresh ones in. The resident
    size stays near its high-water mark, which the peak (`peak_rss_mb`) counts anyway. False where the C
    library is not glibc (musl, macOS): nothing is changed there."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # 1 on success; a C library that refuses a value keeps its default, and we say so.
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")
    ]  # fmt: skip


_libc: Any = None  # glibc, where this process runs on it: mallinfo2 and malloc_trim
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _libc.mallinfo2.restype = _MallInfo2
        _libc.malloc_trim.argtypes, _libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):  # not glibc >= 2.33
        _libc = None


def pin_threads(cpus: set[int]) -> bool:
    """Pin every thread of this process to `cpus`, not only the calling one (`sched_setaffinity(0)` moves
    just that thread: the OpenMP workers torch made earlier would stay where they were). Threads made later
    inherit their creator's cores. False where the OS has no per-thread affinity (not Linux)."""
    if not hasattr(os, "sched_setaffinity") or not (_PROC / "self" / "task").is_dir():
        return False
    for tid in os.listdir(_PROC / "self" / "task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)
    return True


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the kernel now (glibc `malloc_trim(0)`: every whole free page,
    also inside the heap, not only at its top). For a process that goes idle between bursts (a rollout
    between steps, a drafter between leases) while another one peaks: what it kept for reuse
    (`keep_freed_memory`) then stops counting against the host, and its next burst faults pages in again.
    False where the C library is not glibc, or nothing was released."""
    if _libc is None:
        return False
    return bool(_libc.malloc_trim(0))


def memory_now() -> dict[str, float]:
    """This process's resident MiB now and, under glibc, its heap: MiB in use and MiB freed but kept
    (`keep_freed_memory`), which is what a log line needs to tell a leak from a high-water mark."""
    fields: dict[str, float] = {}
    try:
        fields["rss_mb"] = round(
            int((_PROC / "self" / "statm").read_text().split()[1]) * _PAGE_BYTES / 2**20, 1
        )
    except (OSError, ValueError, IndexError):
        pass
    if _libc is not None:
        info = _libc.mallinfo2()
        fields["heap_used_mb"] = round((info.uordblks + info.hblkhd) / 2**20, 1)
        fields["heap_free_mb"] = round(info.fordblks / 2**20, 1)
    return fields


class MemorySampler:
    """The peak, over time, of the summed proportional set size (Pss) of a process and its descendants.

    Pss splits each shared page between the processes that map it (a shared-memory slot both ends map, a
    library every process loads), so the sum is what the tree holds at that moment — unlike summing each
    process's own peak RSS, which counts shared pages in every process and adds peaks from different
    moments. `sample()` reads /proc/PID/smaps_rollup of every process in the tree (Linux ≥ 4.14; elsewhere
    `available` is False and nothing is recorded); call it every second or so from any thread. `peak_mb`
    is the largest sum seen and `at_peak_mb` its split by process label (`label(pid)`, default the pid; a
    process labelled None is not counted, e.g. a benchmark's own process beside the run it measures).

    A smaps_rollup read walks the process's page tables under its mmap lock, at a CPU cost per resident GB
    that took a noticeable share of a core from the runs a bench timed, and held each process's lock while
    it allocated (docs/benchmarks.md, bench e2e). So each reading first takes every process's resident
    pages, private and shared (/proc/PID/statm, far cheaper): the tree's Pss grows only by pages some
    process newly maps, so since a process's last full read its share can have grown by at most the growth
    of its private part plus that of its shared part. If even that bound on the sum is no new peak, nothing
    more is read (`skipped`). (A process that unmaps one shared page and maps another within one interval
    slips past the bound by that page: a shared-memory slot's churn, not a step's activations.)
    """

    def __init__(self, root_pid: int | None = None, label: Callable[[int], str | None] | None = None) -> None:
        self.root_pid = os.getpid() if root_pid is None else root_pid
        self.label: Callable[[int], str | None] = label or str
        self.available = (_PROC / str(self.root_pid) / "smaps_rollup").is_file()
        self.peak_mb = 0.0
        self.at_peak_mb: dict[str, float] = {}
        self.samples = 0
        self.skipped = 0  # readings whose RSS bound was no new peak: no smaps_rollup read
        # pid -> (private, shared, Pss) MiB at its last full read
        self._read: dict[int, tuple[float, float, float]] = {}

    def tree(self) -> list[int]:
        """The root and every process descending from it now."""
        parents: dict[int, int] = {}
        for entry in _PROC.iterdir():
            if entry.name.isdigit() and (parent := parent_pid(int(entry.name))) is not None:
                parents[int(entry.name)] = parent
        tree, frontier = [self.root_pid], [self.root_pid]
        while frontier:
            frontier = [pid for pid, parent in parents.items() if parent in frontier]
            tree += frontier
        return tree

    def sample(self) -> float:
        """One reading: the tree's summed Pss in MiB now, or, where the RSS bound shows it cannot be a new
        peak, that bound (at least the sum). 0.0 where unavailable."""
        if not self.available:
            return 0.0
        self.samples += 1
        counted = {pid: key for pid in self.tree() if (key := self.label(pid)) is not None}
        rss = {pid: mb for pid in counted if (mb := _resident_mib(pid)) is not None}
        bound = 0.0
        for pid, (private, shared) in rss.items():
            last = self._read.get(pid)
            if last is None:
                bound += private + shared
            else:
                bound += last[2] + max(0.0, private - last[0]) + max(0.0, shared - last[1])
        if self.peak_mb and bound <= self.peak_mb:
            self.skipped += 1
            return bound
        split: dict[str, float] = {}
        self._read = {}
        for pid, key in counted.items():
            pss = _pss_kib(pid)
            if pss is not None:
                split[key] = split.get(key, 0.0) + pss / 1024
                if pid in rss:
                    self._read[pid] = (*rss[pid], pss / 1024)
        total = sum(split.values())
        if total > self.peak_mb:
            self.peak_mb = total
            self.at_peak_mb = {key: round(mb, 1) for key, mb in sorted(split.items())}
        return total


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies (PR_SET_PDEATHSIG, Linux); exits at once with code 3 if
    `parent_pid` (when given) is no longer its parent, gone before the request took effect."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if parent_pid and os.getppid() != parent_pid:
        os._exit(3)


def fresh_random_state() -> None:
    """Seeds numpy's and torch's global generators (where they exist) from the OS's entropy, so no two
    actors, nor an actor and its restart, draw the same numbers from them."""
    # A forked actor starts from its fork server's generators (torch's always exists there): without
    # this, a user's reward or environment drawing from one of them repeats another actor's draws.
    # Slipstream's own randomness is keyed, never drawn from these. `random` needs nothing: Python
    # reseeds it in a child of os.fork; numpy.random, imported lazily, seeds itself at its import.
    if (numpy_random := sys.modules.get("numpy.random")) is not None:
        numpy_random.seed()
    if (torch := sys.modules.get("torch")) is not None:
        torch.seed()


def parent_pid(pid: int) -> int | None:
    """The parent of `pid` from /proc/PID/stat; None if it is gone (or /proc has no such entry)."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state; comm may hold spaces
    except (OSError, ValueError, IndexError):
        return None


def _resident_mib(pid: int) -> tuple[float, float] | None:
    """(private, shared) resident MiB of `pid` from /proc/PID/statm: anonymous, and file or shmem."""
    try:
        fields = (_PROC / str(pid) / "statm").read_text().split()
        resident, shared = int(fields[1]) * _PAGE_BYTES / 2**20, int(fields[2]) * _PAGE_BYTES / 2**20
        return resident - shared, shared
    except (OSError, ValueError, IndexError):
        return None  # exited


def _pss_kib(pid: int) -> int | None:
    try:
        for line in (_PROC / str(pid) / "smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None  # exited, or not ours to read
    return None


def exit_how(code: int) -> str:
    """How a process ended: "killed by SIGKILL" or "exited with code 3"."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def exit_code_text(code: int | None) -> str:
    """An exit code for an error message: "exit code -9, SIGKILL", "exit code 2", "exit code unknown"."""
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"exit code {code}, {signal.Signals(-code).name}"
        except ValueError:
            return f"exit code {code}, signal {-code}"
    return f"exit code {code}"
