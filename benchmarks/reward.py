"""Reward benchmark: completions scored per second, a per-completion reward vs the same scoring batched,
through the verifier's worker pool; and the LLM judge (tasks/judge.py) at batch 1 vs 16.

    slipstream bench reward --json
    slipstream bench reward --completions 4096 --rounds 4 --judge-model DIR --json

The pool (`pool`): two `VerifierActor`s under one Supervisor, as real processes (the actor, its
forkserver, its workers) with the same `workers`: one runs `exact` (ours, per completion: a worker call,
and a `Calling`, a `Called` and an `Outcome` on the worker's pipe, per sample), the other
`exact_batched` (TRL's convention, the same scoring, one call per batch of up to `batch_size`). A round
sends `completions` ScoreRequests to one actor at once, as a rollout step's completions arrive, and ends
at its last Reward;
the rounds go A B B A (ABBA, `rounds` per arm), so a host that drifts slows both alike. The judge
(`judge`): `Judge` loaded once in this process (`judge_threads` torch threads), the same
`judge_completions` completions scored one per call vs `judge_batch` per call, ABBA too. Each arm's
figure is completions per second over the median of its rounds. Every arm is checked against its pair:
the two pools' rewards must be equal, the judge's scores equal within `JUDGE_TOLERANCE`.

The workload: "What is a + b?" rows with reasoning and an <answer> tag, right and wrong alternately
(seeded). `run` returns `RewardBenchResult`. Timings are only worth reading from a quiet host: the
result carries the load average at the start.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from slipstream.actors.verifier import VerifierActor
from slipstream.protocols.reward import Reward, ScoreRequest
from slipstream.runtime.supervisor import ActorSpec, Supervisor
from slipstream.tasks.rewards import extract_answer

__all__ = [
    "JUDGE_TOLERANCE",
    "Arm",
    "RewardBenchResult",
    "abba",
    "exact",
    "exact_batched",
    "render",
    "run",
    "workload",
]

JUDGE_TOLERANCE = 1e-4  # batch 1 vs batch N: the same prompts, other batch shapes (float rounding only)
_HERE = "slipstream.benchmarks.reward"


class Arm(msgspec.Struct, frozen=True, kw_only=True):
    """One side of a comparison."""

    name: str
    batch: int  # completions per reward call: 1, or the most per call
    completions: int  # scored per round
    rounds_s: list[float]  # each round's seconds, in the order run
    per_s: float  # completions / the median round


class RewardBenchResult(msgspec.Struct, frozen=True, kw_only=True):
    """What `run` measured."""

    cpus: int  # cores this process may run on
    load_avg: float  # the host's 1-minute load average at the start (timings want ~0)
    pool: list[Arm]  # per_completion (`exact`) and batched (`exact_batched`), through the verifier
    pool_workers: int
    pool_batch_wait_s: float
    pool_speedup: float  # batched per_s / per_completion per_s
    pool_same_rewards: bool  # both pools gave every completion the same reward
    judge_model: str
    judge_threads: int
    judge: list[Arm]  # batch_1 and batch_N, the judge in this process
    judge_speedup: float  # batch_N per_s / batch_1 per_s
    judge_max_diff: float  # the largest |score at batch 1 - score at batch N|
    judge_mean_right: float  # the judge's mean score of the right answers (a sanity figure, not a test)
    judge_mean_wrong: float


# -- the rewards the pools load by path ------------------------------------------------------------------


def exact(prompt: str, completion: str, *, answer: Any = None, **_: Any) -> float | None:
    """1.0 if the completion's <answer> equals the row's answer, else 0.0; None without an answer."""
    if answer is None:
        return None
    return 1.0 if extract_answer(completion) == str(answer).strip() else 0.0


def exact_batched(
    prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any], **_: Any
) -> list[float | None]:
    """`exact` in TRL's batched convention: one call, one value per completion."""
    return [exact(p, c, answer=a) for p, c, a in zip(prompts, completions, answer, strict=True)]


# -- the workload and the schedule -----------------------------------------------------------------------


