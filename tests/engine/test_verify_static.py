"""Fixed-shape verification (`verify_static`) against today's `verify_match`, `verify_chain`, `verify_tree`
and `verify_drafts`, and its capture safety.

Equality is bitwise (`torch.equal`, or exact list equality of the floats `Verified` holds): the static
functions run the same float operations on the same values. Batches are seeded: chains and random trees
with equal siblings, empty drafts, padding nodes and rows, ragged lengths, greedy / sampled / filtered
rows, draft_probs None and given. Draft tokens copy the target's own draw with high probability, so walks
go deep. Capture safety uses the FakeTensor harness of test_sample_static (and its planted failures).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from slipstream.engine import verify_static as vs
from slipstream.engine.sampling import SamplingParams, processed_probs, sample
from slipstream.engine.speculator import verify_drafts
from slipstream.engine.verify import PAD_TOKEN, Proposal, VerifyEntry, verify_chain, verify_match, verify_tree
from slipstream.engine.verify_static import (
    draw_static,
    emitted,
    match_walk,
    rejection_chain_static,
    rejection_tree_static,
    verify_static,
)
from tests.engine.test_sample_static import (
    HOST_READ_ERRORS,
    TEMPERATURES,
    TOP_P,
    fake_run,
    host_reads,
    op_trace,
    top_ks,
)


@dataclass
class Batch:
    """One verify pass in both layouts: today's entries over flat logits, and the static [B, N] tensors."""

    entries: list[VerifyEntry]
    flat_logits: torch.Tensor  # [rows, V]
    logits: torch.Tensor  # [B, N, V]
    tokens: torch.Tensor  # [B, N]
    parents: torch.Tensor  # [B, N]
    valid: torch.Tensor  # [B, N]
    depths: torch.Tensor  # [B, N]
    temperature: torch.Tensor  # [B]
    top_p: torch.Tensor
    top_k: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    chain: torch.Tensor  # [B] bool: Proposal.parents is None
    max_depth: int
    max_children: int
    filtered: bool

    def params(self) -> tuple[torch.Tensor, ...]:
        return self.temperature, self.top_p, self.top_k


def rand(g: torch.Generator) -> float:
    return float(torch.rand((), generator=g))


def randint(g: torch.Generator, lo: int, hi: int) -> int:
    """Uniform in [lo, hi]."""
    return int(torch.randint(lo, hi + 1, (), generator=g))


def random_parents(g: torch.Generator, n: int, kind: str) -> list[int]:
    """Draft-numbered parents (-1 = root) in topological order."""
    if kind == "chain":
        return list(range(-1, n - 1))
    return [-1 if i == 0 or rand(g) < 0.3 else randint(g, max(0, i - 3), i - 1) for i in range(n)]


def random_sampling_params(g: torch.Generator, vocab: int, greedy: bool) -> SamplingParams:
    if greedy:
        return SamplingParams(temperature=0.0, seed=randint(g, 0, 2**40))
    ks = top_ks(vocab)
    return SamplingParams(
        temperature=TEMPERATURES[randint(g, 1, len(TEMPERATURES) - 1)],
        top_p=TOP_P[randint(g, 0, len(TOP_P) - 1)],
        top_k=max(0, ks[randint(g, 0, len(ks) - 1)]),
        seed=randint(g, 0, 2**40),
    )


