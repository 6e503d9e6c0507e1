"""`slipstream bench soak`: a training run under random SIGKILLs of its actors, beside the same run without.

    slipstream bench soak --steps 30 --json              # a tiny random model, a kill every ~3 s
    slipstream bench soak --model smollm2-135m --kill-every 5 --kills 10 --seed 1 --json

A seeded RNG picks each victim among the rollout, verifier, drafter and learner actors; a thread SIGKILLs
it about every `kill_every_s` seconds, by the pid its log's "ready" event names, if that pid is a child of
this process. No actor is killed more often than `faults.max_restarts`, and kills stop when the last step
begins, so every kill is recovered within the run. Then the same config runs without kills, and the
samples are compared per (step, group, sample): reproducible mode makes them identical, up to a keyed near
tie that float rounding in another batch shape flips (`near_tie`). The default model is a tiny random
Llama with SmolLM2's tokenizer, built into the run directory (its answers are noise: a soak does not
mind). `run` takes the loop as a callable (benchmarks do not import cli/). `--nodes 2` runs the training as
`slipstream train` processes on two namespaced nodes instead, the agent and the coordinator killed too
(benchmarks/soak_nodes.py).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgspec

from slipstream.engine import hub
from slipstream.protocols import samples_record
from slipstream.runtime.fork_server import launcher_pid
from slipstream.runtime.transport import parse_actor_name

__all__ = [
    "OVERRIDES", "Kill", "LogTail", "RunOutcome", "SoakPlan", "SoakResult", "compare", "expected_keys", "metrics_records", "near_tie", "outcome",
    "render", "run", "tiny_model",
]  # fmt: skip

Key = tuple[int, int, int]  # (step, group, sample)
Sample = tuple[list[int], list[float]]  # its tokens and log-probs
TrainFn = Callable[[Path], dict[str, Any]]  # run directory -> the run's summary; the loop runs in-process
VICTIMS = ("rollout", "verifier", "drafter", "learner")
NOT_KILLED: dict[str, str] = {}
WINDOWS = {
    "rollout": "any time",
    "verifier": "any time",
    "drafter": "any time",
    "learner": "any time (it restarts from its newest checkpoint and replays the steps after it)",
    "last step": "no kills (one there could go unrecovered)",
}
# Applied over the config before the command line's own overrides: a small fast run, and a restart budget
# and backoff a kill every few seconds fits in.
OVERRIDES = (
    "prompts_per_step=4",
    "max_tokens=48",
    "checkpoint_every=0",
    "drafter.batch_tokens=64",
    "drafter.init_from=",  # the demo's shipped head fits SmolLM2, not the tiny model
    "learner.threads=1",
    "faults.max_restarts=8",
    "faults.restart_backoff_s=0.1",
)


class SoakPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What the soak needs to know of the run's config, and how it kills."""

    actors: list[str]  # every actor of the run, "role:rank"
    steps: int
    prompts_per_step: int
    group_size: int
    max_tokens: int  # new tokens per response at most (the workload's size)
    max_restarts: int  # faults.max_restarts: no actor is killed more often
    kill_every_s: float = 3.0  # mean seconds between kills (uniform in [0.5, 1.5] of it)
    kills: int = 0  # the most kills (0 = as many as the run and the budget allow)
    seed: int = 0  # the victims' RNG


class Kill(msgspec.Struct, frozen=True, kw_only=True):
    at_s: float  # since the run started
    actor: str
    pid: int
    step: int  # steps completed when it was killed


class RunOutcome(msgspec.Struct, frozen=True, kw_only=True):
    run_dir: str
    wall_s: float
    steps_completed: int
    expected: int  # samples the configured steps deal: steps x prompts_per_step x group_size
    recorded: int  # rows in samples/step-N.jsonl
    lost: int  # expected (step, group, sample) with no row
    error: str = ""  # why the run ended early ("" = it finished)


class SoakResult(msgspec.Struct, frozen=True, kw_only=True):
    steps: int
    seed: int
    kill_every_s: float
    max_restarts: int  # per actor per run
    victims: list[str]  # roles killed
    not_killed: dict[str, str]  # role -> why not
    kill_windows: dict[str, str]  # when each role may be killed, and why
    kills: dict[str, int]  # by role
    kill_log: list[Kill]
    restarts: dict[str, int]  # by role, from the run's metrics
    requeued: int  # samples and score requests dealt again (metrics)
    duplicates: int  # results dropped as seen already (metrics)
    differing: int  # (step, group, sample) whose tokens differ from the run without kills, or missing
    near_ties: int  # of those, diverged after >= 1 shared token whose log-probs agree within NEAR_TIE_LOGP
    soak: RunOutcome
    clean: RunOutcome
    ok: bool  # both finished, nothing lost, recorded == expected, only near ties differ, kills restarted


