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
Environment actors (multi-turn episodes) go to the node of the first rollout they serve, unpinned.
Actors sharing one GPU each get a share of its memory (`GpuShares`, set by the actor's host process from
`SLIPSTREAM_GPU_MEMORY`), and a plan that does not fit the card fails here, naming the actors and bytes.

    place("cuda", rollouts=6, learners=2, learner_threads=2, cores=16, gpus=8)
    place_nodes("cpu", default_shares(2, rollouts=4, verifiers=2, learners=1), [Host(2, 0)] * 2, 2)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "GPU_MEMORY_ENV",
    "GpuShares",
    "Host",
    "NodeShare",
    "Placement",
    "Slot",
    "apply_gpu_memory",
    "default_shares",
    "environment_nodes",
    "place",
    "place_nodes",
]

GPU_MEMORY_ENV = "SLIPSTREAM_GPU_MEMORY"
"""An actor's share of its GPU, "cuda:N=FRACTION", set in its environment by the run (`Slot.env`)."""
CUDA_CONTEXT_BYTES = 768 * 2**20
"""What one process's CUDA context holds outside its allocator's share (driver state, kernels, cuBLAS
workspaces): counted against the card for every process that shares it."""


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
    memory_fraction: float = 0.0
    """Share of its GPU's memory the actor's allocator may hold (0: no cap; set where actors share a GPU)."""

    def env(self) -> dict[str, str]:
        """What the actor's process needs in its environment for this slot (its GPU memory share)."""
        if not self.memory_fraction:
            return {}
        return {GPU_MEMORY_ENV: f"{self.device}={self.memory_fraction:.4f}"}


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
class GpuShares:
    """Fractions of a shared GPU's memory, per actor of each role (None: an even split of what the others
    leave, by the weights of `DEFAULT_WEIGHTS`). Applied only where several actors share one GPU."""

    rollout: float | None = None
    drafter: float | None = None
    learner: float | None = None

    DEFAULT_WEIGHTS = {"rollout": 0.5, "drafter": 0.1, "learner": 0.4}
    """How a card is split among roles left unset (the rollouts' KV caches and the learner's activations and
    optimizer state are the large holders; a drafter holds a small head and its buffer)."""

    def resolve(self, counts: dict[str, int], free: float) -> dict[str, float]:
        """Per-actor fractions for `counts` actors of each role on one GPU, with `free` of the card left
        after the CUDA contexts. ValueError where a set fraction is not in (0, 1)."""
        fixed = {role: getattr(self, role) for role in counts if getattr(self, role) is not None}
        for role, value in fixed.items():
            if not 0 < value < 1:
                raise ValueError(f"placement.gpu_memory.{role}: {value} is not a fraction in (0, 1)")
        left = free - sum(value * counts[role] for role, value in fixed.items())
        unset = [role for role in counts if role not in fixed and counts[role]]
        weight = sum(self.DEFAULT_WEIGHTS[role] for role in unset)
        shares = dict(fixed)
        for role in unset:
            shares[role] = max(left, 0.0) * self.DEFAULT_WEIGHTS[role] / weight / counts[role]
        return shares


@dataclass(frozen=True)
class Host:
    """What one node has, as its agent reported it."""

    cores: int
    gpus: int = 0
    gpu_bytes: int = 0
    """Memory of each of its GPUs (0: unknown; the head's own card is asked where it has one)."""


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
    gpu_bytes: int | None = None,
    shares: GpuShares | None = None,
) -> Placement:
    """Slots for `rollouts` rollout actors (and their drafters) and `learners` learner ranks on a host of
    `cores` cores and `gpus` GPUs (default: this host's); `kind` is the run's device setting. Where actors
    share a GPU of `gpu_bytes` (default: the card's), each gets its `shares` (default `GpuShares()`) of it."""
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
    plan = Placement(
        rollouts=gpu,
        drafters=list(gpu),
        drafter_of=list(range(rollouts)),
        learners=[Slot(f"cuda:{(first + i) % gpus}", threads=learner_threads) for i in range(learners)],
    )
    return _share_gpus(plan, gpu_bytes, shares or GpuShares())


