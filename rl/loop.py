"""The synchronous GRPO loop, top to bottom: what `slipstream train` runs (cli/train.py parses its arguments).

    summary = await train(load_config("deploy/configs/demo.yaml", ["steps=2"]), Path("runs/x"))

One step: deal the step's prompts to the rollout actors → stream each completion to a verifier the moment
it arrives (rewards overlap the tail), while idle rollout devices are leased to drafter training → preempt
when the last completion is in → build GRPO groups → one learner step → the learner pushes the weights and
every rollout acknowledges the new version. Each step's record goes to metrics.jsonl (and to the sinks
`metrics.sinks` names: runtime/sinks.py) and as one line to `step_lines` (stdout), the run's to
summary.json. A dead actor is restarted and its work dealt again (the coordinator); a dead learner
restarts from its newest checkpoint and replays the steps after it from their samples files (here).
Configuration: `TrainConfig` and the actors it makes, in rl/run_config.py.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, TextIO

import msgspec
import torch

from slipstream.actors.learner import RENDEZVOUS_FILE, LearnerActor
from slipstream.engine import hub
from slipstream.engine.device import require_device
from slipstream.engine.sampling import group_seed
from slipstream.engine.tokenizer import Tokenizer
from slipstream.protocols.learner import ScoredGroup
from slipstream.protocols.reward import ScoreRequest
from slipstream.protocols.rollout import Completion, GenerateRequest, SamplingSpec
from slipstream.rl import run_dir as run_dir_files
from slipstream.rl.coordinator import ActorDiedError, Coordinator
from slipstream.rl.run_config import (
    TrainConfig,
    actor_names,
    actor_specs,
    data_stream,
    lease_plan,
    require_transport,
    sampling_of,
)
from slipstream.rl.run_dir import StepRecord
from slipstream.rl.step import rollout_step
from slipstream.runtime.agent import AgentLauncher
from slipstream.runtime.cluster import RENDEZVOUS, Cluster, run_keys
from slipstream.runtime.host import actor_path
from slipstream.runtime.placement import Host
from slipstream.runtime.progress import ProgressFactory, silent
from slipstream.runtime.sinks import open_sinks, require_sinks
from slipstream.runtime.spans import SpanRecorder, span_path
from slipstream.runtime.supervisor import ActorSpec, Supervisor
from slipstream.runtime.transport import actor_name
from slipstream.runtime.turns import Turns
from slipstream.tasks.datasets import Row, chat_prompt_ids


async def train(
    cfg: TrainConfig,
    run_dir: Path,
    *,
    baseline: bool = False,
    resume: bool = False,
    progress: ProgressFactory = silent,
    log: Any = None,
    step_lines: TextIO | None = None,
    cluster: Cluster | None = None,
    keys_dir: Path | None = None,
    join_timeout_s: float = 300.0,
    turns: Turns | None = None,
) -> dict[str, Any]:
    """Runs the loop; returns the summary also written to run_dir/summary.json. `step_lines`: where each
    step's line is printed as it finishes (None: nowhere). With a multi-node `cluster` this is node 0, the
    head: it waits for the other nodes' agents (`join_timeout_s`), then places actors on every node.
    `turns`: start-up, each step, and the shutdown each wait for this run's turn (runtime/turns.py: bench
    e2e interleaves two runs step by step); the waits are in no step's time."""
    cluster = cluster or Cluster()
    require_device(cfg.device)  # refused before anything starts, naming the field
    require_sinks(cfg.metrics)  # so is a sink whose package is missing
    require_transport(cfg, cluster)  # and plaintext TCP across hosts that the config does not allow
    run_dir.mkdir(parents=True, exist_ok=True)
    # The learner ranks' rendezvous file: one a crashed run left behind would hand a resumed run stale
    # addresses and counts.
    (run_dir / RENDEZVOUS_FILE).unlink(missing_ok=True)
    model_dir = hub.resolve(cfg.model)
    tokenizer = Tokenizer.from_dir(model_dir)
    state = run_dir_files.read_state(run_dir) if resume else {"step": 0, "checkpoint": ""}
    if state["checkpoint"]:
        state["checkpoint"] = str(run_dir / state["checkpoint"])  # relative (an absolute one stays as it is)
    start = int(state["step"])
    stream = data_stream(cfg, state, log)
    system = cfg.system_prompt or None
    sampling = SamplingSpec(
        temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_tokens=cfg.max_tokens,
        stop_token_ids=sorted(tokenizer.stop_ids),
    )  # fmt: skip
    agents: AgentLauncher | None = None
    hosts: list[Host] | None = None
    key_file: Path | None = None
    if cluster.multi:
        if cfg.transport.security == "curve":
            keys, key_file = run_keys(run_dir, keys_dir=keys_dir, create=keys_dir is None)
        else:
            keys = None
        agents = AgentLauncher(cluster, curve=keys, log=log)
        try:
            joined = await agents.wait_for_agents(join_timeout_s)
        except BaseException:
            await agents.close("the head gave up waiting")
            raise
        hosts = [Host(len(os.sched_getaffinity(0)), gpu_count(cfg.device))]
        hosts += [Host(joined[n].cores, joined[n].gpus) for n in range(1, cluster.nnodes)]
    specs = actor_specs(
        cfg, run_dir, baseline=baseline, resume_from=str(state["checkpoint"]), hosts=hosts,
        rendezvous=cluster.head_endpoint(RENDEZVOUS) if cluster.multi and cfg.learner.ranks > 1 else "",
    )  # fmt: skip
    rollouts, drafters, verifiers, learners = actor_names(cfg, baseline=baseline, hosts=hosts)
    drafter_of, lease_cpus = lease_plan(cfg, baseline=baseline, hosts=hosts)
    sup = Supervisor(
        run_dir,
        max_restarts=cfg.faults.max_restarts,
        restart_backoff_s=cfg.faults.restart_backoff_s,
        log=log,
        trace=cfg.trace,
        cluster=cluster,
        curve_key=key_file,
        remote=agents,
    )
    spans = SpanRecorder(
        span_path(run_dir, "coordinator") if cfg.trace else None, actor="coordinator", role="coordinator"
    )
    # A resumed run keeps the steps before its checkpoint and drops those after it (they are done again):
    # metrics.jsonl and the summary then hold every step once.
    records = run_dir_files.read_records(run_dir / "metrics.jsonl", before=start) if resume else []
    run_dir_files.write_records(run_dir / "metrics.jsonl", records)
    sinks = open_sinks(cfg.metrics, run_dir, resume_step=start, run_config=msgspec.to_builtins(cfg))
    metrics_file = (run_dir / "metrics.jsonl").open("a")
    last_checkpoint, invalid_steps = time.monotonic(), 0

    async def take_turn() -> None:  # before start-up, each step and the shutdown (`turns`)
        if turns is not None:
            await turns.acquire()

    def end_turn() -> None:
        if turns is not None:
            turns.release()

    try:
        await take_turn()
        await sup.start(specs)
        end_turn()
        async with Coordinator(
            sup,
            rollouts=rollouts,
            drafters=drafter_of,
            lease_cpus=lease_cpus,
            verifiers=verifiers,
            learners=learners,
            restart=True,  # a dead rollout or verifier is restarted and dealt its work again
            log=log,
        ) as coord:
            coord.spans = spans
            version = start

            async def recover_learners() -> None:
                """The learner restarts from its newest checkpoint and replays the steps after it, up to the
                current one, from their recorded samples; again if it dies meanwhile (within its budget)."""
                while True:
                    try:
                        return await _recover_learner(coord, cfg, run_dir, specs, version)
                    except ActorDiedError:
                        if not any(n in coord.dead for n in learners):
                            raise

            coord.recover_learners = recover_learners
            if start > 0:  # the resumed learner hands its weights to the fresh rollouts first
                await coord.push_weights(start, to=rollouts, head_to=drafters)
                coord.policy_version = start
                await coord.heads_applied(start, drafters)
            for step in range(start, cfg.steps):
                await take_turn()
                chunk = range(step * cfg.prompts_per_step, (step + 1) * cfg.prompts_per_step)
                restarts_before = len(coord.restarted)
                # Group ids stay global (their sampling seeds too); the rows come from the stream.
                rows = dict(zip(chunk, stream.take(cfg.prompts_per_step), strict=True))
                data_cursor = stream.state()
                prompts = {
                    g: chat_prompt_ids(tokenizer, row.question, system=system) for g, row in rows.items()
                }
                with progress(f"step {step + 1}/{cfg.steps}", len(chunk) * cfg.group_size) as bar:
                    record, groups_out = await _step(
                        coord, cfg, step, version, chunk, rows, prompts, tokenizer, sampling, bar.advance
                    )
                    learned = time.monotonic()
                    checkpoint = ""
                    if _checkpoint_due(cfg, step, time.monotonic() - last_checkpoint):
                        # relative to the run directory
                        checkpoint = f"checkpoints/step-{step + 1}/{run_dir_files.CHECKPOINT_FILE}"
                    # The line where weights are pushed: the learner trains, then sends every rollout v + 1.
                    while True:
                        try:
                            stats = await coord.train(
                                step,
                                groups_out,
                                version=version + 1,
                                push_to=rollouts,
                                push_head_to=drafters,
                            )
                            learn_s = time.monotonic() - learned
                            # The drafters' heads too: copied during the next rollout, they took its
                            # cores' time (the learner pushes them first, so they overlap the rollouts').
                            await coord.weights_applied(version + 1, heads=drafters)
                            synced = time.monotonic()
                            if checkpoint:  # the policy, its optimizer and the drafter, after the sync
                                await coord.save_checkpoint(
                                    step + 1, str(run_dir / checkpoint), drafters=drafters[:1]
                                )
                            break
                        except ActorDiedError:
                            if not any(n in coord.dead for n in learners):
                                raise
                            await recover_learners()  # then this step trains again
                    version += 1
                    sync_s = synced - learned - learn_s
                    checkpoint_s = time.monotonic() - synced
                    lead = stats[0]
                    moved = coord.pushed.pop(version, {})  # what the push of this version sent across hosts
                    for late in [
                        v for v in coord.pushed if v < version
                    ]:  # a head push reported after its step
                        del coord.pushed[late]
                    finished = time.monotonic()
                    spans.add("learn", _ns(learned), _ns(learn_s), step)
                    spans.add("sync", _ns(learned + learn_s), _ns(sync_s), step, version=version)
                    if checkpoint:
                        spans.add("checkpoint", _ns(synced), _ns(checkpoint_s), step)
                    began = learned - record.step_s  # the record's step_s so far: rollout and rewards
                    spans.add("step", _ns(began), _ns(finished - began), step)
                    record = msgspec.structs.replace(
                        record,
                        learn_s=round(learn_s, 3),
                        sync_s=round(sync_s, 3),
                        step_s=round(record.step_s + learn_s + sync_s + checkpoint_s, 3),
                        checkpoint_s=round(checkpoint_s, 3),
                        loss=lead.loss,
                        grad_norm=lead.grad_norm,
                        mismatch_logp_abs_max=lead.metrics.get("mismatch_logp_abs_max", 0.0),
                        sync_bytes=int(lead.metrics.get("push_bytes", 0.0)),
                        wire_bytes=moved.get("wire_bytes", 0),
                        wire_full_bytes=moved.get("full_bytes", 0),
                        policy_version=version,
                        restarts=coord.restarted[restarts_before:],
                    )
                run_dir_files.write_samples(run_dir / "samples" / f"step-{step}.jsonl", groups_out, tokenizer)
                if checkpoint:
                    # Relative to the run directory: a run moved or resumed from elsewhere still finds it.
                    run_dir_files.write_state(
                        run_dir,
                        {
                            "step": step + 1,
                            "checkpoint": checkpoint,
                            "data": data_cursor,  # the rows after this step's: where a resume reads on
                        },
                    )
                    run_dir_files.prune_checkpoints(run_dir, cfg.keep_checkpoints)
                    last_checkpoint = time.monotonic()
                records.append(record)
                metrics_file.write(msgspec.json.encode(record).decode() + "\n")
                metrics_file.flush()
                sinks.write(record.step, msgspec.to_builtins(record))
                if log is not None:
                    log.info("step", **msgspec.structs.asdict(record))
                if step_lines is not None:
                    print(_step_line(record, cfg.steps), file=step_lines, flush=True)
                end_turn()
                all_invalid = record.invalid == cfg.prompts_per_step * cfg.group_size
                invalid_steps = invalid_steps + 1 if all_invalid else 0
                if invalid_steps >= cfg.faults.max_invalid_steps:
                    raise RuntimeError(
                        f"{invalid_steps} steps in a row where every reward failed (faults.max_invalid_steps): "
                        f"{_explain(record.reward_errors)}"
                    )
    finally:
        metrics_file.close()
        try:
            await take_turn()  # stopping the actors computes too (their checkpoints, logs)
            await sup.shutdown(reason="training finished")
        finally:
            if turns is not None:
                turns.done()  # the other run waits for this one no more, whatever happened here
        if agents is not None:  # after their actors are down: the agents stop and exit
            await agents.close("training finished")
        sinks.close()  # after the actors are down: a failing sink cannot keep them running
        spans.close()
    summary = run_dir_files.summary(msgspec.to_builtins(cfg), records, run_dir, baseline=baseline)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def gpu_count(device: str) -> int:
    return torch.cuda.device_count() if device == "cuda" and torch.cuda.is_available() else 0


