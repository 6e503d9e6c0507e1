"""Speculative decoding inside the Generator: configuration, drafter management, limits inside an
accepted run, the KV cache after rejections, hot swaps, chunked prefill beside verification, the token
budget, hidden states and accounting. (Losslessness at scale is `test_spec_lossless.py`.)

The model runs in float64 so greedy outputs compare token for token (see `test_generator.py`).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

import pytest
import torch

from slipstream.engine.drafters import Draft, Drafter, DraftState, NGramDrafter, OracleDrafter
from slipstream.engine.generator import Completion, Generator, Request
from slipstream.engine.kv_cache import KVCache
from slipstream.engine.model import Transformer
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.speculator import SpecConfig, Speculator, share_budget
from slipstream.engine.weights import load_model
from tests.engine.test_generator import prefill

VOCAB = 160
CHAIN = SpecConfig(method="ngram", depth=3)
TREE = SpecConfig(method="ngram", depth=4, topk=3, verify=10)


@pytest.fixture(scope="module")
def model(make_checkpoint: Callable[..., Path]) -> Transformer:
    return load_model(make_checkpoint("qwen2", seed=7), dtype=torch.float64)


def requests_with_repeats(count: int, seed: int = 0, max_tokens: int = 24) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        motif = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 5))]
        out.append(
            Request(
                request_id=f"r{i}",
                prompt_ids=(motif * 8)[: rng.randint(4, 24)],
                params=SamplingParams(temperature=0.0, max_tokens=rng.randint(max_tokens // 2, max_tokens)),
                group_id=f"g{i // 2}",
            )
        )
    return out


def plain(model: Transformer, requests: Sequence[Request], **kwargs: object) -> list[Completion]:
    kwargs = {"num_slots": 4, "token_budget": 64, "eos_token_ids": (), **kwargs}
    return Generator(model, **kwargs).generate(requests)  # type: ignore[arg-type]


def oracle_of(completions: Sequence[Completion]) -> OracleDrafter:
    return OracleDrafter({c.request_id: c.prompt_ids + c.token_ids for c in completions})


def drive(gen: Generator, on_step: Callable[[int], None] | None = None) -> dict[str, Completion]:
    done: dict[str, Completion] = {}
    step = 0
    while gen.has_unfinished():
        if on_step is not None:
            on_step(step)
        done.update({o.request_id: o.completion for o in gen.step() if o.completion is not None})
        step += 1
    return done


class Detour(NGramDrafter):
    """N-gram chains turned into trees with a wrong sibling BEFORE every drafted token, so an accepted path
    is never a prefix of the node order: the KV cache must move K/V, not just roll back."""

    def propose(self, states, depth, topk, verify):
        drafts = []
        for chain in super().propose(states, depth, 1, depth):
            tokens, parents = [], []
            for level, token in enumerate(chain.tokens.tolist()):
                parent = 2 * level - 1 if level else -1  # the previous level's real token
                tokens += [(token + 1) % VOCAB, token]
                parents += [parent, parent]
            drafts.append(
                Draft(torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64))
            )
        return drafts


# ---- configuration and drafters ------------------------------------------------------------------------


def test_spec_config_validates_and_names_the_field() -> None:
    assert not SpecConfig().enabled and SpecConfig(method="ngram").enabled
    assert SpecConfig(depth=5).verify_budget == 5
    assert SpecConfig(depth=4, topk=4).verify_budget == 16
    assert SpecConfig(depth=4, topk=4, verify=10).verify_budget == 10
    assert SpecConfig(depth=7, verify=3).verify_budget == 3
    assert SpecConfig(depth=3, verify=5).verify_budget == 3  # a chain has depth tokens at most
    assert SpecConfig(depth=4, topk=4, verify=32).verify_budget == 32  # EAGLE-2 trees expand topk²
    for field, kwargs in [
        ("method", {"method": "medusa"}),
        ("depth", {"depth": 0}),
        ("topk", {"topk": 0}),
        ("verify", {"verify": -1}),
        ("mode", {"mode": "match"}),
    ]:
        with pytest.raises(ValueError, match=rf"SpecConfig\.{field}"):
            SpecConfig(**kwargs)


def test_drafter_selection(model: Transformer) -> None:
    # The engine makes no drafter of its own: a method without a held drafter is refused, by name.
    with pytest.raises(ValueError, match="'eagle'"):
        Generator(model, spec=SpecConfig(method="eagle"))
    with pytest.raises(ValueError, match="'ngram'"):
        Generator(model, spec=CHAIN)
    with pytest.raises(ValueError, match="'hybrid' needs a drafter held for 'ngram'"):
        Generator(model, spec=SpecConfig(method="hybrid"), drafters={"eagle": NGramDrafter()})
    with pytest.raises(ValueError, match="not 'hybrid'"):
        Generator(model, drafters={"hybrid": NGramDrafter()})
    gen = Generator(model)
    assert not gen.spec.enabled and not gen.speculator.drafters
    ngram = NGramDrafter()
    gen.hold("ngram", ngram)  # held while speculation is off: it observes from now on
    assert not gen.spec.enabled
    gen.set_spec(CHAIN)
    gen.set_spec(None)
    gen.set_spec(TREE)  # the n-gram tables survive a detour through "off"
    assert gen.speculator.drafters["ngram"] is ngram and gen.spec == TREE
    with pytest.raises(ValueError, match="'self'"):
        gen.set_spec(SpecConfig(method="self"))
    assert gen.spec == TREE  # a refused spec changes nothing
    swapped = NGramDrafter(max_n=3)
    gen.hold("ngram", swapped)
    assert gen.speculator.drafters["ngram"] is swapped


def test_self_method_replays_a_recorded_run(model: Transformer) -> None:
    requests = requests_with_repeats(6, seed=1)
    oracle = OracleDrafter()
    gen = Generator(
        model, num_slots=4, token_budget=64, eos_token_ids=(), spec=SpecConfig(method="self", depth=5),
        drafters={"self": oracle},
    )  # fmt: skip
    first = gen.generate(requests)
    assert gen.stats["drafted"] == 0  # nothing recorded yet: plain decoding
    for completion in first:
        oracle.record(completion.request_id, completion.prompt_ids + completion.token_ids)
    second = gen.generate(requests)
    stats = gen.stats
    assert [c.token_ids for c in second] == [c.token_ids for c in first]
    assert stats["accepted"] == stats["drafted"] > 0
    assert sum(c.target_passes for c in second) < sum(c.target_passes for c in first)
    # Per draft depth: every offered token was accepted, deeper depths are reached no more often, and the
    # depths' acceptances add up to the accepted draft tokens.
    offered, accepted = gen.position_stats
    assert offered == accepted and len(offered) == 5
    assert all(a >= b for a, b in itertools.pairwise(offered))
    assert sum(accepted) == stats["accepted"]


def test_position_stats_count_a_tree_by_depth_not_by_node(model: Transformer) -> None:
    requests = requests_with_repeats(4, seed=3)
    gen = Generator(
        model, num_slots=4, token_budget=64, eos_token_ids=(), spec=TREE, drafters={"ngram": Detour()}
    )
    for request in requests:
        gen.add(request)
    drive(gen)
    offered, accepted = gen.position_stats
    assert 0 < len(offered) <= TREE.depth  # two nodes a level: counted by depth, not by node
    assert gen.last_draft_ns > 0  # the last step drafted (what a rollout's "draft" span covers)
    assert all(0 <= a <= o for o, a in zip(offered, accepted, strict=True))
    assert sum(accepted) >= gen.stats["accepted"] > 0  # a stop or limit may cut accepted tokens afterwards


def test_token_budget_is_derived_from_slots_and_draft_size(model: Transformer) -> None:
    ngram = {"ngram": NGramDrafter()}
    assert Generator(model, num_slots=4, max_len=16).token_budget == 512  # the floor
    # Every sequence's pending token and full draft fit in one pass, with 64 tokens to spare for prefill.
    assert Generator(model, num_slots=64, max_len=16, spec=TREE, drafters=ngram).token_budget == 64 * 11 + 64
    assert Generator(model, num_slots=64, max_len=16, max_draft=16).token_budget == 64 * 17 + 64
    assert (
        Generator(model, num_slots=64, max_len=16, max_draft=0, spec=TREE, drafters=ngram).token_budget == 512
    )
    assert (
        Generator(model, num_slots=64, max_len=16, token_budget=100, spec=TREE, drafters=ngram).token_budget
        == 100
    )
    with pytest.raises(ValueError, match="max_draft"):
        Generator(model, max_draft=-1)


def test_share_budget_is_fair() -> None:
    assert share_budget([3, 3, 3], 100) == 3
    assert share_budget([7, 7, 1], 9) == 4  # 4 + 4 + 1
    assert share_budget([7, 7, 7], 2) == 0
    assert share_budget([], 5) == 0


def test_drafts_are_checked_and_trimmed_to_their_caps() -> None:
    class Fixed(Drafter):
        uses_hidden = False

        def __init__(self, draft: Draft) -> None:
            self.draft = draft

        def propose(self, states, depth, topk, verify):
            return [self.draft for _ in states]

    state = DraftState(request_id="a", group_id="g", tokens=[1, 2], prompt_len=2, params=SamplingParams())
    # root → 5 → 6 → 7 and root → 8 → 9: nodes deeper than 2 go, the rest keep their shape.
    tree = Draft(torch.tensor([5, 8, 6, 9, 7]), torch.tensor([-1, -1, 0, 1, 2]))
    spec = Speculator(VOCAB)
    spec.hold("eagle", Fixed(tree))
    spec.set(SpecConfig(method="eagle", depth=3, topk=2))
    (proposal,) = spec.draft([state], depth_caps=[2], node_caps=[10], budget=10)
    assert proposal.tokens == [5, 8, 6, 9] and proposal.parents == [-1, -1, 0, 1]
    (proposal,) = spec.draft([state], depth_caps=[1], node_caps=[10], budget=10)
    assert proposal.tokens == [5, 8] and proposal.parents == [-1, -1]
    (proposal,) = spec.draft([state], depth_caps=[3], node_caps=[10], budget=1)
    assert proposal.tokens == [5] and proposal.parents is None  # what is left is a chain
    spec.hold("eagle", Fixed(Draft(torch.tensor([1, 2]), torch.tensor([1, -1]))))
    with pytest.raises(ValueError, match="topological"):
        spec.draft([state], depth_caps=[3], node_caps=[10], budget=10)
    spec.hold("eagle", Fixed(Draft.chain([VOCAB])))
    with pytest.raises(ValueError, match="draft tokens"):
        spec.draft([state], depth_caps=[3], node_caps=[10], budget=10)


# ---- limits inside an accepted run ---------------------------------------------------------------------


def test_stop_and_limits_cut_an_accepted_run_where_plain_decoding_stops(model: Transformer) -> None:
    prompt = [5, 6, 7, 8]
    free = plain(
        model,
        [Request(request_id="a", prompt_ids=prompt, params=SamplingParams(temperature=0.0, max_tokens=30))],
    )
    oracle = oracle_of(free)  # drafts run past any stop or limit below
    tokens = free[0].token_ids
    index = next(i for i in range(5, 30) if tokens[i] not in tokens[:i])
    cases = [
        (SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=(tokens[index],)), {}),
        (SamplingParams(temperature=0.0, max_tokens=index + 1), {}),
        (SamplingParams(temperature=0.0, max_tokens=30), {"max_len": len(prompt) + index + 1}),
    ]
    for params, kwargs in cases:
        request = Request(request_id="a", prompt_ids=prompt, params=params)
        (reference,) = plain(model, [request], **kwargs)
        gen = Generator(
            model, num_slots=2, token_budget=64, eos_token_ids=(), return_hidden=True,
            spec=SpecConfig(method="self", depth=7), drafters={"self": oracle}, **kwargs,
        )  # fmt: skip
        (completion,) = gen.generate([request])
        assert completion.token_ids == reference.token_ids == tokens[: index + 1]
        assert completion.finish_reason == reference.finish_reason
        assert len(completion.logprobs) == len(completion.token_ids) == completion.hidden.shape[0]
        assert completion.target_passes < len(completion.token_ids)  # several tokens per pass
        assert gen.cache.num_free_slots == 2


# ---- the KV cache after rejections ---------------------------------------------------------------------


def test_cache_equals_one_that_never_saw_rejected_tokens(model: Transformer) -> None:
    requests = requests_with_repeats(3, seed=2, max_tokens=30)
    gen = Generator(
        model, num_slots=3, token_budget=64, eos_token_ids=(), spec=TREE, drafters={"ngram": Detour()}
    )
    for request in requests:
        gen.add(request)
    history = {r.request_id: list(r.prompt_ids) for r in requests}
    checked = 0
    while gen.has_unfinished():
        outputs = gen.step()
        for output in outputs:
            history[output.request_id] += output.token_ids
        stats = gen.stats
        if stats["drafted"] == stats["accepted"]:
            continue  # nothing rejected yet
        for slot, request in enumerate(requests):  # admitted together: slot i holds request i
            done = any(o.request_id == request.request_id and o.completion for o in outputs)
            if done or gen.cache.lengths[slot] == 0:
                continue
            committed = history[request.request_id][:-1]  # the last token is pending
            assert gen.cache.length(slot) == len(committed)
            reference = KVCache.for_model(model.config, num_slots=1, max_len=128, dtype=torch.float64)
            ref_slot = reference.allocate()
            prefill(model, reference, ref_slot, list(request.prompt_ids))
            for token in committed[len(request.prompt_ids) :]:  # plain decoding: one token at a time
                prefill(model, reference, ref_slot, [token])
            for ours, theirs in zip(
                gen.cache.keys + gen.cache.values, reference.keys + reference.values, strict=True
            ):
                torch.testing.assert_close(
                    ours[slot, :, : len(committed)], theirs[ref_slot, :, : len(committed)], atol=1e-10, rtol=0
                )
            checked += 1
    assert checked >= 5 and gen.stats["accepted"] > 0


# ---- hot swap ------------------------------------------------------------------------------------------


def test_hot_swapping_drafters_and_strategies_keeps_greedy_output(model: Transformer) -> None:
    requests = requests_with_repeats(10, seed=3, max_tokens=40)
    reference = plain(model, requests)
    gen = Generator(
        model, num_slots=4, token_budget=64, eos_token_ids=(), spec=CHAIN, drafters={"ngram": NGramDrafter()}
    )
    for request in requests:
        gen.add(request)

    def swap(step: int) -> None:
        # Any drafter may be held for any method, mid-run: drafts change speed only.
        if step == 4:
            gen.hold("ngram", oracle_of(reference))
        elif step == 8:
            gen.hold("ngram", NGramDrafter(min_n=1, max_n=2))
            gen.set_spec(TREE)
        elif step == 12:
            gen.set_spec(None)
        elif step == 15:
            gen.hold("self", oracle_of(reference))
            gen.set_spec(SpecConfig(method="self", depth=7))
        elif step == 20:
            gen.hold("self", NGramDrafter())

    done = drive(gen, swap)
    assert [done[r.request_id].token_ids for r in requests] == [c.token_ids for c in reference]
    assert gen.stats["accepted"] > 0


# ---- chunked prefill beside verification, and the token budget -----------------------------------------


def test_prefill_shares_the_verify_pass_within_the_token_budget(model: Transformer) -> None:
    short = Request(
        request_id="short", prompt_ids=[1, 2, 3], params=SamplingParams(temperature=0.0, max_tokens=40)
    )
    long = Request(
        request_id="long",
        prompt_ids=list(range(40, 100)),
        params=SamplingParams(temperature=0.0, max_tokens=8),
    )
    reference = plain(model, [short, long])
    gen = Generator(
        model, num_slots=2, token_budget=12, eos_token_ids=(),
        spec=SpecConfig(method="self", depth=7), drafters={"self": oracle_of(reference)},
    )  # fmt: skip
    passes: list[int] = []
    forward = model.forward

    def spy(input_ids: torch.Tensor, *args: object) -> object:
        passes.append(input_ids.numel())
        return forward(input_ids, *args)

    model.forward = spy  # type: ignore[method-assign]
    try:
        gen.add(short)
        gen.step()
        gen.add(long)
        per_step = []
        while gen.has_unfinished():
            before = len(passes)
            outputs = {o.request_id: o for o in gen.step()}
            assert len(passes) - before == 1  # one forward pass per iteration, prefill included
            per_step.append((outputs.get("short"), outputs.get("long")))
    finally:
        del model.forward
    assert max(passes) <= 12
    # While "long" prefills (no output yet), "short" keeps speculating: several tokens in some passes.
    prefilling = [s for s, lo in per_step[:4] if lo is None]
    assert prefilling and max(len(s.token_ids) for s in prefilling if s is not None) > 1
    done = {c.request_id: c.token_ids for c in reference}
    assert gen.stats["committed"] == len(done["short"]) + len(done["long"])


# ---- hidden states and the drafter's view --------------------------------------------------------------


class Spy(Detour):
    """A detour drafter that asks for hidden states and records what it is told."""

    uses_hidden = True

    def __init__(self) -> None:
        super().__init__()
        self.observed: dict[Hashable, list[torch.Tensor]] = {}
        self.proposed_hidden: list[torch.Tensor | None] = []
        self.resets: list[Hashable] = []
        self.group_resets: list[Hashable] = []

    def observe(self, state: DraftState) -> None:
        assert state.hidden is not None
        self.observed.setdefault(state.request_id, []).append(state.hidden)
        super().observe(state)

    def propose(self, states, depth, topk, verify):
        self.proposed_hidden += [s.hidden for s in states]
        return super().propose(states, depth, topk, verify)

    def reset(self, request_id: Hashable) -> None:
        self.resets.append(request_id)
        super().reset(request_id)

    def reset_group(self, group_id: Hashable) -> None:
        self.group_resets.append(group_id)
        super().reset_group(group_id)


def test_hidden_states_follow_the_accepted_path(model: Transformer) -> None:
    requests = requests_with_repeats(6, seed=4)
    reference = plain(model, requests, return_hidden=True)
    spy = Spy()
    gen = Generator(
        model, num_slots=3, token_budget=64, eos_token_ids=(), return_hidden=True, spec=TREE,
        drafters={"ngram": spy},
    )  # fmt: skip
    completions = gen.generate(requests)
    assert gen.stats["accepted"] > 0 and gen.stats["drafted"] > gen.stats["accepted"]
    hidden = model.config.hidden_size
    for completion, ref in zip(completions, reference, strict=True):
        assert completion.token_ids == ref.token_ids
        # Completion.hidden: the state that sampled each token, whichever pass node it was.
        torch.testing.assert_close(completion.hidden, ref.hidden, atol=1e-10, rtol=0)
        # The drafter saw the same states, exactly once each, as tokens were committed.
        torch.testing.assert_close(
            torch.cat(spy.observed[completion.request_id]), ref.hidden, atol=1e-10, rtol=0
        )
    # At propose time every commit has been observed: no new states.
    assert spy.proposed_hidden and all(h is not None and h.shape == (0, hidden) for h in spy.proposed_hidden)
    # Each request is forgotten once; each group once its last request is done.
    assert sorted(spy.resets) == sorted(r.request_id for r in requests)
    assert sorted(spy.group_resets) == sorted({r.group_id for r in requests})


def test_abort_during_speculation(model: Transformer) -> None:
    requests = requests_with_repeats(4, seed=5, max_tokens=30)
    spy = Spy()
    gen = Generator(
        model, num_slots=4, token_budget=64, eos_token_ids=(), spec=CHAIN, drafters={"ngram": spy}
    )
    for request in requests:
        gen.add(request)
    for _ in range(3):
        gen.step()
    assert gen.abort("r0")
    done = drive(gen)
    assert "r0" not in done and "r0" in spy.resets
    reference = plain(model, requests[1:])
    assert [done[c.request_id].token_ids for c in reference] == [c.token_ids for c in reference]
    assert gen.cache.num_free_slots == 4 and sorted(spy.group_resets) == ["g0", "g1"]