def tiny_model(path: Path) -> Path:
    """A tiny random Llama (2 layers, hidden 64) with SmolLM2's tokenizer and chat template, at `path`;
    reused if it is there."""
    if (path / "model.safetensors").is_file():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    smol = hub.pull("smollm2-135m")
    vocab = json.loads((smol / "config.json").read_text())["vocab_size"]
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.15, bos_token_id=None,
        eos_token_id=2, tie_word_embeddings=True,  # as SmolLM2
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(smol / name, path / name)
    return path


def run(train: TrainFn, root: Path, plan: SoakPlan) -> SoakResult:
    """The run with kills under root/soak, then without under root/clean; the comparison."""
    for name in ("soak", "clean"):
        if (root / name).exists():  # the loop appends to metrics.jsonl: an old run's steps would count
            raise ValueError(f"{root / name} exists: a soak needs fresh run directories (--run-dir)")
    stop = threading.Event()
    kills: list[Kill] = []
    killer = threading.Thread(target=_kill_loop, args=(plan, root / "soak", stop, kills), daemon=True)
    killer.start()
    try:
        soak, soak_samples = _outcome(train, root / "soak", plan)
    finally:
        stop.set()
        killer.join()
    clean, clean_samples = _outcome(train, root / "clean", plan)
    steps = metrics_records(root / "soak")
    restarts = Counter(parse_actor_name(a)[0] for s in steps for a in s["restarts"])
    killed = Counter(parse_actor_name(k.actor)[0] for k in kills)
    differing, near_ties, _ = compare(expected_keys(plan), soak_samples, clean_samples)
    return SoakResult(
        steps=plan.steps,
        seed=plan.seed,
        kill_every_s=plan.kill_every_s,
        max_restarts=plan.max_restarts,
        victims=list(VICTIMS),
        not_killed=dict(NOT_KILLED),
        kill_windows=dict(WINDOWS),
        kills=dict(killed),
        kill_log=kills,
        restarts=dict(restarts),
        requeued=sum(s["requeued"] for s in steps),
        duplicates=sum(s["duplicates"] for s in steps),
        differing=differing,
        near_ties=near_ties,
        soak=soak,
        clean=clean,
        ok=all(not o.error and o.lost == 0 and o.recorded == o.expected for o in (soak, clean))
        and differing == near_ties
        and restarts == killed,
    )


def _outcome(train: TrainFn, run_dir: Path, plan: SoakPlan) -> tuple[RunOutcome, dict[Key, Sample]]:
    """One run, timed; an error ends it, and is reported rather than raised (what it left is compared)."""
    started = time.monotonic()
    error = ""
    try:
        train(run_dir)
    except Exception as exc:  # a soak reports how the run ended
        error = f"{type(exc).__name__}: {exc}"
    return outcome(plan, run_dir, time.monotonic() - started, error)


class _Shape(Protocol):
    steps: int
    prompts_per_step: int
    group_size: int


def outcome(plan: _Shape, run_dir: Path, wall_s: float, error: str) -> tuple[RunOutcome, dict[Key, Sample]]:
    """A finished run's outcome (`error`: why it ended early, "" if it did not) and its samples."""
    rows, samples = _samples(run_dir, plan.steps)
    expected = expected_keys(plan)
    result = RunOutcome(
        run_dir=str(run_dir),
        wall_s=round(wall_s, 1),
        steps_completed=len(metrics_records(run_dir)),
        expected=len(expected),
        recorded=rows,
        lost=sum(k not in samples for k in expected),
        error=error,
    )
    return result, samples


def expected_keys(plan: _Shape) -> list[Key]:
    """Every (step, group, sample) the run deals: step s holds groups s*P ... s*P + P - 1 (the data cursor)."""
    p = plan.prompts_per_step
    return [
        (s, g, i)
        for s in range(plan.steps)
        for g in range(s * p, (s + 1) * p)
        for i in range(plan.group_size)
    ]


def compare(
    expected: list[Key], soaked: dict[Key, Sample], clean: dict[Key, Sample], *, until_near_tie: bool = False
) -> tuple[int, int, int]:
    """(expected samples that differ between the runs or are missing from either, near ties among them, the
    last step compared). With `until_near_tie`, the steps after the first one where only near ties differ
    are left out: from there the two runs train on different samples and diverge by design (as
    tests/cli/conftest.py `assert_same_samples` compares two runs)."""
    last = max((k[0] for k in expected), default=-1)
    differ: list[Key] = []
    near = 0
    for step in range(last + 1):
        keys = [k for k in expected if k[0] == step]
        here = [k for k in keys if k not in soaked or k not in clean or soaked[k][0] != clean[k][0]]
        ties = sum(k in soaked and k in clean and near_tie(soaked[k], clean[k]) for k in here)
        differ += here
        near += ties
        if until_near_tie and here and ties == len(here):
            return len(differ), near, step
    return len(differ), near, last


