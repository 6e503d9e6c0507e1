"""One step of the run as data: `StepWork`, the state rl/run.py's verbs fill phase by phase, and what a
finished step leaves: its `StepRecord` (metrics.jsonl, the sinks; fields in rl/run_dir.py) and its line.

The non-obvious choice: everything of one step lives in its `StepWork`, never in the run's fields, so a
step can be trained again, or rolled out again as its next try, after a learner death without anything of
the earlier try leaking in; the record is a pure function of it (and of what the coordinator counted).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from slipstream.protocols.learner import GroupPlan, StepStats
from slipstream.rl.run_dir import StepRecord
from slipstream.rl.step import Arrival, StepMetrics
from slipstream.tasks.datasets import Row

__all__ = ["StepWork", "explain_reward_errors", "step_line", "step_record"]


@dataclass
class StepWork:
    """One step's state, filled phase by phase."""

    step: int
    rows: dict[int, Row]  # group id -> its dataset row (group ids are global, their seeds too)
    prompts: dict[int, list[int]]  # group id -> prompt token ids
    data_cursor: dict[str, Any]  # the stream after this step's rows: where a resume reads on
    restarts_before: int  # the run's restarts before this step (the step reports its own)
    attempt: int = 0  # the step's try: rolled out again after a learner died holding its samples
    started: float = field(default_factory=time.monotonic)
    # (group, sample) -> its receipt: the learner rank its group went to holds the sample itself
    completions: dict[tuple[int, int], Arrival] = field(default_factory=dict)
    rewards: dict[tuple[int, int], float | None] = field(default_factory=dict)
    reward_errors: dict[str, int] = field(default_factory=dict)
    metrics: StepMetrics = field(default_factory=StepMetrics)
    groups: list[GroupPlan] = field(default_factory=list)  # what the learner ranks are asked to train
    stats: list[StepStats] = field(default_factory=list)
    checkpoint: str = ""  # relative to the run directory; "" when none is due
    marks: dict[str, float] = field(default_factory=dict)  # phase -> seconds (its last try)

    @property
    def version(self) -> int:
        """The policy version this step trains."""
        return self.step + 1


def step_record(
    work: StepWork, *, moved: dict[str, int], restarts: list[str], multi_turn: bool
) -> StepRecord:
    """The step's metrics.jsonl record (fields: rl/run_dir.py), once it is done. `moved`: what the push
    of its version sent across hosts (the coordinator's `pushed`); `restarts`: the actors restarted during
    it; `multi_turn`: a run of episodes (every sample counts its turns)."""
    groups, m, marks, lead = work.groups, work.metrics, work.marks, work.stats[0]
    valid = [r for grp in groups for r in grp.rewards if r is not None]
    mixed = sum(len({r for r in grp.rewards if r is not None}) > 1 for grp in groups)
    tokens = sum(c.tokens for c in work.completions.values())
    turns = [c.turns for c in work.completions.values() if c.turns]  # episodes' policy turns
    # A multi-turn run: every sample is an episode (an invalid one too, with the turns it reached).
    by_count = Counter(str(c.turns) for c in work.completions.values() if multi_turn)
    waits = [c.env_wait_s for c in work.completions.values()]
    return StepRecord(
        step=work.step,
        reward_mean=round(sum(valid) / len(valid), 4) if valid else math.nan,
        correct_share=round(sum(r >= 1.0 for r in valid) / len(valid), 4) if valid else math.nan,
        nonzero_adv_share=round(mixed / len(groups), 4),
        invalid=sum(r is None for grp in groups for r in grp.rewards),
        tokens=tokens,
        mean_response_tokens=round(tokens / max(len(work.completions), 1), 1),
        step_s=round(time.monotonic() - work.started, 3),
        rollout_s=round(m.rollout_s, 3),
        reward_s=round(marks["reward"], 3),
        learn_s=round(marks["learn"], 3),
        sync_s=round(marks["sync"], 3),
        checkpoint_s=round(marks.get("checkpoint", 0.0), 3),
        accept_length=round(m.accept_length, 3),
        spec_accept_length=round(m.spec_accept_length, 3),
        spec_token_share=round(m.spec_token_share, 4),
        arms=dict(m.arms),
        accept_by_batch=m.speculated_accept_length(),
        arms_by_batch={bucket: dict(arms) for bucket, arms in m.arms_by_batch.items()},
        decode_by_batch=m.decode_seconds_by_batch(),
        accept_by_position=m.accept_by_position(),
        arm_table=m.arm_table(),
        drafter_loss=None if m.drafter_loss is None else round(m.drafter_loss, 5),
        idle_device_s=round(m.idle_device_s, 3),
        reclaimed_s=round(m.reclaimed_s, 3),
        loss=lead.loss,
        grad_norm=lead.grad_norm,
        reward_errors=work.reward_errors,
        requeued=m.requeued,
        # Copies dropped at the head (rewards, strays) and at the learner ranks (samples held already).
        duplicates=m.duplicates + sum(int(s.metrics.get("duplicates", 0)) for s in work.stats),
        reward_call_s=round(m.reward_call_s, 3),
        reward_terms=m.reward_terms(),
        mismatch_logp_abs_max=lead.metrics.get("mismatch_logp_abs_max", 0.0),
        sync_bytes=moved.get("push_bytes", 0),
        wire_bytes=moved.get("wire_bytes", 0),
        wire_full_bytes=moved.get("full_bytes", 0),
        policy_version=work.version,
        restarts=restarts,
        turns_mean=round(sum(turns) / len(turns), 3) if turns else 0.0,
        turns_max=max(turns, default=0),
        turns_by_count=dict(sorted(by_count.items(), key=lambda kv: int(kv[0]))),
        env_wait_s=round(sum(waits), 3),
        env_wait_max_s=round(max(waits, default=0.0), 3),
    )


