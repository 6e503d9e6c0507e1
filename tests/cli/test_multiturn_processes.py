"""Multi-turn acceptance (issue 42) through real processes: `train` with rollout, environment, verifier and
learner actors over ZeroMQ, a tiny random model, one step each.

- Speculation changes no token across turns: the same 3-turn config, greedy and sampled in reproducible
  mode, run with the tuner's n-gram arms and as `--baseline` gives every sample the same tokens and policy
  mask; the speculative run's spans show drafts verified after an environment's answer, and greedy,
  accepted there (or the test could pass without speculating across a turn).
- A slow environment does not stall the batch: one episode (tests/cli/multiturn_env.py `SlowOne`) holds
  its first answer until the other episodes have ended; the spans show every other sample of its rollout
  finished, and its rollout committed their later turns' tokens, while it waited; the run completes.

The actor-harness versions (the test plays the environment, in-process) are in tests/actors/
test_rollout_episodes.py. Each test here was seen to fail with a plant (2026-11-28, a sitecustomize in the
rollout processes, or the test environment edited): a turn's end that keeps what a speculative step
emitted past it (greedy), verification by rejection sampling instead of keyed (sampled), a rollout that
decodes nothing while an episode waits, an environment whose slow reply blocks its loop.

Found here and fixed (2026-11-28): when one speculative step reached a turn's cut and the request's
max_tokens at once, the engine ended the sample at max_tokens and the rollout took that completion whole,
keeping tokens past the cut that plain decoding never decodes; the speculation test runs at the
max_tokens (48) where that happened.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import uvloop

from slipstream.cli import train
from slipstream.runtime.spans import Span, read_spans
from tests.cli.conftest import config

pytestmark = pytest.mark.timeout(300)

PROMPTS, GROUP = 3, 4


def samples_of(run_dir: Path) -> dict[tuple[int, int], dict[str, Any]]:
    """(group, sample) -> its step-0 record (each once)."""
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for line in (run_dir / "samples" / "step-0.jsonl").read_text().splitlines():
        s = json.loads(line)
        key = (s["group_id"], s["sample_index"])
        assert key not in out, f"{key} recorded twice"
        out[key] = s
    return out


def record_of(run_dir: Path) -> dict[str, Any]:
    (line,) = (run_dir / "metrics.jsonl").read_text().splitlines()
    return json.loads(line)


def spans_named(spans: list[Span], name: str) -> list[Span]:
    return [sp for sp in spans if sp.name == name]


# Sampled: T = 0.15 among the top 2, else a random model's near-uniform choice among 49k tokens leaves a
# group's samples no n-gram in common, and nothing is drafted after an answer.
@pytest.mark.parametrize(
    ("temperature", "top_k"), [(0.0, 0), (0.15, 2)], ids=["greedy", "reproducible-sampled"]
)
def test_speculation_on_and_off_give_the_same_tokens_across_turns(
    tiny_chat: Path, tmp_path: Path, temperature: float, top_k: int
) -> None:
    # max_tokens 48: three 6-token turns and two answers take 46, so the last turn's cut and max_tokens can
    # fall in one speculative step, which ended the sample at 48 where plain decoding ends its turn at 46
    # (fixed 2026-11-28: docs/environments.md).
    cfg = config(
        tiny_chat, steps=1, prompts_per_step=PROMPTS, group_size=GROUP, max_tokens=48, temperature=temperature,
        top_k=top_k, checkpoint_every=0, checkpoint_hf=False, drafter={"enabled": False},
        # n-gram drafts or none, chosen often (hold 1, epsilon 0.5). One slot a rollout: a group's samples
        # decode one after another, and each drafts from its siblings' documents (the n-gram tables are
        # the group's), which greedy decoding repeats token for token: drafts are accepted after each answer
        # too, and a step's 4 tokens pass a 6-token turn's end, where the turn must be cut.
        rollout={"max_batch": 1, "tuner": {"arms": ["off", "ngram:d3"], "epsilon": 0.5, "hold": 1, "seed": 1}},
        environment={"env": "tests.cli.multiturn_env:Relay", "options": {"turns": 3},
                     "max_turn_tokens": 6, "turn_timeout_s": 30},
    )  # fmt: skip
    runs = {}
    for baseline in (True, False):
        run_dir = tmp_path / ("baseline" if baseline else "speculative")
        uvloop.run(train.train(cfg, run_dir, baseline=baseline))
        runs[baseline] = run_dir
        rec = record_of(run_dir)
        assert rec["invalid"] == 0 and rec["turns_by_count"] == {"3": PROMPTS * GROUP}, rec

    plain, spec = samples_of(runs[True]), samples_of(runs[False])
    assert plain.keys() == spec.keys() and len(plain) == PROMPTS * GROUP
    for key, want in plain.items():
        got = spec[key]
        assert got["token_ids"] == want["token_ids"], key  # lossless across the environment's answers
        assert got["policy_mask"] == want["policy_mask"], key

    # The baseline never drafted; the speculative run drafted after an environment's answer and, greedy,
    # kept drafts there. Sampled, siblings part at the first near tie of the top two, so drafts after an
    # answer are mostly rejected: what is checked there is that the token committed in a rejected draft's
    # place is the keyed one plain decoding draws.
    assert {sp.args["arm"] for sp in spans_named(read_spans(runs[True]), "iteration")} == {"off"}
    across = iterations_after_an_answer(read_spans(runs[False]))
    speculated = [sp.args for sp in across if sp.args["arm"] != "off"]
    assert sum(it["drafted"] for it in speculated) > 0, speculated
    if temperature == 0.0:
        assert sum(it["accepted"] for it in speculated) > 0, speculated


def iterations_after_an_answer(spans: list[Span]) -> list[Span]:
    """The rollouts' decode iterations that ran while an episode of theirs decoded a turn after an
    environment's answer: from an answered `env_wait` span's end to the episode's next wait or its end."""
    by_episode: dict[tuple[int | None, str], list[Span]] = {}
    for sp in spans_named(spans, "env_wait"):
        _, request, _ = sp.args["episode"].split("/")
        by_episode.setdefault((sp.rank, request), []).append(sp)
    ends = {
        (sp.rank, f"{sp.args['group']}:{sp.args['index']}"): sp.end_ns for sp in spans_named(spans, "sample")
    }
    windows = []  # (rank, start, end)
    for (rank, request), waits in by_episode.items():
        waits.sort(key=lambda sp: sp.start_ns)
        for i, wait in enumerate(waits):
            if wait.args["outcome"] == "answered":
                until = waits[i + 1].start_ns if i + 1 < len(waits) else ends[rank, request]
                windows.append((rank, wait.end_ns, until))
    return [
        it
        for it in spans_named(spans, "iteration")
        if any(r == it.rank and start <= it.start_ns and it.end_ns <= end for r, start, end in windows)
    ]


