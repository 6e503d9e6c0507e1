"""Rollout benchmark: a long-tail GRPO rollout, plain vs n-gram vs adaptive, side by side in one run.

    slipstream bench rollout --json                                  # deploy/configs/bench-rollout.yaml
    slipstream bench rollout prompts=4 max_tokens=128 --json         # key.sub=value overrides (or --prompts 4)
    slipstream bench rollout --config my.yaml --trace iters.jsonl    # plus every decode iteration, JSON lines

Real processes: 2 rollout actors, one core and one thread each ("2 devices"), and in the adaptive mode
2 drafter actors that train one EAGLE head. The bench is a client of `rl/coordinator.py`, as the RL
loop is: whole groups are dealt by expected work, an idle device is leased to its drafter, and every lease
is preempted when the last completion arrives. Each mode runs `steps` RL steps on the same fresh prompts;
the first warms the tuner and the online drafter, the others are measured and summed. Verification is
reproducible, so every mode decodes the responses plain decoding does (`differing_responses` counts the
rare exceptions). Configuration: `RolloutBenchConfig` (benchmarks/rollout_config.py); result:
`RolloutBenchResult`; why this workload, and measured figures: docs/benchmarks.md.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch
import uvloop

from slipstream.actors.drafter import DrafterActor
from slipstream.actors.rollout import RolloutActor
from slipstream.benchmarks.rollout_config import Mode, RolloutBenchConfig
from slipstream.engine import hub
from slipstream.engine.sampling import group_seed
from slipstream.engine.tokenizer import Tokenizer
from slipstream.engine.tuner import Tuner, TunerConfig
from slipstream.engine.warmup import warmup
from slipstream.engine.weights import load_model
from slipstream.protocols.rollout import GenerateRequest, IterationStats, SamplingSpec
from slipstream.rl.coordinator import Coordinator
from slipstream.rl.step import rollout_step
from slipstream.runtime import config as run_config
from slipstream.runtime.placement import Placement, place
from slipstream.runtime.progress import bar
from slipstream.runtime.supervisor import ActorSpec, Supervisor
from slipstream.runtime.transport import actor_name
from slipstream.tasks.datasets import task_prompts

__all__ = ["ModeFigures", "RolloutBenchResult", "render", "run"]

DEVICES = 2


# -- result --------------------------------------------------------------------------------------------


class ModeFigures(msgspec.Struct, frozen=True, kw_only=True):
    """One mode's figures. Totals are over the measured steps (all but the first, or the only one); per
    bucket figures are keyed by the tuner's bucket label ("1", "3-4", "17+")."""

    makespan_s: float  # first request sent → last completion received, summed over the measured steps
    tokens: int  # response tokens in the measured steps
    tokens_per_s: float  # tokens / makespan_s
    accept_length: dict[str, float]  # last step, per bucket: 1 + accepted draft tokens per sequence-iteration
    arms: dict[str, dict[str, int]]  # last step, per bucket: decode iterations per arm the tuner chose
    decode_s: dict[str, float]  # last step, per bucket: device-seconds of decode iterations
    idle_device_s: float  # device-seconds between a rollout going Idle and the end of its step
    reclaimed_s: float  # drafter training seconds inside the leases of that idle time
    reclaimed_share: float  # reclaimed_s / idle_device_s, at most 1 (0 without idle time)
    preempt_ms: list[float]  # preempt → released latency of every lease in the measured steps
    finish_reasons: dict[str, int]  # last step: completions per finish reason ("stop", "length", …)
    measured_steps: int  # how many steps the totals cover
    step_makespans_s: list[float]  # every step's makespan, the first included
    bucket_device_share: dict[str, float]  # per bucket: its share of the decode device-seconds
    bucket_tokens_per_s: dict[str, float]  # per bucket: committed tokens per decode device-second


