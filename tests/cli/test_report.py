"""`slipstream report`: a synthetic run directory in the formats `train` writes, drawn and checked.

The run is built here (metrics records with and without the newer fields, samples files in the real
layout, span files written by the real `SpanRecorder`), so the tests need no training run and no model.
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from slipstream.cli import report
from slipstream.runtime.spans import Span, SpanRecorder

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL_CHARTS = [
    "reward",
    "lengths",
    "speculation",
    "accept_position",
    "arms",
    "drafter_loss",
    "idle",
    "step_time",
    "reward_calls",
    "sync",
    "mismatch",
    "long_tail",
]
ROLLOUT_S = [2.0, 5.0, 3.0]  # step 1 has the longest rollout


def _record(step: int, *, new_fields: bool, baseline: bool = False) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "step": step,
        "reward_mean": 0.2 + 0.1 * step,
        "correct_share": 0.1 + 0.1 * step,
        "nonzero_adv_share": 0.5,
        "invalid": 0,
        "tokens": 700,
        "mean_response_tokens": 22.0,
        "step_s": 20.0 + step,
        "rollout_s": ROLLOUT_S[step],
        "reward_s": 0.05,
        "learn_s": 12.0,
        "sync_s": 1.1,
        "accept_length": 1.0 if baseline else 1.2 + 0.1 * step,
        "arms": {"off": 100} if baseline else {"off": 50, "ngram:d3": 30, "eagle:d3": 20},
        "accept_by_batch": {} if baseline else {"1": 1.5, "3-4": 1.3, "9-16": 2.1},
        "idle_device_s": 1.0 + step,
        "reclaimed_s": 0.0 if baseline else 0.8 + step,
        "loss": 0.03,
        "grad_norm": 1.5,
        "mismatch_logp_abs_max": 0.0 if step == 2 else 4e-5,  # an exact step: drawn at the log axis' floor
        "policy_version": step + 1,
        "reward_errors": {},
        "restarts": [],
        "checkpoint_s": 3.0 if step == 2 else 0.0,
        "requeued": 0,
        "duplicates": 0,
    }
    if new_fields:
        rec["arms_by_batch"] = {
            "1": {"off": 10, "eagle:d3": 5},
            "3-4": {"ngram:d3": 20, "eagle:d3": 15},
            "9-16": {"off": 40, "ngram:d3": 10},
        }
        rec["accept_by_position"] = [0.7, 0.4 - 0.1 * step, 0.2]
        counts = {"iterations": 4, "sequences": 4, "accepted": 4 + step, "drafted": 12, "committed": 8 + step,
                  "seconds": 0.2, "draft_s": 0.004}  # fmt: skip
        rec["arm_table"] = {
            "cascade:d8": {"1": counts},
            "off": {"1": {**counts, "accepted": 0, "drafted": 0}},
        }
        rec["drafter_loss"] = None if step == 0 else 2.0 - 0.3 * step
        rec["sync_bytes"] = 270_000_000
        # A batched judge (its last step's calls all of 6) and a per-completion exact match, 2 s a step.
        judge_max = 8 if step < 2 else 6
        rec["reward_terms"] = {
            "judge": {"calls": 4, "samples": 24, "seconds": 1.5, "batch_mean": 6.0, "batch_max": judge_max,
                      "invalid": 1},
            "exact": {"calls": 24, "samples": 24, "seconds": 0.5, "batch_mean": 1.0, "batch_max": 1, "invalid": 0},
        }  # fmt: skip
        rec["reward_call_s"] = 2.0
    return rec


def make_run(
    root: Path, *, steps: int = 3, new_fields: bool = True, spans: bool = True, baseline: bool = False
) -> Path:
    """A run directory as `slipstream train` leaves it (the parts `report` reads)."""
    run = root / "run"
    (run / "samples").mkdir(parents=True)
    records = [_record(s, new_fields=new_fields, baseline=baseline) for s in range(steps)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = {"device": "cpu", "model": "smollm2-135m", "task": "chain_sum", "steps": steps, "max_tokens": 64}
    config["trace"] = spans
    (run / "config.json").write_text(json.dumps(config))
    (run / "summary.json").write_text(json.dumps({"baseline": baseline, "config": config, "steps": records}))
    for step in range(steps):
        lines = []
        for i in range(8):
            n = 64 if i == 7 else 5 + 3 * i + step  # one cut off at max_tokens
            lines.append(
                {
                    "group_id": i // 4,
                    "sample_index": i % 4,
                    "reward": [1.0, 0.0, None][i % 3],  # None: an invalid sample
                    "text": "x" * n,
                    "token_ids": list(range(n)),
                    "prompt_ids": [1, 2, 3],
                    "logprobs": [-0.5] * n,
                }
            )
        (run / "samples" / f"step-{step}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if spans:
        _write_spans(run, steps)
    return run


def _write_spans(run: Path, steps: int) -> None:
    coord = SpanRecorder(run / "spans" / "coordinator.jsonl", actor="coordinator", role="coordinator")
    rollouts = [
        SpanRecorder(run / "spans" / f"rollout-{r}.jsonl", actor=f"rollout-{r}", role="rollout", rank=r)
        for r in range(2)
    ]
    t = 10**12
    for step in range(steps):
        roll = int(ROLLOUT_S[step] * 1e9)
        coord.add("rollout", t, roll, step)
        for i in range(8):
            start = t + i * 10**8
            dur = roll - i * 10**8 if i == 7 else (3 + i) * 10**8  # the last sample is the long tail
            # Step 0's sample spans carry no step: the report places them by the coordinator's span.
            span_step = None if step == 0 else step
            fields = {"group": i // 4, "index": i % 4, "tokens": 5 + 3 * i, "finish": "stop"}
            rollouts[i % 2].add("sample", start, dur, span_step, **fields)
        # rollout-0 finishes first and idles until the step's last completion, lent to the drafter.
        idle_from = t + 16 * 10**8
        coord.add(
            "device_idle", idle_from, t + roll - idle_from, step, device="rollout-0", lent_to="drafter-0"
        )
        t += roll
        for name, seconds in (("reward", 0.05), ("learn", 12.0), ("sync", 1.1)):
            coord.add(name, t, int(seconds * 1e9), step)
            t += int(seconds * 1e9)
    for rec in (coord, *rollouts):
        rec.close()


def _pngs_in(page: str) -> tuple[set[str], list[bytes]]:
    """The PNG files the page links to, and the PNGs it embeds."""
    linked = set(re.findall(r'href="([\w-]+\.png)"', page))
    embedded = [
        base64.b64decode(b) for b in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    ]
    return linked, embedded


def test_a_traced_run_draws_every_chart_embedded_and_beside_the_page(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    out = tmp_path / "out"
    result = report.build_report(run, out)

    assert result.html == out / report.HTML_NAME
    assert [c.name for c in result.charts] == ALL_CHARTS
    assert [c.missing for c in result.charts] == [None] * len(ALL_CHARTS)
    page = result.html.read_text()
    linked, embedded = _pngs_in(page)
    assert linked == {f"{name}.png" for name in ALL_CHARTS}
    for name in ALL_CHARTS:
        data = (out / f"{name}.png").read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, name
    # The page stands alone: what it embeds is exactly the files written beside it.
    assert sorted(embedded) == sorted((out / f"{name}.png").read_bytes() for name in ALL_CHARTS)
    assert "not recorded" not in page
    for text in ("smollm2-135m", "slipstream", "3 (steps 0–2)", "0.400 (first step 0.200)", "63.0 s"):
        assert text in page, text
    assert "<th>turns per sample</th><td>single-turn run: no environment, no episodes</td>" in page
    assert "<th>environment wait</th>" not in page
    # Reward time per term and its batch sizes, over the run: 6 s of 63 s of steps.
    assert (
        "<th>reward calls</th><td>6.0 s (10% of step time); exact: 1.5 s, 72 calls, batch mean 1.0 (max 1); "
        "judge: 4.5 s, 12 calls, batch mean 6.0 (max 8), 3 invalid</td>"
    ) in page


def test_an_untraced_older_run_says_what_it_did_not_record(tmp_path: Path) -> None:
    run = make_run(tmp_path, new_fields=False, spans=False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "long_tail.png").write_bytes(PNG_MAGIC + b"stale")  # from an earlier report of a traced run
    result = report.build_report(run, out)

    missing = {c.name: c.missing for c in result.charts if c.missing}
    assert set(missing) == {"accept_position", "arms", "drafter_loss", "reward_calls", "long_tail"}
    assert "tracing was off (trace: false)" in missing["long_tail"]
    assert "accept_by_position" in missing["accept_position"]
    assert "no `reward_terms` field" in missing["reward_calls"]
    page = result.html.read_text()
    assert page.count("not recorded in this run") == 5 and "<th>reward calls</th>" not in page
    linked, embedded = _pngs_in(page)
    assert linked == {f"{c.name}.png" for c in result.charts if c.png} and len(embedded) == len(linked)
    assert not (out / "long_tail.png").exists()
    assert not (out / "drafter_loss.png").exists()


def test_turns_rows_of_a_multi_turn_run_and_of_one_from_before_the_wait_fields(tmp_path: Path) -> None:
    recs = [
        {"step": 0, "turns_mean": 1.5, "turns_max": 3, "turns_by_count": {"0": 1, "1": 2, "3": 1},
         "env_wait_s": 2.0, "env_wait_max_s": 0.9},
        {"step": 1, "turns_mean": 1.0, "turns_max": 1, "turns_by_count": {"1": 4}, "env_wait_s": 1.0,
         "env_wait_max_s": 0.4},
    ]  # fmt: skip
    data = report.RunData(tmp_path, recs, {"environment": {"env": "pkg.mod:Env"}}, None, mode="slipstream")
    untraced = dict(report.turns_rows(data))
    # The mean over played samples (7 of them: 9 turns), the histogram summed over the steps.
    assert untraced["turns per sample"] == "mean 1.29, max 3; samples by turns (all steps) 0: 1, 1: 6, 3: 1"
    assert untraced["environment wait"] == (
        "1.50 s a step (summed over samples), share: needs spans; at most 0.90 s for one sample"
    )
    spans = [Span("rollout-0", "rollout", 0, name, 0, int(s * 1e9), 0) for name, s in
             (("sample", 8.0), ("sample", 4.0), ("env_wait", 3.0), ("iteration", 5.0))]  # fmt: skip
    data.spans = spans
    assert (
        "1.50 s a step (summed over samples), 25% of the samples' time in the rollout"
        in dict(report.turns_rows(data))["environment wait"]
    )
    older = [{"step": 0, "turns_mean": 2.0, "turns_max": 2}]
    rows = dict(report.turns_rows(report.RunData(tmp_path, older, {}, None, mode="?")))
    assert rows == {
        "turns per sample": "mean 2.00, max 2; samples by turns: not recorded in this run (before the field)",
        "environment wait": "not recorded in this run (before the field)",
    }


def test_the_turns_chart_is_drawn_for_a_multi_turn_run_and_left_out_of_a_single_turn_one(
    tmp_path: Path,
) -> None:
    single = report.build_report(make_run(tmp_path / "single"))
    assert "turns" not in [c.name for c in single.charts]  # not even as "not recorded": nothing to record
    assert not (single.html.parent / "turns.png").exists() and 'id="turns"' not in single.html.read_text()

    run = make_run(tmp_path / "multi")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for rec, by_count in zip(records, ({"1": 5, "2": 3}, {"2": 6, "4": 2}, {"2": 7, "6": 1}), strict=True):
        samples = sum(by_count.values())
        turns = sum(int(k) * n for k, n in by_count.items())
        rec.update(turns_mean=turns / samples, turns_max=max(map(int, by_count)), turns_by_count=by_count,
                   env_wait_s=0.4 * turns, env_wait_max_s=0.5 * max(map(int, by_count)))  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "environment": {"env": "pkg.envs:Env"}}))
    result = report.build_report(run)
    charts = {c.name: c for c in result.charts}
    assert [c.name for c in result.charts] == [*ALL_CHARTS[:2], "turns", *ALL_CHARTS[2:]]
    assert charts["turns"].missing is None and (run / "report" / "turns.png").read_bytes().startswith(
        PNG_MAGIC
    )
    page = result.html.read_text()
    assert 'id="turns"' in page and "turns.png" in _pngs_in(page)[0]
    # A multi-turn run from before the turn fields: the chart is listed, and says what it lacks.
    for rec in records:
        for key in ("turns_mean", "turns_max", "turns_by_count", "env_wait_s", "env_wait_max_s"):
            del rec[key]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    older = {c.name: c for c in report.build_report(run, tmp_path / "older").charts}
    assert "no `turns_mean` field" in (older["turns"].missing or "")


def test_a_baseline_run_has_no_speculation_chart(tmp_path: Path) -> None:
    run = make_run(tmp_path, baseline=True, spans=False)
    result = report.build_report(run)  # default output: RUN/report

    assert result.html == run / "report" / report.HTML_NAME
    charts = {c.name: c for c in result.charts}
    assert "did not speculate" in (charts["speculation"].missing or "")
    assert charts["idle"].png is not None and charts["reward"].png is not None
    assert "<td>baseline</td>" in result.html.read_text()


def test_sample_spans_are_placed_by_step_and_the_longest_rollout_is_the_default(tmp_path: Path) -> None:
    from slipstream.cli import report_tail

    data = report.load_run(make_run(tmp_path))
    samples = [s for s in data.spans if s.name == "sample"]
    by_step = report_tail.sample_steps(samples, data.spans)
    assert {step: len(spans) for step, spans in by_step.items()} == {0: 8, 1: 8, 2: 8}
    assert report_tail.longest_rollout(data, by_step) == 1
    data.tail_step = 5  # not traced (build_report refuses steps the run does not have)
    assert "no `sample` spans for step 5" in str(report_tail.long_tail(data))


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    report.add_parser(parser.add_subparsers(dest="command"))
    return report.run(parser.parse_args(argv))


def test_the_command_writes_the_page_and_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(tmp_path, spans=False)
    assert _cli(["report", str(run), "-o", str(tmp_path / "o"), "--tail-step", "1"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "o" / report.HTML_NAME) in out
    assert "long_tail: not recorded in this run" in out
    assert _cli(["report", str(run), "--tail-step", "7"]) == 2
    assert "--tail-step 7" in capsys.readouterr().err


@pytest.mark.parametrize("content", [None, "", "\n\n"])
def test_a_missing_or_empty_metrics_file_is_named_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    if content is not None:
        (run / "metrics.jsonl").write_text(content)
    assert _cli(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert str(run / "metrics.jsonl") in err
    assert ("no such file" if content is None else "empty") in err
    assert not (run / "report").exists()


def test_a_torn_last_line_is_skipped_and_a_bad_line_is_named(tmp_path: Path) -> None:
    run = make_run(tmp_path, spans=False)
    metrics = run / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 3, "reward_m')  # a run killed mid-write
    assert [r["step"] for r in report.load_run(run).records] == [0, 1, 2]
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], "not json", *lines[1:]]) + "\n")
    with pytest.raises(report.ReportError, match=r"metrics\.jsonl:2: not a JSON record"):
        report.load_run(run)


def test_without_matplotlib_the_command_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path, spans=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    assert _cli(["report", str(run)]) == 2
    assert "pip install 'slipstream[report]'" in capsys.readouterr().err
    assert not (run / "report").exists()
