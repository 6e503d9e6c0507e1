"""The verifier with batched, weighted and verl rewards, as real processes.

A TRL-style reward (`batch_of`) writes each call's size to the row's `calls_file`, so the tests count its
calls. Batches form from what has arrived: completions sent together share a call, a lone one is scored
once `batch_wait_s` has passed. A batched call that fails costs its batch; a per-completion component
that hangs inside a batch costs its sample, and the batch's others are scored again on a fresh worker.
Each call's size and seconds reach the coordinator per term (`RewardCalls`) ahead of the Rewards.
The pool shares tests/actors/test_verifier.py's harness (one Supervisor on a thread).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from slipstream.protocols.reward import Reward, RewardCalls
from tests.actors.test_verifier import Pools, spec

BATCH_WAIT_S = 1.0  # long enough that completions sent one after another share a batch on a busy host
BATCH_TIMEOUT_S = 2.0
TIMEOUT_S = 1.0

# -- rewards the workers load by path -------------------------------------------------------------


def batch_of(prompts: list[str], completions: list[str], calls_file: list[str], **kwargs: Any) -> Any:
    """TRL's convention: one call for the batch, one value (or None) per completion."""
    with open(calls_file[0], "a") as f:
        f.write(f"{len(completions)}\n")
    if "hang_batch" in completions:
        time.sleep(600)
    if "raise_batch" in completions:
        raise RuntimeError("the batch failed")
    if "short" in completions:
        return [1.0]
    if expect := kwargs.get("expect"):  # rows that differ: right only against its own row
        return [float(c == e) for c, e in zip(completions, expect, strict=True)]
    return [None if c == "none" else 1.0 for c in completions]


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
    """verl's convention, unchanged: a dict with its score."""
    if data_source != "arith":
        raise ValueError(f"unknown data_source {data_source!r}")
    right = solution_str.split()[-1] == str(ground_truth)  # asymmetric: "7" against "so 7" is wrong
    return {"score": float(right), "acc": right}


# -- the pool --------------------------------------------------------------------------------------

HERE = "tests.actors.test_verifier_batching"
TERMS = [
    {"fn": f"{HERE}:batch_of", "name": "batch"},
    {"fn": "tests.actors.test_verifier:behave", "weight": 0.5, "name": "own"},
]


@pytest.fixture(scope="module")
def pools(tmp_path_factory: pytest.TempPathFactory) -> Any:
    batching = {"batch_size": 8, "batch_wait_s": BATCH_WAIT_S, "batch_timeout_s": BATCH_TIMEOUT_S}
    pools = Pools(
        tmp_path_factory.mktemp("verifier-batching") / "run",
        [
            spec(f"{HERE}:batch_of", 0, workers=2, timeout_s=TIMEOUT_S, **batching),
            spec(TERMS, 1, workers=1, timeout_s=TIMEOUT_S, **batching),  # type: ignore[arg-type]
            spec(f"{HERE}:compute_score", 2, workers=1, data_source="arith"),
        ],
    )
    yield pools
    pools.close()


def calls(path: Path) -> list[int]:
    return [int(n) for n in path.read_text().split()] if path.exists() else []


def row(calls_file: Path, answer: float = 1.0) -> str:
    return json.dumps({"answer": answer, "calls_file": str(calls_file)})


def reward_calls(pools: Pools, actor: str, since: int) -> dict[str, dict[str, float]]:
    """`actor`'s RewardCalls from `pools.seen[since:]` that came before its last Reward there, summed per
    term ("seconds", "calls", "samples", "invalid"; "max_batch" the largest)."""
    window = [(i, m) for i, (s, m) in enumerate(pools.seen[since:]) if s == actor]
    last = max(i for i, m in window if isinstance(m, Reward))
    out: dict[str, dict[str, float]] = {}
    for _, msg in (x for x in window if x[0] < last and isinstance(x[1], RewardCalls)):
        for name, t in msg.terms.items():
            cell = out.setdefault(
                name, dict.fromkeys(("calls", "samples", "seconds", "invalid", "max_batch"), 0)
            )
            for key in ("calls", "samples", "seconds", "invalid"):
                cell[key] += getattr(t, key)
            cell["max_batch"] = max(cell["max_batch"], t.max_batch)
    return out