def make_batch(
    g: torch.Generator, b: int, vocab: int, max_nodes: int, *, kinds=("chain", "tree", "empty"), greedy=0.25
) -> Batch:
    """b entries (plus padding nodes to a common N); draft tokens copy the parent's draw 75% of the time
    and an earlier sibling's token 25% of the time (equal siblings)."""
    entries, blocks, shapes = [], [], []
    row = 0
    for _ in range(b):
        kind = kinds[randint(g, 0, len(kinds) - 1)]
        n = 0 if kind == "empty" else randint(g, 1, max_nodes)
        parents = random_parents(g, n, kind)
        params = random_sampling_params(g, vocab, rand(g) < greedy)
        position = randint(g, 1, 5000)
        logits = torch.randn(n + 1, vocab, generator=g) * (1.0, 3.0, 6.0)[randint(g, 0, 2)]
        if rand(g) < 0.3:
            logits = logits.round()  # ties
        pass_parents = [-1, *(p + 1 for p in parents)]
        depths = [0]
        for p in parents:
            depths.append(depths[p + 1] + 1)
        temperature, top_p, top_k, seed = (
            torch.tensor([x] * (n + 1)) for x in (params.temperature, params.top_p, params.top_k, params.seed)
        )
        drawn, _ = sample(logits, temperature, top_p, top_k, seed, position + torch.tensor(depths))
        tokens: list[int] = []
        for i, parent in enumerate(pass_parents[1:]):
            siblings = [tokens[j] for j in range(i) if pass_parents[j + 1] == parent]
            if siblings and rand(g) < 0.25:
                tokens.append(siblings[randint(g, 0, len(siblings) - 1)])
            elif rand(g) < 0.75:
                tokens.append(int(drawn[parent]))
            else:
                tokens.append(randint(g, 0, vocab - 1))
        proposal = Proposal(tokens, None if kind == "chain" else parents)
        entries.append(VerifyEntry(row, proposal, params, position))
        blocks.append(logits)
        shapes.append((pass_parents, depths, [randint(g, 0, vocab - 1), *tokens]))
        row += n + 1

    width = 1 + max(len(p) - 1 for p, _, _ in shapes)
    n_pad = [width - len(p) for p, _, _ in shapes]
    pad = [torch.randn(k, vocab, generator=g) for k in n_pad]  # padding logits: anything
    logits = torch.stack([torch.cat([x, y]) for x, y in zip(blocks, pad, strict=True)])

    def padded(values: list[list[int]], fill: int) -> torch.Tensor:
        return torch.tensor([v + [fill] * (width - len(v)) for v in values])

    parents_t = padded([p for p, _, _ in shapes], -1)
    depths_t = padded([d for _, d, _ in shapes], 0)
    counts = [max((list(p).count(j) for j in range(len(p))), default=0) for p, _, _ in shapes]
    return Batch(
        entries=entries,
        flat_logits=torch.cat(blocks),
        logits=logits,
        tokens=padded([t for _, _, t in shapes], 10**6),  # padding tokens out of range on purpose
        parents=parents_t,
        valid=padded([[1] * len(p) for p, _, _ in shapes], 0).bool(),
        depths=depths_t,
        temperature=torch.tensor([e.params.temperature for e in entries], dtype=torch.float32),
        top_p=torch.tensor([e.params.top_p for e in entries], dtype=torch.float32),
        top_k=torch.tensor([e.params.top_k for e in entries]),
        seeds=torch.tensor([e.params.seed for e in entries]),
        positions=torch.tensor([e.position for e in entries]),
        chain=torch.tensor([e.proposal.parents is None for e in entries]),
        max_depth=int(depths_t.max()),
        max_children=max(counts),
        filtered=any(
            not e.params.greedy and (e.params.top_p < 1 or 0 < e.params.top_k < vocab) for e in entries
        ),
    )


def assert_rows_equal(verified, path, accept_length, tokens, logprobs) -> None:
    """Static results [B, D+1] equal today's `Verified` per row, and are padded past accept_length."""
    for b, v in enumerate(verified):
        a = len(v.nodes) - 1
        assert int(accept_length[b]) == a, b
        assert path[b, : a + 1].tolist() == v.nodes and bool((path[b, a + 1 :] == v.nodes[-1]).all()), b
        assert tokens[b, : a + 1].tolist() == v.tokens and bool((tokens[b, a + 1 :] == PAD_TOKEN).all()), b
        assert torch.equal(logprobs[b, : a + 1], torch.tensor(v.logprobs, dtype=torch.float32)), b
        assert bool((logprobs[b, a + 1 :] == 0).all()), b


# ---------------------------------------------------------------------------------------------------------
# "match"


@pytest.mark.parametrize("vocab", [50, 130])
def test_draw_and_walk_are_verify_match(vocab):
    g = torch.Generator().manual_seed(vocab)
    deepest = 0
    for _ in range(20):
        batch = make_batch(g, 6, vocab, max_nodes=7)
        drawn, logprobs = draw_static(
            batch.logits, *batch.params(), batch.seeds, batch.positions, batch.depths, filtered=batch.filtered
        )
        path, accept_length = match_walk(batch.tokens, batch.parents, batch.valid, drawn, batch.max_depth)
        assert_rows_equal(
            verify_match(batch.flat_logits, batch.entries),
            path, accept_length, *emitted(path, accept_length, drawn, logprobs),
        )  # fmt: skip
        deepest = max(deepest, int(accept_length.max()))
    assert deepest >= 3, "walks too shallow to test"


