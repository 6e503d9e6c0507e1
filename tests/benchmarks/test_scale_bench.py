"""`bench scale` at a tiny size through real processes: stand-in rollouts, the real coordinator and verifier,
a learner that holds its groups. The rows must say that every group, sample and token reached the learner,
that the real verifier scored (every other completion ends in a tagged answer: a mean of exactly 0.5),
and that what crossed the coordinator grows with the step."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest

from slipstream.benchmarks import scale
from slipstream.cli.main import build_parser


@pytest.mark.timeout(240)
def test_a_tiny_scale_bench_reaches_the_learner_and_grows_with_the_step(tmp_path: Path) -> None:
    result = scale.run(
        prompts=4, samples=4, tokens=48, fractions=[Fraction(1, 2), Fraction(1)], steps=1, rollouts=2,
        verifier_workers=1, run_dir=tmp_path, say=lambda _: None,
    )  # fmt: skip
    small, full = result.rows
    assert (small.prompts, full.prompts) == (2, 4)
    for row in (small, full):
        assert not row.skipped and not row.failed
        want = row.prompts * row.samples
        assert (row.learner_groups, row.learner_samples, row.learner_tokens) == (row.prompts, want, want * 48)
        assert row.complete
        assert row.reward_mean == 0.5  # answer_format scored every completion, the tagged half 1.0
        assert 0 < row.step_s < 60 and row.step_s_all == [row.step_s]
        assert 0 <= row.first_to_last_completion_s <= row.step_s
        assert 0 <= row.last_completion_to_held_s <= row.step_s
        assert 0 <= row.loop_stall_max_s <= row.step_s
        assert row.coordinator_cpu_s >= 0 and set(row.actor_cpu_s) == set(row.peak_rss_mb) - {"coordinator"}
        assert row.inbound_messages == sum(n for n, _ in row.inbound_by_kind.values()) > 0
        assert row.outbound_bytes == sum(b for _, b in row.outbound_by_kind.values()) > 0
        assert {"rollout:0", "rollout:1", "verifier:0", "learner:0"} <= set(row.peak_rss_mb)
        assert all(mb > 0 for mb in row.peak_rss_mb.values())
        # The stand-ins recorded their drains: a step the learner held must have been sent first.
        assert (tmp_path / f"prompts-{row.prompts}" / scale.RECORD_DIR / "rollout-0.jsonl").is_file()
    # Twice the groups: more crosses the head each way (whatever path bulk data takes, receipts grow too).
    assert full.inbound_bytes > small.inbound_bytes and full.outbound_bytes > small.outbound_bytes
    assert full.inbound_messages > small.inbound_messages
    assert "complete" in scale.render(result)


def test_a_step_the_host_cannot_hold_is_skipped_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    assert scale._unaffordable(1 << 50).startswith("needs ~")  # a petabyte step fits no host
    assert scale._unaffordable(1 << 10) == ""
    monkeypatch.setattr(
        scale, "_unaffordable", lambda payload: "needs ~99 GiB, the host has 1.0 GiB available"
    )
    result = scale.run(prompts=4, samples=2, tokens=8, fractions=[Fraction(1)], say=lambda _: None)
    (row,) = result.rows
    assert row.skipped.startswith("needs ~99 GiB") and not row.complete and row.step_s == 0.0
    assert "skipped: needs ~99 GiB" in scale.render(result)


def test_fractions_parse_and_the_cli_defaults_are_the_modules() -> None:
    assert scale.parse_fractions("1/8, 0.25,1") == [Fraction(1, 8), Fraction(1, 4), Fraction(1)]
    for bad in ("", "0", "3/2", "x", "1/0"):
        with pytest.raises(ValueError, match="--fractions"):
            scale.parse_fractions(bad)
    args = build_parser().parse_args(["bench", "scale", "--json"])
    defaults = scale.run.__kwdefaults__
    assert defaults is not None
    for key in ("prompts", "samples", "tokens", "steps", "rollouts", "verifier_workers"):
        assert getattr(args, key) == defaults[key], key
    assert args.step_timeout == defaults["step_timeout_s"]
    assert tuple(scale.parse_fractions(args.fractions)) == scale.DEFAULT_FRACTIONS
