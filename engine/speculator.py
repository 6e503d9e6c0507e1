"""Speculative decoding for the Generator: configuration, the held drafters, batched lossless verification.

One speculative iteration (driven by `Generator.step`): every decode-state sequence gets a draft from the
current method's drafter (`Speculator.draft`), the target scores all of them in ONE forward pass — each
sequence's pending token as the root, its draft nodes after it under a tree mask (chains keep the causal
mask) — next to the prefill chunks of other requests (cheaper than two passes: docs/engine.md), and
`verify_drafts` decides per sequence which nodes survive and what the next token is.

Verification is split by how a row decides, not by draft shape:
- "match" rows (greedy requests, every request in "reproducible" mode, empty drafts) draw the target's
  token after EVERY node in one batched `sampling.sample` call with plain decoding's (seed, position)
  noise, then walk the draft while a child carries the drawn token: `verify_chain`/`verify_tree` in
  "match" mode for the whole batch at once, token-identical to plain decoding by construction.
- "rejection" rows (sampling requests in "rejection" mode with a draft) build the processed target
  distributions and go through `verify.verify_chain` (all chains in one call) or `verify.verify_tree`
  (one call per tree): lossless in distribution, not token-identical.

Drafters are built by the caller and held by method name (`Speculator.hold`); the engine makes none.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal, get_args

import torch
from torch import Tensor

from slipstream.engine.drafters.base import Draft, Drafter, DraftState, stack_chains
from slipstream.engine.drafters.hybrid import HybridDrafter
from slipstream.engine.sampling import SamplingParams, params_tensors, processed_probs, sample
from slipstream.engine.verify import verify_chain, verify_tree

__all__ = [
    "DRAFTER_METHODS",
    "EMPTY",
    "Proposal",
    "SpecConfig",
    "Speculator",
    "Verified",
    "VerifyEntry",
    "share_budget",
    "verify_drafts",
]

Method = Literal["off", "ngram", "self", "eagle", "hybrid"]
SpecMode = Literal["rejection", "reproducible"]
DRAFTER_METHODS = ("ngram", "self", "eagle")
"""The methods a drafter is held for; "hybrid" drafts with the held "ngram" and "eagle" drafters."""


@dataclass(frozen=True, kw_only=True)
class SpecConfig:
    """How the Generator speculates (the tuner may change it between iterations via `set_spec`)."""

    method: Method = "off"
    """"off" (plain decoding), "ngram" (prompt-group lookup), "self" (replay of recorded outputs: the
    benchmark ceiling), "eagle" (a trained draft head, passed in as the drafter) or "hybrid" (n-gram where
    it has a match, else the EAGLE head: `drafters.hybrid`)."""
    depth: int = 4
    """Draft tokens per pass (chain) or tree depth."""
    topk: int = 1
    """1 drafts a chain; > 1 a tree expanding the top-k children of a node."""
    verify: int = 0
    """Tree: draft nodes verified per pass (0 → depth * topk). Chain: caps the chain at min(depth, verify)."""
    mode: SpecMode = "rejection"
    """Sampling rows: "rejection" (lossless in distribution) or "reproducible" (token-identical to plain
    decoding with the same seeds). Greedy rows are always an exact argmax match."""

    def __post_init__(self) -> None:
        if self.method not in get_args(Method):
            raise ValueError(
                f"SpecConfig.method must be one of {', '.join(get_args(Method))}, got {self.method!r}"
            )
        for name, least in (("depth", 1), ("topk", 1), ("verify", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"SpecConfig.{name} must be an integer >= {least}, got {value!r}")
        if self.mode not in ("rejection", "reproducible"):
            raise ValueError(f"SpecConfig.mode must be rejection or reproducible, got {self.mode!r}")

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    @property
    def verify_budget(self) -> int:
        """Most draft nodes one sequence sends to a verify pass (a tree may hold more candidates than
        depth * topk, so an explicit `verify` is not capped by it; a chain is)."""
        if not self.verify:
            return self.depth * self.topk
        return min(self.verify, self.depth) if self.topk == 1 else self.verify


@dataclass(slots=True)
class Proposal:
    """One sequence's draft as Python lists (the verify pass and the tree walk read them per node)."""

    tokens: list[int]
    """[n] draft tokens; draft node i is node i + 1 of the verify pass (node 0 is the pending token)."""
    parents: list[int] | None
    """[n] parent draft node (-1 = the root) in topological order, or None for a chain."""
    draft_probs: Tensor | None = None
    """[n, V] the distribution each token was drawn from, or None (point masses)."""

    @property
    def size(self) -> int:
        return len(self.tokens)

    def pass_parents(self) -> list[int]:
        """[n + 1] parents in verify-pass numbering: the root first."""
        parents = self.parents if self.parents is not None else range(-1, self.size - 1)
        return [-1, *(p + 1 for p in parents)]

    def root_tokens(self) -> list[int]:
        """Tokens of the root's children."""
        if self.parents is None:
            return self.tokens[:1]
        return [t for t, p in zip(self.tokens, self.parents, strict=True) if p < 0]

    def depths(self) -> list[int]:
        """[n + 1] depth of each verify-pass node (the root 0)."""
        if self.parents is None:
            return list(range(self.size + 1))
        depths = [0]
        for p in self.parents:
            depths.append(depths[p + 1] + 1)
        return depths

    def prefix(self, n: int) -> Proposal:
        """The first n nodes (a prefix of a topological order is a tree); a chain drops its parents."""
        parents = None if self.parents is None else self.parents[:n]
        if parents is not None and parents == list(range(-1, len(parents) - 1)):
            parents = None
        probs = self.draft_probs
        if n >= self.size:
            return Proposal(self.tokens, parents, probs)
        return Proposal(self.tokens[:n], parents, None if probs is None else probs[:n])

    def as_draft(self) -> Draft:
        tokens = torch.tensor(self.tokens, dtype=torch.int64)
        if self.parents is None:
            return Draft.chain(tokens, self.draft_probs)
        return Draft(tokens, torch.tensor(self.parents, dtype=torch.int64), self.draft_probs)