def test_match_walk_takes_the_first_of_equal_siblings():
    # Root 0 has children 1, 2, 3; 2 and 3 carry the drawn token 5; 3 has a child carrying 7, 2 has none.
    parents = torch.tensor([[-1, 0, 0, 0, 3]])
    tokens = torch.tensor([[9, 4, 5, 5, 7]])
    drawn = torch.tensor([[5, 0, 1, 7, 2]])
    valid = torch.ones(1, 5, dtype=torch.bool)
    path, accept_length = match_walk(tokens, parents, valid, drawn, 2)
    assert path.tolist() == [[0, 2, 2]] and accept_length.tolist() == [1]


# ---------------------------------------------------------------------------------------------------------
# "rejection"


def chain_case(g: torch.Generator, b: int, k: int, vocab: int, with_draft_probs: bool):
    """Random chains: target probs with zeros (top-k), ragged lengths, drafts mostly plausible."""
    rows = b * (k + 1)
    temperature = torch.tensor(TEMPERATURES[1:])[torch.randint(3, (rows,), generator=g)]
    top_k = torch.tensor([0, 3, 10])[torch.randint(3, (rows,), generator=g)]
    top_p = torch.tensor([1.0, 0.8])[torch.randint(2, (rows,), generator=g)]
    logits = torch.randn(rows, vocab, generator=g) * 3
    target = processed_probs(logits, temperature, top_p, top_k).view(b, k + 1, vocab)
    likely = target[:, :k].argmax(-1)
    drafts = torch.where(
        torch.rand(b, k, generator=g) < 0.7, likely, torch.randint(vocab, (b, k), generator=g)
    )
    lengths = torch.randint(0, k + 1, (b,), generator=g)
    draft_probs = None
    if with_draft_probs:
        draft_probs = torch.softmax(torch.randn(b, k, vocab, generator=g) * 3, -1)
        # Row 0 drafts a token q gives no mass, with p == q: rejected, and its residual is empty.
        draft_probs[0] = target[0, :k]
        drafts[0, 0] = int(target[0, 0].argmin())
        lengths[0] = k
    seeds = torch.randint(0, 2**40, (b,), generator=g)
    positions = torch.randint(0, 5000, (b,), generator=g)
    return drafts, draft_probs, target, seeds, positions, lengths


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_rejection_chain_static_is_verify_chain(with_draft_probs):
    g = torch.Generator().manual_seed(int(with_draft_probs))
    accepted = 0
    for k, vocab in ((1, 70), (4, 130), (6, 64), (0, 50)):
        for _ in range(10):
            case = chain_case(g, 7, k, vocab, with_draft_probs and k > 0)
            expected = verify_chain(*case)
            accept_length, tokens, logprobs = rejection_chain_static(*case)
            assert torch.equal(accept_length, expected.accept_length)
            assert torch.equal(tokens, expected.tokens)
            assert torch.equal(logprobs, expected.logprobs)
            accepted += int(accept_length.sum())
    assert accepted > 20


def tree_case(g: torch.Generator, b: int, vocab: int, max_nodes: int):
    batch = make_batch(g, b, vocab, max_nodes, kinds=("tree", "tree", "empty"), greedy=0.0)
    probs = processed_probs(
        batch.logits.flatten(0, 1), *(x.repeat_interleave(batch.logits.shape[1]) for x in batch.params())
    )
    return batch, probs.view(batch.logits.shape)


@pytest.mark.parametrize("vocab", [40, 130])
def test_rejection_tree_static_is_verify_tree(vocab):
    g = torch.Generator().manual_seed(vocab + 3)
    deepest = 0
    for _ in range(16):
        batch, target = tree_case(g, 6, vocab, max_nodes=8)
        path, accept_length, tokens, logprobs = rejection_tree_static(
            batch.tokens, batch.parents, batch.valid, target, batch.seeds, batch.positions,
            batch.max_depth, batch.max_children,
        )  # fmt: skip
        for b, entry in enumerate(batch.entries):
            p = entry.proposal
            n = p.size
            expected = verify_tree(
                p.tokens, p.parents if p.parents is not None else [], target[b, : n + 1],
                entry.params.seed, entry.position,
            )  # fmt: skip
            a = expected.accept_length
            assert int(accept_length[b]) == a
            assert path[b, 1 : a + 1].tolist() == [x + 1 for x in expected.accepted.tolist()]
            assert torch.equal(tokens[b, : a + 1], expected.tokens)
            assert torch.equal(logprobs[b, : a + 1], expected.logprobs)
            assert bool((tokens[b, a + 1 :] == PAD_TOKEN).all())
        deepest = max(deepest, int(accept_length.max()))
    assert deepest >= 2, "walks too shallow to test"


