"""The run's plan: how a `TrainConfig` (rl/run_config.py) maps onto actors — what each node runs, where
each actor goes, the actors' names, which drafter trains on which idle rollout device, and every actor's
`ActorSpec`. rl/run.py starts the run from these; `bench e2e`, `bench scale` and the tests read them too.

The non-obvious choice: placement itself lives in runtime/placement.py (cores or GPUs per role); this module
only turns a config and a placement into names and specs, so the loop reads top to bottom without them.

    specs = actor_specs(load_config("deploy/configs/demo.yaml"), run_dir, baseline=False, resume_from="")
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import torch

from slipstream.actors.drafter import DrafterActor
from slipstream.actors.environment import EnvironmentActor
from slipstream.actors.learner import LearnerActor
from slipstream.actors.rollout import RolloutActor
from slipstream.actors.verifier import VerifierActor
from slipstream.engine.config import ModelConfig
from slipstream.engine.memory_plan import MemoryPlan, plan_learner
from slipstream.engine.tuner_config import TunerConfig
from slipstream.rl.run_config import (
    TrainConfig,
    default_reward,
    episode_tokens,
    learner_precision,
    rollout_dtype,
)
from slipstream.runtime.config import ConfigError
from slipstream.runtime.placement import (
    GpuShares,
    Host,
    NodeShare,
    Placement,
    default_shares,
    environment_nodes,
    place,
    place_nodes,
)
from slipstream.runtime.spec import ActorSpec
from slipstream.runtime.transport import actor_name

__all__ = ["actor_names", "actor_specs", "environment_names", "lease_plan", "node_shares", "placement"]


def node_shares(cfg: TrainConfig, nnodes: int) -> list[NodeShare]:
    """What each of `nnodes` nodes runs: `nodes` as configured (checked against the run's counts, naming the
    field), or the default spread."""
    if not cfg.nodes:
        return default_shares(
            nnodes, rollouts=cfg.rollout.devices, verifiers=cfg.verifier.actors, learners=cfg.learner.ranks
        )
    if len(cfg.nodes) != nnodes:
        raise ConfigError(f"nodes: {len(cfg.nodes)} entries for a run on {nnodes} node(s)")
    for what, want, field in (
        ("rollouts", cfg.rollout.devices, "rollout.devices"),
        ("verifiers", cfg.verifier.actors, "verifier.actors"),
        ("learners", cfg.learner.ranks, "learner.ranks"),
    ):
        if (got := sum(getattr(n, what) for n in cfg.nodes)) != want:
            raise ConfigError(f"nodes: {got} {what} over the nodes, but {field} is {want}")
    if cfg.nodes[0].learners < 1:
        raise ConfigError("nodes: node 0 must run learner rank 0 (the ranks meet at the head)")
    return [NodeShare(rollouts=n.rollouts, verifiers=n.verifiers, learners=n.learners) for n in cfg.nodes]


def placement(cfg: TrainConfig, hosts: list[Host] | None = None) -> Placement:
    """Where the run's rollouts, drafters, verifiers and learner ranks go (runtime/placement.py): on this
    host, or (`hosts`: what each node has, node 0 first) across the nodes of a multi-node run."""
    if hosts is None:
        return place(
            cfg.device,
            rollouts=cfg.rollout.devices,
            learners=cfg.learner.ranks,
            learner_threads=cfg.learner.threads,
            shares=gpu_shares(cfg),
        )
    return place_nodes(cfg.device, node_shares(cfg, len(hosts)), hosts, cfg.learner.threads, gpu_shares(cfg))


def gpu_shares(cfg: TrainConfig) -> GpuShares:
    memory = cfg.placement.gpu_memory
    return GpuShares(rollout=memory.rollout, drafter=memory.drafter, learner=memory.learner)


def actor_names(
    cfg: TrainConfig, *, baseline: bool, hosts: list[Host] | None = None
) -> tuple[list[str], list[str], list[str], list[str]]:
    """Rollout, drafter (none for --baseline or a disabled drafter), verifier and learner actor names."""
    on = cfg.drafter.enabled and not baseline
    drafters = range(len(placement(cfg, hosts).drafters)) if on else range(0)
    return (
        [actor_name(RolloutActor.role, r) for r in range(cfg.rollout.devices)],
        [actor_name(DrafterActor.role, r) for r in drafters],
        [actor_name(VerifierActor.role, r) for r in range(cfg.verifier.actors)],
        [actor_name(LearnerActor.role, r) for r in range(cfg.learner.ranks)],
    )


def environment_names(cfg: TrainConfig) -> list[str]:
    """The environment actors' names (none for a single-turn run)."""
    return [
        actor_name(EnvironmentActor.role, e)
        for e in range(cfg.environment.actors if cfg.environment.env else 0)
    ]


