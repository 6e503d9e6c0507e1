"""`slipstream train` end to end on a tiny model with SmolLM2's tokenizer: real processes, real rewards.

The tiny model (random weights, SmolLM2's vocabulary and chat template) decodes fast, so a 3-step run takes
seconds of compute. Its answers are noise, so the reward adds a term of the text's length to the
reasoning-gym score: groups then have mixed rewards and the policy really moves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import uvloop

from slipstream.cli import trace as trace_cli
from slipstream.cli import train
from slipstream.engine.policy_checkpoint import is_checkpoint
from slipstream.engine.tokenizer import Tokenizer
from slipstream.rl import run_config, run_plan
from slipstream.tasks.datasets import chat_prompt_ids
from tests.cli.conftest import brevity, config
from tests.cli.test_trace import check_chrome_trace

pytestmark = pytest.mark.timeout(600)


def own_rewards(cfg: run_config.TrainConfig, run_dir: Path) -> list[tuple[dict[str, Any], float]]:
    """Every recorded sample (a samples/step-N.jsonl line, with its step) beside the reward of its own
    completion: the run's reward, brevity, applied to the sample's tokens decoded as the verifier gets them
    (special tokens dropped) and to the fields, through JSON as sent, of the row whose prompt it answers."""
    assert cfg.reward == "tests.cli.conftest:brevity"
    tokenizer = Tokenizer.from_dir(Path(cfg.model))
    dealt = run_config.data_stream(cfg, {}).take(cfg.steps * cfg.prompts_per_step)
    rows = {tuple(chat_prompt_ids(tokenizer, row.question)): row for row in dealt}
    out = []
    for step in range(cfg.steps):
        for line in (run_dir / "samples" / f"step-{step}.jsonl").read_text().splitlines():
            sample = json.loads(line)
            row = rows[tuple(sample["prompt_ids"])]
            fields = json.loads(
                json.dumps({"question": row.question, "answer": row.answer, "metadata": row.metadata})
            )
            text = tokenizer.decode(sample["token_ids"], skip_special_tokens=True)
            out.append(({"step": step, **sample}, brevity(row.question, text, **fields)))
    assert len(out) == cfg.steps * cfg.prompts_per_step * cfg.group_size
    return out


def differing(rewards: list[tuple[dict[str, Any], float]]) -> list[tuple[int, int, int, float | None, float]]:
    """(step, group, sample, recorded, own) of each sample whose recorded reward is not its own."""
    return [
        (s["step"], s["group_id"], s["sample_index"], s["reward"], own)
        for s, own in rewards
        if s["reward"] != own
    ]


def test_three_steps_learn_sync_and_train_the_drafter_in_idle_time(tiny_chat: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = config(tiny_chat)
    summary = uvloop.run(train.train(cfg, run_dir))
    steps = summary["steps"]
    # Every rollout acknowledged each version, having re-hashed its weights to the learner's (bitwise).
    assert [s["policy_version"] for s in steps] == [1, 2, 3]
    applied = [json.loads(line) for line in (run_dir / "logs" / "rollout-0.jsonl").read_text().splitlines()]
    assert [r["version"] for r in applied if r["event"] == "weights_applied" and r["verified"]] == [1, 2, 3]
    # One drafter for this CPU host's two rollout cores: it holds the policy's embedding and head alone,
    # and follows them after every push.
    assert sorted(p.name for p in (run_dir / "logs").glob("drafter-*.jsonl")) == ["drafter-0.jsonl"]
    log = [json.loads(line) for line in (run_dir / "logs" / "drafter-0.jsonl").read_text().splitlines()]
    assert [r["version"] for r in log if r["event"] == "head_synced"] == [1, 2, 3]
    assert {r["cpus"][0] for r in log if r["event"] == "leased"} <= {0, 1}  # each lease pins one core
    assert all(s["nonzero_adv_share"] > 0 for s in steps)  # the reward differed inside groups
    assert all(s["grad_norm"] > 0 for s in steps)  # so the policy moved
    # Every step, not only step 0: the learner scores the rollout's tokens under the weights the rollout
    # sampled them with, so any cached copy left stale by a weight update (a packed head) shows up here.
    assert [s["mismatch_logp_abs_max"] < 1e-4 for s in steps] == [True] * 3, steps
    assert all(s["invalid"] == 0 for s in steps)
    # Each sample carries the reward of its own completion: a reward moved to a sibling keeps the step's mean
    # and its mixed groups, so nothing above would notice it.
    assert differing(own_rewards(cfg, run_dir)) == []
    assert sum(s["reclaimed_s"] for s in steps) > 0  # the drafter trained in leased idle time
    speculated = [s["accept_by_batch"] for s in steps]  # where the tuner speculated, per batch bucket
    assert any(speculated) and all(set(a) <= {"1", "2", "3-4", "5-8"} for a in speculated), speculated
    assert all(v >= 1.0 for a in speculated for v in a.values())
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]
    assert json.loads((run_dir / "summary.json").read_text())["last_reward"] == steps[-1]["reward_mean"]
    assert is_checkpoint(run_dir / "checkpoints" / "step-2" / "learner")
    # The per-bucket arm counts add up to the step's, draft depths accept a share, a push has a size.
    for s in steps:
        by_bucket: dict[str, int] = {}
        for arms in s["arms_by_batch"].values():
            for arm, n in arms.items():
                by_bucket[arm] = by_bucket.get(arm, 0) + n
        assert by_bucket == s["arms"]
        assert all(0.0 <= a <= 1.0 for a in s["accept_by_position"]) and s["sync_bytes"] > 0
    assert any(s["accept_by_position"] for s in steps)
    # None where the drafter finished no training step inside the step (preempted mid-step counts none).
    assert all(s["drafter_loss"] is None or s["drafter_loss"] > 0 for s in steps)
    check_run_trace(run_dir, rollouts=2, steps=3)
    # The last checkpoint, also as an HF model directory (tests/engine/test_hf_export.py: transformers loads
    # such a directory to our logits).
    assert json.loads((run_dir / "hf" / "SOURCE.json").read_text())["step"] == 3
    assert summary["hf"] == str(run_dir / "hf") and (run_dir / "hf" / "model.safetensors").is_file()


def check_run_trace(run_dir: Path, *, rollouts: int, steps: int) -> None:
    """`slipstream trace` of a real run: valid Chrome trace JSON, spans from every role and the
    coordinator, each weight push a flow from the learner to every rollout."""
    out = run_dir / "trace.json"
    assert trace_cli.run(argparse.Namespace(run=run_dir, out=out, steps=None)) == 0
    trace = json.loads(out.read_text())
    check_chrome_trace(trace)
    events = trace["traceEvents"]
    name_of = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    spans_of: dict[str, set[str]] = {}
    for e in events:
        if e["ph"] in ("X", "i"):
            spans_of.setdefault(name_of[e["pid"]], set()).add(e["name"])
    assert {"step", "rollout", "reward", "learn", "sync"} <= spans_of["coordinator"]
    for r in range(rollouts):
        assert {"iteration", "sample", "apply_weights", "warm_up", "draft", "verify"} <= spans_of[
            f"rollout-{r}"
        ]
    iterations = [e for e in events if e.get("name") == "iteration"]
    assert sum(e["args"]["prefill_tokens"] for e in iterations) > 0  # prompts prefilled inside iterations
    assert {"micro_batch", "optimizer", "push"} <= spans_of["learner-0"]
    assert "reward" in spans_of["verifier-0"]
    assert {"lease", "train_step"} <= spans_of["drafter-0"]
    assert {"device_idle", "lease"} <= spans_of["devices"]
    written = sum(len(p.read_text().splitlines()) for p in (run_dir / "samples").glob("step-*.jsonl"))
    assert len([e for e in events if e.get("name") == "sample"]) == written  # one span per completion
    flows = [e for e in events if e["ph"] in ("s", "f")]
    ends = sorted(name_of[e["pid"]] for e in flows if e["ph"] == "f")
    assert ends == sorted(f"rollout-{r}" for r in range(rollouts) for _ in range(steps))
    assert {name_of[e["pid"]] for e in flows if e["ph"] == "s"} == {"learner-0"}


def test_a_request_the_rollout_cannot_serve_is_recorded_invalid(tiny_chat: Path, tmp_path: Path) -> None:
    rows = [
        {"question": r.question, "answer": r.answer, "metadata": r.metadata}
        for r in run_config.data_stream(config(tiny_chat), {}).take(3)
    ]
    # Padded, the second question's prompt outgrows the rollouts' max_len (1024 + max_tokens): its group comes
    # back as "error" completions. Their empty text would still score (brevity gives it 0.0): only the finish
    # reason says that there is no response to learn from.
    rows[1]["question"] += " 0" * 1100
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config(tiny_chat, task=str(data), steps=1, drafter={"enabled": False}, rollout={"devices": 1})
    run_dir = tmp_path / "run"
    summary = uvloop.run(train.train(cfg, run_dir))
    log = [json.loads(line) for line in (run_dir / "logs" / "rollout-0.jsonl").read_text().splitlines()]
    refusals = [r["error"] for r in log if r["event"] == "bad_request"]
    assert len(refusals) == 4 and all("max_len" in e for e in refusals), refusals
    rewards = own_rewards(cfg, run_dir)
    refused = [(s, own) for s, own in rewards if len(s["prompt_ids"]) >= 1024 + cfg.max_tokens]
    assert [(s["token_ids"], s["reward"]) for s, _ in refused] == [([], None)] * 4
    assert summary["steps"][0]["invalid"] == 4
    assert differing([r for r in rewards if r not in refused]) == []


def test_bench_e2e_runs_both_modes_and_times_the_learner(tiny_chat: Path, tmp_path: Path) -> None:
    """Greedy, so that it also checks the baseline and the default rollouts (every arm, the drafter trained
    online) token-identical: one pair of runs for both (it was a test of its own, and a second pair)."""
    from slipstream.benchmarks import e2e

    cfg = config(tiny_chat, steps=2, temperature=0.0)

    def run(run_dir: Path, baseline: bool, turns: str | None) -> dict[str, Any]:
        run_dir.mkdir(parents=True)
        (run_dir / "config.json").write_text(json.dumps(msgspec.to_builtins(cfg)))
        return uvloop.run(train.train(cfg, run_dir, baseline=baseline))

    result = e2e.run(run, tmp_path, cost_steps=2, threads=1)
    assert result.steps == 2 and len(result.slipstream.step_s_each) == len(result.baseline.step_s_each) == 2
    assert result.slipstream.reclaimed_s > 0 and result.baseline.reclaimed_s == 0  # no drafter in baseline
    assert result.baseline.accept_length == 1.0  # plain decoding: one token per target forward
    assert result.baseline.step0_accept_by_batch == {}  # it never speculated
    assert result.speedup_step > 0 and result.slipstream.tokens_per_s > 0
    # Greedy: every response token-identical across the two modes, and the default run tried speculative
    # arms where the baseline never did.
    samples = {
        mode: sorted(
            (step, r["group_id"], r["sample_index"], r["token_ids"])
            for step in range(2)
            for r in map(
                json.loads, (tmp_path / mode / "samples" / f"step-{step}.jsonl").read_text().splitlines()
            )
        )
        for mode in ("baseline", "slipstream")
    }
    assert samples["baseline"] == samples["slipstream"] and len(samples["baseline"]) == 24
    assert result.identical_sample_steps == 2
    assert result.slipstream.step0_accept_by_batch  # it speculated
    # In-process runs write no coordinator log (the CLI configures it): no inbound figures, not zeros.
    assert result.slipstream.inbound_by_kind == {} and result.slipstream.inbound_messages == 0
    cost = result.learner
    assert cost.steps == 2 and len(cost.forward_s) == len(cost.train_s) == 2
    assert cost.sequence_tokens > cost.response_tokens > 0
    assert cost.cost_x > 1  # forward + backward + optimizer cost more than the forward alone
    decoded = json.loads(msgspec.json.encode(result))
    assert decoded["learner"]["cost_x"] == cost.cost_x and "speedup_rollout" in decoded
    assert "learner cost per token" in e2e.render(result)
    if Path("/proc/self/smaps_rollup").is_file():  # sampled while each run ran: every actor, at once
        held = result.slipstream.peak_pss_mb
        assert {"coordinator", "learner:0", "rollout:0", "drafter:0"} <= held.keys()
        assert result.slipstream.peak_pss_mb_total == pytest.approx(sum(held.values()), abs=1)
        assert "peak summed PSS" in e2e.render(result)


def test_a_run_that_takes_turns_computes_only_in_its_own(tiny_chat: Path, tmp_path: Path) -> None:
    """`--turns`: start-up, each step and the shutdown wait for the run's turn; between them the other
    party (here a thread standing in for bench e2e's other run) holds it, and no step overlaps its turns."""
    import threading

    from slipstream.runtime.turns import Turns

    cfg = config(tiny_chat, steps=2)
    baton = tmp_path / "baton"
    baton.write_text("run")
    other = Turns(baton, "other", "run", poll_s=0.001)
    held: list[tuple[int, int]] = []  # the other party's turns, monotonic ns

    def other_party() -> None:
        async def loop() -> None:
            while not other.done_marker("run").exists():
                await other.acquire()
                if other.holder() != "other":
                    break  # the run is done: nothing left to alternate with
                started = time.monotonic_ns()
                await asyncio.sleep(0.3)
                held.append((started, time.monotonic_ns()))
                other.release()

        asyncio.run(loop())

    thread = threading.Thread(target=other_party)
    thread.start()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(msgspec.to_builtins(cfg)))
    summary = uvloop.run(train.train(cfg, run_dir, turns=Turns(baton, "run", "other", poll_s=0.001)))
    thread.join(timeout=30)
    assert len(summary["steps"]) == 2
    assert len(held) == 3  # after the start-up and after each step; the shutdown ends the run's turns
    spans = [json.loads(line) for line in (run_dir / "spans" / "coordinator.jsonl").read_text().splitlines()]
    steps = [(d["ts"], d["ts"] + d["dur"]) for d in spans if d.get("name") == "step"]
    assert len(steps) == 2
    for a, b in steps:
        assert all(b <= start or end <= a for start, end in held), "a step ran during the other party's turn"