async def _step(
    coord: Coordinator,
    cfg: TrainConfig,
    step: int,
    version: int,
    chunk: range,
    rows: dict[int, Row],
    prompts: dict[int, list[int]],
    tokenizer: Tokenizer,
    sampling: SamplingSpec,
    advance: Any,
) -> tuple[StepRecord, list[ScoredGroup]]:
    """Rollout with rewards streaming, then the groups; the record's learn/sync fields are filled later."""
    started = time.monotonic()
    requests = [
        GenerateRequest(
            group_id=g,
            prompt_ids=torch.tensor(prompts[g], dtype=torch.int64),
            num_samples=cfg.group_size,
            seed=group_seed(cfg.seed, g),
            sampling=sampling,
            policy_version=version,
        )
        for g in chunk
    ]

    last_completion = [started]

    async def score(completion: Completion) -> None:
        # Each completion goes to a verifier at once: rewards overlap the rollout's tail.
        last_completion[0] = time.monotonic()
        row = rows[completion.group_id]
        await coord.score(
            ScoreRequest(
                group_id=completion.group_id,
                sample_index=completion.sample_index,
                prompt=row.question,
                completion=tokenizer.decode(completion.token_ids.tolist(), skip_special_tokens=True),
                row_json=json.dumps(
                    {"question": row.question, "answer": row.answer, "metadata": row.metadata}
                ),
                policy_version=completion.policy_version,
            )
        )
        advance()

    completions, metrics = await rollout_step(coord, requests, score)
    coord.spans.add("rollout", _ns(started), _ns(metrics.rollout_s), step)
    rollout_end = last_completion[0]  # the reward tail: from the last completion to the last reward
    rewards: dict[tuple[int, int], float | None] = {}
    errors: dict[str, int] = {}
    while len(rewards) < len(completions):
        reward = await coord.reward()
        rewards[(reward.group_id, reward.sample_index)] = reward.reward
        if reward.error is not None:
            errors[reward.error] = errors.get(reward.error, 0) + 1
    reward_s = time.monotonic() - rollout_end
    coord.spans.add("reward", _ns(rollout_end), _ns(reward_s), step)  # the tail after the last completion
    groups = []
    for g in chunk:
        done = [completions[(g, i)] for i in range(cfg.group_size)]
        groups.append(
            ScoredGroup(
                step=step,
                group_id=g,
                prompt_ids=torch.tensor(prompts[g], dtype=torch.int64),
                # A request the rollout could not serve comes back as an "error" completion: invalid.
                response_ids=[c.token_ids for c in done],
                behaviour_logprobs=[c.logprobs for c in done],
                rewards=[None if c.finish_reason == "error" else rewards[(g, i)] for i, c in enumerate(done)],
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                policy_version=version,
            )
        )
    valid = [r for grp in groups for r in grp.rewards if r is not None]
    mixed = sum(len({r for r in grp.rewards if r is not None}) > 1 for grp in groups)
    tokens = sum(len(c.token_ids) for c in completions.values())
    record = StepRecord(
        step=step,
        reward_mean=round(sum(valid) / len(valid), 4) if valid else math.nan,
        correct_share=round(sum(r >= 1.0 for r in valid) / len(valid), 4) if valid else math.nan,
        nonzero_adv_share=round(mixed / len(groups), 4),
        invalid=sum(r is None for grp in groups for r in grp.rewards),
        tokens=tokens,
        mean_response_tokens=round(tokens / max(len(completions), 1), 1),
        step_s=round(time.monotonic() - started, 3),
        rollout_s=round(metrics.rollout_s, 3),
        reward_s=round(reward_s, 3),
        learn_s=0.0,
        sync_s=0.0,
        accept_length=round(metrics.accept_length, 3),
        spec_accept_length=round(metrics.spec_accept_length, 3),
        spec_token_share=round(metrics.spec_token_share, 4),
        arms=dict(metrics.arms),
        accept_by_batch=metrics.speculated_accept_length(),
        arms_by_batch={bucket: dict(arms) for bucket, arms in metrics.arms_by_batch.items()},
        decode_by_batch=metrics.decode_seconds_by_batch(),
        accept_by_position=metrics.accept_by_position(),
        drafter_loss=None if metrics.drafter_loss is None else round(metrics.drafter_loss, 5),
        idle_device_s=round(metrics.idle_device_s, 3),
        reclaimed_s=round(metrics.reclaimed_s, 3),
        loss=0.0,
        grad_norm=0.0,
        reward_errors=errors,
        requeued=metrics.requeued,
        duplicates=metrics.duplicates,
        mismatch_logp_abs_max=0.0,
        policy_version=version,
    )
    return record, groups


