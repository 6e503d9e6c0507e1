"""`bench rollout` end to end on a tiny model: all three modes, real processes, the JSON it promises.

Speed figures on a tiny random model mean nothing; what is asserted is the machinery: every mode decodes
the same responses (reproducible verification), idle devices are leased to the drafter actors and the
leases are preempted, and the JSON carries every field the benchmark documents.
"""

import json
from pathlib import Path

import pytest
import torch

from slipstream.benchmarks import rollout
from slipstream.engine import eagle_export
from slipstream.engine.config import ModelConfig
from slipstream.engine.eagle import EagleHead
from tests.engine.conftest import build_checkpoint


@pytest.mark.timeout(300)
def test_bench_rollout_runs_all_modes_on_the_same_responses(tmp_path: Path) -> None:
    model = build_checkpoint(tmp_path / "model")
    config = ModelConfig.from_dict(json.loads((model / "config.json").read_text()))
    torch.manual_seed(0)
    eagle_export.export(EagleHead.for_target(config), config, tmp_path / "drafter", version=1)

    trace = tmp_path / "iterations.jsonl"
    result = rollout.run(
        str(model), prompts=4, samples=3, max_tokens=48, steps=3, drafter=tmp_path / "drafter", trace=trace
    )

    assert result["identical_outputs"] is True
    assert result["differing_responses"] == {"plain": 0, "ngram": 0, "adaptive": 0}
    assert set(result["modes"]) == {"plain", "ngram", "adaptive"}
    for mode, figures in result["modes"].items():
        assert figures["tokens"] > 0 and figures["makespan_s"] > 0, mode
        assert set(figures) >= {
            "makespan_s",
            "tokens_per_s",
            "accept_length",
            "idle_device_s",
            "reclaimed_share",
        }
        assert sum(figures["finish_reasons"].values()) == 12
        # Steps 2 and 3 are measured and summed.
        assert figures["measured_steps"] == 2 and len(figures["step_makespans_s"]) == 3
        assert figures["makespan_s"] == pytest.approx(sum(figures["step_makespans_s"][1:]), abs=2e-3)
        assert sum(figures["decode_s"].values()) > 0
        assert sum(figures["bucket_device_share"].values()) == pytest.approx(1.0, abs=0.01)
        assert set(figures["bucket_tokens_per_s"]) == set(figures["bucket_device_share"])
        assert all(rate > 0 for rate in figures["bucket_tokens_per_s"].values())
    assert {arm for arms in result["modes"]["plain"]["arms"].values() for arm in arms} == {"off"}
    adaptive = result["modes"]["adaptive"]
    # The rank that drains first gets a lease, which the end of the phase preempts.
    assert len(adaptive["preempt_ms"]) >= 1
    assert result["speedup"] > 0 and result["ngram_speedup"] > 0
    assert len(result["speedup_per_step"]) == 3
    assert set(result["speedup_per_bucket"]) <= set(result["modes"]["plain"]["bucket_tokens_per_s"])
    assert all(ratio > 0 for ratio in result["ngram_speedup_per_bucket"].values())
    # The trace holds every decode iteration of every mode and step, each with its arm and timing.
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert {row["mode"] for row in rows} == {"plain", "ngram", "adaptive"}
    assert {row["group_base"] for row in rows} == {0, 10_000, 20_000}
    assert all(row["iter_s"] > 0 and row["batch_size"] >= 1 for row in rows)
    assert {row["arm"] for row in rows if row["mode"] == "plain"} == {"off"}
