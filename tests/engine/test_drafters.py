"""Drafters and draft trees: tree masks and EAGLE-2 construction, the n-gram and oracle drafters."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from slipstream.engine.drafters import (
    Draft,
    Drafter,
    DraftState,
    HybridDrafter,
    NGramDrafter,
    OracleDrafter,
    stack_chains,
)
from slipstream.engine.sampling import SamplingParams, keyed_exponential, sample
from slipstream.engine.tree import (
    build_tree,
    chain_parents,
    path_to,
    tree_attention_mask,
    tree_depths,
    tree_positions,
)
from slipstream.engine.verify import Proposal, VerifyEntry, verify_match

PARAMS = SamplingParams()


def on(device: torch.device, *tensors: torch.Tensor) -> bool:
    """Every tensor is on `device`'s kind ("cuda" names no index; a tensor's device is "cuda:0")."""
    return all(t.device.type == device.type for t in tensors)


def state(rid, gid, tokens, prompt_len, params=PARAMS) -> DraftState:
    return DraftState(request_id=rid, group_id=gid, tokens=tokens, prompt_len=prompt_len, params=params)


# ---------------------------------------------------------------------------------------------------------
# Trees


def test_tree_attention_mask_depths_positions(device):
    # root → 0 → {1, 2}; root → 3; 2 → 4
    parents = torch.tensor([-1, 0, 0, -1, 2], device=device)
    mask = tree_attention_mask(parents)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 0, 1, 0, 0],
            [0, 0, 0, 1, 0],
            [1, 0, 1, 0, 1],
        ],
        dtype=torch.bool,
        device=device,
    )
    assert torch.equal(mask, expected)
    assert torch.equal(tree_attention_mask(parents, depth=2), expected)  # the known depth: no host reads
    assert tree_depths(parents).tolist() == [0, 1, 1, 0, 2]
    assert tree_positions(parents, 10).tolist() == [10, 11, 11, 10, 12]
    assert path_to(parents, 4) == [0, 2, 4] and path_to(parents, 3) == [3]


def test_chain_is_a_tree_with_causal_mask():
    parents = chain_parents(5)
    assert parents.tolist() == [-1, 0, 1, 2, 3]
    assert torch.equal(tree_attention_mask(parents), torch.ones(5, 5, dtype=torch.bool).tril())
    assert (
        Draft.chain([4, 5, 6]).is_chain and not Draft(torch.tensor([1, 2]), torch.tensor([-1, -1])).is_chain
    )


class MarkovExpand:
    """Draft log-probs of the next token given the previous one (the root's previous token is 0)."""

    def __init__(self, vocab: int = 12, seed: int = 0, device: torch.device | str = "cpu"):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.log_softmax(torch.randn(vocab, vocab, generator=g) * 2, -1).to(device)
        self.frontiers: list[list[int]] = []

    def __call__(self, tokens, parents, frontier):
        assert tokens.device == parents.device == frontier.device
        self.frontiers.append(frontier.tolist())
        prev = torch.tensor([0 if f < 0 else int(tokens[f]) for f in frontier.tolist()], device=tokens.device)
        return self.table[prev]


def path_score(table, tokens, parents, node):
    prev, total = 0, 0.0
    for i in path_to(parents, node):
        total += float(table[prev, tokens[i]])
        prev = int(tokens[i])
    return total


def test_build_tree_eagle2():
    expand = MarkovExpand()
    tree = build_tree(expand, depth=4, topk=3, verify=10)
    n = len(tree)
    assert n == 10
    assert all(int(p) < i for i, p in enumerate(tree.parents.tolist()))  # topological
    # Expansions: the root, then the 3 best nodes of each level.
    assert [len(f) for f in expand.frontiers] == [1, 3, 3, 3]
    for i in range(n):
        assert tree.scores[i].item() == pytest.approx(
            path_score(expand.table, tree.tokens, tree.parents, i), abs=1e-5
        )
    # Siblings are distinct tokens; no node has more than topk children.
    for p in set(tree.parents.tolist()):
        kids = tree.tokens[tree.parents == p].tolist()
        assert len(kids) == len(set(kids)) <= 3
    # The kept nodes are the 10 best candidates: nothing left out scores above the worst kept node.
    big = build_tree(MarkovExpand(), depth=4, topk=3, verify=10_000)
    kth = tree.scores.min().item()
    assert int((big.scores > kth + 1e-6).sum()) <= n
    assert torch.equal(tree.depths, tree_depths(tree.parents))


def test_build_tree_topk1_is_the_greedy_chain():
    expand = MarkovExpand()
    tree = build_tree(expand, depth=5, topk=1, verify=8)
    assert torch.equal(tree.parents, chain_parents(5))
    prev = 0
    for tok in tree.tokens.tolist():
        assert tok == int(expand.table[prev].argmax())
        prev = tok


def test_built_tree_verifies_losslessly_in_match_mode():
    """A tree built by one Markov model, verified against another: the emitted path is plain decoding's."""
    draft, target = MarkovExpand(seed=1), MarkovExpand(seed=2)
    tree = build_tree(draft, depth=3, topk=2, verify=6)
    prev = torch.cat([torch.tensor([0]), tree.tokens])
    proposal = Proposal(tree.tokens.tolist(), tree.parents.tolist())
    (res,) = verify_match(target.table[prev], [VerifyEntry(0, proposal, SamplingParams(seed=9), 5)])
    ctx = 0
    for j, tok in enumerate(res.tokens):
        plain, _ = sample(target.table[ctx][None], torch.ones(1), torch.ones(1), torch.zeros(1, dtype=torch.int64),
                          torch.tensor([9]), torch.tensor([5 + j]))  # fmt: skip
        assert tok == int(plain[0])
        ctx = tok


def test_trees_and_drafts_are_made_on_the_device(device):
    """build_tree keeps its candidates where the drafter's log-probs are; the n-gram and oracle drafters
    and stack_chains make their tensors on the device they are given."""
    tree = build_tree(MarkovExpand(device=device), depth=3, topk=2, verify=6, device=device)
    cpu_tree = build_tree(MarkovExpand(), depth=3, topk=2, verify=6)
    assert on(device, tree.tokens, tree.parents, tree.scores)
    assert (
        tree.tokens.tolist() == cpu_tree.tokens.tolist()
        and tree.parents.tolist() == cpu_tree.parents.tolist()
    )
    drafter = NGramDrafter(min_n=2, max_n=3, device=device)
    drafter.observe(state("a", 0, [*PROMPT, 1, 2, 3, 4, 5, 6, 7], 4))
    chain, tree_draft, none = (
        drafter.propose([state("b", 0, [*PROMPT, 9, 1, 2], 4)], depth=3, topk=1, verify=8)[0],
        drafter.propose([state("c", 0, [*PROMPT, 9, 1, 2], 4)], depth=3, topk=2, verify=8)[0],
        drafter.propose([state("d", 1, [7, 7, 1, 2], 2)], depth=3, topk=1, verify=8)[0],
    )
    assert chain.tokens.tolist() == [3, 4, 5] and chain.is_chain and len(none) == 0
    assert all(on(device, d.tokens, d.parents) for d in (chain, tree_draft, none))
    (replay,) = OracleDrafter({"r": [1, 2, 3, 4]}, device=device).propose([state("r", 0, [1, 2], 1)], 2, 1, 2)
    assert on(device, replay.tokens) and replay.tokens.tolist() == [3, 4]
    p = torch.full((1, 5), 0.2, device=device)
    tokens, lengths, probs = stack_chains(
        [Draft.chain([1], p), Draft.chain([4], device=device)], device=device
    )
    assert on(device, tokens, lengths, probs)
    assert probs[1, 0].tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]