def _ns(seconds: float) -> int:
    """time.monotonic() seconds as the nanoseconds spans are kept in (the same clock)."""
    return int(seconds * 1e9)


async def _recover_learner(
    coord: Coordinator, cfg: TrainConfig, run_dir: Path, specs: list[ActorSpec], step: int
) -> None:
    """Restarts the learner ranks from the newest checkpoint and trains again, without new rollouts, every
    step between it and `step` from samples/step-N.jsonl (tokens, behaviour log-probs, rewards): the
    learner then holds what the rollouts hold."""
    state = run_dir_files.read_state(run_dir) if (run_dir / "checkpoints" / "state.json").is_file() else {}
    done, checkpoint = int(state.get("step", 0)), str(state.get("checkpoint", ""))
    path = str(run_dir / checkpoint) if checkpoint else ""  # "": none yet, the policy the run started from
    (run_dir / RENDEZVOUS_FILE).unlink(missing_ok=True)
    learner = actor_path(LearnerActor)
    names = {actor_name(LearnerActor.role, spec.rank): spec for spec in specs if spec.actor == learner}
    configs = {name: msgspec.structs.replace(spec.config, resume_from=path) for name, spec in names.items()}
    await coord.restart_learners(configs)
    for replayed in range(done, step):
        await coord.train(
            replayed, run_dir_files.recorded_groups(run_dir, replayed, sampling_of(cfg)), version=replayed + 1
        )


