"""`bench rollout` end to end on a tiny model: all three modes, real processes, the JSON it promises; and
its configuration: the packaged YAML, the flags and overrides, errors that name the field.

Speed figures on a tiny random model mean nothing; what is asserted is the machinery: every mode decodes
the same responses (reproducible verification), idle devices are leased to the drafter actors and the
leases are preempted, and the JSON carries every field the benchmark documents.
"""

import argparse
import json
import re
from pathlib import Path

import msgspec
import pytest
import torch

from slipstream.benchmarks import rollout
from slipstream.cli import bench
from slipstream.cli.common import packaged_config
from slipstream.cli.main import main
from slipstream.engine import eagle_export
from slipstream.engine.config import ModelConfig
from slipstream.engine.eagle import EagleHead
from slipstream.runtime.config import load
from tests.engine.conftest import build_checkpoint


@pytest.mark.timeout(300)
def test_bench_rollout_runs_all_modes_on_the_same_responses(tmp_path: Path) -> None:
    model = build_checkpoint(tmp_path / "model")
    config = ModelConfig.from_dict(json.loads((model / "config.json").read_text()))
    torch.manual_seed(0)
    eagle_export.export(EagleHead.for_target(config), config, tmp_path / "drafter", version=1)

    trace = tmp_path / "iterations.jsonl"
    config = rollout.RolloutBenchConfig(
        model=str(model), prompts=4, samples=3, max_tokens=48, steps=3, drafter=str(tmp_path / "drafter")
    )
    result = json.loads(msgspec.json.encode(rollout.run(config, trace=trace)))  # what --json prints

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


def test_the_packaged_config_is_the_structs_defaults() -> None:
    assert (
        load(packaged_config("bench-rollout.yaml"), rollout.RolloutBenchConfig)
        == rollout.RolloutBenchConfig()
    )


def test_flags_and_overrides_map_onto_the_config(tmp_path: Path) -> None:
    path = tmp_path / "bench.yaml"
    path.write_text("prompts: 2\nsamples: 2\ntuner:\n  arms:\n    ngram: ['off', 'ngram:d5']\n")
    parser = argparse.ArgumentParser()
    bench.rollout_arguments(parser)  # `slipstream bench rollout`'s flags
    args = parser.parse_intermixed_args(
        ["--config", str(path), "--prompts", "4", "--modes", "plain,ngram", "--model", "true", "steps=2",
         "--max-tokens", "128", "drafter_actors.batch_tokens=256", "samples=3"]
    )  # fmt: skip
    config = bench.rollout_config(args)
    assert (config.prompts, config.samples, config.steps, config.max_tokens) == (4, 3, 2, 128)
    assert config.modes == ["plain", "ngram"] and config.model == "true"  # a flag's value is never re-typed
    assert config.tuner.arms.ngram == ["off", "ngram:d5"] and config.tuner.arms.plain == ["off"]
    assert config.drafter_actors.batch_tokens == 256 and config.temperature == 0.7


@pytest.mark.parametrize(
    ("yaml_text", "argv", "message"),
    [
        ("", ["prompts=many"], r"prompts: expected `int`, got `str`"),
        ("", ["--prompts", "0"], r"prompts: expected `int` >= 1"),
        ("drafter_actors:\n  batch_token: 8\n", [], r"drafter_actors\.batch_token: unknown field"),
        ("", ["tuner.arms.ngram=[off]"], r"tuner\.arms\.ngram\[0\]: expected `str`, got `bool`"),
        (
            "",
            ['tuner.arms.adaptive=["off", "eagle:x"]'],
            r"tuner\.arms: adaptive\[1\]: 'eagle:x' is not an arm",
        ),
        ("", ["tuner.buckets=[2, 4]"], r"tuner: buckets: must start at 1"),
        ("", ["--modes", "plain,fast"], r"modes\[1\]: invalid enum value 'fast'"),
        ("", ["rollout_actors.spec_mode=fast"], r"rollout_actors\.spec_mode: invalid enum value 'fast'"),
    ],
)
def test_a_bad_config_fails_at_start_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], yaml_text: str, argv: list[str], message: str
) -> None:
    path = tmp_path / "bench.yaml"
    path.write_text(yaml_text)
    missing = tmp_path / "no-model"  # the config is refused before anything would load it
    assert main(["bench", "rollout", "--json", "--config", str(path), "--model", str(missing), *argv]) == 1
    err = capsys.readouterr().err
    assert re.search(f"^slipstream bench: {message}", err), err
