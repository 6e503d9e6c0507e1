"""Placement: which device, cores and threads each actor gets (runtime/placement.py)."""

from __future__ import annotations

import pytest

from slipstream.runtime.placement import Slot, place


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
    with pytest.raises(ValueError, match="at least one rollout"):
        place("cpu", rollouts=0, learners=1, learner_threads=1, cores=2)
