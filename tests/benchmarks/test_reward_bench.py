"""`slipstream bench reward` at a tiny size: real verifier processes, the tiny judge; the schedule is ABBA,
both pools agree, the judge's batch sizes agree, and the command line's defaults are `run`'s."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest

from slipstream.benchmarks import reward
from slipstream.cli.main import main
from tests.benchmarks.test_bench_cli import _bench_parsers


def test_the_schedule_is_abba() -> None:
    assert reward.abba(1) == [0, 1]
    assert reward.abba(2) == [0, 1, 1, 0]
    assert reward.abba(4) == [0, 1, 1, 0, 0, 1, 1, 0]


def test_the_two_rewards_score_alike() -> None:
    rows = reward.workload(8)
    one = [reward.exact(q, c, **r) for q, c, r in rows]
    many = reward.exact_batched(
        [q for q, _, _ in rows], [c for _, c, _ in rows], [r["answer"] for *_, r in rows]
    )
    assert one == many == [1.0, 0.0] * 4
    assert reward.exact("q", "<answer>1</answer>") is None


@pytest.mark.timeout(300)
def test_a_tiny_run_prints_one_json_object(
    tiny_chat: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["bench", "reward", "--json", "--completions", "12", "--rounds", "2", "--batch-size", "4",
            "--judge-model", str(tiny_chat), "--judge-completions", "4", "--judge-batch", "2",
            "--judge-threads", "1"]  # fmt: skip
    assert main(argv) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert [a["name"] for a in result["pool"]] == ["per_completion", "batched"]
    assert [a["batch"] for a in result["pool"]] == [1, 4]
    assert [a["name"] for a in result["judge"]] == ["batch_1", "batch_2"]
    for arm in result["pool"] + result["judge"]:
        assert len(arm["rounds_s"]) == 2 and all(t > 0 for t in arm["rounds_s"]) and arm["per_s"] > 0
    assert result["pool"][0]["completions"] == 12 and result["judge"][0]["completions"] == 4
    assert result["pool_same_rewards"] is True
    assert result["judge_max_diff"] <= reward.JUDGE_TOLERANCE and result["judge_threads"] == 1
    assert 0.0 <= result["judge_mean_right"] <= 1.0 and 0.0 <= result["judge_mean_wrong"] <= 1.0


def test_the_command_lines_defaults_are_runs() -> None:
    parser = _bench_parsers()["reward"]
    defaults = {k: p.default for k, p in inspect.signature(reward.run).parameters.items()}
    for flag in ("completions", "rounds", "workers", "batch_size", "judge_model", "judge_completions",
                 "judge_batch", "judge_threads"):  # fmt: skip
        assert parser.get_default(flag) == defaults[flag], flag