NEAR_TIE_LOGP = 1e-4
"""Log-prob agreement on the shared prefix under which a divergence counts as a near tie (see `near_tie`)."""


def near_tie(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]) -> bool:
    """Whether two samples of one seed, (tokens, log-probs) each, differ only by a keyed near tie: they share
    at least one token and every shared token's log-prob agrees within NEAR_TIE_LOGP. A restarted rollout
    decodes in other batch shapes (and tuner arms), whose float rounding differs by ~1e-6; where two tokens'
    keyed scores are that close, the sample flips there. Other weights would move the shared log-probs
    far more, another seed would diverge at the first token: neither passes."""
    (ta, la), (tb, lb) = a, b
    n = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), min(len(ta), len(tb)))
    return n >= 1 and all(abs(x - y) <= NEAR_TIE_LOGP for x, y in zip(la[:n], lb[:n], strict=True))


def _samples(run_dir: Path, steps: int) -> tuple[int, dict[Key, tuple[list[int], list[float]]]]:
    """Rows in the samples records (every learner rank's share), and each (step, group, sample)'s tokens and
    log-probs."""
    rows, out = 0, {}
    for step in range(steps):
        lines = [
            line
            for path in samples_record.sample_files(run_dir, step)
            for line in path.read_text().splitlines()
        ]
        for r in (json.loads(line) for line in lines if line.strip()):
            rows += 1
            out[(step, r["group_id"], r["sample_index"])] = (r["token_ids"], r["logprobs"])
    return rows, out


def metrics_records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


# -- the killer -----------------------------------------------------------------------------------------


@dataclass
class LogTail:
    """A JSON-lines log read as it grows (a restarted actor appends to its predecessor's file)."""

    path: Path
    offset: int = 0
    partial: bytes = b""

    def new(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]


@dataclass
class _Actor:
    name: str
    tail: LogTail
    pid: int | None = None  # the newest process's, from its "ready" event
    killed: set[int] = field(default_factory=set)

    def update(self) -> None:
        for event in self.tail.new():
            if event.get("event") == "ready":
                self.pid = int(event["pid"])

    def live_pid(self, plan: SoakPlan) -> int | None:
        """Its pid if it is up and started by this process (no other process is ever killed)."""
        if self.pid is None or self.pid in self.killed or launcher_pid(self.pid) != os.getpid():
            return None
        return self.pid


def _kill_loop(plan: SoakPlan, run_dir: Path, stop: threading.Event, kills: list[Kill]) -> None:
    """SIGKILLs a victim about every kill_every_s seconds until the last step begins or `stop`."""
    rng = random.Random(plan.seed)
    logs = run_dir / "logs"
    actors = {a: _Actor(a, LogTail(logs / f"{a.replace(':', '-')}.jsonl")) for a in plan.actors}
    victims = sorted(a for a in actors if parse_actor_name(a)[0] in VICTIMS)
    count: Counter[str] = Counter()
    started = time.monotonic()

    def window_open() -> bool:  # the last step's kills could go unrecovered: none there
        return not stop.is_set() and len(metrics_records(run_dir)) < plan.steps - 1

    while window_open() and not all(a.pid for a in actors.values()):  # the whole run up first
        for actor in actors.values():
            actor.update()
        stop.wait(0.05)
    while window_open() and (not plan.kills or len(kills) < plan.kills):
        choices = [v for v in victims if count[v] < plan.max_restarts]
        if not choices or stop.wait(rng.uniform(0.5, 1.5) * plan.kill_every_s):
            return
        victim = actors[rng.choice(choices)]
        while window_open():
            victim.update()
            pid = victim.live_pid(plan)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:  # died meanwhile: wait for its successor
                    victim.killed.add(pid)
                    continue
                victim.killed.add(pid)
                count[victim.name] += 1
                steps = len(metrics_records(run_dir))
                kills.append(
                    Kill(at_s=round(time.monotonic() - started, 2), actor=victim.name, pid=pid, step=steps)
                )
                break
            stop.wait(0.01)


def render(result: SoakResult) -> str:
    lines = [f"{'':>6} {'wall s':>7} {'steps':>5} {'expected':>8} {'recorded':>8} {'lost':>4}  error"]
    for name in ("soak", "clean"):
        o: RunOutcome = getattr(result, name)
        lines.append(
            f"{name:>6} {o.wall_s:>7.1f} {o.steps_completed:>5} {o.expected:>8} {o.recorded:>8} {o.lost:>4}"
            f"  {o.error or '-'}"
        )
    lines.append(
        f"kills {result.kills} (every ~{result.kill_every_s} s, seed {result.seed}), restarts {result.restarts}, "
        f"requeued {result.requeued}, duplicates dropped {result.duplicates}; {result.differing} samples differ "
        f"({result.near_ties} near ties) from the run without kills; not killed: {result.not_killed}; "
        f"{'OK' if result.ok else 'FAILED'}"
    )
    return "\n".join(lines)
