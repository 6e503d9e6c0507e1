"""Every config shipped in deploy/configs loads as what reads it (a run config; bench-rollout.yaml as
`bench rollout`'s): its fields, its reward and environment import paths and their options are checked at
start, so a shipped config that a change broke fails here, not in a user's first run."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.benchmarks import rollout_config as rollout
from slipstream.rl.run_config import load_config

CONFIGS = sorted((Path(__file__).parents[2] / "deploy" / "configs").glob("*.yaml"))


def test_the_configs_are_found() -> None:
    assert {"demo.yaml", "multiturn.yaml", "guess_number.yaml"} <= {p.name for p in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_a_shipped_config_loads(path: Path) -> None:
    if path.stem == "bench-rollout":
        assert rollout.load_config(path).prompts >= 1
        return
    cfg = load_config(path, [])
    assert cfg.steps >= 1 and cfg.model
    if path.stem in ("multiturn", "guess_number"):
        assert cfg.environment is not None and cfg.environment.env.startswith(
            "slipstream.tasks.environments:"
        )
