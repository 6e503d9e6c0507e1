"""Environment wait per turn in engine/episodes.py (issue 42), on a fake clock: a tiny random model with
SmolLM2's chat template, no sockets (the test plays the environment).

- A turn's wait runs from its end (sent to the environment) to its answer; decoding time and the wait
  for an episode's opening are not counted; the sample's total is the sum of its turns', each told to
  `on_wait` (start, duration, episode, turn, outcome) once.
- A turn lost with its environment (replayed) keeps its wait in the sample's total; a turn failed while
  waiting (a timeout, an error) ends its wait there; failing an episode that is decoding adds nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.engine.episodes import EpisodeLimits, Episodes, Finished, TurnEnd
from slipstream.engine.generator import Generator
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.tokenizer import Tokenizer
from slipstream.engine.weights import load_model
from tests.engine.conftest import build_chat_checkpoint

S = 1_000_000_000  # ns a second
OPENING = [{"role": "user", "content": "What is 1 + 2?"}]


class Clock:
    """A monotonic nanosecond clock the test moves by hand."""

    def __init__(self) -> None:
        self.ns = 10 * S

    def __call__(self) -> int:
        return self.ns


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_checkpoint(tmp_path_factory.mktemp("chat"), max_position_embeddings=512)


def episodes(chat_model: Path, clock: Clock, waits: list[tuple[int, int, dict[str, Any]]]) -> Episodes:
    generator = Generator(
        load_model(chat_model, dtype=torch.float32), num_slots=2, max_len=256, token_budget=64,
        eos_token_ids=(2,),
    )  # fmt: skip
    return Episodes(
        generator, Tokenizer.from_dir(chat_model), EpisodeLimits(max_turn_tokens=4, max_turns=3), "rollout:0@x",
        on_wait=lambda start, dur, **at: waits.append((start, dur, at)), clock=clock,
    )  # fmt: skip


def start(eps: Episodes, request_id: str, clock: Clock) -> None:
    eps.begin(request_id, SamplingParams(temperature=0.0, max_tokens=60), "0", "{}")
    clock.ns += 7 * S  # the environment takes its time to open it: not a turn's wait
    eps.opened(request_id, OPENING, ())


def next_turn(eps: Episodes, clock: Clock) -> TurnEnd:
    """Decodes until a turn ends, the clock moving 1 ms an iteration (decoding: never counted)."""
    for _ in range(200):
        ends = eps.turn_ends(eps.generator.step())
        if ends:
            (end,) = ends
            return end
        clock.ns += S // 1000
    raise AssertionError("no turn ended")


def test_a_turns_wait_is_its_end_to_its_answer_summed_per_sample(chat_model: Path) -> None:
    clock, waits = Clock(), []
    eps = episodes(chat_model, clock, waits)
    start(eps, "a", clock)
    first = next_turn(eps, clock)
    sent0 = clock.ns
    clock.ns += 3 * S // 2
    assert eps.answer("a", "result 3", "tool", done=False, reward=None) is None
    second = next_turn(eps, clock)
    assert clock.ns - sent0 > 3 * S // 2  # the second turn's decoding moved the clock too
    sent1 = clock.ns
    clock.ns += S // 4
    finished = eps.answer("a", "correct", "tool", done=True, reward=1.0)
    assert isinstance(finished, Finished) and finished.turns == 2 and finished.reward == 1.0
    assert finished.env_wait_s == pytest.approx(1.75, abs=1e-9)
    assert finished.counts() == {"turns": 2, "env_wait_s": finished.env_wait_s}
    episode = "rollout:0@x/a/0"
    assert (first.turn, second.turn) == (0, 1)
    assert waits == [
        (sent0, 3 * S // 2, {"episode": episode, "turn": 0, "outcome": "answered"}),
        (sent1, S // 4, {"episode": episode, "turn": 1, "outcome": "answered"}),
    ]


def test_a_lost_turns_wait_is_kept_across_its_replay_and_a_failure_ends_the_wait(chat_model: Path) -> None:
    clock, waits = Clock(), []
    eps = episodes(chat_model, clock, waits)
    start(eps, "b", clock)
    next_turn(eps, clock)
    clock.ns += 2 * S  # its environment died holding the turn
    assert eps.replay("b") == "rollout:0@x/b/1"
    clock.ns += 5 * S  # the new opening: not counted
    eps.opened("b", OPENING, ())
    next_turn(eps, clock)
    clock.ns += S  # no answer: the rollout's deadline fails it
    finished = eps.fail("b", "no answer within 1 s")
    assert finished.completion is None and finished.error == "no answer within 1 s"
    assert finished.env_wait_s == pytest.approx(3.0, abs=1e-9)
    assert [(dur, at["episode"], at["outcome"]) for _, dur, at in waits] == [
        (2 * S, "rollout:0@x/b/0", "lost"),
        (S, "rollout:0@x/b/1", "failed"),
    ]
    # Failing an episode while it decodes (its answer was taken) adds no wait.
    start(eps, "c", clock)
    next_turn(eps, clock)
    clock.ns += S // 2
    assert eps.answer("c", "result 3", "tool", done=False, reward=None) is None
    clock.ns += 9 * S
    assert eps.fail("c", "boom").env_wait_s == pytest.approx(0.5, abs=1e-9)
    assert len(waits) == 3
