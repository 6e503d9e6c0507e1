"""The reward worker: the process a verifier runs the user's reward in, and what crosses its pipe.

`actors/verifier.py` starts these from a forkserver that preloads this module and `tasks.rewards`, so a
worker starts in milliseconds with the built-in rewards imported. The non-obvious choice: nothing here
imports torch (or anything of the actor runtime): preloaded, the actor module pulled torch into the
forkserver and every worker forked from it, doubling their memory (docs/benchmarks.md). A user's reward
that needs torch imports it itself.

A worker loads the reward's terms (`load_reward`; one that cannot load is a start-up error naming the
path), ties its life and its process group's to the actor's (`_die_with_the_actor`), then scores `Batch`es
until its pipe closes: each batched component once per batch, then each sample's per-completion ones,
sending `Calling` before every call (so the actor knows which samples a deadline is about), `Called`
after it (its time and size: the report's reward time) and each sample's `Outcome` once it is known.
Everything crosses the pipe as msgspec bytes, never pickles. `judge` (tasks/reward_conventions.py) says
what a returned value is worth.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing.forkserver
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection

import msgspec

from slipstream.tasks.reward_conventions import (
    Component,
    RewardTerm,
    Sample,
    Verdict,
    call_reward,
    combine,
    judge,
    load_components,
    named,
)

__all__ = [
    "REASONS",
    "Batch",
    "Called",
    "Calling",
    "Job",
    "Outcome",
    "Started",
    "WorkerSpec",
    "call_reward",
    "judge",
    "worker_main",
]

REASONS = ("raised", "timeout", "garbage", "none", "crashed", "bad_row", "stopped")  # why a sample is invalid
Job = Sample  # one completion to score


# -- what crosses a worker's pipe ----------------------------------------------------------------


class WorkerSpec(msgspec.Struct, frozen=True):
    terms: tuple[RewardTerm, ...]
    data_source: str = ""  # verl's data_source where a row names none


class Batch(msgspec.Struct, array_like=True, frozen=True):
    jobs: list[Job]


class Started(msgspec.Struct, tag=True, array_like=True, frozen=True):
    pid: int
    error: str | None  # why the reward could not be loaded
    conventions: dict[str, str] = {}  # component name → how it is called


class Calling(msgspec.Struct, tag=True, array_like=True, frozen=True):
    job_ids: list[int]  # the samples the call about to start scores
    batched: bool  # one call for all of them (the actor's batch deadline) or one sample's
    component: str = ""  # the term called (a call killed at its deadline is charged to it)


class Called(msgspec.Struct, tag=True, array_like=True, frozen=True):
    component: str
    size: int  # samples the call scored
    started_ns: int  # time.monotonic_ns() as it began: one clock for the host's processes
    seconds: float  # its wall time
    invalid: int  # samples it made invalid


class Outcome(msgspec.Struct, tag=True, array_like=True, frozen=True):
    job_id: int
    reward: float | None
    reason: str | None  # one of REASONS when reward is None
    error: str | None
    elapsed_s: float
    components: dict[str, float] = {}  # each component's own reward (those that scored)
    blame: str | None = None  # the component that made the sample invalid


# -- the worker side -----------------------------------------------------------------------------


def worker_main(conn: Connection, spec: bytes) -> None:
    """A worker process: load the reward's terms, then score batches from `conn` until the actor closes it."""
    _die_with_the_actor()
    _fresh_random_state()  # before the reward loads: a class reward may draw as it is built
    encoder = msgspec.msgpack.Encoder()
    terms = msgspec.msgpack.decode(spec, type=WorkerSpec)
    try:
        components = load_components(terms.terms, terms.data_source)
    except ValueError as e:
        conn.send_bytes(encoder.encode(Started(pid=os.getpid(), error=str(e))))
        return
    conventions = {c.name: str(c.convention) for c in components}
    conn.send_bytes(encoder.encode(Started(pid=os.getpid(), error=None, conventions=conventions)))
    decoder = msgspec.msgpack.Decoder(Batch)
    loop = asyncio.new_event_loop()
    while True:
        try:
            batch = decoder.decode(conn.recv_bytes())
        except EOFError:
            return
        for outcome in score(components, batch.jobs, loop, lambda m: conn.send_bytes(encoder.encode(m))):
            conn.send_bytes(encoder.encode(outcome))


