"""Rewards written for other frameworks, unchanged (tests/cli/test_train_rewards.py runs them in a train)."""

from __future__ import annotations

from typing import Any


def trl_length(prompts: list[Any], completions: list[str], **kwargs: Any) -> list[float | None]:
    """TRL's batched convention: every completion of the call at once, dataset columns as lists."""
    assert len(prompts) == len(completions) and all(len(v) == len(completions) for v in kwargs.values())
    return [(len(c) % 5) / 4 for c in completions]


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """verl's convention: the run's task as the data source, the row's answer as the ground truth."""
    return (0.5 if data_source == "chain_sum" else 0.0) + (0.25 if ground_truth not in (None, "") else 0.0)