def workload(n: int, seed: int = 0) -> list[tuple[str, str, dict[str, Any]]]:
    """`n` (question, completion, row): a sum worked out, its answer tagged, right for even i."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        c = a + b if i % 2 == 0 else a + b + rng.choice([-10, -1, 1, 10])
        question = f"What is {a} + {b}?"
        completion = f"First {a} + {b}: add the tens, then the ones, which gives {c}. <answer>{c}</answer>"
        out.append((question, completion, {"question": question, "answer": str(a + b), "metadata": {}}))
    return out


def abba(rounds: int) -> list[int]:
    """Which arm (0 or 1) runs each turn: 0 1 1 0 0 1 1 0 …, `rounds` turns for each arm."""
    return [(i // 2 + i) % 2 for i in range(2 * rounds)]


def _arm(name: str, batch: int, n: int, times: list[float]) -> Arm:
    return Arm(name=name, batch=batch, completions=n, rounds_s=times, per_s=n / statistics.median(times))


# -- the pool ----------------------------------------------------------------------------------------------


def _specs(workers: int, batch_size: int, batch_wait_s: float) -> list[ActorSpec]:
    common = {"workers": workers, "batch_size": batch_size, "batch_wait_s": batch_wait_s, "report_every_s": 0}
    return [
        ActorSpec(
            actor="slipstream.actors.verifier:VerifierActor", rank=rank, config={"reward": fn, **common}
        )
        for rank, fn in enumerate((f"{_HERE}:exact", f"{_HERE}:exact_batched"))
    ]


async def _round(
    sup: Supervisor, actor: str, group: int, rows: list[tuple[str, str, dict[str, Any]]]
) -> list[Reward]:
    """Sends every row to `actor` at once; returns its Rewards by sample index once the last is in."""
    for i, (question, completion, row) in enumerate(rows):
        request = ScoreRequest(group_id=group, sample_index=i, prompt=question, completion=completion,
                               row_json=json.dumps(row), policy_version=0)  # fmt: skip
        await sup.send(actor, request)
    got: dict[int, Reward] = {}
    while len(got) < len(rows):
        _, msg = await asyncio.wait_for(sup.inbox.get(), timeout=120.0)
        if isinstance(msg, Reward) and msg.group_id == group:
            got[msg.sample_index] = msg
    return [got[i] for i in range(len(rows))]


async def _pool(
    rows: list[tuple[str, str, dict[str, Any]]],
    rounds: int,
    workers: int,
    batch_size: int,
    batch_wait_s: float,
    run_dir: Path,
    say: Callable[[str], None],
) -> tuple[list[Arm], bool]:
    sup = Supervisor(run_dir, heartbeat_s=1.0)
    await sup.start(_specs(workers, batch_size, batch_wait_s))
    actors = [f"{VerifierActor.role}:{rank}" for rank in range(2)]
    times: list[list[float]] = [[], []]
    rewards: list[list[float | None]] = [[], []]
    groups = iter(range(1, 1 << 30))
    try:
        for arm in (0, 1):  # a warm-up round each: the workers' first batches, the sockets
            await _round(sup, actors[arm], next(groups), rows[: min(len(rows), 2 * batch_size)])
        for arm in abba(rounds):
            started = time.perf_counter()
            got = await _round(sup, actors[arm], next(groups), rows)
            times[arm].append(time.perf_counter() - started)
            rewards[arm] = [r.reward for r in got]
            say(f"pool {('per_completion', 'batched')[arm]}: {len(rows) / times[arm][-1]:.0f} completions/s")
    finally:
        await sup.shutdown(grace_s=10.0)
    arms = [_arm("per_completion", 1, len(rows), times[0]), _arm("batched", batch_size, len(rows), times[1])]
    return arms, rewards[0] == rewards[1] and None not in rewards[0]


# -- the judge -------------------------------------------------------------------------------------------


def _judge(
    rows: list[tuple[str, str, dict[str, Any]]],
    rounds: int,
    batch: int,
    model: str,
    threads: int,
    say: Callable[[str], None],
) -> tuple[list[Arm], list[float], list[float], int]:
    from slipstream.tasks import judge

    judge_cls = type("BenchJudge", (judge.Judge,), {"model": model, "threads": threads})
    j = judge_cls()

    def score(size: int) -> list[float]:
        out: list[float] = []
        for start in range(0, len(rows), size):
            part = rows[start : start + size]
            got = j(
                prompts=[q for q, _, _ in part],
                completions=[c for _, c, _ in part],
                answer=[r["answer"] for _, _, r in part],
                question=[q for q, _, _ in part],
            )
            out += [float("nan") if s is None else s for s in got]
        return out

    sizes = (1, batch)
    for size in sizes:  # warm-up: the first passes' allocations and oneDNN's primitives
        score(size)
    times: list[list[float]] = [[], []]
    scores: list[list[float]] = [[], []]
    for arm in abba(rounds):
        started = time.perf_counter()
        scores[arm] = score(sizes[arm])
        times[arm].append(time.perf_counter() - started)
        say(f"judge batch {sizes[arm]}: {len(rows) / times[arm][-1]:.1f} completions/s")
    arms = [_arm("batch_1", 1, len(rows), times[0]), _arm(f"batch_{batch}", batch, len(rows), times[1])]
    return arms, scores[0], scores[1], torch.get_num_threads()


# -- the bench -------------------------------------------------------------------------------------------


def run(
    *,
    completions: int = 2048,
    rounds: int = 2,
    workers: int = 2,
    batch_size: int = 32,
    batch_wait_s: float = 0.05,
    judge_model: str = "smollm2-135m",
    judge_completions: int = 32,
    judge_batch: int = 16,
    judge_threads: int = 0,
    seed: int = 0,
    run_dir: Path | None = None,
    log: bool = True,
) -> RewardBenchResult:
    """Both comparisons, each ABBA (`rounds` per arm); see the module docstring. judge_threads: 0 for the
    judge's default (`tasks.judge.default_threads`); run_dir: the supervisor's (a temporary one if None)."""
    for name, value in (("completions", completions), ("rounds", rounds), ("workers", workers),
                        ("batch_size", batch_size), ("judge_completions", judge_completions),
                        ("judge_batch", judge_batch)):  # fmt: skip
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")

    def say(message: str) -> None:
        if log:
            print(f"bench reward: {message}", flush=True, file=sys.stderr)

    load_avg = os.getloadavg()[0]
    rows = workload(completions, seed)
    with tempfile.TemporaryDirectory(prefix="bench-reward-") as tmp:
        pool, same = asyncio.run(
            _pool(rows, rounds, workers, batch_size, batch_wait_s, Path(run_dir or tmp), say)
        )
    judged = workload(judge_completions, seed + 1)
    arms, one, many, threads = _judge(judged, rounds, judge_batch, judge_model, judge_threads, say)
    diffs = [abs(a - b) for a, b in zip(one, many, strict=True)]
    right = [s for (_, c, r), s in zip(judged, many, strict=True) if extract_answer(c) == r["answer"]]
    wrong = [s for (_, c, r), s in zip(judged, many, strict=True) if extract_answer(c) != r["answer"]]
    return RewardBenchResult(
        cpus=len(os.sched_getaffinity(0)),
        load_avg=round(load_avg, 2),
        pool=pool,
        pool_workers=workers,
        pool_batch_wait_s=batch_wait_s,
        pool_speedup=pool[1].per_s / pool[0].per_s,
        pool_same_rewards=same,
        judge_model=judge_model,
        judge_threads=threads,
        judge=arms,
        judge_speedup=arms[1].per_s / arms[0].per_s,
        judge_max_diff=max(diffs) if diffs else 0.0,
        judge_mean_right=statistics.fmean(right) if right else float("nan"),
        judge_mean_wrong=statistics.fmean(wrong) if wrong else float("nan"),
    )


def render(result: RewardBenchResult) -> str:
    """A few lines for a terminal."""
    lines = [f"cpus {result.cpus}, load {result.load_avg}"]
    for title, arms, speedup in (("pool", result.pool, result.pool_speedup),
                                 ("judge", result.judge, result.judge_speedup)):  # fmt: skip
        row = ", ".join(f"{a.name} {a.per_s:.1f}/s" for a in arms)
        lines.append(f"{title}: {row}; x{speedup:.2f}")
    lines.append(
        f"pool rewards equal: {result.pool_same_rewards}; judge max diff {result.judge_max_diff:.2e}"
    )
    return "\n".join(lines)