def _checkpoint_due(cfg: TrainConfig, step: int, since_last_s: float) -> bool:
    """After step `step` (0-based): every `checkpoint_every` steps, at least every `checkpoint_minutes`,
    and after the last step."""
    by_steps = cfg.checkpoint_every > 0 and (step + 1) % cfg.checkpoint_every == 0
    by_time = cfg.checkpoint_minutes > 0 and since_last_s >= cfg.checkpoint_minutes * 60
    return by_steps or by_time or step + 1 == cfg.steps


def _step_line(r: StepRecord, steps: int) -> str:
    """One finished step, compact: printed as it finishes, whether stdout is a terminal or not (the progress
    bars are transient and on stderr; a step's line comes after its bar is gone)."""
    split = f"rollout {r.rollout_s:.1f}, reward {r.reward_s:.1f}, learn {r.learn_s:.1f}, sync {r.sync_s:.1f}"
    split += f", ckpt {r.checkpoint_s:.1f}" if r.checkpoint_s else ""
    invalid = f"  {r.invalid} invalid" if r.invalid else ""
    return (
        f"step {r.step + 1}/{steps}  reward {r.reward_mean:.3f}  correct {r.correct_share:.3f}  {r.tokens} tok  "
        f"{r.step_s:.1f} s ({split})  {_speculation(r)}{invalid}"
    )


def _speculation(r: StepRecord) -> str:
    """What speculation did in the step: its accept length where it ran, and the share of tokens it decoded
    (an average over every iteration would count the tuner's plain ones as 1.0)."""
    if not r.spec_token_share:
        return "no speculation"
    return f"accept {r.spec_accept_length:.2f} on {r.spec_token_share:.0%} of tokens"


def _explain(errors: dict[str, int]) -> str:
    """The reward's most common errors, with the fix for the usual signature mistake."""
    if not errors:
        return "no error was reported"
    top = sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    text = "; ".join(f"{n}× {e}" for e, n in top)
    if any("unexpected keyword argument" in e for e in errors):
        text += (
            " — a reward is called as fn(prompt, completion, **row), row being the dataset row's fields "
            "(question, answer, metadata): accept **kwargs (e.g. def reward(prompt, completion, answer, **_))"
        )
    return text
