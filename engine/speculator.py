"""Speculative decoding for the Generator: configuration, drafters, and batched lossless verification.

One speculative iteration (driven by `Generator.step`): every decode-state sequence gets a draft from the
current drafter (`Speculator.draft`), the target scores all of them in ONE forward pass — each sequence's
pending token as the root, its draft nodes after it under a tree mask (chains keep the cheaper causal
mask) — next to the prefill chunks of other requests, and `verify_drafts` decides per sequence which draft
nodes survive and what the next token is. The Generator then commits the root-to-leaf path in the KV cache.

Verification is split by how a row decides, not by draft shape:
- "match" rows — greedy requests in any mode, every request in "reproducible" mode, and any request with
  an empty draft — draw the target's token after EVERY node in one batched `sampling.sample` call, with
  the same (seed, position) noise plain decoding uses at that position (argmax for greedy rows, so no
  full-vocabulary distribution is built for them), then walk the draft from the root while a child carries
  the drawn token. This is `verify_chain`/`verify_tree` in "match" mode for the whole batch at once: one
  sampler call instead of one per depth per request, and token-identical to plain decoding by construction.
- "rejection" rows (sampling requests in "rejection" mode with a non-empty draft) build the processed
  target distributions and go through `speculative.verify_chain` (all chains in one call) or
  `speculative.verify_tree` (one call per tree): lossless in distribution, not token-identical.

Measured on 2 CPU threads (SmolLM2-135M shape): running the verify nodes and the prefill chunks of other
requests in the same forward pass is 5–25% faster than two passes, so the Generator does that.
`score_trees` is the verify pass on its own (no prefill alongside), for drafters and tests.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, get_args

import torch
from torch import Tensor

from slipstream.engine.batch import BatchLayout
from slipstream.engine.drafters.base import Draft, Drafter, DraftState, stack_chains
from slipstream.engine.drafters.hybrid import HybridDrafter
from slipstream.engine.drafters.ngram import NGramDrafter
from slipstream.engine.drafters.oracle import OracleDrafter
from slipstream.engine.kv_cache import KVCache
from slipstream.engine.model import Transformer
from slipstream.engine.sampling import SamplingParams, params_tensors, processed_probs, sample
from slipstream.engine.speculative import verify_chain, verify_tree
from slipstream.engine.tree import tree_attention_mask

__all__ = [
    "EMPTY",
    "Proposal",
    "SpecConfig",
    "Speculator",
    "TreeScores",
    "Verified",
    "VerifyEntry",
    "VerifyTree",
    "score_tree",
    "score_trees",
    "share_budget",
    "verify_drafts",
]

Method = Literal["off", "ngram", "self", "eagle", "hybrid"]
SpecMode = Literal["rejection", "reproducible"]


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
    """The Generator's speculation policy and its drafters, one per method.

    Every held drafter observes every commit, even while another method (or "off") is active, so its tables
    or features stay current for the moment the tuner switches to it. The "self" method without a given
    drafter uses an `OracleDrafter` that records each completion of this Generator: a second run of the
    same requests then drafts the first run's output.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.config = SpecConfig()
        self.drafters: dict[str, Drafter] = {}
        self.needs_hidden = False
        """Some held drafter reads `DraftState.hidden` (the Generator then gathers the target's states)."""
        self._recorder: OracleDrafter | None = None

    def set(self, spec: SpecConfig | None, drafter: Drafter | None = None) -> None:
        spec = spec if spec is not None else SpecConfig()
        if spec.method == "hybrid":
            # The hybrid drafts with the held n-gram and EAGLE drafters (a given drafter is the EAGLE head).
            if drafter is not None:
                self._hold("eagle", drafter)
            if "eagle" not in self.drafters:
                raise ValueError("SpecConfig.method 'hybrid' needs an EAGLE head: pass it as the drafter")
            if "ngram" not in self.drafters:
                self._hold("ngram", NGramDrafter())
        elif drafter is not None:
            if not spec.enabled:
                raise ValueError("a drafter needs a speculation method: pass spec=SpecConfig(method=...)")
            self._hold(spec.method, drafter)
        elif spec.enabled and spec.method not in self.drafters:
            if spec.method == "eagle":
                raise ValueError("SpecConfig.method 'eagle' needs a drafter: pass the trained EAGLE head")
            if spec.method == "ngram":
                self._hold("ngram", NGramDrafter())
            else:
                recorder = OracleDrafter()
                self._hold("self", recorder)
                self._recorder = recorder
        self.config = spec

    def set_drafter(self, drafter: Drafter) -> None:
        if not self.config.enabled:
            raise ValueError("speculation is off: choose a method with set_spec(spec, drafter)")
        self._hold("eagle" if self.config.method == "hybrid" else self.config.method, drafter)

    def _hold(self, method: str, drafter: Drafter) -> None:
        replaced = self.drafters.get(method)
        if replaced is not None and replaced is self._recorder:
            self._recorder = None
        self.drafters[method] = drafter
        self.needs_hidden = any(d.uses_hidden for d in self.drafters.values())

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

    def finish(self, request_id: Hashable, tokens: Sequence[int] | None, group_done: Hashable | None) -> None:
        """A request finished (tokens: its full sequence) or was aborted (None); its group may be done."""
        if tokens is not None and self._recorder is not None:
            self._recorder.record(request_id, tokens)
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