def test_a_slow_environment_does_not_stall_the_other_samples(tiny_chat: Path, tmp_path: Path) -> None:
    samples = PROMPTS * GROUP
    cfg = config(
        tiny_chat, steps=1, prompts_per_step=PROMPTS, group_size=GROUP, max_tokens=48, checkpoint_every=0,
        checkpoint_hf=False, drafter={"enabled": False},
        rollout={"devices": 1},  # every sample in one batch: the slow one's neighbours are its rollout's
        # The slow episode waits for the other samples' episodes to end, at most 60 s (far longer than their
        # decoding takes): a rollout that stalls meanwhile is caught by what ended during the wait.
        environment={"env": "tests.cli.multiturn_env:SlowOne",
                     "options": {"turns": 2, "others": samples - 1, "max_wait_s": 60.0},
                     "max_turn_tokens": 6, "turn_timeout_s": 90},
    )  # fmt: skip
    run_dir = tmp_path / "run"
    uvloop.run(train.train(cfg, run_dir))

    rec = record_of(run_dir)  # the run completed, every sample valid and recorded once, two turns each
    assert rec["invalid"] == 0 and rec["turns_by_count"] == {"2": samples}, rec
    recorded = samples_of(run_dir)
    assert len(recorded) == samples

    spans = read_spans(run_dir)
    waits = spans_named(spans, "env_wait")
    slow = max(waits, key=lambda sp: sp.dur_ns)  # the held first answer
    assert slow.args["turn"] == 0 and slow.args["outcome"] == "answered"
    slow_key = tuple(int(x) for x in slow.args["episode"].split("/")[1].split(":"))
    ends = {(sp.args["group"], sp.args["index"]): sp.end_ns for sp in spans_named(spans, "sample")}
    assert ends.keys() == recorded.keys()
    during = lambda t: slow.start_ns < t < slow.end_ns  # noqa: E731
    # Every other sample's second turn was answered, and the sample finished, while the slow one waited.
    assert all(during(t) for key, t in ends.items() if key != slow_key), (slow, ends)
    assert not during(ends[slow_key])
    answered = [sp for sp in waits if sp is not slow and sp.args["turn"] == 1 and during(sp.end_ns)]
    assert len(answered) == samples - 1
    # The tokens behind that: the others' second turns (policy tokens after their first answer) were
    # committed by the rollout's iterations within the wait.
    later_turns = 0
    for key, s in recorded.items():
        mask = s["policy_mask"]
        if key != slow_key:
            later_turns += sum(mask[mask.index(0) :])  # policy tokens after the first answer
    committed = sum(
        sp.args["committed"]
        for sp in spans_named(spans, "iteration")
        if slow.start_ns <= sp.start_ns and sp.end_ns <= slow.end_ns
    )
    assert later_turns > 0 and committed >= later_turns, (committed, later_turns)
