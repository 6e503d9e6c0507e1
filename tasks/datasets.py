"""Datasets: rows of {question, answer, metadata} from reasoning-gym generators, offline.

reasoning-gym builds item i of a dataset from seed + i, so datasets of neighbouring seeds share items:
take consecutive chunks of one dataset (`rows(task, n, seed)[a:b]`) for disjoint questions, and keep
training and evaluation seeds further apart than their sizes. Nothing is downloaded: every generator
runs locally. `chat_prompt_ids` turns a question into the ids the model is given.

    rows = reasoning_gym_rows("basic_arithmetic", 8, seed=0)
    ids = [chat_prompt_ids(tokenizer, r.question) for r in rows]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from slipstream.engine.tokenizer import Tokenizer


@dataclass(frozen=True, kw_only=True)
class Row:
    """One dataset item: what the model is asked, and what its reward is given."""

    question: str
    answer: Any = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


def _reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as e:
        raise RuntimeError("reasoning-gym is missing: pip install 'slipstream[tasks]'") from e
    return reasoning_gym


def reasoning_gym_rows(task: str, n: int, seed: int, **config: Any) -> list[Row]:
    """`n` items of the reasoning-gym task `task` (`config`: the task's own options, e.g. difficulty)."""
    reasoning_gym = _reasoning_gym()
    try:
        dataset = reasoning_gym.create_dataset(task, size=n, seed=seed, **config)
    except Exception as e:  # reasoning-gym raises several types for an unknown name or option
        raise ValueError(f"reasoning-gym task {task!r} with {config or 'default options'}: {e}") from None
    return [
        Row(question=str(item["question"]), answer=item.get("answer"), metadata=item.get("metadata", {}))
        for item in dataset
    ]


def chat_prompt_ids(tokenizer: Tokenizer, question: str, system: str | None = None) -> list[int]:
    """`question` as one user turn (after an optional system turn) through the model's chat template."""
    messages = [{"role": "system", "content": system}] if system else []
    return tokenizer.apply_chat_template([*messages, {"role": "user", "content": question}])


def task_prompts(task: str, n: int, seed: int, tokenizer: Tokenizer) -> list[list[int]]:
    """`n` reasoning-gym questions of `task`, as chat-templated token ids."""
    return [chat_prompt_ids(tokenizer, row.question) for row in reasoning_gym_rows(task, n, seed)]


__all__ = ["Row", "chat_prompt_ids", "reasoning_gym_rows", "task_prompts"]