EMPTY = Proposal([], None)


@dataclass(slots=True)
class VerifyEntry:
    """One sequence's share of a verify pass."""

    row: int
    """Logit row of the root; the draft's nodes follow it."""
    proposal: Proposal
    params: SamplingParams
    position: int
    """Position (index in prompt + response) of the token after the root."""


@dataclass(slots=True)
class Verified:
    """What verification emits for one sequence (before max_tokens / stop truncation)."""

    tokens: list[int]
    """Accepted draft tokens, then the correction or bonus token."""
    logprobs: list[float]
    """Log-prob of each token under the target's processed distribution (0 for greedy)."""
    nodes: list[int]
    """Verify-pass node that sampled each token: the root (0), then the accepted draft nodes. The KV cache
    keeps exactly these nodes (the last emitted token becomes the new pending one)."""


class Speculator:
    """The Generator's speculation policy and the drafters it holds, one per method.

    The caller builds every drafter and holds it for its method (`hold`, or `drafters=` at construction);
    `set` only chooses among them and raises if the chosen method's drafter is not held. Every held drafter
    observes every commit, even while another method (or "off") is active, so its tables or features stay
    current for the moment the tuner switches to it.
    """

    def __init__(self, vocab_size: int, drafters: Mapping[str, Drafter] | None = None) -> None:
        self.vocab_size = vocab_size
        self.config = SpecConfig()
        self.drafters: dict[str, Drafter] = {}
        self.needs_hidden = False
        """Some held drafter reads `DraftState.hidden` (the Generator then gathers the target's states)."""
        for method, drafter in (drafters or {}).items():
            self.hold(method, drafter)

    def hold(self, method: str, drafter: Drafter) -> None:
        """Hold `drafter` for `method` (one of `DRAFTER_METHODS`), replacing the one held for it, if any."""
        if method not in DRAFTER_METHODS:
            also = ' ("hybrid" drafts with the held ngram and eagle drafters)' if method == "hybrid" else ""
            raise ValueError(
                f"a drafter is held for one of {', '.join(DRAFTER_METHODS)}, not {method!r}{also}"
            )
        if not isinstance(drafter, Drafter):
            raise TypeError(
                f"the drafter held for {method!r} must be a Drafter, got {type(drafter).__name__}"
            )
        self.drafters[method] = drafter
        self.needs_hidden = any(d.uses_hidden for d in self.drafters.values())

    def set(self, spec: SpecConfig | None) -> None:
        """Speculate with `spec` from the next draft on (None or method "off": plain decoding)."""
        spec = spec if spec is not None else SpecConfig()
        needed = {"off": (), "hybrid": ("ngram", "eagle")}.get(spec.method, (spec.method,))
        missing = [method for method in needed if method not in self.drafters]
        if missing:
            held = ", ".join(map(repr, self.drafters)) or "none"
            raise ValueError(
                f"speculation method {spec.method!r} needs a drafter held for "
                f"{' and '.join(map(repr, missing))} (held: {held}): build it and pass it in drafters= "
                "or hold() it first"
            )
        self.config = spec

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def draft(
        self, states: Sequence[DraftState], depth_caps: Sequence[int], node_caps: Sequence[int], budget: int
    ) -> list[Proposal]:
        """Proposals for `states`: sequence i gets at most depth_caps[i] levels and node_caps[i] nodes, all
        together at most `budget` nodes (shared fairly). Caps only ever drop work that could not pay off."""
        spec = self.config
        asked = [
            i for i, (depth, nodes) in enumerate(zip(depth_caps, node_caps, strict=True)) if depth > 0 < nodes
        ]
        proposals = [EMPTY] * len(states)
        if not asked or budget <= 0:
            return proposals
        # In reproducible mode every row is verified by drawing the target's token with keyed noise, which
        # a drafter may share (`DraftState.keyed`); greedy rows are keyed in any mode.
        asked_states = []
        for i in asked:
            state = states[i]
            keyed = spec.mode == "reproducible" or state.params.greedy
            asked_states.append(state if state.keyed == keyed else replace(state, keyed=keyed))
        drafter = (
            HybridDrafter(self.drafters["ngram"], self.drafters["eagle"])
            if spec.method == "hybrid"
            else self.drafters[spec.method]
        )
        drafts = drafter.propose(asked_states, spec.depth, spec.topk, spec.verify_budget)
        if len(drafts) != len(asked):
            raise ValueError(f"drafter returned {len(drafts)} drafts for {len(asked)} requests")
        for i, draft in zip(asked, drafts, strict=True):
            proposals[i] = self._proposal(draft, depth_caps[i], min(node_caps[i], spec.verify_budget))
        cap = share_budget([p.size for p in proposals], budget)
        return [p if p.size <= cap else p.prefix(cap) for p in proposals]

    def _proposal(self, draft: Draft, depth_cap: int, node_cap: int) -> Proposal:
        """Check a draft and drop its nodes deeper than depth_cap, then all but its first node_cap."""
        if len(draft) == 0:
            return EMPTY
        tokens, parents, probs = draft.tokens.tolist(), draft.parents.tolist(), draft.draft_probs
        if any(not -1 <= p < i for i, p in enumerate(parents)):
            raise ValueError(f"draft parents {parents} are not in topological order (parent before child)")
        if min(tokens) < 0 or max(tokens) >= self.vocab_size:
            raise ValueError(f"draft tokens must lie in [0, {self.vocab_size}), got {tokens}")
        if probs is not None and probs.shape[-1] != self.vocab_size:
            raise ValueError(f"draft_probs must have {self.vocab_size} columns, got {tuple(probs.shape)}")
        proposal = Proposal(tokens, parents, probs).prefix(len(tokens))
        depths = proposal.depths()[1:]
        if max(depths) > depth_cap:
            # Nodes within the depth cap are closed under ancestors: still a tree, renumbered.
            keep = [i for i, d in enumerate(depths) if d <= depth_cap]
            new_index = {old: new for new, old in enumerate(keep)}
            proposal = Proposal(
                [tokens[i] for i in keep],
                [new_index.get(parents[i], -1) for i in keep],
                None if probs is None else probs[keep],
            ).prefix(len(keep))
        return proposal.prefix(node_cap)

    def observe(self, state: DraftState) -> None:
        for drafter in self.drafters.values():
            drafter.observe(state)

    def finish(self, request_id: Hashable, group_done: Hashable | None) -> None:
        """A request finished or was aborted; its group may be done (every request of it has left)."""
        for drafter in self.drafters.values():
            drafter.reset(request_id)
            if group_done is not None:
                drafter.reset_group(group_done)


