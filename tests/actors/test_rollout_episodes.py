"""The rollout's loop over turns (issue 42), driven in-process: the test plays the environment actor.

- A 2-turn episode's record: the environment's tokens (the rendered delta) masked out with log-prob 0,
  the policy's tokens with their log-probs, the opening as the prompt, the environment's reward.
- Greedy tokens are identical with speculation on and off across turns (reproducible mode).
- A slow environment does not stall the others: while one episode waits, the other samples decode; its
  sample's environment wait (`Completion.env_wait_s`) is the longest.
- An environment restart (EnvironmentUp with a new incarnation) replays lost episodes from their start:
  the same tokens, each sample completed once; a raising environment makes only its sample invalid.

The acceptance versions of the second and third, through real processes (`train`, an environment actor):
tests/cli/test_multiturn_processes.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from slipstream.actors.rollout import RolloutActor
from slipstream.engine.tokenizer import Tokenizer
from slipstream.protocols.environment import (
    Answer,
    ChatMessage,
    EnvironmentUp,
    EpisodeOpened,
    OpenEpisode,
    Turn,
)
from slipstream.protocols.rollout import Completion, GenerateRequest, SamplingSpec
from slipstream.runtime.inbox import Inbox
from tests.actors.test_rollout_actor import Captured
from tests.engine.conftest import build_chat_checkpoint

ENV = "environment:0"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_checkpoint(tmp_path_factory.mktemp("chat"), max_position_embeddings=1024)


def actor(
    model: Path, run_dir: Path, arms: list[str], hidden_to: tuple[str, ...] = (), **episodes: Any
) -> tuple[RolloutActor, Captured]:
    out = Captured()
    cfg = msgspec.convert(
        {"model": str(model), "max_batch": 4, "max_len": 512, "warm_up": False, "environments": [ENV],
         "tuner": {"buckets": [1, 2, 5], "arms": arms, "epsilon": 0.5, "hold": 1, "seed": 1},
         "episodes": {"max_turn_tokens": 6, "max_turns": 3, **episodes}, "hidden_to": list(hidden_to)},
        RolloutActor.Config,
    )  # fmt: skip
    rollout = RolloutActor(cfg, rank=0, outbox=out, inbox=Inbox(8), run_dir=str(run_dir))
    rollout.on_start()
    return rollout, out


def request(group: int, n: int, temperature: float = 0.0) -> GenerateRequest:
    return GenerateRequest(
        group_id=group, prompt_ids=torch.tensor([1]), num_samples=n, seed=7 + group, policy_version=0,
        sampling=SamplingSpec(temperature=temperature, max_tokens=60, stop_token_ids=[2]),
        row_json=json.dumps({"question": f"What is {group} + 2?", "answer": str(group + 2)}),
    )  # fmt: skip


Reply = Callable[[Turn], Answer | None]


def two_turns(turn: Turn) -> Answer:
    done = turn.turn >= 1
    return Answer(episode_id=turn.episode_id, turn=turn.turn, text=f"observation {turn.turn}", role="tool",
                  done=done, reward=1.0 if done else None)  # fmt: skip


def run(
    rollout: RolloutActor, out: Captured, reply: Reply, incarnation: str = "env-a", limit: int = 5000
) -> None:
    """Steps the actor, answering every message it sends the environment, until it is idle."""
    seen = 0
    for _ in range(limit):
        while seen < len(out.sent):
            dest, msg = out.sent[seen]
            seen += 1
            if dest != ENV:
                continue
            if isinstance(msg, OpenEpisode):
                opening = [ChatMessage(role="user", content=json.loads(msg.row_json)["question"])]
                rollout.on_episode_opened(
                    EpisodeOpened(episode_id=msg.episode_id, messages=opening, incarnation=incarnation), ENV
                )
            elif isinstance(msg, Turn) and (answer := reply(msg)) is not None:
                rollout.on_answer(answer, ENV)
        if not rollout.step() and seen == len(out.sent) and not rollout.episodes.live:
            return
    raise AssertionError("the rollout never went idle")


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "reproducible-sampled"])
def test_a_two_turn_record_masks_the_environment_and_speculation_changes_nothing(
    chat_model: Path, tmp_path: Path, temperature: float
) -> None:
    # Greedy, and sampled in reproducible mode (the rollout's default spec_mode): the same tokens with and
    # without speculation, across the environment's answer.
    records = {}
    for name, arms in (("plain", ["off"]), ("ngram", ["off", "ngram:d3"])):
        rollout, out = actor(chat_model, tmp_path / name, arms)
        rollout.on_generate(request(0, 3, temperature), "coordinator")
        rollout.on_generate(request(1, 2, temperature), "coordinator")
        run(rollout, out, two_turns)
        records[name] = {(c.group_id, c.sample_index): c for c in out.of(Completion)}
        assert len(records[name]) == 5
    tokenizer = Tokenizer.from_dir(chat_model)
    for key, c in records["plain"].items():
        other = records["ngram"][key]
        assert c.token_ids.tolist() == other.token_ids.tolist(), key  # lossless across turns
        assert c.turns == 2 and c.env_reward == 1.0 and c.error is None
        mask = c.policy_mask
        assert mask.shape == c.token_ids.shape and 0 < int((~mask).sum()) < len(mask)
        assert bool((c.logprobs[~mask] == 0).all())  # the environment's tokens carry no log-prob
        # Exactly one answer between the two turns, and it is the template's rendered tool message.
        runs = [bool(x) for x in mask.tolist()]
        assert runs.index(False) == 6 and runs[:6] == [True] * 6  # the first turn: max_turn_tokens
        answer = tokenizer.decode(c.token_ids[~mask].tolist(), skip_special_tokens=False)
        assert "observation 0" in answer and answer.rstrip().endswith("assistant")
        question = f"What is {key[0]} + 2?"
        assert c.prompt_ids.tolist() == tokenizer.apply_chat_template([{"role": "user", "content": question}])


def test_after_an_answer_eagle_drafts_are_still_offered_and_the_tokens_stay_the_same(
    chat_model: Path, tmp_path: Path
) -> None:
    """EAGLE across turns (issue 42): the head is fed the answer's prefill states (the Generator keeps
    them: tests/engine/test_multiturn.py), so the tuner is offered it after an answer as before one.
    Greedy tokens equal plain decoding's."""
    plain, out = actor(chat_model, tmp_path / "plain", ["off"])
    plain.on_generate(request(0, 3), "coordinator")
    run(plain, out, two_turns)
    want = {c.sample_index: c.token_ids.tolist() for c in out.of(Completion)}
    # hidden_to: an untrained head is held (trained online in a run), so eagle and hybrid are arms.
    rollout, out = actor(chat_model, tmp_path / "eagle", ["off", "eagle:d3", "hybrid:d3"], ("drafter:0",))
    assert {"eagle", "hybrid"} <= rollout.methods
    offered: list[tuple[bool, frozenset[str]]] = []
    choose = rollout.tuner.choose

    def recording(batch: int, available: Any = None) -> Any:
        episodes = rollout.episodes
        answered = episodes is not None and any(e.turns > 0 for e in episodes.live.values())
        offered.append((answered, frozenset(available)))
        return choose(batch, available)

    rollout.tuner.choose = recording  # type: ignore[method-assign]
    rollout.on_generate(request(0, 3), "coordinator")
    run(rollout, out, two_turns)
    assert {c.sample_index: c.token_ids.tolist() for c in out.of(Completion)} == want
    after = [methods for answered, methods in offered if answered]
    assert after and all({"eagle", "hybrid"} <= m for m in after)