def test_the_gpu_config_is_checked_and_refused_at_start_naming_the_device(tmp_path: Path) -> None:
    from slipstream.cli.common import packaged_config
    from slipstream.engine.tuner import parse_arm

    cfg = run_config.load_config(packaged_config("gpu-7b.yaml"))  # every key valid: a typo would fail here
    assert cfg.device == "cuda" and cfg.group_size == 16 and cfg.learner.loss.tis_cap == 2.0
    assert all(parse_arm(arm) for arm in cfg.rollout.tuner.arms)
    # Its learner fits an 80 GB card as its comment says (Qwen2.5-7B's shape: the model is not here).
    from slipstream.engine.memory_plan import plan_learner
    from tests.engine.test_sharding import H100, QWEN_7B

    learner = cfg.learner
    plan = plan_learner(
        QWEN_7B, ranks=learner.ranks, micro_batch_tokens=learner.optim.micro_batch_tokens,
        activation_checkpointing=learner.activation_checkpointing, compute_dtype="bfloat16", device="cuda",
    )  # fmt: skip
    plan.check(H100)
    assert f"{plan.total / 2**30:.2f} GiB" in packaged_config("gpu-7b.yaml").read_text()
    with pytest.raises(ValueError, match="device: 'cuda' is not available"):
        uvloop.run(train.train(cfg, tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_rollout_max_batch_caps_a_rollouts_slots_and_a_negative_one_is_refused(tmp_path: Path) -> None:
    from slipstream.runtime.config import ConfigError

    def rollout_slots(cfg: run_config.TrainConfig) -> list[int]:
        specs = run_plan.actor_specs(cfg, tmp_path, baseline=True, resume_from="")
        return [s.config.max_batch for s in specs if s.actor.endswith(":RolloutActor")]

    base = ["prompts_per_step=3", "group_size=4", "rollout.devices=2"]
    # 0: all a rollout can be dealt (2 groups)
    assert rollout_slots(run_config.load_config(None, base)) == [8, 8]
    assert rollout_slots(run_config.load_config(None, [*base, "rollout.max_batch=4"])) == [4, 4]
    with pytest.raises(ConfigError, match=r"^rollout\.max_batch: expected `int` >= 0"):
        run_config.load_config(None, [*base, "rollout.max_batch=-1"])