def lease_plan(
    cfg: TrainConfig, *, baseline: bool, hosts: list[Host] | None = None
) -> tuple[dict[str, str], dict[str, list[int]]]:
    """Which drafter each rollout's idle device is lent to, and the cores a lease of it grants."""
    where = placement(cfg, hosts)
    rollouts, drafters = actor_names(cfg, baseline=baseline, hosts=hosts)[:2]
    if not drafters:
        return {}, {}
    drafter_of = {rollout: drafters[where.drafter_of[r]] for r, rollout in enumerate(rollouts)}
    return drafter_of, {rollout: where.rollouts[r].cpus for r, rollout in enumerate(rollouts)}


def actor_specs(
    cfg: TrainConfig,
    run_dir: Path,
    *,
    baseline: bool,
    resume_from: str,
    hosts: list[Host] | None = None,
    rendezvous: str = "",
) -> list[ActorSpec]:
    """Every process of the run, placed by runtime/placement.py (`lease_plan`: which drafter trains on which
    idle rollout device); `hosts` and `rendezvous` (the learner ranks' tcp:// meeting point at the head) for
    a run across nodes."""
    where = placement(cfg, hosts)
    rollouts, drafters = actor_names(cfg, baseline=baseline, hosts=hosts)[:2]
    return [
        *_rollout_specs(cfg, where, drafters, baseline=baseline),
        *_drafter_specs(cfg, where, rollouts, drafters),
        *_verifier_specs(cfg, where),
        *_environment_specs(cfg, where, rollouts),
        *_learner_specs(cfg, where, resume_from=resume_from, rendezvous=rendezvous),
    ]


