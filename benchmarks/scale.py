"""Scale benchmark of the RL control plane: a step of the size users run through the real message paths.

    slipstream bench scale --json                                   # 512 prompts x 16 samples x 2048 tokens
    slipstream bench scale --fractions 1/8,1/4 --prompts 256 --json

Per fraction of `prompts` (default 1/8, 1/4, 1/2, 1; samples and tokens stay), a fresh run opens as
`slipstream train` opens one (rl/run.py `Run`: supervisor, coordinator, real processes and sockets), and
its steps go through the loop's own verbs, `batch` → `roll_out_and_score` → `learn`, so whatever path the
loop takes is what is measured, now and after bulk data leaves the head. Two roles are stand-ins:
- rollouts (`ReplayRollout`, benchmarks/replay_rollout.py): they answer each GenerateRequest at once
  with completions of exactly `tokens` tokens, windows of recorded text (this package's own source,
  tokenized), every other one ending in an <answer> tag, plus one IterationStats per decode iteration a
  real rollout would send;
- the learner runs with `hold_only` (actors/learner.py): samples are received from the stand-ins, held,
  receipted, assembled, checked and recorded, but no model is loaded and nothing trains; it says when it
  held the step's last sample.
The verifier is the real one with a real, cheap scorer (`answer_format`). Each row is the last step's:
coordinator CPU (user+sys of this process, /proc), bytes and messages in and out of its socket, the step's
wall time, and the seconds from the last completion leaving a stand-in to the learner holding every group.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import msgspec

from slipstream.actors.learner import LearnerActor
from slipstream.actors.rollout import RolloutActor
from slipstream.benchmarks.replay_rollout import RECORD_DIR, ReplayRollout
from slipstream.engine import hub
from slipstream.engine.tokenizer import Tokenizer
from slipstream.protocols import samples_record
from slipstream.rl.recovery import ActorDiedError
from slipstream.rl.run import Run
from slipstream.rl.run_config import TrainConfig
from slipstream.runtime.cluster import Cluster
from slipstream.runtime.host import actor_path
from slipstream.runtime.process import parent_pid
from slipstream.runtime.spec import ActorSpec

__all__ = [
    "DEFAULT_FRACTIONS",
    "ScaleResult",
    "ScaleRow",
    "parse_fractions",
    "render",
    "run",
]

DEFAULT_FRACTIONS = (Fraction(1, 8), Fraction(1, 4), Fraction(1, 2), Fraction(1))
REWARD = "slipstream.tasks.rewards:answer_format"  # real and cheap: the bench times the plane, not scoring
ANSWER = "\n<answer>7</answer>"  # what every other completion ends in: answer_format scores it 1.0
PAYLOAD_BYTES = 12  # per token on the wire: an int64 id and a float32 log-prob
# Host memory a step may need, in payloads: the coordinator's completions and groups, the learner's copies,
# what queues between them, the samples file's lines; with margin.
MEMORY_FACTOR = 8
CORPUS_TOKENS = 1 << 16


class ScaleRun(Run):
    """The training run with stand-ins: `ReplayRollout` where the rollouts go, the learner `hold_only`; and
    a liveness limit of minutes, not seconds: the loop stalls for longer than `train`'s 3 s at these sizes
    (`loop_stall_max_s` says how long), and the bench measures the paths, not how they fail."""

    heartbeat_s = 10.0  # actors give a silent head 10 intervals
    missed_beats = 30

    def __init__(self, cfg: TrainConfig, run_dir: Path, *, corpus: list[int], answer_ids: list[int],
                 log: Any = None) -> None:  # fmt: skip
        super().__init__(cfg, run_dir, baseline=False, resume=False, log=log)
        self.corpus, self.answer_ids = corpus, answer_ids

    def check_memory(self, hosts: Any) -> None:
        """Nothing to check: the stand-in learner holds no model."""

    def plan_actors(self, hosts: Any, rendezvous: str) -> list[ActorSpec]:
        specs = []
        for spec in super().plan_actors(hosts, rendezvous):
            config = spec.config
            if spec.actor == actor_path(RolloutActor):
                assert isinstance(config, RolloutActor.Config)
                stand_in = ReplayRollout.Config(
                    tokens=self.cfg.max_tokens, corpus=self.corpus, answer_ids=self.answer_ids,
                    max_batch=config.max_batch, model=config.model,
                )  # fmt: skip
                spec = msgspec.structs.replace(spec, actor=actor_path(ReplayRollout), config=stand_in)
            elif spec.actor == actor_path(LearnerActor):
                assert isinstance(config, LearnerActor.Config)
                held = msgspec.structs.replace(config, hold_only=True, warm_up=False)
                spec = msgspec.structs.replace(spec, config=held)
            specs.append(spec)
        return specs


class ScaleRow(msgspec.Struct, kw_only=True):
    """One size: the last step's figures (`step_s_all`: every step's wall seconds)."""

    fraction: float
    prompts: int
    samples: int
    tokens: int
    payload_mb: float  # token ids + log-probs of the step's completions (12 bytes a token)
    skipped: str = ""  # why this size did not run (host memory); every figure below is 0 then
    failed: str = ""  # why a step did not finish (an actor taken as dead, past --step-timeout); "" if all did
    # The coordinator's warnings and errors in the step, by event (a dropped send, backpressure, a death)
    warnings: dict[str, int] = {}
    # The longest the coordinator's event loop ran no task in the step: past 3 s `train`'s supervisor takes
    # every actor as dead (missed heartbeats), past 10 s the actors take the head as gone.
    loop_stall_max_s: float = 0.0
    step_s: float = 0.0  # batch → roll out and score → learner holds every group (the loop's verbs)
    coordinator_cpu_s: float = 0.0  # user + sys of the coordinator's process (this one) over the step
    inbound_messages: int = 0  # what the coordinator's socket received over the step
    inbound_bytes: int = 0
    outbound_messages: int = 0  # what it sent over the step
    outbound_bytes: int = 0
    inbound_by_kind: dict[str, list[int]] = {}  # kind -> [messages, bytes]
    outbound_by_kind: dict[str, list[int]] = {}
    first_to_last_completion_s: float = 0.0  # step start -> the last completion left a stand-in rollout
    last_completion_to_held_s: float = 0.0  # -> the learner holds every group (its step is complete)
    marks: dict[str, float] = {}  # the loop's own phase marks (rollout, reward, learn)
    learner_groups: int = 0  # what the learner held: must be the step's prompts
    learner_samples: int = 0
    learner_tokens: int = 0
    complete: bool = False  # every group, sample and token reached the learner
    reward_mean: float = 0.0  # over the step's scored samples (~0.5: every other one ends in a tagged answer)
    actor_cpu_s: dict[str, float] = {}  # each actor process's user + sys over the step (not its children)
    peak_rss_mb: dict[str, float] = {}  # VmHWM per process ("coordinator", actors with their children)
    step_s_all: list[float] = []


class ScaleResult(msgspec.Struct, kw_only=True):
    prompts: int  # the full size (fraction 1)
    samples: int
    tokens: int
    rollouts: int
    verifier_workers: int
    steps: int  # steps per size; the rows hold the last
    reward: str
    cores: int
    rows: list[ScaleRow]


def parse_fractions(text: str) -> list[Fraction]:
    """ "1/8,1/4,0.5,1" → fractions in (0, 1]; a clear error naming --fractions otherwise."""
    try:
        values = [Fraction(part.strip()) for part in text.split(",") if part.strip()]
    except (ValueError, ZeroDivisionError):
        raise ValueError(
            f"--fractions must be comma-separated fractions such as 1/8,1/2,1, got {text!r}"
        ) from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise ValueError(f"--fractions must lie in (0, 1], got {text!r}")
    return values


def run(
    *,
    prompts: int = 512,
    samples: int = 16,
    tokens: int = 2048,
    fractions: list[Fraction] | tuple[Fraction, ...] = DEFAULT_FRACTIONS,
    steps: int = 2,
    rollouts: int = 2,
    verifier_workers: int = 1,
    step_timeout_s: float = 600.0,
    run_dir: Path | None = None,
    say: Any = None,
) -> ScaleResult:
    """Each fraction of `prompts` x `samples` x `tokens` as its own run of `steps` steps, smallest first;
    a size the host's available memory cannot hold is skipped, saying so. A step not done within
    `step_timeout_s` ends its size (`failed`; the larger sizes still run). `run_dir`: keep the runs there
    (default: a temporary directory, removed)."""
    say = say or (lambda message: print(message, file=sys.stderr, flush=True))
    if min(prompts, samples, tokens, steps, rollouts, verifier_workers) < 1 or samples < 2:
        raise ValueError("prompts, tokens, steps, rollouts and verifier_workers must be >= 1, samples >= 2")
    tokenizer = Tokenizer.from_dir(hub.resolve(TrainConfig().model))
    corpus = recorded_corpus(tokenizer)
    answer_ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    rows = []
    with tempfile.TemporaryDirectory(prefix="slipstream-bench-scale-") as tmp:
        root = run_dir or Path(tmp)
        for fraction in sorted(fractions):
            size = max(1, round(prompts * fraction))
            row = ScaleRow(fraction=float(fraction), prompts=size, samples=samples, tokens=tokens,
                           payload_mb=round(size * samples * tokens * PAYLOAD_BYTES / 2**20, 1))  # fmt: skip
            if why := _unaffordable(size * samples * tokens * PAYLOAD_BYTES):
                say(f"bench scale: {size} x {samples} x {tokens} skipped: {why}")
                row.skipped = why
            else:
                say(f"bench scale: {size} prompts x {samples} samples x {tokens} tokens …")
                cfg = _config(size, samples, tokens, steps, rollouts, verifier_workers)
                where = root / f"prompts-{size}"
                _measure_size(cfg, where, corpus, answer_ids, row, step_timeout_s)
                if row.failed:
                    say(f"bench scale: {size} prompts: {row.failed}")
            rows.append(row)
    return ScaleResult(
        prompts=prompts, samples=samples, tokens=tokens, rollouts=rollouts, verifier_workers=verifier_workers,
        steps=steps, reward=REWARD, cores=len(os.sched_getaffinity(0)), rows=rows,
    )  # fmt: skip


def _config(prompts: int, samples: int, tokens: int, steps: int, rollouts: int, workers: int) -> TrainConfig:
    """The demo's task and tokenizer at this size; no drafter (stand-ins decode nothing to draft for)."""
    from slipstream.rl.run_config import load_config

    return load_config(None, [
        f"prompts_per_step={prompts}", f"group_size={samples}", f"max_tokens={tokens}", f"steps={steps}",
        "task=chain_sum", f"reward={REWARD}", "drafter.enabled=false", f"rollout.devices={rollouts}",
        f"verifier.workers={workers}", "checkpoint_every=0", "checkpoint_minutes=0", "checkpoint_hf=false",
        f"dataset_size={max(prompts * steps, 64)}",
    ])  # fmt: skip


