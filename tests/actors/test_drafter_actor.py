"""The drafter actor: preemption latency and restart from checkpoint after SIGKILL (real processes), and
the policy version its updates carry (in-process, through its handlers)."""

import asyncio
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import uvloop
import zmq

from slipstream.actors.drafter import DrafterActor
from slipstream.protocols.base import Message
from slipstream.protocols.control import Lease, Preempt, Released, Status
from slipstream.protocols.drafter import DrafterUpdate, HiddenStates
from slipstream.runtime.codec import Codec, checksum
from slipstream.runtime.inbox import Inbox
from slipstream.runtime.process import pin_threads
from slipstream.runtime.supervisor import ActorSpec, Supervisor
from tests.engine.conftest import build_checkpoint

HEARTBEAT_S = 0.25


def drafter_config(model: Path, **config: Any) -> DrafterActor.Config:
    # nice 0: an actor built in this process must not lower the test process's own priority for good.
    fields = {"publish_to": ["coordinator"], "batch_tokens": 256, "min_buffer_tokens": 32,
              "publish_every_steps": 5, "checkpoint_every_steps": 5, "publish_min_interval_s": 0.0,
              "nice": 0, **config}  # fmt: skip
    return DrafterActor.Config(model=str(model), **fields)


def drafter_spec(model: Path, rank: int = 0, **config: Any) -> ActorSpec:
    """A drafter process, at the niceness it runs with in a run unless `config` says otherwise."""
    config = {"nice": DrafterActor.Config(model="").nice, **config}
    return ActorSpec.of(DrafterActor, rank=rank, config=drafter_config(model, **config), threads=1)


def hidden_states(
    n: int, hidden_size: int, vocab: int, *, seed: int = 0, policy_version: int = 0
) -> list[HiddenStates]:
    """`n` random sequences' hidden states, as rollouts send them."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 40 + i % 30
        out.append(
            HiddenStates(
                group_id=i,
                sample_index=0,
                token_ids=torch.randint(0, vocab, (length,), generator=gen),
                hidden=torch.randn(length, hidden_size, generator=gen),
                response_start=8,
                policy_version=policy_version,
            )
        )
    return out


def send_as(endpoint: str, identity: str, messages: Iterable[Message]) -> None:
    """Sends `messages` to an actor's data socket as the peer `identity` would."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.connect(endpoint)
    codec = Codec()
    for msg in messages:
        sock.send_multipart(codec.encode(msg))
    sock.close(linger=2000)
    ctx.term()


def feed(
    endpoint: str, n: int, hidden_size: int, vocab: int, *, seed: int = 0, policy_version: int = 0
) -> None:
    """Streams `n` random sequences' hidden states to the drafter's data socket."""
    send_as(
        endpoint, "rollout:0", hidden_states(n, hidden_size, vocab, seed=seed, policy_version=policy_version)
    )


def _nice(pid: int, tid: int) -> int:
    """A thread's niceness, from /proc (field 19 of its stat line)."""
    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])


