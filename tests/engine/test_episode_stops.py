"""A turn's stop sequence is found the same whether the turn is searched whole or as its tokens arrive
(one to four a step, as speculation commits them), searching only a window back from what was searched:
the cut is the fewest tokens whose text holds the stop."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from slipstream.engine import hub
from slipstream.engine.episodes import EpisodeLimits, Episodes
from slipstream.engine.tokenizer import Tokenizer

TEXTS = [
    "Let me add. <calc>3 + 4</calc> then more",
    "no tool at all, just an answer <answer>7</answer>",
    "ünïcödé first — <calc>12*(3+4)</calc>",
    "split across tokens: </ca" + "lc> and later </calc>",
    "</calc> at once",
]


@pytest.fixture(scope="module")
def episodes() -> Episodes:
    tokenizer = Tokenizer.from_dir(hub.pull("smollm2-135m"))
    engine = SimpleNamespace(eos_token_ids=(2,))  # the search reads the tokenizer only: no engine behind
    return Episodes(engine, tokenizer, EpisodeLimits(), "rollout:0")  # type: ignore[arg-type]


@pytest.mark.parametrize("text", TEXTS)
def test_a_stop_is_cut_where_a_whole_search_cuts_it(episodes: Episodes, text: str) -> None:
    stops = ("</calc>",)
    turn = episodes.tokenizer.encode(text)
    whole = episodes._stop_at(turn, stops)
    if "</calc>" in text:
        assert whole is not None and "</calc>" in episodes.tokenizer.decode(turn[:whole])
        assert "</calc>" not in episodes.tokenizer.decode(turn[: whole - 1])
    rng = random.Random(text)
    for _ in range(20):
        scanned, n, found = 0, 0, None
        while n < len(turn) and found is None:
            n = min(len(turn), n + rng.randint(1, 4))
            found = episodes._stop_at(turn[:n], stops, scanned)
            scanned = n
        assert found == whole
