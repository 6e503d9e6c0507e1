"""Real processes through the supervisor: handshake, data exchange, death detection, clean shutdown."""

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import uvloop
import zmq

from slipstream.cli import smoke
from slipstream.protocols.control import Status
from slipstream.protocols.drafter import HiddenStates
from slipstream.runtime import logs
from slipstream.runtime.actor import EmptyConfig
from slipstream.runtime.codec import Codec
from slipstream.runtime.supervisor import ActorSpec, Supervisor, SupervisorError

HEARTBEAT_S = 0.25


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def next_status(sup: Supervisor, topic: str, timeout: float = 30.0) -> Status:
    deadline = time.monotonic() + timeout
    while True:
        _, msg = await asyncio.wait_for(sup.inbox.get(), timeout=max(0.01, deadline - time.monotonic()))
        if isinstance(msg, Status) and msg.topic == topic:
            return msg


@pytest.mark.timeout(90)
def test_three_actors_exchange_then_sigkill_is_reported_and_rest_shut_down(tmp_path: Path) -> None:
    async def main() -> None:
        sup = Supervisor(
            tmp_path, heartbeat_s=HEARTBEAT_S, log=logs.configure(role="coordinator", run_dir=tmp_path)
        )
        pids: list[int] = []
        try:
            await sup.start(smoke.specs(sinks=2, messages=8))
            pids = [sup.pid(n) for n in ("source:0", "sink:0", "sink:1")]
            # Every actor runs with oneDNN's and ideep's shape caches bounded (the supervisor's defaults).
            environ = dict(
                line.split("=", 1)
                for line in Path(f"/proc/{pids[0]}/environ").read_bytes().decode().split("\0")
                if "=" in line
            )
            assert (
                environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY") == environ.get("LRU_CACHE_CAPACITY") == "256"
            )
            await sup.send("source:0", Status(topic="go", fields={}))
            done = await next_status(sup, "smoke_done")
            assert done.fields["acked"] == 16 and done.fields["bad"] == 0
            assert done.fields["shm_mapped_bytes"] > 0  # same-host bulk tensors took the shared-memory lane
            # What crossed the control socket, by kind: each actor's hello and ready, its heartbeats, the
            # source's status; bytes as the frames arrived. Counted afresh after a take.
            kinds = sup.traffic.take()
            assert kinds["control.hello"][0] == kinds["control.ready"][0] == 3, kinds
            assert kinds["control.status"][0] >= 1
            assert all(n >= 1 and nbytes >= 4 * n for n, nbytes in kinds.values()), kinds
            assert set(sup.traffic.take()) <= {"control.heartbeat", "control.status"}

            killed_at = time.monotonic()
            os.kill(sup.pid("sink:1"), signal.SIGKILL)
            died = await asyncio.wait_for(sup.deaths.get(), timeout=3 * HEARTBEAT_S)
            assert died.name == "sink:1" and "SIGKILL" in died.reason
            assert time.monotonic() - killed_at <= 3 * HEARTBEAT_S
            assert sorted(sup.alive()) == ["sink:0", "source:0"]
        finally:
            await sup.shutdown(reason="test over", grace_s=5.0)
        for pid in pids:
            assert gone(pid), f"process {pid} left behind"
        # The survivors stopped cleanly (they logged it, with their peak resident memory), not killed.
        for name in ("source-0", "sink-0"):
            lines = (tmp_path / "logs" / f"{name}.jsonl").read_text().splitlines()
            (stopped,) = [e for e in map(json.loads, lines) if e["event"] == "stopped"]
            assert 20 < stopped["peak_rss_mb"] < 4096  # an interpreter with torch, not the parent's size

    uvloop.run(main())


@pytest.mark.timeout(60)
def test_hung_actor_is_declared_dead_after_missed_heartbeats(tmp_path: Path) -> None:
    async def main() -> None:
        sup = Supervisor(tmp_path, heartbeat_s=HEARTBEAT_S)
        try:
            await sup.start([ActorSpec(actor="slipstream.cli.smoke:Sink")])
            pid = sup.pid("sink:0")
            os.kill(pid, signal.SIGSTOP)  # alive but silent: only heartbeats can tell
            stopped_at = time.monotonic()
            died = await asyncio.wait_for(sup.deaths.get(), timeout=10 * HEARTBEAT_S)
            assert died.name == "sink:0" and "no heartbeat" in died.reason
            assert time.monotonic() - stopped_at <= 3 * HEARTBEAT_S + 2 * HEARTBEAT_S  # + one check period
        finally:
            await sup.shutdown(grace_s=0.5)
        assert gone(pid)

    uvloop.run(main())


