"""Placement: which device, cores, threads and GPU memory share each actor gets (runtime/placement.py), and
an actor out of device memory dying with its own exit code."""

from __future__ import annotations

import pytest
import torch

from slipstream.runtime.actor import Actor
from slipstream.runtime.placement import (
    CUDA_CONTEXT_BYTES,
    GPU_MEMORY_ENV,
    GpuShares,
    Host,
    NodeShare,
    Slot,
    apply_gpu_memory,
    default_shares,
    place,
    place_nodes,
)


def test_cpu_pins_each_rollout_to_a_core_and_gives_the_host_one_drafter() -> None:
    p = place("cpu", rollouts=3, learners=1, learner_threads=2, cores=2)
    assert p.rollouts == [Slot("cpu", 1, [0]), Slot("cpu", 1, [1]), Slot("cpu", 1, [0])]
    # One drafter process may run on every rollout core; each lease narrows it to the idle rollout's.
    assert p.drafters == [Slot("cpu", 1, [0, 1])]
    assert p.drafter_of == [0, 0, 0]  # the pairing the coordinator leases by
    assert p.learners == [Slot("cpu", 2, [])]


def test_cuda_gives_learners_their_own_gpus_when_there_are_enough() -> None:
    p = place("cuda", rollouts=6, learners=2, learner_threads=2, cores=16, gpus=8)
    assert [s.device for s in p.rollouts] == [f"cuda:{i}" for i in range(6)]
    assert p.drafters == p.rollouts and p.drafter_of == list(range(6))  # each GPU's drafter trains there
    assert [s.device for s in p.learners] == ["cuda:6", "cuda:7"]
    assert all(s.cpus == [] for s in p.rollouts + p.learners)


def test_cuda_shares_the_rollout_gpus_when_there_are_too_few() -> None:
    p = place("cuda", rollouts=2, learners=1, learner_threads=1, cores=16, gpus=1)
    assert [s.device for s in p.rollouts + p.drafters + p.learners] == ["cuda:0"] * 5


def test_bad_placements_name_the_problem() -> None:
    with pytest.raises(ValueError, match="at least one GPU"):
        place("cuda", rollouts=1, learners=1, learner_threads=1, cores=2, gpus=0)
    with pytest.raises(ValueError, match="'tpu'"):
        place("tpu", rollouts=1, learners=1, learner_threads=1, cores=2)
    with pytest.raises(ValueError, match="negative"):
        place("cpu", rollouts=-1, learners=1, learner_threads=1, cores=2)
    with pytest.raises(ValueError, match="nodes: 1 node shares for a run on 2 nodes"):
        place_nodes("cpu", [NodeShare(rollouts=1, learners=1)], [Host(2), Host(2)], 1)


def test_a_node_without_rollouts_has_no_drafter() -> None:
    p = place("cpu", rollouts=0, learners=1, learner_threads=2, cores=4)
    assert p.rollouts == [] and p.drafters == [] and p.learners == [Slot("cpu", 2, [])]


def test_default_shares_spread_rollouts_and_verifiers_and_keep_learners_on_node_0() -> None:
    assert default_shares(3, rollouts=4, verifiers=2, learners=2) == [
        NodeShare(rollouts=2, verifiers=1, learners=2),
        NodeShare(rollouts=1, verifiers=1, learners=0),
        NodeShare(rollouts=1, verifiers=0, learners=0),
    ]


def test_nodes_are_placed_one_by_one_with_global_ranks_and_their_own_drafters() -> None:
    shares = [NodeShare(verifiers=1, learners=1), NodeShare(rollouts=3), NodeShare(rollouts=1, verifiers=1)]
    p = place_nodes("cpu", shares, [Host(8), Host(2), Host(4)], learner_threads=4)
    assert p.rollouts == [Slot("cpu", 1, [0], 1), Slot("cpu", 1, [1], 1), Slot("cpu", 1, [0], 1),
                          Slot("cpu", 1, [0], 2)]  # fmt: skip
    assert p.drafters == [Slot("cpu", 1, [0, 1], 1), Slot("cpu", 1, [0], 2)]  # one per node with rollouts
    assert p.drafter_of == [0, 0, 0, 1]  # each rollout lends its core to its own node's drafter
    assert p.learners == [Slot("cpu", 4, [], 0)] and p.verifier_nodes == [0, 2]
    gpu = place_nodes("cuda", [NodeShare(learners=1), NodeShare(rollouts=2)], [Host(16, 1), Host(16, 2)], 1)
    assert [(s.device, s.node) for s in gpu.rollouts] == [("cuda:0", 1), ("cuda:1", 1)]
    assert gpu.drafter_of == [0, 1] and [(s.device, s.node) for s in gpu.learners] == [("cuda:0", 0)]


H100 = 80 * 2**30


