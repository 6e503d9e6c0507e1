"""Speculative verification: hand-computed cases, statistical losslessness, and reproducibility.

`verify_match` is the one reproducible ("match") verifier: the engine's, tested here on its own.
`verify_chain` / `verify_tree` are rejection sampling. Statistical tests: a chi-square goodness-of-fit
test at false-alarm rate ALPHA = 1e-3 (critical value from the chi-square quantile, `chi2_critical`), on a
Markov "model" over a small vocabulary where the target Q and the draft P differ. Every such test also runs
a planted bug through the same check and asserts that the check rejects it, so a pass is evidence, not a
blind spot. Seeds are fixed: the tests are deterministic. Hand cases run on every `device`.
"""

from __future__ import annotations

import pytest
import torch

from slipstream.engine import verify
from slipstream.engine.sampling import SamplingParams, processed_probs, race_sample, sample
from slipstream.engine.verify import (
    PAD_TOKEN,
    Proposal,
    VerifyEntry,
    verify_chain,
    verify_match,
    verify_tree,
)
from tests.engine.test_sampling import chi2_critical, chi2_statistic

V = 6
GREEDY = SamplingParams(temperature=0.0)


def one_hot_rows(tokens: list[int], vocab: int = 8, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens, device=device), vocab).float()


def match_chains(
    logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams], positions: list[int]
) -> list[verify.Verified]:
    """verify_match over chains whose logit rows are stacked [sum(len + 1), V] in order."""
    entries, row = [], 0
    for tokens, p, position in zip(drafts, params, positions, strict=True):
        entries.append(VerifyEntry(row, Proposal(tokens, None), p, position))
        row += len(tokens) + 1
    return verify_match(logits, entries)


# ---------------------------------------------------------------------------------------------------------
# Hand-computed cases


def test_greedy_chain_accepts_the_argmax_prefix(device):
    # Target argmax after each prefix: 1, 2, 5, 6. Draft 1, 2, 3: two accepted, then 5.
    target = one_hot_rows([1, 2, 5, 6], device=device)  # [4, 8]
    out = verify_chain(
        torch.tensor([[1, 2, 3]], device=device), None, target[None], torch.tensor([0], device=device),
        torch.tensor([10], device=device),
    )  # fmt: skip
    assert out.tokens.device == target.device and out.logprobs.device == target.device
    assert out.accept_length.tolist() == [2] and out.num_emitted.tolist() == [3]
    assert out.tokens.tolist() == [[1, 2, 5, PAD_TOKEN]]
    assert out.logprobs.tolist() == [[0.0, 0.0, 0.0, 0.0]]
    (res,) = match_chains(target, [[1, 2, 3]], [GREEDY], [10])  # the same rows as logits
    assert res.tokens == [1, 2, 5] and res.nodes == [0, 1, 2] and res.logprobs == [0.0, 0.0, 0.0]


def test_greedy_chain_full_acceptance_emits_bonus_and_ragged_lengths(device):
    target = torch.stack([one_hot_rows([1, 2, 5, 6]), one_hot_rows([4, 4, 4, 4])]).to(device)  # [2, 4, 8]
    out = verify_chain(
        torch.tensor([[1, 2, 5], [4, 0, 0]], device=device), None, target,
        torch.tensor([0, 1], device=device), torch.tensor([3, 3], device=device),
        draft_lengths=torch.tensor([3, 1], device=device),
    )  # fmt: skip
    assert out.accept_length.tolist() == [3, 1]
    assert out.tokens.tolist() == [[1, 2, 5, 6], [4, 4, PAD_TOKEN, PAD_TOKEN]]
    logits = torch.cat([target[0], target[1, :2]])  # chain 2 has one draft token: two rows
    first, second = match_chains(logits, [[1, 2, 5], [4]], [GREEDY, GREEDY], [3, 3])
    assert first.tokens == [1, 2, 5, 6] and first.nodes == [0, 1, 2, 3]
    assert second.tokens == [4, 4] and second.nodes == [0, 1]