@dataclass(frozen=True, kw_only=True)
class VerifyTree:
    """A draft tree to verify for one sequence."""

    slot: int
    tokens: Sequence[int]
    """[n] node tokens in topological order; node 0 is the root: the sequence's pending token."""
    parents: Sequence[int]
    """[n] parent node of each node; -1 for the root."""


@dataclass(frozen=True)
class TreeScores:
    """Per tree: logits [n, vocab] (row i scores the token after node i) and hidden [n, hidden]."""

    base_lengths: list[int]
    logits: list[Tensor]
    hidden: list[Tensor]


@torch.inference_mode()
def score_trees(model: Transformer, cache: KVCache, trees: Sequence[VerifyTree]) -> TreeScores:
    """One verify pass over several sequences' draft trees, with tree attention masks.

    Node i of a tree is written to cache position base + i (base = the slot's length before the pass) at
    RoPE position base + depth(i). Afterwards each slot's length is base + n: the caller keeps the
    accepted path with `cache.commit_path(slot, base, accepted_nodes)` (or `rollback`).
    """
    base_lengths = [cache.length(tree.slot) for tree in trees]
    sizes = [len(tree.tokens) for tree in trees]
    for tree, n in zip(trees, sizes, strict=True):
        parents = [int(p) for p in tree.parents]
        if (
            len(parents) != n
            or n == 0
            or parents[0] != -1
            or any(not 0 <= p < i for i, p in enumerate(parents[1:], 1))
        ):
            raise ValueError(
                f"slot {tree.slot}: need one parent per token, node 0 as the root (parent -1) and every "
                f"other node's parent an earlier node; got parents {parents}"
            )
    masks = [tree_attention_mask(torch.as_tensor(tree.parents, dtype=torch.int64)) for tree in trees]
    layout = BatchLayout.build(
        cache, [tree.slot for tree in trees], sizes, tree_masks=masks, logit_rows=range(sum(sizes))
    )
    ids = torch.tensor([t for tree in trees for t in tree.tokens], dtype=torch.int64, device=cache.device)
    logits, hidden = model(ids, layout.positions, layout, cache)
    offsets = layout.cu_seqlens
    return TreeScores(
        base_lengths=base_lengths,
        logits=[logits[offsets[i] : offsets[i + 1]] for i in range(len(trees))],
        hidden=[hidden[offsets[i] : offsets[i + 1]] for i in range(len(trees))],
    )


def score_tree(
    model: Transformer,
    cache: KVCache,
    slot: int,
    base_len: int,
    tokens: Sequence[int],
    parents: Sequence[int],
) -> tuple[Tensor, Tensor]:
    """Single-sequence `score_trees`: (logits [n, vocab], hidden [n, hidden]); checks the base length."""
    if cache.length(slot) != base_len:
        raise ValueError(f"slot {slot} holds {cache.length(slot)} tokens, not base_len {base_len}")
    scores = score_trees(model, cache, [VerifyTree(slot=slot, tokens=tokens, parents=parents)])
    return scores.logits[0], scores.hidden[0]