def test_build_tree_validation():
    with pytest.raises(ValueError, match="verify"):
        build_tree(MarkovExpand(), depth=2, topk=2, verify=0)


# ---------------------------------------------------------------------------------------------------------
# Draft / stack_chains


def test_draft_validation_and_stack_chains():
    with pytest.raises(ValueError, match="parents"):
        Draft(torch.tensor([1, 2]), torch.tensor([-1]))
    with pytest.raises(ValueError, match="draft_probs"):
        Draft.chain([1, 2], torch.ones(3, 5))
    p = torch.full((2, 5), 0.2)
    tokens, lengths, probs = stack_chains([Draft.chain([1, 2], p), Draft.chain([4]), Draft.empty()])
    assert tokens.tolist() == [[1, 2], [4, 0], [0, 0]] and lengths.tolist() == [2, 1, 0]
    assert probs.shape == (3, 2, 5) and torch.equal(probs[1, 0], torch.eye(5)[4])
    assert stack_chains([Draft.chain([3])])[2] is None
    with pytest.raises(ValueError, match="chain"):
        stack_chains([Draft(torch.tensor([1, 2]), torch.tensor([-1, -1]))])


# ---------------------------------------------------------------------------------------------------------
# n-gram drafter

PROMPT = [50, 51, 52, 53]


