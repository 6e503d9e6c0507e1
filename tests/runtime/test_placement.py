"""Placement: which device, cores and threads each actor gets (runtime/placement.py)."""

from __future__ import annotations

import pytest

from slipstream.runtime.placement import Host, NodeShare, Slot, default_shares, place, place_nodes


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
