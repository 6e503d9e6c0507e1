"""One seed, one set of samples: `slipstream generate` and a rollout group agree token for token.

`generate` on a prompts file holding one prompt G times, with --seed S, and a `RolloutActor` given
`GenerateRequest(seed=S, num_samples=G)` for that prompt both seed sample i with `sample_seed(S, i)`: with
the same sampling settings, request i of the file and sample i of the group are the same tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.actors import rollout_samples  # where the rollout derives each sample's seed
from slipstream.cli import generate as generate_cmd
from slipstream.cli.main import main
from slipstream.protocols.rollout import Completion, GenerateRequest, SamplingSpec
from tests.actors.test_rollout_actor import drain, make_actor
from tests.engine.conftest import build_checkpoint

PROMPT = [5, 9, 14, 3, 77, 5, 9]
SAMPLES = 5
SEED = 123_456_789
MAX_TOKENS = 16
TEMPERATURE, TOP_K = 1.0, 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", seed=3)


def generated(capsys: pytest.CaptureFixture[str], model: Path, tmp_path: Path) -> list[list[int]]:
    """Token ids of `slipstream generate` over the prompt repeated SAMPLES times, in file order."""
    prompts = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"id": f"s{i}", "prompt_ids": PROMPT}) for i in range(SAMPLES)]
    prompts.write_text("\n".join(lines) + "\n")
    argv = ["generate", "--model", str(model), "--prompts", str(prompts), "--json", "--seed", str(SEED)]
    sampling = ["--temperature", str(TEMPERATURE), "--top-k", str(TOP_K), "--max-tokens", str(MAX_TOKENS)]
    capsys.readouterr()  # drop what came before (an in-process actor logs to stdout)
    assert main([*argv, *sampling]) == 0
    records: list[dict[str, Any]] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["id"] for r in records] == [f"s{i}" for i in range(SAMPLES)]
    return [r["token_ids"] for r in records]


def rolled_out(model: Path, run_dir: Path) -> list[list[int]]:
    """Token ids of one rollout group (plain decoding: the "off" arm only), sample i at index i."""
    actor, out = make_actor(model, run_dir, max_batch=SAMPLES, tuner={"arms": ["off"]})
    request = GenerateRequest(
        group_id=0,
        prompt_ids=torch.tensor(PROMPT),
        num_samples=SAMPLES,
        seed=SEED,
        sampling=SamplingSpec(temperature=TEMPERATURE, top_k=TOP_K, max_tokens=MAX_TOKENS),
        policy_version=0,
    )
    actor.on_generate(request, "coordinator")
    drain(actor)
    samples = {c.sample_index: c.token_ids.tolist() for c in out.of(Completion)}
    assert sorted(samples) == list(range(SAMPLES))
    return [samples[i] for i in range(SAMPLES)]


def test_generate_and_a_rollout_group_give_the_same_samples_for_one_seed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, model_dir: Path, tmp_path: Path
) -> None:
    group = rolled_out(model_dir, tmp_path / "run")
    assert all(len(tokens) == MAX_TOKENS for tokens in group)
    assert len({tuple(tokens) for tokens in group}) == SAMPLES  # each sample has its own seed
    assert generated(capsys, model_dir, tmp_path) == group

    # Planted: either side back on its old derivation. The same comparison catches each.
    with monkeypatch.context() as planted:
        planted.setattr(generate_cmd, "sample_seed", lambda seed, index: seed * 2**32 + index)
        assert generated(capsys, model_dir, tmp_path) != group
    with monkeypatch.context() as planted:
        planted.setattr(
            rollout_samples, "sample_seed", lambda seed, index: (seed << 20 | index) & (2**63 - 1)
        )
        assert rolled_out(model_dir, tmp_path / "planted") != group
