"""`slipstream drafter warmup`'s command line and `drafter.init_from`: the task's options and system prompt
reach the prompts, which are `train`'s; every flag is documented; the demo starts from the shipped drafter
and an unknown drafter name fails at start naming the field. The engine's warmup is stubbed (its own
training and evals are the engine's tests); the tokenizer is SmolLM2's (`hub.pull`, cached).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from slipstream.cli import drafter as drafter_cli
from slipstream.cli.common import packaged_config
from slipstream.cli.main import build_parser, main
from slipstream.engine import hub
from slipstream.engine.tokenizer import Tokenizer
from slipstream.rl import run_config
from slipstream.runtime.config import ConfigError
from slipstream.tasks.datasets import chat_prompt_ids, load_rows

DEMO_OPTIONS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What `drafter warmup` hands the engine's warmup, which does nothing else here."""
    seen: dict[str, Any] = {}

    def fake_warmup(target: Any, train_prompts: Any, eval_prompts: Any, **kwargs: Any) -> dict[str, Any]:
        seen.update(train=train_prompts, eval=eval_prompts, **kwargs)
        return {"steps": kwargs["steps"]}

    monkeypatch.setattr(drafter_cli, "load_model", lambda path: None)
    monkeypatch.setattr(drafter_cli.engine_warmup, "warmup", fake_warmup)
    return seen


def _warmup(tmp_path: Path, *extra: str) -> int:
    argv = ["drafter", "warmup", "--model", "smollm2-135m", "--task", "chain_sum", "--steps", "1"]
    return main([*argv, "--samples", "3", "--eval-samples", "2", "--out", str(tmp_path), *extra])


def test_task_options_and_system_prompt_reach_the_prompts_as_train_builds_them(
    captured: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    system = "Answer with the number."
    assert _warmup(tmp_path, "--task-options", json.dumps(DEMO_OPTIONS), "--system-prompt", system) == 0
    # train's prompts: its data source (load_rows with task_options), then chat_prompt_ids with its system turn
    cfg = run_config.TrainConfig(task="chain_sum", task_options=DEMO_OPTIONS, system_prompt=system, seed=0)
    rows, _ = load_rows(cfg.task, seed=cfg.seed, size=5, options=cfg.task_options)
    tokenizer = Tokenizer.from_dir(hub.resolve("smollm2-135m"))
    expected = [chat_prompt_ids(tokenizer, r.question, system=cfg.system_prompt) for r in rows]
    assert [*captured["train"], *captured["eval"]] == expected
    assert len(captured["train"]) == 3 and len(captured["eval"]) == 2
    for row in rows:  # the demo's family: two one-digit terms
        assert len([t for t in row.question.split() if t.lstrip("-").isdigit()]) == 2
    result = json.loads(capsys.readouterr().out)
    assert result["task_options"] == DEMO_OPTIONS and result["system_prompt"] == system
    assert json.loads((tmp_path / "warmup.json").read_text())["task_options"] == DEMO_OPTIONS


def test_without_options_the_task_defaults_differ(captured: dict[str, Any], tmp_path: Path) -> None:
    assert _warmup(tmp_path) == 0
    default = captured["train"]
    assert _warmup(tmp_path, "--task-options", json.dumps(DEMO_OPTIONS)) == 0
    assert captured["train"] != default


def test_dtype_reaches_the_export(captured: dict[str, Any], tmp_path: Path) -> None:
    import torch

    assert _warmup(tmp_path, "--dtype", "bfloat16") == 0
    assert captured["export_dtype"] is torch.bfloat16


@pytest.mark.parametrize("bad", ["{min_terms: 2}", "[1, 2]"])
def test_bad_task_options_are_refused_naming_the_flag(
    bad: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _warmup(tmp_path, "--task-options", bad)
    assert exit_info.value.code == 2
    assert "--task-options" in capsys.readouterr().err


def test_every_warmup_flag_is_documented() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    drafter = sub.choices["drafter"]
    dsub = next(a for a in drafter._actions if isinstance(a, argparse._SubParsersAction))
    warmup = dsub.choices["warmup"]
    flags = [a for a in warmup._actions if a.option_strings and a.dest != "help"]
    assert {a.dest for a in flags} >= {"task_options", "system_prompt", "dtype"}
    assert [a.dest for a in flags if not a.help] == []


def test_the_demo_starts_from_the_shipped_drafter() -> None:
    cfg = run_config.load_config(packaged_config("demo.yaml"))
    assert cfg.drafter.init_from in hub.DRAFTERS
    assert hub.DRAFTERS[cfg.drafter.init_from].model == cfg.model
    assert cfg.task_options == DEMO_OPTIONS


def test_an_unknown_drafter_fails_at_start_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^drafter: init_from: unknown drafter 'smollm2-135m-chain-sun'"):
        run_config.load_config(packaged_config("demo.yaml"), ["drafter.init_from=smollm2-135m-chain-sun"])
    with pytest.raises(ConfigError, match=r"^drafter: init_from: unknown drafter"):
        run_config.load_config(packaged_config("demo.yaml"), [f"drafter.init_from={tmp_path / 'absent'}"])
    run_config.load_config(packaged_config("demo.yaml"), ["drafter.init_from="])  # "" = untrained: fine
