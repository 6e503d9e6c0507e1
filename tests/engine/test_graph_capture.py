"""Capturing ahead (engine/speculator.py `capture_graphs`, the rollout's warm-up): every fixed-shape key a run
meets, of the Generator's steps and of the EAGLE drafter's rounds, is among the keys captured before it.

On a GPU a key missing from the plan is captured on first use, inside a rollout (0.1-0.7 s an iteration on
an H200, docs/gpu.md); on the CPU the same steps run eagerly and each runner records the keys it ran, so the
plan is checked here against what a real decode met."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from slipstream.engine.drafters.eagle import EagleDrafter
from slipstream.engine.generator import Generator, Request
from slipstream.engine.model import Transformer
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.speculator import SpecConfig, capture_graphs
from slipstream.engine.weights import load_model
from tests.engine.test_eagle_rounds import head_for

ROWS = 8


def requests(vocab: int) -> list[Request]:
    """Seven requests: greedy, sampled, and sampled with top-p (the step's filtered keys), of 6 to 30 new
    tokens (the batch shrinks through the buckets); repeated prompt tokens, so drafts are accepted now and
    then."""
    gen = torch.Generator().manual_seed(5)
    params = [
        SamplingParams(temperature=0.0, seed=0),
        SamplingParams(temperature=0.9, seed=1),
        SamplingParams(temperature=0.9, top_p=0.8, seed=2),
    ]
    return [
        Request(
            request_id=f"q{i}",
            prompt_ids=torch.randint(0, vocab, (4,), generator=gen).tolist() * 2,
            params=dataclasses.replace(params[i % 3], max_tokens=6 + 4 * i),
        )
        for i in range(7)
    ]


def speculative(
    target: Transformer, spec: SpecConfig, device: torch.device
) -> tuple[Generator, EagleDrafter]:
    drafter = EagleDrafter(head_for(target), target, num_slots=ROWS, max_len=96, draft_vocab=12, static=True)
    generator = Generator(
        target,
        num_slots=ROWS,
        max_len=96,
        token_budget=64,
        spec=spec,
        drafters={"eagle": drafter},
        static=True,
    )
    return generator, drafter


@pytest.mark.parametrize("mode", ["reproducible", "rejection"])
def test_every_key_a_run_meets_is_planned(make_checkpoint: Callable[..., Path], mode: str) -> None:
    target = load_model(make_checkpoint("llama", seed=3), dtype=torch.float32)
    spec = SpecConfig(method="eagle", depth=3, topk=1, verify=3, mode=mode)
    generator, drafter = speculative(target, spec, torch.device("cpu"))
    generator.generate(requests(target.config.vocab_size))
    step = generator._static
    assert step is not None and drafter.rounds is not None
    met = step.runner.seen
    assert met <= set(step.keys_for(spec, ROWS)), met - set(step.keys_for(spec, ROWS))
    # The run met what the plan must cover: speculation, top-p rows, several batch buckets.
    assert any(k.nodes > 1 for k in met) and any(k.filtered for k in met)
    assert len({k.batch for k in met}) >= 3
    if mode == "rejection":
        assert any(k.rejection for k in met)
    rounds_met = drafter.rounds.runner.seen
    planned = set(drafter.rounds.keys_for(ROWS, range(1, spec.depth + 1)))
    assert rounds_met and rounds_met <= planned, rounds_met - planned
    assert {key[0] for key in rounds_met} == {"extend", "chain"}
    assert capture_graphs(generator, [(spec, ROWS)], drafter) == 0  # nothing to capture on the CPU


def test_plain_plans_cover_plain_decoding(make_checkpoint: Callable[..., Path]) -> None:
    target = load_model(make_checkpoint("llama", seed=3), dtype=torch.float32)
    generator = Generator(target, num_slots=ROWS, max_len=96, token_budget=64, static=True)
    generator.generate(requests(target.config.vocab_size))
    step = generator._static
    assert step is not None
    planned = set(step.keys_for(None, ROWS))
    assert step.runner.seen <= planned and all(k.nodes == 1 for k in planned)
    # A plan sized for fewer rows than the run decoded at misses the larger buckets: the check can fail.
    assert not step.runner.seen <= set(step.keys_for(None, 2))


@pytest.mark.gpu
def test_after_capturing_ahead_a_run_captures_nothing(make_checkpoint: Callable[..., Path]) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    target = load_model(make_checkpoint("llama", seed=3), dtype=torch.bfloat16, device=device)
    spec = SpecConfig(method="eagle", depth=3, topk=1, verify=3, mode="reproducible")
    generator, drafter = speculative(target, spec, device)
    assert capture_graphs(generator, [(None, ROWS), (spec, ROWS)], drafter) > 0
    step, rounds = generator._static, drafter.rounds
    assert step is not None and rounds is not None
    before = (len(step.runner.keys), len(rounds.runner.keys))
    generator.generate(requests(target.config.vocab_size))
    assert step.runner.seen and (len(step.runner.keys), len(rounds.runner.keys)) == before