def _share_gpus(plan: Placement, gpu_bytes: int | None, shares: GpuShares) -> Placement:
    """`plan` with a memory share on every slot of a GPU that several actors use; ValueError naming the
    actors and bytes where one GPU's shares and contexts exceed the card."""
    roles = {"rollout": plan.rollouts, "drafter": plan.drafters, "learner": plan.learners}
    by_device: dict[str, dict[str, int]] = {}
    for role, slots in roles.items():
        for slot in slots:
            counts = by_device.setdefault(slot.device, dict.fromkeys(roles, 0))
            counts[role] += 1
    fractions: dict[str, dict[str, float]] = {}
    for device, counts in by_device.items():
        processes = sum(counts.values())
        if processes < 2:
            continue
        total = gpu_bytes if gpu_bytes else _card_bytes(device)
        if total is None:
            continue  # no card here to size (a simulated plan): the actor's own device check fails first
        contexts = processes * CUDA_CONTEXT_BYTES
        per = shares.resolve(counts, 1.0 - contexts / total)
        held = contexts + sum(per[role] * n * total for role, n in counts.items() if n)
        if held > total or any(per[role] <= 0 for role, n in counts.items() if n):
            parts = [
                f"{n} {role}{'s' if n > 1 else ''} × {_gib(per[role] * total)}"
                for role, n in counts.items()
                if n
            ]
            raise ValueError(
                f"placement: {device} ({_gib(total)}) cannot hold {' + '.join(parts)} + {processes} CUDA "
                f"contexts × {_gib(CUDA_CONTEXT_BYTES)} = {_gib(held)}: lower placement.gpu_memory's shares "
                "or run fewer actors on it"
            )
        fractions[device] = per

    def shared(role: str, slot: Slot) -> Slot:
        per = fractions.get(slot.device)
        if per is None:
            return slot
        fraction = math.floor(per[role] * 1e4) / 1e4  # rounded down: the rounded shares still fit the card
        return Slot(slot.device, slot.threads, list(slot.cpus), slot.node, fraction)

    return Placement(
        rollouts=[shared("rollout", s) for s in plan.rollouts],
        drafters=[shared("drafter", s) for s in plan.drafters],
        learners=[shared("learner", s) for s in plan.learners],
        drafter_of=plan.drafter_of,
        verifier_nodes=plan.verifier_nodes,
    )


def _card_bytes(device: str) -> int | None:
    index = torch.device(device).index or 0
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    return int(torch.cuda.get_device_properties(index).total_memory)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def apply_gpu_memory(environ: dict[str, str] | None = None) -> tuple[str, float] | None:
    """In an actor's process: cap its allocator at the share `GPU_MEMORY_ENV` names (`Slot.env`), before
    anything allocates. Returns (device, fraction), or None where no share is set. ValueError on a
    malformed value; RuntimeError where the named device is not there."""
    value = (os.environ if environ is None else environ).get(GPU_MEMORY_ENV)
    if not value:
        return None
    device, sep, fraction_text = value.rpartition("=")
    try:
        fraction = float(fraction_text)
    except ValueError:
        fraction = -1.0
    if not sep or not device.startswith("cuda") or not 0 < fraction <= 1:
        raise ValueError(f"{GPU_MEMORY_ENV}={value!r}: expected 'cuda:N=FRACTION' with 0 < FRACTION <= 1")
    if not torch.cuda.is_available():
        raise RuntimeError(f"{GPU_MEMORY_ENV}={value!r}: this process sees no CUDA device")
    torch.cuda.set_per_process_memory_fraction(fraction, torch.device(device))
    return device, fraction


def default_shares(nnodes: int, *, rollouts: int, verifiers: int, learners: int) -> list[NodeShare]:
    """Rollouts and verifiers spread evenly over the nodes (the first ones take the remainder), every learner
    rank on node 0 (the ranks meet at the head)."""

    def spread(n: int) -> list[int]:
        return [n // nnodes + (i < n % nnodes) for i in range(nnodes)]

    return [
        NodeShare(rollouts=r, verifiers=v, learners=learners if i == 0 else 0)
        for i, (r, v) in enumerate(zip(spread(rollouts), spread(verifiers), strict=True))
    ]


def place_nodes(
    kind: str,
    shares: list[NodeShare],
    hosts: list[Host],
    learner_threads: int,
    gpu_shares: GpuShares | None = None,
) -> Placement:
    """Slots for a run across `len(hosts)` nodes, node i running `shares[i]` on `hosts[i]`'s cores and GPUs
    (`gpu_shares`: as `place`'s `shares`)."""
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
            cores=host.cores, gpus=host.gpus, gpu_bytes=host.gpu_bytes or None, shares=gpu_shares,
        )  # fmt: skip
        drafter_of += [len(drafters) + d for d in p.drafter_of]
        rollouts += [_on(s, node) for s in p.rollouts]
        drafters += [_on(s, node) for s in p.drafters]
        learners += [_on(s, node) for s in p.learners]
        verifier_nodes += [node] * share.verifiers
    return Placement(rollouts, drafters, learners, drafter_of, verifier_nodes)


def environment_nodes(environments: int, rollout_nodes: list[int]) -> list[int]:
    """The node of each environment actor: that of the first rollout it serves (rollout r talks to actor
    r % environments), so a turn's round trip stays on one host; node 0 where it serves none. They are not
    pinned: an episode's work is Python between turns, not a device's (on a CPU host they share the cores
    as the verifiers do)."""
    return [rollout_nodes[e] if e < len(rollout_nodes) else 0 for e in range(environments)]


def _on(slot: Slot, node: int) -> Slot:
    return Slot(slot.device, slot.threads, list(slot.cpus), node, slot.memory_fraction)
