"""Actors forked from a fork server (runtime/fork_server.py): real processes through the supervisor. Each
test fails if actors are exec'd instead (their parent would be this process), or if a forked actor differs
from an exec'd one in what it runs with: its command line, cores, session, environment, stdio, exit code.
Servers are the process's: a test may find one an earlier test started (same environment)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import uvloop

from slipstream.runtime.actor import Actor
from slipstream.runtime.fork_server import ENV_SWITCH, ForkedProcess, ForkServers, launcher_pid
from slipstream.runtime.process import parent_pid
from slipstream.runtime.supervisor import ActorSpec, Supervisor

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork servers run on Linux only")

SINK = "slipstream.cli.smoke:Sink"
ROOT = Path(__file__).resolve().parents[2]


class Draws(Actor):
    """Writes its first draws from each global generator a reward or environment might use, by pid."""

    role = "draws"

    def on_start(self) -> None:
        draws = {
            "random": random.random(),
            "numpy": float(np.random.random()),
            "torch": float(torch.rand(())),
        }
        path = Path(self.run_dir, "draws", f"{os.getpid()}.json")
        path.parent.mkdir(exist_ok=True)
        path.with_suffix(".tmp").write_text(json.dumps(draws))
        path.with_suffix(".tmp").replace(path)


def cmdline(pid: int) -> list[str]:
    return [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0") if a]


def environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    return dict(p.split("=", 1) for p in pairs if "=" in p)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_actors_are_forked_from_one_server_and_run_as_an_exec_d_actor_would(tmp_path: Path) -> None:
    async def main() -> None:
        sup = Supervisor(tmp_path, heartbeat_s=0.25)
        try:
            await sup.start([ActorSpec(actor=SINK, rank=0), ActorSpec(actor=SINK, rank=1, cpus=[0])])
            pids = [sup.pid("sink:0"), sup.pid("sink:1")]
            servers = {parent_pid(pid) for pid in pids}
            assert len(servers) == 1 and os.getpid() not in servers  # one server forked both
            server = servers.pop()
            assert server is not None and "--fork-server" in cmdline(server)
            assert parent_pid(server) == os.getpid()
            assert [launcher_pid(pid) for pid in pids] == [os.getpid()] * 2  # what a soak may kill
            for rank, pid in enumerate(pids):
                argv = cmdline(pid)  # as ps shows an exec'd actor: its own command line, not the server's
                assert argv[:5] == [sys.executable, "-m", "slipstream.runtime", "--actor", SINK], argv
                assert argv[argv.index("--rank") + 1] == str(rank)
                assert argv[argv.index("--parent-pid") + 1] == str(server)  # it dies with its parent
                assert os.getsid(pid) == pid  # its own session: Ctrl-C reaches the coordinator alone
                assert environ(pid)["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "256"  # the launch's environment
            assert os.sched_getaffinity(pids[1]) == {0}  # its cores
            assert os.sched_getaffinity(pids[0]) == os.sched_getaffinity(0)  # none asked: this process's
            sup.kill("sink:0")
            died = await asyncio.wait_for(sup.deaths.get(), 10)
            assert (died.name, died.exit_code) == ("sink:0", -signal.SIGKILL)
        finally:
            await sup.shutdown(reason="test")
        assert sup._procs["sink:1"].proc.returncode == 0  # a clean exit's code, reported by the server
        # The server is the process's, not the supervisor's: the next supervisor here forks from it.
        again = Supervisor(tmp_path / "again", heartbeat_s=0.25)
        try:
            await again.start([ActorSpec(actor=SINK, rank=0)])
            assert parent_pid(again.pid("sink:0")) == server
        finally:
            await again.shutdown(reason="test")

    uvloop.run(main())


def test_each_environment_gets_its_own_server_and_the_switch_turns_forking_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> tuple[list[int], list[str]]:
        sup = Supervisor(tmp_path, heartbeat_s=0.25)
        try:
            await sup.start(
                [
                    ActorSpec(actor=SINK, rank=0, env={"SLIPSTREAM_TEST_TAG": "a"}),
                    ActorSpec(actor=SINK, rank=1, env={"SLIPSTREAM_TEST_TAG": "b"}),
                    ActorSpec(actor=SINK, rank=2, env={"SLIPSTREAM_TEST_TAG": "a"}),
                ]
            )
            servers = [parent_pid(sup.pid(f"sink:{r}")) or 0 for r in range(3)]
            # Each server was started with its actors' environment: what is read at interpreter start applies.
            return servers, [environ(pid)["SLIPSTREAM_TEST_TAG"] for pid in servers]
        finally:
            await sup.shutdown(reason="test")

    (server_a, server_b, server_a2), tags = uvloop.run(main())
    assert server_a == server_a2 != server_b and os.getpid() not in (server_a, server_b)
    assert tags == ["a", "b", "a"]
    monkeypatch.setenv(ENV_SWITCH, "0")

    async def exec_d() -> int | None:
        sup = Supervisor(tmp_path / "off", heartbeat_s=0.25)
        try:
            await sup.start([ActorSpec(actor=SINK, rank=0)])
            return parent_pid(sup.pid("sink:0"))
        finally:
            await sup.shutdown(reason="test")

    assert uvloop.run(exec_d()) == os.getpid()


def test_a_forked_child_writes_to_the_callers_stderr_as_it_is_at_the_fork(tmp_path: Path) -> None:
    """Not the server's (the caller's stderr when the server started): a run's log may be redirected between
    two starts. And it exits with the code an exec'd one would (argparse's 2 for a bad command line)."""
    first, second = tmp_path / "first.err", tmp_path / "second.err"

    async def main() -> list[int]:
        forks = ForkServers()
        saved = os.dup(2)
        codes = []
        try:
            for path in (first, second):
                with path.open("w") as f:
                    os.dup2(f.fileno(), 2)
                    cmd = [sys.executable, "-m", "slipstream.runtime", "--no-such-flag"]
                    proc = await forks.spawn(cmd, env={}, cpus=[])
                    assert isinstance(proc, ForkedProcess), forks.why_not
                    codes.append(await asyncio.wait_for(proc.wait(), 30))
                    assert proc.returncode == codes[-1]
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        return codes

    assert uvloop.run(main()) == [2, 2]
    assert "usage: slipstream-actor" in first.read_text()
    assert "usage: slipstream-actor" in second.read_text()


def test_a_killed_server_takes_its_actors_with_it_and_a_restart_forks_from_a_new_one(tmp_path: Path) -> None:
    async def main() -> None:
        sup = Supervisor(tmp_path, heartbeat_s=0.25, restart_backoff_s=0.0)
        try:
            await sup.start([ActorSpec(actor=SINK, rank=0), ActorSpec(actor=SINK, rank=1)])
            pids = [sup.pid("sink:0"), sup.pid("sink:1")]
            server = parent_pid(pids[0])
            assert server is not None and server != os.getpid()
            os.kill(server, signal.SIGKILL)
            deaths = [await asyncio.wait_for(sup.deaths.get(), 10) for _ in range(2)]
            assert sorted(d.name for d in deaths) == ["sink:0", "sink:1"]
            for _ in range(100):  # PDEATHSIG: the actors die with their server, nothing left behind
                if all(gone(p) for p in pids):
                    break
                await asyncio.sleep(0.05)
            assert all(gone(p) for p in pids)
            await sup.restart("sink:0")
            assert parent_pid(sup.pid("sink:0")) not in (server, os.getpid())  # forked by a new server
        finally:
            await sup.shutdown(reason="test")

    uvloop.run(main())


def test_actors_and_their_restarts_draw_different_numbers_from_every_global_generator(tmp_path: Path) -> None:
    """Forked actors start from their server's generators: each actor (and each restart) is seeded from the
    OS at start. (An exec'd actor is a fresh interpreter: numpy and torch seed themselves from the OS.)"""
    # A site whose start-up draws from numpy (as a sitecustomize or a preloaded library may): the server's
    # numpy generator then exists before it forks, as torch's always does.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import numpy.random\n\nnumpy.random.random()\n")
    pythonpath = os.pathsep.join(p for p in (str(site), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    draws = "tests.runtime.test_fork_server:Draws"

    def written() -> dict[str, dict[str, float]]:
        return {p.stem: json.loads(p.read_text()) for p in (tmp_path / "draws").glob("*.json")}

    async def main() -> list[int]:
        sup = Supervisor(tmp_path, heartbeat_s=0.25, restart_backoff_s=0.0)
        try:
            specs = [ActorSpec(actor=draws, rank=r, env={"PYTHONPATH": pythonpath}) for r in range(3)]
            await sup.start(specs)
            pids = [sup.pid(f"draws:{r}") for r in range(3)]
            assert parent_pid(pids[0]) != os.getpid()  # forked
            for _ in range(2):  # a restart of rank 0, twice
                sup.kill("draws:0")
                await asyncio.wait_for(sup.deaths.get(), 10)
                await sup.restart("draws:0")
                pids.append(sup.pid("draws:0"))
            for _ in range(200):
                if len(written()) == len(pids):
                    break
                await asyncio.sleep(0.05)
            return pids
        finally:
            await sup.shutdown(reason="test")

    pids = uvloop.run(main())
    assert len(set(pids)) == 5
    got = written()
    assert sorted(got) == sorted(map(str, pids))
    for generator in ("random", "numpy", "torch"):
        values = [d[generator] for d in got.values()]
        assert len(set(values)) == len(values), (generator, got)
