"""The sharded learner (FSDP2 over gloo, real processes): 2 sharded ranks = 1 plain rank over 3 steps,
checkpointing and chunked log-probs change no gradient, distributed checkpoints resume 2 -> 1 and 1 -> 2,
and the memory plan: its state term is what a rank holds, it names the field that would make a config
fit, and an 8k-token sample's activations stay within its activation term."""

from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from slipstream.engine.config import ModelConfig
from slipstream.engine.memory_plan import PlanDoesNotFit, plan_learner
from slipstream.engine.policy_checkpoint import load_policy, read_weights, save_policy
from slipstream.engine.policy_train import OptimConfig, PolicySample, PolicyTrainer
from slipstream.engine.sharding import full_tensors, shard_policy
from slipstream.engine.weights import load_model
from tests.engine.test_policy_train import join_group, rollout, run_ranks, tcp_store

OPTIM = OptimConfig(lr=1e-3, micro_batch_tokens=32, max_grad_norm=1.0)
STEPS = 3


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in full_tensors(list(model.named_parameters()))}


def _full_moments(trainer: PolicyTrainer, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """AdamW's moments by parameter name, gathered (DTensor) or as held."""
    out = {}
    for name, param in model.named_parameters():
        state = trainer.optimizer.state[param]
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{key}"] = next(full_tensors([("", state[key])]))[1].clone()
    return out


def _sharded_rank(rank: int, world: int, port: int, model_dir: str, out: str, mode: str) -> None:
    """`mode` "train": 3 steps on this rank's half of each step's samples; "save": 1 step then a
    checkpoint; "resume": loads the 1-rank checkpoint, then 1 step."""
    torch.set_num_threads(1)
    join_group(rank, world, port)
    try:
        samples = rollout(Path(model_dir))
        model = shard_policy(load_model(Path(model_dir)))
        trainer = PolicyTrainer(model, optim=OPTIM)
        if mode == "resume":
            info = load_policy(os.path.join(out, "one"), model, trainer.optimizer)
            trainer.steps = info["steps"]
            loaded = {"weights": _full(model), "moments": _full_moments(trainer, model)}
        steps = STEPS if mode == "train" else 1
        # Rank 1 gets one sample of eight in the first step: the ranks run different micro-batch counts.
        shares = [samples[:7], samples[7:]] if world == 2 else [samples]
        stats = [trainer.step(shares[rank] if s == 0 else samples[rank::world]) for s in range(steps)]
        if mode == "save":
            save_policy(os.path.join(out, "two"), model, trainer.optimizer, steps=trainer.steps, version=1)
        result = {"weights": _full(model), "stats": stats, "moments": _full_moments(trainer, model)}
        if mode == "resume":
            result["loaded"] = loaded
        result["state_bytes"] = trainer.state_bytes()
        if rank == 0:
            torch.save(result, os.path.join(out, f"{mode}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _plain(model_dir: Path, steps: int, trainer: PolicyTrainer | None = None) -> tuple[PolicyTrainer, list]:
    samples = rollout(model_dir)
    trainer = trainer or PolicyTrainer(load_model(model_dir), optim=OPTIM)
    return trainer, [trainer.step(samples) for _ in range(steps)]


@pytest.mark.timeout(240)
def test_two_sharded_ranks_train_as_one_plain_rank(make_checkpoint, tmp_path: Path) -> None:
    model_dir = make_checkpoint()
    store = tcp_store()  # held: the ranks meet on it
    run_ranks(_sharded_rank, store.port, str(model_dir), str(tmp_path), "train", timeout_s=200)
    sharded = torch.load(tmp_path / "train.pt", weights_only=True)
    plain, stats = _plain(model_dir, STEPS)
    for step in range(STEPS):
        for key in ("loss", "grad_norm", "tokens", "mismatch_logp_abs_max"):
            assert sharded["stats"][step][key] == pytest.approx(stats[step][key], rel=1e-5, abs=1e-6), key
    for name, param in plain.model.named_parameters():
        torch.testing.assert_close(sharded["weights"][name], param.detach(), rtol=0, atol=1e-5)
    # A rank holds half (the ceil of each parameter's rows) of the weights, gradients and moments.
    one = plain.state_bytes()
    ratio = sum(sharded["state_bytes"].values()) / sum(one.values())
    assert 0.45 < ratio <= 0.55, ratio
    config = ModelConfig.from_pretrained(model_dir)
    plan = plan_learner(config, ranks=2)
    assert plan.state == pytest.approx(sum(sharded["state_bytes"].values()), rel=0.02)
    assert plan_learner(config, ranks=1).state == pytest.approx(sum(one.values()), rel=0.02)


@pytest.mark.timeout(300)
def test_a_distributed_checkpoint_resumes_on_another_rank_count(make_checkpoint, tmp_path: Path) -> None:
    """2 ranks save after a step; 1 rank loads it, its next step equals the 2-rank run's second step (and
    the uninterrupted plain run's); 1 rank saves, 2 ranks load it and step: the same again."""
    model_dir = make_checkpoint()
    samples = rollout(model_dir)
    # The uninterrupted run: two steps on one rank.
    whole, whole_stats = _plain(model_dir, 2)
    store = tcp_store()  # held: the ranks meet on it
    run_ranks(_sharded_rank, store.port, str(model_dir), str(tmp_path), "save", timeout_s=200)
    two = torch.load(tmp_path / "save.pt", weights_only=True)

    # 2 -> 1
    resumed = PolicyTrainer(load_model(model_dir), optim=OPTIM)
    info = load_policy(tmp_path / "two", resumed.model, resumed.optimizer)
    resumed.steps = info["steps"]
    assert info == {"steps": 1, "version": 1}
    for name, param in resumed.model.named_parameters():
        assert torch.equal(param.detach(), two["weights"][name]), name
    for name, moment in _full_moments(resumed, resumed.model).items():
        assert torch.equal(moment, two["moments"][name]), name
    assert read_weights(tmp_path / "two").keys() == dict(resumed.model.named_parameters()).keys()
    stats = resumed.step(samples)
    assert stats["loss"] == pytest.approx(whole_stats[1]["loss"], rel=1e-5, abs=1e-6)
    for name, param in whole.model.named_parameters():
        torch.testing.assert_close(dict(resumed.model.named_parameters())[name].detach(), param.detach(),
                                   rtol=0, atol=1e-5)  # fmt: skip

    # 1 -> 2: the plain run's first step, saved, loaded by two sharded ranks.
    first, _ = _plain(model_dir, 1)
    save_policy(tmp_path / "one", first.model, first.optimizer, steps=first.steps, version=1)
    again = tcp_store()
    run_ranks(_sharded_rank, again.port, str(model_dir), str(tmp_path), "resume", timeout_s=200)
    back = torch.load(tmp_path / "resume.pt", weights_only=True)
    for name, param in first.model.named_parameters():
        assert torch.equal(back["loaded"]["weights"][name], param.detach()), name
    for name, moment in _full_moments(first, first.model).items():
        assert torch.equal(back["loaded"]["moments"][name], moment), name
    assert back["stats"][0]["loss"] == pytest.approx(whole_stats[1]["loss"], rel=1e-5, abs=1e-6)
    for name, param in whole.model.named_parameters():
        torch.testing.assert_close(back["weights"][name], param.detach(), rtol=0, atol=1e-5)


def _grads(model_dir: Path, samples: list[PolicySample], **kwargs) -> dict[str, torch.Tensor]:
    optim = kwargs.pop("optim", OPTIM)
    trainer = PolicyTrainer(load_model(model_dir), optim=optim, **kwargs)
    trainer.step(samples)
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def test_checkpointed_layers_and_chunked_logprobs_give_the_same_gradients(make_checkpoint) -> None:
    model_dir = make_checkpoint()
    samples = rollout(model_dir)
    plain = _grads(model_dir, samples)
    checkpointed = _grads(model_dir, samples, activation_checkpointing=True)
    chunked = _grads(model_dir, samples, optim=OptimConfig(**{**_fields(OPTIM), "logprob_chunk_tokens": 3}))
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(chunked[name], grad, rtol=1e-5, atol=1e-7)


def _fields(optim: OptimConfig) -> dict:
    import msgspec

    return msgspec.structs.asdict(optim)


QWEN_7B = ModelConfig(
    model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
    num_attention_heads=28, num_key_value_heads=4, head_dim=128, qkv_bias=True, torch_dtype="bfloat16",
)  # fmt: skip
H100 = 80 * 10**9


def test_a_plan_that_does_not_fit_names_the_field() -> None:
    """A 7B-shaped policy on an 80 GB card: each config that does not fit names the cheapest fix."""
    plan = lambda **kw: plan_learner(QWEN_7B, compute_dtype="bfloat16", device="cuda", **kw)  # noqa: E731
    fits = plan(ranks=4, micro_batch_tokens=16384, activation_checkpointing=True)
    fits.check(H100)
    assert 0.5 < fits.state / (16 * QWEN_7B_PARAMS / 4) < 1.01  # a quarter of 16 bytes a parameter
    with pytest.raises(PlanDoesNotFit, match=r"set learner\.activation_checkpointing: true"):
        plan(ranks=4, micro_batch_tokens=16384).check(H100)
    with pytest.raises(PlanDoesNotFit, match=r"raise learner\.ranks \(to 3 or more\)"):
        plan(ranks=1, micro_batch_tokens=8192, activation_checkpointing=True).check(H100)
    with pytest.raises(PlanDoesNotFit, match=r"lower learner\.optim\.micro_batch_tokens"):
        plan(ranks=4, micro_batch_tokens=131072, activation_checkpointing=True).check(H100)


QWEN_7B_PARAMS = 7_615_616_512  # Qwen2.5-7B's parameter count


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost",
    )]  # fmt: skip


def _heap_bytes() -> int:
    """Bytes glibc's malloc has handed out now (small blocks plus mmap'd ones): torch's CPU allocator
    takes every tensor's storage from it."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def _heap_growth(model_dir: Path, sample: PolicySample, optim: OptimConfig, checkpointing: bool) -> int:
    """The heap's peak growth over one step (sampled at every projection's and norm's forward, recomputes
    included, and at every gradient's accumulation), less the gradients themselves."""
    trainer = PolicyTrainer(load_model(model_dir), optim=optim, activation_checkpointing=checkpointing)
    trainer._create_moments()
    peak = [0]

    def sample_heap(*_: object) -> None:
        peak[0] = max(peak[0], _heap_bytes())

    modules = [m for m in trainer.model.modules() if not list(m.children())]
    handles = [m.register_forward_hook(sample_heap) for m in modules]
    handles += [p.register_post_accumulate_grad_hook(sample_heap) for p in trainer.params]
    gc.collect()
    base = _heap_bytes()
    stats = trainer.step([sample])
    for handle in handles:
        handle.remove()
    assert stats["tokens"] == len(sample.response_ids)
    return peak[0] - base - sum(p.numel() * 4 for p in trainer.params)


def test_an_8k_token_sample_trains_within_the_plans_activation_bytes(make_checkpoint) -> None:
    """One 8k-token sample with checkpointing and chunked log-probs: the heap's growth over the step, less
    the gradients, stays within the plan's activation term; whole fp32 logits alone would exceed it, and
    the same step without checkpointing holds every layer's activations (far more)."""
    # A vocabulary whose whole logits outweigh the rest, and layers enough for checkpointing to show.
    model_dir = make_checkpoint(vocab_size=8192, num_hidden_layers=4)
    config = ModelConfig.from_pretrained(model_dir)
    length = 8192
    sample = PolicySample(
        prompt_ids=[1, 2, 3], response_ids=[5] * (length - 3), behaviour_logprobs=[-1.0] * (length - 3),
        advantage=1.0,
    )  # fmt: skip
    optim = OptimConfig(lr=1e-4, micro_batch_tokens=length, logprob_chunk_tokens=1024)
    used = _heap_growth(model_dir, sample, optim, checkpointing=True)
    plan = plan_learner(
        config, micro_batch_tokens=length, logprob_chunk_tokens=1024, activation_checkpointing=True
    )
    assert 0 < used <= plan.activations, (used, plan.activations)
    assert (length - 3) * config.vocab_size * 4 > plan.activations  # what chunking avoids
    layers = config.num_hidden_layers * length * config.hidden_size * 4
    unchecked = _heap_growth(model_dir, sample, optim, checkpointing=False)
    assert unchecked > used + layers, (unchecked, used)
