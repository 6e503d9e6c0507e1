"""The reward worker: the process a verifier runs the user's reward in, and what crosses its pipe.

`actors/verifier.py` starts these from a forkserver that preloads this module and `tasks.rewards`, so a
worker starts in milliseconds with the built-in rewards imported. The non-obvious choice: nothing here
imports torch (or anything of the actor runtime): preloaded, the actor module pulled torch into the
forkserver and every worker forked from it, doubling their memory (docs/benchmarks.md). A user's reward
that needs torch imports it itself.

A worker loads the reward (`load_reward`; one that cannot load is a start-up error naming the path), ties
its life and its process group's to the actor's (`_die_with_the_actor`), then scores `Job`s until its
pipe closes. Jobs and outcomes cross the pipe as msgspec bytes, never pickles. `judge` says what a
returned value is worth: a finite real number, or None with the reason the sample is invalid.
"""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import math
import multiprocessing.forkserver
import numbers
import os
import signal
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgspec

__all__ = ["REASONS", "Job", "Outcome", "Started", "call_reward", "judge", "worker_main"]

REASONS = ("raised", "timeout", "garbage", "none", "crashed", "bad_row", "stopped")  # why a sample is invalid
_CLIP = 300  # characters of a returned value or exception message kept in an error


# -- what crosses a worker's pipe ----------------------------------------------------------------


class Job(msgspec.Struct, array_like=True, frozen=True):
    job_id: int
    prompt: str
    completion: str
    row: dict[str, Any]


class Started(msgspec.Struct, tag=True, array_like=True, frozen=True):
    pid: int
    error: str | None  # why the reward could not be loaded


class Outcome(msgspec.Struct, tag=True, array_like=True, frozen=True):
    job_id: int
    reward: float | None
    reason: str | None  # one of REASONS when reward is None
    error: str | None
    elapsed_s: float


# -- the worker side -----------------------------------------------------------------------------


def judge(value: object) -> tuple[float | None, str | None, str | None]:
    """(reward, reason, error) for what a reward function returned."""
    if value is None:
        return None, "none", "none: the reward could not score it"
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            reward = float(value)
        except (TypeError, ValueError, OverflowError):
            reward = math.nan
        if math.isfinite(reward):
            return reward, None, None
    return None, "garbage", f"garbage: returned {_clip(repr(value))} ({type(value).__name__})"


def call_reward(
    fn: Callable[..., Any], prompt: str, completion: str, row: dict[str, Any], loop: asyncio.AbstractEventLoop
) -> tuple[float | None, str | None, str | None]:
    """One call of `fn` as a worker makes it: awaited in `loop` if async, any exception caught."""
    try:
        value = fn(prompt, completion, **row)
        if inspect.isawaitable(value):
            value = loop.run_until_complete(value)
    except BaseException as e:  # SystemExit too: a reward that exits costs its sample, not the worker
        return None, "raised", f"raised: {type(e).__name__}: {_clip(str(e))}"
    return judge(value)


def worker_main(conn: Connection, reward_path: str) -> None:
    """A worker process: load the reward, then score jobs from `conn` until the actor closes it."""
    # Imported here, not by the module: the actor imports this module but runs no reward code, and the
    # built-ins' dependencies take seconds and tens of MB to import (the forkserver has them preloaded).
    from slipstream.tasks.rewards import load_reward

    _die_with_the_actor()
    encoder = msgspec.msgpack.Encoder()
    try:
        fn = load_reward(reward_path)
    except ValueError as e:
        conn.send_bytes(encoder.encode(Started(pid=os.getpid(), error=str(e))))
        return
    conn.send_bytes(encoder.encode(Started(pid=os.getpid(), error=None)))
    decoder = msgspec.msgpack.Decoder(Job)
    loop = asyncio.new_event_loop()
    while True:
        try:
            job = decoder.decode(conn.recv_bytes())
        except EOFError:
            return
        started = time.perf_counter()
        reward, reason, error = call_reward(fn, job.prompt, job.completion, job.row, loop)
        outcome = Outcome(
            job_id=job.job_id,
            reward=reward,
            reason=reason,
            error=error,
            elapsed_s=time.perf_counter() - started,
        )
        conn.send_bytes(encoder.encode(outcome))


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


def _clip(text: str) -> str:
    return text if len(text) <= _CLIP else text[:_CLIP] + "…"
