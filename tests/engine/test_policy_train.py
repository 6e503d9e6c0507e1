"""PolicyTrainer: step-0 agreement with the rollout's log-probs, micro-batching, learning, the LR schedule
and clipping as applied, fp32 masters, 2 ranks = 1 rank (gradients summed, not averaged).

Multi-process tests go through `run_ranks`: spawned ranks rendezvous on a TCP store that the test process
hosts, so no rank's teardown takes the store from a peer, and barrier before destroying their group."""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from slipstream.engine.generator import Generator, Request
from slipstream.engine.grpo import LossConfig
from slipstream.engine.policy_train import OptimConfig, PolicySample, PolicyTrainer, micro_batches
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.sharding import shard_policy
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


def test_the_scheduled_lr_is_the_one_applied(make_checkpoint) -> None:
    model_dir = make_checkpoint()
    samples = rollout(model_dir)
    trainer = PolicyTrainer(load_model(model_dir), optim=OptimConfig(lr=1e-3, warmup_steps=3))
    before = [p.detach().clone() for p in trainer.params]
    lrs = [trainer.step(samples)["lr"]]
    moved = torch.cat([(p.detach() - b).abs().flatten() for p, b in zip(trainer.params, before, strict=True)])
    # Adam's first update is lr * g / (|g| + eps): about lr wherever the gradient is not ~0.
    assert moved[moved > 0].median() == pytest.approx(2.5e-4, rel=0.02)
    lrs += [trainer.step(samples)["lr"] for _ in range(3)]
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])


def grad_norm(params: list[torch.nn.Parameter]) -> float:
    return math.sqrt(sum(float(p.grad.double().square().sum()) for p in params))


def test_gradients_are_clipped_to_max_grad_norm(make_checkpoint) -> None:
    model_dir = make_checkpoint()
    samples = rollout(model_dir)
    free = PolicyTrainer(load_model(model_dir), optim=OptimConfig(max_grad_norm=0))
    norm = free.step(samples)["grad_norm"]
    assert grad_norm(free.params) == pytest.approx(norm, rel=1e-5)
    clipped = PolicyTrainer(load_model(model_dir), optim=OptimConfig(max_grad_norm=norm / 4))
    stats = clipped.step(samples)
    assert stats["grad_norm"] == pytest.approx(norm, rel=1e-5)  # reported before clipping
    # The gradients the optimizer used (kept until the next step's zero_grad) were scaled down to the cap.
    assert grad_norm(clipped.params) == pytest.approx(norm / 4, rel=1e-4)
    for p, q in zip(clipped.params, free.params, strict=True):
        torch.testing.assert_close(p.grad, q.grad / 4, rtol=1e-4, atol=1e-9)


def test_trainable_weights_must_be_fp32_masters(make_checkpoint) -> None:
    with pytest.raises(ValueError, match=r"float32 master weights, got torch\.bfloat16"):
        PolicyTrainer(load_model(make_checkpoint(), dtype=torch.bfloat16))