@pytest.mark.timeout(60)
def test_actor_drops_malformed_messages_and_serves_the_next(tmp_path: Path) -> None:
    async def main() -> None:
        sup = Supervisor(tmp_path, heartbeat_s=HEARTBEAT_S)
        try:
            await sup.start([ActorSpec(actor="slipstream.cli.smoke:Sink")])
            endpoint = sup.endpoints()["sink:0"]
            ctx = zmq.Context()
            peer = ctx.socket(zmq.ROUTER)  # the sink replies to its sender: be addressable
            peer.setsockopt(zmq.IDENTITY, b"tester:0")
            bound = ipc_for(tmp_path)
            peer.bind(bound)
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.IDENTITY, b"tester:0")
            dealer.connect(endpoint)
            codec = Codec()
            good = HiddenStates(group_id=5, sample_index=0, token_ids=torch.arange(4),
                                hidden=torch.ones(4, 8), response_start=1, policy_version=0)  # fmt: skip
            frames = codec.encode(good)
            for bad in ([b"drafter.hidden"], [b"nope", b"\x90"], [b"drafter.hidden", b"\xc1\xc1\xc1"],
                        [frames[0], frames[1][:-2]], [os.urandom(7), os.urandom(40)]):  # fmt: skip
                dealer.send_multipart(bad)
            dealer.send_multipart(frames)
            await asyncio.sleep(1.0)
            log = (tmp_path / "logs" / "sink-0.jsonl").read_text()
            assert log.count('"event":"dropped_malformed"') == 5
            assert '"event":"handler_failed"' not in log
            # The valid message after the garbage was served: the sink's handler ran (it tried to reply
            # to "tester:0", which is not a peer it knows, so the IO thread logs that destination).
            assert '"event":"unknown_destination"' in log
            assert sup.alive() == ["sink:0"]
            dealer.close(0)
            peer.close(0)
            ctx.term()
        finally:
            await sup.shutdown(grace_s=2.0)
        assert '"handled":1,' in (tmp_path / "logs" / "sink-0.jsonl").read_text()  # exactly the valid one

    uvloop.run(main())


def ipc_for(tmp_path: Path) -> str:
    from slipstream.runtime.transport import ipc_endpoint

    return ipc_endpoint(tmp_path, "tester")


@pytest.mark.timeout(30)
def test_bad_actor_config_fails_at_start_naming_the_field(tmp_path: Path) -> None:
    async def main() -> None:
        sup = Supervisor(tmp_path, heartbeat_s=HEARTBEAT_S)
        bad = ActorSpec(actor="slipstream.cli.smoke:Source", config={"sinks": [], "mesages": 3})
        with pytest.raises(SupervisorError, match=r"source:0 config: mesages: unknown field"):
            await sup.start([bad])
        sup2 = Supervisor(tmp_path / "b", heartbeat_s=HEARTBEAT_S)
        bad = ActorSpec(actor="slipstream.cli.smoke:Source", config={"messages": "many"})
        with pytest.raises(SupervisorError, match=r"source:0 config: messages: expected `int`, got `str`"):
            await sup2.start([bad])

    uvloop.run(main())


def test_actor_spec_of_carries_the_typed_config() -> None:
    spec = ActorSpec.of(
        smoke.Source, rank=2, config=smoke.Source.Config(sinks=["sink:0"], messages=3), cpus=[1]
    )
    assert spec.actor == "slipstream.cli.smoke:Source" and spec.rank == 2 and spec.cpus == [1]
    assert spec.plain_config() == {"sinks": ["sink:0"], "messages": 3, "tokens": 1024, "hidden": 576}
    assert ActorSpec.of(smoke.Sink).config == EmptyConfig()  # the Config's defaults when none is given
    with pytest.raises(TypeError, match=r"Source: config is a EmptyConfig, expected Source.Config"):
        ActorSpec.of(smoke.Source, config=EmptyConfig())
    with pytest.raises(TypeError, match="not an Actor subclass"):
        ActorSpec.of(Status)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_a_typed_config_is_checked_before_anything_spawns(tmp_path: Path) -> None:
    async def main() -> None:
        sup = Supervisor(tmp_path / "a", heartbeat_s=HEARTBEAT_S)
        wrong = ActorSpec(actor="slipstream.cli.smoke:Source", config=EmptyConfig())
        with pytest.raises(SupervisorError, match=r"source:0 config: a EmptyConfig, expected Source.Config"):
            await sup.start([wrong])
        sup2 = Supervisor(tmp_path / "b", heartbeat_s=HEARTBEAT_S)
        bad = ActorSpec.of(smoke.Source, config=smoke.Source.Config(messages="many"))  # type: ignore[arg-type]
        with pytest.raises(SupervisorError, match=r"source:0 config: messages: expected `int`, got `str`"):
            await sup2.start([bad])

    uvloop.run(main())


@pytest.mark.timeout(30)
def test_unknown_actor_path_fails_at_start(tmp_path: Path) -> None:
    async def main() -> None:
        sup = Supervisor(tmp_path)
        with pytest.raises(SupervisorError, match="cannot load actor"):
            await sup.start([ActorSpec(actor="slipstream.cli.smoke:Nope")])

    uvloop.run(main())


@pytest.mark.timeout(60)
def test_live_event_stream_carries_actor_logs(tmp_path: Path) -> None:
    """What `slipstream logs RUN --follow` reads: actors' records, live, filtered by role prefix."""

    async def main() -> None:
        sup = Supervisor(tmp_path, heartbeat_s=HEARTBEAT_S)
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        try:
            await sup.start([ActorSpec(actor="slipstream.cli.smoke:Sink")])
            endpoints = json.loads((tmp_path / "endpoints.json").read_text())
            sub.connect(endpoints["events"])
            sub.setsockopt(zmq.SUBSCRIBE, b"sink")
            await asyncio.sleep(0.5)  # PUB/SUB: a subscription takes a moment to reach the publisher
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(sup.endpoints()["sink:0"])
            dealer.send_multipart([b"garbage", b"\x00"])  # the sink logs dropped_malformed
            deadline = time.monotonic() + 10
            events = []
            while time.monotonic() < deadline and "dropped_malformed" not in events:
                if sub.poll(100):
                    topic, line = sub.recv_multipart()
                    assert topic == b"sink:0"
                    events.append(json.loads(line)["event"])
                await asyncio.sleep(0)
            assert "dropped_malformed" in events
            dealer.close(0)
        finally:
            sub.close(0)
            ctx.term()
            await sup.shutdown(grace_s=2.0)

    uvloop.run(main())
