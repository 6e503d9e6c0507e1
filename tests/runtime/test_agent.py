"""Node agents (runtime/agent.py): a second node's actors start through its agent and talk to the head and to
node 0's actors over CURVE TCP. Real processes on loopback: the agent is a separate process, as on a node."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import uvloop
import zmq

from slipstream.cli import smoke
from slipstream.protocols.control import Status
from slipstream.runtime import logs
from slipstream.runtime.agent import AgentLauncher
from slipstream.runtime.cluster import CONTROL, Cluster, run_keys
from slipstream.runtime.supervisor import ActorSpec, Supervisor

AGENT = """
import asyncio, sys
from pathlib import Path
from slipstream.runtime import logs
from slipstream.runtime.agent import run_agent
from slipstream.runtime.cluster import Cluster
port, run_dir, key, head_timeout = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], float(sys.argv[4])
cluster = Cluster(nnodes=2, node_rank=1, head_host="127.0.0.1", head_port=port, address="127.0.0.1")
log = logs.configure(role="agent", rank=1, run_dir=run_dir)
key_file = Path(key) if key else None
sys.exit(asyncio.run(run_agent(cluster, run_dir, key_file=key_file, log=log, head_timeout_s=head_timeout)))
"""


def free_port() -> int:
    """A base port with the run's derived ports free too (control .. data ports of a few actors)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 32 < 65535 and all(_free(port + k) for k in range(32)):
            return port
    raise RuntimeError("no free port range")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start_agent(port: int, run_dir: Path, key: Path | None, head_timeout_s: float = 10.0) -> subprocess.Popen:
    args = [str(port), str(run_dir), str(key or ""), str(head_timeout_s)]
    return subprocess.Popen([sys.executable, "-c", AGENT, *args])


