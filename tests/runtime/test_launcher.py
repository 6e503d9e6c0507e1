"""The supervisor starts actors through a launcher (runtime/launcher.py): the seam where node agents will
start actors on other nodes (issue 20). Real processes through the local launcher."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import pytest
import uvloop

from slipstream.runtime.launcher import ActorLaunch, LocalLauncher, ProcessHandle
from slipstream.runtime.supervisor import ActorSpec, Supervisor, SupervisorError


class Recording(LocalLauncher):
    """The local launcher, noting what it was asked to start (as a node agent's launcher would be asked)."""

    def __init__(self, nodes: Collection[int] = (0,)) -> None:
        self.nodes = tuple(nodes)
        self.launched: list[tuple[str, int, list[int]]] = []

    async def launch(self, a: ActorLaunch) -> ProcessHandle:
        self.launched.append((a.actor, a.node, sorted(a.cpus)))
        return await super().launch(a)


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
    assert all(actor == "slipstream.cli.smoke:Sink" for actor, _, _ in launcher.launched)


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
        a = ActorLaunch(name="sink:0", actor="slipstream.cli.smoke:Sink", rank=0, node=2, run_dir="/tmp")
        with pytest.raises(ValueError, match="node 2: a local launcher starts actors on node 0 only"):
            await LocalLauncher().launch(a)

    uvloop.run(main())
