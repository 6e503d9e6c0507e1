"""Weight deltas across hosts: the learner sends a cross-host (tcp://) rollout XOR deltas against the version
it acknowledged, a same-host (ipc://) one full buckets as before; the rollout decodes them against what it
holds and ends bitwise the learner's; a destination without that base refuses once (`want_full`) and a
full push repairs it; the drafter's head parts take deltas too. Driven in process through the handlers,
then in real processes, one rollout binding its data socket on tcp:// as on another node."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import uvloop

from slipstream.actors.drafter import DrafterActor
from slipstream.actors.learner import LearnerActor
from slipstream.actors.rollout import RolloutActor
from slipstream.protocols.drafter import HeadAck
from slipstream.protocols.learner import (
    XOR_ZSTD,
    PushWeights,
    ScoredGroup,
    WeightAck,
    WeightsPushed,
    WeightUpdate,
)
from slipstream.rl import recovery
from slipstream.rl.coordinator import Coordinator
from slipstream.runtime.codec import checksum
from slipstream.runtime.inbox import Inbox
from slipstream.runtime.launcher import ActorLaunch, LocalLauncher, ProcessHandle
from slipstream.runtime.supervisor import ActorSpec, Supervisor
from tests.actors.test_drafter_actor import Sent, drafter_config
from tests.actors.test_learner import as_completions, scored_groups, train, train_step
from tests.actors.test_rollout_actor import Captured, make_actor
from tests.engine.conftest import build_checkpoint

REWARDS = [[1.0, 0.0, 0.5, 1.0], [0.0, 0.5, 1.0, 0.0]]
OPTIM = {"lr": 2e-5}  # the demo's learning rate: deltas are as small as a run's
REMOTE, LOCAL = "tcp://10.0.0.2:29517", "ipc:///tmp/slipstream-test/data-rollout-1"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def groups(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> list[ScoredGroup]:
    return scored_groups(tiny, tmp_path_factory.mktemp("groups"), REWARDS)


def learner_with_peers(
    model: Path, run_dir: Path, peers: dict[str, str], **config: Any
) -> tuple[LearnerActor, Captured]:
    out = Captured()
    cfg = msgspec.convert({"model": str(model), "warm_up": False, **config}, LearnerActor.Config)
    learner = LearnerActor(cfg, rank=0, outbox=out, inbox=Inbox(8), run_dir=str(run_dir), peers=peers)
    learner.on_start()
    return learner, out


def to(out: Captured, dest: str, start: int = 0) -> list[WeightUpdate]:
    """The WeightUpdates sent to `dest`, from message `start` of the outbox on."""
    return [m for d, m in out.sent[start:] if d == dest and isinstance(m, WeightUpdate)]


def pushed(out: Captured, topic: str = "weights_pushed") -> list[dict[str, Any]]:
    """The learner's WeightsPushed reports of pushes to rollouts ("weights_pushed") or drafters alone."""
    head_only = topic == "head_pushed"
    return [
        msgspec.structs.asdict(m)
        for _, m in out.sent
        if isinstance(m, WeightsPushed) and m.head_only == head_only
    ]


def at_step(groups: list[ScoredGroup], step: int) -> list[ScoredGroup]:
    return [msgspec.structs.replace(g, step=step) for g in groups]


def cast(learner: LearnerActor) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(learner.push_dtype, copy=True) for n, p in learner.model.named_parameters()}


def bitwise_equal(rollout: RolloutActor, expected: dict[str, torch.Tensor]) -> list[str]:
    """Names whose held weights differ from `expected` in any bit (packed-only ones unpacked)."""
    held = dict(rollout.model.named_weights())
    return [n for n, t in expected.items() if not torch.equal(held[n].view(torch.uint8), t.view(torch.uint8))]


