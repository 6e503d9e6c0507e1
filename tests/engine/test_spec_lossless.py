"""Speculative decoding in the Generator is lossless, end to end.

- Greedy: token-identical to plain decoding for every drafter (n-gram, self/oracle) and strategy (chain
  depth 1/3/7, tree), 200+ requests of mixed lengths in continuous batches with chunked prefill, on tiny
  models with and without GQA.
- Reproducible mode: token-identical to plain decoding with the same seeds (mixed temperature/top-p/top-k),
  also when a request's rounds alternate between no draft, an accepted draft and a rejected one (noise is
  keyed by position, not by round).
- Rejection mode: the law of the first two generated tokens under speculation matches the exact law of
  plain sampling (computed from the model) under top-k, top-p and both — a chi-square goodness-of-fit test
  at false-alarm rate ALPHA = 1e-3 over all cases on a tiny model with an 8-token vocabulary and a drafter
  whose distribution differs from the target's — and the same test rejects a planted bug (no residual
  resampling; top-p dropped from the target), so a pass is evidence.

Models run in float64, so that "identical tokens" is not at the mercy of float32 near-ties between a row
computed alone and the same row computed inside a larger matrix multiply. Prompts repeat short motifs and
GRPO-style groups share a prompt, so the n-gram drafter proposes and is accepted (asserted: a run that
accepts nothing proves nothing), and also rejected (asserted: rollback is exercised).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace

import pytest
import torch
from torch import Tensor

from slipstream.engine import speculator, verify
from slipstream.engine.drafters import Draft, Drafter, DraftState, NGramDrafter, OracleDrafter
from slipstream.engine.generator import Completion, Generator, Request
from slipstream.engine.model import Transformer
from slipstream.engine.sampling import SamplingParams, params_tensors, processed_probs
from slipstream.engine.speculator import SpecConfig
from slipstream.engine.weights import load_model
from tests.engine.test_sampling import ALPHA, chi2_critical, chi2_statistic

VOCAB = 160
STRATEGIES = {
    "chain1": {"depth": 1},
    "chain3": {"depth": 3},
    "chain7": {"depth": 7},
    "tree": {"depth": 4, "topk": 3, "verify": 10},
}
MODELS = {
    "llama-gqa": ("llama", {"num_key_value_heads": 2}),
    "qwen2-mha": ("qwen2", {"num_key_value_heads": 4}),
    "llama-mqa": ("llama", {"num_key_value_heads": 1, "num_attention_heads": 2, "hidden_size": 48}),
}


def repetitive_requests(
    count: int, seed: int, params: Callable[[random.Random, int], SamplingParams]
) -> list[Request]:
    """Groups of 4 siblings sharing a prompt made of a repeated motif; mixed prompt and response lengths."""
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        if i % 4 == 0:
            motif = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
            prompt = (motif * 20)[: rng.randint(1, 40)]
        requests.append(
            Request(request_id=f"r{i}", prompt_ids=prompt, params=params(rng, i), group_id=f"g{i // 4}")
        )
    return requests


def greedy_params(rng: random.Random, i: int) -> SamplingParams:
    stops = (rng.randrange(VOCAB),) if i % 3 == 0 else ()
    return SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 32), stop_token_ids=stops)


def run(model: Transformer, requests: Sequence[Request], **kwargs: object) -> tuple[list[Completion], dict]:
    gen = Generator(model, num_slots=12, token_budget=48, eos_token_ids=(), **kwargs)  # type: ignore[arg-type]
    completions = gen.generate(requests)
    assert gen.cache.num_free_slots == 12
    return completions, gen.stats


def assert_same_output(
    got: Sequence[Completion], reference: Sequence[Completion], logprob_atol: float
) -> None:
    for completion, ref in zip(got, reference, strict=True):
        assert completion.token_ids == ref.token_ids, completion.request_id
        assert completion.finish_reason == ref.finish_reason, completion.request_id
        torch.testing.assert_close(completion.logprobs, ref.logprobs, atol=logprob_atol, rtol=0)


def assert_accounting(completions: Sequence[Completion], stats: dict) -> None:
    """Every pass emits its accepted drafts plus one token, except a last pass cut short by a limit."""
    assert stats["committed"] == sum(len(c.token_ids) for c in completions)
    assert stats["accepted"] == sum(c.accepted for c in completions)
    assert stats["drafted"] == sum(c.drafted for c in completions)
    for c in completions:
        assert c.accepted <= c.drafted
        assert c.target_passes + c.accepted - 1 <= len(c.token_ids) <= c.target_passes + c.accepted


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_is_token_identical_for_every_drafter_and_strategy(make_checkpoint, name: str) -> None:
    arch, overrides = MODELS[name]
    model = load_model(make_checkpoint(arch, seed=11, **overrides), dtype=torch.float64)
    requests = repetitive_requests(208, seed=5, params=greedy_params)
    reference, plain_stats = run(model, requests)
    assert plain_stats["drafted"] == 0 and plain_stats["target_passes"] == plain_stats["iterations"]
    assert len({len(c.token_ids) for c in reference}) > 10 and {"stop", "length"} <= {
        c.finish_reason for c in reference
    }
    oracle = OracleDrafter({c.request_id: c.prompt_ids + c.token_ids for c in reference})
    for method in ("ngram", "self"):
        for strategy, shape in STRATEGIES.items():
            spec = SpecConfig(method=method, **shape)
            drafters = {"self": oracle} if method == "self" else {"ngram": NGramDrafter()}
            completions, stats = run(model, requests, spec=spec, drafters=drafters)
            assert_same_output(completions, reference, logprob_atol=0.0)
            assert_accounting(completions, stats)
            assert stats["accepted"] > 0, (method, strategy)
            assert stats["target_passes"] < plain_stats["target_passes"], (method, strategy)
            if method == "ngram":
                assert stats["drafted"] > stats["accepted"], strategy  # rejections happened: rollback ran
            else:
                assert stats["accepted"] == stats["drafted"], strategy  # the replay is always right


def sampling_params(rng: random.Random, i: int) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.3, 0.6, 1.0]),
        top_p=rng.choice([1.0, 0.9, 0.7]),
        top_k=rng.choice([0, 0, 5, 20]),
        seed=1000 + i,
        max_tokens=rng.randint(1, 28),
    )


def test_reproducible_mode_is_token_identical_to_plain_sampling(make_checkpoint) -> None:
    model = load_model(make_checkpoint("llama", seed=11), dtype=torch.float64)
    requests = repetitive_requests(96, seed=6, params=sampling_params)
    reference, _ = run(model, requests)
    oracle = OracleDrafter({c.request_id: c.prompt_ids + c.token_ids for c in reference})
    for method, shape in [
        ("ngram", STRATEGIES["chain3"]),
        ("ngram", STRATEGIES["tree"]),
        ("self", {"depth": 7}),
    ]:
        spec = SpecConfig(method=method, mode="reproducible", **shape)
        drafters = {"self": oracle} if method == "self" else {"ngram": NGramDrafter()}
        completions, stats = run(model, requests, spec=spec, drafters=drafters)
        # Log-probs come from float32 distributions of float64 logits computed in different batch shapes.
        assert_same_output(completions, reference, logprob_atol=1e-6)
        assert_accounting(completions, stats)
        sampled = [c for c, r in zip(completions, requests, strict=True) if not r.params.greedy]
        assert sum(c.accepted for c in sampled) > 0, method  # drafts were accepted on sampled rows too


class IntermittentDrafter(Drafter):
    """Cycles each request through three kinds of round: no draft, the recorded continuation (accepted
    whole), the continuation with its last token changed (rejected there, or at once for one token).

    Requests start the cycle at different rounds, so a batch's pass mixes all three kinds. `rounds` logs
    (position, kind) per request.
    """

    uses_hidden = False
    KINDS = ("empty", "replay", "junk")

    def __init__(self, recorded: dict[str, list[int]]) -> None:
        self.oracle = OracleDrafter(recorded)
        self.rounds: dict[Hashable, list[tuple[int, str]]] = {}
        self.start: dict[Hashable, int] = {}

    def propose(self, states: Sequence[DraftState], depth: int, topk: int, verify: int) -> list[Draft]:
        drafts = []
        for state in states:
            start = self.start.setdefault(state.request_id, len(self.start))
            log = self.rounds.setdefault(state.request_id, [])
            kind = self.KINDS[(start + len(log)) % 3]
            draft = Draft.empty()
            if kind != "empty":
                draft = self.oracle.propose([state], depth, topk, verify)[0]
                if kind == "junk" and len(draft) > 0:
                    tokens = draft.tokens.clone()
                    tokens[-1] = (tokens[-1] + 1) % VOCAB
                    draft = Draft.chain(tokens)
            log.append((state.position, kind if len(draft) > 0 else "empty"))
            drafts.append(draft)
        return drafts


def nongreedy_params(rng: random.Random, i: int) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.6, 1.0]),
        top_p=rng.choice([1.0, 0.9]),
        top_k=rng.choice([0, 20]),
        seed=2000 + i,
        max_tokens=rng.randint(12, 32),
    )


@pytest.mark.parametrize("count", [1, 24])
def test_reproducible_mode_keeps_noise_positions_across_empty_and_drafted_rounds(
    make_checkpoint, count: int
) -> None:
    """Sampling noise is keyed by (seed, position) alone: a request whose rounds alternate between no
    draft, an accepted draft and a rejected one still samples plain decoding's tokens."""
    model = load_model(make_checkpoint("llama", seed=11), dtype=torch.float64)
    requests = repetitive_requests(count, seed=8, params=nongreedy_params)
    reference, _ = run(model, requests)
    drafter = IntermittentDrafter({c.request_id: c.prompt_ids + c.token_ids for c in reference})
    spec = SpecConfig(method="self", mode="reproducible", depth=3)
    completions, stats = run(model, requests, spec=spec, drafters={"self": drafter})
    assert_same_output(completions, reference, logprob_atol=1e-6)
    assert_accounting(completions, stats)
    # Not vacuous: every request has drafts accepted after an empty round, and rejections happened.
    for c in completions:
        kinds = [kind for _, kind in drafter.rounds[c.request_id]]
        assert "empty" in kinds and "replay" in kinds[kinds.index("empty") + 1 :], (c.request_id, kinds)
        assert c.accepted > 0, c.request_id
    assert stats["drafted"] > stats["accepted"]