def test_rejection_point_mass_hand_case(device):
    # q0 is sure of the draft (accepted); q1 gives the draft 0 (rejected); the residual is q1 itself.
    q = torch.zeros(1, 3, 8, device=device)
    q[0, 0, 3] = 1.0
    q[0, 1, 4] = q[0, 1, 5] = 0.5
    q[0, 2, 0] = 1.0
    out = verify_chain(
        torch.tensor([[3, 7]], device=device), None, q, torch.tensor([5], device=device),
        torch.tensor([0], device=device),
    )  # fmt: skip
    assert out.accept_length.item() == 1 and out.tokens[0, 0] == 3 and out.tokens[0, 1].item() in (4, 5)
    assert out.logprobs[0, 1].item() == pytest.approx(torch.tensor(0.5).log().item())


def test_rejection_equal_distributions_always_accept():
    torch.manual_seed(0)
    q = torch.softmax(torch.randn(64, 4, 8), -1)
    drafts = torch.randint(0, 8, (64, 3))
    out = verify_chain(drafts, q[:, :3], q, torch.arange(64), torch.zeros(64, dtype=torch.int64))
    assert (out.accept_length == 3).all()
    torch.testing.assert_close(out.logprobs, q.gather(2, out.tokens[..., None])[..., 0].log())


def test_match_is_the_target_draw(device):
    """Each emitted token is sample()'s draw at the same (seed, position) with the entry's params, and the
    deeper draws happen only under a surviving first token."""
    torch.manual_seed(1)
    logits = (torch.randn(15, 40) * 2).to(device)  # 3 chains of 4 drafts: rows 0-4, 5-9, 10-14
    params = [SamplingParams(seed=4), SamplingParams(seed=5, top_p=0.9), SamplingParams(seed=6, top_k=7)]
    positions = [7, 0, 100]
    plain = []
    for b, (p, pos) in enumerate(zip(params, positions, strict=True)):
        rows = logits[5 * b : 5 * b + 5]
        t, tp, tk = (torch.tensor([x] * 5, device=device) for x in (p.temperature, p.top_p, p.top_k))
        seeds = torch.full((5,), p.seed, device=device)
        tokens, _ = sample(rows, t, tp, tk, seeds, torch.arange(pos, pos + 5, device=device))
        plain.append(tokens.tolist())
    drafts = [list(plain[0][:4]), list(plain[1][:4]), [(plain[2][0] + 1) % 40, *plain[2][1:4]]]
    drafts[1][2] = (drafts[1][2] + 1) % 40  # chain 1 diverges at index 2; chain 2 at once
    res = match_chains(logits, drafts, params, positions)
    assert [r.nodes for r in res] == [[0, 1, 2, 3, 4], [0, 1, 2], [0]]
    assert res[0].tokens == plain[0] and res[1].tokens == plain[1][:3] and res[2].tokens == plain[2][:1]
    probs = torch.softmax(logits[0].double(), -1)
    assert res[0].logprobs[0] == pytest.approx(float(probs[plain[0][0]].log()), abs=1e-5)


def test_tree_hand_case_greedy(device):
    # root → {7 (node 0), 2 (node 1)}; node 1 → {3 (node 2), 4 (node 3)}; node 3 → {1 (node 4)}.
    tokens, parents = [7, 2, 3, 4, 1], [-1, -1, 1, 1, 3]
    # argmax at the root, after each node: root→2, after node 1 → 4, after node 3 → 0 (no child 0).
    target = one_hot_rows([2, 0, 4, 0, 0, 6], device=device)
    out = verify_tree(torch.tensor(tokens), torch.tensor(parents), target, seed=3, base_position=20)
    assert out.accepted.tolist() == [1, 3] and out.accept_length == 2 and out.tokens.device == target.device
    assert out.tokens.tolist() == [2, 4, 0] and out.logprobs.tolist() == [0.0, 0.0, 0.0]
    (res,) = verify_match(target, [VerifyEntry(0, Proposal(tokens, parents), GREEDY, 20)])
    assert res.nodes == [0, 2, 4] and res.tokens == [2, 4, 0]
    # The full path accepted: a bonus token after the leaf.
    target[3 + 1] = one_hot_rows([1], device=device)[0]
    out = verify_tree(tokens, parents, target, seed=3, base_position=20)
    assert out.accepted.tolist() == [1, 3, 4] and out.tokens.tolist() == [2, 4, 1, 6]
    (res,) = verify_match(target, [VerifyEntry(0, Proposal(tokens, parents), GREEDY, 20)])
    assert res.nodes == [0, 2, 4, 5] and res.tokens == [2, 4, 1, 6]


