"""PolicyTrainer: step-0 agreement with the rollout's log-probs, micro-batching, learning, 2 ranks = 1 rank."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slipstream.engine.generator import Generator, Request
from slipstream.engine.grpo import LossConfig
from slipstream.engine.policy_train import OptimConfig, PolicySample, PolicyTrainer, micro_batches
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.weights import load_model

PROMPTS = [[5, 17, 33, 2], [9, 9, 40], [120, 3, 77, 15, 8], [1, 2]]
SAMPLING = [(1.0, 1.0, 0), (0.8, 0.9, 0), (1.2, 1.0, 20), (0.7, 0.85, 12)]  # (temperature, top_p, top_k)


def rollout(model_dir: Path, max_tokens: int = 12) -> list[PolicySample]:
    """Samples from the real generator (its reported log-probs), advantages +1/-1 alternating."""
    model = load_model(model_dir)
    requests = [
        Request(
            request_id=str(i),
            prompt_ids=prompt,
            params=SamplingParams(temperature=t, top_p=p, top_k=k, max_tokens=max_tokens, seed=100 + i),
        )
        for i, (prompt, (t, p, k)) in enumerate(zip(PROMPTS * 2, SAMPLING * 2, strict=True))
    ]
    completions = Generator.for_requests(model, requests, eos_token_ids=()).generate(requests)
    return [
        PolicySample(
            prompt_ids=c.prompt_ids,
            response_ids=c.token_ids,
            behaviour_logprobs=c.logprobs,
            advantage=1.0 if i % 2 == 0 else -1.0,
            temperature=r.params.temperature,
            top_p=r.params.top_p,
            top_k=r.params.top_k,
        )
        for i, (c, r) in enumerate(zip(completions, requests, strict=True))
    ]


def test_micro_batches_respect_the_budget_and_sort_by_length() -> None:
    lengths = [5, 30, 7, 12, 3, 40]
    groups = micro_batches(lengths, budget=40)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 40
    assert groups[0] == [4, 0, 2]  # the shortest first, packed together
    assert [5] in groups  # longer than the budget allows with company: alone


def test_step_zero_logprobs_match_the_rollout_and_ratio_is_one(make_checkpoint) -> None:
    model_dir = make_checkpoint()
    samples = rollout(model_dir)
    trainer = PolicyTrainer(load_model(model_dir), optim=OptimConfig(lr=1e-4))
    stats = trainer.step(samples)
    assert stats["tokens"] == sum(len(s.response_ids) for s in samples) > 0
    assert stats["mismatch_logp_abs_max"] < 1e-4
    assert abs(stats["ratio_max"] - 1) < 1e-4 and abs(stats["ratio_min"] - 1) < 1e-4
    assert stats["clip_frac_low"] == stats["clip_frac_high"] == 0.0


def test_forward_pass_logprobs_match_the_rollout_and_head_rows_match_full_logits(make_checkpoint) -> None:
    model_dir = make_checkpoint()
    samples = rollout(model_dir)
    trainer = PolicyTrainer(load_model(model_dir), optim=OptimConfig(micro_batch_tokens=24))
    logprobs = trainer.logprobs(samples)  # the forward pass `bench e2e` measures the learner against
    for sample, logp in zip(samples, logprobs, strict=True):
        assert logp.shape == (len(sample.response_ids),)
        assert torch.allclose(logp, torch.tensor(sample.behaviour_logprobs), atol=1e-4)
    ids = torch.tensor([[5, 17, 33, 2, 9, 40], [1, 2, 3, 4, 5, 6]])
    full = trainer.model.forward_train(ids).reshape(-1, trainer.model.config.vocab_size)
    rows = torch.tensor([1, 4, 7, 11])
    assert torch.allclose(trainer.model.forward_train(ids, rows=rows), full[rows], atol=1e-6)


def test_a_planted_logprob_shift_is_seen_as_mismatch(make_checkpoint) -> None:
    model_dir = make_checkpoint()
    samples = rollout(model_dir)
    # Log-probs taken one position late: what a rollout bug would report.
    shifted = [
        PolicySample(
            prompt_ids=s.prompt_ids,
            response_ids=s.response_ids,
            behaviour_logprobs=[*s.behaviour_logprobs[1:], s.behaviour_logprobs[0]],
            advantage=s.advantage,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
        )
        for s in samples
    ]
    stats = PolicyTrainer(load_model(model_dir)).step(shifted)
    assert stats["mismatch_logp_abs_max"] > 1e-2


def test_micro_batching_gives_the_same_update(make_checkpoint) -> None:
    model_dir = make_checkpoint()
    samples = rollout(model_dir)
    updated = []
    for budget in (10_000, 16):
        model = load_model(model_dir)
        stats = PolicyTrainer(model, optim=OptimConfig(lr=1e-3, micro_batch_tokens=budget)).step(samples)
        updated.append((stats, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (big, w_big), (small, w_small) = updated
    assert big["loss"] == pytest.approx(small["loss"], abs=1e-6)
    assert big["grad_norm"] == pytest.approx(small["grad_norm"], rel=1e-5)
    for name in w_big:
        # Adam divides by sqrt(v): a summation-order difference in a near-zero gradient shows up at ~1e-6.
        torch.testing.assert_close(w_big[name], w_small[name], rtol=1e-4, atol=1e-5)


def test_positive_advantage_raises_the_sampled_tokens_logprob(make_checkpoint) -> None:
    model_dir = make_checkpoint()
    samples = [s for s in rollout(model_dir) if s.advantage > 0]
    model = load_model(model_dir)
    trainer = PolicyTrainer(model, optim=OptimConfig(lr=1e-3))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.step(samples)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    # After the step the same behaviour log-probs read as a ratio above 1 on average.
    stats = PolicyTrainer(model, optim=OptimConfig(lr=1e-12)).step(samples)
    assert stats["ratio_mean"] > 1.0


def test_lr_schedule_warmup_then_cosine() -> None:
    optim = OptimConfig(lr=1.0, warmup_steps=3, total_steps=13, min_lr_ratio=0.1)
    assert [optim.lr_factor(s) for s in range(3)] == pytest.approx([0.25, 0.5, 0.75])
    assert optim.lr_factor(3) == pytest.approx(1.0)
    assert optim.lr_factor(8) == pytest.approx(0.55)
    assert optim.lr_factor(13) == pytest.approx(0.1) == optim.lr_factor(99)
    assert OptimConfig(lr=1.0).lr_factor(50) == 1.0
    with pytest.raises(ValueError, match=r"optim\.min_lr_ratio"):
        OptimConfig(min_lr_ratio=2.0)


def test_kl_needs_a_reference(make_checkpoint) -> None:
    with pytest.raises(ValueError, match="reference"):
        PolicyTrainer(load_model(make_checkpoint()), loss=LossConfig(kl_coef=0.1))


def _rank(rank: int, world: int, init: str, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        samples = rollout(Path(model_dir))
        model = load_model(Path(model_dir))
        trainer = PolicyTrainer(model, optim=OptimConfig(lr=1e-3, micro_batch_tokens=32))
        stats = trainer.step(samples[rank::world])
        torch.save({"weights": model.state_dict(), "stats": stats}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_two_gloo_ranks_give_the_same_update_as_one(make_checkpoint, tmp_path: Path) -> None:
    model_dir = make_checkpoint()
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(_rank, args=(2, init, str(model_dir), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    model = load_model(model_dir)
    stats = PolicyTrainer(model, optim=OptimConfig(lr=1e-3, micro_batch_tokens=32)).step(rollout(model_dir))
    for name, tensor in model.state_dict().items():
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name])  # ranks agree bitwise
        torch.testing.assert_close(ranks[0]["weights"][name], tensor, rtol=1e-4, atol=1e-5)
    assert ranks[0]["stats"]["tokens"] == stats["tokens"]
    assert ranks[0]["stats"]["loss"] == pytest.approx(stats["loss"], abs=1e-6)
    assert ranks[0]["stats"]["mismatch_logp_abs_max"] == pytest.approx(stats["mismatch_logp_abs_max"])


@pytest.mark.parametrize("mode", ["rejection", "reproducible"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_step_zero_agreement_holds_with_speculation_on(make_checkpoint, mode: str, shape: str) -> None:
    """The rollout's reported log-probs of tokens committed by verify passes (accepted drafts, rejection
    resamples, bonus tokens) are log q of the processed target distribution: what the learner computes."""
    from slipstream.engine.speculator import SpecConfig
    from tests.engine.test_spec_lossless import SMALL, SkewedDrafter

    model_dir = make_checkpoint(**SMALL)
    model = load_model(model_dir)
    params = [(0.9, 0.9, 6), (1.0, 0.8, 0), (0.7, 1.0, 5)]
    requests = [
        Request(
            request_id=str(i),
            prompt_ids=[3, 1, 4, i % 8],
            params=SamplingParams(temperature=t, top_p=p, top_k=k, max_tokens=24, seed=7 + i),
        )
        for i, (t, p, k) in enumerate(params * 2)
    ]
    spec = SpecConfig(method="eagle", depth=3, topk=1 if shape == "chain" else 2, verify=0, mode=mode)
    drafter = SkewedDrafter(torch.full((SMALL["vocab_size"],), 1.0 / SMALL["vocab_size"]), shape)
    gen = Generator.for_requests(model, requests, spec=spec, drafters={"eagle": drafter}, eos_token_ids=())
    completions = gen.generate(requests)
    assert sum(c.accepted for c in completions) > 0  # verify passes really committed drafted tokens
    samples = [
        PolicySample(
            prompt_ids=c.prompt_ids,
            response_ids=c.token_ids,
            behaviour_logprobs=c.logprobs,
            advantage=1.0,
            temperature=r.params.temperature,
            top_p=r.params.top_p,
            top_k=r.params.top_k,
        )
        for c, r in zip(completions, requests, strict=True)
    ]
    stats = PolicyTrainer(load_model(model_dir)).step(samples)
    assert stats["mismatch_logp_abs_max"] < 1e-4
    assert abs(stats["ratio_max"] - 1) < 1e-4 and abs(stats["ratio_min"] - 1) < 1e-4