def step_line(r: StepRecord, steps: int) -> str:
    """One finished step, compact: printed as it finishes, whether stdout is a terminal or not (the progress
    bars are transient and on stderr; a step's line comes after its bar is gone)."""
    split = f"rollout {r.rollout_s:.1f}, reward {r.reward_s:.1f}, learn {r.learn_s:.1f}, sync {r.sync_s:.1f}"
    split += f", ckpt {r.checkpoint_s:.1f}" if r.checkpoint_s else ""
    invalid = f"  {r.invalid} invalid" if r.invalid else ""
    wait = f", env wait {r.env_wait_s:.1f} s"
    invalid += f"  turns {r.turns_mean:.1f} (max {r.turns_max}{wait})" if r.turns_max else ""
    # The reward calls' seconds over the step's: what rewards cost, overlapped with the rollout or not.
    calls = f"  reward calls {r.reward_call_s / r.step_s:.0%}" if r.reward_terms and r.step_s > 0 else ""
    return (
        f"step {r.step + 1}/{steps}  reward {r.reward_mean:.3f}  correct {r.correct_share:.3f}  {r.tokens} tok  "
        f"{r.step_s:.1f} s ({split}){calls}  {_speculation(r)}{invalid}"
    )


def _speculation(r: StepRecord) -> str:
    """What speculation did in the step: its accept length where it ran, and the share of tokens it decoded
    (an average over every iteration would count the tuner's plain ones as 1.0)."""
    if not r.spec_token_share:
        return "no speculation"
    return f"accept {r.spec_accept_length:.2f} on {r.spec_token_share:.0%} of tokens"


def explain_reward_errors(errors: dict[str, int]) -> str:
    """The reward's most common errors, with the fix for the usual signature mistake."""
    if not errors:
        return "no error was reported"
    top = sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    text = "; ".join(f"{n}× {e}" for e, n in top)
    if any("unexpected keyword argument" in e for e in errors):
        text += (
            " — a reward is called as fn(prompt, completion, **row), row being the dataset row's fields "
            "(question, answer, metadata): accept **kwargs (e.g. def reward(prompt, completion, answer, **_))"
        )
    return text
