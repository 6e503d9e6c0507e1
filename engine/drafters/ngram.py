"""Model-free n-gram drafter over a GRPO prompt group (prompt lookup across siblings).

The G responses of one prompt repeat each other (and the prompt) heavily, so the continuation of the
request's last n tokens elsewhere in the group is a good draft. Per group the drafter keeps every
document (the prompt once, then each sibling's response) and an append-only index n-gram → [(document,
continuation position)] for n from `max_n` down to `min_n`, updated from each history's new suffix only.

A proposal uses the longest n that matches, merges the continuations of its most recent `max_matches`
occurrences into a trie counting occurrences per node, and drafts the best `verify` nodes by count, at most
`topk` children per node (topk == 1: the most frequent continuation, as a chain). Drafts are
deterministic (point masses). Keyed rows (reproducible mode, T > 0) draft a chain that, where the
continuations branch, follows the sampler's own race with the counts as the distribution (`keyed_chain`).
Tables are host lists; only a proposal's two small tensors are made, on `device`. More in docs/engine.md,
"N-gram drafter".
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from slipstream.engine.drafters.base import Draft, Drafter, DraftState
from slipstream.engine.sampling import keyed_exponential

__all__ = ["NGramDrafter", "keyed_chain", "trie_draft"]


@dataclass
class _Group:
    docs: list[list[int]] = field(default_factory=list)
    index: dict[tuple[int, ...], list[tuple[int, int]]] = field(default_factory=dict)
    prompt_indexed: bool = False


@dataclass
class _Request:
    group_id: Hashable
    doc: int  # index into the group's docs
    synced: int  # how many history tokens are in the doc
    first_indexed: int  # continuation positions below this are not indexed (the prompt, seen once)


class NGramDrafter(Drafter):
    """Prompt-lookup drafter over all sequences of a prompt group."""

    name = "ngram"
    uses_hidden = False

    def __init__(
        self, min_n: int = 2, max_n: int = 4, max_matches: int = 32, device: torch.device | str = "cpu"
    ) -> None:
        """min_n, max_n: the n-gram lengths indexed; max_matches: recent occurrences merged per proposal;
        device: where its drafts' tensors are made (the generator's model's)."""
        if min_n < 1:
            raise ValueError(f"min_n must be >= 1, got {min_n}")
        if max_n < min_n:
            raise ValueError(f"max_n must be >= min_n={min_n}, got {max_n}")
        if max_matches < 1:
            raise ValueError(f"max_matches must be >= 1, got {max_matches}")
        self.min_n, self.max_n, self.max_matches = min_n, max_n, max_matches
        self.device = torch.device(device)
        self._groups: dict[Hashable, _Group] = {}
        self._requests: dict[Hashable, _Request] = {}

    # -- tables --------------------------------------------------------------------------------------------

    def _sync(self, state: DraftState) -> _Request:
        """Bring the group's tables up to date with the request's history (its new suffix only)."""
        req = self._requests.get(state.request_id)
        group = self._groups.setdefault(state.group_id, _Group())
        if req is None:
            # The prompt is indexed once per group; a sibling indexes only continuations in its response.
            first = 0 if not group.prompt_indexed else state.prompt_len
            group.prompt_indexed = True
            group.docs.append([])
            req = _Request(state.group_id, len(group.docs) - 1, 0, first)
            self._requests[state.request_id] = req
        history = state.tokens
        if len(history) > req.synced:
            new = history[req.synced :]
            new = new.tolist() if isinstance(new, Tensor) else list(new)
            doc = group.docs[req.doc]
            for token in new:
                self._append(group, req, doc, int(token))
            req.synced = len(doc)
        return req

    def _append(self, group: _Group, req: _Request, doc: list[int], token: int) -> None:
        pos = len(doc)
        doc.append(token)
        if pos < req.first_indexed:
            return
        for n in range(self.min_n, self.max_n + 1):
            if pos - n < 0:
                break
            group.index.setdefault(tuple(doc[pos - n : pos]), []).append((req.doc, pos))

    # -- Drafter -------------------------------------------------------------------------------------------

    def observe(self, state: DraftState) -> None:
        self._sync(state)

    def reset(self, request_id: Hashable) -> None:
        # The request's document stays in its group: siblings still decoding keep drafting from it.
        self._requests.pop(request_id, None)

    def reset_group(self, group_id: Hashable) -> None:
        self._groups.pop(group_id, None)
        for rid in [r for r, req in self._requests.items() if req.group_id == group_id]:
            del self._requests[rid]

    def propose(self, states: Sequence[DraftState], depth: int, topk: int, verify: int) -> list[Draft]:
        for name, value in (("depth", depth), ("topk", topk), ("verify", verify)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        return [self._propose_one(state, depth, topk, verify) for state in states]

    def _propose_one(self, state: DraftState, depth: int, topk: int, verify: int) -> Draft:
        req = self._sync(state)
        group = self._groups[state.group_id]
        doc = group.docs[req.doc]
        for n in range(min(self.max_n, len(doc)), self.min_n - 1, -1):
            matches = group.index.get(tuple(doc[len(doc) - n :]))
            if matches:
                conts = [group.docs[d][p : p + depth] for d, p in matches[-self.max_matches :]]
                if topk == 1 and state.keyed and not state.params.greedy:
                    tokens, parents = keyed_chain(
                        conts, min(depth, verify), state.params.seed, state.position
                    )
                else:
                    tokens, parents = trie_draft(conts, topk, verify)
                return Draft(
                    torch.tensor(tokens, dtype=torch.int64, device=self.device),
                    torch.tensor(parents, dtype=torch.int64, device=self.device),
                )
        return Draft.empty(self.device)


def keyed_chain(
    continuations: list[list[int]], length: int, seed: int, position: int
) -> tuple[list[int], list[int]]:
    """A chain through the continuations' trie that, where they branch, follows the child the sampler's own
    race would pick if the branch counts were the distribution: argmin E / count, with E the keyed noise
    at that position (`sampling.keyed_exponential`). Siblings were sampled from the same policy at the same
    temperature, so the counts estimate the distribution the target draws from, and the keyed choice
    guesses the target's very draw where the most frequent branch would only be its likeliest one."""
    tokens: list[int] = []
    alive = continuations
    for d in range(length):
        counts: dict[int, int] = {}
        for cont in alive:
            if len(cont) > d:
                counts[cont[d]] = counts.get(cont[d], 0) + 1
        if not counts:
            break
        if len(counts) == 1:
            (token,) = counts
        else:
            token = min(counts, key=lambda t: (keyed_exponential(seed, position + d, t) / counts[t], t))
        tokens.append(token)
        alive = [cont for cont in alive if len(cont) > d and cont[d] == token]
    return tokens, list(range(-1, len(tokens) - 1))


def trie_draft(continuations: list[list[int]], topk: int, verify: int) -> tuple[list[int], list[int]]:
    """Merge continuations (oldest first) into a trie; keep the best `verify` nodes, `topk` per parent:
    (tokens, parents) in topological order."""
    node_of: dict[tuple[int, int], int] = {}  # (parent, token) -> trie node
    token: list[int] = []
    parent: list[int] = []
    depth: list[int] = []
    count: list[int] = []
    recency: list[int] = []
    for rank, cont in enumerate(continuations):
        at = -1
        for d, tok in enumerate(cont):
            key = (at, tok)
            if key not in node_of:
                node_of[key] = len(token)
                token.append(tok)
                parent.append(at)
                depth.append(d)
                count.append(0)
                recency.append(rank)
            at = node_of[key]
            count[at] += 1
            recency[at] = rank
    # A node never outcounts its parent and is shallower-first on ties, so parents come first.
    order = sorted(range(len(token)), key=lambda i: (-count[i], depth[i], -recency[i]))
    new_index: dict[int, int] = {}
    n_children: dict[int, int] = {}
    chosen: list[int] = []
    for i in order:
        if len(chosen) == verify:
            break
        p = parent[i]
        if (p >= 0 and p not in new_index) or n_children.get(p, 0) >= topk:
            continue
        n_children[p] = n_children.get(p, 0) + 1
        new_index[i] = len(chosen)
        chosen.append(i)
    return [token[i] for i in chosen], [new_index[parent[i]] if parent[i] >= 0 else -1 for i in chosen]