def test_remote_rollouts_get_deltas_same_host_ones_full_and_both_end_bitwise_equal(
    tiny: Path, groups: list[ScoredGroup], tmp_path: Path
) -> None:
    peers = {"rollout:0": REMOTE, "rollout:1": LOCAL}
    learner, out = learner_with_peers(tiny, tmp_path / "learner", peers, optim=OPTIM, bucket_bytes=16 << 10)
    rollouts = {n: make_actor(tiny, tmp_path / n, verify_applied_weights=True) for n in peers}
    for version in (1, 2, 3):
        start = len(out.sent)
        # The coordinator's view: each rollout acknowledged the previous version (none before the first push).
        bases = {n: version - 1 for n in peers} if version > 1 else {}
        before = cast(learner)
        train(learner, at_step(groups, version), version=version, push_to=list(peers), delta_base=bases)
        after = cast(learner)
        moved = sum(int((before[n].view(torch.int32) != t.view(torch.int32)).sum()) for n, t in after.items())
        assert moved > 0.5 * sum(t.numel() for t in after.values())  # a real step: most weights changed
        remote, local = to(out, "rollout:0", start), to(out, "rollout:1", start)
        assert len(remote) == len(local) > 1  # bucketed
        assert {u.encoding for u in local} == {""}  # same host: full, as before deltas
        assert {(u.encoding, u.base_version) for u in remote} == (
            {(XOR_ZSTD, version - 1)} if version > 1 else {("", 0)}
        )
        for name, (rollout, acks) in rollouts.items():
            for update in to(out, name, start):
                rollout.on_weights(update, "learner:0")
            # verify_applied_weights: the rollout re-hashed what it holds against the learner's checksums.
            assert [(a.version, a.ok) for a in acks.of(WeightAck)][-1] == (version, True)
            assert rollout.policy_version == version and bitwise_equal(rollout, after) == []
        report = pushed(out)[-1]
        full = sum(t.numel() * t.element_size() for t in after.values())
        assert report["version"] == version and report["bytes"] == report["full_bytes"] == full
        if version > 1:  # one remote destination took deltas; far fewer bytes crossed hosts
            assert report["deltas"] == 1 and 0 < report["wire_bytes"] < 0.8 * full
        else:
            assert report["deltas"] == 0 and report["wire_bytes"] == full
    assert all(len(acks.of(WeightAck)) == 3 for _, acks in rollouts.values())  # never a refusal


def test_a_destination_without_the_base_refuses_once_and_a_full_push_repairs_it(
    tiny: Path, groups: list[ScoredGroup], tmp_path: Path
) -> None:
    learner, out = learner_with_peers(
        tiny, tmp_path / "learner", {"rollout:0": REMOTE}, optim=OPTIM, bucket_bytes=16 << 10
    )
    train(learner, at_step(groups, 1), version=1, push_to=["rollout:0"])  # v1, full: lost with its process
    start = len(out.sent)
    train(learner, at_step(groups, 2), version=2, push_to=["rollout:0"], delta_base={"rollout:0": 1})
    deltas = to(out, "rollout:0", start)
    assert len(deltas) > 1 and {u.encoding for u in deltas} == {XOR_ZSTD}
    rollout, acks = make_actor(tiny, tmp_path / "restarted")  # a fresh process: it holds v0
    held = {n: w.clone() for n, w in rollout.model.named_weights()}
    for update in deltas:
        rollout.on_weights(update, "learner:0")
    (refusal,) = acks.of(WeightAck)  # once for the version, not once per bucket
    assert not refusal.ok and refusal.want_full and refusal.version == 2
    assert "delta base mismatch: against v1, this rollout holds v0" in (refusal.error or "")
    assert rollout.policy_version == 0 and bitwise_equal(rollout, held) == []
    # What the coordinator does with want_full: the version again, in full.
    start = len(out.sent)
    learner.on_push(PushWeights(version=2, to=["rollout:0"]), "coordinator")
    full = to(out, "rollout:0", start)
    assert {u.encoding for u in full} == {""} and pushed(out)[-1]["deltas"] == 0
    for update in full:
        rollout.on_weights(update, "learner:0")
    assert [(a.version, a.ok) for a in acks.of(WeightAck)] == [(2, False), (2, True)]
    assert rollout.policy_version == 2 and bitwise_equal(rollout, cast(learner)) == []