def patched_tree(monkeypatch, root_q: dict[int, float], children: list[int]):
    """(verify_tree's result, rejection_tree_static's) for one root whose children carry `children`, with
    every keyed uniform patched to 1.0 (a value the hash can produce, rarely) in both implementations:
    then every child is rejected unless rounding decides otherwise."""
    from slipstream.engine import sample_static, sampling

    def ones(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return torch.ones(torch.broadcast_shapes(keys.shape, index.shape), dtype=torch.float64)

    for module in (sampling, sample_static, vs):
        monkeypatch.setattr(module, "_uniform_at", ones)
    n = len(children)
    target = torch.zeros(1, n + 1, 20)
    target[0, 0, list(root_q)] = torch.tensor(list(root_q.values()))
    target[0, 1:, 0] = 1.0
    expected = verify_tree(children, [-1] * n, target[0], seed=1, base_position=3)
    ours = rejection_tree_static(
        torch.tensor([[0, *children]]), torch.tensor([[-1] + [0] * n]), torch.ones(1, n + 1, dtype=torch.bool),
        target, torch.tensor([1]), torch.tensor([3]), 1, n,
    )  # fmt: skip
    return expected, ours


def test_rejection_tree_empty_residual_falls_back_to_q(monkeypatch):
    # All of q is on the children, so after rejecting both the residual is empty: both draw from q.
    expected, (_, accept_length, tokens, logprobs) = patched_tree(monkeypatch, {4: 0.5, 9: 0.5}, [9, 4])
    assert expected.accept_length == 0 and expected.tokens.tolist() == [4]
    assert accept_length.tolist() == [0] and tokens.tolist() == [[4, PAD_TOKEN]]
    assert torch.equal(logprobs[:, :1], expected.logprobs[None])


def test_rejection_tree_recomputes_rest_sum(monkeypatch):
    # After rejecting token 4 (mass 1), sum(rest) is 2**-59 recomputed but 0 by subtraction (1 + 2**-59
    # rounds to 1): only the recomputed sum rejects token 9 as `verify_tree` does.
    root_q = {4: 1.0, 9: 2.0**-60, 11: 2.0**-60}
    expected, (_, accept_length, tokens, logprobs) = patched_tree(monkeypatch, root_q, [4, 9])
    assert expected.accept_length == 0
    assert accept_length.tolist() == [0] and tokens[0, 0] == expected.tokens[0]
    assert torch.equal(logprobs[:, :1], expected.logprobs[None])


# ---------------------------------------------------------------------------------------------------------
# Routing: verify_static == speculator.verify_drafts


def draft_probs_for(batch: Batch, g: torch.Generator, vocab: int) -> torch.Tensor | None:
    """Give about half the chains a draft distribution; the others get point masses (`stack_chains`)."""
    n = batch.logits.shape[1] - 1
    probs = torch.zeros(len(batch.entries), n, vocab)
    given = False
    for b, entry in enumerate(batch.entries):
        p = entry.proposal
        if p.parents is not None or p.size == 0:
            continue
        if rand(g) < 0.5:
            p.draft_probs = torch.softmax(torch.randn(p.size, vocab, generator=g) * 2, -1)
            probs[b, : p.size] = p.draft_probs
            given = True
        else:
            probs[b, torch.arange(p.size), torch.tensor(p.tokens)] = 1.0
    return probs if given else None


@pytest.mark.parametrize("mode", ["rejection", "reproducible"])
def test_verify_static_is_verify_drafts(mode):
    g = torch.Generator().manual_seed(11 if mode == "rejection" else 12)
    vocab = 90
    for _ in range(15):
        batch = make_batch(g, 7, vocab, max_nodes=6)
        draft_probs = draft_probs_for(batch, g, vocab)
        rejection = torch.tensor(
            [mode == "rejection" and e.proposal.size > 0 and not e.params.greedy for e in batch.entries]
        )
        out = verify_static(
            batch.logits, batch.tokens, batch.parents, batch.valid, batch.depths, *batch.params(),
            batch.seeds, batch.positions, rejection, batch.chain, draft_probs,
            max_depth=batch.max_depth, max_children=batch.max_children, filtered=batch.filtered,
        )  # fmt: skip
        assert_rows_equal(verify_drafts(batch.flat_logits, batch.entries, mode), *out)


# ---------------------------------------------------------------------------------------------------------
# Capture safety


def small_batch(seed: int) -> Batch:
    return make_batch(torch.Generator().manual_seed(seed), 4, 70, max_nodes=5, kinds=("chain", "tree"))


def run_all(batch: Batch, target: torch.Tensor) -> None:
    """Every public function once, on whatever tensors (real or fake) `batch` and `target` hold."""
    drawn, logprobs = draw_static(
        batch.logits, *batch.params(), batch.seeds, batch.positions, batch.depths, filtered=True
    )
    path, accept_length = match_walk(batch.tokens, batch.parents, batch.valid, drawn, batch.max_depth)
    emitted(path, accept_length, drawn, logprobs)
    k = batch.tokens.shape[1] - 1
    lengths = batch.valid[:, 1:].sum(-1)
    for draft_probs in (None, target[:, :k]):
        rejection_chain_static(
            batch.tokens[:, 1:], draft_probs, target, batch.seeds, batch.positions, lengths
        )
    rejection_tree_static(
        batch.tokens, batch.parents, batch.valid, target, batch.seeds, batch.positions, batch.max_depth,
        batch.max_children,
    )  # fmt: skip
    verify_static(
        batch.logits, batch.tokens, batch.parents, batch.valid, batch.depths, *batch.params(), batch.seeds,
        batch.positions, batch.temperature > 0, batch.chain, None, max_depth=batch.max_depth,
        max_children=batch.max_children, filtered=True,
    )  # fmt: skip


def fake_batch_run(batch: Batch) -> None:
    target = torch.softmax(batch.logits, -1)
    tensors = {name: value for name, value in vars(batch).items() if isinstance(value, torch.Tensor)}

    def with_tensors(target: torch.Tensor, *values: torch.Tensor) -> None:
        fields = dict(vars(batch), **dict(zip(tensors, values, strict=True)))
        run_all(Batch(**fields), target)

    fake_run(with_tensors, target, *tensors.values())


def test_verify_functions_run_on_fake_tensors():
    fake_batch_run(small_batch(0))


@pytest.mark.parametrize("plant", ["nonzero", "item"])
def test_fake_harness_catches_planted_host_reads(monkeypatch, plant):
    inner = vs._row_at

    def leaky(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        at.nonzero() if plant == "nonzero" else at.max().item()
        return inner(x, at)

    monkeypatch.setattr(vs, "_row_at", leaky)
    with pytest.raises(HOST_READ_ERRORS):
        fake_batch_run(small_batch(0))


def test_fake_harness_catches_todays_verify_chain():
    case = chain_case(torch.Generator().manual_seed(0), 3, 3, 40, False)
    with pytest.raises(HOST_READ_ERRORS):
        fake_run(verify_chain, *case)


def test_op_trace_does_not_depend_on_data():
    # Same shapes and static arguments, different data (structure included: a chain in every row).
    first = small_batch(0)
    g = torch.Generator().manual_seed(9)
    b, n, vocab = first.logits.shape
    second = replace(
        first,
        logits=torch.randn(b, n, vocab, generator=g),
        tokens=torch.randint(vocab, (b, n), generator=g),
        parents=torch.arange(-1, n - 1).expand(b, n).clone(),
        valid=torch.ones(b, n, dtype=torch.bool),
        depths=torch.arange(n).expand(b, n).clone(),
        temperature=torch.tensor(TEMPERATURES)[torch.randint(4, (b,), generator=g)],
        seeds=torch.randint(0, 2**40, (b,), generator=g),
        positions=torch.randint(0, 5000, (b,), generator=g),
        chain=~first.chain,
    )
    traces = [op_trace(run_all, batch, torch.softmax(batch.logits, -1)) for batch in (first, second)]
    assert traces[0] == traces[1]


def test_source_has_no_host_reads():
    assert host_reads(vs) == []
