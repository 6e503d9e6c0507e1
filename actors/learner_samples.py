"""What the learner trains on: a step's scored groups, checked, turned into `PolicySample`s.

A group that cannot be trained on (dtypes, ranks, lengths that disagree) is emptied rather than dropped:
it still counts as arrived, so the coordinator's count of the step's groups holds, and it trains nothing.
The others' rewards become GRPO group advantages (`engine.grpo`, invalid rewards masked); a sample with
an empty response or in a group whose advantages are all zero (when configured) is left out.

Not an actor: the learner's own part, beside it because it reads the `ScoredGroup` message (engine/
sees no messages), and apart because it is a pure function of a step's groups (tests call it alone).
"""

from __future__ import annotations

import torch

from slipstream.engine.grpo import LossConfig, group_advantages
from slipstream.engine.policy_train import PolicySample
from slipstream.protocols.learner import ScoredGroup


def policy_samples(
    groups: list[ScoredGroup], loss: LossConfig
) -> tuple[list[PolicySample], dict[str, float]]:
    """A step's training samples (valid ones, with group advantages) and what was left out."""
    if not groups:
        return [], {"groups": 0.0, "invalid_samples": 0.0, "zero_adv_share": 0.0}
    size = max(len(g.rewards) for g in groups)
    rewards = torch.zeros(len(groups), size, dtype=torch.float64)
    valid = torch.zeros(len(groups), size, dtype=torch.bool)
    for i, g in enumerate(groups):
        for j, r in enumerate(g.rewards):
            if r is not None:
                rewards[i, j], valid[i, j] = r, True
    adv = group_advantages(rewards, valid, normalize_std=loss.normalize_std)
    keep = adv.sample_mask(loss.drop_zero_adv_groups)
    samples = [
        PolicySample(
            prompt_ids=g.prompt_ids.tolist(),
            response_ids=g.response_ids[j].tolist(),
            behaviour_logprobs=g.behaviour_logprobs[j].tolist(),
            advantage=float(adv.advantages[i, j]),
            temperature=g.temperature,
            top_p=g.top_p,
            top_k=g.top_k,
            # A multi-turn episode's environment tokens: context, out of the loss (engine/policy_train.py).
            policy_mask=g.policy_masks[j].tolist() if g.policy_masks and g.policy_masks[j].numel() else None,
        )
        for i, g in enumerate(groups)
        for j in range(len(g.rewards))
        if keep[i, j] and len(g.response_ids[j]) > 0
    ]
    counts = {
        "groups": float(len(groups)),
        "invalid_samples": float(sum(r is None for g in groups for r in g.rewards)),
        "zero_adv_share": float(adv.zero_adv_share),
    }
    return samples, counts


def check_group(msg: ScoredGroup) -> str | None:
    """Why a decoded group cannot be trained on (dtype, rank, lengths), or None."""
    n = len(msg.rewards)
    if len(msg.response_ids) != n or len(msg.behaviour_logprobs) != n:
        return f"{len(msg.response_ids)} responses, {len(msg.behaviour_logprobs)} log-prob rows, {n} rewards"
    if msg.prompt_ids.dtype != torch.int64 or msg.prompt_ids.dim() != 1 or msg.prompt_ids.numel() == 0:
        return f"prompt_ids must be a non-empty 1-D int64 tensor, got {msg.prompt_ids.dtype} {tuple(msg.prompt_ids.shape)}"
    for j, (ids, logp) in enumerate(zip(msg.response_ids, msg.behaviour_logprobs, strict=True)):
        if ids.dtype != torch.int64 or ids.dim() != 1:
            return f"response {j}: ids must be 1-D int64, got {ids.dtype} {tuple(ids.shape)}"
        if logp.dtype != torch.float32 or logp.shape != ids.shape:
            return f"response {j}: log-probs must be float32 {tuple(ids.shape)}, got {logp.dtype} {tuple(logp.shape)}"
    if msg.policy_masks and len(msg.policy_masks) != n:
        return f"{len(msg.policy_masks)} policy masks for {n} responses"
    return None


def without_samples(msg: ScoredGroup) -> ScoredGroup:
    """The group with every sample marked invalid: it still counts as arrived, it trains nothing."""
    return ScoredGroup(
        step=msg.step,
        group_id=msg.group_id,
        prompt_ids=torch.zeros(1, dtype=torch.int64),
        response_ids=[],
        behaviour_logprobs=[],
        rewards=[],
        policy_version=msg.policy_version,
    )


__all__ = ["check_group", "policy_samples", "without_samples"]
