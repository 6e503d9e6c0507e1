"""The decode path on one device: the batch plan, the generator (plain and speculative) and reproducible
sampling, each run on the `device` fixture (cpu, and cuda under the gpu marker).

A pre-forward hook checks that every tensor the generator hands the model — ids, positions, the layout's
index tensors and masks — is on the model's device; on CUDA a stray CPU tensor in sampling or
verification raises, so the cuda case checks the rest. The reproducible test is the device's own
identity: the same seeds give the same tokens with speculation off, on with n-gram chains and trees, and
on with a replay of the recorded run, on the same device (float64, so no float32 near-tie between
differently shaped passes decides a token).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from slipstream.engine.batch import BatchLayout
from slipstream.engine.drafters import NGramDrafter, OracleDrafter
from slipstream.engine.generator import Completion, Generator, Request
from slipstream.engine.kv_cache import KVCache
from slipstream.engine.model import Transformer
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.speculator import SpecConfig
from slipstream.engine.tree import tree_attention_mask
from slipstream.engine.weights import load_model
from tests.engine.test_spec_lossless import repetitive_requests


def on(device: torch.device, *tensors: Tensor | None) -> bool:
    """Every given tensor is on `device`'s kind ("cuda" names no index; a tensor's device is "cuda:0")."""
    return all(t.device.type == device.type for t in tensors if t is not None)


def layout_tensors(layout: BatchLayout) -> list[Tensor | None]:
    tensors = [layout.positions, layout.write_slots, layout.write_positions, layout.logit_rows]
    for group in layout.groups:
        tensors += [group.slot_index, group.query_index, group.token_rows, group.output_index, group.mask]
    return tensors


@pytest.fixture
def model(make_checkpoint: Callable[..., Path], device: torch.device) -> Transformer:
    """A float64 tiny Llama on `device` whose every forward checks its inputs' device."""
    model = load_model(make_checkpoint("llama", seed=11), dtype=torch.float64, device=device)

    def check(_: torch.nn.Module, args: tuple[Any, ...]) -> None:
        input_ids, positions, layout, cache = args
        assert on(device, input_ids, positions, *layout_tensors(layout), *cache.keys, *cache.values)

    model.register_forward_pre_hook(check)
    return model


def test_batch_layout_is_made_on_the_cache_device(device: torch.device) -> None:
    """Decodes, a tree, a gather-mode group and a long chunk: every plan tensor on the cache's device, with
    the values of the same plan on the CPU."""
    plans = []
    for where in (torch.device("cpu"), device):
        cache = KVCache(num_layers=1, num_slots=8, max_len=128, num_kv_heads=1, head_dim=4, device=where)
        slots = [cache.allocate() for _ in range(8)]
        for slot, length in zip(slots, [5, 3, 0, 7, 2, 9, 4, 1], strict=True):
            cache.set_length(slot, length)
        tree = tree_attention_mask(torch.tensor([-1, 0, 0, 1], device=where), depth=2)
        # Slot 1 decodes, slots 0 and 7 take 2 tokens (a gather: too far apart for a view), slot 3
        # verifies a 4-node tree, slot 2 prefills a 70-token chunk alone.
        layout = BatchLayout.build(
            cache, [0, 1, 3, 7, 2], [2, 1, 4, 2, 70], tree_masks=[None, None, tree, None, None]
        )
        plans.append(layout)
        if where == device:
            assert on(device, *layout_tensors(layout))
    cpu, dev = plans
    for a, b in zip(layout_tensors(cpu), layout_tensors(dev), strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b.cpu())
    assert dev.positions.tolist()[3:7] == [7, 8, 8, 9]  # tree nodes at start + depth
    assert any(g.slot_index is not None for g in dev.groups) and any(
        g.query_index is not None for g in dev.groups
    )


def mixed_params(rng: random.Random, i: int) -> SamplingParams:
    """Greedy and sampled rows with top-p / top-k, distinct seeds."""
    return SamplingParams(
        temperature=rng.choice([0.0, 0.6, 1.0]),
        top_p=rng.choice([1.0, 0.9]),
        top_k=rng.choice([0, 20]),
        seed=500 + i,
        max_tokens=rng.randint(4, 20),
    )


def mixed_requests(count: int, seed: int) -> list[Request]:
    """Sibling groups sharing a repeated-motif prompt (the n-gram drafter has matches), mixed params."""
    return repetitive_requests(count, seed, mixed_params)


def run(model: Transformer, requests: list[Request], **kwargs: Any) -> tuple[list[Completion], dict]:
    gen = Generator(model, num_slots=8, token_budget=40, eos_token_ids=(), **kwargs)
    assert gen.cache.device.type == model.embed_tokens.weight.device.type
    completions = gen.generate(requests)
    return completions, gen.stats


def test_plain_generator_runs_on_the_device(model: Transformer, device: torch.device) -> None:
    requests = mixed_requests(12, seed=1)
    completions, stats = run(model, requests, return_hidden=True)
    assert stats["committed"] == sum(len(c.token_ids) for c in completions)
    for completion in completions:
        # Hidden states leave the device once, with the completion.
        assert completion.hidden is not None and completion.hidden.device.type == "cpu"
        assert len(completion.logprobs) == len(completion.token_ids)
        assert all(lp <= 0 for lp in completion.logprobs)


@pytest.mark.parametrize("mode", ["rejection", "reproducible"])
def test_speculative_generator_runs_on_the_device(
    model: Transformer, device: torch.device, mode: str
) -> None:
    """n-gram chains and trees verified on the device, in both modes; drafts are made there too."""
    requests = mixed_requests(12, seed=2)
    for shape in ({"depth": 3}, {"depth": 3, "topk": 2, "verify": 6}):
        spec = SpecConfig(method="ngram", mode=mode, **shape)
        completions, stats = run(
            model, requests, spec=spec, drafters={"ngram": NGramDrafter(device=device)}, return_hidden=True
        )
        assert stats["accepted"] > 0 and stats["drafted"] > stats["accepted"], shape  # both paths ran
        for completion, request in zip(completions, requests, strict=True):
            assert completion.hidden is not None and completion.hidden.device.type == "cpu"
            assert 1 <= len(completion.token_ids) <= request.params.max_tokens


def test_reproducible_sampling_gives_the_same_tokens_with_and_without_speculation(
    model: Transformer, device: torch.device
) -> None:
    """The same seeds, the same tokens on this device: speculation off, n-gram chain and tree in
    reproducible mode, and a replay of the recorded run (every draft accepted)."""
    requests = mixed_requests(16, seed=3)
    reference, _ = run(model, requests)
    replay = OracleDrafter({c.request_id: c.prompt_ids + c.token_ids for c in reference}, device=device)
    for method, shape in [
        ("ngram", {"depth": 3}),
        ("ngram", {"depth": 4, "topk": 3, "verify": 8}),
        ("self", {"depth": 5}),
    ]:
        drafters = {"self": replay} if method == "self" else {"ngram": NGramDrafter(device=device)}
        spec = SpecConfig(method=method, mode="reproducible", **shape)
        completions, stats = run(model, requests, spec=spec, drafters=drafters)
        for completion, ref in zip(completions, reference, strict=True):
            assert completion.token_ids == ref.token_ids, (method, shape, completion.request_id)
            torch.testing.assert_close(completion.logprobs, ref.logprobs, atol=1e-6, rtol=0)
        sampled = [c for c, r in zip(completions, requests, strict=True) if not r.params.greedy]
        assert sum(c.accepted for c in sampled) > 0, (method, shape)  # drafts survived on sampled rows
        assert stats["target_passes"] < sum(len(c.token_ids) for c in completions)
