"""The learner's side of a multi-turn record: each Completion's policy mask crosses the wire (codec), into
the group the learner assembles and the samples record a restarted learner replays from, and into
`PolicySample.policy_mask`, so an environment's tokens stay out of the loss: the update reads nothing at
them (their rollout log-probs can be anything), and a learner that drops the masks trains on them."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from slipstream.actors.learner import policy_samples
from slipstream.engine.grpo import LossConfig
from slipstream.engine.policy_train import OptimConfig, PolicyTrainer
from slipstream.engine.weights import load_model
from slipstream.protocols import samples_record
from slipstream.protocols.learner import GroupPlan, ScoredGroup
from slipstream.protocols.rollout import Completion
from slipstream.runtime.codec import Codec, ProtocolError
from tests.engine.conftest import build_checkpoint

PROMPT = [5, 6, 7, 8]
RESPONSES = [[9, 10, 11, 40, 41, 42, 12, 13], [14, 15, 16, 40, 41, 42, 17]]
MASKS = [[True] * 3 + [False] * 3 + [True] * 2, [True] * 3 + [False] * 3 + [True]]


def group(*, masks: bool = True, behaviour: list[list[float]] | None = None) -> ScoredGroup:
    """The two-sample group; `behaviour` its rollout log-probs (default 0.0 at observations, -1.5 else)."""
    if behaviour is None:
        behaviour = [[0.0 if not m else -1.5 for m in mask] for mask in MASKS]
    logp = [torch.tensor(b) for b in behaviour]
    return ScoredGroup(
        step=0, group_id=0, prompt_ids=torch.tensor(PROMPT),
        response_ids=[torch.tensor(r) for r in RESPONSES], behaviour_logprobs=logp, rewards=[1.0, 0.0],
        policy_version=0, policy_masks=[torch.tensor(m) for m in MASKS] if masks else [],
    )  # fmt: skip


def completions() -> list[Completion]:
    g = group()
    return [
        Completion(
            group_id=0, sample_index=i, token_ids=ids, logprobs=logp, finish_reason="stop", policy_version=0,
            policy_mask=mask, prompt_ids=g.prompt_ids,
        )
        for i, (ids, logp, mask) in enumerate(zip(g.response_ids, g.behaviour_logprobs, g.policy_masks, strict=True))
    ]  # fmt: skip


def test_masks_cross_the_wire_and_the_samples_file(tmp_path: Path) -> None:
    codec = Codec()
    held = [codec.decode(codec.encode(c)) for c in completions()]
    plan = GroupPlan(group_id=0, prompt_ids=torch.empty(0, dtype=torch.int64), rewards=[1.0, 0.0])
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
    got = samples_record.assemble(plan, held, 0, sampling)  # an episode's: its opening is the prompt
    assert got.prompt_ids.tolist() == PROMPT
    samples, _ = policy_samples([got], LossConfig())
    assert [list(s.policy_mask) for s in samples] == MASKS
    assert [s.num_policy_tokens for s in samples] == [5, 4]
    path = tmp_path / "samples" / "step-0.jsonl"
    samples_record.write_samples(path, [got], [["a", "b"]])
    (back,) = samples_record.read_groups([path], 0, sampling)
    assert [m.tolist() for m in back.policy_masks] == MASKS
    single, _ = policy_samples([group(masks=False)], LossConfig())
    assert all(s.policy_mask is None for s in single)


def test_a_malformed_mask_is_refused_at_decoding() -> None:
    codec = Codec()
    kind, body, *tensors = codec.encode(completions()[0])
    fields = msgspec.msgpack.decode(bytes(body))
    fields[list(Completion.__struct_fields__).index("policy_mask")] = ["bool", [1], b"\x01"]  # 1 of 8 tokens
    with pytest.raises(ProtocolError, match="policy_mask"):
        codec.decode([kind, msgspec.msgpack.encode(fields), *tensors])


def test_a_planted_unmasked_observation_changes_the_update(tmp_path: Path) -> None:
    model_dir = build_checkpoint(tmp_path / "tiny")

    def grads(scored: ScoredGroup) -> tuple[torch.Tensor, float]:
        samples, _ = policy_samples([scored], LossConfig())
        trainer = PolicyTrainer(load_model(model_dir), optim=OptimConfig(lr=1e-3, max_grad_norm=1e9))
        stats = trainer.step(samples)
        return torch.cat([p.grad.reshape(-1) for p in trainer.params]), stats["tokens"]

    masked, tokens = grads(group())
    planted, planted_tokens = grads(group(masks=False))  # what a learner that ignores the masks trains
    assert tokens == 9 and planted_tokens == 15
    assert not torch.allclose(masked, planted)


def test_the_update_reads_nothing_at_an_environments_tokens(tmp_path: Path) -> None:
    """Whatever the rollout's log-probs say at the observation tokens, the gradient is the same, bitwise; the
    same change at one policy token changes it. A loss that weighed the observation tokens (even with the
    token count right) would scale each by its ratio to those log-probs."""
    model_dir = build_checkpoint(tmp_path / "tiny")
    # No ratio here is clipped (the tiny model's log-probs are about -5): every token counts, with its ratio.
    loss = LossConfig(eps_low=0.99, eps_high=100.0)

    def grads(observation: float, policy: float, first_policy: float | None = None) -> torch.Tensor:
        behaviour = [[policy if m else observation for m in mask] for mask in MASKS]
        if first_policy is not None:
            behaviour[0][0] = first_policy
        samples, _ = policy_samples([group(behaviour=behaviour)], loss)
        trainer = PolicyTrainer(
            load_model(model_dir), loss=loss, optim=OptimConfig(lr=1e-3, max_grad_norm=1e9)
        )
        assert trainer.step(samples)["tokens"] == 9
        return torch.cat([p.grad.reshape(-1) for p in trainer.params])

    base = grads(observation=-4.0, policy=-5.0)
    assert torch.equal(base, grads(observation=-6.5, policy=-5.0))
    assert torch.equal(base, grads(observation=0.0, policy=-5.0))
    assert not torch.allclose(base, grads(observation=-4.0, policy=-5.0, first_policy=-5.5))  # it can tell
