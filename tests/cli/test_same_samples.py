"""The helper the `train` tests compare two runs' samples with (conftest's `assert_same_samples`): equal runs
pass, a keyed near tie ends the comparison at its step, anything else fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.conftest import assert_same_samples


def _run(root: Path, steps: list[dict[tuple[int, int], tuple[list[int], list[float], float]]]) -> Path:
    (root / "samples").mkdir(parents=True)
    for step, rows in enumerate(steps):
        lines = [
            json.dumps({"group_id": g, "sample_index": i, "token_ids": t, "logprobs": lp, "reward": r})
            for (g, i), (t, lp, r) in rows.items()
        ]
        (root / "samples" / f"step-{step}.jsonl").write_text("\n".join(lines) + "\n")
    return root


BASE = [
    {(0, 0): ([5, 6, 7], [-1.0, -2.0, -3.0], 0.5), (0, 1): ([8, 9], [-1.5, -2.5], 1.0)},
    {(1, 0): ([1, 2, 3], [-0.5, -0.25, -4.0], 0.0), (1, 1): ([4], [-3.0], 0.5)},
]


def test_equal_runs_compare_to_the_end(tmp_path: Path) -> None:
    assert assert_same_samples(_run(tmp_path / "a", BASE), _run(tmp_path / "b", BASE), 2) == 2


def test_a_near_tie_ends_the_comparison_at_its_step(tmp_path: Path) -> None:
    tie = [BASE[0], {**BASE[1], (1, 0): ([1, 2, 9], [-0.5, -0.25 + 1e-6, -4.0], 1.0)}]
    assert assert_same_samples(_run(tmp_path / "a", tie), _run(tmp_path / "b", BASE), 2) == 1
    early = [{**BASE[0], (0, 1): ([8, 3], [-1.5, -0.1], 0.0)}, {(1, 0): ([7], [-9.0], 0.0), **BASE[1]}]
    assert assert_same_samples(_run(tmp_path / "c", early), _run(tmp_path / "d", BASE), 2) == 0


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({(0, 1): ([3, 9], [-1.5, -2.5], 1.0)}, "not by a near tie"),  # another first token: another seed
        ({(0, 0): ([5, 6, 1], [-1.0, -2.1, -3.0], 0.5)}, "not by a near tie"),  # the prefix moved: weights
        ({(0, 0): ([5, 6, 7], [-1.0, -2.0, -3.0], 0.0)}, "another reward"),
    ],
)
def test_other_differences_fail(tmp_path: Path, change: dict, error: str) -> None:
    other = [{**BASE[0], **change}, BASE[1]]
    with pytest.raises(AssertionError, match=error):
        assert_same_samples(_run(tmp_path / "a", other), _run(tmp_path / "b", BASE), 2)


def test_a_missing_sample_fails(tmp_path: Path) -> None:
    lost = [BASE[0], {(1, 0): BASE[1][(1, 0)]}]
    with pytest.raises(AssertionError, match="only in one run"):
        assert_same_samples(_run(tmp_path / "a", lost), _run(tmp_path / "b", BASE), 2)
