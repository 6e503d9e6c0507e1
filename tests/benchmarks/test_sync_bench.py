"""`bench sync` (benchmarks/sync.py) on a tiny random model: every documented field, deltas applied bitwise
after real optimizer steps, and smaller than the full push at the demo's learning rate, which it takes from
the demo's config."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import yaml

from slipstream.benchmarks import sync
from tests.engine.conftest import build_checkpoint

DEMO = Path(__file__).resolve().parents[2] / "deploy" / "configs" / "demo.yaml"


def test_the_default_learning_rate_is_the_demos() -> None:
    assert sync.DEMO_LR == yaml.safe_load(DEMO.read_text())["learner"]["optim"]["lr"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["", "bfloat16"])
def test_sync_bench_measures_exact_deltas_smaller_than_full_pushes(tmp_path: Path, dtype: str) -> None:
    model = build_checkpoint(tmp_path / "model")
    result = sync.run(str(model), steps=2, dtype=dtype, log=False)
    printed = json.loads(msgspec.json.encode(result))  # JSON-ready as returned
    assert set(printed) == set(sync.SyncResult.__struct_fields__)
    assert printed["push_dtype"] == (dtype or "float32") and printed["lr"] == sync.DEMO_LR
    assert [s["step"] for s in printed["steps"]] == [0, 1]
    for step in printed["steps"]:
        assert set(step) == set(sync.SyncStep.__struct_fields__)
        assert step["exact"] is True
        assert 0 < step["delta_bytes"] < step["full_bytes"] and step["ratio"] > 1
        assert step["full_bytes"] == printed["params"] * (2 if dtype else 4)
        assert 0 < step["changed_share"] <= 1 and step["encode_s"] >= 0 and step["apply_s"] >= 0
    assert printed["mean_ratio"] > 1
