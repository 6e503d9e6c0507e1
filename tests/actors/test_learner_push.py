"""The learner's masters and pushes: fp32 weights and optimizer state from a bf16 checkpoint, pushes cast to
the rollout's dtype (what a rollout re-hashes), checkpoints of the masters, the drafter's head parts, the
config's device field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from slipstream.actors.learner import LearnerActor
from slipstream.engine.policy_checkpoint import read_weights
from slipstream.engine.weights import load_head_parts
from slipstream.protocols.learner import WeightAck, WeightUpdate
from slipstream.runtime.codec import checksum
from tests.actors.test_learner import make_learner, scored_groups, train
from tests.actors.test_rollout_actor import drain, make_actor
from tests.engine.conftest import build_checkpoint

REWARDS = [[1.0, 0.0, 0.5, 1.0], [0.0, 0.5, 1.0, 0.0]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny"))


def convert(src: Path, dst: Path, dtype: torch.dtype) -> Path:
    """A copy of checkpoint `src` rounded to bf16, stored (and declared in config.json) as `dtype`."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    save_file({n: t.to(torch.bfloat16).to(dtype) for n, t in tensors.items()}, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = str(dtype).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_a_bf16_checkpoint_trains_fp32_masters_and_pushes_them_cast(tiny: Path, tmp_path: Path) -> None:
    bf16 = convert(tiny, tmp_path / "bf16", torch.bfloat16)
    same_in_fp32 = convert(tiny, tmp_path / "fp32", torch.float32)  # the same values, an fp32 checkpoint
    groups = scored_groups(same_in_fp32, tmp_path, REWARDS)
    learner, sent = make_learner(bf16, tmp_path / "bf16-run", optim={"lr": 1e-6})
    reference, _ = make_learner(same_in_fp32, tmp_path / "fp32-run", optim={"lr": 1e-6})
    start = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    ckpt = tmp_path / "ckpt" / "learner"
    train(learner, groups, version=1, push_to=["rollout:0"], checkpoint=str(ckpt))
    train(reference, groups, version=1)

    masters = dict(learner.model.named_parameters())
    changed = total = 0
    for name, param in reference.model.named_parameters():
        assert masters[name].dtype == torch.float32
        assert torch.equal(masters[name], param), name  # the step an fp32 run takes, bit for bit
        changed += int((masters[name] != start[name]).sum())
        total += param.numel()
    assert changed / total > 0.9  # in place on bf16 weights, lr 1e-6 moved 0.3% of them
    states = learner.trainer.optimizer.state.values()
    assert all(s[k].dtype == torch.float32 for s in states for k in ("exp_avg", "exp_avg_sq"))
    saved = read_weights(ckpt)
    assert all(torch.equal(saved[n], p) for n, p in masters.items())  # checkpoints keep the masters

    updates = sent.of(WeightUpdate)
    for update in updates:
        assert update.checksum == checksum(update.names, update.tensors)
        for name, tensor in zip(update.names, update.tensors, strict=True):
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, masters[name].to(torch.bfloat16))
    rollout, out = make_actor(bf16, tmp_path / "rollout2", verify_applied_weights=True)
    for update in updates:
        rollout.on_weights(update, "learner:0")
    drain(rollout)
    assert [a.ok for a in out.of(WeightAck)] == [True] and rollout.policy_version == 1


def test_push_dtype_overrides_the_checkpoints(tiny: Path, tmp_path: Path) -> None:
    groups = scored_groups(tiny, tmp_path, REWARDS)
    learner, sent = make_learner(tiny, tmp_path, push_dtype="float16", bucket_bytes=4096)
    train(learner, groups, version=1, push_to=["rollout:0"])
    updates = sent.of(WeightUpdate)
    assert len(updates) > 1 and {t.dtype for u in updates for t in u.tensors} == {torch.float16}
    assert sum(len(u.names) for u in updates) == len(list(learner.model.parameters()))