@pytest.mark.timeout(120)
def test_completions_that_arrive_together_share_calls(pools: Pools, tmp_path: Path) -> None:
    calls_file = tmp_path / "calls"
    got = pools.score("verifier:0", ["good"] * 12, row_json=row(calls_file))
    assert [r.reward for r in got] == [1.0] * 12
    sizes = calls(calls_file)
    assert sum(sizes) == 12 and len(sizes) < 12 and sum(sizes) / len(sizes) > 1
    status = pools.status("verifier:0")
    assert status["batch_mean"] > 1 and status["component_batch_of_scored"] >= 12


@pytest.mark.timeout(120)
def test_a_lone_completion_is_scored_once_the_batch_wait_is_over(pools: Pools, tmp_path: Path) -> None:
    calls_file = tmp_path / "calls"
    for _ in range(2):  # rewards stream: one completion does not wait for a full batch
        started = time.monotonic()
        (reward,) = pools.score("verifier:0", ["good"], row_json=row(calls_file))
        assert reward.reward == 1.0 and time.monotonic() - started < BATCH_WAIT_S + 5
    assert calls(calls_file) == [1, 1]


@pytest.mark.timeout(120)
def test_a_failed_batched_call_costs_only_its_batch(pools: Pools, tmp_path: Path) -> None:
    calls_file = tmp_path / "calls"
    got = pools.score("verifier:0", ["raise_batch", "good", "good"], row_json=row(calls_file))
    assert [r.error for r in got] == ["raised: RuntimeError: the batch failed"] * 3
    got = pools.score("verifier:0", ["short", "good", "good"], row_json=row(calls_file))
    assert [r.error for r in got] == ["garbage: returned 1 values for 3 completions"] * 3
    got = pools.score("verifier:0", ["good", "none", "good"], row_json=row(calls_file))
    assert [r.reward for r in got] == [1.0, None, 1.0] and got[
        1
    ].error == "none: the reward could not score it"
    assert calls(calls_file) == [3, 3, 3]  # each group was one call: the failures were each its batch's
    status = pools.status("verifier:0")
    assert status["restarts"] == 0 and status["invalid_raised"] == 3 and status["invalid_garbage"] == 3


@pytest.mark.timeout(120)
def test_a_hung_batched_call_is_killed_at_the_batch_deadline(pools: Pools, tmp_path: Path) -> None:
    calls_file = tmp_path / "calls"
    restarts = pools.status("verifier:0")["restarts"]
    got = pools.score("verifier:0", ["hang_batch", "good"], row_json=row(calls_file))
    assert [r.error for r in got] == [f"timeout after {BATCH_TIMEOUT_S} s"] * 2
    assert all(BATCH_TIMEOUT_S <= r.elapsed_s < BATCH_TIMEOUT_S + 3 for r in got)
    got = pools.score("verifier:0", ["good", "good"], row_json=row(calls_file))
    assert [r.reward for r in got] == [1.0, 1.0]
    status = pools.status("verifier:0")
    assert status["restarts"] == restarts + 1 and status["workers"] == 2


@pytest.mark.timeout(120)
def test_weighted_terms_sum_and_each_component_is_counted(pools: Pools, tmp_path: Path) -> None:
    calls_file = tmp_path / "calls"
    got = pools.score("verifier:1", ["good", "good"], row_json=row(calls_file, answer=2.0))
    assert [r.reward for r in got] == [2.0, 2.0]  # 1.0 × batch + 0.5 × own (the row's answer, 2.0)
    got = pools.score("verifier:1", ["good", "raise"], row_json=row(calls_file, answer=2.0))
    assert got[0].reward == 2.0 and got[1].error == "raised: own: ZeroDivisionError: division by zero"
    status = pools.status("verifier:1")
    assert (
        status["reward"]
        == "1*tests.actors.test_verifier_batching:batch_of + 0.5*tests.actors.test_verifier:behave"
    )
    assert status["component_batch_scored"] == 4 and status["component_batch_sum"] == 4.0
    assert status["component_own_scored"] == 3 and status["component_own_sum"] == 6.0
    assert status["component_own_invalid"] == 1 and status["component_batch_invalid"] == 0