class RolloutBenchResult(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What `bench rollout --json` prints. The speedup fields are present when plain and that mode ran."""

    model: str  # the resolved model directory
    task: str
    prompts: int
    samples: int
    max_tokens: int
    temperature: float
    steps: int
    devices: int  # rollout actors, one core each
    drafter: str | None  # the EAGLE head the adaptive mode starts from (None: adaptive not run, none given)
    modes: dict[str, ModeFigures]  # in run order
    warmup: dict[str, Any] | None = None  # the drafter warmup's summary, when this run had to make the head
    differing_responses: dict[str, int]  # per mode: responses not token-identical to the first mode's
    identical_outputs: bool  # no mode differs
    speedup: float | None = None  # plain makespan_s / adaptive makespan_s
    speedup_first_step: float | None = None  # the same for the first (unmeasured) step
    speedup_per_step: list[float] | None = None  # the same for every step
    speedup_per_bucket: dict[str, float] | None = None  # adaptive bucket_tokens_per_s / plain's, per bucket
    ngram_speedup: float | None = None  # plain makespan_s / ngram makespan_s
    ngram_speedup_first_step: float | None = None
    ngram_speedup_per_step: list[float] | None = None
    ngram_speedup_per_bucket: dict[str, float] | None = None


@dataclass
class _Step:
    """One step's figures as the coordinator saw them (bucket sums by bucket index)."""

    makespan_s: float
    tokens: int
    accept_length: dict[str, float]
    arms: dict[str, dict[str, int]]
    decode_s: dict[str, float]
    bucket_s: dict[int, float]
    bucket_tokens: dict[int, int]
    idle_device_s: float
    reclaimed_s: float
    preempt_ms: list[float]
    finish_reasons: dict[str, int]
    responses: dict[tuple[int, int], list[int]]


# -- the coordinator -----------------------------------------------------------------------------------


def default_drafter_dir(model: str, task: str) -> Path:
    return hub.home() / "drafters" / f"{Path(model).name}-{task}"


def _placement(config: RolloutBenchConfig) -> Placement:
    return place(config.device, rollouts=DEVICES, learners=1, learner_threads=1)  # (no learner runs here)


def rollout_specs(
    config: RolloutBenchConfig, mode: Mode, model: str, max_len: int, drafter: Path | None, max_batch: int
) -> list[ActorSpec]:
    adaptive = mode == "adaptive"
    rollouts = [actor_name(RolloutActor.role, r) for r in range(DEVICES)]
    where = _placement(config)
    drafters = [actor_name(DrafterActor.role, r) for r in range(len(where.drafters))]
    specs = []
    for rank, slot in enumerate(where.rollouts):
        rollout = RolloutActor.Config(
            model=model,
            device=slot.device,
            dtype="bfloat16" if config.device == "cuda" else "",
            max_batch=max_batch,
            max_len=max_len,
            spec_mode=config.rollout_actors.spec_mode,
            tuner=config.tuner.config(mode, seed=rank),
            **({"drafter": str(drafter), "hidden_to": drafters} if adaptive else {}),
        )
        specs.append(
            ActorSpec.of(RolloutActor, rank=rank, config=rollout, threads=slot.threads, cpus=slot.cpus)
        )
    if adaptive:
        settings = config.drafter_actors
        for rank, slot in enumerate(where.drafters):
            trainer = DrafterActor.Config(
                model=model,
                device=slot.device,
                init_from=str(drafter),
                publish_to=rollouts,
                world_size=len(where.drafters),
                batch_tokens=settings.batch_tokens,
                publish_every_steps=settings.publish_every_steps,
                checkpoint_every_steps=settings.checkpoint_every_steps,
            )
            specs.append(
                ActorSpec.of(DrafterActor, rank=rank, config=trainer, threads=slot.threads, cpus=slot.cpus)
            )
    return specs


async def run_phase(
    mode: Mode,
    *,
    config: RolloutBenchConfig,
    model: str,
    prompt_sets: list[list[list[int]]],
    stop_ids: list[int],
    drafter: Path | None,
    run_dir: Path,
    bucketing: Tuner,
    trace: list[dict[str, Any]] | None = None,
) -> list[_Step]:
    """One mode: start the actors, run one rollout step per prompt set as the coordinator does (actors,
    tuner state and drafter carry over between steps), return each step's figures."""
    max_len = max(len(p) for prompts in prompt_sets for p in prompts) + config.max_tokens + 64
    max_batch = -(-max(len(prompts) for prompts in prompt_sets) // DEVICES) * config.samples
    sampling = SamplingSpec(
        temperature=config.temperature, max_tokens=config.max_tokens, stop_token_ids=stop_ids
    )
    sup = Supervisor(run_dir, heartbeat_s=1.0, trace=config.spans)
    await sup.start(rollout_specs(config, mode, model, max_len, drafter, max_batch))
    rollouts = [actor_name(RolloutActor.role, r) for r in range(DEVICES)]
    # Only the adaptive mode has drafters: the coordinator leases an idle device to the one placed for it.
    where = _placement(config)
    drafters = (
        {r: actor_name(DrafterActor.role, where.drafter_of[i]) for i, r in enumerate(rollouts)}
        if mode == "adaptive"
        else {}
    )
    lease_cpus = {r: where.rollouts[i].cpus for i, r in enumerate(rollouts)}
    steps = []
    try:
        async with Coordinator(sup, rollouts=rollouts, drafters=drafters, lease_cpus=lease_cpus) as coord:
            for step, prompts in enumerate(prompt_sets):
                figures = await _step(
                    coord, mode, prompts, config.samples, sampling, config.seed + step, group_base=step * 10_000,
                    bucketing=bucketing, trace=trace,
                )  # fmt: skip
                steps.append(figures)
        return steps
    finally:
        await sup.shutdown(grace_s=10.0)


@dataclass
class _BucketSums:
    """One step's decode IterationStats summed per tuner bucket (keyed by bucket index)."""

    bucketing: Tuner
    committed: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    accepted: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    seq_iters: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[int, float] = field(default_factory=lambda: defaultdict(float))  # of decode iterations
    arms: dict[int, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))

    def add(self, msg: IterationStats) -> None:
        b = self.bucketing.bucket(msg.batch_size)
        self.committed[b] += msg.committed
        self.accepted[b] += msg.accepted
        self.seq_iters[b] += msg.batch_size
        self.seconds[b] += msg.iter_s
        self.arms[b][msg.arm] += 1

    def accept_length(self) -> dict[str, float]:
        # 1 + accepted per sequence-iteration, as StepMetrics: committed also counts prefill-born tokens.
        label = self.bucketing.label
        return {label(b): round(1 + self.accepted[b] / self.seq_iters[b], 3) for b in sorted(self.seq_iters)}

    def arm_counts(self) -> dict[str, dict[str, int]]:
        return {self.bucketing.label(b): dict(self.arms[b]) for b in sorted(self.arms)}

    def decode_s(self) -> dict[str, float]:
        return {self.bucketing.label(b): round(self.seconds[b], 2) for b in sorted(self.seconds)}


def _requests(
    prompts: list[list[int]], samples: int, sampling: SamplingSpec, seed: int, group_base: int
) -> list[GenerateRequest]:
    """A step's groups: prompt i as group `group_base + i`, seeded as the RL loop seeds it."""
    return [
        GenerateRequest(
            group_id=group_base + i,
            prompt_ids=torch.tensor(prompt, dtype=torch.int64),
            num_samples=samples,
            seed=group_seed(seed, group_base + i),
            sampling=sampling,
            policy_version=0,
        )
        for i, prompt in enumerate(prompts)
    ]


async def _step(
    coord: Coordinator,
    mode: Mode,
    prompts: list[list[int]],
    samples: int,
    sampling: SamplingSpec,
    seed: int,
    *,
    group_base: int,
    bucketing: Tuner,
    trace: list[dict[str, Any]] | None = None,
) -> _Step:
    """One synchronous rollout step through the coordinator; every IterationStats is summed per bucket
    and appended to `trace` (when given) with its arrival time from the step's start."""
    sums = _BucketSums(bucketing)
    started = time.monotonic()

    def on_iteration(sender: str, msg: IterationStats) -> None:
        if msg.batch_size == 0:  # a prefill-only pass: it says nothing about decoding
            return
        sums.add(msg)
        if trace is not None:
            trace.append({"mode": mode, "group_base": group_base, "t": round(time.monotonic() - started, 4),
                          **msgspec.structs.asdict(msg)})  # fmt: skip

    requests = _requests(prompts, samples, sampling, seed, group_base)
    # every rollout idle, every lease accounted
    completions, m = await rollout_step(coord, requests, on_iteration=on_iteration)
    responses = {key: completion.token_ids.tolist() for key, completion in completions.items()}
    return _Step(
        makespan_s=round(m.rollout_s, 3),
        tokens=sum(len(r) for r in responses.values()),
        accept_length=sums.accept_length(),
        arms=sums.arm_counts(),
        decode_s=sums.decode_s(),
        bucket_s=dict(sums.seconds),
        bucket_tokens=dict(sums.committed),
        idle_device_s=round(m.idle_device_s, 3),
        reclaimed_s=round(m.reclaimed_s, 3),
        preempt_ms=[round(x, 2) for x in m.preempt_ms],
        finish_reasons=dict(m.finish_reasons),
        responses=responses,
    )


# -- the benchmark -------------------------------------------------------------------------------------


def _workload(
    config: RolloutBenchConfig, model_dir: Path
) -> tuple[list[list[list[int]]], list[int], Tokenizer | None]:
    """Each step's prompts, the stop ids, and the tokenizer (None for a bare model directory)."""
    prompts, steps, seed = config.prompts, config.steps, config.seed
    if (model_dir / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_dir(model_dir)
        # A new batch of questions per RL step: consecutive chunks of one dataset. (reasoning-gym keys item i
        # of seed s by s + i, so datasets of neighbouring seeds share items: seed + step would repeat 7 of
        # 8 questions from one step to the next. The default warmup, seed + 1000, is disjoint from these.)
        questions = task_prompts(config.task, prompts * steps, seed, tokenizer)
        prompt_sets = [questions[s * prompts : (s + 1) * prompts] for s in range(steps)]
        return prompt_sets, sorted(tokenizer.stop_ids), tokenizer
    # A bare model directory (the tests' tiny models): seeded random prompts, the model's EOS.
    gen = torch.Generator().manual_seed(seed)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompt_sets = [
        [torch.randint(0, vocab, (8 + 4 * (i % 3),), generator=gen).tolist() for i in range(prompts)]
        for _ in range(steps)
    ]
    return prompt_sets, [], None


def _warm_drafter(
    config: RolloutBenchConfig,
    model_dir: Path,
    drafter: Path,
    tokenizer: Tokenizer | None,
    stop_ids: list[int],
) -> dict[str, Any]:
    """Makes the EAGLE head the adaptive mode starts from at `drafter`; returns the warmup's summary."""
    print(
        f"bench rollout: no warmed drafter at {drafter}; running drafter warmup first (~30 min)",
        file=sys.stderr,
    )
    if tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer to warm a drafter on: give the bench a drafter")
    # Its own 384 + 16 questions: a dataset 1000 seeds on, disjoint from the bench's.
    held = task_prompts(config.task, 384 + 16, config.seed + 1000, tokenizer)
    return warmup(
        load_model(model_dir), held[:384], held[384:], eos=stop_ids, steps=config.warmup_steps,
        out=drafter, max_tokens=256, temperature=config.temperature, seed=config.seed + 1000, progress=bar,
    )  # fmt: skip


def _speedups(figures: dict[str, ModeFigures]) -> dict[str, Any]:
    """Plain's makespans over adaptive's ("speedup…") and n-gram's ("ngram_speedup…"), for the modes that
    ran; per bucket, that mode's tokens/s over plain's."""
    speedups: dict[str, Any] = {}
    if "plain" not in figures:
        return speedups
    plain = figures["plain"]
    for mode, key in (("adaptive", "speedup"), ("ngram", "ngram_speedup")):
        if mode not in figures:
            continue
        other = figures[mode]
        speedups[key] = round(plain.makespan_s / other.makespan_s, 3)
        speedups[f"{key}_first_step"] = round(plain.step_makespans_s[0] / other.step_makespans_s[0], 3)
        speedups[f"{key}_per_step"] = [
            round(p / m, 3) for p, m in zip(plain.step_makespans_s, other.step_makespans_s, strict=True)
        ]
        # Where plain spends most of its time bounds the makespan speedup (docs/benchmarks.md).
        speedups[f"{key}_per_bucket"] = {
            label: round(other.bucket_tokens_per_s[label] / rate, 3)
            for label, rate in plain.bucket_tokens_per_s.items()
            if label in other.bucket_tokens_per_s
        }
    return speedups


def run(config: RolloutBenchConfig | None = None, *, trace: Path | None = None) -> RolloutBenchResult:
    """Every configured mode, one after another, on the same workload; `trace`: write every decode
    iteration there (JSON lines). A config built in code is checked as a file's would be (ConfigError)."""
    config = run_config.convert(msgspec.to_builtins(config or RolloutBenchConfig()), RolloutBenchConfig)
    print(f"bench rollout: config {msgspec.json.encode(config).decode()}", file=sys.stderr)  # resolved, once
    model_dir = hub.resolve(config.model)
    prompt_sets, stop_ids, tokenizer = _workload(config, model_dir)
    drafter = Path(config.drafter) if config.drafter else None
    warmed: dict[str, Any] | None = None
    if "adaptive" in config.modes:
        drafter = drafter or default_drafter_dir(config.model, config.task)
        if not (drafter / "config.json").is_file():
            warmed = _warm_drafter(config, model_dir, drafter, tokenizer, stop_ids)
    bucketing = Tuner(TunerConfig(buckets=list(config.tuner.buckets), arms=["off"]))  # the tuner's buckets
    figures: dict[str, ModeFigures] = {}
    outputs = []
    iterations: list[dict[str, Any]] | None = [] if trace is not None else None
    with tempfile.TemporaryDirectory(prefix="slipstream-bench-rollout-") as tmp:
        for mode in config.modes:
            print(f"bench rollout: {mode} …", file=sys.stderr)
            done = uvloop.run(
                run_phase(
                    mode, config=config, model=str(model_dir), prompt_sets=prompt_sets, stop_ids=stop_ids,
                    drafter=drafter, run_dir=Path(tmp) / mode, bucketing=bucketing, trace=iterations,
                )
            )  # fmt: skip
            outputs.append([step.responses for step in done])
            figures[mode] = _measured(done, bucketing)
    if trace is not None:
        assert iterations is not None
        trace.write_text("".join(json.dumps(row) + "\n" for row in iterations))
    # Responses (over all steps) that differ from the first mode's. Not always 0: see docs/benchmarks.md.
    differing = {
        mode: sum(a != b for step, ref in zip(o, outputs[0], strict=True) for a, b in _pairs(step, ref))
        for mode, o in zip(figures, outputs, strict=True)
    }
    return RolloutBenchResult(
        model=str(model_dir),
        task=config.task,
        prompts=config.prompts,
        samples=config.samples,
        max_tokens=config.max_tokens,
        temperature=config.temperature,
        steps=config.steps,
        devices=DEVICES,
        drafter=None if drafter is None else str(drafter),
        modes=figures,
        warmup=warmed,
        differing_responses=differing,
        identical_outputs=not any(differing.values()),
        **_speedups(figures),
    )


def _pairs(a: dict[Any, list[int]], b: dict[Any, list[int]]) -> list[tuple[list[int], list[int]]]:
    return [(a.get(key, []), b.get(key, [])) for key in sorted(set(a) | set(b))]


def _measured(steps: list[_Step], bucketing: Tuner) -> ModeFigures:
    """A mode's figures over its measured steps: every step but the first (which warms the tuner and starts
    the drafter's online training), or the only one. Times and tokens are totals over those steps, and so
    are bucket_device_share and bucket_tokens_per_s; the other per-bucket figures (accept_length, arms,
    decode_s) and finish reasons are the last step's."""
    measured = steps[1:] or steps
    bucket_s: dict[int, float] = defaultdict(float)
    bucket_tokens: dict[int, int] = defaultdict(int)
    for step in measured:
        for b, seconds in step.bucket_s.items():
            bucket_s[b] += seconds
            bucket_tokens[b] += step.bucket_tokens[b]
    total_s = sum(bucket_s.values())
    makespan = sum(s.makespan_s for s in measured)
    tokens = sum(s.tokens for s in measured)
    idle = sum(s.idle_device_s for s in measured)
    reclaimed = sum(s.reclaimed_s for s in measured)
    last = steps[-1]
    return ModeFigures(
        makespan_s=round(makespan, 3),
        tokens=tokens,
        tokens_per_s=round(tokens / makespan, 2),
        accept_length=last.accept_length,
        arms=last.arms,
        decode_s=last.decode_s,
        idle_device_s=round(idle, 3),
        reclaimed_s=round(reclaimed, 3),
        reclaimed_share=round(min(reclaimed / idle, 1.0), 3) if idle > 0 else 0.0,
        preempt_ms=[x for s in measured for x in s.preempt_ms],
        finish_reasons=last.finish_reasons,
        measured_steps=len(measured),
        step_makespans_s=[s.makespan_s for s in steps],
        bucket_device_share={bucketing.label(b): round(bucket_s[b] / total_s, 3) for b in sorted(bucket_s)},
        bucket_tokens_per_s={
            bucketing.label(b): round(bucket_tokens[b] / bucket_s[b], 2) for b in sorted(bucket_s)
        },
    )


def render(result: RolloutBenchResult) -> str:
    lines = [
        f"rollout: {result.model} on {result.task}, {result.prompts} prompts x {result.samples} samples, "
        f"<= {result.max_tokens} tokens, T={result.temperature}, {result.devices} devices"
    ]
    for mode, m in result.modes.items():
        lines.append(
            f"  {mode:9s} makespan {m.makespan_s:8.2f} s  {m.tokens_per_s:7.1f} tok/s  idle "
            f"{m.idle_device_s:6.1f} dev-s  reclaimed {m.reclaimed_share:.2f}  accept {m.accept_length}"
        )
    for key in ("speedup", "ngram_speedup"):
        if (value := getattr(result, key)) is not None:
            lines.append(f"  {key}: {value:.3f}x")
    lines.append(f"  identical outputs across modes: {result.identical_outputs}")
    return "\n".join(lines)