def share_budget(sizes: Sequence[int], budget: int) -> int:
    """The largest per-sequence cap c with sum(min(size, c)) <= budget (water-filling; fair to all)."""
    if sum(sizes) <= budget:
        return max(sizes, default=0)
    cap = 0
    while sum(min(s, cap + 1) for s in sizes) <= budget:
        cap += 1
    return cap


def verify_drafts(logits: Tensor, entries: Sequence[VerifyEntry], mode: SpecMode) -> list[Verified]:
    """Verify every entry's draft against logits [rows, V] of one verify pass; see the module docstring."""
    match: list[int] = []
    reject: list[int] = []
    for i, entry in enumerate(entries):
        use_rejection = mode == "rejection" and entry.proposal.size > 0 and not entry.params.greedy
        (reject if use_rejection else match).append(i)
    results: dict[int, Verified] = {}
    if match:
        results.update(zip(match, _verify_match(logits, [entries[i] for i in match]), strict=True))
    if reject:
        results.update(zip(reject, _verify_rejection(logits, [entries[i] for i in reject]), strict=True))
    return [results[i] for i in range(len(entries))]


def _verify_match(logits: Tensor, entries: Sequence[VerifyEntry]) -> list[Verified]:
    """Draw the target's token after the nodes like plain decoding would, then walk each draft."""
    drawn: dict[int, tuple[int, float]] = {}  # logit row -> (token, log-prob)
    greedy_rows = [r for e in entries if e.params.greedy for r in range(e.row, e.row + e.proposal.size + 1)]
    if greedy_rows:
        # All-greedy rows: `sample` takes the argmax plain decoding takes, and builds no distribution.
        greedy_logits = logits if len(greedy_rows) == logits.shape[0] else logits[greedy_rows]
        n = len(greedy_rows)
        zeros, unused = torch.zeros(n), torch.zeros(n, dtype=torch.int64)
        tokens, _ = sample(greedy_logits, zeros, torch.ones(n), unused, unused, unused)
        drawn.update(zip(greedy_rows, ((t, 0.0) for t in tokens.tolist()), strict=True))
    sampled = [e for e in entries if not e.params.greedy]
    if sampled:
        # A draw costs a softmax over the vocabulary. Draw at the roots first — a sampled draft often dies
        # there — and at every other node (in one call) only for drafts whose first token survived.
        _draw(logits, [(e.row, e.position, e.params) for e in sampled], drawn)
        deeper = [
            (e.row + j, e.position + depth, e.params)
            for e in sampled
            if drawn[e.row][0] in e.proposal.root_tokens()
            for j, depth in enumerate(e.proposal.depths()[1:], 1)
        ]
        _draw(logits, deeper, drawn)

    results = []
    for entry in entries:
        proposal, row = entry.proposal, entry.row
        nodes = [0]
        if proposal.parents is None:
            for j, token in enumerate(proposal.tokens):
                if token != drawn[row + j][0]:
                    break
                nodes.append(j + 1)
        else:
            child: dict[tuple[int, int], int] = {}
            for j, (parent, token) in enumerate(
                zip(proposal.pass_parents()[1:], proposal.tokens, strict=True)
            ):
                child.setdefault((parent, token), j + 1)  # the first of equal siblings, as verify_tree
            node = child.get((0, drawn[row][0]))
            while node is not None:
                nodes.append(node)
                node = child.get((node, drawn[row + node][0]))
        picks = [drawn[row + node] for node in nodes]
        results.append(Verified([t for t, _ in picks], [lp for _, lp in picks], nodes))
    return results