def test_ngram_proposes_a_siblings_continuation():
    drafter = NGramDrafter(min_n=2, max_n=3)
    # Sibling A has decoded "1 2 3 4 5 6 7"; sibling B has just produced "1 2".
    drafter.observe(state("a", 0, [*PROMPT, 1, 2, 3, 4, 5, 6, 7], 4))
    (draft,) = drafter.propose([state("b", 0, [*PROMPT, 9, 1, 2], 4)], depth=4, topk=1, verify=8)
    assert draft.tokens.tolist() == [3, 4, 5, 6] and draft.is_chain and draft.draft_probs is None
    # The prompt is a source too: a response that repeats the prompt's start continues it.
    (draft,) = drafter.propose([state("c", 0, [*PROMPT, 50, 51], 4)], depth=3, topk=1, verify=8)
    assert draft.tokens.tolist() == [52, 53, 1]
    # Another group does not see group 0.
    (draft,) = drafter.propose([state("d", 1, [7, 7, 1, 2], 2)], depth=3, topk=1, verify=8)
    assert len(draft) == 0


class _Recording(Drafter):
    """A stand-in head that drafts [99] and records which requests it was asked about."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def propose(self, states, depth, topk, verify):
        self.asked += [s.request_id for s in states]
        return [Draft.chain([99] * min(depth, verify)) for _ in states]


def test_hybrid_asks_the_head_only_where_the_ngram_tables_have_no_match():
    ngram, head = NGramDrafter(min_n=2, max_n=3), _Recording()
    ngram.observe(state("a", 0, [*PROMPT, 1, 2, 3, 4, 5], 4))
    hybrid = HybridDrafter(ngram, head)
    drafts = hybrid.propose(
        [state("b", 0, [*PROMPT, 9, 1, 2], 4), state("c", 0, [*PROMPT, 8, 8], 4)], depth=2, topk=1, verify=8
    )
    assert [d.tokens.tolist() for d in drafts] == [[3, 4], [99, 99]]
    assert head.asked == ["c"]


def test_ngram_keyed_chain_follows_the_race_where_siblings_diverge():
    """Three siblings continued "1 2" with 3 (twice) and 4 (once). A keyed sampled row takes the branch
    minimising E / count under its own noise at that position, so across seeds it follows 4 about a third of
    the time (the counts' share), where the unkeyed chain always follows the majority."""
    drafter = NGramDrafter(min_n=2, max_n=2)
    for rid, cont in (("a", [3, 5]), ("b", [3, 5]), ("c", [4, 6])):
        drafter.observe(state(rid, 0, [*PROMPT, 1, 2, *cont], 4))
    picks = []
    for seed in range(300):
        params = SamplingParams(temperature=0.7, seed=seed)
        query = replace(state(f"q{seed}", 0, [*PROMPT, 9, 1, 2], 4, params), keyed=True)
        (draft,) = drafter.propose([query], depth=2, topk=1, verify=8)
        first = (
            3
            if keyed_exponential(seed, query.position, 3) / 2 < keyed_exponential(seed, query.position, 4)
            else 4
        )
        assert draft.tokens.tolist() == [first, 5 if first == 3 else 6]
        picks.append(first)
        drafter.reset(f"q{seed}")
    assert 0.2 < picks.count(4) / len(picks) < 0.45
    (draft,) = drafter.propose([state("u", 0, [*PROMPT, 9, 1, 2], 4)], depth=2, topk=1, verify=8)
    assert draft.tokens.tolist() == [3, 5]


def test_ngram_no_match_is_no_proposal():
    drafter = NGramDrafter()
    (draft,) = drafter.propose([state("a", 0, [*PROMPT, 1, 2, 3], 4)], depth=4, topk=2, verify=8)
    assert len(draft) == 0


def test_ngram_longest_match_wins_and_topk_builds_a_tree():
    drafter = NGramDrafter(min_n=1, max_n=3)
    drafter.observe(state("a", 0, [*PROMPT, 8, 1, 2, 3, 4], 4))
    drafter.observe(state("b", 0, [*PROMPT, 9, 1, 2, 5, 6], 4))
    drafter.observe(state("c", 0, [*PROMPT, 9, 1, 2, 5, 7], 4))
    # "9 1 2" matches b and c only (3-gram): continuations 5 6 / 5 7.
    (chain,) = drafter.propose([state("d", 0, [*PROMPT, 9, 1, 2], 4)], depth=2, topk=1, verify=8)
    assert chain.tokens.tolist() == [5, 7]  # count tie at depth 1: the most recent
    # "1 2" with a fresh prefix matches all three (2-gram): 5 twice, 3 once.
    (tree,) = drafter.propose([state("e", 0, [*PROMPT, 0, 1, 2], 4)], depth=2, topk=2, verify=5)
    assert tree.tokens.tolist()[:2] == [5, 3]
    assert tree.parents.tolist()[:2] == [-1, -1]
    assert len(tree) == 5 and sorted(tree.tokens.tolist()[2:]) == [4, 6, 7]
    assert all(int(p) < i for i, p in enumerate(tree.parents.tolist()))
    (small,) = drafter.propose([state("e", 0, [*PROMPT, 0, 1, 2], 4)], depth=2, topk=2, verify=2)
    assert small.tokens.tolist() == [5, 3]


def test_ngram_updates_incrementally():
    drafter = NGramDrafter(min_n=2, max_n=4)
    history = [*PROMPT, 1, 2, 3]
    drafter.observe(state("a", 0, list(history), 4))
    group = drafter._groups[0]
    entries = sum(len(v) for v in group.index.values())
    history += [4, 5]
    drafter.observe(state("a", 0, list(history), 4))
    # Two new tokens add one entry per n each (3 sizes), nothing is re-indexed.
    assert sum(len(v) for v in group.index.values()) == entries + 2 * 3
    # A sibling indexes only its response: its prompt is already there.
    drafter.observe(state("b", 0, [*PROMPT, 9], 4))
    assert sum(len(v) for v in group.index.values()) == entries + 2 * 3 + 3
    # Tensor histories work too; the tokens just accepted are immediately usable.
    (draft,) = drafter.propose(
        [state("b", 0, torch.tensor([*PROMPT, 9, 3, 4]), 4)], depth=2, topk=1, verify=4
    )
    assert draft.tokens.tolist() == [5]


def test_ngram_reset_keeps_siblings_tables_and_reset_group_drops_them():
    drafter = NGramDrafter()
    drafter.observe(state("a", 0, [*PROMPT, 1, 2, 3], 4))
    drafter.reset("a")
    (draft,) = drafter.propose([state("b", 0, [*PROMPT, 1, 2], 4)], depth=2, topk=1, verify=4)
    assert draft.tokens.tolist() == [3]
    drafter.reset_group(0)
    assert 0 not in drafter._groups and "b" not in drafter._requests
    with pytest.raises(ValueError, match="max_n"):
        NGramDrafter(min_n=3, max_n=2)


# ---------------------------------------------------------------------------------------------------------
# Oracle drafter


def test_oracle_replays_the_recording():
    oracle = OracleDrafter({"r": [1, 2, 3, 4, 5, 6]})
    (d,) = oracle.propose([state("r", 0, [1, 2], 1)], depth=3, topk=4, verify=10)
    assert d.tokens.tolist() == [3, 4, 5] and d.is_chain
    (d,) = oracle.propose([state("r", 0, [1, 2, 3, 4, 5], 1)], depth=3, topk=1, verify=10)
    assert d.tokens.tolist() == [6]
    for history in ([1, 9], [1, 2, 3, 4, 5, 6]):  # diverged; finished
        assert len(oracle.propose([state("r", 0, history, 1)], 3, 1, 10)[0]) == 0
    assert len(oracle.propose([state("unknown", 0, [1], 1)], 3, 1, 10)[0]) == 0


def test_oracle_drafts_are_all_accepted_in_match_mode():
    """Record plain decoding of a Markov model, replay it: every draft is accepted, output identical."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(30, 30, generator=g) * 2
    t, tp, tk, seed = torch.ones(1), torch.tensor([0.9]), torch.zeros(1, dtype=torch.int64), torch.tensor([4])
    prompt = [0]
    seq = list(prompt)
    for pos in range(len(prompt), 25):
        tok, _ = sample(logits[seq[-1]][None], t, tp, tk, seed, torch.tensor([pos]))
        seq.append(int(tok))
    oracle = OracleDrafter({"r": torch.tensor(seq)})
    out = list(prompt)
    while len(out) < len(seq):
        (d,) = oracle.propose([state("r", 0, out, 1)], depth=4, topk=1, verify=4)
        k = len(d)
        chain = torch.tensor([out[-1], *d.tokens.tolist()])
        params = SamplingParams(top_p=0.9, seed=4)
        (res,) = verify_match(
            logits[chain], [VerifyEntry(0, Proposal(d.tokens.tolist(), None), params, len(out))]
        )
        assert len(res.tokens) == k + 1
        out += res.tokens
    assert out[: len(seq)] == seq
