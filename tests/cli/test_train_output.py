"""What `slipstream train` shows and leaves as it runs: a line per step on stdout, and the metric sinks.

One real 2-step run of the command on the tiny model (conftest.py), in its own process with stdout a pipe,
as under nohup, a scheduler or `| tee`: there the progress bars are off. Each step's line must come as the
step finishes — while the run is still going, its record already in metrics.jsonl — and before the closing
table. Where tensorboard is installed the same run has `metrics.sinks=[tensorboard]`, and its event files,
read back by TensorBoard's own reader, must hold every step's numbers as metrics.jsonl does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from slipstream.runtime.sinks import scalars
from tests.cli.conftest import config

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
SINKS = ["tensorboard"] if importlib.util.find_spec("tensorboard") else []
STEP = re.compile(
    r"^step (?P<i>\d+)/2  reward (?P<reward>\S+)  correct (?P<correct>\S+)  (?P<tokens>\d+) tok  "
    r"(?P<step_s>[\d.]+) s \(rollout [\d.]+, reward [\d.]+, learn [\d.]+, sync [\d.]+(, ckpt [\d.]+)?\)"
    r"(  reward calls (?P<calls>\d+)%)?  "
    r"(no speculation|accept (?P<accept>[\d.]+) on (?P<share>\d+)% of tokens)$"
)


@pytest.fixture(scope="module")
def run(tiny_chat: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The run: its directory, its stdout lines, and for each, the run's state the moment it was read."""
    root = tmp_path_factory.mktemp("output")
    cfg = config(
        tiny_chat,
        steps=2,
        prompts_per_step=2,
        max_tokens=16,
        drafter={"enabled": False},
        rollout={"devices": 1},
        metrics={"sinks": SINKS},
    )
    config_file = root / "run.yaml"  # JSON is YAML
    config_file.write_text(json.dumps(msgspec.to_builtins(cfg)))
    run_dir = root / "run"
    exe = shutil.which("slipstream")
    command = [exe] if exe else [sys.executable, "-m", "slipstream.cli.main"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
    }
    env.pop("PYTHONUNBUFFERED", None)  # stdout block-buffered into the pipe, as a user's run has it
    with (root / "stderr.txt").open("w") as stderr:
        child = subprocess.Popen(
            [*command, "train", str(config_file), "--run-dir", str(run_dir)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        lines = []
        try:
            assert child.stdout is not None
            for line in child.stdout:
                metrics = run_dir / "metrics.jsonl"
                lines.append(
                    {
                        "text": line.rstrip("\n"),
                        "records": len(metrics.read_text().splitlines()) if metrics.is_file() else 0,
                        "finished": (run_dir / "summary.json").is_file(),
                    }
                )
            assert child.wait(timeout=60) == 0, (root / "stderr.txt").read_text()[-3000:]
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"dir": run_dir, "lines": lines, "records": records}


def test_each_step_prints_its_line_as_it_finishes_when_stdout_is_a_pipe(run: dict[str, Any]) -> None:
    texts = [line["text"] for line in run["lines"]]
    steps = [i for i, text in enumerate(texts) if re.match(r"step \d", text)]
    assert len(steps) == 2, texts
    table = texts.index(next(t for t in texts if t.split()[:2] == ["step", "reward"]))  # the closing table
    assert steps[0] < steps[1] < table, texts
    first = run["lines"][steps[0]]
    # Flushed at once: read while the run goes on, step 1's record written and step 2's not yet.
    assert first["records"] == 1 and not first["finished"], first
    for i, (at, record) in enumerate(zip(steps, run["records"], strict=True)):
        m = STEP.match(texts[at])
        assert m is not None, texts[at]
        assert int(m["i"]) == i + 1
        assert m["reward"] == f"{record['reward_mean']:.3f}"
        assert m["correct"] == f"{record['correct_share']:.3f}"
        assert int(m["tokens"]) == record["tokens"]
        assert m["step_s"] == f"{record['step_s']:.1f}"
        # The verifier's calls reached the step's record ahead of its last reward: one a sample here.
        terms = record["reward_terms"]
        assert list(terms) == ["brevity"] and terms["brevity"]["samples"] == terms["brevity"]["calls"] == 8
        assert terms["brevity"]["batch_max"] == 1 and terms["brevity"]["seconds"] > 0
        assert m["calls"] == f"{100 * record['reward_call_s'] / record['step_s']:.0f}"
        # What speculation did where it ran, not an average that counts the tuner's plain iterations as 1.0.
        if record["spec_token_share"]:
            assert m["accept"] == f"{record['spec_accept_length']:.2f}"
            assert m["share"] == f"{100 * record['spec_token_share']:.0f}"
        else:
            assert m["accept"] is None and record["spec_accept_length"] == 0.0


@pytest.mark.skipif(not SINKS, reason="tensorboard is not installed: pip install 'slipstream[tensorboard]'")
def test_the_tensorboard_sink_holds_every_steps_numbers_as_metrics_jsonl(run: dict[str, Any]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run["dir"] / "tensorboard"))
    events.Reload()
    got = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    want: dict[str, list[tuple[int, float]]] = {}
    for record in run["records"]:
        for tag, value in scalars(record).items():
            want.setdefault(tag, []).append((record["step"], value))
    assert set(got) == set(want) and {"reward_mean", "tokens", "learn_s"} <= set(got)
    assert any(tag.startswith("arms/") for tag in got)
    for tag, values in want.items():  # event files hold float32
        assert got[tag] == [(s, pytest.approx(v, rel=1e-6, abs=1e-6, nan_ok=True)) for s, v in values], tag
