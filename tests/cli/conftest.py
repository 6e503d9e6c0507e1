"""What the `train` tests share: the 3-step config (real processes, a real reasoning-gym scorer plus a
length term) over the suite's `tiny_chat` model (tests/conftest.py), and comparing two runs' samples."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from slipstream.benchmarks.soak import near_tie
from slipstream.rl import run_config
from slipstream.tasks.rewards import reasoning_gym


def brevity(prompt: str, completion: str, **row: Any) -> float:
    """The task's own score, plus a term that differs between samples (a random model is never right, and
    never stops before max_tokens)."""
    return reasoning_gym(prompt, completion, **row) + (len(completion) % 3) / 2


def config(model: Path, **overrides: Any) -> run_config.TrainConfig:
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
    return msgspec.convert({**base, **overrides}, run_config.TrainConfig)


Recorded = dict[tuple[int, int, int], tuple[list[int], list[float], float | None]]


def recorded_samples(run_dir: Path, steps: int) -> Recorded:
    """(step, group, sample) -> its tokens, log-probs and reward, as samples/step-N.jsonl and the other learner
    ranks' shares (step-N.rank-R.jsonl) hold them (each once: a sample recorded twice fails here)."""
    out: Recorded = {}
    for step in range(steps):
        shares = [run_dir / "samples" / f"step-{step}.jsonl"]
        shares += sorted((run_dir / "samples").glob(f"step-{step}.rank-*.jsonl"))
        lines = [line for share in shares for line in share.read_text().splitlines()]
        for line in lines:
            r = json.loads(line)
            key = (step, r["group_id"], r["sample_index"])
            assert key not in out, f"{key} recorded twice"
            out[key] = (r["token_ids"], r["logprobs"], r["reward"])
    return out


def assert_same_samples(a: Path, b: Path, steps: int) -> int:
    """Runs `a` and `b` recorded the same samples: every (step, group, sample) once in each, with the same
    tokens and reward (reproducible mode: a sample's tokens follow from its seed and the policy alone).

    Up to a keyed near tie (benchmarks/soak.py `near_tie`): a rollout that decodes in other batch shapes
    (another placement, a restart, the tuner's arms, which follow timing) rounds its float32 logits
    differently by ~1e-6, and a tiny random model's near-uniform distributions put a sampled token that close
    to a tie in about one sample in a few hundred. Such a sample may differ after a shared prefix whose
    log-probs agree within 1e-4; from that step on the two runs train on different samples, so later steps
    are compared only for being complete. Wrong weights or a wrong seed move the prefix or the first token
    and fail. Returns the first step with a near tie (`steps` if none)."""
    got, want = recorded_samples(a, steps), recorded_samples(b, steps)
    assert got.keys() == want.keys(), f"samples only in one run: {sorted(got.keys() ^ want.keys())[:8]}"
    for step in range(steps):
        keys = [k for k in want if k[0] == step]
        differ = [k for k in keys if got[k][0] != want[k][0]]
        for k in differ:
            assert near_tie(got[k][:2], want[k][:2]), f"{k} differs, and not by a near tie"
        for k in keys:
            if k not in differ:
                assert got[k][2] == want[k][2], f"{k}: the same tokens, another reward"
        if differ:
            return step
    return steps