# ---------------------------------------------------------------------------------------------------------
# Rejection mode: a statistical test on an 8-token vocabulary.

SMALL = {"vocab_size": 8, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}
PROMPT = [3, 1, 4]
# top_p is chosen so the nucleus cuts tokens of this model's distributions: the test asserts that it forbids
# outcomes worth over 5% of the law of the same settings without top-p.
SETTINGS = {
    "top-k": SamplingParams(temperature=0.9, top_k=6),
    "top-p": SamplingParams(temperature=0.9, top_p=0.8),
    "top-p+top-k": SamplingParams(temperature=0.9, top_p=0.85, top_k=5),
}
# (draft shape, sampling settings, planted bug, samples per run). Samples: enough that each planted bug's
# statistic lands far above the critical value (the tree path verifies request by request, so it gets
# fewer to stay fast).
LAW_CASES = [
    ("chain", "top-k", "_residual", 4000),
    ("point_mass", "top-k", "_residual", 4000),
    ("tree", "top-k", "_without", 2500),
    ("chain", "top-p", "no_top_p", 4000),
    ("point_mass", "top-p+top-k", "no_top_p", 4000),
]
# Bonferroni: each case tests at ALPHA / len(LAW_CASES), so with correct speculation the cases together
# fail with probability at most ALPHA over the choice of seeds, however many cases there are.
LAW_ALPHA = ALPHA / len(LAW_CASES)