def test_every_role_on_one_gpu_gets_a_share_that_fits_the_card() -> None:
    """One GPU (a simulated 80 GiB card): two rollouts, their two drafters and the learner each get a memory
    share; the shares and every process's CUDA context fit the card; the share travels in the env."""
    p = place("cuda", rollouts=2, learners=1, learner_threads=1, cores=16, gpus=1, gpu_bytes=H100)
    slots = p.rollouts + p.drafters + p.learners
    assert [s.device for s in slots] == ["cuda:0"] * 5 and all(s.memory_fraction > 0 for s in slots)
    held = sum(s.memory_fraction for s in slots) * H100 + 5 * CUDA_CONTEXT_BYTES
    assert held <= H100
    rollout, drafter, learner = (
        p.rollouts[0].memory_fraction,
        p.drafters[0].memory_fraction,
        p.learners[0].memory_fraction,
    )
    assert (
        rollout > learner / 2 and learner > drafter
    )  # the default weights: KV caches and the learner hold most
    assert p.learners[0].env() == {GPU_MEMORY_ENV: f"cuda:0={learner:.4f}"}
    explicit = place(
        "cuda", rollouts=2, learners=1, learner_threads=1, cores=16, gpus=1, gpu_bytes=H100,
        shares=GpuShares(learner=0.5),
    )  # fmt: skip
    assert explicit.learners[0].memory_fraction == 0.5
    assert explicit.rollouts[0].memory_fraction < rollout  # the others split what the learner leaves


def test_a_plan_that_does_not_fit_the_card_names_the_actors_and_bytes() -> None:
    with pytest.raises(ValueError) as error:
        place(
            "cuda", rollouts=2, learners=1, learner_threads=1, cores=16, gpus=1, gpu_bytes=H100,
            shares=GpuShares(rollout=0.4, learner=0.3),
        )  # fmt: skip
    message = str(error.value)
    assert "cuda:0 (80.0 GiB)" in message and "2 rollouts × 32.0 GiB" in message
    assert "1 learner × 24.0 GiB" in message and "5 CUDA contexts" in message
    with pytest.raises(ValueError, match=r"placement.gpu_memory.rollout: 1.5 is not a fraction"):
        place(
            "cuda",
            rollouts=1,
            learners=1,
            learner_threads=1,
            gpus=1,
            gpu_bytes=H100,
            shares=GpuShares(rollout=1.5),
        )


def test_several_gpus_keep_their_placement_and_share_only_where_actors_meet() -> None:
    p = place("cuda", rollouts=6, learners=2, learner_threads=2, cores=16, gpus=8, gpu_bytes=H100)
    assert [s.device for s in p.rollouts] == [f"cuda:{i}" for i in range(6)]
    assert all(s.memory_fraction > 0 for s in p.rollouts + p.drafters)  # a rollout and its drafter
    assert [s.memory_fraction for s in p.learners] == [0.0, 0.0]  # alone on cuda:6 and cuda:7: no cap
    nodes = place_nodes(
        "cuda", [NodeShare(learners=1), NodeShare(rollouts=2)], [Host(16, 1, H100), Host(16, 2, H100)], 1
    )
    assert [s.memory_fraction for s in nodes.learners] == [0.0]
    assert all(s.memory_fraction > 0 and s.node == 1 for s in nodes.rollouts)


def test_an_actor_applies_its_share_before_it_allocates(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    assert apply_gpu_memory({}) is None and calls == []
    assert apply_gpu_memory({GPU_MEMORY_ENV: "cuda:0=0.2500"}) == ("cuda:0", 0.25)
    assert calls == [(0.25, torch.device("cuda:0"))]
    for bad in ("cuda:0", "cuda:0=1.5", "cpu=0.5", "cuda:0=x"):
        with pytest.raises(ValueError, match=GPU_MEMORY_ENV):
            apply_gpu_memory({GPU_MEMORY_ENV: bad})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        apply_gpu_memory({GPU_MEMORY_ENV: "cuda:0=0.25"})


@pytest.mark.timeout(60)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_an_actor_whose_share_cannot_be_applied_fails_at_start_naming_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import uvloop

    from slipstream.cli import smoke
    from slipstream.runtime.supervisor import ActorSpec, Supervisor, SupervisorError

    async def main() -> None:
        sup = Supervisor(tmp_path, heartbeat_s=0.25)
        spec = ActorSpec.of(smoke.Sink, env=Slot("cuda:0", memory_fraction=0.25).env())
        try:
            with pytest.raises(SupervisorError, match=r"gpu memory share: .*no CUDA device"):
                await sup.start([spec])
        finally:
            await sup.shutdown(reason="test over", grace_s=2.0)

    uvloop.run(main())


class OutOfMemory(Actor):
    """Runs out of device memory in its compute loop, as a rollout whose batch outgrew its share does."""

    role = "oom"

    def step(self) -> bool:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.timeout(60)
def test_an_actor_out_of_device_memory_dies_with_its_own_exit_code(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Out of memory is told apart from a bug (EXIT_OUT_OF_MEMORY), so its owner can restart it smaller."""
    import asyncio
    import os
    from pathlib import Path

    import uvloop

    from slipstream.runtime.host import EXIT_OUT_OF_MEMORY
    from slipstream.runtime.supervisor import ActorSpec, Supervisor

    root = str(Path(__file__).resolve().parents[2])
    env = {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}

    async def main() -> None:
        sup = Supervisor(tmp_path, heartbeat_s=0.25)
        try:
            await sup.start([ActorSpec.of(OutOfMemory, env=env)])
            died = await asyncio.wait_for(sup.deaths.get(), timeout=20)
            assert died.name == "oom:0" and died.exit_code == EXIT_OUT_OF_MEMORY == 12
            assert "OutOfMemoryError: CUDA out of memory" in died.reason
        finally:
            await sup.shutdown(reason="test over", grace_s=2.0)

    uvloop.run(main())
