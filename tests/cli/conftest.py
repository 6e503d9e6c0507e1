"""Fixtures of the `train` tests: a tiny random model with SmolLM2's tokenizer and chat template, and the
3-step config they share (real processes, a real reasoning-gym scorer plus a length term)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest

from slipstream.cli import train
from slipstream.engine import hub
from slipstream.tasks.rewards import reasoning_gym
from tests.engine.conftest import build_checkpoint


def brevity(prompt: str, completion: str, **row: Any) -> float:
    """The task's own score, plus a term that differs between samples (a random model is never right, and
    never stops before max_tokens)."""
    return reasoning_gym(prompt, completion, **row) + (len(completion) % 3) / 2


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    smol = hub.pull("smollm2-135m")
    vocab = json.loads((smol / "config.json").read_text())["vocab_size"]
    path = build_checkpoint(
        tmp_path_factory.mktemp("tiny-chat"),
        vocab_size=vocab,
        eos_token_id=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,  # as SmolLM2: the head is the embedding, and its packed copy must follow
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(smol / name, path / name)
    return path


def config(model: Path, **overrides: Any) -> train.TrainConfig:
    base = {
        "model": str(model),
        "task": "chain_sum",
        "task_options": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        "reward": "tests.cli.conftest:brevity",
        "steps": 3,
        "prompts_per_step": 3,  # 2 groups on one device, 1 on the other: an idle window to lease
        "group_size": 4,
        "max_tokens": 48,
        "temperature": 1.0,
        "checkpoint_every": 2,
        "drafter": {"batch_tokens": 64},
        # Every rollout re-hashes its weights after each update against the learner's checksums, so each
        # acknowledged version below asserts bitwise-equal weights across the processes.
        "rollout": {"verify_weights": True},
        "learner": {"threads": 1, "optim": {"lr": 1e-3}},
    }
    return msgspec.convert({**base, **overrides}, train.TrainConfig)