def test_every_collective_holds_a_tensor_on_the_model_device(
    make_checkpoint, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NCCL takes CUDA tensors, gloo CPU ones: a one-process stand-in for a 2-rank group records them."""
    model_dir = make_checkpoint()
    samples = rollout(model_dir)
    seen: list[torch.device] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None: seen.append(tensor.device))
    trainer = PolicyTrainer(load_model(model_dir, device=device))
    trainer.sharded = True  # the trainer's own collectives (FSDP's gathers are its own, on the device)
    stats = trainer.step(samples)
    assert stats["tokens"] > 0
    assert len(seen) == 4 and all(d.type == device.type for d in seen)  # counts, passes, sums, maxima


def test_kl_needs_a_reference(make_checkpoint) -> None:
    with pytest.raises(ValueError, match="reference"):
        PolicyTrainer(load_model(make_checkpoint()), loss=LossConfig(kl_coef=0.1))


def run_ranks(fn: Callable[..., None], *args: Any, world: int = 2, timeout_s: float = 150.0) -> None:
    """Runs `fn(rank, world, *args)` in `world` spawned processes and fails, killing every one, when a rank
    fails or they outlive `timeout_s`: a collective that one rank never joins fails here, never hangs."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=fn, args=(rank, world, *args), daemon=True) for rank in range(world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
    finally:
        late = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
    assert not late, f"ranks {late} still running after {timeout_s} s (a collective some rank never joined?)"
    codes = [proc.exitcode for proc in procs]
    assert codes == [0] * world, f"rank exit codes {codes}"


def tcp_store() -> dist.TCPStore:
    """A store on 127.0.0.1 (a free port picked by the OS) that outlives the ranks that use it."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def join_group(rank: int, world: int, port: int) -> None:
    dist.init_process_group(
        "gloo",
        store=dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60)),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )


DP_OPTIM = OptimConfig(lr=1e-3, micro_batch_tokens=32, max_grad_norm=0)  # unclipped: grads compare as is


def _rank(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    join_group(rank, world, port)
    try:
        samples = rollout(Path(model_dir))
        model = shard_policy(load_model(Path(model_dir)))
        trainer = PolicyTrainer(model, optim=DP_OPTIM)
        stats = trainer.step(samples[rank::world])
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        weights = {n: p.full_tensor() for n, p in model.state_dict().items()}
        torch.save(
            {"weights": weights, "grads": grads, "stats": stats},
            os.path.join(out, f"rank{rank}.pt"),
        )
        dist.barrier()  # nobody tears the group down while a peer may still be in a collective
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_two_gloo_ranks_give_the_same_update_as_one(make_checkpoint, tmp_path: Path) -> None:
    model_dir = make_checkpoint()
    store = tcp_store()
    run_ranks(_rank, store.port, str(model_dir), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    model = load_model(model_dir)
    stats = PolicyTrainer(model, optim=DP_OPTIM).step(rollout(model_dir))
    for name, tensor in model.state_dict().items():
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name])  # ranks agree bitwise
        torch.testing.assert_close(ranks[0]["weights"][name], tensor, rtol=1e-4, atol=1e-5)
    # AdamW hardly sees a gradient's scale: the gradients themselves show a sum (not a mean) over ranks.
    for name, param in model.named_parameters():
        torch.testing.assert_close(ranks[0]["grads"][name], param.grad, rtol=1e-4, atol=1e-7)
    assert ranks[0]["stats"]["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-5)
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


def test_warm_up_changes_nothing_and_the_next_step_is_the_same(make_checkpoint) -> None:
    """warm_up runs a full-budget forward and backward and creates AdamW's moments, and changes nothing
    learned: weights, step count and gradients as before, moments zero at step 0, and the first real step
    (weights and moments) bit-identical to a cold trainer's."""
    model_dir = make_checkpoint()
    samples = rollout(model_dir)
    results = []
    for warm in (False, True):
        model = load_model(model_dir)
        trainer = PolicyTrainer(model, optim=OptimConfig(lr=1e-3, micro_batch_tokens=64))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        if warm:
            trainer.warm_up()
            assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
            assert all(p.grad is None for p in model.parameters())
            assert trainer.steps == 0 and len(trainer.optimizer.state) == len(trainer.params)
            for state in trainer.optimizer.state.values():
                assert float(state["step"]) == 0
                assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
        stats = trainer.step(samples)
        moments = [
            (float(st["step"]), st["exp_avg"].clone(), st["exp_avg_sq"].clone())
            for st in (trainer.optimizer.state[p] for p in trainer.params)
        ]
        results.append((stats, {n: p.detach().clone() for n, p in model.named_parameters()}, moments))
        if warm:  # a resumed optimizer keeps its moments: warm_up creates none over them
            trainer.warm_up()
            assert all(
                torch.equal(a[1], trainer.optimizer.state[p]["exp_avg"])
                for a, p in zip(moments, trainer.params, strict=True)
            )
    (cold, w_cold, m_cold), (warm_stats, w_warm, m_warm) = results
    assert warm_stats["loss"] == cold["loss"] and warm_stats["grad_norm"] == cold["grad_norm"]
    assert all(torch.equal(w_cold[n], w_warm[n]) for n in w_cold)
    assert all(
        a[0] == b[0] == 1 and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
        for a, b in zip(m_cold, m_warm, strict=True)
    )


def test_a_bf16_step_keeps_fp32_masters_and_follows_the_fp32_step(make_checkpoint) -> None:
    """bf16 autocast: the masters, their gradients and AdamW's moments stay fp32; the gradient and the loss
    equal the fp32 step's within bf16 rounding of the forward, and the step-0 log-probs within it too."""
    model_dir = make_checkpoint()
    samples = rollout(model_dir)
    runs = {}
    for precision in ("fp32", "bf16"):
        model = load_model(model_dir)
        trainer = PolicyTrainer(model, optim=OptimConfig(lr=1e-3, max_grad_norm=1e9), precision=precision)
        stats = trainer.step(samples)
        grads = torch.cat([p.grad.reshape(-1) for p in trainer.params])
        assert grads.dtype == torch.float32 and all(p.dtype == torch.float32 for p in trainer.params)
        moments = [t for state in trainer.optimizer.state.values() for t in state.values() if t.dim()]
        assert moments and all(t.dtype == torch.float32 for t in moments)
        runs[precision] = (stats, grads)
    (fp32, g32), (bf16, g16) = runs["fp32"], runs["bf16"]
    cosine = float(torch.nn.functional.cosine_similarity(g32, g16, dim=0))
    assert cosine > 0.99, cosine
    assert float((g16.norm() - g32.norm()).abs() / g32.norm()) < 0.05
    assert bf16["loss"] == pytest.approx(fp32["loss"], abs=0.02)
    assert bf16["mismatch_logp_abs_max"] > fp32["mismatch_logp_abs_max"]  # the rounding shows, reported
    assert not torch.equal(g32, g16)  # bf16 did run
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16"):
        PolicyTrainer(load_model(model_dir), precision="fp16")  # type: ignore[arg-type]


def test_an_environments_tokens_are_context_never_trained_on(make_checkpoint) -> None:
    """A multi-turn sample: policy tokens, an environment's answer, policy tokens. The answer's tokens (mask
    False) are out of the loss and the token count: whatever behaviour log-probs they carry, the update is
    the same bits; unmasked (the planted bug), they change it."""
    model_dir = make_checkpoint()
    base = rollout(model_dir)[0]
    n = len(base.response_ids)
    assert n >= 9
    mask = [True] * 4 + [False] * 3 + [True] * (n - 7)

    def grads(sample: PolicySample) -> tuple[torch.Tensor, dict]:
        model = load_model(model_dir)
        trainer = PolicyTrainer(model, optim=OptimConfig(lr=1e-3, max_grad_norm=1e9))
        stats = trainer.step([sample])
        return torch.cat([p.grad.reshape(-1) for p in trainer.params]), stats

    def with_answer(logprob: float, policy_mask: list[bool] | None) -> PolicySample:
        behaviour = list(base.behaviour_logprobs)
        behaviour[4:7] = [logprob] * 3  # an environment's tokens: no sampling log-prob of the policy's
        return replace(base, behaviour_logprobs=behaviour, policy_mask=policy_mask)

    a, stats = grads(with_answer(0.0, mask))
    b, _ = grads(with_answer(-7.0, mask))
    assert torch.equal(a, b) and stats["tokens"] == n - 3
    planted, planted_stats = grads(with_answer(-7.0, None))
    assert not torch.equal(a, planted) and planted_stats["tokens"] == n
    with pytest.raises(ValueError, match="mask entries"):
        replace(base, policy_mask=[True])