def _draw(
    logits: Tensor, rows: Sequence[tuple[int, int, SamplingParams]], drawn: dict[int, tuple[int, float]]
) -> None:
    """`sample` at (logit row, position, params) triples into `drawn`: plain decoding's draw there."""
    if not rows:
        return
    temperature, top_p, top_k, seeds = params_tensors([params for _, _, params in rows])
    positions = torch.tensor([position for _, position, _ in rows], dtype=torch.int64)
    index = [row for row, _, _ in rows]
    tokens, logprobs = sample(logits[index], temperature, top_p, top_k, seeds, positions)
    drawn.update(zip(index, zip(tokens.tolist(), logprobs.tolist(), strict=True), strict=True))


def _verify_rejection(logits: Tensor, entries: Sequence[VerifyEntry]) -> list[Verified]:
    """Speculative sampling against the processed target distributions (lossless in distribution)."""
    rows: list[int] = []
    params: list[SamplingParams] = []
    for entry in entries:
        n = entry.proposal.size + 1
        rows.extend(range(entry.row, entry.row + n))
        params.extend([entry.params] * n)
    temperature, top_p, top_k, _ = params_tensors(params)
    probs = processed_probs(logits[rows], temperature, top_p, top_k)  # [sum(n + 1), V]
    starts = [0]  # first probs row of each entry
    for entry in entries[:-1]:
        starts.append(starts[-1] + entry.proposal.size + 1)

    results: dict[int, Verified] = {}
    chains = [i for i, entry in enumerate(entries) if entry.proposal.parents is None]
    if chains:
        tokens, lengths, draft_probs = stack_chains(
            [entries[i].proposal.as_draft() for i in chains], probs.shape[-1]
        )  # [b, k], [b], [b, k, V] | None
        k = tokens.shape[1]
        # Row j of chain b reads probs row starts[b] + j; rows past its draft read a zero row (padding).
        index = torch.tensor([starts[i] for i in chains])[:, None] + torch.arange(k + 1)[None, :]
        index = torch.where(torch.arange(k + 1)[None, :] <= lengths[:, None], index, probs.shape[0])
        padded = torch.cat([probs, probs.new_zeros(1, probs.shape[-1])])[index]  # [b, k + 1, V]
        seeds = torch.tensor([entries[i].params.seed for i in chains], dtype=torch.int64)
        positions = torch.tensor([entries[i].position for i in chains], dtype=torch.int64)
        out = verify_chain(tokens, draft_probs, padded, seeds, positions, "rejection", lengths)
        for i, accepted, emitted, logprobs in zip(
            chains, out.accept_length.tolist(), out.tokens.tolist(), out.logprobs.tolist(), strict=True
        ):
            results[i] = Verified(
                emitted[: accepted + 1], logprobs[: accepted + 1], list(range(accepted + 1))
            )
    for i, entry in enumerate(entries):
        if entry.proposal.parents is None:
            continue
        # verify_tree treats children as point masses (SpecInfer): lossless however they were chosen.
        draft = entry.proposal.as_draft()
        n = entry.proposal.size
        out = verify_tree(
            draft.tokens, draft.parents, probs[starts[i] : starts[i] + n + 1], entry.params.seed, entry.position,
            "rejection",
        )  # fmt: skip
        results[i] = Verified(
            out.tokens.tolist(), out.logprobs.tolist(), [0, *(a + 1 for a in out.accepted.tolist())]
        )
    return [results[i] for i in range(len(entries))]