def recorded_corpus(tokenizer: Tokenizer) -> list[int]:
    """`CORPUS_TOKENS` token ids of recorded text: this package's own Python source (prose and code, ~4
    characters a token, as responses are; uniform random ids decode to ~7). Files holding an answer tag are
    left out, so only the planted tail scores."""
    root = Path(__file__).resolve().parents[1]
    ids: list[int] = []
    for path in sorted(root.glob("*/*.py")):
        text = path.read_text(errors="replace")
        if "<answer>" in text:
            continue
        ids += tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= CORPUS_TOKENS:
            break
    stops = set(tokenizer.stop_ids)
    return [i for i in ids if i not in stops][:CORPUS_TOKENS]


def _measure_size(
    cfg: TrainConfig, run_dir: Path, corpus: list[int], answer_ids: list[int], row: ScaleRow, timeout_s: float
) -> None:
    import uvloop

    from slipstream.runtime import logs

    run_dir.mkdir(parents=True, exist_ok=True)
    log = logs.configure(role="coordinator", run_dir=run_dir)  # the coordinator logs as in `train`
    _reset_peak()
    uvloop.run(_steps(ScaleRun(cfg, run_dir, corpus=corpus, answer_ids=answer_ids, log=log), row, timeout_s))


async def _steps(run: ScaleRun, row: ScaleRow, timeout_s: float) -> None:
    """Opens the run, takes its steps (the row keeps the last), reads every process's peak, closes."""
    cfg, run_dir = run.cfg, run.run_dir
    log_file = run_dir / "logs" / "coordinator.jsonl"
    try:
        await run.open(Cluster(), keys_dir=None, join_timeout_s=60.0)
        sup = run.sup
        assert sup is not None
        for step in range(cfg.steps):
            # Inbound: the coordinator starts its count afresh as the step begins (`inbound`, logged).
            sup.outbound.take()
            names, logged = sup.alive(), log_file.stat().st_size
            actors_before = {n: _cpu_s(sup.pid(n)) for n in names}
            stalls = asyncio.create_task(_longest_stall())
            cpu_before, began = _cpu_s(os.getpid()), time.monotonic()
            work = run.batch(step)
            try:
                await asyncio.wait_for(_step(run, work), timeout_s)
            except (TimeoutError, ActorDiedError) as exc:
                row.failed = f"step {step}: {str(exc) or f'not done within {timeout_s:g} s'}"
            ended, cpu_after = time.monotonic(), _cpu_s(os.getpid())
            stalls.cancel()
            row.loop_stall_max_s = round(await stalls, 3)
            row.warnings = _warnings(log_file, logged)
            if row.failed:  # the figures stay the last finished step's, if any; the size is not complete
                row.complete = False
                break
            _record_traffic(row, sup.traffic.take(), sup.outbound.take())
            row.step_s_all.append(round(ended - began, 3))
            row.step_s = round(ended - began, 3)
            row.coordinator_cpu_s = round(cpu_after - cpu_before, 2)
            row.actor_cpu_s = {
                n: round(_cpu_s(sup.pid(n)) - before, 2) for n, before in actors_before.items()
            }
            _record_held(row, cfg, work, began=began, last_sent=_last_sent(run_dir, step))
            # Off the clock: the step's samples file (~0.5 GB at 512 x 16 x 2048) is not kept.
            for path in samples_record.sample_files(run_dir, step):
                path.unlink()
        row.peak_rss_mb = {"coordinator": _peak_mb(os.getpid(), children=False)}
        row.peak_rss_mb |= {n: _peak_mb(sup.pid(n), children=True) for n in sup.alive()}
    finally:
        await run.close()


