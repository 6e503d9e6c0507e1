"""Multi-turn decoding in the Generator (`pause` / `resume`): a request's turn ends, the environment's answer
is appended and prefilled on the same cache, and decoding continues.

- The second turn is exactly what a fresh request whose prompt is the whole history decodes (greedy and
  keyed sampling: noise is keyed by position), on the dynamic and the fixed-shape path, with speculation
  off and on (n-gram, reproducible mode) — so nothing of the first turn's cache or the parking leaks.
- The record: policy mask, log-prob 0 and no hidden row for the environment's tokens.
- A paused request holds its slot and never stalls the others: they keep decoding while it waits.
- `pause(keep=…)` drops tokens a speculative step emitted past the turn's end and rolls their K/V back.
- Misuse is refused naming the request.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from slipstream.engine.drafters import NGramDrafter
from slipstream.engine.drafters.eagle import EagleDrafter
from slipstream.engine.generator import Completion, Generator, Request
from slipstream.engine.model import Transformer
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.speculator import SpecConfig
from slipstream.engine.weights import load_model

OBSERVATION = [7, 8, 9, 7, 8, 9, 11]
PROMPT = [5, 17, 33, 2, 5, 17, 33, 2, 5]


@pytest.fixture(scope="module")
def model(make_checkpoint: Callable[..., Path]) -> Transformer:
    return load_model(make_checkpoint("llama", seed=5), dtype=torch.float64)


def generator(model: Transformer, *, static: bool, spec: bool, **kwargs: object) -> Generator:
    extra: dict = {}
    if spec:
        extra = {
            "spec": SpecConfig(method="ngram", depth=3, mode="reproducible"),
            "drafters": {"ngram": NGramDrafter()},
        }
    return Generator(
        model, num_slots=3, max_len=128, token_budget=64, eos_token_ids=(), static=static, **extra, **kwargs
    )  # type: ignore[arg-type]


def until(gen: Generator, request_id: str, n: int) -> None:
    """Step until `request_id` has at least n tokens after its prompt."""
    for _ in range(200):
        seq = gen.scheduler.running.get(request_id)
        if seq is not None and seq.num_generated >= n and seq.decoding:
            return
        gen.step()
    raise AssertionError("no progress")


def two_turns(gen: Generator, params: SamplingParams, first: int) -> Completion:
    gen.add(Request(request_id="ep", prompt_ids=PROMPT, params=params))
    until(gen, "ep", first)
    gen.pause("ep", keep=first)
    assert gen.num_parked == 1 and gen.num_decoding == 0 and gen.step() == []  # nothing to run
    gen.resume("ep", OBSERVATION)
    done = []
    while gen.has_unfinished():
        done += [o.completion for o in gen.step() if o.completion is not None]
    (completion,) = done
    return completion


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "fixed-shape"])
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_next_turn_decodes_as_a_fresh_request_over_the_whole_history(
    model: Transformer, static: bool, spec: bool, temperature: float
) -> None:
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=40)
    episode = two_turns(generator(model, static=static, spec=spec), params, first=9)
    first, rest = episode.token_ids[:9], episode.token_ids[9 + len(OBSERVATION) :]
    assert episode.token_ids[9 : 9 + len(OBSERVATION)] == OBSERVATION
    assert episode.policy_mask == [True] * 9 + [False] * len(OBSERVATION) + [True] * len(rest)
    assert all(episode.logprobs[9 + i] == 0.0 for i in range(len(OBSERVATION)))
    # The same tokens as one request whose prompt is the history: same seed, same positions.
    history = Request(request_id="ep", prompt_ids=PROMPT + first + OBSERVATION, params=params)
    fresh = generator(model, static=False, spec=False).generate([history])[0]
    single = generator(model, static=False, spec=False).generate(
        [
            Request(
                request_id="ep",
                prompt_ids=PROMPT,
                params=SamplingParams(temperature=temperature, seed=3, max_tokens=9),
            )
        ]
    )[0]
    assert first == single.token_ids
    assert rest == fresh.token_ids[: len(rest)] and len(rest) == 40 - 9 - len(OBSERVATION)


def test_the_record_of_a_turn_holds_hidden_rows_for_the_policys_tokens_only(model: Transformer) -> None:
    gen = generator(model, static=False, spec=False, return_hidden=True)
    episode = two_turns(gen, SamplingParams(temperature=0.0, max_tokens=30), first=5)
    assert episode.policy_mask is not None and episode.hidden is not None
    assert episode.hidden.shape[0] == sum(episode.policy_mask) == 30 - len(OBSERVATION)


def test_a_paused_request_holds_its_slot_and_never_stalls_the_others(model: Transformer) -> None:
    gen = generator(model, static=False, spec=False)
    params = SamplingParams(temperature=0.0, max_tokens=50)
    for i in range(3):
        gen.add(Request(request_id=f"r{i}", prompt_ids=PROMPT[i:], params=params))
    until(gen, "r0", 4)
    gen.pause("r0")
    free = gen.cache.num_free_slots
    progress = {"r1": 0, "r2": 0}
    for _ in range(10):  # the environment is slow: ten iterations pass
        for out in gen.step():
            assert out.request_id != "r0"
            progress[out.request_id] += len(out.token_ids)
    assert progress == {"r1": 10, "r2": 10} and gen.cache.num_free_slots == free
    assert gen.scheduler.running["r0"].num_generated == 4  # parked: nothing decoded for it
    gen.resume("r0", OBSERVATION)
    assert any(out.request_id == "r0" for out in gen.step())  # prefilled and sampled at once


def test_pause_drops_what_speculation_emitted_past_the_turns_end(model: Transformer) -> None:
    """A speculative step may commit several tokens; the caller ends the turn at one of them: the rest are
    dropped and rolled back, and the next turn is what a plain run with that history decodes."""
    params = SamplingParams(temperature=0.0, max_tokens=40)
    gen = generator(model, static=False, spec=True)
    gen.add(Request(request_id="ep", prompt_ids=PROMPT * 3, params=params))
    until(gen, "ep", 12)
    seq = gen.scheduler.running["ep"]
    kept = seq.tokens[len(PROMPT) * 3 : len(PROMPT) * 3 + 6]
    before = seq.num_generated
    assert gen.pause("ep", keep=6) == before - 6 > 0
    assert seq.num_generated == 6 and gen.cache.length(seq.slot) == len(seq.tokens) - 1
    gen.resume("ep", OBSERVATION)
    done = []
    while gen.has_unfinished():
        done += [o.completion for o in gen.step() if o.completion is not None]
    rest = done[0].token_ids[6 + len(OBSERVATION) :]
    history = Request(request_id="ep", prompt_ids=PROMPT * 3 + kept + OBSERVATION, params=params)
    fresh = generator(model, static=False, spec=False).generate([history])[0]
    assert rest == fresh.token_ids[: len(rest)] and rest


def test_misuse_is_refused_naming_the_request(model: Transformer) -> None:
    gen = generator(model, static=False, spec=False)
    params = SamplingParams(temperature=0.0, max_tokens=30)
    gen.add(Request(request_id="ep", prompt_ids=PROMPT, params=params))
    with pytest.raises(ValueError, match="'nope' is not running"):
        gen.pause("nope")
    gen.step()  # prefilled, first token pending
    with pytest.raises(ValueError, match="'ep' is not paused"):
        gen.resume("ep", OBSERVATION)
    with pytest.raises(ValueError, match=r"'ep': keep must lie in \[1, 1\], got 3"):
        gen.pause("ep", keep=3)
    gen.pause("ep")
    with pytest.raises(ValueError, match="'ep' is not decoding"):
        gen.pause("ep")
    with pytest.raises(ValueError, match=r"'ep': observation ids must be non-empty and lie in \[0, 160\)"):
        gen.resume("ep", [160])
    with pytest.raises(ValueError, match="'ep': 200 observation tokens leave no room in max_len 128"):
        gen.resume("ep", [1] * 200)
    gen.resume("ep", OBSERVATION)
    until(gen, "ep", 1 + len(OBSERVATION) + 1)
    with pytest.raises(ValueError, match=r"keep must lie in \[9, "):  # not into the observation
        gen.pause("ep", keep=5)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "fixed-shape"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_eagle_head_sees_the_answer_and_drafts_across_turns(
    model: Transformer, static: bool, temperature: float
) -> None:
    """EAGLE across turns (issue 42): the answer's prefill states reach the head, so its window runs on
    over the answer (no gap, no fresh window) and it drafts in the next turn; the tokens stay plain
    decoding's. Without the answer's states the head saw a gap and restarted after it."""
    from tests.engine.test_eagle_rounds import head_for

    params = SamplingParams(temperature=temperature, seed=3, max_tokens=40)
    want = two_turns(generator(model, static=static, spec=False), params, first=9).token_ids
    drafter = EagleDrafter(head_for(model), model, num_slots=3, max_len=128, static=static)
    gen = Generator(
        model, num_slots=3, max_len=128, token_budget=64, eos_token_ids=(), static=static,
        spec=SpecConfig(method="eagle", depth=3, mode="reproducible"), drafters={"eagle": drafter},
    )  # fmt: skip
    gen.add(Request(request_id="ep", prompt_ids=PROMPT, params=params))
    until(gen, "ep", 9)
    gen.pause("ep", keep=9)
    window = drafter._requests.get("ep")
    gen.resume("ep", OBSERVATION)
    drafted = gen.stats["drafted"]
    done = []
    while gen.has_unfinished():
        seq = gen.scheduler.running["ep"]
        if window is None:  # speculation dropped tokens past the turn's end: the head starts over there
            window = drafter._requests.get("ep")
        else:
            assert drafter._requests.get("ep") is window and window.start < len(PROMPT) + 9
            assert window.start + window.num_features <= len(seq.tokens)
        done += [o.completion for o in gen.step() if o.completion is not None]
    assert done[0].token_ids == want
    assert window is not None and window.start < len(PROMPT) + 9  # its window holds the answer
    assert gen.stats["drafted"] > drafted  # it drafted after the answer