def gone(pid: int, within_s: float = 5.0) -> bool:
    """The process ended (a zombie waiting for its new parent to reap it counts) within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


def events(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / "logs" / f"{name}.jsonl"
    return [msgspec.json.decode(line) for line in path.read_bytes().splitlines()] if path.exists() else []


def test_a_second_nodes_actors_start_through_its_agent_and_exchange_tensors_over_curve(
    tmp_path: Path,
) -> None:
    port = free_port()
    cluster = Cluster(nnodes=2, node_rank=0, head_host="127.0.0.1", head_port=port, address="127.0.0.1")
    keys, key_file = run_keys(tmp_path, keys_dir=None, create=True)
    assert (key_file.stat().st_mode & 0o777) == 0o600
    agent = start_agent(port, tmp_path, key_file)
    log = logs.configure(role="coordinator", run_dir=tmp_path)
    specs = [
        ActorSpec.of(smoke.Source, config=smoke.Source.Config(sinks=["sink:0", "sink:1"], messages=8)),
        ActorSpec.of(smoke.Sink, rank=0),
        ActorSpec.of(smoke.Sink, rank=1, node=1),
    ]
    seen: dict = {}

    async def main() -> None:
        agents = AgentLauncher(cluster, curve=keys, log=log)
        joined = await agents.wait_for_agents(60)
        seen["joined"] = joined[1]
        sup = Supervisor(
            tmp_path, heartbeat_s=0.5, log=log, cluster=cluster, curve_key=key_file, remote=agents
        )
        try:
            await sup.start(specs)
            seen["from_node_0"], seen["from_node_1"] = sup.endpoints(0), sup.endpoints(1)
            seen["sink1_pid"] = sup.pid("sink:1")
            # Someone without the run's key (with a key pair of its own and the head's public key), and
            # someone speaking plaintext, knock on the head's control port while the run works.
            ctx = zmq.Context()
            intruder, plain = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
            intruder.curve_serverkey = keys.public
            intruder.curve_publickey, intruder.curve_secretkey = zmq.curve_keypair()
            for s in (intruder, plain):
                s.setsockopt(zmq.LINGER, 0)
                s.connect(f"tcp://127.0.0.1:{port + CONTROL}")
                s.send(b"hello")
            await sup.send("source:0", Status(topic="go", fields={}))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                _, msg = await asyncio.wait_for(sup.inbox.get(), timeout=60)
                if isinstance(msg, Status) and msg.topic == "smoke_done":
                    seen["done"] = msg.fields
                    break
            for _ in range(50):  # the refusals are logged as they happen
                if {"peer_refused", "handshake_failed"} <= {
                    e["event"] for e in events(tmp_path, "coordinator")
                }:
                    break
                await asyncio.sleep(0.1)
            intruder.close(0)
            plain.close(0)
            ctx.term()
            assert sup.deaths.empty()
        finally:
            await sup.shutdown(reason="test")
            await agents.close("test")

    uvloop.run(main())
    assert agent.wait(timeout=30) == 0  # the agent stopped when the head said the run is over
    assert seen["joined"].node == 1 and seen["joined"].cores >= 1
    assert seen["done"]["acked"] == 16 and seen["done"]["bad"] == 0  # every tensor checksummed across
    # Peers on the same node meet over ipc; across nodes over tcp.
    assert seen["from_node_0"]["sink:0"].startswith("ipc://")
    assert seen["from_node_0"]["sink:1"] == f"tcp://127.0.0.1:{port + 16 + 2}"  # the 3rd actor's port
    assert seen["from_node_1"]["sink:0"].startswith("tcp://") and seen["from_node_1"]["sink:1"].startswith(
        "ipc://"
    )
    started = [e for e in events(tmp_path, "agent-1") if e["event"] == "actor_started"]
    assert [(e["actor"], e["pid"]) for e in started] == [("sink:1", seen["sink1_pid"])]
    logged = {e["event"] for e in events(tmp_path, "coordinator")}
    assert "peer_refused" in logged  # the intruder's key, by the ZAP handler
    assert "handshake_failed" in logged  # the plaintext client, by the socket monitor


def test_a_lost_nodes_actors_restart_on_node_0_and_their_peers_follow(tmp_path: Path) -> None:
    port = free_port()
    cluster = Cluster(nnodes=2, node_rank=0, head_host="127.0.0.1", head_port=port, address="127.0.0.1")
    keys, key_file = run_keys(tmp_path, keys_dir=None, create=True)
    agent = start_agent(port, tmp_path, key_file)
    log = logs.configure(role="coordinator", run_dir=tmp_path)
    seen: dict = {}

    async def main() -> None:
        # 8 s: on a slow host the agent starting sink:1 (a fresh interpreter importing torch) went quiet
        # for over 3 s, and node 1 was taken as lost before it was killed.
        agents = AgentLauncher(cluster, curve=keys, log=log, lost_after_s=8.0)
        await agents.wait_for_agents(60)
        sup = Supervisor(tmp_path, heartbeat_s=0.5, log=log, cluster=cluster, curve_key=key_file, remote=agents,
                         restart_backoff_s=0.1)  # fmt: skip
        try:
            await sup.start([
                ActorSpec.of(smoke.Source, config=smoke.Source.Config(sinks=["sink:0", "sink:1"], messages=4)),
                ActorSpec.of(smoke.Sink, rank=0),
                ActorSpec.of(smoke.Sink, rank=1, node=1),
            ])  # fmt: skip
            pid, before = sup.pid("sink:1"), sup.endpoints(0)["sink:1"]
            os.kill(agent.pid, signal.SIGKILL)  # the node's agent dies; its actors die with it (PDEATHSIG)
            died = await asyncio.wait_for(sup.deaths.get(), timeout=30)
            assert died.name == "sink:1" and gone(pid)
            await sup.restart("sink:1")  # node 1 is lost meanwhile: it starts on node 0
            seen["moved"] = (before, sup.endpoints(0)["sink:1"])
            # The source on node 0 was told where sink:1 is now: its tensors reach it, checksums intact.
            await sup.send("source:0", Status(topic="go", fields={}))
            while True:
                _, msg = await asyncio.wait_for(sup.inbox.get(), timeout=60)
                if isinstance(msg, Status) and msg.topic == "smoke_done":
                    seen["done"] = msg.fields
                    break
        finally:
            await sup.shutdown(reason="test")
            await agents.close("test")

    uvloop.run(main())
    before, after = seen["moved"]
    assert before.startswith("tcp://") and after.startswith("ipc://")  # node 0's peers reach it over ipc now
    assert seen["done"]["acked"] == 8 and seen["done"]["bad"] == 0
    logged = events(tmp_path, "coordinator")
    assert any(e["event"] == "node_lost" and e["node"] == 1 for e in logged)
    assert any(e["event"] == "relocated" and e["actor"] == "sink:1" and e["from_node"] == 1 for e in logged)
    assert any(e["event"] == "peer_moved" and e["peer"] == "sink:1" for e in events(tmp_path, "source-0"))


def test_an_agent_whose_head_falls_silent_stops_its_actors_and_exits(tmp_path: Path) -> None:
    port = free_port()
    cluster = Cluster(nnodes=2, node_rank=0, head_host="127.0.0.1", head_port=port, address="127.0.0.1")
    keys, key_file = run_keys(tmp_path, keys_dir=None, create=True)
    agent = start_agent(port, tmp_path, key_file, head_timeout_s=3.0)
    log = logs.configure(role="coordinator", run_dir=tmp_path)
    seen: dict = {}

    async def main() -> None:
        agents = AgentLauncher(cluster, curve=keys, log=log)
        await agents.wait_for_agents(60)
        sup = Supervisor(
            tmp_path, heartbeat_s=0.5, log=log, cluster=cluster, curve_key=key_file, remote=agents
        )
        await sup.start([ActorSpec.of(smoke.Sink, rank=1, node=1)])
        seen["pid"] = sup.pid("sink:1")
        # The head falls silent without a word (as if its host hung): no StopAgent, no heartbeats to anyone.
        for task in agents._tasks + sup._tasks[1:]:  # every loop but the supervisor's receive loop
            task.cancel()
        started = time.monotonic()
        seen["code"] = await asyncio.get_running_loop().run_in_executor(None, agent.wait, 60)
        seen["after_s"] = time.monotonic() - started
        await sup.shutdown(reason="test", grace_s=0.5)
        await agents.close("test")

    uvloop.run(main())
    assert seen["code"] == 1 and seen["after_s"] < 10  # its head timeout (3 s here) and a 2 s grace
    assert gone(seen["pid"])
    assert any(e["event"] == "head_lost" for e in events(tmp_path, "agent-1"))