def _rollout_specs(
    cfg: TrainConfig, where: Placement, drafters: list[str], *, baseline: bool
) -> list[ActorSpec]:
    """A rollout per rollout slot: speculation off for --baseline, its hidden states to the drafters."""
    devices = cfg.rollout.devices
    tuner = TunerConfig(buckets=cfg.rollout.tuner.buckets, arms=["off"]) if baseline else cfg.rollout.tuner
    # Prompts of reasoning tasks are short; a longer one is refused, named.
    max_len = 1024 + episode_tokens(cfg)
    environments = environment_names(cfg)
    dtype = rollout_dtype(cfg)
    return [
        ActorSpec.of(
            RolloutActor,
            rank=r,
            config=RolloutActor.Config(
                model=cfg.model,
                device=slot.device,
                dtype=dtype,
                max_batch=cfg.rollout.max_batch or -(-cfg.prompts_per_step // devices) * cfg.group_size,
                max_len=max_len,
                spec_mode=cfg.rollout.spec_mode,
                tuner=msgspec.structs.replace(tuner, seed=cfg.seed + r),
                drafter=cfg.drafter.init_from if drafters else "",
                hidden_to=drafters,
                verify_applied_weights=cfg.rollout.verify_weights,
                environments=environments,
                episodes=cfg.environment.limits(),
                history=cfg.rollout.history,
            ),
            threads=slot.threads,
            hang_s=cfg.faults.hang_s,
            cpus=slot.cpus,
            node=slot.node,
            env=slot.env(),
        )
        for r, slot in enumerate(where.rollouts)
    ]


def _drafter_specs(
    cfg: TrainConfig, where: Placement, rollouts: list[str], drafters: list[str]
) -> list[ActorSpec]:
    """A drafter per drafter slot, publishing its head to every rollout (none when `drafters` is empty)."""
    if not drafters:
        return []
    return [
        ActorSpec.of(
            DrafterActor,
            rank=r,
            config=DrafterActor.Config(
                model=cfg.model,
                device=slot.device,
                batch_tokens=cfg.drafter.batch_tokens,
                lr=cfg.drafter.lr,
                warmup_steps=cfg.drafter.warmup_steps,
                unroll_steps=cfg.drafter.unroll_steps,
                publish_to=rollouts,
                publish_every_steps=cfg.drafter.publish_every_steps,
                world_size=len(drafters),
                init_from=cfg.drafter.init_from,
                seed=cfg.seed,
                verify_applied_head=cfg.rollout.verify_weights,
            ),
            threads=slot.threads,
            hang_s=cfg.faults.hang_s,
            cpus=slot.cpus,
            node=slot.node,
            env=slot.env(),
        )
        for r, slot in enumerate(where.drafters)
    ]


def _verifier_specs(cfg: TrainConfig, where: Placement) -> list[ActorSpec]:
    """The verifier actors, each scoring with the run's reward, on the nodes placement gave them."""
    return [
        ActorSpec.of(
            VerifierActor,
            rank=r,
            config=VerifierActor.Config(
                reward=default_reward(cfg),
                workers=cfg.verifier.workers,
                timeout_s=cfg.verifier.timeout_s,
                batch_size=cfg.verifier.batch_size,
                batch_wait_s=cfg.verifier.batch_wait_s,
                batch_timeout_s=cfg.verifier.batch_timeout_s,
                data_source=cfg.task,
            ),
            hang_s=cfg.faults.hang_s,
            node=where.verifier_nodes[r] if where.verifier_nodes else 0,
        )
        for r in range(cfg.verifier.actors)
    ]


def _environment_specs(cfg: TrainConfig, where: Placement, rollouts: list[str]) -> list[ActorSpec]:
    """The environment actors of a multi-turn run: rollout r talks to actor r % environments, on its node."""
    environments = environment_names(cfg)
    rollout_nodes = [slot.node for slot in where.rollouts]
    return [
        ActorSpec.of(
            EnvironmentActor,
            rank=e,
            config=EnvironmentActor.Config(
                env=cfg.environment.env,
                options=cfg.environment.options,
                turn_timeout_s=cfg.environment.turn_timeout_s,
                notify=[r for i, r in enumerate(rollouts) if i % len(environments) == e],
            ),
            hang_s=cfg.faults.hang_s,
            node=node,
        )
        for e, node in enumerate(environment_nodes(len(environments), rollout_nodes))
    ]


def _learner_specs(
    cfg: TrainConfig, where: Placement, *, resume_from: str, rendezvous: str
) -> list[ActorSpec]:
    """A learner rank per learner slot, pushing weights in the rollouts' dtype."""
    return [
        ActorSpec.of(
            LearnerActor,
            rank=r,
            config=LearnerActor.Config(
                model=cfg.model,
                device=slot.device,
                push_dtype=rollout_dtype(cfg),
                optim=cfg.learner.optim,
                loss=cfg.learner.loss,
                world_size=cfg.learner.ranks,
                resume_from=resume_from,
                seed=cfg.seed,
                rendezvous=rendezvous,
                push_deltas=cfg.learner.push_deltas,
                delta_threads=cfg.learner.delta_threads,
                precision=learner_precision(cfg),
                push_ipc=cfg.learner.push_ipc,
                activation_checkpointing=cfg.learner.activation_checkpointing,
            ),
            threads=slot.threads,
            hang_s=cfg.faults.hang_s,
            node=slot.node,
            env=slot.env(),
        )
        for r, slot in enumerate(where.learners)
    ]


def learner_memory_plan(cfg: TrainConfig, model_dir: str | Path) -> MemoryPlan:
    """The learner's per-rank memory plan for `cfg` (engine/memory_plan.py), from the model's config alone."""
    optim = cfg.learner.optim
    return plan_learner(
        ModelConfig.from_pretrained(model_dir),
        ranks=cfg.learner.ranks,
        micro_batch_tokens=optim.micro_batch_tokens,
        logprob_chunk_tokens=optim.logprob_chunk_tokens,
        activation_checkpointing=cfg.learner.activation_checkpointing,
        compute_dtype="bfloat16" if learner_precision(cfg) == "bf16" else "float32",
        reference=cfg.learner.loss.kl_coef > 0,
        device=cfg.device,
    )


def learner_capacity(cfg: TrainConfig, hosts: list[Host] | None = None) -> int | None:
    """Bytes one learner rank may use: its GPU's memory (its `placement.gpu_memory` share where actors
    share the card), or on a CPU the host's memory over the ranks it runs; None where unknown (no card
    here to ask: the rank's own allocation fails first)."""
    learners = placement(cfg, hosts).learners
    slot = learners[0]
    if slot.device.startswith("cuda"):
        if not torch.cuda.is_available():
            return None
        index = torch.device(slot.device).index or 0
        card = int(torch.cuda.get_device_properties(index).total_memory)
        return int(card * slot.memory_fraction) if slot.memory_fraction else card
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    here = sum(1 for s in learners if s.node == slot.node)
    return ram // max(here, 1)
