"""One training run's verbs: what rl/loop.py calls, step by step, to read top to bottom.

`Run` holds what lives as long as the run: the config, the data stream, the supervisor and its actors,
the coordinator, the metrics files and sinks. `open` starts them; per step `batch` takes the prompts,
then `roll_out_and_score`, `learn`, `push`, `checkpoint` and `record`, each marking its own time (its span
and its field of the step's record); `close` stops everything in order; `summary` writes the run's.

Non-obvious choices:
- What belongs to one step lives in its `StepWork` (rl/step_work.py: prompts, receipts, rewards, the
  groups' plans, stats, marks), never in the run's fields: a step can be trained again, or rolled out
  again as its next try (`lost`), after a learner death without anything of the previous try leaking in.
- No sample's tensors pass here: the rollouts send them to the learner ranks, which hold, record and train
  on them; the loop keeps their receipts (lengths, texts to score, finish reasons) and the rewards.
- The policy version has one owner, the coordinator (`policy_version`, moved only when every rollout
  acknowledged a push). The learner's version counts steps: step s trains version s + 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, TextIO

import msgspec
import torch

from slipstream.actors.learner import RENDEZVOUS_FILE
from slipstream.engine import hub
from slipstream.engine.sampling import group_seed
from slipstream.engine.tokenizer import Tokenizer
from slipstream.protocols import samples_record
from slipstream.protocols.learner import GroupPlan, TrainStep
from slipstream.protocols.reward import ScoreRequest
from slipstream.protocols.rollout import GenerateRequest, SamplingSpec
from slipstream.rl import recovery
from slipstream.rl import run_dir as run_dir_files
from slipstream.rl.coordinator import Coordinator
from slipstream.rl.run_config import TrainConfig, data_stream, episode_tokens, sampling_of
from slipstream.rl.run_plan import (
    actor_names,
    actor_specs,
    environment_names,
    learner_capacity,
    learner_memory_plan,
    lease_plan,
)
from slipstream.rl.step import Arrival, rollout_step
from slipstream.rl.step_work import StepWork, explain_reward_errors, step_line, step_record
from slipstream.runtime.agent import AgentLauncher
from slipstream.runtime.cluster import RENDEZVOUS, Cluster, run_keys
from slipstream.runtime.placement import Host
from slipstream.runtime.sinks import open_sinks
from slipstream.runtime.spans import SpanRecorder, span_path
from slipstream.runtime.supervisor import ActorSpec, Supervisor
from slipstream.runtime.turns import Turns
from slipstream.tasks.datasets import Row, chat_prompt_ids

__all__ = ["Run", "checkpoint_due"]


class Run:
    """See the module docstring. `open`, then the verbs, then `close` (in a `finally`)."""

    # The supervisor's liveness: its heartbeat interval, and the beats an actor may miss before it is taken
    # as dead (an actor takes a head silent for 10 intervals as gone). `bench scale` raises both: at the
    # step sizes it streams, this loop stalls for seconds and every actor would be taken as dead.
    heartbeat_s: float = 1.0
    missed_beats: int = 3

    def __init__(
        self,
        cfg: TrainConfig,
        run_dir: Path,
        *,
        baseline: bool,
        resume: bool,
        log: Any = None,
        step_lines: TextIO | None = None,
        turns: Turns | None = None,
    ) -> None:
        self.cfg, self.run_dir, self.baseline, self.log = cfg, run_dir, baseline, log
        self.step_lines, self.turns = step_lines, turns
        run_dir.mkdir(parents=True, exist_ok=True)
        # The learner ranks' rendezvous file: one a crashed run left behind would hand a resumed run stale
        # addresses and counts.
        (run_dir / RENDEZVOUS_FILE).unlink(missing_ok=True)
        self.tokenizer = Tokenizer.from_dir(hub.resolve(cfg.model))
        # What a learner rank will hold (engine/memory_plan.py): printed first, checked before any actor
        # starts (`open`), kept in summary.json.
        self.memory_plan = learner_memory_plan(cfg, hub.resolve(cfg.model))
        state = run_dir_files.read_state(run_dir) if resume else {"step": 0, "checkpoint": ""}
        if state["checkpoint"]:
            state["checkpoint"] = str(run_dir / state["checkpoint"])  # relative (an absolute one stays)
        self.state = state
        self.start = int(state["step"])
        self.stream = data_stream(cfg, state, log)
        self.sampling = SamplingSpec(
            temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_tokens=episode_tokens(cfg),
            stop_token_ids=sorted(self.tokenizer.stop_ids),
        )  # fmt: skip
        self.spans = SpanRecorder(
            span_path(run_dir, "coordinator") if cfg.trace else None, actor="coordinator", role="coordinator"
        )
        # A resumed run keeps the steps before its checkpoint and drops those after it (they are done
        # again): metrics.jsonl and the summary then hold every step once.
        self.records = (
            run_dir_files.read_records(run_dir / "metrics.jsonl", before=self.start) if resume else []
        )
        run_dir_files.write_records(run_dir / "metrics.jsonl", self.records)
        self.sinks = open_sinks(
            cfg.metrics, run_dir, resume_step=self.start, run_config=msgspec.to_builtins(cfg)
        )
        self.metrics_file = (run_dir / "metrics.jsonl").open("a")
        self.last_checkpoint, self.invalid_steps = time.monotonic(), 0
        self.agents: AgentLauncher | None = None
        self.sup: Supervisor | None = None
        self._exit = contextlib.AsyncExitStack()

    # -- start and stop ---------------------------------------------------------------------------------

    async def open(self, cluster: Cluster, *, keys_dir: Path | None, join_timeout_s: float) -> None:
        """Starts every actor (on every node of a multi-node `cluster`: this is node 0, the head, and it
        waits `join_timeout_s` for the others' agents) and the coordinator. A resumed run's learner then
        hands its weights to the fresh rollouts and drafters."""
        cfg, run_dir = self.cfg, self.run_dir
        hosts, key_file = await self._join(cluster, keys_dir, join_timeout_s)
        self.check_memory(hosts)
        self.specs = self.plan_actors(
            hosts, cluster.head_endpoint(RENDEZVOUS) if cluster.multi and cfg.learner.ranks > 1 else ""
        )
        self.rollouts, self.drafters, verifiers, learners = actor_names(
            cfg, baseline=self.baseline, hosts=hosts
        )
        drafter_of, lease_cpus = lease_plan(cfg, baseline=self.baseline, hosts=hosts)
        self.sup = Supervisor(
            run_dir, max_restarts=cfg.faults.max_restarts, restart_backoff_s=cfg.faults.restart_backoff_s,
            log=self.log, trace=cfg.trace, cluster=cluster, curve_key=key_file, remote=self.agents,
            heartbeat_s=self.heartbeat_s, missed_beats=self.missed_beats,
        )  # fmt: skip
        await self.take_turn()
        await self.sup.start(self.specs)
        self.end_turn()
        self.coord = await self._exit.enter_async_context(
            Coordinator(
                self.sup, rollouts=self.rollouts, drafters=drafter_of, lease_cpus=lease_cpus,
                verifiers=verifiers, learners=learners, environments=environment_names(cfg),
                restart=True,  # a dead rollout, verifier or drafter is restarted and dealt its work again
                policy_version=self.start, homes=self.state.get("homes"), recover_learners=self.recover_learners,
                spans=self.spans, log=self.log,
            )
        )  # fmt: skip
        if self.start > 0:  # the resumed learner hands its weights to the fresh rollouts first
            await self.coord.push_weights(self.start, to=self.rollouts, head_to=self.drafters)
            await self.coord.heads_applied(self.start, self.drafters)

    def check_memory(self, hosts: list[Host] | None) -> None:
        """Says the learner's memory plan (log, and the step lines' first line) and raises PlanDoesNotFit,
        naming the field to change, where it exceeds what a rank's device has: before any actor starts.
        `bench scale` overrides it: its learners hold no model."""
        plan = self.memory_plan
        if self.log is not None:
            self.log.info("memory_plan", **plan.as_dict())
        if self.step_lines is not None:
            print(plan.line(), file=self.step_lines, flush=True)
        capacity = learner_capacity(self.cfg, hosts)
        if capacity is not None:
            plan.check(capacity)

    def plan_actors(self, hosts: list[Host] | None, rendezvous: str) -> list[ActorSpec]:
        """Every process of the run (rl/run_plan.py `actor_specs`). `bench scale` overrides it: stand-in
        rollouts and a learner that only holds its groups, in the run's places and under its names."""
        return actor_specs(
            self.cfg, self.run_dir, baseline=self.baseline, resume_from=str(self.state["checkpoint"]),
            hosts=hosts, rendezvous=rendezvous,
        )  # fmt: skip

    async def _join(
        self, cluster: Cluster, keys_dir: Path | None, join_timeout_s: float
    ) -> tuple[list[Host] | None, Path | None]:
        """On several nodes: the run's key, the other nodes' agents, and every node's cores and GPUs."""
        if not cluster.multi:
            return None, None
        keys, key_file = None, None
        if self.cfg.transport.security == "curve":
            keys, key_file = run_keys(self.run_dir, keys_dir=keys_dir, create=keys_dir is None)
        self.agents = AgentLauncher(
            cluster, curve=keys, log=self.log, lost_after_s=self.cfg.faults.node_lost_s
        )
        try:
            joined = await self.agents.wait_for_agents(join_timeout_s)
        except BaseException:
            await self.agents.close("the head gave up waiting")
            self.agents = None
            raise
        hosts = [Host(len(os.sched_getaffinity(0)), gpu_count(self.cfg.device))]
        hosts += [Host(joined[n].cores, joined[n].gpus) for n in range(1, cluster.nnodes)]
        return hosts, key_file

    async def close(self) -> None:
        """Stops the coordinator, the actors (in a turn of their own: stopping computes too), the agents,
        the sinks."""
        try:
            await self._exit.aclose()
        finally:
            self.metrics_file.close()
            try:
                if self.sup is not None:
                    await self.take_turn()  # stopping the actors computes too (their checkpoints, logs)
                    await self.sup.shutdown(reason="training finished")
            finally:
                if self.turns is not None:
                    self.turns.done()  # the other run waits for this one no more, whatever happened here
            if self.agents is not None:  # after their actors are down: the agents stop and exit
                await self.agents.close("training finished")
            self.sinks.close()  # after the actors are down: a failing sink cannot keep them running
            self.spans.close()

    def summary(self) -> dict[str, Any]:
        """The run's summary (its config, every step's record), also written to run_dir/summary.json."""
        summary = run_dir_files.summary(
            msgspec.to_builtins(self.cfg), self.records, self.run_dir, baseline=self.baseline
        )
        summary["memory_plan"] = self.memory_plan.as_dict()
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    async def take_turn(self) -> None:
        """Before start-up, each step and the shutdown (`turns`: bench e2e interleaves two runs)."""
        if self.turns is not None:
            await self.turns.acquire()

    def end_turn(self) -> None:
        if self.turns is not None:
            self.turns.release()

    # -- the step's verbs ---------------------------------------------------------------------------------

    def batch(self, step: int) -> StepWork:
        """Step `step`'s prompts: the next rows of the data stream, as chat prompts."""
        cfg = self.cfg
        chunk = range(step * cfg.prompts_per_step, (step + 1) * cfg.prompts_per_step)
        rows = dict(zip(chunk, self.stream.take(cfg.prompts_per_step), strict=True))
        system = cfg.system_prompt or None
        prompts = {g: chat_prompt_ids(self.tokenizer, row.question, system=system) for g, row in rows.items()}
        return StepWork(step, rows, prompts, self.stream.state(), len(self.coord.restarted))

    async def roll_out_and_score(self, work: StepWork, advance: Any) -> None:
        """Deals the prompts to the rollouts (each group's samples go to the learner rank that trains it)
        and sends each receipt's text to a verifier the moment it arrives (rewards overlap the tail) while
        idle rollout devices are leased to drafter training; then the rewards' tail and the step's plan for
        the learners. `advance`: the progress bar, a sample at a time."""
        last_completion = [work.started]

        async def score(receipt: Arrival) -> None:
            last_completion[0] = time.monotonic()
            if not self._env_scored(work, receipt):
                await self.coord.score(self._score_request(work, receipt))
            advance()

        work.completions, work.metrics = await rollout_step(self.coord, self._requests(work), score)
        self._mark(work, "rollout", work.started, work.metrics.rollout_s)
        tail = last_completion[0]  # the reward tail: from the last completion to the last reward
        while len(work.rewards) < len(work.completions):
            reward = await self.coord.reward()
            work.rewards[(reward.group_id, reward.sample_index)] = reward.reward
            if reward.error is not None:
                work.reward_errors[reward.error] = work.reward_errors.get(reward.error, 0) + 1
        self._mark(work, "reward", tail)
        work.groups = self._plans(work)
        if checkpoint_due(self.cfg, work.step, time.monotonic() - self.last_checkpoint):
            work.checkpoint = f"checkpoints/step-{work.step + 1}/{run_dir_files.CHECKPOINT_FILE}"

    async def learn(self, work: StepWork) -> None:
        """One GRPO step on the learner ranks: policy version `work.version`. Each rank first writes its
        share of the samples record; a step recorded so already (its learner died after) is replayed from
        it."""
        began = time.monotonic()
        recorded = self.recorded(work.step)
        asks = {}
        for rank, name in enumerate(self.coord.learners):
            share = [plan for plan in work.groups if self._learner_of(plan.group_id, work) == name]
            path = str(samples_record.share_path(self.run_dir, work.step, rank))
            asks[name] = TrainStep(
                step=work.step, version=work.version, groups=[] if recorded else share,
                samples_path=path, replay=recorded, **sampling_of(self.cfg),
            )  # fmt: skip
        work.stats = await self.coord.train(work.step, asks)
        self._mark(work, "learn", began)

    def recorded(self, step: int) -> bool:
        """Whether every learner rank's share of step `step`'s samples record is on disk."""
        shares = [samples_record.share_path(self.run_dir, step, r) for r in range(len(self.coord.learners))]
        return all(path.is_file() for path in shares)

    async def lost(self, work: StepWork) -> StepWork:
        """After a learner's recovery: the step as it stands, if its samples record is on disk; else its
        samples died with the learner, and the step starts again (its rewards still owed first: the same
        samples are scored again when they come back)."""
        if work.completions and self.recorded(work.step):
            return work
        await self.coord.settle_scores()
        return StepWork(
            work.step,
            work.rows,
            work.prompts,
            work.data_cursor,
            work.restarts_before,
            attempt=work.attempt + 1,
        )

    async def push(self, work: StepWork) -> None:
        """The line where weights are pushed: the learner sends `work.version` to every rollout (deltas
        across hosts) and its head parts to the drafters; returns when all of them applied it. The heads
        too: copied during the next rollout, they took its cores' time."""
        began = time.monotonic()
        coord, version = self.coord, work.version
        await coord.push_weights(version, to=self.rollouts, head_to=self.drafters, deltas=True)
        await coord.weights_applied(version, heads=self.drafters)
        self._mark(work, "sync", began, version=version)

    async def checkpoint(self, work: StepWork) -> None:
        """When due: the policy and its optimizer (the learner), the drafter (its owner), after the sync."""
        if work.checkpoint:
            began = time.monotonic()
            path = str(self.run_dir / work.checkpoint)
            await self.coord.save_checkpoint(work.step + 1, path, drafters=self.drafters[:1])
            self._mark(work, "checkpoint", began)

    def record(self, work: StepWork) -> None:
        """The step's record to metrics.jsonl, the sinks, the log and the step line; when it checkpointed,
        the run's state. Raises after
        `faults.max_invalid_steps` steps in a row where every reward failed."""
        cfg, run_dir = self.cfg, self.run_dir
        restarts = self.coord.restarted[work.restarts_before :]
        multi_turn = bool(cfg.environment.env)
        record = step_record(work, moved=self._pushed(work.version), restarts=restarts, multi_turn=multi_turn)
        self.spans.add("step", _ns(work.started), _ns(time.monotonic() - work.started), work.step)
        if work.checkpoint:
            # Relative to the run directory: a run moved or resumed from elsewhere still finds it.
            state = {"step": work.step + 1, "checkpoint": work.checkpoint, "data": work.data_cursor,
                     "homes": dict(self.coord.homes)}  # fmt: skip
            run_dir_files.write_state(run_dir, state)
            run_dir_files.prune_checkpoints(run_dir, cfg.keep_checkpoints)
            self.last_checkpoint = time.monotonic()
        self.records.append(record)
        self.metrics_file.write(msgspec.json.encode(record).decode() + "\n")
        self.metrics_file.flush()
        self.sinks.write(record.step, msgspec.to_builtins(record))
        if self.log is not None:
            self.log.info("step", **msgspec.structs.asdict(record))
        if self.step_lines is not None:
            print(step_line(record, cfg.steps), file=self.step_lines, flush=True)
        all_invalid = record.invalid == cfg.prompts_per_step * cfg.group_size
        self.invalid_steps = self.invalid_steps + 1 if all_invalid else 0
        if self.invalid_steps >= cfg.faults.max_invalid_steps:
            raise RuntimeError(
                f"{self.invalid_steps} steps in a row where every reward failed (faults.max_invalid_steps): "
                f"{explain_reward_errors(record.reward_errors)}"
            )

    async def recover_learners(self, cause: BaseException | None = None) -> None:
        """A learner died: its ranks restart from the newest checkpoint and train again the steps after it
        from their samples files (rl/recovery.py), up to the steps recorded when the loop caught `cause`
        (the step in flight then trains again; `cause` is re-raised when no learner died), else up to the
        version the rollouts hold (the coordinator's call, to re-push it to a restarted rollout: after a
        step's sync that is the step in flight's, whose samples are on disk before it trains)."""
        if cause is not None and not any(n in self.coord.dead for n in self.coord.learners):
            raise cause
        version = self.steps_recorded if cause is not None else self.coord.policy_version
        await recovery.replay_learner(self.coord, self.cfg, self.run_dir, self.specs, version)

    @property
    def steps_recorded(self) -> int:
        """Steps whose samples are on disk (the resumed ones and this run's): what a replay trains up to."""
        return self.start + sum(r.step >= self.start for r in self.records)

    # -- the parts of a step ---------------------------------------------------------------------------

    def _pushed(self, version: int) -> dict[str, int]:
        """What the push of `version` sent across hosts, taken from the coordinator's count (with any older
        version's: a head push reported after its step)."""
        moved = self.coord.pushed.pop(version, {})
        for late in [v for v in self.coord.pushed if v < version]:
            del self.coord.pushed[late]
        return moved

    def _mark(
        self, work: StepWork, phase: str, began: float, seconds: float | None = None, **fields: Any
    ) -> None:
        """A phase's timing mark: its seconds in the step's record and its span in the trace."""
        seconds = time.monotonic() - began if seconds is None else seconds
        work.marks[phase] = seconds
        self.spans.add(phase, _ns(began), _ns(seconds), work.step, **fields)

    def _requests(self, work: StepWork) -> list[GenerateRequest]:
        cfg = self.cfg
        return [
            GenerateRequest(
                group_id=g,
                prompt_ids=torch.tensor(work.prompts[g], dtype=torch.int64),
                num_samples=cfg.group_size,
                seed=group_seed(cfg.seed, g),
                sampling=self.sampling,
                policy_version=work.step,
                # An episode: the environment opens it from the row (the prompt above is not used then).
                row_json=_row_json(work.rows[g]) if cfg.environment.env else "",
                learn_at=self._learner_of(g, work),
                attempt=work.attempt,
            )
            for g in work.rows
        ]

    def _learner_of(self, group_id: int, work: StepWork) -> str:
        """The learner rank that trains group `group_id` (and holds its samples): the step's groups in turn."""
        learners = self.coord.learners
        return learners[(group_id - work.step * self.cfg.prompts_per_step) % len(learners)]

    def _env_scored(self, work: StepWork, completion: Arrival) -> bool:
        """An episode's reward where it needs no verifier: the environment's own, or None for an invalid
        episode (its error recorded: masked, never a silent 0). False: the verifier scores the transcript."""
        if not self.cfg.environment.env:
            return False
        key = (completion.group_id, completion.sample_index)
        if completion.finish_reason == "error":
            why = f"episode: {completion.error or 'the rollout could not serve it'}"
            work.reward_errors[why] = work.reward_errors.get(why, 0) + 1
            work.rewards[key] = None
            return True
        if completion.env_reward is not None:
            work.rewards[key] = completion.env_reward
            return True
        return False

    def _score_request(self, work: StepWork, receipt: Arrival) -> ScoreRequest:
        row = work.rows[receipt.group_id]
        return ScoreRequest(
            group_id=receipt.group_id,
            sample_index=receipt.sample_index,
            prompt=row.question,
            completion=receipt.text,  # decoded by the rollout
            row_json=_row_json(row),
            policy_version=receipt.policy_version,
        )

    def _plans(self, work: StepWork) -> list[GroupPlan]:
        """Each group's prompt and rewards for its learner rank. A request the rollout could not serve came
        back as an "error" sample: invalid. So is an episode whose opening differs from its group's first
        (an environment whose opening is not a function of the row): the learner reads one prompt a group."""
        cfg, plans = self.cfg, []
        for g in work.rows:
            done = [work.completions[(g, i)] for i in range(cfg.group_size)]
            openings = [(i, c.opening) for i, c in enumerate(done) if c.opening]
            differs = {i for i, digest in openings if digest != openings[0][1]}
            if differs:
                why = "episode: its opening differs from its group's (the learner reads one prompt a group)"
                work.reward_errors[why] = work.reward_errors.get(why, 0) + len(differs)
            rewards = [
                None if c.finish_reason == "error" or i in differs else work.rewards[(g, i)]
                for i, c in enumerate(done)
            ]
            prompt = torch.empty(0, dtype=torch.int64) if openings else torch.tensor(work.prompts[g])
            plans.append(GroupPlan(group_id=g, prompt_ids=prompt, rewards=rewards))
        return plans


def _row_json(row: Row) -> str:
    """A dataset row as a reward scores with it and an environment opens an episode from it (values JSON
    cannot hold, as text)."""
    return json.dumps({"question": row.question, "answer": row.answer, "metadata": row.metadata}, default=str)


def gpu_count(device: str) -> int:
    return torch.cuda.device_count() if device == "cuda" and torch.cuda.is_available() else 0


def _ns(seconds: float) -> int:
    """time.monotonic() seconds as the nanoseconds spans are kept in (the same clock)."""
    return int(seconds * 1e9)


def checkpoint_due(cfg: TrainConfig, step: int, since_last_s: float) -> bool:
    """After step `step` (0-based): every `checkpoint_every` steps, at least every `checkpoint_minutes`,
    and after the last step."""
    by_steps = cfg.checkpoint_every > 0 and (step + 1) % cfg.checkpoint_every == 0
    by_time = cfg.checkpoint_minutes > 0 and since_last_s >= cfg.checkpoint_minutes * 60
    return by_steps or by_time or step + 1 == cfg.steps