def _record_traffic(row: ScaleRow, inbound: dict[str, list[int]], outbound: dict[str, list[int]]) -> None:
    """The step's messages and bytes into and out of the coordinator (each kind's [messages, bytes])."""
    row.inbound_by_kind, row.outbound_by_kind = dict(sorted(inbound.items())), dict(sorted(outbound.items()))
    row.inbound_messages, row.inbound_bytes = (sum(c[i] for c in inbound.values()) for i in (0, 1))
    row.outbound_messages, row.outbound_bytes = (sum(c[i] for c in outbound.values()) for i in (0, 1))


def _record_held(row: ScaleRow, cfg: TrainConfig, work: Any, *, began: float, last_sent: float) -> None:
    """What the learner held of the step and when, its rewards, and whether every group reached it."""
    held = [s.metrics for s in work.stats]
    row.first_to_last_completion_s = round(last_sent - began, 3)
    row.last_completion_to_held_s = round(max(m["held_at"] for m in held) - last_sent, 3)
    row.marks = {k: round(v, 3) for k, v in work.marks.items()}
    scored = [r for g in work.groups for r in g.rewards if r is not None]
    row.reward_mean = round(sum(scored) / max(len(scored), 1), 4)
    row.learner_groups = int(sum(m["groups"] for m in held))
    row.learner_samples = int(sum(m["samples"] for m in held))
    row.learner_tokens = sum(s.tokens for s in work.stats)
    want = cfg.prompts_per_step * cfg.group_size
    row.complete = (row.learner_groups, row.learner_samples, row.learner_tokens) == (
        cfg.prompts_per_step,
        want,
        want * cfg.max_tokens,
    )


