"""`slipstream train` with multi-turn episodes (issue 42): real processes, a tiny random model, one run.

The run (2 steps, 2 rollouts, one environment actor of tests/cli/multiturn_env.py: two turns an episode)
SIGKILLs its environment actor at the first reply (the episode kills its own process, once). The run must
restart it, its rollouts replay the lost episodes from their start, and every sample is recorded once,
none invalid; the record holds each sample's policy mask (two runs of policy tokens, the environment's
answer between them at log-prob 0), the opening as the prompt, two turns a sample, and the environment's
reward where it gave one, else the verifier's on the transcript; each turn's environment wait in the
step record (summed, most, turns by count), as `env_wait` spans, and in `report` (its rows and turns
chart) and `trace` of the same run. A bad `environment:` section fails at start, naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import uvloop

from slipstream.cli import main as cli_main
from slipstream.cli import report, train
from slipstream.engine.tokenizer import Tokenizer
from slipstream.rl import run_config
from slipstream.runtime.spans import read_spans
from tests.cli.conftest import brevity, config, recorded_samples
from tests.cli.multiturn_env import env_reward

pytestmark = pytest.mark.timeout(300)

STEPS = 2


@pytest.fixture(scope="module")
def run(tiny_chat: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[run_config.TrainConfig, Path]:
    root = tmp_path_factory.mktemp("multiturn")
    marker = root / "killed"
    cfg = config(
        tiny_chat, steps=STEPS, prompts_per_step=3, group_size=2, max_tokens=48, checkpoint_every=0,
        checkpoint_hf=False, drafter={"enabled": False},
        environment={"env": "tests.cli.multiturn_env:Relay", "options": {"turns": 2, "kill_marker": str(marker)},
                     "max_turn_tokens": 6, "turn_timeout_s": 10},
    )  # fmt: skip
    uvloop.run(train.train(cfg, root / "run"))
    assert marker.is_file()  # the environment actor was killed
    return cfg, root / "run"


def steps_of(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_killed_environment_is_restarted_and_every_episode_recorded_once(run: Any) -> None:
    cfg, run_dir = run
    steps = steps_of(run_dir)
    assert [s["step"] for s in steps] == list(range(STEPS))
    assert [s["restarts"] for s in steps] == [["environment:0"], []]
    assert all(s["invalid"] == 0 for s in steps), [s["reward_errors"] for s in steps]
    samples = recorded_samples(run_dir, STEPS)  # each (step, group, sample) once, or it fails
    assert len(samples) == STEPS * cfg.prompts_per_step * cfg.group_size
    replayed = sum(
        json.loads(line)["event"] == "episode_replayed"
        for rank in range(cfg.rollout.devices)
        for line in (run_dir / "logs" / f"rollout-{rank}.jsonl").read_text().splitlines()
    )
    assert replayed > 0  # the lost episodes were played again from their start
    ups = [json.loads(line) for line in (run_dir / "logs" / "environment-0.jsonl").read_text().splitlines()]
    assert len({e["incarnation"] for e in ups if e["event"] == "environment_up"}) == 2


def test_masks_turns_openings_and_rewards_are_recorded(run: Any) -> None:
    cfg, run_dir = run
    steps = steps_of(run_dir)
    assert [(s["turns_mean"], s["turns_max"]) for s in steps] == [(2.0, 2)] * STEPS
    tokenizer = Tokenizer.from_dir(Path(cfg.model))
    rows = run_config.data_stream(cfg, {}).take(STEPS * cfg.prompts_per_step)  # group id g is rows[g]
    by_env = by_verifier = 0
    for step in range(STEPS):
        for line in (run_dir / "samples" / f"step-{step}.jsonl").read_text().splitlines():
            s = json.loads(line)
            row = rows[s["group_id"]]
            opening = tokenizer.apply_chat_template([{"role": "user", "content": row.question}])
            assert s["prompt_ids"] == opening  # the group's prompt is the episode's rendered opening
            mask, logprobs, ids = s["policy_mask"], s["logprobs"], s["token_ids"]
            assert len(mask) == len(ids) == len(logprobs)
            runs = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
            assert len(runs) == 2 and mask[0] == 1 and 0 in mask  # turn, the environment's answer, turn
            assert all(lp == 0.0 for m, lp in zip(mask, logprobs, strict=True) if not m)
            assert all(lp < 0.0 for m, lp in zip(mask, logprobs, strict=True) if m)
            assert "result 1" in tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
            if int(str(row.answer)) % 2 == 1:  # the environment's reward, from the last turn's text
                last = ids[runs[1] :]
                assert s["reward"] == env_reward(tokenizer.decode(last, skip_special_tokens=True))
                by_env += 1
            else:  # none: the run's reward scored the transcript
                fields = json.loads(
                    json.dumps({"question": row.question, "answer": row.answer, "metadata": row.metadata})
                )
                text = tokenizer.decode(ids, skip_special_tokens=True)
                assert s["reward"] == brevity(row.question, text, **fields)
                by_verifier += 1
    assert by_env and by_verifier


def test_environment_waits_and_turns_are_in_the_record_the_report_and_the_trace(run: Any) -> None:
    cfg, run_dir = run
    steps = steps_of(run_dir)
    per_step = cfg.prompts_per_step * cfg.group_size
    assert [s["turns_by_count"] for s in steps] == [{"2": per_step}] * STEPS  # every sample, two turns
    for s in steps:  # two turns a sample, each waiting for its answer
        assert 0 < s["env_wait_max_s"] <= s["env_wait_s"] < s["rollout_s"] * per_step, s
    spans = read_spans(run_dir)
    waits = [sp for sp in spans if sp.name == "env_wait"]
    answered = [sp for sp in waits if sp.args["outcome"] == "answered"]
    # Every sample's two turns were answered (the lost ones replayed); the turn that killed its environment
    # (and any other in flight then) was lost.
    assert len(answered) == STEPS * per_step * 2 and {sp.args["turn"] for sp in answered} == {0, 1}
    assert {sp.args["outcome"] for sp in waits} == {"answered", "lost"}
    assert {sp.role for sp in waits} == {"rollout"}
    by_step = [sum(sp.dur_ns for sp in waits if sp.step == s["step"]) / 1e9 for s in steps]
    assert by_step == pytest.approx([s["env_wait_s"] for s in steps], abs=0.01)  # the record sums the spans

    pytest.importorskip("matplotlib")
    rows = dict(report.header_rows(report.load_run(run_dir)))
    assert rows["turns per sample"] == f"mean 2.00, max 2; samples by turns (all steps) 2: {STEPS * per_step}"
    wait = rows["environment wait"]
    assert " s a step (summed over samples), " in wait and "% of the samples' time in the rollout" in wait
    assert cli_main.main(["report", str(run_dir), "-o", str(run_dir / "report")]) == 0
    assert "<th>environment wait</th>" in (run_dir / "report" / report.HTML_NAME).read_text()
    assert (run_dir / "report" / "turns.png").is_file()  # the turns chart, from the real record

    assert cli_main.main(["trace", str(run_dir), "-o", str(run_dir / "trace.json")]) == 0
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    drawn = [e for e in events if e.get("name") == "env_wait" and e["ph"] == "X"]
    assert len(drawn) == len(waits) and all(e["args"]["episode"] for e in drawn)
    assert all(lanes[e["pid"], e["tid"]].startswith("environment waits ") for e in drawn)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("environment.env=no_such_module:Env", "environment: env: "),
        ("environment.env=slipstream.tasks.environments:Calculator", None),
        ("environment.max_turns=0", "environment.max_turns: "),
        ("environment.turn_timeout_s=-1", "environment.turn_timeout_s: "),
    ],
)
def test_a_bad_environment_config_fails_at_start_naming_the_field(
    override: str, named: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if named is None:  # a good path with a misspelt option of its factory
        argv = [override, "environment.options={max_cals: 3}"]
        named = "environment: options: "
    else:
        argv = [override]
    assert cli_main.main(["train", *argv, "--run-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert named in err, err
    assert not (tmp_path / "run" / "logs").exists()  # refused before any actor started
