"""The learner actor driven in-process beside a rollout actor: step-0 agreement, exact weight sync,
invalid samples masked, malformed groups counted, checkpoint and resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from slipstream.actors.learner import LearnerActor, policy_samples
from slipstream.engine.policy_checkpoint import is_checkpoint
from slipstream.protocols.control import CheckpointSaved, SaveCheckpoint
from slipstream.protocols.learner import (
    GroupPlan,
    PushWeights,
    SampleReceipt,
    ScoredGroup,
    StepStats,
    TrainStep,
    WeightAck,
    WeightUpdate,
)
from slipstream.protocols.rollout import Completion
from slipstream.runtime.inbox import Inbox
from tests.actors.test_rollout_actor import Captured, drain, make_actor, request
from tests.engine.conftest import build_checkpoint

PROMPTS = [[5, 17, 33, 2], [9, 9, 40, 1, 3]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny"))


def make_learner(model: Path, run_dir: Path, rank: int = 0, **config: Any) -> tuple[LearnerActor, Captured]:
    out = Captured()
    cfg = msgspec.convert({"model": str(model), **config}, LearnerActor.Config)
    actor = LearnerActor(cfg, rank=rank, outbox=out, inbox=Inbox(8), run_dir=str(run_dir))
    actor.on_start()
    return actor, out


def scored_groups(
    tiny: Path, tmp_path: Path, rewards: list[list[float | None]], step: int = 0
) -> list[ScoredGroup]:
    """Real rollouts of PROMPTS (4 samples each, T = 0.9, top-p 0.95), scored with `rewards`."""
    rollout, out = make_actor(tiny, tmp_path / "rollout", max_batch=8)
    for g, prompt in enumerate(PROMPTS):
        rollout.on_generate(request(g, prompt, len(rewards[g]), 0.9, max_tokens=10), "coordinator")
    drain(rollout)
    by_group: dict[int, list[Completion]] = {}
    for c in out.of(Completion):
        by_group.setdefault(c.group_id, []).append(c)
    groups = []
    for g, prompt in enumerate(PROMPTS):
        done = sorted(by_group[g], key=lambda c: c.sample_index)
        groups.append(
            ScoredGroup(
                step=step,
                group_id=g,
                prompt_ids=torch.tensor(prompt),
                response_ids=[c.token_ids for c in done],
                behaviour_logprobs=[c.logprobs for c in done],
                rewards=rewards[g],
                temperature=0.9,
                policy_version=0,
            )
        )
    return groups


def feed(learner: LearnerActor, groups: list[ScoredGroup], *, version: int, **step: Any) -> None:
    """`groups` as a learner receives them: each sample straight from its rollout (a `Completion`, answered
    with a receipt), then the coordinator's `TrainStep` (`step`) naming each group's prompt and rewards."""
    for completion in as_completions(groups, step.get("step")):
        learner.on_completion(completion, "rollout:0")
    learner.on_train(train_step(groups, version=version, **step), "coordinator")


def as_completions(groups: list[ScoredGroup], step: int | None = None) -> list[Completion]:
    """Each sample of `groups` as its rollout sends it to the learner (policy version: the step's)."""
    return [
        Completion(
            group_id=g.group_id, sample_index=i, token_ids=ids, logprobs=logp, finish_reason="stop",
            policy_version=g.step if step is None else step, text=f"response {i}",
            policy_mask=g.policy_masks[i] if g.policy_masks else torch.empty(0, dtype=torch.bool),
        )
        for g in groups
        for i, (ids, logp) in enumerate(zip(g.response_ids, g.behaviour_logprobs, strict=True))
    ]  # fmt: skip


def train_step(groups: list[ScoredGroup], *, version: int, **step: Any) -> TrainStep:
    """The coordinator's ask for `groups`: each one's prompt and rewards, and how they were sampled."""
    plans = [GroupPlan(group_id=g.group_id, prompt_ids=g.prompt_ids, rewards=list(g.rewards)) for g in groups]
    if groups:
        step = {
            "temperature": groups[0].temperature,
            "top_p": groups[0].top_p,
            "top_k": groups[0].top_k,
            **step,
        }
    return TrainStep(version=version, groups=plans, **step)


def train(
    learner: LearnerActor,
    groups: list[ScoredGroup],
    *,
    version: int,
    push_to: list[str] | None = None,
    push_head_to: list[str] | None = None,
    delta_base: dict[str, int] | None = None,
    checkpoint: str = "",
    **step: Any,
) -> None:
    """One step as a run takes it: the groups' samples from their rollout, `TrainStep`, then `SaveCheckpoint`
    (with `checkpoint`) and `PushWeights` (with `push_to` or `push_head_to`), each its own message."""
    step.setdefault("step", groups[0].step if groups else 0)
    feed(learner, groups, version=version, **step)
    assert learner.step()
    assert not learner.step()  # one TrainStep, one optimizer step
    if checkpoint:
        learner.on_checkpoint(SaveCheckpoint(step=step["step"] + 1, path=checkpoint), "coordinator")
    if push_to or push_head_to:
        push = PushWeights(
            version=version, to=push_to or [], head_to=push_head_to or [], delta_base=delta_base or {}
        )
        learner.on_push(push, "coordinator")


def test_step_zero_matches_the_rollout_and_the_push_is_bitwise_exact(tiny: Path, tmp_path: Path) -> None:
    groups = scored_groups(tiny, tmp_path, [[1.0, 0.0, None, 1.0], [0.0, 0.5, 1.0, 0.0]])
    learner, sent = make_learner(tiny, tmp_path, optim={"lr": 1e-3})
    train(learner, groups, version=1, push_to=["rollout:0"])
    (stats,) = sent.of(StepStats)
    assert stats.version == 1 and stats.tokens > 0
    assert stats.metrics["mismatch_logp_abs_max"] < 1e-4  # the learner reads the rollout's log-probs
    assert abs(stats.metrics["ratio_max"] - 1) < 1e-4 and abs(stats.metrics["ratio_min"] - 1) < 1e-4
    assert stats.metrics["invalid_samples"] == 1.0

    rollout, out = make_actor(tiny, tmp_path / "rollout2")
    before = {n: w.clone() for n, w in rollout.model.named_weights()}  # packed ones unpacked
    for update in sent.of(WeightUpdate):
        rollout.on_weights(update, "learner:0")
    drain(rollout)
    assert [a.ok for a in out.of(WeightAck)] == [True] and rollout.policy_version == 1
    learned = dict(learner.model.named_parameters())
    changed = 0
    for name, param in rollout.model.named_weights():
        assert torch.equal(param, learned[name]), name  # bitwise
        changed += not torch.equal(param, before[name])
    assert changed > 0  # the policy moved
    # The push ran without the step's gradients: freed once the optimizer stepped (a model's worth).
    assert all(p.grad is None for p in learner.model.parameters())


def test_a_corrupted_bucket_is_refused_and_nothing_decodes_until_the_version_is_whole(
    tiny: Path, tmp_path: Path
) -> None:
    groups = scored_groups(tiny, tmp_path, [[1.0, 0.0], [0.0, 1.0]])
    learner, sent = make_learner(tiny, tmp_path, optim={"lr": 1e-3}, bucket_bytes=4096)
    train(learner, groups, version=1, push_to=["rollout:0"])
    updates = sent.of(WeightUpdate)
    assert len(updates) > 1  # bucketed
    rollout, out = make_actor(tiny, tmp_path / "rollout2")
    before = {n: w.clone() for n, w in rollout.model.named_weights()}  # packed ones unpacked
    bad = updates[0]
    tampered = WeightUpdate(
        version=bad.version, bucket=bad.bucket, num_buckets=bad.num_buckets, names=bad.names,
        tensors=[bad.tensors[0] + 1e-3, *bad.tensors[1:]], checksum=bad.checksum,
    )  # fmt: skip
    rollout.on_weights(tampered, "learner:0")
    (ack,) = out.of(WeightAck)
    assert not ack.ok and "checksum" in (ack.error or "")
    # The refused bucket wrote nothing; the valid ones that follow go straight into the idle rollout's
    # parameters, and with one bucket missing the version is not whole: nothing decodes meanwhile.
    for update in updates[1:]:
        rollout.on_weights(update, "learner:0")
    rollout.on_generate(request(0, [1, 2, 3], 2, 1.0), "coordinator")
    drain(rollout)
    assert rollout.policy_version == 0 and not out.of(Completion) and len(out.of(WeightAck)) == 1
    params = dict(rollout.model.named_weights())
    assert all(torch.equal(params[n], before[n]) for n in bad.names)
    assert all(
        torch.equal(params[n], t) for u in updates[1:] for n, t in zip(u.names, u.tensors, strict=True)
    )
    rollout.on_weights(bad, "learner:0")  # the bucket again, intact (the learner's re-push)
    assert [(a.version, a.ok) for a in out.of(WeightAck)] == [(1, False), (1, True)]
    drain(rollout)
    assert rollout.policy_version == 1 and {c.policy_version for c in out.of(Completion)} == {1}


def test_invalid_samples_leave_the_loss(tiny: Path, tmp_path: Path) -> None:
    groups = scored_groups(tiny, tmp_path, [[1.0, None, 0.0, None], [None, None, None, None]])
    learner, _ = make_learner(tiny, tmp_path)
    samples, counts = policy_samples(groups, learner.config.loss)
    assert counts["invalid_samples"] == 6.0
    assert len(samples) == 2  # the two valid samples of group 0; group 1 has none
    assert sorted(s.advantage for s in samples) == pytest.approx([-0.7071067, 0.7071067], abs=1e-6)
    assert counts["zero_adv_share"] == 0.5


def test_a_malformed_group_counts_as_arrived_and_trains_nothing(tiny: Path, tmp_path: Path) -> None:
    (good, other) = scored_groups(tiny, tmp_path, [[1.0, 0.0], [0.0, 1.0]])
    broken = msgspec.structs.replace(other, prompt_ids=other.prompt_ids.float())
    learner, sent = make_learner(tiny, tmp_path)
    train(learner, [good, broken], version=1)
    (stats,) = sent.of(StepStats)
    assert stats.metrics["groups"] == 2.0
    assert stats.tokens == sum(len(t) for t in good.response_ids)


def test_checkpoint_then_resume_continues_the_same_run(tiny: Path, tmp_path: Path) -> None:
    groups = scored_groups(tiny, tmp_path, [[1.0, 0.0], [0.0, 1.0]])
    ckpt = tmp_path / "ckpt" / "learner"
    first, _ = make_learner(tiny, tmp_path, optim={"lr": 1e-3})
    train(first, groups, version=1, checkpoint=str(ckpt))
    assert is_checkpoint(ckpt) and not ckpt.with_name("learner.tmp").exists()
    resumed, _ = make_learner(tiny, tmp_path, optim={"lr": 1e-3}, resume_from=str(ckpt))
    assert resumed.version == 1 and resumed.trainer.steps == 1
    for (name, a), b in zip(first.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    nxt = [msgspec.structs.replace(g, step=1) for g in groups]
    train(first, nxt, version=2)
    train(resumed, nxt, version=2)
    for (name, a), b in zip(first.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), name  # same optimizer state: the same second step


def test_applied_weights_are_rehashed_against_the_learners_checksums(tiny: Path, tmp_path: Path) -> None:
    groups = scored_groups(tiny, tmp_path, [[1.0, 0.0], [0.0, 1.0]])
    learner, sent = make_learner(tiny, tmp_path, optim={"lr": 1e-3}, bucket_bytes=4096)
    train(learner, groups, version=1, push_to=["rollout:0"])
    updates = sent.of(WeightUpdate)
    rollout, out = make_actor(tiny, tmp_path / "rollout2", verify_applied_weights=True)
    for update in updates:
        rollout.on_weights(update, "learner:0")
    assert [a.ok for a in out.of(WeightAck)] == [True] and rollout.policy_version == 1

    # A planted apply bug: a written parameter changes after its bucket passed the receipt check.
    learner2, sent2 = make_learner(tiny, tmp_path / "l2", optim={"lr": 1e-3}, bucket_bytes=4096)
    train(learner2, groups, version=1, push_to=["rollout:0"])
    rollout2, out2 = make_actor(tiny, tmp_path / "rollout3", verify_applied_weights=True)
    *first, last = sent2.of(WeightUpdate)
    for update in first:
        rollout2.on_weights(update, "learner:0")
    name = first[0].names[0]
    rollout2.model.write_parameter(name, dict(rollout2.model.named_weights())[name] + 1.0)
    rollout2.on_weights(last, "learner:0")
    (ack,) = out2.of(WeightAck)
    assert not ack.ok and f"buckets [{first[0].bucket}]" in (ack.error or "")


def test_a_checkpoint_that_cannot_be_written_is_answered_as_failed(tiny: Path, tmp_path: Path) -> None:
    """The coordinator waits for the answer: a failed save says so (and leaves no partial file)."""
    learner, out = make_learner(tiny, tmp_path)
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    learner.on_checkpoint(SaveCheckpoint(step=3, path=str(blocker / "step-3" / "learner")), "coordinator")
    (answer,) = out.of(CheckpointSaved)
    assert answer.error and answer.step == 3
    assert "not-a-directory" in answer.error
    good = tmp_path / "ckpt" / "learner"
    learner.on_checkpoint(SaveCheckpoint(step=4, path=str(good)), "coordinator")
    assert [bool(s.error) for s in out.of(CheckpointSaved)] == [True, False]
    assert is_checkpoint(good) and not good.with_name("learner.tmp").exists()


def test_samples_are_held_and_receipted_once_a_newer_try_replaces_and_duplicates_are_counted(
    tiny: Path, tmp_path: Path
) -> None:
    (group,) = scored_groups(tiny, tmp_path, [[1.0, 0.0, 0.5, 1.0], [0.0, 1.0]])[:1]
    learner, sent = make_learner(tiny, tmp_path)
    first, second, *rest = as_completions([group], step=0)
    learner.on_completion(first, "rollout:0")
    learner.on_completion(first, "rollout:1")  # a requeue's copy of the same try: dropped
    newer = msgspec.structs.replace(second, attempt=1, text="the newer try")
    learner.on_completion(second, "rollout:0")
    learner.on_completion(newer, "rollout:0")  # the step's next try: replaces the older copy
    learner.on_completion(second, "rollout:0")  # the older try again: dropped
    receipts = sent.of(SampleReceipt)
    assert [(r.sample_index, r.attempt) for r in receipts] == [(0, 0), (1, 0), (1, 1)]
    assert receipts[0].tokens == len(first.token_ids) and receipts[2].text == "the newer try"
    assert not any(isinstance(m, torch.Tensor) for r in receipts for m in msgspec.structs.astuple(r))
    for completion in rest:
        learner.on_completion(completion, "rollout:0")
    learner.on_train(
        train_step([group], version=1, step=0, samples_path=str(tmp_path / "s.jsonl")), "coordinator"
    )
    assert learner.step()
    (stats,) = sent.of(StepStats)
    assert stats.metrics["duplicates"] == 2.0 and stats.metrics["groups"] == 1.0
    texts = [json.loads(line)["text"] for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert texts == ["response 0", "the newer try", "response 2", "response 3"]
    learner.on_completion(first, "rollout:0")  # a copy after its step trained (policy v0 < v1): dropped
    assert len(sent.of(SampleReceipt)) == 3 + 2 and learner._duplicates == 1


def test_a_step_waits_until_every_sample_of_its_groups_is_held(tiny: Path, tmp_path: Path) -> None:
    groups = scored_groups(tiny, tmp_path, [[1.0, 0.0], [0.0, 1.0]])
    learner, sent = make_learner(tiny, tmp_path)
    *early, last = as_completions(groups, step=0)
    for completion in early:
        learner.on_completion(completion, "rollout:0")
    learner.on_train(train_step(groups, version=1, step=0), "coordinator")
    assert not learner.step() and not sent.of(StepStats)  # one sample still on its way
    learner.on_completion(last, "rollout:1")
    assert learner.step() and len(sent.of(StepStats)) == 1
