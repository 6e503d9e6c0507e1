"""Placement: which device, cores and threads each actor of a run gets. Decided here, never in an actor.

A *device* is what one rollout actor owns: a GPU on a CUDA host, a core on a CPU host. A drafter trains
on a rollout's device only while that rollout is idle (the coordinator's lease); `drafter_of[r]` says
which drafter rollout r's device is lent to. On a CUDA host each rollout has a drafter on its GPU. On a
CPU host one drafter serves every core: its process may run on all the rollouts' cores and pins its
threads to the cores it is leased (each lease carries them), so the host holds one drafter's weights,
optimizer and buffer instead of one per core (~0.6 GB each for SmolLM2, docs/training.md), and the
drafter is one copy, never averaged. Learner ranks get GPUs of their own when the host has enough
(rollouts + ranks ≤ GPUs), else they share the rollouts' GPUs from the first (synchronous RL: the
rollouts are idle while the learner trains). On a CPU host rollout r is pinned to core r mod cores with
one thread, and the learner takes `learner_threads` unpinned threads.

    place("cuda", rollouts=6, learners=2, learner_threads=2, cores=16, gpus=8)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

__all__ = ["Placement", "Slot", "place"]


@dataclass(frozen=True)
class Slot:
    """Where one actor runs."""

    device: str
    """"cpu" or "cuda:N": what the actor's `device` setting receives."""
    threads: int = 1
    """torch/OpenMP threads in the actor's process."""
    cpus: list[int] = field(default_factory=list)
    """Cores to pin the process to (empty: no pinning)."""


@dataclass(frozen=True)
class Placement:
    rollouts: list[Slot]
    drafters: list[Slot]
    learners: list[Slot]
    drafter_of: list[int] = field(default_factory=list)
    """drafter_of[r]: the index in `drafters` of the drafter rollout r's device is lent to."""


def place(
    kind: str,
    *,
    rollouts: int,
    learners: int,
    learner_threads: int,
    cores: int | None = None,
    gpus: int | None = None,
) -> Placement:
    """Slots for `rollouts` rollout actors (and their drafters) and `learners` learner ranks on a host of
    `cores` cores and `gpus` GPUs (default: this host's); `kind` is the run's device setting."""
    cores = (os.cpu_count() or 1) if cores is None else cores
    if gpus is None:
        gpus = torch.cuda.device_count() if kind == "cuda" else 0
    if rollouts < 1 or learners < 1:
        raise ValueError(
            f"placement needs at least one rollout and one learner, got {rollouts} and {learners}"
        )
    if kind == "cpu":
        cores = max(1, cores)
        pinned = [Slot("cpu", threads=1, cpus=[r % cores]) for r in range(rollouts)]
        every = sorted({cpu for slot in pinned for cpu in slot.cpus})
        return Placement(
            rollouts=pinned,
            drafters=[Slot("cpu", threads=1, cpus=every)],  # one for the host; leases narrow its cores
            learners=[Slot("cpu", threads=learner_threads) for _ in range(learners)],
            drafter_of=[0] * rollouts,
        )
    if kind != "cuda":
        raise ValueError(f"device: {kind!r} is not a device kind (cpu or cuda)")
    if gpus < 1:
        raise ValueError("device: 'cuda' needs at least one GPU, this host has none")
    # GPU actors do their work on the GPU: one host thread each keeps 16-core hosts from oversubscription.
    gpu = [Slot(f"cuda:{r % gpus}", threads=1) for r in range(rollouts)]
    first = rollouts if rollouts + learners <= gpus else 0
    return Placement(
        rollouts=gpu,
        drafters=list(gpu),
        drafter_of=list(range(rollouts)),
        learners=[Slot(f"cuda:{(first + i) % gpus}", threads=learner_threads) for i in range(learners)],
    )
