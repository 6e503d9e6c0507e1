"""Metric sinks (runtime/sinks.py): TensorBoard read back by its own reader, config errors, missing extras.

The TensorBoard cases write real event files and read them with tensorboard's EventAccumulator (they are
skipped where tensorboard is not installed: `pip install 'slipstream[tensorboard]'`). The wandb case
injects a fake `wandb` module that records the calls: it checks what the sink asks of wandb (an offline run
in the run directory, one log per step at that step), not real wandb, which the suite never exercises.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import uvloop

from slipstream.cli import train
from slipstream.rl import run_config
from slipstream.runtime.config import ConfigError
from slipstream.runtime.sinks import MetricsConfig, open_sinks, require_sinks, scalars

pytestmark = pytest.mark.timeout(120)

RECORD: dict[str, Any] = {
    "reward_mean": 0.25,
    "tokens": 96,
    "arms": {"off": 3, "chain-3": 5},
    "accept_by_batch": {"1": 2.5, "3-4": 1.75},
    "restarts": ["rollout-0"],  # a list: not a scalar
    "note": "text",  # nor is a string
}


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag's (step, value) list, as TensorBoard itself reads the directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_scalars_flattens_nested_numbers_with_a_slash_and_skips_the_rest() -> None:
    assert scalars(RECORD) == {
        "reward_mean": 0.25,
        "tokens": 96.0,
        "arms/off": 3.0,
        "arms/chain-3": 5.0,
        "accept_by_batch/1": 2.5,
        "accept_by_batch/3-4": 1.75,
    }


def test_tensorboard_holds_each_steps_scalars_on_disk_after_each_step(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    sinks = open_sinks(MetricsConfig(sinks=["tensorboard"]), tmp_path)
    try:
        sinks.write(0, RECORD)
        sinks.write(1, {**RECORD, "reward_mean": 0.5, "arms": {"off": 8}})
        got = read_scalars(tmp_path / "tensorboard")  # before close: each step is flushed as written
    finally:
        sinks.close()
    assert got["reward_mean"] == [(0, 0.25), (1, 0.5)]
    assert got["tokens"] == [(0, 96.0), (1, 96.0)]
    assert got["arms/off"] == [(0, 3.0), (1, 8.0)]
    assert got["arms/chain-3"] == [(0, 5.0)]
    assert got["accept_by_batch/3-4"] == [(0, 1.75), (1, 1.75)]
    assert not {"restarts", "note"} & set(got)


def test_a_resumed_run_appends_to_the_same_directory_each_step_once(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    first = open_sinks(MetricsConfig(sinks=["tensorboard"]), tmp_path)
    for step in range(4):  # the run crashed after step 3; its newest checkpoint is after step 1
        first.write(step, {"reward_mean": float(step)})
    first.close()
    resumed = open_sinks(MetricsConfig(sinks=["tensorboard"]), tmp_path, resume_step=2)
    try:
        # As metrics.jsonl at a resume: the steps from the checkpoint on are gone until done again.
        assert read_scalars(tmp_path / "tensorboard")["reward_mean"] == [(0, 0.0), (1, 1.0)]
        resumed.write(2, {"reward_mean": 20.0})
    finally:
        resumed.close()
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert read_scalars(tmp_path / "tensorboard")["reward_mean"] == [(0, 0.0), (1, 1.0), (2, 20.0)]


@pytest.mark.parametrize(
    "override, error",
    [
        ("metrics.sinks=[tensorbord]", r"^metrics\.sinks\[0\]: invalid enum value 'tensorbord'"),
        ("metrics.sinks=tensorboard", r"^metrics\.sinks: expected `array`, got `str`"),
        ("metrics.sink=[wandb]", r"^metrics\.sink: unknown field"),
        ("metrics.wandb_project=[a]", r"^metrics\.wandb_project: expected `str`"),
    ],
)
def test_a_bad_metrics_value_fails_at_load_naming_the_field(override: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        run_config.load_config(None, [override])


def test_the_sinks_are_off_by_default_and_named_in_a_config() -> None:
    assert run_config.load_config(None).metrics == MetricsConfig(sinks=[], wandb_project="")
    cfg = run_config.load_config(None, ["metrics.sinks=[tensorboard, wandb]", "metrics.wandb_project=grpo"])
    assert cfg.metrics == MetricsConfig(sinks=["tensorboard", "wandb"], wandb_project="grpo")


@pytest.mark.parametrize("sink", ["tensorboard", "wandb"])
def test_a_missing_package_is_named_with_its_extra(sink: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, sink, None)  # `import <sink>` now fails, as where it is not installed
    want = f"metrics.sinks: {sink} needs `pip install 'slipstream[{sink}]'`"
    with pytest.raises(ConfigError) as e:
        require_sinks(MetricsConfig(sinks=[sink]))
    assert str(e.value) == want
    require_sinks(MetricsConfig())  # none named: nothing is looked for


def test_train_refuses_a_missing_sink_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = run_config.load_config(None, ["metrics.sinks=[wandb]"])
    with pytest.raises(ConfigError, match=r"slipstream\[wandb\]"):
        uvloop.run(train.train(cfg, tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # no run directory, no process


class FakeRun:
    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, float], int]] = []
        self.finished = 0

    def log(self, data: dict[str, float], step: int) -> None:
        self.logged.append((data, step))

    def finish(self) -> None:
        self.finished += 1


def test_wandb_runs_offline_in_the_run_directory_one_log_per_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fake wandb (real wandb is not exercised by the suite): what the sink calls, with what."""
    inits: list[dict[str, Any]] = []
    run = FakeRun()

    def init(**kwargs: Any) -> FakeRun:
        inits.append(kwargs)
        return run

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # found, as an installed package is
    fake.init = init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)

    run_dir = tmp_path / "train-1"
    run_dir.mkdir()
    config = MetricsConfig(sinks=["wandb", "wandb"], wandb_project="grpo")  # named twice: opened once
    sinks = open_sinks(config, run_dir, run_config={"steps": 2})
    sinks.write(0, RECORD)
    sinks.write(1, {"reward_mean": 0.5})
    assert run.finished == 0
    sinks.close()
    assert inits == [
        {"mode": "offline", "dir": str(run_dir), "project": "grpo", "name": "train-1", "config": {"steps": 2}}
    ]
    assert run.logged == [(scalars(RECORD), 0), ({"reward_mean": 0.5}, 1)]
    assert run.finished == 1
