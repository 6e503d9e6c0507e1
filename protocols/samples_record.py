"""The samples record: a step's responses with their rewards and behaviour log-probs, as JSON lines.

The learner writes it (each rank its share: rank 0 `samples/step-N.jsonl`, rank r `step-N.rank-r.jsonl`)
before it trains on a step, so a restarted learner replays the step from it (`TrainStep.replay`) without
rolling it out again; `slipstream report` and the tests read what the policy did from it. A file on disk
spoken between processes, so it lives beside the wire messages: written atomically (a reader never sees
half a share), read back as the `ScoredGroup`s the learner trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from slipstream.protocols.learner import GroupPlan, SampleReceipt, ScoredGroup
from slipstream.protocols.rollout import Completion

__all__ = [
    "assemble",
    "opening_digest",
    "read_groups",
    "receipt_of",
    "sample_files",
    "share_path",
    "write_samples",
]


def opening_digest(prompt_ids: torch.Tensor) -> str:
    """An episode's opening as a receipt names it ("": none, a single turn's): a group's must agree."""
    if not prompt_ids.numel():
        return ""
    return hashlib.blake2b(prompt_ids.numpy().tobytes(), digest_size=8).hexdigest()


def receipt_of(c: Completion) -> SampleReceipt:
    """What the coordinator keeps of a held sample: no tensors, the text to score."""
    return SampleReceipt(
        group_id=c.group_id, sample_index=c.sample_index, tokens=len(c.token_ids),
        finish_reason=c.finish_reason, policy_version=c.policy_version, accept_length=c.accept_length,
        text=c.text, opening=opening_digest(c.prompt_ids), turns=c.turns, env_wait_s=c.env_wait_s,
        env_reward=c.env_reward, error=c.error, attempt=c.attempt,
    )  # fmt: skip


def assemble(plan: GroupPlan, held: Sequence[Completion], step: int, sampling: dict[str, Any]) -> ScoredGroup:
    """Group `plan`'s samples (in index order) with its rewards. Its prompt: the plan's, or for episodes the
    first sample's opening (a sample whose opening differs was made invalid by the coordinator)."""
    openings = [c.prompt_ids for c in held if c.prompt_ids.numel()]
    prompt = plan.prompt_ids if plan.prompt_ids.numel() or not openings else openings[0]
    return ScoredGroup(
        step=step, group_id=plan.group_id, prompt_ids=prompt,
        response_ids=[c.token_ids for c in held], behaviour_logprobs=[c.logprobs for c in held],
        rewards=list(plan.rewards), **sampling, policy_version=step,
        # A multi-turn episode's: which tokens the policy sampled (the environment's are context).
        policy_masks=[c.policy_mask for c in held] if any(c.policy_mask.numel() for c in held) else [],
    )  # fmt: skip


def share_path(run_dir: Path, step: int, rank: int) -> Path:
    """Where learner rank `rank` writes its share of step `step`."""
    name = f"step-{step}.jsonl" if rank == 0 else f"step-{step}.rank-{rank}.jsonl"
    return run_dir / "samples" / name


def sample_files(run_dir: Path, step: int) -> list[Path]:
    """Step `step`'s shares on disk, rank 0's first."""
    folder = run_dir / "samples"
    return sorted(
        (
            p
            for p in [folder / f"step-{step}.jsonl", *folder.glob(f"step-{step}.rank-*.jsonl")]
            if p.is_file()
        ),
        key=lambda p: int(p.name.rsplit("rank-", 1)[1].split(".")[0]) if "rank-" in p.name else 0,
    )


def write_samples(path: Path, groups: Sequence[ScoredGroup], texts: Sequence[Sequence[str]]) -> None:
    """Every response of `groups` with its reward and `texts` (per group, per response), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    encode = msgspec.json.Encoder().encode  # json.dumps cost seconds at users' step sizes (`bench scale`)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as out:
        for group, group_texts in zip(groups, texts, strict=True):
            prompt = group.prompt_ids.tolist()
            responses = [ids.tolist() for ids in group.response_ids]
            for i, (tokens, text, reward) in enumerate(
                zip(responses, group_texts, group.rewards, strict=True)
            ):
                row = {
                    "group_id": group.group_id, "sample_index": i, "reward": reward,
                    "text": text, "token_ids": tokens, "prompt_ids": prompt,
                    # The behaviour log-probs: what a replay of this step by a restarted learner needs.
                    "logprobs": group.behaviour_logprobs[i].tolist(),
                }  # fmt: skip
                if group.policy_masks and group.policy_masks[i].numel():  # a multi-turn episode's
                    row["policy_mask"] = [int(x) for x in group.policy_masks[i].tolist()]
                out.write(encode(row) + b"\n")
    os.replace(tmp, path)


def read_groups(paths: Sequence[Path], step: int, sampling: dict[str, Any]) -> list[ScoredGroup]:
    """The groups recorded in `paths` (a step's shares), by group id; `sampling`: temperature, top_p and
    top_k, how the step was sampled."""
    by_group: dict[int, list[dict[str, Any]]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            by_group.setdefault(row["group_id"], []).append(row)
    groups = []
    for group_id, rows in sorted(by_group.items()):
        rows.sort(key=lambda r: r["sample_index"])
        groups.append(
            ScoredGroup(
                step=step,
                group_id=group_id,
                prompt_ids=torch.tensor(rows[0]["prompt_ids"], dtype=torch.int64),
                response_ids=[torch.tensor(r["token_ids"], dtype=torch.int64) for r in rows],
                behaviour_logprobs=[torch.tensor(r["logprobs"], dtype=torch.float32) for r in rows],
                rewards=[r["reward"] for r in rows],
                **sampling,
                policy_version=step,
                policy_masks=[torch.tensor(r.get("policy_mask", []), dtype=torch.bool) for r in rows]
                if any("policy_mask" in r for r in rows)
                else [],
            )
        )
    return groups
