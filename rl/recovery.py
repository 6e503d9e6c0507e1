"""Recovery: what the RL plane does when an actor dies, role by role, in one place.

A death reaches the coordinator as a message (the supervisor's `ActorDied`); whoever waits on that actor
calls here. With `restart`, the actor is restarted through the supervisor (its budget and backoff) and
handed what it lost; without, the wait raises `ActorDiedError` naming it.

- rollout: restarted, handed the current policy (a fresh process holds the step-0 weights), then dealt
  again the samples it owed: same seeds, so the same tokens in reproducible mode. One that ran out of
  device memory restarts with half its batch cap (`out_of_memory` event).
- verifier: restarted and sent again the score requests it held (a reward is never lost or counted twice).
- environment: restarted; at start it tells its rollouts `EnvironmentUp`, and they replay the episodes it
  held from their start with the same seeds (each sample still completes once: the rollouts own them).
- drafter: restarted from its own checkpoint, its leases void, handed the policy's head (drafters change
  speed, never samples: the step goes on meanwhile).
- learner: every rank restarted (one lost rank breaks the process group) from the newest checkpoint, then
  the steps after it trained again from their samples records, without new rollouts (`replay_learner`);
  the samples of a step it held but had not recorded died with it, and the step is rolled out again.
  A learner that dies while a restarted rollout waits for its weights is recovered first, then pushes.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import TYPE_CHECKING

import msgspec

from slipstream.protocols import samples_record
from slipstream.protocols.learner import PushWeights, TrainStep

if TYPE_CHECKING:
    from pathlib import Path

    from slipstream.rl.coordinator import Coordinator
    from slipstream.rl.run_config import TrainConfig
    from slipstream.rl.step import RolloutStep
    from slipstream.runtime.supervisor import ActorSpec

__all__ = ["ActorDiedError", "replay_learner", "restart_learners"]


class ActorDiedError(RuntimeError):
    """An actor the coordinator was waiting on died; the message names it and why."""


async def restart(coord: Coordinator, name: str, what: str) -> None:
    """Restarts dead actor `name` through the supervisor (its budget), or raises ActorDiedError."""
    reason = coord.dead[name]
    if not coord.restart:
        raise ActorDiedError(f"{name} died while the coordinator waited for {what}: {reason}")
    coord.emit("restarting", actor=name, reason=reason, level="warning")
    config = _smaller_batch(coord, name, reason)
    # Out of `dead` before the restart, not after: a death of the new process during the restart's awaits
    # is recorded there, and must stay (a soak killed a rank 84 ms after its restart and lost the news).
    del coord.dead[name]
    try:
        await coord.sup.restart(name, config=config)
    except Exception as exc:  # the budget is spent, or the restart failed: final, not another death
        raise RuntimeError(f"{name} died ({reason}) and was not restarted: {exc}") from exc
    coord.restarted.append(name)


def _smaller_batch(coord: Coordinator, name: str, reason: str) -> msgspec.Struct | None:
    """A rollout that ran out of device memory restarts with half its batch cap (its KV cache and decode
    buffers grow with the batch); None for any other death (the same config). RuntimeError at a cap of 1."""
    if not reason.startswith("OutOfMemoryError") or not name.startswith("rollout"):
        return None
    config = coord.sup.config(name)
    cap = config["max_batch"] if isinstance(config, dict) else config.max_batch
    if cap <= 1:
        raise RuntimeError(f"{name} ran out of device memory at a batch cap of 1: {reason}")
    if isinstance(config, dict):
        smaller = {**config, "max_batch": cap // 2}
    else:
        smaller = msgspec.structs.replace(config, max_batch=cap // 2)
    coord.emit("out_of_memory", actor=name, max_batch=cap // 2, was=cap, level="warning")
    return smaller


async def revive_rollout(coord: Coordinator, name: str, what: str, version: int) -> None:
    """Restarts dead rollout `name` and hands it weights `version` (none for 0, what it loads); again if
    it dies meanwhile (the supervisor's budget bounds the tries). A learner that dies meanwhile is
    recovered first (its checkpoint, then a replay) when `version` is the policy the run holds; a version
    being synced cannot be rebuilt so (the caller retrains it)."""
    while True:
        try:
            if name in coord.dead:
                await restart(coord, name, what)
            if version > 0:
                await coord.push_weights(version, to=[name])
            return
        except ActorDiedError:
            if not coord.restart:
                raise
            if any(n in coord.dead for n in coord.learners):
                if coord.recover_learners is None or version != coord.policy_version:
                    raise
                await coord.recover_learners()
            elif name not in coord.dead:
                raise


async def recover_rollout(coord: Coordinator, name: str, step: RolloutStep) -> None:
    """Restarts dead rollout `name` mid-step, gives it the current weights, and deals it what it owed."""
    await revive_rollout(coord, name, "a completion", coord.policy_version)
    coord.leases.busy(name)
    owed: dict[int, list[int]] = defaultdict(list)
    for group, sample in step.ledger.held_by(name):
        owed[group].append(sample)
    for group, samples in sorted(owed.items()):
        step.ledger.deal(name, [(group, i) for i in samples], requeue=True)
        request = msgspec.structs.replace(step.requests[group], sample_indices=samples)
        await coord.sup.send(name, request)
    coord.emit("requeued", actor=name, samples=sum(len(v) for v in owed.values()), groups=len(owed))
    if not owed:  # it had finished its share before it died: idle, and it will not say so itself
        coord.on_idle(name, time.monotonic())


async def recover_verifier(coord: Coordinator, name: str) -> int:
    """Restarts dead verifier `name` and sends it again the score requests it held; returns how many."""
    await restart(coord, name, "a reward")
    owed = coord.scores.held_by(name)
    coord.scores.deal(name, owed, requeue=True)
    for key in owed:
        await coord.sup.send(name, coord.score_requests[key])
    coord.emit("requeued", actor=name, scores=len(owed))
    return len(owed)


async def recover_environment(coord: Coordinator, name: str) -> None:
    """Restarts dead environment actor `name`; its rollouts replay what it held (actors/rollout.py)."""
    await restart(coord, name, "episodes' answers")
    coord.emit("environment_restarted", actor=name)


async def recover_drafter(coord: Coordinator, drafter: str) -> None:
    """Restarts dead drafter `drafter` (from its checkpoint): its leases are void, and it gets the head of
    the policy the rollouts hold (a learner that dies meanwhile pushes it again after its recovery)."""
    await restart(coord, drafter, "leases released")
    coord.leases.void(drafter)
    coord.drafter_steps.pop(drafter, None)  # it counts again from its checkpoint's steps
    version = coord.policy_version
    if version > 0 and coord.learners:  # the restarted process loaded the step-0 head
        for learner in coord.learners:  # sharded ranks gather with rank 0
            await coord.sup.send(learner, PushWeights(version=version, to=[], head_to=[drafter]))
        await coord.heads_applied(version, [drafter])


async def restart_learners(coord: Coordinator, configs: dict[str, msgspec.Struct]) -> None:
    """Restarts every learner rank with `configs` (e.g. the newest checkpoint to resume from). Ranks still
    alive are killed first: one lost rank breaks the process group, and the ranks rendezvous together."""
    learners = coord.learners
    if not coord.restart:
        dead = [n for n in learners if n in coord.dead]
        raise ActorDiedError(f"{dead[0]} died: {coord.dead[dead[0]]}" if dead else "no learner died")
    for name in learners:
        if name not in coord.dead:
            coord.sup.kill(name)
    await coord.wait_until(lambda: all(n in coord.dead for n in learners), [], "learner ranks to stop", 30.0)
    reasons = {n: coord.dead.pop(n) for n in learners}  # before the restarts: see `restart`
    coord.emit("restarting_learners", reasons=reasons, level="warning")
    try:
        await asyncio.gather(*(coord.sup.restart(n, config=configs[n]) for n in learners))
    except Exception as exc:  # final: not an ActorDiedError, which a caller would answer with a restart
        raise RuntimeError(f"learner ranks died ({reasons}) and were not restarted: {exc}") from exc
    coord.forget_stats()  # stats of the step in flight died with the ranks
    coord.restarted.extend(learners)


async def replay_learner(
    coord: Coordinator, cfg: TrainConfig, run_dir: Path, specs: list[ActorSpec], version: int
) -> None:
    """Restarts the learner ranks from the newest checkpoint and trains again, without new rollouts, every
    step between it and policy `version` from its samples record (tokens, behaviour log-probs, rewards):
    the learner then holds what the rollouts hold. Again if it dies meanwhile (within its budget)."""
    from slipstream.actors.learner import RENDEZVOUS_FILE, LearnerActor
    from slipstream.rl import run_dir as run_dir_files
    from slipstream.rl.run_config import sampling_of
    from slipstream.runtime.host import actor_path
    from slipstream.runtime.transport import actor_name

    while True:
        try:
            state = (
                run_dir_files.read_state(run_dir)
                if (run_dir / "checkpoints" / "state.json").is_file()
                else {}
            )
            done, checkpoint = int(state.get("step", 0)), str(state.get("checkpoint", ""))
            path = str(run_dir / checkpoint) if checkpoint else ""  # "": none yet, the run's start policy
            (run_dir / RENDEZVOUS_FILE).unlink(missing_ok=True)
            learner = actor_path(LearnerActor)
            names = {actor_name(LearnerActor.role, s.rank): s for s in specs if s.actor == learner}
            configs = {n: msgspec.structs.replace(s.config, resume_from=path) for n, s in names.items()}
            await restart_learners(coord, configs)
            for replayed in range(done, version):  # each rank reads its share of the step's record
                asks = {
                    name: TrainStep(
                        step=replayed,
                        version=replayed + 1,
                        replay=True,
                        **sampling_of(cfg),
                        samples_path=str(samples_record.share_path(run_dir, replayed, rank)),
                    )
                    for rank, name in enumerate(coord.learners)
                }
                await coord.train(replayed, asks)
            return
        except ActorDiedError:
            if not any(n in coord.dead for n in coord.learners):
                raise
