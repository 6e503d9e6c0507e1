"""Placement: which device, cores and threads each actor of a run gets. Decided here, never in an actor.

A *device* is what one rollout actor owns: a GPU on a CUDA host, a core on a CPU host. A drafter trains
on a rollout's device only while that rollout is idle (the coordinator's lease); `drafter_of[r]` names
the drafter rollout r's device is lent to. On a CUDA host each rollout has a drafter on its GPU; on a CPU
host one drafter serves every core, pinning its threads to the cores it is leased, so the host holds one
drafter's weights, optimizer and buffer (docs/training.md), never copies to average. Learner ranks get
GPUs of their own when the host has enough, else share the rollouts' from the first (synchronous RL). On
a CPU host rollout r is pinned to core r mod cores, one thread; the learner takes `learner_threads`. A run
across nodes is placed node by node (`place_nodes`): each node's `NodeShare` (default: rollouts and
verifiers spread evenly, every learner rank on node 0) goes through `place` with its cores and GPUs.

    place("cuda", rollouts=6, learners=2, learner_threads=2, cores=16, gpus=8)
    place_nodes("cpu", default_shares(2, rollouts=4, verifiers=2, learners=1), [Host(2, 0)] * 2, 2)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

__all__ = ["Host", "NodeShare", "Placement", "Slot", "default_shares", "place", "place_nodes"]


@dataclass(frozen=True)
class Slot:
    """Where one actor runs."""

    device: str
    """"cpu" or "cuda:N": what the actor's `device` setting receives."""
    threads: int = 1
    """torch/OpenMP threads in the actor's process."""
    cpus: list[int] = field(default_factory=list)
    """Cores to pin the process to (empty: no pinning)."""
    node: int = 0
    """The node of the run it runs on."""


@dataclass(frozen=True)
class Placement:
    rollouts: list[Slot]
    drafters: list[Slot]
    learners: list[Slot]
    drafter_of: list[int] = field(default_factory=list)
    """drafter_of[r]: the index in `drafters` of the drafter rollout r's device is lent to."""
    verifier_nodes: list[int] = field(default_factory=list)
    """verifier_nodes[v]: the node of verifier v (empty: every verifier on node 0)."""


@dataclass(frozen=True)
class Host:
    """What one node has, as its agent reported it."""

    cores: int
    gpus: int = 0


@dataclass(frozen=True)
class NodeShare:
    """What one node of a run runs."""

    rollouts: int = 0
    verifiers: int = 0
    learners: int = 0


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
    if rollouts < 0 or learners < 0:
        raise ValueError(f"placement: negative counts ({rollouts} rollouts, {learners} learners)")
    if kind == "cpu":
        cores = max(1, cores)
        pinned = [Slot("cpu", threads=1, cpus=[r % cores]) for r in range(rollouts)]
        every = sorted({cpu for slot in pinned for cpu in slot.cpus})
        return Placement(
            rollouts=pinned,
            # One for the host (none without rollouts); leases narrow its cores.
            drafters=[Slot("cpu", threads=1, cpus=every)] if rollouts else [],
            learners=[Slot("cpu", threads=learner_threads) for _ in range(learners)],
            drafter_of=[0] * rollouts,
        )
    if kind != "cuda":
        raise ValueError(f"device: {kind!r} is not a device kind (cpu or cuda)")
    if gpus < 1 and rollouts + learners > 0:
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


def default_shares(nnodes: int, *, rollouts: int, verifiers: int, learners: int) -> list[NodeShare]:
    """Rollouts and verifiers spread evenly over the nodes (the first ones take the remainder), every learner
    rank on node 0 (the ranks meet at the head)."""

    def spread(n: int) -> list[int]:
        return [n // nnodes + (i < n % nnodes) for i in range(nnodes)]

    return [
        NodeShare(rollouts=r, verifiers=v, learners=learners if i == 0 else 0)
        for i, (r, v) in enumerate(zip(spread(rollouts), spread(verifiers), strict=True))
    ]


def place_nodes(kind: str, shares: list[NodeShare], hosts: list[Host], learner_threads: int) -> Placement:
    """Slots for a run across `len(hosts)` nodes, node i running `shares[i]` on `hosts[i]`'s cores and GPUs."""
    if len(shares) != len(hosts):
        raise ValueError(f"nodes: {len(shares)} node shares for a run on {len(hosts)} nodes")
    rollouts: list[Slot] = []
    drafters: list[Slot] = []
    learners: list[Slot] = []
    drafter_of: list[int] = []
    verifier_nodes: list[int] = []
    for node, (share, host) in enumerate(zip(shares, hosts, strict=True)):
        p = place(
            kind, rollouts=share.rollouts, learners=share.learners, learner_threads=learner_threads,
            cores=host.cores, gpus=host.gpus,
        )  # fmt: skip
        drafter_of += [len(drafters) + d for d in p.drafter_of]
        rollouts += [_on(s, node) for s in p.rollouts]
        drafters += [_on(s, node) for s in p.drafters]
        learners += [_on(s, node) for s in p.learners]
        verifier_nodes += [node] * share.verifiers
    return Placement(rollouts, drafters, learners, drafter_of, verifier_nodes)


def _on(slot: Slot, node: int) -> Slot:
    return Slot(slot.device, slot.threads, list(slot.cpus), node)
