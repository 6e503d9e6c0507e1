"""Other frameworks' rewards in a real run: a TRL-style batched function and a verl-style `compute_score`,
unchanged, combined by weights (`reward:` as terms), score every sample of a 2-step `slipstream train`
exactly as the functions say (tests/cli/foreign_rewards.py), through the verifier's real worker pool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import uvloop

from slipstream.cli import train
from tests.cli.conftest import config
from tests.cli.foreign_rewards import compute_score, trl_length

pytestmark = pytest.mark.timeout(600)


def test_trl_and_verl_rewards_run_unchanged_with_weights(tiny_chat: Path, tmp_path: Path) -> None:
    terms = [
        {"fn": "tests.cli.foreign_rewards:trl_length", "weight": 0.4},
        {"fn": "tests.cli.foreign_rewards:compute_score", "weight": 0.6, "name": "verl"},
    ]
    cfg = config(tiny_chat, steps=2, checkpoint_every=0, reward=terms, drafter={"enabled": False})
    run = tmp_path / "run"
    summary = uvloop.run(train.train(cfg, run))
    assert len(summary["steps"]) == 2
    scored = 0
    for step in range(2):
        for line in (run / "samples" / f"step-{step}.jsonl").read_text().splitlines():
            sample = json.loads(line)
            expected = 0.4 * trl_length([""], [sample["text"]])[0] + 0.6 * compute_score("chain_sum", "", "x")
            assert sample["reward"] == pytest.approx(expected), sample["text"]
            scored += 1
    assert scored == 2 * cfg.prompts_per_step * cfg.group_size
    for record in summary["steps"]:  # each term's calls reached the step's record, on its own
        terms, n = record["reward_terms"], cfg.prompts_per_step * cfg.group_size
        assert (
            set(terms) == {"trl_length", "verl"}
            and terms["trl_length"]["samples"] == terms["verl"]["samples"] == n
        )
        assert terms["verl"]["calls"] == n and terms["verl"]["batch_max"] == 1  # per completion
        assert 1 <= terms["trl_length"]["calls"] <= n and terms["trl_length"]["batch_max"] >= 1  # batched
        assert record["reward_call_s"] == pytest.approx(sum(t["seconds"] for t in terms.values()), abs=2e-3)


def test_a_verifier_killed_while_a_batched_reward_scores_is_restarted_and_each_sample_scored_once(
    tiny_chat: Path, tmp_path: Path
) -> None:
    import asyncio

    from tests.cli.test_train_faults import _kill_while_working

    terms = [{"fn": "tests.cli.foreign_rewards:trl_length", "weight": 1.0}]
    cfg = config(
        tiny_chat, steps=3, checkpoint_every=0, reward=terms, drafter={"enabled": False},
        faults={"restart_backoff_s": 0.1}, verifier={"batch_wait_s": 0.5},
    )  # fmt: skip
    run = tmp_path / "run"

    async def run_with_kill() -> dict:
        job = asyncio.create_task(train.train(cfg, run))
        kill = asyncio.create_task(_kill_while_working(run, "verifier-0", "rollout-0", step=1))
        summary = await job
        assert kill.done(), "the verifier was never killed (the run ended first)"
        return summary

    summary = uvloop.run(run_with_kill())
    assert any("verifier:0" in s["restarts"] for s in summary["steps"])
    for step in range(3):
        lines = (run / "samples" / f"step-{step}.jsonl").read_text().splitlines()
        keys = [(s["group_id"], s["sample_index"]) for s in map(json.loads, lines)]
        assert len(keys) == len(set(keys)) == cfg.prompts_per_step * cfg.group_size  # each once
        for sample in map(json.loads, lines):
            assert sample["reward"] == pytest.approx(trl_length([""], [sample["text"]])[0])