def test_a_delta_against_other_bits_or_a_corrupt_one_is_refused_for_a_full_push(
    tiny: Path, groups: list[ScoredGroup], tmp_path: Path
) -> None:
    learner, out = learner_with_peers(tiny, tmp_path / "learner", {"rollout:0": REMOTE}, optim=OPTIM)
    train(learner, at_step(groups, 1), version=1, push_to=["rollout:0"])
    first = to(out, "rollout:0")
    start = len(out.sent)
    train(learner, at_step(groups, 2), version=2, push_to=["rollout:0"], delta_base={"rollout:0": 1})
    (delta,) = to(out, "rollout:0", start)

    # Its v1 differs from the learner's in one element (say a learner replayed on other hardware): the
    # decoded bucket fails its checksum, which says the bases differed.
    rollout, acks = make_actor(tiny, tmp_path / "drifted")
    for update in first:
        rollout.on_weights(update, "learner:0")
    name = first[0].names[0]
    rollout.model.write_parameter(name, dict(rollout.model.named_weights())[name] + 1e-3)
    rollout.on_weights(delta, "learner:0")
    refusal = acks.of(WeightAck)[-1]
    assert refusal.want_full and "checksum mismatch" in (refusal.error or "") and rollout.policy_version == 1

    rollout, acks = make_actor(tiny, tmp_path / "corrupt")
    for update in first:
        rollout.on_weights(update, "learner:0")
    blob = bytearray(delta.tensors[0].numpy().tobytes())
    blob[len(blob) // 2] ^= 0x01
    corrupt = msgspec.structs.replace(
        delta, tensors=[torch.frombuffer(blob, dtype=torch.uint8), *delta.tensors[1:]]
    )
    rollout.on_weights(corrupt, "learner:0")
    refusal = acks.of(WeightAck)[-1]
    assert refusal.want_full and "undecodable delta" in (refusal.error or "") and rollout.policy_version == 1
    rollout.on_weights(delta, "learner:0")  # the same version's other deltas are dropped: full is coming
    assert len(acks.of(WeightAck)) == 2 and rollout.policy_version == 1


def test_pushes_without_a_base_or_with_deltas_off_are_full(
    tiny: Path, groups: list[ScoredGroup], tmp_path: Path
) -> None:
    for i, (config, bases) in enumerate([({}, {"rollout:0": 7}), ({"push_deltas": False}, {"rollout:0": 1})]):
        learner, out = learner_with_peers(
            tiny, tmp_path / f"{i}", {"rollout:0": REMOTE}, optim=OPTIM, **config
        )
        train(learner, at_step(groups, 1), version=1, push_to=["rollout:0"])
        start = len(out.sent)
        # A base the learner kept no copy of (7), or deltas switched off: full buckets.
        train(learner, at_step(groups, 2), version=2, push_to=["rollout:0"], delta_base=bases)
        assert {u.encoding for u in to(out, "rollout:0", start)} == {""}
        assert pushed(out)[-1]["wire_bytes"] == pushed(out)[-1]["full_bytes"] > 0
    # One host: no copy is kept at all (the memory a delta base costs is only paid across hosts).
    learner, _ = learner_with_peers(tiny, tmp_path / "one-host", {"rollout:0": LOCAL}, optim=OPTIM)
    train(learner, at_step(groups, 1), version=1, push_to=["rollout:0"])
    assert learner._pushed == {}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_remote_drafter_takes_head_deltas_bitwise(tmp_path: Path, tied: bool) -> None:
    model = build_checkpoint(tmp_path / "model", tie_word_embeddings=tied)
    groups = scored_groups(model, tmp_path, REWARDS)
    learner, out = learner_with_peers(model, tmp_path / "learner", {"drafter:0": REMOTE}, optim=OPTIM)
    sent = Sent()
    cfg = drafter_config(model, checkpoint_every_steps=0, verify_applied_head=True)
    drafter = DrafterActor(cfg, rank=0, outbox=sent, inbox=Inbox(8), run_dir=str(tmp_path / "run"))
    drafter.on_start()
    for version in (1, 2, 3):
        start = len(out.sent)
        bases = {"drafter:0": version - 1} if version > 1 else {}
        train(
            learner, at_step(groups, version), version=version, push_head_to=["drafter:0"], delta_base=bases
        )
        updates = to(out, "drafter:0", start)
        assert {u.encoding for u in updates} == ({XOR_ZSTD} if version > 1 else {""})
        for update in updates:
            drafter.on_weights(update, "learner:0")
        (synced,) = [msgspec.structs.asdict(m) for _, m in sent.messages[-1:] if isinstance(m, HeadAck)]
        head = {n: t for n, t in cast(learner).items() if n in drafter._head_params}
        names = sorted(head)
        assert synced["version"] == version and synced["checksum"] == checksum(
            names, [head[n] for n in names]
        )
        if version > 1:
            assert pushed(out, "head_pushed")[-1]["wire_bytes"] < pushed(out, "head_pushed")[-1]["full_bytes"]
    # A delta against a head it does not hold is refused, and the head stays.
    stale = msgspec.structs.replace(updates[0], version=9, base_version=5)
    drafter.on_weights(stale, "learner:0")
    refused = sent.messages[-1][1]
    assert isinstance(refused, HeadAck) and not refused.ok
    assert "delta base mismatch: against v5, the head is v3" in str(refused.why)
    assert drafter.head_version == 3


# -- real processes ------------------------------------------------------------------------------------


class OtherHost(LocalLauncher):
    """Starts node 1's actors on this host too, binding their data sockets on tcp://127.0.0.1 as a node's
    actors do: node 0's peers then reach them over TCP, as on another host (no CURVE: no run key)."""

    nodes = (0, 1)

    def __init__(self, port: int) -> None:
        self.port = port

    async def launch(self, a: ActorLaunch) -> ProcessHandle:
        if a.node == 1:
            a = dataclasses.replace(a, node=0, data_host="127.0.0.1", data_port=self.port)
        return await super().launch(a)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(240)
def test_real_processes_sync_by_deltas_across_hosts_and_recover_a_restarted_rollout(
    tiny: Path, groups: list[ScoredGroup], tmp_path: Path
) -> None:
    rollout_cfg = {"model": str(tiny), "max_batch": 4, "warm_up": False, "verify_applied_weights": True}
    learner_cfg = {"model": str(tiny), "optim": OPTIM, "warm_up": False, "bucket_bytes": 16 << 10}
    specs = [
        ActorSpec.of(LearnerActor, config=msgspec.convert(learner_cfg, LearnerActor.Config)),
        ActorSpec.of(RolloutActor, rank=0, node=1, config=msgspec.convert(rollout_cfg, RolloutActor.Config)),
        ActorSpec.of(RolloutActor, rank=1, config=msgspec.convert(rollout_cfg, RolloutActor.Config)),
    ]
    rollouts = ["rollout:0", "rollout:1"]

    async def main() -> tuple[dict[str, str], dict[int, dict[str, int]]]:
        sup = Supervisor(tmp_path / "run", heartbeat_s=0.5, launcher=OtherHost(free_port()))
        await sup.start(specs)
        try:
            endpoints = sup.endpoints(0)  # as the learner (node 0) reaches them
            async with Coordinator(sup, rollouts=rollouts, learners=["learner:0"], restart=True) as coord:

                async def sync(version: int) -> None:
                    share = at_step(groups, version)
                    for completion in as_completions(share, version):  # as the rollouts send them
                        await sup.send("learner:0", completion)
                    await coord.train(
                        version, {"learner:0": train_step(share, version=version, step=version)}
                    )
                    push = coord.push_weights(version, to=rollouts, deltas=True)
                    await asyncio.wait_for(push, timeout=60)
                    await asyncio.wait_for(coord.weights_applied(version), timeout=60)

                for version in (1, 2, 3):
                    await sync(version)
                # A restart the coordinator saw: no base known, so the next push is full for it.
                sup.kill("rollout:0")
                while "rollout:0" not in coord.dead:
                    await asyncio.sleep(0.05)
                await recovery.restart(
                    coord, "rollout:0", "the test"
                )  # as its recovery does, minus the re-push
                await sync(4)
                await sync(5)  # deltas again, against the v4 it got in full
                # A restart it has not seen yet (the death still in flight): the coordinator names v5 as its
                # base; the fresh process refuses the deltas (want_full) and gets v6 in full.
                sup.kill("rollout:0")
                while "rollout:0" not in coord.dead:
                    await asyncio.sleep(0.05)
                await recovery.restart(coord, "rollout:0", "the test")
                coord._holds["rollout:0"] = 5
                await sync(6)
                await sync(7)
                return endpoints, dict(coord.pushed)
        finally:
            await sup.shutdown(grace_s=5.0)

    endpoints, moved = uvloop.run(main())
    assert endpoints["rollout:0"].startswith("tcp://127.0.0.1:") and endpoints["rollout:1"].startswith(
        "ipc://"
    )
    full = moved[1]["full_bytes"]
    assert full > 0 and all(moved[v]["full_bytes"] == full for v in (1, 2, 3, 4, 5, 7))
    assert moved[1]["wire_bytes"] == full  # nothing acknowledged yet: full
    for v in (2, 3, 5, 7):  # every rollout acked the previous version: deltas across hosts
        assert moved[v]["wire_bytes"] < 0.8 * full, (v, moved[v])
    assert moved[4]["wire_bytes"] == full  # after a restart the coordinator saw
    # v6: deltas refused by the restarted rollout, then the full push: more than either alone.
    assert moved[6]["wire_bytes"] > full and moved[6]["full_bytes"] == 2 * full
    # The refusal is the restarted process's, once: not once per bucket.
    log = (tmp_path / "run" / "logs" / "rollout-0.jsonl").read_text()
    assert log.count("delta base mismatch") == 1 and "checksum mismatch" not in log
