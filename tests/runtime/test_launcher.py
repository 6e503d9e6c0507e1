"""The supervisor starts actors through a launcher (runtime/launcher.py): the seam where node agents will
start actors on other nodes (issue 20). Real processes through the local launcher."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import pytest
import uvloop

from slipstream.runtime.launcher import LocalLauncher, ProcessHandle
from slipstream.runtime.supervisor import ActorSpec, Supervisor, SupervisorError


class Recording(LocalLauncher):
    """The local launcher, noting what it was asked to start (a stand-in for a node agent's launcher)."""

    def __init__(self, nodes: Collection[int] = (0,)) -> None:
        self.nodes = tuple(nodes)
        self.launched: list[tuple[list[str], int, list[int]]] = []

    async def launch(
        self, cmd: Sequence[str], *, env: Mapping[str, str], cpus: Collection[int], node: int
    ) -> ProcessHandle:
        self.launched.append((list(cmd), node, sorted(cpus)))
        return await super().launch(cmd, env=env, cpus=cpus, node=0)


def test_every_actor_starts_through_the_supervisors_launcher(tmp_path: Path) -> None:
    launcher = Recording()

    async def main() -> None:
        sup = Supervisor(tmp_path, heartbeat_s=0.25, launcher=launcher)
        try:
            await sup.start(
                [
                    ActorSpec(actor="slipstream.cli.smoke:Sink", rank=0),
                    ActorSpec(actor="slipstream.cli.smoke:Sink", rank=1, cpus=[0]),
                ]
            )
            assert sorted(sup.endpoints()) == ["sink:0", "sink:1"]
        finally:
            await sup.shutdown(reason="test")

    uvloop.run(main())
    assert [(node, cpus) for _, node, cpus in launcher.launched] == [(0, []), (0, [0])]
    assert all("--actor" in cmd and "slipstream.cli.smoke:Sink" in cmd for cmd, _, _ in launcher.launched)


def test_an_actor_on_a_node_no_launcher_serves_is_refused_before_anything_starts(tmp_path: Path) -> None:
    launcher = Recording(nodes=(0,))

    async def main() -> None:
        sup = Supervisor(tmp_path, heartbeat_s=0.25, launcher=launcher)
        with pytest.raises(SupervisorError, match=r"sink:1: ActorSpec.node is 1.*node\(s\) \[0\]"):
            await sup.start(
                [
                    ActorSpec(actor="slipstream.cli.smoke:Sink", rank=0),
                    ActorSpec(actor="slipstream.cli.smoke:Sink", rank=1, node=1),
                ]
            )

    uvloop.run(main())
    assert launcher.launched == []  # not even node 0's actor


def test_the_local_launcher_refuses_another_node() -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="node 2: a local launcher starts actors on node 0 only"):
            await LocalLauncher().launch(["true"], env={}, cpus=(), node=2)

    uvloop.run(main())
