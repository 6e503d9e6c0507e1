"""Actor start-up benchmark: actors exec'd vs forked from a fork server (runtime/fork_server.py), side by side.

    slipstream bench startup --json [--actors 4] [--rounds 3]

Each round starts `--actors` actors through a real supervisor (the smoke Sink: the whole actor runtime,
torch imported, no model), once with fork servers off (SLIPSTREAM_FORK_SERVER=0: every actor exec'd) and
once on, the two modes alternating A B B A so a drift of the host's speed falls on both, and times: the
start (the supervisor's construction to every actor Ready, a fork server's cold start included), one
restart (a SIGKILLed actor to Ready again, no backoff), and the CPU seconds of every process the round
started, fork server included (this process's reaped children and their descendants: getrusage). Medians
per mode, then fork / exec ratios. The result is `StartupResult`; figures: docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import msgspec

from slipstream.runtime.fork_server import ENV_SWITCH, stop_servers
from slipstream.runtime.supervisor import ActorSpec, Supervisor

ACTOR = "slipstream.cli.smoke:Sink"


class ModeResult(msgspec.Struct, frozen=True, kw_only=True):
    """One mode's medians over the rounds."""

    start_s: float  # the supervisor built to every actor Ready
    restart_s: float  # one SIGKILLed actor back to Ready
    cpu_s: float  # CPU seconds of every process the round started (fork server included)


class StartupResult(msgspec.Struct, frozen=True, kw_only=True):
    """What `bench startup --json` prints."""

    actors: int
    rounds: int
    exec: ModeResult  # every actor exec'd (SLIPSTREAM_FORK_SERVER=0)
    fork: ModeResult  # actors forked from a fork server
    start_ratio: float  # fork.start_s / exec.start_s
    restart_ratio: float
    cpu_ratio: float


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def _round(run_dir: Path, actors: int) -> tuple[float, float]:
    """One round's start and restart seconds."""
    began = time.perf_counter()
    sup = Supervisor(run_dir, heartbeat_s=0.25, restart_backoff_s=0.0)
    try:
        await sup.start([ActorSpec(actor=ACTOR, rank=r) for r in range(actors)])
        started = time.perf_counter() - began
        sup.kill("sink:0")
        await asyncio.wait_for(sup.deaths.get(), 30)
        began = time.perf_counter()
        await sup.restart("sink:0")
        return started, time.perf_counter() - began
    finally:
        await sup.shutdown(reason="bench")


def _mode(forked: bool, run_dir: Path, actors: int) -> tuple[float, float, float]:
    before = os.environ.get(ENV_SWITCH)
    os.environ[ENV_SWITCH] = "1" if forked else "0"
    try:
        stop_servers()  # a cold start, as a run's first actors meet it
        cpu = _children_cpu_s()
        start, restart = asyncio.run(_round(run_dir, actors))
        stop_servers()  # reaped: its CPU counts in this round's
        return start, restart, _children_cpu_s() - cpu
    finally:
        if before is None:
            os.environ.pop(ENV_SWITCH, None)
        else:
            os.environ[ENV_SWITCH] = before


def run(actors: int = 4, rounds: int = 3) -> StartupResult:
    """`rounds` rounds of each mode, A B B A …; medians and ratios."""
    if actors < 1 or rounds < 1:
        raise ValueError(f"--actors and --rounds must be >= 1, got {actors} and {rounds}")
    seen: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="slipstream-startup-") as tmp:
        for i in range(rounds):
            for forked in (False, True) if i % 2 == 0 else (True, False):
                seen[forked].append(_mode(forked, Path(tmp) / f"{i}-{int(forked)}", actors))

    def medians(rows: list[tuple[float, float, float]]) -> ModeResult:
        start, restart, cpu = (round(statistics.median(col), 3) for col in zip(*rows, strict=True))
        return ModeResult(start_s=start, restart_s=restart, cpu_s=cpu)

    exec_d, forked = medians(seen[False]), medians(seen[True])
    return StartupResult(
        actors=actors,
        rounds=rounds,
        exec=exec_d,
        fork=forked,
        start_ratio=round(forked.start_s / exec_d.start_s, 3),
        restart_ratio=round(forked.restart_s / exec_d.restart_s, 3),
        cpu_ratio=round(forked.cpu_s / exec_d.cpu_s, 3) if exec_d.cpu_s else 0.0,
    )


def render(r: StartupResult) -> str:
    """The result as a small table."""
    rows = [f"{'':>8}  {'start s':>8}  {'restart s':>9}  {'cpu s':>7}"]
    for name, m in (("exec", r.exec), ("fork", r.fork)):
        rows.append(f"{name:>8}  {m.start_s:>8.3f}  {m.restart_s:>9.3f}  {m.cpu_s:>7.2f}")
    rows.append(f"{'ratio':>8}  {r.start_ratio:>8.3f}  {r.restart_ratio:>9.3f}  {r.cpu_ratio:>7.3f}")
    return f"{r.actors} actors, {r.rounds} rounds each, medians\n" + "\n".join(rows)