def test_a_slow_environment_does_not_stall_the_other_samples(chat_model: Path, tmp_path: Path) -> None:
    rollout, out = actor(chat_model, tmp_path / "slow", ["off"])
    held: list[Turn] = []
    progress: list[int] = []

    def reply(turn: Turn) -> Answer | None:
        if turn.episode_id.endswith("0:0/0") and not held:
            held.append(turn)  # the slow one: answered after the others are done
            return None
        return two_turns(turn)

    rollout.on_generate(request(0, 3), "coordinator")
    seen = 0
    for _ in range(2000):
        while seen < len(out.sent):
            _, msg = out.sent[seen]
            seen += 1
            if isinstance(msg, OpenEpisode):
                opening = [ChatMessage(role="user", content="What is 0 + 2?")]
                rollout.on_episode_opened(EpisodeOpened(episode_id=msg.episode_id, messages=opening), ENV)
            elif isinstance(msg, Turn) and (answer := reply(msg)) is not None:
                rollout.on_answer(answer, ENV)
        if held:
            progress.append(len(out.of(Completion)))
        if not rollout.step() and len(out.of(Completion)) == 2:
            break
    assert held and len(out.of(Completion)) == 2  # the others finished while the slow one waited
    assert rollout.generator.num_parked == 1
    rollout.on_answer(two_turns(held[0]), ENV)
    run(rollout, out, two_turns)
    done = {c.sample_index: c for c in out.of(Completion)}
    assert sorted(done) == [0, 1, 2]
    # Each sample's environment wait travels on its completion; the held turn's outlasted the others'
    # decoding, the others' were answered at once.
    assert all(c.turns >= 1 and c.env_wait_s > 0 for c in done.values())
    assert done[0].env_wait_s > max(done[1].env_wait_s, done[2].env_wait_s)


def test_a_restart_replays_lost_episodes_and_an_error_is_one_invalid_sample(
    chat_model: Path, tmp_path: Path
) -> None:
    clean, out = actor(chat_model, tmp_path / "clean", ["off"])
    clean.on_generate(request(0, 3, temperature=0.8), "coordinator")
    run(clean, out, two_turns)
    want = {c.sample_index: c.token_ids.tolist() for c in out.of(Completion)}

    rollout, out = actor(chat_model, tmp_path / "restart", ["off"])
    rollout.on_generate(request(0, 3, temperature=0.8), "coordinator")
    restarted = []

    def reply(turn: Turn) -> Answer | None:
        if "/0:2/" in turn.episode_id:
            return Answer(episode_id=turn.episode_id, turn=turn.turn, error="raised ZeroDivisionError: x")
        if not restarted:  # the environment dies holding every episode; its successor says so
            restarted.append(turn)
            rollout.on_environment_up(EnvironmentUp(incarnation="env-b"), ENV)
            return None
        return two_turns(turn)

    run(rollout, out, reply, incarnation="env-a")
    got = {c.sample_index: c for c in out.of(Completion)}
    assert sorted(got) == [0, 1, 2] and len(out.of(Completion)) == 3  # each once
    assert got[2].finish_reason == "error" and "ZeroDivisionError" in (got[2].error or "")
    for i in (0, 1):
        c = got[i]
        assert c.token_ids.tolist() == want[i] and c.error is None
        assert bool((c.logprobs[~c.policy_mask] == 0).all()) and bool((c.logprobs[c.policy_mask] < 0).all())
