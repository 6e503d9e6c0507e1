"""Generator: continuous batching is invisible in the output, chunked prefill interleaves with decoding,
finish conditions, abort, and the tree-verify primitive.

The model runs in float64 so that "identical tokens" is not at the mercy of float32 near-ties between a
row computed alone and the same row computed inside a larger matrix multiply.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from slipstream.engine.batch import BatchLayout
from slipstream.engine.drafters import NGramDrafter
from slipstream.engine.generator import Completion, Generator, Request, SpecConfig, run_requests
from slipstream.engine.kv_cache import KVCache
from slipstream.engine.model import Transformer
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.weights import load_model
from tests.engine.tree_scoring import VerifyTree, accepted_path, score_tree, score_trees

VOCAB = 160
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def model(make_checkpoint: Callable[..., Path]) -> Transformer:
    return load_model(make_checkpoint("qwen2", seed=7), dtype=torch.float64)


def alone(model: Transformer, request: Request, **kwargs: object) -> Completion:
    kwargs = {"num_slots": 1, "token_budget": 64, "eos_token_ids": (), **kwargs}
    return Generator(model, **kwargs).generate([request])[0]  # type: ignore[arg-type]


def random_requests(
    count: int, seed: int, params: Callable[[random.Random, int], SamplingParams]
) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            request_id=f"r{i}",
            prompt_ids=[rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))],
            params=params(rng, i),
            group_id=f"g{i // 4}",
        )
        for i in range(count)
    ]


def test_greedy_batching_matches_decoding_alone(model: Transformer) -> None:
    requests = random_requests(
        56,
        0,
        lambda rng, i: SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24), stop_token_ids=(i,)),
    )
    gen = Generator(model, num_slots=8, token_budget=24, eos_token_ids=())
    batched = gen.generate(requests)
    assert gen.cache.num_free_slots == 8
    lengths = {len(c.token_ids) for c in batched}
    assert len(lengths) > 5  # mixed response lengths
    for request, completion in zip(requests, batched, strict=True):
        reference = alone(model, request)
        assert completion.request_id == request.request_id and completion.group_id == request.group_id
        assert completion.prompt_ids == list(request.prompt_ids)
        assert completion.token_ids == reference.token_ids, request.request_id
        assert completion.finish_reason == reference.finish_reason
        assert completion.logprobs == [0.0] * len(completion.token_ids)  # greedy: one-hot distribution


def test_sampling_is_independent_of_batch_composition(model: Transformer) -> None:
    def params(rng: random.Random, i: int) -> SamplingParams:
        return SamplingParams(
            temperature=0.9, top_p=0.95, top_k=40, seed=1000 + i, max_tokens=rng.randint(4, 16)
        )

    requests = random_requests(12, 1, params)
    batched = Generator(model, num_slots=5, token_budget=16, eos_token_ids=()).generate(requests)
    for request, completion in zip(requests, batched, strict=True):
        reference = alone(model, request)
        assert completion.token_ids == reference.token_ids
        torch.testing.assert_close(completion.logprobs, reference.logprobs, atol=1e-6, rtol=0)
        assert all(lp <= 0 for lp in completion.logprobs)
    # The seed matters: the same prompt under another seed samples something else.
    reseeded = [
        Request(
            request_id=r.request_id,
            prompt_ids=r.prompt_ids,
            params=SamplingParams(
                temperature=0.9, top_p=0.95, top_k=40, seed=r.params.seed + 1, max_tokens=r.params.max_tokens
            ),
        )
        for r in requests
    ]
    other = Generator(model, num_slots=5, token_budget=16, eos_token_ids=()).generate(reseeded)
    assert any(a.token_ids != b.token_ids for a, b in zip(batched, other, strict=True))


def test_siblings_share_their_prompt_prefill(model: Transformer) -> None:
    """A group's samples prefill their prompt once: the others copy its K/V but for the last token, which
    they feed themselves. Completions equal unshared ones (sampled and greedy), also for a sibling added
    while the first decodes (it copies from a decoding one) and for siblings whose leader is aborted
    mid-prefill (the next one leads)."""
    prompt, other = list(range(3, 30)), list(range(40, 52))

    def request(i: int, ids: list[int], temperature: float) -> Request:
        params = SamplingParams(temperature=temperature, seed=i, max_tokens=10)
        return Request(request_id=f"r{i}", prompt_ids=ids, params=params, group_id=str(ids[0]))

    requests = [request(i, prompt, 0.9) for i in range(4)] + [request(4, other, 0.0), request(5, prompt, 0.0)]
    late = request(6, prompt, 0.9)
    runs = {}
    for share in (True, False):
        gen = Generator(model, num_slots=8, token_budget=64, eos_token_ids=(), share_prompts=share)
        for r in requests:
            gen.add(r)
        done: dict[str, Completion] = {}
        fed = 0
        while gen.has_unfinished():
            if gen.stats["iterations"] == 3:
                gen.add(late)
            done |= {o.request_id: o.completion for o in gen.step() if o.completion is not None}
            fed += gen.last_prefill_tokens
        runs[share] = (done, fed, gen.stats["shared_prompt_tokens"])
    (shared, shared_fed, copied), (plain, plain_fed, none) = runs[True], runs[False]
    assert (copied, none) == (5 * 26, 0)  # r1-r3, r5 and the late r6 copied 26 of 27 positions each
    assert (shared_fed, plain_fed) == (27 + 12 + 5, 6 * 27 + 12)
    assert shared.keys() == plain.keys() == {f"r{i}" for i in range(7)}
    for name, completion in shared.items():
        assert completion.prompt_ids == plain[name].prompt_ids
        assert completion.token_ids == plain[name].token_ids, name
        torch.testing.assert_close(completion.logprobs, plain[name].logprobs, atol=1e-6, rtol=0)

    gen = Generator(model, num_slots=4, token_budget=16, eos_token_ids=())
    for i in range(3):
        gen.add(request(i, prompt, 0.9))
    gen.step()  # r0 prefilled 16 of 27 tokens; r1 and r2 wait for it
    assert [gen.abort("r0"), gen.stats["shared_prompt_tokens"]] == [True, 0]
    rest: dict[str, Completion] = {}
    while gen.has_unfinished():
        rest |= {o.request_id: o.completion for o in gen.step() if o.completion is not None}
    assert gen.stats["shared_prompt_tokens"] == 26  # r1 led, r2 copied from it
    for i in (1, 2):
        assert rest[f"r{i}"].token_ids == shared[f"r{i}"].token_ids


def test_grown_cache_is_invisible_in_the_output_and_sized_by_the_batch(model: Transformer) -> None:
    """Same completions (tokens and log-probs, bitwise) from a cache grown to the live batch as from one
    paid up front, plain and speculative (tree, reproducible); the grown one holds a fraction of the
    bytes at its peak and none once idle."""

    def params(rng: random.Random, i: int) -> SamplingParams:
        return SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=i, max_tokens=rng.randint(1, 40))

    requests = random_requests(24, 3, params)  # prompts <= 40 tokens: a sequence needs <= 80 positions
    tree = SpecConfig(method="ngram", depth=3, topk=2, verify=6, mode="reproducible")
    for spec in (None, tree):
        outputs, peaks = [], []
        for grow in (False, True):
            drafters = None if spec is None else {"ngram": NGramDrafter()}
            gen = Generator(
                model,
                num_slots=8,
                max_len=512,
                token_budget=32,
                eos_token_ids=(),
                spec=spec,
                drafters=drafters,
                grow_cache=grow,
            )
            held = [gen.cache.nbytes]
            track = lambda _, held=held, cache=gen.cache: held.append(cache.nbytes)  # noqa: E731
            outputs.append(run_requests(gen, requests, on_tokens=track))
            peaks.append(max(held))
            assert gen.cache.nbytes == (gen.cache.max_nbytes if not grow else 0)  # grown: released when idle
            assert spec is None or gen.stats["drafted"] > gen.stats["accepted"] > 0  # commits and rollbacks
        for static, grown in zip(*outputs, strict=True):
            assert grown.token_ids == static.token_ids and grown.logprobs == static.logprobs
        bytes_per_token = KVCache.for_model(model.config, num_slots=1, max_len=1).bytes_per_token
        assert peaks[0] == bytes_per_token * 8 * 512 * 2  # float64: twice the float32 figure
        assert peaks[1] <= peaks[0] // 4  # 8 slots x 128 positions at most, of 512


def test_a_long_tail_in_a_high_slot_moves_down(model: Transformer) -> None:
    """The last sequence of a batch, left alone in a high slot of a grown cache, moves to the lowest slots
    and the storage shrinks to them; its tokens are those it decodes alone."""
    requests = [
        Request(
            request_id=f"r{i}",
            prompt_ids=[10 + i, 20 + i, 30 + i],
            params=SamplingParams(temperature=0.8, seed=i, max_tokens=60 if i == 7 else 3),
        )
        for i in range(8)
    ]
    gen = Generator(model, num_slots=8, max_len=128, token_budget=64, eos_token_ids=(), grow_cache=True)
    capacity = []
    done = run_requests(gen, requests, on_tokens=lambda _: capacity.append(gen.cache.slot_capacity))
    assert capacity[1] == 8 and capacity[-2] == 4  # r7 ran alone in slot 0 of 4
    for request, completion in zip(requests, done, strict=True):
        assert completion.token_ids == alone(model, request).token_ids


def test_compaction_moves_slots_that_never_held_anything(model: Transformer) -> None:
    """Requests admitted beyond what the first pass could prefill hold slots with no storage yet; when the
    first ones finish at once, compaction moves those slots down (it used to copy from past the storage:
    IndexError, 16 one-token requests of 64-token prompts on 16 slots)."""
    requests = [
        Request(request_id=f"r{i}", prompt_ids=[(7 * i + 13 * j) % VOCAB for j in range(16)],
                params=SamplingParams(temperature=1.0, seed=i, max_tokens=1 if i < 4 else 3))
        for i in range(8)
    ]  # fmt: skip
    gen = Generator(model, num_slots=8, max_len=64, token_budget=64, eos_token_ids=(), grow_cache=True)
    done = gen.generate(requests)
    for request, completion in zip(requests, done, strict=True):
        assert completion.token_ids == alone(model, request).token_ids


def test_chunked_prefill_interleaves_with_decode(model: Transformer) -> None:
    gen = Generator(model, num_slots=4, token_budget=8, eos_token_ids=())
    short = Request(
        request_id="short", prompt_ids=[1, 2, 3], params=SamplingParams(temperature=0.0, max_tokens=30)
    )
    long = Request(
        request_id="long",
        prompt_ids=list(range(40, 80)),
        params=SamplingParams(temperature=0.0, max_tokens=5),
    )
    gen.add(short)
    assert [o.request_id for o in gen.step()] == ["short"]
    gen.add(long)
    # Budget 8: one token for "short", seven for "long"'s prefill, so its 40 prompt tokens take 6 passes,
    # and "short" decodes a token in every one of them.
    for step in range(6):
        outputs = {o.request_id: o for o in gen.step()}
        assert len(outputs["short"].token_ids) == 1
        assert ("long" in outputs) == (step == 5)
    done: dict[str, Completion] = {}
    while gen.has_unfinished():
        done.update({o.request_id: o.completion for o in gen.step() if o.completion is not None})
    assert done["long"].token_ids == alone(model, long).token_ids
    assert done["short"].token_ids == alone(model, short).token_ids


def test_long_prompt_alone_prefills_in_chunks(model: Transformer) -> None:
    long = Request(request_id="long", prompt_ids=list(range(40, 80)), params=GREEDY)
    gen = Generator(model, num_slots=2, token_budget=9, eos_token_ids=())
    gen.add(long)
    assert [gen.step() for _ in range(4)] == [[], [], [], []]  # 36 of 40 prompt tokens, no logits yet
    (first,) = gen.step()
    assert first.request_id == "long" and len(first.token_ids) == 1
    rest = []
    while gen.has_unfinished():
        rest += gen.step()
    assert first.token_ids + [o.token_ids[0] for o in rest] == alone(model, long).token_ids


def test_max_tokens_stop_ids_and_eos(model: Transformer) -> None:
    prompt = [5, 6, 7, 8]
    free = alone(model, Request(request_id="a", prompt_ids=prompt, params=GREEDY))
    assert len(free.token_ids) == 12 and free.finish_reason == "length"
    # Stop at the first token that did not occur earlier (so the stop is exactly there).
    index = next(i for i in range(2, 12) if free.token_ids[i] not in free.token_ids[:i])
    stop = free.token_ids[index]
    stopped = alone(
        model,
        Request(
            request_id="b", prompt_ids=prompt, params=SamplingParams(temperature=0.0, stop_token_ids=(stop,))
        ),
    )
    assert stopped.token_ids == free.token_ids[: index + 1] and stopped.finish_reason == "stop"
    by_eos = alone(model, Request(request_id="c", prompt_ids=prompt, params=GREEDY), eos_token_ids=(stop,))
    assert by_eos.token_ids == stopped.token_ids and by_eos.finish_reason == "stop"


def test_cache_full_finishes_with_length(model: Transformer) -> None:
    request = Request(request_id="a", prompt_ids=list(range(15)), params=SamplingParams(temperature=0.0))
    completion = alone(model, request, max_len=20)
    assert len(completion.prompt_ids) + len(completion.token_ids) == 20
    assert completion.finish_reason == "length"


def test_abort_waiting_and_running(model: Transformer) -> None:
    requests = [
        Request(
            request_id=name,
            prompt_ids=[i + 1] * (3 + i),
            params=SamplingParams(temperature=0.0, max_tokens=10),
        )
        for i, name in enumerate(["a", "b", "c"])
    ]
    gen = Generator(model, num_slots=2, token_budget=16, eos_token_ids=())
    for request in requests:
        gen.add(request)
    gen.step()
    gen.step()
    assert gen.num_running == 2
    assert gen.abort("a") and gen.abort("c")  # running, waiting
    assert not gen.abort("a") and not gen.abort("unknown")
    assert gen.cache.num_free_slots == 1
    done = []
    while gen.has_unfinished():
        done += [o.completion for o in gen.step() if o.completion is not None]
    assert [c.request_id for c in done] == ["b"]
    assert done[0].token_ids == alone(model, requests[1]).token_ids


def test_return_hidden_reproduces_the_sampled_tokens(model: Transformer) -> None:
    request = Request(request_id="a", prompt_ids=[9, 8, 7], params=GREEDY)
    completion = alone(model, request, return_hidden=True)
    assert completion.hidden is not None
    assert completion.hidden.shape == (len(completion.token_ids), model.config.hidden_size)
    with torch.no_grad():
        assert model.head(completion.hidden).argmax(-1).tolist() == completion.token_ids


def test_request_validation(model: Transformer) -> None:
    gen = Generator(model, num_slots=2, max_len=16, token_budget=8)
    with pytest.raises(ValueError, match="empty prompt"):
        gen.add(Request(request_id="a", prompt_ids=[]))
    with pytest.raises(ValueError, match="leaves no room"):
        gen.add(Request(request_id="a", prompt_ids=[1] * 16))
    with pytest.raises(ValueError, match="prompt ids"):
        gen.add(Request(request_id="a", prompt_ids=[VOCAB]))
    gen.add(Request(request_id="a", prompt_ids=[1]))
    with pytest.raises(ValueError, match="already queued"):
        gen.add(Request(request_id="a", prompt_ids=[2]))
    with pytest.raises(ValueError, match="token_budget"):
        Generator(model, num_slots=8, token_budget=8)


# ---- tree verification primitive ----------------------------------------------------------------------


def prefill(model: Transformer, cache: KVCache, slot: int, tokens: list[int]) -> torch.Tensor:
    layout = BatchLayout.build(cache, [slot], [len(tokens)])
    logits, _ = model(torch.tensor(tokens), layout.positions, layout, cache)
    return logits[-1]


def test_score_chain_matches_one_by_one_decoding(model: Transformer) -> None:
    prompt = [3, 14, 15, 92, 65, 35]
    continuation = alone(model, Request(request_id="a", prompt_ids=prompt, params=GREEDY)).token_ids[:5]

    stepwise = KVCache.for_model(model.config, num_slots=1, max_len=32, dtype=torch.float64)
    slot = stepwise.allocate()
    prefill(model, stepwise, slot, prompt)
    one_by_one = torch.stack([prefill(model, stepwise, slot, [token]) for token in continuation])

    tree = KVCache.for_model(model.config, num_slots=3, max_len=32, dtype=torch.float64)
    tree.allocate()
    tree_slot = tree.allocate()
    prefill(model, tree, tree_slot, prompt)
    logits, hidden = score_tree(model, tree, tree_slot, len(prompt), continuation, [-1, 0, 1, 2, 3])
    torch.testing.assert_close(logits, one_by_one, atol=1e-10, rtol=0)
    assert hidden.shape == (5, model.config.hidden_size)
    # The greedy chain verifies itself: each row's argmax is the next draft token.
    assert logits.argmax(-1)[:-1].tolist() == continuation[1:]
    for a, b in zip(stepwise.keys + stepwise.values, tree.keys + tree.values, strict=True):
        torch.testing.assert_close(
            a[slot, :, : len(prompt) + 5], b[tree_slot, :, : len(prompt) + 5], atol=1e-10, rtol=0
        )


def test_score_trees_batch_then_commit_equals_never_branched(model: Transformer) -> None:
    prompts = [[7, 7, 1, 2], [50, 51, 52, 53, 54, 55, 56]]
    greedy = [
        alone(model, Request(request_id=str(i), prompt_ids=p, params=GREEDY)).token_ids
        for i, p in enumerate(prompts)
    ]

    cache = KVCache.for_model(model.config, num_slots=2, max_len=32, dtype=torch.float64)
    slots = [cache.allocate(), cache.allocate()]
    for slot, prompt in zip(slots, prompts, strict=True):
        prefill(model, cache, slot, prompt)
    # Tree per sequence: root = pending token g0; wrong sibling w under the root; g1 under the root with
    # children (w, g2). The accepted path is root, g1, g2 (node indices 0, 2, 4).
    trees = [
        VerifyTree(
            slot=slot,
            tokens=[g[0], (g[1] + 1) % VOCAB, g[1], (g[2] + 3) % VOCAB, g[2]],
            parents=[-1, 0, 0, 2, 2],
        )
        for slot, g in zip(slots, greedy, strict=True)
    ]
    scores = score_trees(model, cache, trees)
    for tree, base, logits, g in zip(trees, scores.base_lengths, scores.logits, greedy, strict=True):
        verified = accepted_path(logits, tree, GREEDY, base + 1)
        assert verified.nodes == [0, 2, 4] and verified.tokens == g[1:4]
        cache.commit_path(tree.slot, base, verified.nodes)

    for slot, prompt, g in zip(slots, prompts, greedy, strict=True):
        chain = KVCache.for_model(model.config, num_slots=1, max_len=32, dtype=torch.float64)
        chain_slot = chain.allocate()
        prefill(model, chain, chain_slot, prompt + g[:3])
        assert cache.length(slot) == chain.length(chain_slot)
        for a, b in zip(cache.keys + cache.values, chain.keys + chain.values, strict=True):
            torch.testing.assert_close(
                a[slot, :, : cache.length(slot)], b[chain_slot, :, : cache.length(slot)], atol=1e-10, rtol=0
            )
        torch.testing.assert_close(
            prefill(model, cache, slot, [g[3]]), prefill(model, chain, chain_slot, [g[3]]), atol=1e-10, rtol=0
        )

    with pytest.raises(ValueError, match="root"):
        score_trees(model, cache, [VerifyTree(slot=slots[0], tokens=[1, 2], parents=[0, 0])])