@pytest.mark.parametrize("tied", [False, True])
def test_the_head_parts_lead_the_push_and_rollouts_and_drafters_share_them(
    tmp_path: Path, tied: bool
) -> None:
    model = build_checkpoint(tmp_path / "model", tie_word_embeddings=tied)
    groups = scored_groups(model, tmp_path, REWARDS)
    learner, sent = make_learner(model, tmp_path, push_dtype="bfloat16", bucket_bytes=4096)
    drafters = ["drafter:0", "drafter:1"]
    train(learner, groups, version=3, push_to=["rollout:0"], push_head_to=drafters)
    masters = dict(learner.model.named_parameters())
    heads = sorted(n for n, _ in load_head_parts(model).named_parameters())
    to_rollout = [m for d, m in sent.sent if d == "rollout:0"]
    # Every parameter to the rollout, in buckets numbered over the push, the head parts' buckets first.
    assert [u.bucket for u in to_rollout] == list(range(len(to_rollout)))
    assert {u.num_buckets for u in to_rollout} == {len(to_rollout)} and {u.version for u in to_rollout} == {3}
    assert sorted(n for u in to_rollout for n in u.names) == sorted(masters)
    k = sum(1 for u in to_rollout if set(u.names) <= set(heads))
    assert sorted(n for u in to_rollout[:k] for n in u.names) == heads  # no bucket mixes head and layers
    # ... and the largest head part last: a drafter's completing bucket, copied once (not staged).
    assert to_rollout[k - 1].names[-1] == ("embed_tokens.weight" if tied else "lm_head.weight")
    for dest in drafters:
        # What a drafter holds of its target (lm_head only when untied), nothing more: the very buckets (one
        # cast, one checksum, one shared-memory copy: `broadcast`) the rollout takes, sent before anything else.
        updates = [m for d, m in sent.sent if d == dest]
        key = lambda u: (u.bucket, u.num_buckets, u.names, u.checksum)  # noqa: E731
        assert [key(u) for u in updates] == [key(u) for u in to_rollout[:k]]
        first_layers = next(i for i, (_, m) in enumerate(sent.sent) if m == to_rollout[k])
        assert all(i < first_layers for i, (d, _) in enumerate(sent.sent) if d == dest)
        assert sorted(n for u in updates for n in u.names) == heads
        assert ("lm_head.weight" in heads) == (not tied)
        for update in updates:
            assert update.checksum == checksum(update.names, update.tensors)
            for name, tensor in zip(update.names, update.tensors, strict=True):
                assert torch.equal(tensor, masters[name].to(torch.bfloat16))
    # A push of the head alone (a restarted drafter) numbers its buckets over itself.
    sent.sent.clear()
    learner.push([], 3, head_to=["drafter:0"])
    alone = [m for d, m in sent.sent if d == "drafter:0"]
    assert [u.bucket for u in alone] == list(range(k)) and {u.num_buckets for u in alone} == {k}
    assert sorted(n for u in alone for n in u.names) == heads


def test_a_step_without_groups_trains_nothing_and_pushes(tiny: Path, tmp_path: Path) -> None:
    learner, sent = make_learner(tiny, tmp_path)
    start = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    train(learner, [], version=5, push_to=["rollout:0"], push_head_to=["drafter:0"])
    assert learner.trainer.steps == 0 and learner.version == 5
    assert all(torch.equal(p, start[n]) for n, p in learner.model.named_parameters())
    assert {u.version for u in sent.of(WeightUpdate)} == {5} and {d for d, _ in sent.sent} >= {"drafter:0"}


def test_device_is_validated_naming_the_field() -> None:
    for good in ("cpu", "cuda", "cuda:1"):
        LearnerActor.Config(model="m", device=good)
    for bad in ("gpu", "cuda:", "cuda:x", "CPU"):
        with pytest.raises(ValueError, match=r"device: '.*' is not a device"):
            LearnerActor.Config(model="m", device=bad)
    with pytest.raises(msgspec.ValidationError, match="push_dtype"):
        msgspec.convert({"model": "m", "push_dtype": "int8"}, LearnerActor.Config)


@pytest.mark.gpu
def test_pushes_on_one_gpu_travel_as_ipc_refs_and_rollouts_apply_them_bitwise(
    tiny: Path, tmp_path: Path
) -> None:
    """Learner and two rollouts on one GPU: every bucket leaves as CUDA IPC refs (no tensor on the wire), and
    after three pushes each rollout holds the masters cast to bf16, re-hashed on the GPU (verify)."""
    from slipstream.protocols.learner import CUDA_IPC

    groups = scored_groups(tiny, tmp_path, REWARDS)
    learner, sent = make_learner(
        tiny, tmp_path / "learner", device="cuda", push_dtype="bfloat16", bucket_bytes=4096
    )
    rollouts = [
        make_actor(
            tiny, tmp_path / f"rollout{r}", device="cuda", dtype="bfloat16", verify_applied_weights=True
        )
        for r in range(2)
    ]
    for version in (1, 2, 3):
        sent.sent.clear()
        train(learner, groups, version=version, push_to=["rollout:0", "rollout:1"])
        updates = sent.of(WeightUpdate)
        assert updates and all(u.encoding == CUDA_IPC and not u.tensors and u.ipc for u in updates)
        for rollout, out in rollouts:
            for update in updates:
                rollout.on_weights(update, "learner:0")
            drain(rollout)
            assert [a.ok for a in out.of(WeightAck)][-1:] == [True] and rollout.policy_version == version
    masters = dict(learner.model.named_parameters())
    for rollout, _ in rollouts:
        for name, weight in rollout.model.named_weights():
            assert torch.equal(weight, masters[name].detach().to(torch.bfloat16)), name
