"""Rollout benchmark: a long-tail GRPO rollout, plain vs n-gram vs full adaptive, side by side in one run.

    slipstream bench rollout --json                       # smollm2-135m, basic_arithmetic, all three modes
    slipstream bench rollout --prompts 4 --samples 4 --max-tokens 128 --json      # a quicker one
    slipstream bench rollout --trace iters.jsonl          # plus every decode iteration, one JSON line each
    python -m slipstream.benchmarks.rollout --json        # the same without the CLI

Workload: `prompts` reasoning-gym questions (fixed seed) through the chat template, `samples` (G) responses
each at temperature 0.7, up to `max_tokens` (512) tokens, EOS honoured — so response lengths are the
model's own, heavy-tailed ones. Why 0.7: at T = 1 SmolLM2-135M degenerates in about a third of its
responses, which all run to the length cap (11 of 32 at 384 tokens): a wide plateau, not a tail. At 0.7
one response in 32 reaches 512 tokens and a few long ones decode alone for half the makespan, which is
the shape of reasoning-model rollouts this benchmark is about. Real processes: 2 rollout actors, each pinned to one core of this CPU with one thread
("2 devices"), and for the adaptive mode 2 drafter actors, one per device, dormant until leased. The
bench itself is the coordinator: it deals whole groups round-robin (GRPO siblings stay together, so the
n-gram drafter sees them), streams completions back, leases a device to its drafter actor the moment
that device's rollout reports Idle, and preempts every lease when the last completion arrives.

Modes (same prompts, same seeds):
- plain: the tuner has one arm, "off".
- ngram: arms off and n-gram chains: what a user without a drafter gets (the tuner switches n-gram off
  where it loses).
- adaptive: off, n-gram, EAGLE and hybrid (n-gram where it matches, else EAGLE) arms. The EAGLE head
  starts warmed (`--drafter DIR`, by default a cached `drafter warmup` of the model on the task, made on
  first use), keeps training online on the rollouts' hidden states in idle device time, and hot-swaps
  into the still-decoding rollout.

Steps: each mode runs `steps` RL steps (4), each on its own fresh prompts, the same for every mode. The
first warms the tuner and starts the online drafter; the others are measured and summed, because one
step's makespan on this shared 2-core machine varies by ±15% between runs (29.8–36.1 s for the same
plain step) — a sum over three steps halves that.

Verification runs in reproducible mode, so every mode produces the responses plain decoding does with the
same seeds (checked: `identical_outputs`, and `differing_responses` per mode); the makespans then compare
the same work. One caveat, measured: a verify pass computes a position's logits in differently shaped
kernel calls than a one-row decode step (oneDNN's single-row path, attention over 1 vs k + 1 query rows),
and SmolLM2's logits then differ by up to ~6e-5. Where the sampler's race at a position is decided by less
than that, the token differs and that response continues differently: 1 response in 32 diverged in one of
about ten runs. Each token is still drawn from the target distribution as computed (the same numerical
noise by which plain decoding at batch 1 and batch 16 differ); bitwise batch invariance is not built. Each mode's JSON: makespan_s
(first request sent → last completion received, summed over the measured steps), tokens_per_s,
idle_device_s (device-seconds between a rollout going idle and the end of its step), reclaimed_share
(drafter training seconds inside those leases / idle_device_s), step_makespans_s (every step); and, for
the last step, accept_length per batch-size bucket (committed tokens per sequence-iteration), arms chosen
per bucket and decode_s (device-seconds of decode iterations per bucket); over the measured steps,
bucket_device_share (each bucket's share of the decode device-seconds) and bucket_tokens_per_s. Top
level: speedup = plain makespan / adaptive makespan, ngram_speedup = plain / ngram, each also per step
and per bucket (`speedup_per_bucket`: the mode's bucket tokens/s over plain's; with plain's
bucket_device_share it bounds what the makespan can gain). `--trace FILE` writes
every decode iteration (rank, batch size, arm, drafted, accepted, committed, seconds) as JSON lines.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec
import torch
import uvloop

from slipstream.engine import hub
from slipstream.engine.tokenizer import Tokenizer
from slipstream.engine.tuner import Tuner, TunerConfig
from slipstream.engine.warmup import warmup
from slipstream.engine.weights import load_model
from slipstream.protocols.control import Idle, Lease, Preempt, Released
from slipstream.protocols.drafter import DrafterStats
from slipstream.protocols.rollout import Completion, GenerateRequest, IterationStats, SamplingSpec
from slipstream.runtime.progress import bar
from slipstream.runtime.supervisor import ActorSpec, Supervisor
from slipstream.tasks.datasets import task_prompts

__all__ = ["MODES", "main", "render", "run"]

MODES = ("plain", "ngram", "adaptive")
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_TASK = "basic_arithmetic"
DEVICES = 2
BUCKETS = [1, 2, 3, 5, 9, 17]
# Deep n-gram chains pay off in the tail, where a lone long response often repeats itself or a sibling.
# EAGLE trees and depth 7 lost in every bucket here (1 CPU thread per device; see the README figures), and
# every arm costs exploration, so the bench offers the arms that can win. "hybrid" drafts with the n-gram
# tables where they match and with the head elsewhere.
NGRAM_ARMS = ["ngram:d3", "ngram:d5", "ngram:d8"]
EAGLE_ARMS = ["eagle:d3", "hybrid:d3", "hybrid:d5"]
ARMS = {"plain": ["off"], "ngram": ["off", *NGRAM_ARMS], "adaptive": ["off", *NGRAM_ARMS, *EAGLE_ARMS]}
PHASE_TIMEOUT_S = 3600.0


# The rollout's own bucketing (the tuner's), so figures are reported per bucket the tuner decides in.
_BUCKETING = Tuner(TunerConfig(buckets=BUCKETS, arms=["off"]))


def default_drafter_dir(model: str, task: str) -> Path:
    return hub.home() / "drafters" / f"{Path(model).name}-{task}"


def rollout_specs(
    mode: str, model: str, max_len: int, drafter: Path | None, max_batch: int
) -> list[ActorSpec]:
    adaptive = mode == "adaptive"
    specs = []
    for rank in range(DEVICES):
        config: dict[str, Any] = {
            "model": model,
            "max_batch": max_batch,
            "max_len": max_len,
            "spec_mode": "reproducible",
            "tuner": {"buckets": BUCKETS, "arms": ARMS[mode], "seed": rank},
        }
        if adaptive:
            config.update(drafter=str(drafter), hidden_to=[f"drafter:{r}" for r in range(DEVICES)])
        specs.append(
            ActorSpec(actor="slipstream.actors.rollout:RolloutActor", rank=rank, config=config, cpus=[rank])
        )
    if adaptive:
        for rank in range(DEVICES):
            config = {
                "model": model,
                "init_from": str(drafter),
                "publish_to": [f"rollout:{r}" for r in range(DEVICES)],
                "world_size": DEVICES,
                "batch_tokens": 512,  # a short step: preemption waits at most one
                "publish_every_steps": 10,
                "checkpoint_every_steps": 0,
            }
            specs.append(
                ActorSpec(
                    actor="slipstream.actors.drafter:DrafterActor", rank=rank, config=config, cpus=[rank]
                )
            )
    return specs


async def run_phase(
    mode: str,
    *,
    model: str,
    prompt_sets: list[list[list[int]]],
    samples: int,
    max_tokens: int,
    temperature: float,
    stop_ids: list[int],
    seed: int,
    drafter: Path | None,
    run_dir: Path,
    trace: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """One mode: start the actors, run one rollout step per prompt set as the coordinator does (actors,
    tuner state and drafter carry over between steps), return each step's figures."""
    max_len = max(len(p) for prompts in prompt_sets for p in prompts) + max_tokens + 64
    max_batch = -(-max(len(prompts) for prompts in prompt_sets) // DEVICES) * samples
    sampling = SamplingSpec(temperature=temperature, max_tokens=max_tokens, stop_token_ids=stop_ids)
    sup = Supervisor(run_dir, heartbeat_s=1.0)
    await sup.start(rollout_specs(mode, model, max_len, drafter, max_batch))
    last_trained: dict[int, float] = {}
    steps = []
    try:
        for step, prompts in enumerate(prompt_sets):
            figures = await _coordinate(
                sup, mode, prompts, samples, sampling, seed + step, group_base=step * 10_000,
                last_trained=last_trained, trace=trace,
            )  # fmt: skip
            steps.append(figures)
        return steps
    finally:
        await sup.shutdown(grace_s=10.0)


_lease_ids = itertools.count(1)


async def _coordinate(
    sup: Supervisor,
    mode: str,
    prompts: list[list[int]],
    samples: int,
    sampling: SamplingSpec,
    seed: int,
    *,
    group_base: int,
    last_trained: dict[int, float],
    trace: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One synchronous rollout step. last_trained (drafter rank -> its training seconds so far, from
    DrafterStats) carries across steps; every IterationStats is appended to `trace` (when given) with its
    arrival time from the step's start."""
    adaptive = mode == "adaptive"
    expected = len(prompts) * samples
    responses: dict[tuple[int, int], list[int]] = {}
    committed: dict[int, int] = defaultdict(int)  # by bucket index
    seq_iters: dict[int, int] = defaultdict(int)
    bucket_s: dict[int, float] = defaultdict(float)  # device-seconds of decode iterations, by bucket
    arms: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    idle_at: dict[int, float] = {}
    leases: dict[int, int] = {}  # drafter rank -> lease id
    trained_at_lease: dict[int, float] = {}
    awaiting_stats: set[int] = set()  # released drafters whose DrafterStats is still on its way
    released_ms: list[float] = []
    finish: dict[str, int] = defaultdict(int)

    started = time.monotonic()
    for i, prompt in enumerate(prompts):
        group = group_base + i
        await sup.send(
            f"rollout:{i % DEVICES}",
            GenerateRequest(
                group_id=group,
                prompt_ids=torch.tensor(prompt, dtype=torch.int64),
                num_samples=samples,
                seed=seed * 1_000_003 + group,
                sampling=sampling,
                policy_version=0,
            ),
        )
    ended = None
    deadline = started + PHASE_TIMEOUT_S
    # Every rollout reports Idle right after its last completion: wait for all, so none trails into the next step.
    while ended is None or leases or awaiting_stats or len(idle_at) < DEVICES:
        if not sup.deaths.empty():
            died = sup.deaths.get_nowait()
            raise RuntimeError(f"{died.name} died during the {mode} phase: {died.reason}")
        try:
            # Wake at least every second, so an actor that dies while all are quiet is noticed.
            sender, msg = await asyncio.wait_for(sup.inbox.get(), timeout=1.0)
        except TimeoutError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{mode} phase: no progress before the {PHASE_TIMEOUT_S:.0f} s limit"
                ) from None
            continue
        now = time.monotonic()
        if isinstance(msg, Completion):
            responses[(msg.group_id, msg.sample_index)] = msg.token_ids.tolist()
            finish[msg.finish_reason] += 1
            if len(responses) == expected:
                ended = now
                for rank, lease_id in leases.items():  # the step is over: give the devices back
                    preempt = Preempt(lease_id=lease_id, reason="rollout done", sent_ns=time.time_ns())
                    await sup.send(f"drafter:{rank}", preempt)
                deadline = now + 30.0
        elif isinstance(msg, IterationStats):
            if msg.batch_size == 0:  # a prefill-only pass: it says nothing about decoding
                continue
            label = _BUCKETING.bucket(msg.batch_size)
            committed[label] += msg.committed
            seq_iters[label] += msg.batch_size
            bucket_s[label] += msg.iter_s
            if trace is not None:
                trace.append({"mode": mode, "group_base": group_base, "t": round(now - started, 4),
                              **msgspec.structs.asdict(msg)})  # fmt: skip
            arms[label][msg.arm] += 1
        elif isinstance(msg, Idle):
            if msg.rank in idle_at:
                continue
            idle_at[msg.rank] = now
            if adaptive and ended is None:
                # The line where an idle device goes to drafter training.
                lease_id = next(_lease_ids)
                trained_at_lease[msg.rank] = last_trained.get(msg.rank, 0.0)
                lease = Lease(lease_id=lease_id, device=f"cpu:{msg.rank}", threads=1, cpus=[msg.rank])
                await sup.send(f"drafter:{msg.rank}", lease)
                leases[msg.rank] = lease_id
        elif isinstance(msg, DrafterStats):
            last_trained[msg.rank] = msg.elapsed_s
            awaiting_stats.discard(msg.rank)
        elif isinstance(msg, Released):
            rank = int(sender.split(":")[1])
            leases.pop(rank, None)
            awaiting_stats.add(rank)  # a drafter reports its training seconds right after releasing
            released_ms.append(msg.latency_ns / 1e6)
    assert ended is not None
    makespan = ended - started
    idle_device_s = sum(max(0.0, ended - t) for t in idle_at.values())
    reclaimed_s = sum(max(0.0, last_trained.get(rank, 0.0) - t0) for rank, t0 in trained_at_lease.items())
    tokens = sum(len(r) for r in responses.values())
    return {
        "makespan_s": round(makespan, 3),
        "tokens": tokens,
        "tokens_per_s": round(tokens / makespan, 2),
        "accept_length": {
            _BUCKETING.label(b): round(committed[b] / seq_iters[b], 3) for b in sorted(seq_iters)
        },
        "arms": {_BUCKETING.label(b): dict(arms[b]) for b in sorted(arms)},
        "decode_s": {_BUCKETING.label(b): round(bucket_s[b], 2) for b in sorted(bucket_s)},
        "_bucket_s": dict(bucket_s),  # by bucket index, for the totals over the measured steps
        "_bucket_tokens": dict(committed),
        "idle_device_s": round(idle_device_s, 3),
        "reclaimed_s": round(reclaimed_s, 3),
        "reclaimed_share": round(min(reclaimed_s / idle_device_s, 1.0), 3) if idle_device_s > 0 else 0.0,
        "preempt_ms": [round(x, 2) for x in released_ms],
        "finish_reasons": dict(finish),
        "_responses": responses,
    }


def run(
    model: str | None = None,
    *,
    task: str = DEFAULT_TASK,
    prompts: int = 8,
    samples: int = 4,
    max_tokens: int = 512,
    temperature: float = 0.7,
    seed: int = 0,
    steps: int = 4,
    modes: tuple[str, ...] = MODES,
    drafter: Path | None = None,
    warmup_steps: int = 1000,
    trace: Path | None = None,
) -> dict[str, Any]:
    """All requested modes, one after another, on the same workload; see the module docstring."""
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: choose from {', '.join(MODES)}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    model = model or DEFAULT_MODEL
    model_dir = hub.resolve(model)
    if (model_dir / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_dir(model_dir)
        # A new batch of questions per RL step: consecutive chunks of one dataset. (reasoning-gym keys item i
        # of seed s by s + i, so datasets of neighbouring seeds share items: seed + step would repeat 7 of
        # 8 questions from one step to the next. The default warmup, seed + 1000, is disjoint from these.)
        questions = task_prompts(task, prompts * steps, seed, tokenizer)
        prompt_sets = [questions[s * prompts : (s + 1) * prompts] for s in range(steps)]
        stop_ids = sorted(tokenizer.stop_ids)
    else:  # a bare model directory (the tests' tiny models): seeded random prompts, the model's EOS
        gen = torch.Generator().manual_seed(seed)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        prompt_sets = [
            [torch.randint(0, vocab, (8 + 4 * (i % 3),), generator=gen).tolist() for i in range(prompts)]
            for _ in range(steps)
        ]
        stop_ids = []
    warmed: dict[str, Any] | None = None
    if "adaptive" in modes:
        drafter = drafter or default_drafter_dir(model, task)
        if not (drafter / "config.json").is_file():
            print(
                f"bench rollout: no warmed drafter at {drafter}; running drafter warmup first (~30 min)",
                file=sys.stderr,
            )
            # Its own 384 + 16 questions: a dataset 1000 seeds on, disjoint from the bench's.
            held = task_prompts(task, 384 + 16, seed + 1000, tokenizer)
            warmed = warmup(
                load_model(model_dir), held[:384], held[384:], eos=stop_ids, steps=warmup_steps, out=drafter,
                max_tokens=256, temperature=temperature, seed=seed + 1000, progress=bar,
            )  # fmt: skip
    result: dict[str, Any] = {
        "model": str(model_dir),
        "task": task,
        "prompts": prompts,
        "samples": samples,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "steps": steps,
        "devices": DEVICES,
        "drafter": None if drafter is None else str(drafter),
        "modes": {},
    }
    if warmed is not None:
        result["warmup"] = warmed
    outputs = []
    iterations: list[dict[str, Any]] | None = [] if trace is not None else None
    with tempfile.TemporaryDirectory(prefix="slipstream-bench-rollout-") as tmp:
        for mode in modes:
            print(f"bench rollout: {mode} …", file=sys.stderr)
            figures = uvloop.run(
                run_phase(
                    mode,
                    model=str(model_dir),
                    prompt_sets=prompt_sets,
                    samples=samples,
                    max_tokens=max_tokens,
                    temperature=temperature,
                    stop_ids=stop_ids,
                    seed=seed,
                    drafter=drafter,
                    run_dir=Path(tmp) / mode,
                    trace=iterations,
                )
            )
            outputs.append([f.pop("_responses") for f in figures])
            result["modes"][mode] = _measured(figures)
    if trace is not None:
        assert iterations is not None
        trace.write_text("".join(json.dumps(row) + "\n" for row in iterations))
    # Responses (over all steps) that differ from the first mode's. Not always 0: see the module docstring.
    result["differing_responses"] = {
        mode: sum(a != b for step, ref in zip(o, outputs[0], strict=True) for a, b in _pairs(step, ref))
        for mode, o in zip(result["modes"], outputs, strict=True)
    }
    result["identical_outputs"] = not any(result["differing_responses"].values())
    modes = result["modes"]
    if "plain" in modes:
        for mode, key in (("adaptive", "speedup"), ("ngram", "ngram_speedup")):
            if mode in modes:
                result[key] = round(modes["plain"]["makespan_s"] / modes[mode]["makespan_s"], 3)
                first = modes["plain"]["step_makespans_s"][0] / modes[mode]["step_makespans_s"][0]
                result[f"{key}_first_step"] = round(first, 3)
                per_step = [
                    round(p / m, 3)
                    for p, m in zip(
                        modes["plain"]["step_makespans_s"], modes[mode]["step_makespans_s"], strict=True
                    )
                ]
                result[f"{key}_per_step"] = per_step
                # Per bucket: this mode's tokens/s over plain's there. Where plain spends most of its time
                # bounds the makespan speedup (see the README).
                plain_rates, rates = modes["plain"]["bucket_tokens_per_s"], modes[mode]["bucket_tokens_per_s"]
                result[f"{key}_per_bucket"] = {
                    label: round(rates[label] / plain_rates[label], 3)
                    for label in plain_rates
                    if label in rates
                }
    return result


def _pairs(a: dict[Any, list[int]], b: dict[Any, list[int]]) -> list[tuple[list[int], list[int]]]:
    return [(a.get(key, []), b.get(key, [])) for key in sorted(set(a) | set(b))]


def _measured(figures: list[dict[str, Any]]) -> dict[str, Any]:
    """A mode's figures over its measured steps: every step but the first (which warms the tuner and starts
    the drafter's online training), or the only one. Times and tokens are totals over those steps, and so
    are bucket_device_share and bucket_tokens_per_s; the other per-bucket figures (accept_length, arms,
    decode_s) and finish reasons are the last step's."""
    buckets = [(f.pop("_bucket_s"), f.pop("_bucket_tokens")) for f in figures]
    measured = figures[1:] or figures
    bucket_s: dict[int, float] = defaultdict(float)
    bucket_tokens: dict[int, int] = defaultdict(int)
    for step_s, step_tokens in buckets[1:] or buckets:
        for b, seconds in step_s.items():
            bucket_s[b] += seconds
            bucket_tokens[b] += step_tokens[b]
    total_s = sum(bucket_s.values())
    makespan = sum(f["makespan_s"] for f in measured)
    tokens = sum(f["tokens"] for f in measured)
    idle = sum(f["idle_device_s"] for f in measured)
    reclaimed = sum(f["reclaimed_s"] for f in measured)
    return {
        **figures[-1],
        "measured_steps": len(measured),
        "makespan_s": round(makespan, 3),
        "tokens": tokens,
        "tokens_per_s": round(tokens / makespan, 2),
        "idle_device_s": round(idle, 3),
        "reclaimed_s": round(reclaimed, 3),
        "reclaimed_share": round(min(reclaimed / idle, 1.0), 3) if idle > 0 else 0.0,
        "preempt_ms": [x for f in measured for x in f["preempt_ms"]],
        "step_makespans_s": [f["makespan_s"] for f in figures],
        # Over the measured steps: where the device time went, and how fast each batch-size bucket decoded.
        "bucket_device_share": {
            _BUCKETING.label(b): round(bucket_s[b] / total_s, 3) for b in sorted(bucket_s)
        },
        "bucket_tokens_per_s": {
            _BUCKETING.label(b): round(bucket_tokens[b] / bucket_s[b], 2) for b in sorted(bucket_s)
        },
    }


def render(result: dict[str, Any]) -> str:
    lines = [
        f"rollout: {result['model']} on {result['task']}, {result['prompts']} prompts x {result['samples']} "
        f"samples, <= {result['max_tokens']} tokens, T={result['temperature']}, {result['devices']} devices"
    ]
    for mode, m in result["modes"].items():
        lines.append(
            f"  {mode:9s} makespan {m['makespan_s']:8.2f} s  {m['tokens_per_s']:7.1f} tok/s  idle "
            f"{m['idle_device_s']:6.1f} dev-s  reclaimed {m['reclaimed_share']:.2f}  accept {m['accept_length']}"
        )
    for key in ("speedup", "ngram_speedup"):
        if key in result:
            lines.append(f"  {key}: {result[key]:.3f}x")
    lines.append(f"  identical outputs across modes: {result['identical_outputs']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m slipstream.benchmarks.rollout", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default=None)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--json", action="store_true")
    p.add_argument("--task", default=DEFAULT_TASK)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--drafter", type=Path, default=None)
    p.add_argument("--trace", type=Path, default=None)
    args = p.parse_args(argv)
    result = run(
        args.model,
        task=args.task,
        prompts=args.prompts,
        samples=args.samples,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        steps=args.steps,
        modes=tuple(args.modes.split(",")),
        drafter=args.drafter,
        trace=args.trace,
    )
    print(json.dumps(result) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
