"""Two sharded learner actors in two processes (gloo, the actor's own rendezvous and teardown): when one
rank has nothing to learn from (every sample invalid, every group dropped as zero-advantage, or no group
dealt) both step together and end equal to one learner trained on all the groups; their checkpoint and
push, gathered from the shards, are what one unsharded learner holding the same weights writes and sends."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from slipstream.engine.sharding import full_tensors
from slipstream.protocols.learner import PushWeights, ScoredGroup, StepStats, WeightUpdate
from tests.actors.test_learner import make_learner, scored_groups, train
from tests.engine.conftest import build_checkpoint
from tests.engine.test_policy_train import run_ranks

OPTIM = {"lr": 1e-3, "max_grad_norm": 0}


def _learner_rank(
    rank: int, world: int, model: str, run_dir: str, shares: list[list[ScoredGroup]], config: dict[str, Any]
) -> None:
    torch.set_num_threads(1)
    learner, sent = make_learner(Path(model), Path(run_dir), rank=rank, world_size=world, **config)
    try:
        train(learner, shares[rank], version=1)
        (stats,) = sent.of(StepStats)
        torch.save(
            {
                "weights": dict(full_tensors(list(learner.model.state_dict().items()))),
                "stats": msgspec.structs.asdict(stats),
            },
            os.path.join(run_dir, f"rank{rank}.pt"),
        )
    finally:
        learner.on_stop()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny"))


def with_rewards(group: ScoredGroup, rewards: list[float | None]) -> ScoredGroup:
    return msgspec.structs.replace(group, rewards=rewards)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["all_invalid", "all_zero_advantage", "no_group"])
def test_a_rank_with_nothing_steps_with_the_others(tiny: Path, tmp_path: Path, case: str) -> None:
    first, second = scored_groups(tiny, tmp_path, [[1.0, 0.0, 0.5, 1.0], [0.0, 0.5, 1.0, 0.0]])
    config = {"optim": OPTIM, "loss": {"drop_zero_adv_groups": True}}
    shares = {
        "all_invalid": [[first], [with_rewards(second, [None] * 4)]],
        "all_zero_advantage": [[first], [with_rewards(second, [1.0] * 4)]],
        "no_group": [[first, second], []],
    }[case]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_ranks(_learner_rank, str(tiny), str(run_dir), shares, config, timeout_s=180)
    ranks = [torch.load(run_dir / f"rank{r}.pt", weights_only=True) for r in range(2)]

    alone, sent = make_learner(tiny, tmp_path / "alone", **config)
    train(alone, [g for share in shares for g in share], version=1)
    (stats,) = sent.of(StepStats)
    for name, tensor in alone.model.state_dict().items():
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name
        torch.testing.assert_close(ranks[0]["weights"][name], tensor, rtol=1e-4, atol=1e-5)
    for rank in ranks:
        assert rank["stats"]["tokens"] == stats.tokens > 0
        assert rank["stats"]["grad_norm"] == pytest.approx(stats.grad_norm, rel=1e-5)
        for key in ("mismatch_logp_abs_max", "ratio_min", "ratio_mean", "pg_loss"):
            assert rank["stats"]["metrics"][key] == pytest.approx(stats.metrics[key], abs=1e-6), key


def _pushing_rank(rank: int, world: int, model: str, run_dir: str, shares: list[list[ScoredGroup]]) -> None:
    torch.set_num_threads(1)
    learner, sent = make_learner(
        Path(model), Path(run_dir), rank=rank, world_size=world, optim=OPTIM, bucket_bytes=4096
    )
    try:
        train(
            learner, shares[rank], version=1, push_to=["rollout:0"], push_head_to=["drafter:0"],
            checkpoint=os.path.join(run_dir, "ckpt"),
        )  # fmt: skip
        updates = [msgspec.structs.asdict(u) for u in sent.of(WeightUpdate)]
        torch.save(
            {"updates": updates, "weights": dict(full_tensors(list(learner.model.named_parameters())))},
            os.path.join(run_dir, f"push{rank}.pt"),
        )
    finally:
        learner.on_stop()


@pytest.mark.timeout(240)
def test_a_push_from_shards_is_the_unsharded_push_byte_for_byte(tiny: Path, tmp_path: Path) -> None:
    """Two sharded ranks train, checkpoint and push (to a rollout and a drafter's head, buckets of 4 KB):
    rank 0 sends every bucket, rank 1 none; one unsharded learner resumed from their checkpoint holds the
    same weights and pushes the same buckets, names, bytes and checksums."""
    first, second = scored_groups(tiny, tmp_path, [[1.0, 0.0, 0.5, 1.0], [0.0, 0.5, 1.0, 0.0]])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_ranks(_pushing_rank, str(tiny), str(run_dir), [[first], [second]], timeout_s=180)
    ranks = [torch.load(run_dir / f"push{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[0]["updates"] and not ranks[1]["updates"]

    alone, sent = make_learner(
        tiny, tmp_path / "alone", optim=OPTIM, bucket_bytes=4096, resume_from=str(run_dir / "ckpt")
    )
    assert alone.version == 1
    for name, param in alone.model.named_parameters():
        assert torch.equal(param.detach(), ranks[0]["weights"][name]), name
    alone.on_push(PushWeights(version=1, to=["rollout:0"], head_to=["drafter:0"]), "coordinator")
    plain = [msgspec.structs.asdict(u) for u in sent.of(WeightUpdate)]
    assert len(plain) == len(ranks[0]["updates"])
    for got, want in zip(ranks[0]["updates"], plain, strict=True):
        assert (got["bucket"], got["names"], got["checksum"]) == (
            want["bucket"],
            want["names"],
            want["checksum"],
        )
        for a, b in zip(got["tensors"], want["tensors"], strict=True):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