async def wait_for(sup: Supervisor, kind: type, pred=lambda m: True, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        _, msg = await asyncio.wait_for(sup.inbox.get(), timeout=max(0.01, deadline - time.monotonic()))
        if isinstance(msg, kind) and pred(msg):
            return msg


@pytest.mark.timeout(120)
def test_preempt_releases_within_100ms_p99(tmp_path: Path) -> None:
    model = build_checkpoint(tmp_path / "model")

    async def main() -> list[float]:
        sup = Supervisor(tmp_path / "run", heartbeat_s=HEARTBEAT_S)
        try:
            await sup.start([drafter_spec(model, checkpoint_every_steps=0, publish_every_steps=1)])
            # Its compute thread (tid = pid) yields to anything else on a core; its IO thread, which
            # heartbeats and takes the Preempt off the socket, keeps its priority.
            pid = sup.pid("drafter:0")
            nice = {int(t): _nice(pid, int(t)) for t in os.listdir(f"/proc/{pid}/task")}
            assert nice[pid] == 19 and 0 in nice.values(), nice
            feed(sup.endpoints()["drafter:0"], 40, 64, 160)
            latencies = []
            for lease_id in range(1, 21):
                await sup.send("drafter:0", Lease(lease_id=lease_id, device="cpu:0", threads=1))
                await wait_for(sup, DrafterUpdate)  # it is training
                await sup.send("drafter:0", Preempt(lease_id=lease_id, reason="test", sent_ns=time.time_ns()))
                released = await wait_for(sup, Released, lambda m, lid=lease_id: m.lease_id == lid)
                latencies.append(released.latency_ns / 1e6)
            return latencies
        finally:
            await sup.shutdown(grace_s=5.0)

    latencies = sorted(uvloop.run(main()))
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(
        f"preempt→released ms: p50 {latencies[len(latencies) // 2]:.2f} p99 {p99:.2f} max {latencies[-1]:.2f}"
    )
    assert p99 <= 100.0, f"preempt→released p99 {p99:.1f} ms (all: {latencies})"


@pytest.mark.timeout(150)
def test_sigkilled_drafter_restarts_from_its_last_checkpoint(tmp_path: Path) -> None:
    model = build_checkpoint(tmp_path / "model")
    run_dir = tmp_path / "run"

    async def first_life() -> dict[int, DrafterUpdate]:
        sup = Supervisor(run_dir, heartbeat_s=HEARTBEAT_S)
        published: dict[int, DrafterUpdate] = {}
        try:
            await sup.start([drafter_spec(model)])
            feed(sup.endpoints()["drafter:0"], 30, 64, 160, policy_version=4)
            await sup.send("drafter:0", Lease(lease_id=1, device="cpu:0", threads=1))
            checkpointed = 0
            while checkpointed < 10:
                _, msg = await asyncio.wait_for(sup.inbox.get(), timeout=30)
                if isinstance(msg, DrafterUpdate):
                    published[msg.version] = DrafterUpdate(
                        version=msg.version, policy_version=msg.policy_version, names=list(msg.names),
                        tensors=[t.clone() for t in msg.tensors], checksum=msg.checksum,
                    )  # fmt: skip
                elif isinstance(msg, Status) and msg.topic == "drafter_checkpoint":
                    checkpointed = int(msg.fields["version"])
            os.kill(sup.pid("drafter:0"), signal.SIGKILL)
            died = await asyncio.wait_for(sup.deaths.get(), timeout=5)
            assert "SIGKILL" in died.reason
        finally:
            await sup.shutdown(grace_s=1.0)
        return published

    async def second_life() -> DrafterUpdate:
        sup = Supervisor(run_dir, heartbeat_s=HEARTBEAT_S)
        try:
            await sup.start([drafter_spec(model)])
            return await wait_for(sup, DrafterUpdate)  # published at once from the restored checkpoint
        finally:
            await sup.shutdown(grace_s=5.0)

    published = uvloop.run(first_life())
    restored = uvloop.run(second_life())
    assert restored.version >= 10 and restored.version % 5 == 0
    before = published[restored.version]
    assert restored.names == before.names
    assert all(torch.equal(a, b) for a, b in zip(restored.tensors, before.tensors, strict=True))
    assert restored.checksum == before.checksum == checksum(restored.names, restored.tensors)
    assert restored.policy_version == before.policy_version == 4  # checkpointed with the weights

    # The run's drafter is a deployment asset: export it and reload it into the engine, unchanged.
    from slipstream.cli.drafter import export_run
    from slipstream.engine import eagle_export
    from slipstream.engine.weights import load_model

    info = export_run(run_dir, model=str(model), out=tmp_path / "exported")
    assert info["version"] == restored.version
    drafter = eagle_export.load(tmp_path / "exported", load_model(model))
    reloaded = drafter.head.state_dict()
    for name, tensor in zip(restored.names, restored.tensors, strict=True):
        assert torch.equal(reloaded[name], tensor), name


class Sent:
    """Outbox of an in-process actor: decodes what it sends, as a peer would receive it."""

    def __init__(self) -> None:
        self.codec = Codec()
        self.messages: list[tuple[str, Message]] = []

    def send(self, dest: str, frames: list[Any]) -> None:
        self.messages.append((dest, self.codec.decode(frames)))

    def updates(self) -> list[DrafterUpdate]:
        return [m for _, m in self.messages if isinstance(m, DrafterUpdate)]


@pytest.mark.timeout(60)
def test_updates_carry_the_newest_policy_version_trained_on(tmp_path: Path) -> None:
    model = build_checkpoint(tmp_path / "model")
    out = Sent()
    config = drafter_config(model, publish_every_steps=1, checkpoint_every_steps=1)
    actor = DrafterActor(config, rank=0, outbox=out, inbox=Inbox(8), run_dir=str(tmp_path / "run"))
    actor.on_start()
    try:
        for msg in hidden_states(8, 64, 160, policy_version=3):
            actor.on_hidden(msg, "rollout:0")
        actor.on_lease(Lease(lease_id=1, device="cpu:0", threads=0), "coordinator")
        assert actor.step()
        assert [u.policy_version for u in out.updates()] == [3]
        for msg in hidden_states(8, 64, 160, seed=1, policy_version=5):
            actor.on_hidden(msg, "rollout:0")
        assert actor.policy_version == 3  # buffered, not trained on yet: the drafter has not seen it
        assert actor.step()  # batches are drawn newest version first
        assert [u.policy_version for u in out.updates()] == [3, 5]
    finally:
        actor.on_stop()  # waits for the checkpoint writer
    newest = sorted((tmp_path / "run" / "drafter" / "rank-0").glob("ckpt-*.pt"))[-1]
    assert torch.load(newest, weights_only=True)["policy_version"] == 5


@pytest.mark.timeout(60)
def test_one_drafter_trains_on_every_device_leased_and_lets_each_go(tmp_path: Path) -> None:
    """A CPU host's one drafter holds the idle rollouts' cores at once: its threads are the leases' threads
    summed, every thread of the process is pinned to their cores joined, and a preempted lease's core is
    let go at once while training goes on with the others."""
    cores = sorted(os.sched_getaffinity(0))
    a, b = cores[0], cores[-1]  # two cores where the host has them (one on a single-core host)
    threads_before = torch.get_num_threads()

    def pinned() -> set[int]:
        tasks = os.listdir("/proc/self/task")
        return set().union(*(os.sched_getaffinity(int(t)) for t in tasks))

    model = build_checkpoint(tmp_path / "model")
    out = Sent()
    actor = DrafterActor(
        drafter_config(model), rank=0, outbox=out, inbox=Inbox(8), run_dir=str(tmp_path / "run")
    )
    actor.on_start()
    try:
        for msg in hidden_states(8, 64, 160):
            actor.on_hidden(msg, "rollout:0")
        actor.on_lease(Lease(lease_id=1, device="rollout:0", threads=1, cpus=[a]), "coordinator")
        actor.on_lease(Lease(lease_id=2, device="rollout:1", threads=1, cpus=[b]), "coordinator")
        assert torch.get_num_threads() == 2 and pinned() == {a, b}
        assert actor.step()
        actor.on_preempt(Preempt(lease_id=2, reason="rollout:1 busy", sent_ns=time.time_ns()), "coordinator")
        assert torch.get_num_threads() == 1 and pinned() == {a}  # rollout:1's core is its own again
        assert actor.step()  # still leased rollout:0's core
        actor.on_preempt(Preempt(lease_id=1, reason="rollout done", sent_ns=time.time_ns()), "coordinator")
        assert not actor.step()  # no lease left: dormant
        released = [m.lease_id for _, m in out.messages if isinstance(m, Released)]
        assert released == [2, 1]
        stats = [m for _, m in out.messages if type(m).__name__ == "DrafterStats"]
        assert len(stats) == 2 and 0 < stats[0].elapsed_s < stats[1].elapsed_s  # device-seconds, growing
    finally:
        actor.on_stop()
        pin_threads(set(cores))
        torch.set_num_threads(threads_before)