async def _step(run: ScaleRun, work: Any) -> None:
    """The measured verbs of a step: the loop's own."""
    await run.roll_out_and_score(work, lambda: None)
    await run.learn(work)


def _warnings(log_file: Path, offset: int) -> dict[str, int]:
    """The coordinator's warning and error events logged after byte `offset`, counted by event."""
    counts: dict[str, int] = {}
    with log_file.open("rb") as f:
        f.seek(offset)
        for line in f:
            event = json.loads(line)
            if event.get("level") in ("warning", "error"):
                counts[event["event"]] = counts.get(event["event"], 0) + 1
    return dict(sorted(counts.items()))


async def _longest_stall(period_s: float = 0.05) -> float:
    """The longest this event loop let a `period_s` sleep overrun, until cancelled (then returned)."""
    longest = 0.0
    try:
        while True:
            began = time.monotonic()
            await asyncio.sleep(period_s)
            longest = max(longest, time.monotonic() - began - period_s)
    except asyncio.CancelledError:
        return longest


def _last_sent(run_dir: Path, step: int) -> float:
    """When the step's last completion left a stand-in rollout (time.monotonic(): one clock on one host)."""
    sent = []
    for path in (run_dir / RECORD_DIR).glob("rollout-*.jsonl"):
        sent += [
            r["last_sent"]
            for line in path.read_text().splitlines()
            if (r := json.loads(line))["step"] == step
        ]
    if not sent:
        raise RuntimeError(f"no stand-in rollout recorded step {step} in {run_dir / RECORD_DIR}")
    return max(sent)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid`, every thread (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _peak_mb(pid: int, *, children: bool) -> float:
    """VmHWM of `pid` in MiB, plus its children's (a verifier's workers) with `children`: their sum bounds
    what they held at once."""
    pids = [pid, *(_children(pid) if children else [])]
    total = 0
    for p in pids:
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue  # gone meanwhile
        total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
    return round(total / 1024, 1)


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (from /proc/*/stat's parent ids)."""
    parent = {int(e.name): parent_pid(int(e.name)) for e in Path("/proc").iterdir() if e.name.isdigit()}
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        found += kids
        frontier = kids
    return found


def _reset_peak() -> None:
    """Starts this process's VmHWM afresh (Linux: 5 to clear_refs), so a size reports its own peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # an older kernel: the peak then spans the sizes before (smallest first, so still an upper bound)


def _unaffordable(payload: int) -> str:
    """Why the host cannot hold a step of `payload` bytes ("" if it can): MemAvailable against
    MEMORY_FACTOR payloads plus 2 GiB for the processes themselves."""
    need = MEMORY_FACTOR * payload + (2 << 30)
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return ""
    if need > available:
        return f"needs ~{need / 2**30:.1f} GiB, the host has {available / 2**30:.1f} GiB available"
    return ""


def render(result: ScaleResult) -> str:
    """A table, one line per size."""
    head = f"{'prompts':>8} {'payload MB':>10} {'step s':>7} {'coord CPU s':>11} {'in MB':>8} {'out MB':>8} "
    head += f"{'in msgs':>8} {'out msgs':>8} {'last→held s':>11} {'complete':>8}"
    lines = [head]
    for r in result.rows:
        if r.skipped:
            lines.append(f"{r.prompts:>8} {r.payload_mb:>10} skipped: {r.skipped}")
            continue
        lines.append(
            f"{r.prompts:>8} {r.payload_mb:>10} {r.step_s:>7.2f} {r.coordinator_cpu_s:>11.2f} "
            f"{r.inbound_bytes / 2**20:>8.1f} {r.outbound_bytes / 2**20:>8.1f} {r.inbound_messages:>8} "
            f"{r.outbound_messages:>8} {r.last_completion_to_held_s:>11.3f} {r.complete!s:>8}"
        )
    return "\n".join(lines)
