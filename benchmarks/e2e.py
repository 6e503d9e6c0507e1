"""`slipstream bench e2e`: whole RL steps, Slipstream against `--baseline`, side by side in one invocation.

    slipstream bench e2e --json                       # deploy/configs/demo.yaml with steps=4, 2 rounds
    slipstream bench e2e --config my.yaml steps=6 --json

The same config, seeds, prompts and reward run twice: with speculation and drafter training in idle device
time, and as the baseline (plain decoding, no drafter); by default both at once, taking turns step by step
(runtime/turns.py), so a host whose speed drifts slows both alike. Reported per run: step time and its
split, rollout tokens/s, accept length, idle and reclaimed device-seconds, peak memory (`MemorySampler`);
across runs: speedups and token-identical steps (reproducible mode: speculation changes speed, never
tokens); then the learner's cost per token, a training step against the forward pass on the same real
samples. `run` takes the loop as a callable (benchmarks do not import cli/); the CLI's starts each run as a
child `slipstream train`, so the run's memory is its own processes' (`isolated`). Fields and the memory
figures' meaning: docs/benchmarks.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import torch

from slipstream.actors.learner import policy_samples
from slipstream.engine import hub
from slipstream.engine.grpo import LossConfig
from slipstream.engine.policy_train import OptimConfig, PolicySample, PolicyTrainer
from slipstream.engine.weights import load_model
from slipstream.protocols import samples_record
from slipstream.protocols.learner import ScoredGroup
from slipstream.rl.step import pool_arm_tables
from slipstream.runtime.process import MemorySampler, parent_pid
from slipstream.runtime.turns import Turns

__all__ = [
    "E2EResult",
    "LearnerCost",
    "RunFigures",
    "learner_cost",
    "peak_rss",
    "render",
    "run",
    "run_figures",
]

# (run directory, baseline, turns: "FILE:NAME:NEXT" to take turns with the other run, or None) -> its summary
TrainFn = Callable[[Path, bool, str | None], dict[str, Any]]


class RunFigures(msgspec.Struct, frozen=True, kw_only=True):
    """One run, reduced over its steps (times are means per step; device-seconds are sums)."""

    wall_s: float
    step_s: float
    rollout_s: float
    reward_s: float
    learn_s: float
    sync_s: float
    step_s_each: list[float]
    rollout_tokens: int
    tokens_per_s: float  # rollout tokens / rollout seconds
    accept_length: float  # tokens per target forward, token-weighted over steps (1.0 = no speculation)
    # step 0's, per batch-size bucket, over the iterations that speculated: what the drafter the run
    # starts from (the shipped one) buys before any online training
    step0_accept_by_batch: dict[str, float] = {}
    # per batch-size bucket, summed over steps and rollouts: [decode device-seconds, committed tokens]; the
    # two runs side by side say at which batch sizes the method gained or lost time
    decode_by_batch: dict[str, list[float]] = {}
    # per batch-size bucket, the mean over the steps that speculated there of their accept length (decode
    # iterations only: on a multi-turn run, policy tokens; an environment's answer is prefilled)
    accept_by_batch: dict[str, float] = {}
    # Per epoch of the dataset (a step's epoch is its first prompt's): {epoch, steps, step_s, rollout_s
    # (means), accept_length (token-weighted)}. A multi-epoch run drafts from history from the second on.
    epochs: list[dict[str, float]] = []
    # arm -> batch-size bucket -> {iterations, accept_length, draft_ms_per_token, token_share, tokens_per_s}
    # over every step (the steps' tables pooled: `arm_table` in rl/step.py)
    arm_table: dict[str, dict[str, dict[str, float]]] = {}
    turns_mean: float = 0.0  # policy turns per sample, the mean of the steps' means (0: single-turn)
    turns_max: int = 0
    # What reached the coordinator a step (its `inbound` events, rl/coordinator.py), the mean over the
    # steps (start-up excluded): messages, bytes, and {kind: [messages, bytes]}
    inbound_messages: float = 0.0
    inbound_bytes: float = 0.0
    inbound_by_kind: dict[str, list[float]] = {}
    idle_device_s: float
    reclaimed_s: float  # idle device-seconds leased to drafter training
    reclaimed_share: float
    first_reward: float | None
    last_reward: float | None
    invalid: int
    peak_rss_mb: dict[str, float] = {}  # actor ("role:rank") -> peak resident MiB (VmHWM), from its log
    peak_rss_mb_total: float = 0.0  # their sum: an upper bound of the simultaneous peak
    peak_gpu_mb: dict[str, float] = {}  # actor -> the most GPU MiB its allocator held (CUDA runs only)
    # What the run's processes held at once: the peak over time (sampled each second) of their summed
    # proportional set size, shared pages split between the processes that map them; and its split.
    peak_pss_mb_total: float = 0.0
    peak_pss_mb: dict[str, float] = {}


class LearnerCost(msgspec.Struct, frozen=True, kw_only=True):
    threads: int
    steps: int  # sample batches measured
    response_tokens: int  # per batch, mean
    sequence_tokens: int  # prompt + response tokens per batch, mean
    forward_s: list[float]
    train_s: list[float]
    cost_x_each: list[float]
    cost_x: float  # median over batches: train step seconds / forward-pass seconds, same tokens


class E2EResult(msgspec.Struct, frozen=True, kw_only=True):
    run_dir: str
    steps: int
    slipstream: RunFigures
    baseline: RunFigures
    speedup_step: float  # baseline seconds per step / Slipstream's
    speedup_rollout: float
    identical_sample_steps: int  # steps whose every response is token-identical across the two runs
    learner: LearnerCost | None  # None: not measured (--cost-steps 0, e.g. on a GPU machine's clock)
    rounds: int = 1  # 2: S B then B S; slipstream/baseline above are round 1's, the speedups pool rounds
    speedup_step_each: list[float] = []  # per round
    speedup_rollout_each: list[float] = []
    # Per epoch, the rounds pooled: {epoch, steps, speedup_step, speedup_rollout, accept_length (Slipstream's)}
    epochs: list[dict[str, float]] = []
    # Over the epochs after the first (where a multi-epoch run has history to draft from); 0.0 with one epoch
    speedup_step_later_epochs: float = 0.0
    speedup_rollout_later_epochs: float = 0.0


def run(
    train: TrainFn,
    root: Path,
    *,
    cost_steps: int = 3,
    threads: int = 2,
    rounds: int = 1,
    isolated: bool = False,
    interleave: bool = False,
) -> E2EResult:
    """Both runs under `root` (slipstream/, baseline/), then the learner's cost on the first run's samples.
    `rounds` 2 runs Slipstream, baseline, then baseline, Slipstream again (slipstream-2/, baseline-2/):
    whichever runs first in an invocation pays the host's first touches of memory (docs/benchmarks.md),
    so each mode gets an early and a late slot; the speedups pool the rounds' mean step times. `isolated`:
    `train` runs each one as a child process (`slipstream train`, as a user would), so what this process
    holds (imports, the first run's leftovers) is not counted as the run's coordinator. `interleave`
    (with `isolated`): a round's two runs start together and take turns step by step (runtime/turns.py),
    in the round's order, so both meet the host's same minutes; each run's memory is its own processes'."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if interleave and not isolated:
        raise ValueError("interleave needs isolated runs: two runs in this one process cannot take turns")
    figures: dict[str, list[RunFigures]] = {"slipstream": [], "baseline": []}
    for r in range(rounds):
        order = [("slipstream", False), ("baseline", True)][:: -1 if r % 2 else 1]
        dirs = {name: root / (name if r == 0 else f"{name}-{r + 1}") for name, _ in order}
        if interleave:
            both = _taking_turns(train, order, dirs, baton=root / f"turns-{r + 1}")
            for name, _ in order:
                figures[name].append(both[name])
            continue
        for name, baseline in order:
            label = lambda pid: _process_label(pid, isolated=isolated)  # noqa: E731
            figures[name].append(_timed(train, dirs[name], baseline, None, label))
    steps = len(figures["slipstream"][0].step_s_each)
    identical = sum(_samples(root / "slipstream", s) == _samples(root / "baseline", s) for s in range(steps))
    slip, base = figures["slipstream"], figures["baseline"]
    mean = lambda runs, key: statistics.fmean(getattr(f, key) for f in runs)  # noqa: E731
    return E2EResult(
        run_dir=str(root),
        steps=steps,
        slipstream=slip[0],
        baseline=base[0],
        speedup_step=round(mean(base, "step_s") / mean(slip, "step_s"), 3),
        speedup_rollout=round(mean(base, "rollout_s") / mean(slip, "rollout_s"), 3),
        identical_sample_steps=identical,
        learner=(
            learner_cost(root / "slipstream", steps=min(cost_steps, steps), threads=threads)
            if cost_steps
            else None
        ),
        rounds=rounds,
        speedup_step_each=[round(b.step_s / s.step_s, 3) for s, b in zip(slip, base, strict=True)],
        speedup_rollout_each=[round(b.rollout_s / s.rollout_s, 3) for s, b in zip(slip, base, strict=True)],
        **_epoch_speedups(slip, base),
    )


def _epoch_speedups(slip: list[RunFigures], base: list[RunFigures]) -> dict[str, Any]:
    """Per epoch, the speedups of the rounds' pooled mean times, and over every epoch after the first."""

    def pooled(runs: list[RunFigures], epochs: set[int], key: str) -> float:
        cells = [(e["steps"], e[key]) for f in runs for e in f.epochs if e["epoch"] in epochs]
        return sum(n * v for n, v in cells) / max(sum(n for n, _ in cells), 1)

    numbers = sorted({int(e["epoch"]) for f in slip for e in f.epochs})
    out: list[dict[str, float]] = []
    for epoch in numbers:
        steps = sum(int(e["steps"]) for e in slip[0].epochs if e["epoch"] == epoch)
        out.append({
            "epoch": epoch, "steps": steps,
            "speedup_step": round(pooled(base, {epoch}, "step_s") / pooled(slip, {epoch}, "step_s"), 3),
            "speedup_rollout": round(pooled(base, {epoch}, "rollout_s") / pooled(slip, {epoch}, "rollout_s"), 3),
            "accept_length": round(pooled(slip, {epoch}, "accept_length"), 3),
        })  # fmt: skip
    later = set(numbers[1:])
    if not later:
        return {"epochs": out}
    return {
        "epochs": out,
        "speedup_step_later_epochs": round(pooled(base, later, "step_s") / pooled(slip, later, "step_s"), 3),
        "speedup_rollout_later_epochs": round(
            pooled(base, later, "rollout_s") / pooled(slip, later, "rollout_s"), 3
        ),
    }


def _taking_turns(
    train: TrainFn, order: list[tuple[str, bool]], dirs: dict[str, Path], *, baton: Path
) -> dict[str, RunFigures]:
    """A round's two runs started together, taking turns step by step through the file `baton`, the
    first of `order` first; each run's figures by name."""
    baton.write_text(order[0][0])  # the round's first run starts; then they alternate
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = {
            name: pool.submit(_timed_turns, train, dirs[name], baseline, f"{baton}:{name}:{other}")
            for (name, baseline), (other, _) in zip(order, order[::-1], strict=True)
        }
        return {name: running[name].result() for name, _ in order}


def _timed(
    train: TrainFn, run_dir: Path, baseline: bool, turns: str | None, label: Callable[[int], str | None]
) -> RunFigures:
    """One run, its wall time and the peak of its processes' summed Pss (those `label` names)."""
    started = time.monotonic()
    with _sampling(MemorySampler(label=label)) as memory:
        summary = train(run_dir, baseline, turns)
    return run_figures(summary, time.monotonic() - started, run_dir=run_dir, memory=memory)


def _timed_turns(train: TrainFn, run_dir: Path, baseline: bool, turns: str) -> RunFigures:
    """`_timed` for a run that takes turns with another: only its own processes are sampled, and however
    it ends, the other run stops waiting for it."""
    label = lambda pid: _process_label(pid, isolated=True) if _run_dir_of(pid) == str(run_dir) else None  # noqa: E731
    try:
        return _timed(train, run_dir, baseline, turns, label)
    finally:
        Turns.parse(turns).done()  # the child said so already, unless it died before it could


def _run_dir_of(pid: int) -> str | None:
    """The --run-dir of the `slipstream train` child of this process that `pid` is or descends from."""
    while (parent := parent_pid(pid)) is not None and parent != os.getpid():
        pid = parent
    if parent is None:
        return None
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    return argv[argv.index("--run-dir") + 1] if "--run-dir" in argv[:-1] else None


@contextlib.contextmanager
def _sampling(sampler: MemorySampler, every_s: float = 1.0) -> Iterator[MemorySampler]:
    """Sample `sampler` from a daemon thread every `every_s` while the body runs (`MemorySampler`: the cheap
    statm where no process grew enough for a new peak, smaps_rollup where one did; costs in
    docs/benchmarks.md)."""
    done = threading.Event()

    def loop() -> None:
        while not done.wait(every_s):
            sampler.sample()

    thread = threading.Thread(target=loop, name="memory-sampler", daemon=True)
    thread.start()
    try:
        yield sampler
    finally:
        done.set()
        thread.join()


def _process_label(pid: int, *, isolated: bool = False) -> str | None:
    """ "role:rank" for an actor process (from its command line); "coordinator" for the process running the
    loop: this one, or with `isolated` the `slipstream train` child (this one is then not counted: None);
    else "other"."""
    if pid == os.getpid():
        return None if isolated else "coordinator"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "other"
    if "--actor" in argv and "--rank" in argv:
        module = argv[argv.index("--actor") + 1].partition(":")[0].rpartition(".")[2]
        return f"{module}:{argv[argv.index('--rank') + 1]}"
    if isolated and "train" in argv and parent_pid(pid) == os.getpid():
        return "coordinator"
    return "other"  # reward workers, multiprocessing's resource tracker


def run_figures(
    summary: dict[str, Any],
    wall_s: float,
    *,
    run_dir: Path | None = None,
    memory: MemorySampler | None = None,
) -> RunFigures:
    """The run's figures from its summary; with `run_dir`, also its actors' peak memory (`peak_rss`);
    with `memory`, the sampled peak of the processes' summed Pss."""
    steps = summary["steps"]
    if not steps:
        raise ValueError(f"{summary.get('run_dir')}: the run recorded no steps")
    mean = lambda key: round(statistics.fmean(s[key] for s in steps), 3)  # noqa: E731
    tokens = sum(s["tokens"] for s in steps)
    rollout_s = sum(s["rollout_s"] for s in steps)
    idle = sum(s["idle_device_s"] for s in steps)
    reclaimed = sum(s["reclaimed_s"] for s in steps)
    peaks = peak_rss(run_dir) if run_dir is not None else {}
    inbound = coordinator_inbound(run_dir) if run_dir is not None else []
    by_batch: dict[str, list[float]] = {}
    for s in steps:
        for bucket, (seconds, committed) in (s.get("decode_by_batch") or {}).items():
            cell = by_batch.setdefault(bucket, [0.0, 0])
            cell[0] = round(cell[0] + seconds, 3)
            cell[1] += int(committed)
    accepts: dict[str, list[float]] = {}
    for s in steps:
        for bucket, accept in (s.get("accept_by_batch") or {}).items():
            accepts.setdefault(bucket, []).append(float(accept))
    return RunFigures(
        epochs=epoch_figures(steps, summary.get("config") or {}),
        arm_table=pool_arm_tables(steps),
        wall_s=round(wall_s, 1),
        step_s=mean("step_s"),
        rollout_s=mean("rollout_s"),
        reward_s=mean("reward_s"),
        learn_s=mean("learn_s"),
        sync_s=mean("sync_s"),
        step_s_each=[s["step_s"] for s in steps],
        rollout_tokens=tokens,
        tokens_per_s=round(tokens / rollout_s, 1) if rollout_s > 0 else 0.0,
        accept_length=round(sum(s["accept_length"] * s["tokens"] for s in steps) / max(tokens, 1), 3),
        step0_accept_by_batch=dict(steps[0].get("accept_by_batch", {})),
        decode_by_batch=by_batch,
        accept_by_batch={b: round(sum(v) / len(v), 3) for b, v in accepts.items()},
        turns_mean=round(sum(s.get("turns_mean", 0.0) for s in steps) / len(steps), 3),
        turns_max=max((int(s.get("turns_max", 0)) for s in steps), default=0),
        **inbound_means(inbound),
        idle_device_s=round(idle, 2),
        reclaimed_s=round(reclaimed, 2),
        reclaimed_share=round(reclaimed / idle, 3) if idle > 0 else 0.0,
        first_reward=summary.get("first_reward"),
        last_reward=summary.get("last_reward"),
        invalid=int(summary.get("invalid", 0)),
        peak_rss_mb=peaks,
        peak_rss_mb_total=round(sum(peaks.values()), 1),
        peak_gpu_mb=peak_rss(run_dir, "peak_gpu_mb") if run_dir is not None else {},
        peak_pss_mb_total=round(memory.peak_mb, 1) if memory is not None else 0.0,
        peak_pss_mb=memory.at_peak_mb if memory is not None else {},
    )


def epoch_figures(steps: list[dict[str, Any]], config: dict[str, Any]) -> list[dict[str, float]]:
    """Per epoch of the dataset: its steps' mean step and rollout seconds and token-weighted accept length.
    A step's epoch is its first prompt's (`prompts_per_step` x step // `dataset_size`)."""
    per_step, size = int(config.get("prompts_per_step", 1)), int(config.get("dataset_size", 0))
    by_epoch: dict[int, list[dict[str, Any]]] = {}
    for s in steps:
        by_epoch.setdefault(s["step"] * per_step // size if size > 0 else 0, []).append(s)
    out = []
    for epoch, group in sorted(by_epoch.items()):
        tokens = sum(s["tokens"] for s in group)
        out.append({
            "epoch": epoch, "steps": len(group),
            "step_s": round(statistics.fmean(s["step_s"] for s in group), 3),
            "rollout_s": round(statistics.fmean(s["rollout_s"] for s in group), 3),
            "accept_length": round(sum(s["accept_length"] * s["tokens"] for s in group) / max(tokens, 1), 3),
        })  # fmt: skip
    return out


def coordinator_inbound(run_dir: Path) -> list[dict[str, Any]]:
    """The coordinator's `inbound` events but the first (start-up, before step 0): one a step."""
    path = run_dir / "logs" / "coordinator.jsonl"
    if not path.is_file():
        return []
    events = [e for e in map(json.loads, path.read_text().splitlines()) if e.get("event") == "inbound"]
    return events[1:]


def inbound_means(events: list[dict[str, Any]]) -> dict[str, Any]:
    """`RunFigures`' inbound fields: means over the steps' events."""
    if not events:
        return {}
    by_kind: dict[str, list[float]] = {}
    for e in events:
        for kind, (messages, nbytes) in e["kinds"].items():
            cell = by_kind.setdefault(kind, [0.0, 0.0])
            cell[0] += messages / len(events)
            cell[1] += nbytes / len(events)
    return {
        "inbound_messages": round(sum(e["messages"] for e in events) / len(events), 1),
        "inbound_bytes": round(sum(e["bytes"] for e in events) / len(events), 1),
        "inbound_by_kind": {k: [round(m, 1), round(b, 1)] for k, (m, b) in sorted(by_kind.items())},
    }


def peak_rss(run_dir: Path, field: str = "peak_rss_mb") -> dict[str, float]:
    """Peak resident MiB per actor ("role:rank"), read from the `stopped` events in RUN/logs/*.jsonl; an
    actor restarted after a crash logs one per clean stop, and the highest counts. A killed one logs none.
    `field` "peak_gpu_mb": the GPU memory its allocator held at most (actors that used CUDA)."""
    peaks: dict[str, float] = {}
    for path in sorted((run_dir / "logs").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if '"stopped"' not in line:  # cheap filter before parsing: logs run to many lines
                continue
            event = json.loads(line)
            if event.get("event") == "stopped" and field in event:
                name = f"{event.get('role')}:{event.get('rank')}"
                peaks[name] = max(peaks.get(name, 0.0), float(event[field]))
    return peaks


def learner_cost(run_dir: Path, *, steps: int, threads: int) -> LearnerCost:
    """Forward pass vs training step on the run's recorded samples (prompt + response ids), interleaved."""
    config = json.loads((run_dir / "config.json").read_text())
    learner = config.get("learner", {})
    loss = msgspec.convert(learner.get("loss", {}), LossConfig)
    trainer = PolicyTrainer(
        load_model(hub.resolve(config["model"])),
        optim=msgspec.convert(learner.get("optim", {}), OptimConfig),
        loss=loss,
    )
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    forward_s, train_s, response, sequence = [], [], [], []
    try:
        for step in range(steps):
            samples = _policy_samples(run_dir, step, config, loss)
            started = time.perf_counter()
            logprobs = trainer.logprobs(samples)  # the forward pass over the same tokens
            forward_s.append(time.perf_counter() - started)
            samples = [
                dataclasses.replace(s, behaviour_logprobs=lp.tolist())
                for s, lp in zip(samples, logprobs, strict=True)
            ]
            started = time.perf_counter()
            trainer.step(samples)
            train_s.append(time.perf_counter() - started)
            response.append(sum(len(s.response_ids) for s in samples))
            sequence.append(sum(len(s.prompt_ids) + len(s.response_ids) for s in samples))
    finally:
        torch.set_num_threads(previous)
    ratios = [t / f for t, f in zip(train_s, forward_s, strict=True)]
    return LearnerCost(
        threads=threads,
        steps=steps,
        response_tokens=round(statistics.fmean(response)),
        sequence_tokens=round(statistics.fmean(sequence)),
        forward_s=[round(x, 3) for x in forward_s],
        train_s=[round(x, 3) for x in train_s],
        cost_x_each=[round(x, 3) for x in ratios],
        cost_x=round(statistics.median(ratios), 3),
    )


def _rows(run_dir: Path, step: int) -> list[dict[str, Any]]:
    """The step's samples record (every learner rank's share), ordered by (group, sample)."""
    paths = samples_record.sample_files(run_dir, step)
    rows = [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: (r["group_id"], r["sample_index"]))


def _samples(run_dir: Path, step: int) -> list[list[int]]:
    return [r["token_ids"] for r in _rows(run_dir, step)]


def _policy_samples(run_dir: Path, step: int, config: dict[str, Any], loss: LossConfig) -> list[PolicySample]:
    """The step's recorded responses as the learner would train on them (its own advantages and masks);
    behaviour log-probs are placeholders, replaced by the measured forward pass's."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for r in _rows(run_dir, step):
        groups.setdefault(r["group_id"], []).append(r)
    scored = [
        ScoredGroup(
            step=step,
            group_id=g,
            prompt_ids=torch.tensor(members[0]["prompt_ids"]),
            response_ids=[torch.tensor(r["token_ids"], dtype=torch.int64) for r in members],
            behaviour_logprobs=[torch.zeros(len(r["token_ids"])) for r in members],
            rewards=[r["reward"] for r in members],
            temperature=config.get("temperature", 1.0),
            top_p=config.get("top_p", 1.0),
            top_k=config.get("top_k", 0),
            policy_version=step,
        )
        for g, members in groups.items()
    ]
    return policy_samples(scored, loss)[0]


def render(result: E2EResult) -> str:
    lines = [f"{'':>11} {'step s':>7} {'roll':>6} {'reward':>6} {'learn':>6} {'sync':>5} {'tok/s':>6} "
             f"{'accept':>6} {'idle s':>6} {'reclaim':>7} {'reward first→last':>18}"]  # fmt: skip
    for name in ("slipstream", "baseline"):
        f: RunFigures = getattr(result, name)
        lines.append(
            f"{name:>11} {f.step_s:>7.1f} {f.rollout_s:>6.1f} {f.reward_s:>6.2f} {f.learn_s:>6.1f} "
            f"{f.sync_s:>5.2f} {f.tokens_per_s:>6.1f} {f.accept_length:>6.2f} {f.idle_device_s:>6.1f} "
            f"{f.reclaimed_s:>7.1f} {f.first_reward!s:>8} → {f.last_reward!s:<8}"
        )
    for name in ("slipstream", "baseline"):
        f = getattr(result, name)
        if f.peak_rss_mb:
            each = ", ".join(f"{actor} {mb:.0f}" for actor, mb in sorted(f.peak_rss_mb.items()))
            lines.append(
                f"{name} peak RSS MiB: {each}; sum {f.peak_rss_mb_total:.0f} (of per-process peaks: an "
                "upper bound of the simultaneous peak)"
            )
        if f.peak_gpu_mb:
            each = ", ".join(f"{actor} {mb:.0f}" for actor, mb in sorted(f.peak_gpu_mb.items()))
            lines.append(f"{name} peak GPU MiB (allocator): {each}")
        if f.peak_pss_mb_total:
            each = ", ".join(f"{label} {mb:.0f}" for label, mb in f.peak_pss_mb.items())
            lines.append(f"{name} peak summed PSS MiB {f.peak_pss_mb_total:.0f}, held at once: {each}")
    if result.slipstream.step0_accept_by_batch:
        each = ", ".join(f"batch {b}: {a:.2f}" for b, a in result.slipstream.step0_accept_by_batch.items())
        lines.append(f"step 0 accept length where it speculated: {each}")
    for e in result.epochs if len(result.epochs) > 1 else ():
        lines.append(f"epoch {e['epoch']}: speedup step {e['speedup_step']}x, rollout {e['speedup_rollout']}x, "
                     f"accept length {e['accept_length']}")  # fmt: skip
    if result.speedup_step_later_epochs:
        lines.append(f"epochs after the first: speedup step {result.speedup_step_later_epochs}x, rollout "
                     f"{result.speedup_rollout_later_epochs}x")  # fmt: skip
    cost = result.learner
    lines.append(
        f"speedup: step {result.speedup_step}x, rollout {result.speedup_rollout}x; identical samples in "
        f"{result.identical_sample_steps}/{result.steps} steps; "
        + (
            f"learner cost per token {cost.cost_x}x a forward pass ({cost.threads} threads, "
            f"{cost.sequence_tokens} tokens per batch, {cost.steps} batches)"
            if cost
            else "learner cost not measured"
        )
    )
    return "\n".join(lines)