def test_errors_name_the_problem():
    q = torch.full((1, 3, 4), 0.25)
    with pytest.raises(ValueError, match="target_probs"):
        verify_chain(torch.zeros(1, 3, dtype=torch.int64), None, q, torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="draft_lengths"):
        verify_chain(
            torch.zeros(1, 2, dtype=torch.int64), None, q, torch.tensor([0]), torch.tensor([0]),
            draft_lengths=torch.tensor([3]),
        )  # fmt: skip
    with pytest.raises(ValueError, match="parents"):
        verify_tree(torch.tensor([1, 2]), torch.tensor([-1]), q[0], 0, 0)


# ---------------------------------------------------------------------------------------------------------
# Statistical losslessness on a Markov model: q(next | prev) = Q[prev], draft p(next | prev) = P[prev].

Q = torch.tensor(
    [
        [0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
        [0.05, 0.05, 0.40, 0.10, 0.20, 0.20],
        [0.50, 0.10, 0.10, 0.10, 0.10, 0.10],
        [0.10, 0.20, 0.30, 0.20, 0.10, 0.10],
        [0.00, 0.00, 0.00, 0.50, 0.25, 0.25],
        [0.16, 0.16, 0.16, 0.16, 0.16, 0.20],
    ]
)
P = torch.tensor(
    [
        [0.10, 0.10, 0.50, 0.10, 0.10, 0.10],
        [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
        [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
        [0.05, 0.05, 0.05, 0.05, 0.40, 0.40],
        [0.40, 0.10, 0.10, 0.10, 0.20, 0.10],
        [0.16, 0.16, 0.16, 0.16, 0.16, 0.20],
    ]
)
CONTEXT = 1  # the token before the first drafted position
N_ROWS = 30_000


def chain_first_two(k: int, stochastic: bool, mode: str = "rejection") -> torch.Tensor:
    """Decode two tokens per row with speculative rounds; returns [N, 2] tokens."""
    n = N_ROWS
    seeds = torch.arange(n) + 1000
    out = torch.full((n, 2), -1, dtype=torch.int64)
    have = torch.zeros(n, dtype=torch.int64)
    prev = torch.full((n,), CONTEXT)
    while bool((have < 2).any()):
        rows = (have < 2).nonzero()[:, 0]
        pos = have[rows]
        ctx, drafts, dprobs = prev[rows], [], []
        for i in range(k):  # drafts drawn with the shared keyed noise, as a stochastic drafter would
            p = P[ctx] if stochastic else torch.nn.functional.one_hot(P[ctx].argmax(-1), V).float()
            ctx = race_sample(p, seeds[rows], pos + i)
            drafts.append(ctx)
            dprobs.append(p)
        drafts_t = torch.stack(drafts, 1)  # [r, k]
        chain_prev = torch.cat([prev[rows, None], drafts_t], 1)  # [r, k+1]
        if mode == "match":
            tokens, num_emitted = match_as_chains(drafts_t, Q[chain_prev], seeds[rows], pos)
        else:
            res = verify_chain(
                drafts_t, torch.stack(dprobs, 1) if stochastic else None, Q[chain_prev], seeds[rows], pos
            )
            tokens, num_emitted = res.tokens, res.num_emitted
        for j in range(k + 1):
            take = (num_emitted > j) & (have[rows] < 2)
            r = rows[take]
            out[r, have[r]] = tokens[take, j]
            prev[r] = tokens[take, j]
            have[r] += 1
    return out


def match_as_chains(
    drafts: torch.Tensor, target_probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """verify_match on chains given as verify_chain's tensors, at temperature 1 on logits log q (whose
    processed distribution is q): (tokens [B, k+1] padded with PAD_TOKEN, num_emitted [B])."""
    b, k = drafts.shape
    logits = target_probs.log().reshape(b * (k + 1), -1)
    results = match_chains(
        logits, drafts.tolist(), [SamplingParams(seed=s) for s in seeds.tolist()], positions.tolist()
    )
    tokens = torch.tensor([r.tokens + [PAD_TOKEN] * (k + 1 - len(r.tokens)) for r in results])
    return tokens, torch.tensor([len(r.tokens) for r in results])


def assert_chain_law(pairs: torch.Tensor) -> None:
    first_stat, first_dof = chi2_statistic(pairs[:, 0], Q[CONTEXT])
    assert first_stat < chi2_critical(first_dof), f"first token: chi2 {first_stat:.1f}"
    joint = (Q[CONTEXT][:, None] * Q).reshape(-1)  # P(t0, t1) = Q[c, t0] Q[t0, t1]
    pair_stat, pair_dof = chi2_statistic(pairs[:, 0] * V + pairs[:, 1], joint)
    assert pair_stat < chi2_critical(pair_dof), f"pair: chi2 {pair_stat:.1f}"


def chain_law_rejected(pairs: torch.Tensor) -> bool:
    joint = (Q[CONTEXT][:, None] * Q).reshape(-1)
    try:
        pair_stat, pair_dof = chi2_statistic(pairs[:, 0] * V + pairs[:, 1], joint)
    except AssertionError:  # produced an outcome of probability zero
        return True
    first_stat, first_dof = chi2_statistic(pairs[:, 0], Q[CONTEXT])
    return pair_stat > chi2_critical(pair_dof) or first_stat > chi2_critical(first_dof)


@pytest.mark.parametrize(("k", "stochastic"), [(3, True), (2, False)])
def test_chain_rejection_is_lossless(k, stochastic):
    """Rejection mode, stochastic draft (k=3) and point-mass draft (k=2): first token and first pair ~ Q.
    α = 1e-3 per chi-square test."""
    assert_chain_law(chain_first_two(k, stochastic))


def test_chain_match_is_lossless():
    """Match mode with a stochastic drafter sharing the keyed noise. α = 1e-3."""
    assert_chain_law(chain_first_two(3, True, "match"))


def test_chain_planted_bugs_are_detected(monkeypatch):
    """The same check rejects a residual drawn from q, and acceptance with min(1, p/q). α = 1e-3."""
    monkeypatch.setattr(verify, "_residual", lambda q, p, draft: q.clone())
    assert chain_law_rejected(chain_first_two(2, True))
    monkeypatch.undo()
    monkeypatch.setattr(verify, "_accepts", lambda u, p_x, q_x: u * q_x.double() < p_x.double())
    assert chain_law_rejected(chain_first_two(2, True))


# A fixed tree: root → {2 (0), 0 (1), 4 (2)}; node 0 → {0 (3), 1 (4)}; node 1 → {0 (5)}; node 3 → {3 (6)}.
TREE_TOKENS = torch.tensor([2, 0, 4, 0, 1, 0, 3])
TREE_PARENTS = torch.tensor([-1, -1, -1, 0, 0, 1, 3])
TREE_ROWS = 4_000


def tree_first_two(mode: str) -> torch.Tensor:
    prev_of_row = torch.cat([torch.tensor([CONTEXT]), TREE_TOKENS])  # the token each q row conditions on
    target = Q[prev_of_row]  # [n+1, V]
    if mode == "match":  # every row in one call, at temperature 1 on logits log q
        n = TREE_TOKENS.numel()
        tree = Proposal(TREE_TOKENS.tolist(), TREE_PARENTS.tolist())
        entries = [VerifyEntry(row * (n + 1), tree, SamplingParams(seed=row), 0) for row in range(TREE_ROWS)]
        emitted = [res.tokens for res in verify_match(target.log().repeat(TREE_ROWS, 1), entries)]
    else:
        emitted = [
            verify_tree(TREE_TOKENS, TREE_PARENTS, target, seed=row, base_position=0).tokens.tolist()
            for row in range(TREE_ROWS)
        ]
    pairs = torch.empty(TREE_ROWS, 2, dtype=torch.int64)
    for row, tokens in enumerate(emitted):
        if len(tokens) > 1:
            second = tokens[1]
        else:  # one more plain step from the emitted token
            second = int(race_sample(Q[tokens[0]][None], torch.tensor([row]), torch.tensor([1]))[0])
        pairs[row, 0], pairs[row, 1] = tokens[0], second
    return pairs


@pytest.mark.parametrize("mode", ["match", "rejection"])
def test_tree_is_lossless(mode):
    """Tree walk in both modes: first token and first pair ~ Q. α = 1e-3 per chi-square test."""
    assert_chain_law(tree_first_two(mode))


def test_tree_planted_bug_is_detected(monkeypatch):
    """Recursive rejection that forgets to remove rejected children from q fails the same check. α = 1e-3."""
    monkeypatch.setattr(verify, "_without", lambda q, token: q)
    assert chain_law_rejected(tree_first_two("rejection"))


# ---------------------------------------------------------------------------------------------------------
# Reproducible mode == plain decoding


VOCAB = 64


def markov_logits(seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, VOCAB, generator=g) * 2.5  # logits of the next token given the previous one


def plain_decode(logits, temperature, top_p, top_k, seeds, steps):
    b = seeds.numel()
    prev = torch.zeros(b, dtype=torch.int64)
    out = []
    for t in range(steps):
        tok, _ = sample(logits[prev], temperature, top_p, top_k, seeds, torch.full((b,), t))
        out.append(tok)
        prev = tok
    return torch.stack(out, 1)


def test_match_chain_is_token_identical_to_plain_decoding():
    target_logits, draft_logits = markov_logits(7), markov_logits(8) * 0.5 + markov_logits(7) * 0.5
    b, steps, k = 6, 40, 4
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.0, 1.3, 1.0])
    top_p = torch.tensor([1.0, 1.0, 0.9, 1.0, 1.0, 0.6])
    top_k = torch.tensor([0, 0, 0, 5, 0, 0])
    seeds = torch.arange(b) * 17
    reference = plain_decode(target_logits, temperature, top_p, top_k, seeds, steps)
    params = [
        SamplingParams(temperature=float(t), top_p=float(p), top_k=int(tk), seed=int(s))
        for t, p, tk, s in zip(temperature, top_p, top_k, seeds, strict=True)
    ]

    emitted: list[list[int]] = [[] for _ in range(b)]
    prev = torch.zeros(b, dtype=torch.int64)
    accepted_total = 0
    while min(len(e) for e in emitted) < steps:
        pos = torch.tensor([len(e) for e in emitted])
        ctx, drafts = prev, []
        for i in range(k):  # the drafter samples its own distribution with the shared keyed noise
            p = processed_probs(draft_logits[ctx], temperature, top_p, top_k)
            ctx = race_sample(p, seeds, pos + i)
            drafts.append(ctx)
        drafts_t = torch.stack(drafts, 1)
        chain = torch.cat([prev[:, None], drafts_t], 1)  # [B, k+1]
        res = match_chains(target_logits[chain].reshape(-1, VOCAB), drafts_t.tolist(), params, pos.tolist())
        accepted_total += sum(len(r.tokens) - 1 for r in res)
        for row in range(b):
            emitted[row].extend(res[row].tokens)
        prev = torch.tensor([r.tokens[-1] for r in res])
    got = torch.tensor([e[:steps] for e in emitted])
    assert torch.equal(got, reference)
    assert accepted_total > 0  # the coupling made some drafts agree


def test_match_tree_is_token_identical_to_plain_decoding():
    target_logits = markov_logits(7)
    temperature, top_p, top_k = torch.tensor([0.9]), torch.tensor([0.95]), torch.tensor([0])
    steps, seed = 60, 12345
    reference = plain_decode(target_logits, temperature, top_p, top_k, torch.tensor([seed]), steps)[0]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
    out: list[int] = []
    prev = 0
    g = torch.Generator().manual_seed(0)
    while len(out) < steps:
        # A random tree of 10 nodes: each node's parent is a random earlier node (or the root).
        n = 10
        parents = torch.tensor([int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)])
        # Children of a node carry that node's most likely successors under the target, so some match.
        tokens = torch.randint(0, VOCAB, (n,), generator=g)
        prev_tok = torch.empty(n + 1, dtype=torch.int64)
        prev_tok[0] = prev
        for i in range(n):
            parent_tok = prev_tok[parents[i] + 1]
            if i % 2 == 0:
                tokens[i] = target_logits[parent_tok].argmax()
            prev_tok[i + 1] = tokens[i]
        tree = Proposal(tokens.tolist(), parents.tolist())
        (res,) = verify_match(target_logits[prev_tok], [VerifyEntry(0, tree, params, len(out))])
        out.extend(res.tokens)
        prev = out[-1]
    assert out[:steps] == reference.tolist()