class SkewedDrafter(Drafter):
    """Drafts from a fixed distribution unlike the target's, with its own randomness keyed by the request.

    chain: tokens drawn i.i.d. from `probs`, reported as draft_probs (the min(1, q/p) test), or, with
    point_mass, its most likely tokens as a deterministic draft. tree: at each level `topk` distinct
    children drawn from `probs` under the first child (point masses for verify_tree).
    """

    uses_hidden = False

    def __init__(self, probs: torch.Tensor, shape: str) -> None:
        self.probs, self.shape = probs, shape

    def propose(self, states: Sequence[DraftState], depth: int, topk: int, verify: int) -> list[Draft]:
        drafts = []
        for state in states:
            g = torch.Generator().manual_seed(state.params.seed * 1009 + len(state.tokens))
            if self.shape == "point_mass":
                drafts.append(Draft.chain(self.probs.topk(depth).indices))
            elif self.shape == "chain":
                tokens = torch.multinomial(self.probs, depth, replacement=True, generator=g)
                drafts.append(Draft.chain(tokens, self.probs.expand(depth, -1)))
            else:
                tokens, parents, parent = [], [], -1
                for _ in range(depth):
                    children = torch.multinomial(self.probs, topk, replacement=False, generator=g).tolist()
                    tokens += children
                    parents += [parent] * topk
                    parent = len(tokens) - topk
                drafts.append(Draft(torch.tensor(tokens[:verify]), torch.tensor(parents[:verify])))
        return drafts


