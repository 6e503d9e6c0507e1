"""Launchers: how the supervisor starts an actor's process, behind one small interface.

`Supervisor._spawn` builds the command line and environment of an actor and hands them to its launcher,
which returns a handle the supervisor watches (pid, wait, kill, returncode): `asyncio.subprocess.Process`
is one. Today's only launcher, `LocalLauncher`, starts the process on this host (node 0), pinned to the
spec's cores. The seam exists for multi-node runs (issue 20): a node agent's launcher will start the
actors placed on its node and relay their exits, and the supervisor's watching code stays as it is. A spec
placed on a node no launcher serves is refused before anything starts, naming `node`.

    sup = Supervisor(run_dir, launcher=LocalLauncher())   # the default
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

__all__ = ["Launcher", "LocalLauncher", "ProcessHandle"]


class ProcessHandle(Protocol):
    """What the supervisor needs of a started actor process."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def kill(self) -> None: ...


class Launcher(Protocol):
    """Starts actor processes on the nodes it serves."""

    nodes: Collection[int]  # the node indices whose actors this launcher can start

    async def launch(
        self, cmd: Sequence[str], *, env: Mapping[str, str], cpus: Collection[int], node: int
    ) -> ProcessHandle: ...


class LocalLauncher:
    """Starts each actor as a child process of this one, on this host (node 0)."""

    nodes: Collection[int] = (0,)

    async def launch(
        self, cmd: Sequence[str], *, env: Mapping[str, str], cpus: Collection[int], node: int
    ) -> ProcessHandle:
        if node not in self.nodes:
            raise ValueError(f"node {node}: a local launcher starts actors on node 0 only")
        pinned = set(cpus)
        return await asyncio.create_subprocess_exec(
            *cmd,
            env=dict(env),
            start_new_session=True,  # Ctrl-C reaches the coordinator, which shuts actors down in order
            stdin=asyncio.subprocess.DEVNULL,
            preexec_fn=(lambda: os.sched_setaffinity(0, pinned)) if pinned else None,
        )