@pytest.mark.timeout(120)
def test_each_terms_calls_batch_sizes_and_seconds_arrive_ahead_of_the_rewards(
    pools: Pools, tmp_path: Path
) -> None:
    calls_file = tmp_path / "calls"
    since = len(pools.seen)
    got = pools.score("verifier:1", ["good"] * 6 + ["raise"], row_json=row(calls_file, answer=2.0))
    assert [r.reward for r in got] == [2.0] * 6 + [None]
    sizes = calls(calls_file)  # what the batched term was really called with
    terms = reward_calls(pools, "verifier:1", since)
    assert set(terms) == {"batch", "own"}
    batch, own = terms["batch"], terms["own"]
    assert (batch["calls"], batch["samples"], batch["max_batch"]) == (len(sizes), 7, max(sizes))
    assert batch["samples"] / batch["calls"] > 1 and batch["invalid"] == 0  # batching was on
    assert (own["calls"], own["samples"], own["max_batch"], own["invalid"]) == (7, 7, 1, 1)  # one a sample
    # `own` sleeps for nothing; a call's seconds are its wall time: more than nothing, less than the wait.
    assert 0 < batch["seconds"] < 5 and 0 < own["seconds"] < 5
    status = pools.status("verifier:1")
    assert status["component_batch_calls"] >= len(sizes) and status["component_batch_batch_max"] >= max(sizes)
    assert status["component_own_seconds"] >= own["seconds"] and status["component_own_batch_mean"] == 1.0


@pytest.mark.timeout(120)
def test_a_hung_sample_in_a_batch_costs_that_sample_and_the_rest_are_scored_again(
    pools: Pools, tmp_path: Path
) -> None:
    calls_file = tmp_path / "calls"
    restarts = pools.status("verifier:1")["restarts"]
    since = len(pools.seen)
    got = pools.score("verifier:1", ["good", "hang", "good"], row_json=row(calls_file))
    assert [r.reward for r in got] == [1.5, None, 1.5]
    assert got[1].error == f"timeout after {TIMEOUT_S} s"
    assert calls(calls_file) == [3, 1]  # the third sample's batched term ran again, on a fresh worker
    assert pools.status("verifier:1")["restarts"] == restarts + 1
    # The killed call is charged to its term, up to the kill, its sample invalid.
    own = reward_calls(pools, "verifier:1", since)["own"]
    assert own["invalid"] == 1 and TIMEOUT_S <= own["seconds"] < TIMEOUT_S + 3


@pytest.mark.timeout(120)
def test_a_verl_compute_score_works_unchanged(pools: Pools) -> None:
    got = pools.score("verifier:2", ["7", "8"], row_json=json.dumps({"answer": 7}))
    assert [r.reward for r in got] == [1.0, 0.0]  # data_source: the verifier's, as the row names none
    got = pools.score("verifier:2", ["7"], row_json=json.dumps({"answer": 7, "data_source": "other"}))
    assert got[0].error == "raised: ValueError: unknown data_source 'other'"
    assert pools.status("verifier:2")["batch_mean"] == 1.0  # a per-completion convention: one a call


@pytest.mark.timeout(120)
def test_each_completion_is_scored_against_its_own_row(pools: Pools, tmp_path: Path) -> None:
    """Rows that differ, sent together: a batch whose columns were handed over in another order than its
    completions (or a verl solution swapped with its ground truth) would score these 0."""
    calls_file = tmp_path / "calls"
    completions = [f"c{i}" for i in range(8)]
    rows = [json.dumps({"answer": float(i), "expect": c, "calls_file": str(calls_file)})
            for i, c in enumerate(completions)]  # fmt: skip
    got = pools.score("verifier:0", completions, row_json=rows)
    assert [r.reward for r in got] == [1.0] * 8
    assert max(calls(calls_file)) > 1  # at least one call held several rows
    # Two terms: the batched one by `expect`, the per-completion one ("good": its row's answer) by index.
    got = pools.score("verifier:1", ["good"] * 4, row_json=[
        json.dumps({"answer": float(i), "expect": "good", "calls_file": str(calls_file)}) for i in range(4)
    ])  # fmt: skip
    assert [r.reward for r in got] == [1.0 + 0.5 * i for i in range(4)]
    answers = [3, 14, 15, 92]
    got = pools.score("verifier:2", [f"so it is {a}" for a in answers],
                      row_json=[json.dumps({"answer": a}) for a in answers])  # fmt: skip
    assert [r.reward for r in got] == [1.0] * 4