def score(
    components: list[Component],
    jobs: list[Job],
    loop: asyncio.AbstractEventLoop,
    tell: Callable[[Calling | Called], None],
) -> Iterator[Outcome]:
    """Yields each job's Outcome once known; `tell(Calling(...))` before every call of a reward and
    `tell(Called(...))` after it."""
    started = time.perf_counter()
    many = len(components) > 1  # a lone reward's errors read as before: no component name in them
    parts: dict[int, dict[str, float]] = {j.job_id: {} for j in jobs}
    failed: dict[int, tuple[Verdict, str]] = {}  # job id → its verdict, the component that gave it
    for c in (c for c in components if c.batched):
        alive = [j for j in jobs if j.job_id not in failed]
        if not alive:
            break
        tell(Calling(job_ids=[j.job_id for j in alive], batched=True, component=c.name))
        began = time.monotonic_ns()
        verdicts = c.score_batch(alive, loop)
        took = (time.monotonic_ns() - began) / 1e9
        for job, verdict in zip(alive, verdicts, strict=True):
            _record(verdict, c, job, parts, failed, many)
        bad = sum(v[0] is None for v in verdicts)
        tell(Called(component=c.name, size=len(alive), started_ns=began, seconds=took, invalid=bad))
    for job in jobs:
        for c in (c for c in components if not c.batched):
            if job.job_id in failed:
                break
            tell(Calling(job_ids=[job.job_id], batched=False, component=c.name))
            began = time.monotonic_ns()
            verdict = c.score_one(job, loop)
            took = (time.monotonic_ns() - began) / 1e9
            _record(verdict, c, job, parts, failed, many)
            tell(Called(c.name, 1, began, took, int(verdict[0] is None)))
        verdict, blame = failed.get(job.job_id) or (combine(components, parts[job.job_id]), None)
        yield Outcome(
            job_id=job.job_id, reward=verdict[0], reason=verdict[1], error=verdict[2],
            elapsed_s=time.perf_counter() - started, components=parts[job.job_id], blame=blame,
        )  # fmt: skip


def _record(
    verdict: Verdict,
    c: Component,
    job: Job,
    parts: dict[int, dict[str, float]],
    failed: dict[int, tuple[Verdict, str]],
    many: bool,
) -> None:
    if verdict[0] is None:
        failed[job.job_id] = (named(verdict, c.name) if many else verdict, c.name)
    else:
        parts[job.job_id][c.name] = verdict[0]


def _fresh_random_state() -> None:
    """Seeds the global generators a reward may draw from (numpy's, torch's where imported) from the OS:
    workers fork from one forkserver, so where it has them (a sitecustomize, a preloaded library) each
    worker would repeat its siblings' draws, and a restarted worker its predecessor's. Python reseeds
    `random` in a child of os.fork itself."""
    for name in ("numpy.random", "torch"):  # numpy.random is imported lazily, seeded from the OS then
        if (module := sys.modules.get(name)) is not None:
            module.seed()


def _die_with_the_actor() -> None:
    """Ties the life of this worker, and of every process its reward starts, to the actor's."""
    # A forkserver child inherits the server's liveness pipe (so that it could fork in turn), which
    # keeps the server alive as long as the child lives. Closed here, the server exits with the actor,
    # and PDEATHSIG then kills this worker, even in a call that hangs where no Python code runs.
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    os.setsid()  # the group's id is now our pid: the actor's killpg reaches all the reward starts
    _set_pdeathsig(signal.SIGKILL)
    _start_guard()


def _start_guard() -> None:
    """Forks the process that kills this worker's group once the worker is gone, however it went."""
    # A SIGKILLed worker cannot kill its group, and a signal handler in it would never run while a
    # reward hangs in C code holding the GIL: only another process can be relied on to do it.
    worker = os.getpid()
    if os.fork() != 0:
        return
    try:
        # The actor's pipe above all: the actor sees EOF when the worker dies, not when the guard does.
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # kept pending for sigwait
        told = _set_pdeathsig(signal.SIGTERM)
        while os.getppid() == worker:  # checked after prctl: the worker may have died before it
            if told:
                signal.sigwait({signal.SIGTERM})
            else:
                time.sleep(0.5)
        os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(0)  # never back into the worker's code


def _set_pdeathsig(sig: int) -> bool:
    """Asks the kernel for `sig` when this process's parent dies; False where that cannot be asked."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(1, sig) == 0  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False
