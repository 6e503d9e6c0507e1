"""The training loop's bookkeeping: checkpoint policy and pruning, metrics kept once across a resume,
and a run whose reward fails on every sample ending with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import uvloop

from slipstream.cli import train
from slipstream.rl import run, run_config, run_dir
from tests.cli.conftest import config

pytestmark = pytest.mark.timeout(300)


def bad_signature(prompt: str, completion: str, answer: str) -> float:
    """A reward written without **kwargs: it is also passed question and metadata, so it always raises."""
    return 1.0


def test_checkpoints_are_due_by_steps_by_time_and_at_the_end() -> None:
    cfg = msgspec.convert(
        {"steps": 10, "checkpoint_every": 4, "checkpoint_minutes": 1.0}, run_config.TrainConfig
    )
    assert [s for s in range(10) if run.checkpoint_due(cfg, s, since_last_s=0)] == [3, 7, 9]
    assert run.checkpoint_due(cfg, 0, since_last_s=61)  # a minute passed: protect the work
    never = msgspec.convert(
        {"steps": 10, "checkpoint_every": 0, "checkpoint_minutes": 0.0}, run_config.TrainConfig
    )
    assert [s for s in range(10) if run.checkpoint_due(never, s, since_last_s=1e9)] == [9]


def test_only_the_newest_checkpoints_are_kept(tmp_path: Path) -> None:
    for step in (2, 4, 10, 6):
        (tmp_path / "checkpoints" / f"step-{step}").mkdir(parents=True)
    run_dir.prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-10", "step-6"]


def test_a_resumed_run_keeps_each_earlier_step_once(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    # Every scalar field 0; the dict and list fields (per-arm, per-bucket, per-term) keep their defaults.
    fields = {
        f.name: 0
        for f in msgspec.structs.fields(run_dir.StepRecord)
        if not str(f.type).startswith(("dict", "list"))
    }

    def line(step: int, reward: float) -> str:
        return json.dumps({**fields, "step": step, "reward_mean": reward, "arms": {}})

    # Steps 0-2 ran, the run crashed during step 3 (a cut line), and step 1 had been written twice.
    path.write_text("\n".join([line(0, 0.1), line(1, 0.2), line(1, 0.3), line(2, 0.4), '{"step": 3, "rew']))
    records = run_dir.read_records(path, before=2)  # resumed from the checkpoint after step 1
    assert [(r.step, r.reward_mean) for r in records] == [(0, 0.1), (1, 0.3)]
    run_dir.write_records(path, records)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1]


def test_a_reward_that_fails_on_every_sample_ends_the_run_naming_the_fix(
    tiny_chat: Path, tmp_path: Path
) -> None:
    cfg = config(
        tiny_chat, steps=3, reward="tests.cli.test_train_state:bad_signature", faults={"max_invalid_steps": 2}
    )
    with pytest.raises(RuntimeError, match=r"2 steps in a row .*unexpected keyword argument .*\*\*kwargs"):
        uvloop.run(train.train(cfg, tmp_path / "run"))
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["invalid"] for x in lines] == [12, 12]  # both steps recorded, every sample invalid


def test_a_short_jsonl_is_read_in_epochs_and_resumed_at_its_cursor(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(3)]
    data.write_text("\n".join([json.dumps(rows[0]), "{not json", *map(json.dumps, rows[1:])]))
    cfg = msgspec.convert({"task": str(data), "steps": 4, "prompts_per_step": 2}, run_config.TrainConfig)
    stream = run_config.data_stream(cfg, {})
    read = [r.question for _ in range(2) for r in stream.take(cfg.prompts_per_step)]
    cursor = stream.state()
    rest = [r.question for _ in range(2) for r in stream.take(cfg.prompts_per_step)]
    assert sorted(read[:3]) == ["q0", "q1", "q2"]  # an epoch is every usable row once (the bad line skipped)
    resumed = run_config.data_stream(cfg, {"step": 2, "data": json.loads(json.dumps(cursor))})
    assert [r.question for _ in range(2) for r in resumed.take(cfg.prompts_per_step)] == rest
