"""Launchers: how the supervisor starts an actor's process, behind one small interface.

`Supervisor._spawn` describes an actor's process as an `ActorLaunch` (what to run, on which node, with what
environment and cores) and hands it to its launcher, which returns a handle the supervisor watches (pid,
wait, kill, send_signal, returncode): `asyncio.subprocess.Process` is one. `LocalLauncher` starts the
process on this host (node 0), pinned to the spec's cores; runtime/agent.py's `AgentLauncher` asks the
node agent of another node to start it there, and its handle reports the exit the agent relays. Each side
builds the command line itself with `actor_command` (its own interpreter, its own paths). A spec placed on a
node no launcher serves is refused before anything starts, naming `node`.

    sup = Supervisor(run_dir)                                  # LocalLauncher: this host alone
    sup = Supervisor(run_dir, cluster=c, curve_key=key_file, remote=agents)   # and the agents' nodes
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from slipstream.runtime.cluster import node_env
from slipstream.runtime.fork_server import ForkServers

__all__ = [
    "ONEDNN_CACHES",
    "ActorLaunch",
    "Launcher",
    "LocalLauncher",
    "NodeLost",
    "ProcessHandle",
    "actor_command",
    "actor_env",
    "wait_all",
]

# oneDNN's primitive and ideep's computation caches (1024 entries each by default) grow for hundreds of
# steps, a rollout meeting new shapes every step; 256 holds a rollout's heap lower at equal decode time
# (docs/training.md; a miss's cost: docs/benchmarks.md).
ONEDNN_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256", "LRU_CACHE_CAPACITY": "256"}


class NodeLost(OSError):
    """A launch on a node that was lost (its agent fell silent): the supervisor restarts the actor elsewhere."""

    def __init__(self, node: int, why: str) -> None:
        super().__init__(f"node {node} {why}")
        self.node = node


class ProcessHandle(Protocol):
    """What the supervisor needs of a started actor process."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def kill(self) -> None: ...

    def send_signal(self, sig: int) -> None: ...


async def wait_all(procs: list[ProcessHandle], timeout: float) -> bool:
    """Whether every one of `procs` exited within `timeout` seconds."""
    pending = [p.wait() for p in procs if p.returncode is None]
    if not pending:
        return True
    _, not_done = await asyncio.wait([asyncio.ensure_future(w) for w in pending], timeout=timeout)
    for fut in not_done:
        fut.cancel()
    return not not_done


@dataclass(frozen=True, kw_only=True)
class ActorLaunch:
    """One actor process to start: the parts of its command line and environment that do not depend on the
    node it runs on, and where it goes."""

    name: str  # "role:rank"
    actor: str  # "pkg.mod:Class"
    rank: int
    node: int = 0
    run_dir: str
    env: dict[str, str] = field(default_factory=dict)  # set on top of the node's own environment
    cpus: list[int] = field(default_factory=list)
    handshake_timeout_s: float = 120.0
    data_port: int = 0  # multi-node: the tcp port its data socket binds (0: ipc only, one host)
    # Node 0's side of a run, as the supervisor has it (another node's agent uses its own):
    control: str = ""
    events: str = ""
    curve_key: str = ""  # the run's key file ("" = plaintext)
    data_host: str = ""  # the address its data socket binds on (multi-node)


def actor_env(spec_env: Mapping[str, str], threads: int) -> dict[str, str]:
    """An actor's environment, set on top of its node's own: the spec's `env`, its thread count for the
    BLAS/OpenMP pools, and the oneDNN cache caps, which the caller's environment (or the spec's) overrides."""
    env = {var: value for var, value in ONEDNN_CACHES.items() if var not in os.environ}
    env.update(spec_env)
    if threads > 0:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = str(threads)
    return env


def actor_command(
    a: ActorLaunch, *, control: str, events: str, curve_key: str, data_host: str, parent_pid: int
) -> list[str]:
    """The command line of actor process `a` on a node whose side of the run is the keyword arguments."""
    cmd = [
        sys.executable, "-m", "slipstream.runtime",
        "--actor", a.actor, "--rank", str(a.rank), "--node", str(a.node),
        "--control", control, "--run-dir", a.run_dir,
        "--parent-pid", str(parent_pid), "--handshake-timeout", str(a.handshake_timeout_s),
    ]  # fmt: skip
    if events:
        cmd += ["--events", events]
    if curve_key:
        cmd += ["--curve-key", curve_key]
    if data_host:
        cmd += ["--data-host", data_host, "--data-port", str(a.data_port)]
    return cmd


class Launcher(Protocol):
    """Starts actor processes on the nodes it serves."""

    nodes: Collection[int]  # the node indices whose actors this launcher can start

    async def launch(self, a: ActorLaunch) -> ProcessHandle: ...


class LocalLauncher:
    """Starts each actor on this host (node 0): forked from a fork server, or as a child process of this one."""

    nodes: Collection[int] = (0,)
    log: Any = None
    _forks: ForkServers | None = None

    def __init__(self, log: Any = None) -> None:
        self.log = log

    @property
    def forks(self) -> ForkServers:
        """How this launcher forks its actors (the servers are the process's), made on first use: a subclass
        need not call `__init__`."""
        if self._forks is None:
            self._forks = ForkServers(self.log)
        return self._forks

    async def launch(self, a: ActorLaunch) -> ProcessHandle:
        if a.node not in self.nodes:
            raise ValueError(f"node {a.node}: a local launcher starts actors on node 0 only")
        return await spawn(
            actor_command(
                a,
                control=a.control,
                events=a.events,
                curve_key=a.curve_key,
                data_host=a.data_host,
                parent_pid=os.getpid(),
            ),
            env={**node_env(a.data_host), **a.env},
            cpus=a.cpus,
            forks=self.forks,
        )


async def spawn(
    cmd: list[str], *, env: dict[str, str], cpus: Collection[int], forks: ForkServers | None = None
) -> ProcessHandle:
    """A process running `cmd` with this process's environment plus `env`, pinned to `cpus`: forked by one of
    `forks` where that can be done, else a child process of this one."""
    if forks is not None and (forked := await forks.spawn(cmd, env=env, cpus=cpus)) is not None:
        return forked
    pinned = set(cpus)
    return await asyncio.create_subprocess_exec(
        *cmd,
        env={**os.environ, **env},
        start_new_session=True,  # Ctrl-C reaches the coordinator, which shuts actors down in order
        stdin=asyncio.subprocess.DEVNULL,
        preexec_fn=(lambda: os.sched_setaffinity(0, pinned)) if pinned else None,
    )