def exact_law(model: Transformer, params: SamplingParams) -> torch.Tensor:
    """P(t2, t3) [V * V] under plain sampling, from the model's processed distributions.

    t1 is sampled at the end of prefill, before a request has anything to draft from, so t2 and t3 are the
    first two tokens speculation produces; their law is marginalised over t1.
    """
    vocab = model.config.vocab_size
    pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # [V * V, 2]: (t1, t2)
    ids = torch.cat([torch.tensor(PROMPT).expand(vocab * vocab, -1), pairs], 1)
    with torch.no_grad():
        logits = model.forward_train(ids)[:, len(PROMPT) - 1 :]  # [V * V, 3, V]: after prompt, t1, t2
    temperature, top_p, top_k, _ = params_tensors([params] * (vocab * vocab * 3))
    q = processed_probs(logits.reshape(-1, vocab), temperature, top_p, top_k).double().view(-1, 3, vocab)
    joint = q[:, 0].gather(1, pairs[:, :1]) * q[:, 1].gather(1, pairs[:, 1:]) * q[:, 2]  # [(t1, t2), t3]
    return joint.view(vocab, vocab, vocab).sum(0).reshape(-1)


def speculative_law_samples(
    model: Transformer, drafter: Drafter, spec: SpecConfig, params: SamplingParams, n: int
) -> torch.Tensor:
    """[n] t2 * V + t3 of n requests decoded with speculation (distinct seeds, the same prompt)."""
    requests = [
        Request(request_id=str(i), prompt_ids=PROMPT, params=replace(params, seed=i, max_tokens=4))
        for i in range(n)
    ]
    gen = Generator(
        model, num_slots=64, token_budget=512, eos_token_ids=(), spec=spec, drafters={"eagle": drafter}
    )
    tokens = torch.tensor([c.token_ids[1:3] for c in gen.generate(requests)])  # [N, 2]
    stats = gen.stats
    assert 0 < stats["accepted"] < stats["drafted"]  # both acceptances and rejections were exercised
    return tokens[:, 0] * model.config.vocab_size + tokens[:, 1]


def plant(monkeypatch: pytest.MonkeyPatch, bug: str) -> None:
    """A bug the law test must catch."""
    if bug == "no_top_p":
        # The rejection-mode target ignores top-p: drafts are verified against the un-truncated law.
        def untruncated(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor) -> Tensor:
            return processed_probs(logits, temperature, torch.ones_like(top_p), top_k)

        monkeypatch.setattr(speculator, "processed_probs", untruncated)
    else:
        # After a rejection draw from q itself instead of the residual (chains), or keep the rejected
        # child in q (trees).
        monkeypatch.setattr(verify, bug, lambda q, *rest: q.clone())


@pytest.mark.parametrize(("shape", "setting", "bug", "n"), LAW_CASES)
def test_rejection_mode_has_the_law_of_plain_sampling(
    make_checkpoint, monkeypatch, shape: str, setting: str, bug: str, n: int
) -> None:
    model = load_model(make_checkpoint("llama", seed=2, **SMALL), dtype=torch.float64)
    params = SETTINGS[setting]
    exact = exact_law(model, params)
    without_top_p = exact if params.top_p == 1 else exact_law(model, replace(params, top_p=1.0))
    # Not vacuous: the nucleus forbids outcomes that the same settings without top-p give real mass.
    if params.top_p < 1:
        assert float(without_top_p[exact == 0].sum()) > 0.05, setting
    # The drafter favours what the target without top-p dislikes — the tokens the nucleus cuts: many
    # rejections, a large residual correction, and with top-p dropped from the target, forbidden outcomes.
    draft_probs = torch.softmax(-2 * without_top_p.view(8, 8).sum(0).clamp_min(1e-6).log(), 0).float()
    # "eagle" is the method that runs a model-based drafter handed in: here the skewed one.
    spec = SpecConfig(method="eagle", depth=2, topk=2 if shape == "tree" else 1, mode="rejection")

    samples = speculative_law_samples(model, SkewedDrafter(draft_probs, shape), spec, params, n)
    stat, dof = chi2_statistic(samples, exact)
    critical = chi2_critical(dof, LAW_ALPHA)
    assert stat < critical, f"lossless speculation failed the test: chi2 {stat:.1f} >= {critical:.1f}"

    # The same test must catch a planted bug; an outcome the exact law forbids rejects it outright.
    plant(monkeypatch, bug)
    samples = speculative_law_samples(model, SkewedDrafter(draft_probs, shape), spec, params, n)
    forbidden = int((exact[samples] == 0).sum())
    stat = chi2_statistic(samples, exact)[0] if forbidden == 0 else math.inf
    assert stat > critical, f"the test missed the planted bug: chi2 {stat:.1f} < {critical:.1f}"
