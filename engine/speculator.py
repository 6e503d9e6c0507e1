"""Speculative decoding for the Generator: configuration, the held drafters, batched lossless verification.

One speculative iteration (driven by `Generator.step`): every decode-state sequence gets a draft from the
current method's drafter (`Speculator.draft`), the target scores all of them in ONE forward pass — each
sequence's pending token as the root, its draft nodes after it under a tree mask (chains keep the causal
mask) — next to the prefill chunks of other requests (cheaper than two passes: docs/engine.md), and
`verify_drafts` decides per sequence which nodes survive and what the next token is.

Verification is split by how a row decides, not by draft shape:
- "match" rows (greedy requests, every request in "reproducible" mode, empty drafts) go to
  `verify.verify_match` in one call: token-identical to plain decoding by construction.
- "rejection" rows (sampling requests in "rejection" mode with a draft) build the processed target
  distributions and go through `verify.verify_chain` (all chains in one call) or `verify.verify_tree`
  (one call per tree): lossless in distribution, not token-identical.
Verification runs on the logits' device; drafts are read to the host once per pass (one read per device).

Drafters are built by the caller and held by method name (`Speculator.hold`); the engine makes none.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal, get_args

import torch
from torch import Tensor

from slipstream.engine.drafters.base import Draft, Drafter, DraftState, stack_chains
from slipstream.engine.drafters.hybrid import HybridDrafter
from slipstream.engine.request import Request
from slipstream.engine.sampling import SamplingParams, params_tensors, processed_probs
from slipstream.engine.verify import (
    EMPTY,
    Proposal,
    Verified,
    VerifyEntry,
    verify_chain,
    verify_match,
    verify_tree,
)

if TYPE_CHECKING:
    from slipstream.engine.drafters.eagle import EagleDrafter
    from slipstream.engine.generator import Generator

__all__ = [
    "DRAFTER_METHODS",
    "EMPTY",
    "Proposal",
    "SpecConfig",
    "Speculator",
    "Verified",
    "VerifyEntry",
    "capture_graphs",
    "share_budget",
    "verify_drafts",
    "warm_up",
]

Method = Literal["off", "ngram", "self", "eagle", "hybrid", "history", "cascade"]
SpecMode = Literal["rejection", "reproducible"]
DRAFTER_METHODS = ("ngram", "self", "eagle", "history")
"""The methods a drafter is held for; "hybrid" drafts with the held "ngram" and "eagle" drafters, "cascade"
with the held "history" drafter (viewed with the group's siblings) and "eagle"."""
COMPOSITE = {"hybrid": ("ngram", "eagle"), "cascade": ("history", "eagle")}
"""Methods that draft with two held drafters: the first's draft where it has one, else the second's."""


@dataclass(frozen=True, kw_only=True)
class SpecConfig:
    """How the Generator speculates (the tuner may change it between iterations via `set_spec`)."""

    method: Method = "off"
    """"off" (plain decoding), "ngram" (prompt-group lookup), "self" (replay of recorded outputs: the
    benchmark ceiling), "eagle" (a trained draft head, passed in as the drafter), "hybrid" (n-gram where
    it has a match, else the EAGLE head: `drafters.hybrid`), "history" (earlier steps' responses to the
    prompt: `drafters.suffix`) or "cascade" (history and the group's siblings where they match, else the
    EAGLE head)."""
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
            also = (
                f" ({method!r} drafts with the held {' and '.join(COMPOSITE[method])} drafters)"
                if method in COMPOSITE
                else ""
            )
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
        needed = {"off": (), **COMPOSITE}.get(spec.method, (spec.method,))
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
        if spec.method == "hybrid":
            drafter: Drafter = HybridDrafter(self.drafters["ngram"], self.drafters["eagle"])
        elif spec.method == "cascade":
            history = self.drafters["history"]
            drafter = HybridDrafter(getattr(history, "with_siblings", history), self.drafters["eagle"],
                                    head_depth=getattr(history, "head_depth", 0))  # fmt: skip
        else:
            drafter = self.drafters[spec.method]
        drafts = drafter.propose(asked_states, spec.depth, spec.topk, spec.verify_budget)
        if len(drafts) != len(asked):
            raise ValueError(f"drafter returned {len(drafts)} drafts for {len(asked)} requests")
        for i, draft, (tokens, parents) in zip(asked, drafts, _host_lists(drafts), strict=True):
            proposals[i] = self._proposal(
                tokens, parents, draft.draft_probs, depth_caps[i], min(node_caps[i], spec.verify_budget)
            )
        cap = share_budget([p.size for p in proposals], budget)
        return [p if p.size <= cap else p.prefix(cap) for p in proposals]

    def _proposal(
        self, tokens: list[int], parents: list[int], probs: Tensor | None, depth_cap: int, node_cap: int
    ) -> Proposal:
        """Check a draft and drop its nodes deeper than depth_cap, then all but its first node_cap."""
        if not tokens:
            return EMPTY
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


def _host_lists(drafts: Sequence[Draft]) -> list[tuple[list[int], list[int]]]:
    """(tokens, parents) of every draft as lists: one host read per device the drafts are on, not two per
    draft (each would be a device sync)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, draft in enumerate(drafts):
        by_device.setdefault(draft.tokens.device, []).append(i)
    out: list[tuple[list[int], list[int]]] = [([], [])] * len(drafts)
    for ids in by_device.values():
        flat = torch.cat([t for i in ids for t in (drafts[i].tokens, drafts[i].parents)]).tolist()
        at = 0
        for i in ids:
            n = len(drafts[i])
            out[i] = (flat[at : at + n], flat[at + n : at + 2 * n])
            at += 2 * n
    return out


def verify_drafts(logits: Tensor, entries: Sequence[VerifyEntry], mode: SpecMode) -> list[Verified]:
    """Verify every entry's draft against logits [rows, V] of one verify pass; see the module docstring."""
    match: list[int] = []
    reject: list[int] = []
    for i, entry in enumerate(entries):
        use_rejection = mode == "rejection" and entry.proposal.size > 0 and not entry.params.greedy
        (reject if use_rejection else match).append(i)
    results: dict[int, Verified] = {}
    if match:
        results.update(zip(match, verify_match(logits, [entries[i] for i in match]), strict=True))
    if reject:
        results.update(zip(reject, _verify_rejection(logits, [entries[i] for i in reject]), strict=True))
    return [results[i] for i in range(len(entries))]


def _verify_rejection(logits: Tensor, entries: Sequence[VerifyEntry]) -> list[Verified]:
    """Speculative sampling against the processed target distributions (lossless in distribution)."""
    device = logits.device
    rows: list[int] = []
    params: list[SamplingParams] = []
    for entry in entries:
        n = entry.proposal.size + 1
        rows.extend(range(entry.row, entry.row + n))
        params.extend([entry.params] * n)
    temperature, top_p, top_k, _ = params_tensors(params, device)
    rows_t = torch.tensor(rows, dtype=torch.int64, device=device)
    probs = processed_probs(logits.index_select(0, rows_t), temperature, top_p, top_k)  # [sum(n + 1), V]
    starts = [0]  # first probs row of each entry
    for entry in entries[:-1]:
        starts.append(starts[-1] + entry.proposal.size + 1)

    results: dict[int, Verified] = {}
    chains = [i for i, entry in enumerate(entries) if entry.proposal.parents is None]
    if chains:
        drafts = [
            Draft.chain(torch.tensor(p.tokens, dtype=torch.int64, device=device), p.draft_probs)
            for p in (entries[i].proposal for i in chains)
        ]
        # [b, k], [b], [b, k, V] or None
        tokens, lengths, draft_probs = stack_chains(drafts, probs.shape[-1], device)
        k = tokens.shape[1]
        # Row j of chain b reads probs row starts[b] + j; rows past its draft read a zero row (padding).
        cols = torch.arange(k + 1, device=device)[None, :]
        index = torch.tensor([starts[i] for i in chains], device=device)[:, None] + cols
        index = torch.where(cols <= lengths[:, None], index, probs.shape[0])
        padded = torch.cat([probs, probs.new_zeros(1, probs.shape[-1])])[index]  # [b, k + 1, V]
        seeds = torch.tensor([entries[i].params.seed for i in chains], dtype=torch.int64, device=device)
        positions = torch.tensor([entries[i].position for i in chains], dtype=torch.int64, device=device)
        out = verify_chain(tokens, draft_probs, padded, seeds, positions, lengths)
        for i, accepted, emitted, logprobs in zip(
            chains, out.accept_length.tolist(), out.tokens.tolist(), out.logprobs.tolist(), strict=True
        ):
            results[i] = Verified(
                emitted[: accepted + 1], logprobs[: accepted + 1], list(range(accepted + 1))
            )
    for i, entry in enumerate(entries):
        proposal = entry.proposal
        if proposal.parents is None:
            continue
        # verify_tree treats children as point masses (SpecInfer): lossless however they were chosen.
        out = verify_tree(
            proposal.tokens, proposal.parents, probs[starts[i] : starts[i] + proposal.size + 1],
            entry.params.seed, entry.position,
        )  # fmt: skip
        results[i] = Verified(
            out.tokens.tolist(), out.logprobs.tolist(), [0, *(a + 1 for a in out.accepted.tolist())]
        )
    return [results[i] for i in range(len(entries))]


def capture_graphs(
    generator: Generator, plans: Sequence[tuple[SpecConfig | None, int]], eagle: EagleDrafter | None = None
) -> int:
    """Capture now every CUDA graph decoding under `plans` (a speculation config or None, and the most rows
    it decodes at) can meet: the generator's fixed-shape steps and, for plans drafting with `eagle`'s
    chains, its rounds. On first use, each new shape cost an iteration 0.1-0.7 s in a rollout's tail on
    an H200 (docs/gpu.md, 2026-11-28). Returns the new graphs (0 where none are replayed: the CPU)."""
    graphs = generator.capture_graphs(plans)
    rounds = None if eagle is None else eagle.rounds
    for spec, rows in plans:
        if (
            rounds is not None
            and spec is not None
            and spec.method in ("eagle", "hybrid", "cascade")
            and spec.topk == 1
        ):
            graphs += rounds.capture(rows, range(1, spec.depth + 1))
    return graphs


def warm_up(
    generator: Generator, specs: Sequence[SpecConfig | None], *, num_requests: int, max_len: int
) -> None:
    """Decodes `num_requests` synthetic requests for two iterations with each of `specs` (None: plain), so
    that real work does not pay first touches (KV and scratch pages, packed weights, each arm's paths), then
    aborts them: no slot stays taken, nothing is returned."""
    vocab = generator.model.config.vocab_size
    length = max(1, min(64, max_len // 4))
    prompt = [(7919 * i + 13) % vocab for i in range(length)]  # any ids: only the shapes matter
    params = SamplingParams(temperature=1.0, max_tokens=max_len - length, seed=0)
    ids = [f"warm-up:{i}" for i in range(num_requests)]
    for request_id in ids:
        generator.add(Request(request_id=request_id, prompt_ids=prompt, params=params))
    try:
        generator.set_spec(None)
        while generator.num_prefilling:
            generator.step()
        for spec in specs:
            generator.set_spec(spec)
            for _ in range(2):
                generator.step()
    finally:
        for request_id in ids:
            generator.abort(request_id)
        generator.set_spec(None)
