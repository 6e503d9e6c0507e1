"""A turn's cut and the request's max_tokens in one speculative step (issue 42), engine/episodes.py driven as
the rollout drives it (a completion to `Episodes.finished`, the other outputs to `turn_ends`), with the
test as the environment: a tiny random model with SmolLM2's chat template, n-gram drafts fixed on.

Two greedy samples of one group, one slot: the second decodes after the first and drafts its sibling's
tokens, all accepted, 4 a step. Plain decoding ends its turn at `max_turn_tokens` (6), the environment
ends the episode with its reward, and the sample holds 6 tokens. With speculation the step from 5 to 9
tokens reaches the turn's cut and `max_tokens` (7) at once. The engine ended the request at 7 and the
episode took that completion whole (7 tokens, no turn sent, no reward: found by
tests/cli/test_multiturn_processes.py through real processes); now a `pause_on_stop` request whose budget
runs out pauses, and `turn_ends` cuts at the turn's end first, as plain decoding does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slipstream.engine.drafters import NGramDrafter
from slipstream.engine.episodes import EpisodeLimits, Episodes, Finished
from slipstream.engine.generator import Generator
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.speculator import SpecConfig
from slipstream.engine.tokenizer import Tokenizer
from slipstream.engine.weights import load_model
from tests.engine.conftest import build_chat_checkpoint

OPENING = [{"role": "user", "content": "What is 1 + 2?"}]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_checkpoint(tmp_path_factory.mktemp("chat"), max_position_embeddings=512)


def play(chat_model: Path, *, spec: bool) -> dict[str, Finished]:
    """Two samples of one group, one after the other; every turn answered done with reward 1."""
    extra: dict = {}
    if spec:
        extra = {
            "spec": SpecConfig(method="ngram", depth=3, mode="reproducible"),
            "drafters": {"ngram": NGramDrafter()},
        }
    generator = Generator(
        load_model(chat_model, dtype=torch.float32), num_slots=1, max_len=256, token_budget=64,
        eos_token_ids=(2,), **extra,
    )  # fmt: skip
    eps = Episodes(generator, Tokenizer.from_dir(chat_model), EpisodeLimits(max_turn_tokens=6), "rollout:0@x")
    done: dict[str, Finished] = {}
    for request_id in ("0:0", "0:1"):  # both dealt at once, as a group is: the second waits for the slot
        eps.begin(request_id, SamplingParams(temperature=0.0, max_tokens=7), "0", "{}")
        eps.opened(request_id, OPENING, ())
    for _ in range(200):
        outputs = generator.step()
        for out in outputs:
            if out.completion is not None:  # what the rollout does: the engine ended it
                done[out.request_id] = eps.finished(out.completion)
        for end in eps.turn_ends(outputs):
            if isinstance(end, Finished):  # its budget ran out inside a turn
                done[end.request_id] = end
                continue
            finished = eps.answer(end.request_id, "result", "tool", True, 1.0)
            assert finished is not None
            done[end.request_id] = finished
        if len(done) == 2:
            break
    return done


def test_a_speculative_step_past_a_turns_cut_and_max_tokens_ends_as_plain_decoding(chat_model: Path) -> None:
    plain, spec = play(chat_model, spec=False), play(chat_model, spec=True)
    assert [len(f.completion.token_ids) for f in plain.values() if f.completion] == [6, 6]
    for key, want in plain.items():
        got = spec[key]
        assert got.completion is not None and want.completion is not None
        assert got.completion.token_ids == want.completion.token_ids, key
        assert (got.reward, got.turns) == (want.reward, want.turns), key
