"""The EAGLE drafter: runs an `EagleHead` (`engine/eagle.py`) against the target inside the generator.

Per request it keeps the target's features from the last prompt token on and the head's K/V in a slot
cache of its own; `propose` first runs the head over every request's new pairs in one batched pass, then
drafts a chain (batched over requests) or an EAGLE-2 tree (`tree.build_tree`). Keyed rows (reproducible
mode, `DraftState.keyed`) draft with the sampler's own noise, so a draft guesses the target's very draw.

Non-obvious choices (the reasoning is in docs/engine.md, "EAGLE head and drafter"):
- `DraftState.hidden[j]` is the target state that *sampled* the j-th token committed since the last call;
  the last token is pending, and pairs with the newest state to draft the next one.
- The window starts at the last prompt token, whatever states arrive for earlier positions: what the
  buffer trains on.
- Hot swap (`load_state`): with `rebuild=False` (what a rollout does) the cached K/V stay as the older
  weights computed them and only new pairs use the new ones — a drift that costs acceptance, never output.
- Draft vocabulary (`draft_vocab.DraftVocabulary`): drafts use only the most frequent observed tokens.
- Everything lives on the target's device (the head must share it); states arrive from the generator on
  the host and are moved once per call, and drafted tokens go back to the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence

import torch
from torch import Tensor

from slipstream.engine.draft_vocab import DraftVocabulary
from slipstream.engine.drafters.base import Draft, Drafter, DraftState
from slipstream.engine.eagle import EagleHead, attend, target_features
from slipstream.engine.kv_cache import KVCache
from slipstream.engine.model import Transformer
from slipstream.engine.sampling import keyed_pick, keyed_rank
from slipstream.engine.tree import build_tree, tree_depths

__all__ = ["EagleDrafter"]


# (temperature [B], seeds [B], positions [B] of the first draft token) for keyed draws; temperature 0
# where a row drafts its argmax.
_Keys = tuple[Tensor, Tensor, Tensor]


def _keys(states: Sequence[DraftState], device: torch.device) -> _Keys | None:
    """Keys for drafting `states` with the sampler's noise (on `device`, with the logits they race), or None
    when no row is a keyed sampling row."""
    if not any(state.keyed and not state.params.greedy for state in states):
        return None
    temperature = [state.params.temperature if state.keyed else 0.0 for state in states]
    seeds = [state.params.seed for state in states]
    positions = [state.position for state in states]
    return (
        torch.tensor(temperature, device=device),
        torch.tensor(seeds, dtype=torch.int64, device=device),
        torch.tensor(positions, dtype=torch.int64, device=device),
    )


@dataclasses.dataclass(eq=False)
class _Request:
    """The drafter's state for one request."""

    slot: int | None
    """Cache slot, None when every slot was taken at admission (the request is then never drafted)."""
    start: int
    """Sequence position of the window's first pair."""
    features: Tensor
    """[capacity, d] features of positions start, start+1, … (the first `num_features` rows are valid)."""
    num_features: int = 0
    cached: int = 0
    """Pairs whose K/V are in the slot (window positions [0, cached))."""
    last_out: Tensor | None = None
    """[d] head output of the last cached pair: the predicted feature that drafts the first token."""


@dataclasses.dataclass(eq=False)
class _Node:
    """One draft pair to run: the token `token` after a node whose head output is `parent_out`."""

    request: _Request
    token: int
    parent_out: Tensor
    """[d]."""
    position: int
    """Window position of the pair (RoPE) = cached + depth."""
    write: int
    """Cache index its K/V are written to (beyond the slot's length; never committed)."""
    visible: list[int]
    """Cache indices of the draft pairs it attends to besides the committed prefix (ancestors and itself)."""


class EagleDrafter(Drafter):
    """Runs an `EagleHead` against a target `Transformer`: per-request KV cache, chain and tree drafts.

    Draft vocabulary (`draft_vocab.DraftVocabulary`): the drafter proposes among the `draft_vocab` most
    frequent tokens it has observed (prompts and committed responses, plus `prime_counts` priors), which
    makes a draft step at small batch several times cheaper; verification stays over the full vocabulary.
    """

    name = "eagle"

    def __init__(
        self,
        head: EagleHead,
        target: Transformer,
        *,
        num_slots: int = 32,
        max_len: int = 2048,
        version: int = 0,
        draft_vocab: int = 4096,
    ) -> None:
        """num_slots: requests drafted at once; max_len: window pairs + draft nodes per request;
        draft_vocab: draft only among this many of the most frequent observed tokens (0: the full vocabulary;
        see the class notes)."""
        if head.config.hidden_size != target.config.hidden_size:
            raise ValueError(
                f"head hidden_size {head.config.hidden_size} != target hidden_size {target.config.hidden_size}"
            )
        if head.fc.weight.device != target.lm_head_weight.device:
            raise ValueError(
                f"head on {head.fc.weight.device}, target on {target.lm_head_weight.device}: one device"
            )
        self.head = head.eval()
        self.target = target
        self.version = version
        weight = head.fc.weight
        self.cache = KVCache.for_model(
            head.config, num_slots=num_slots, max_len=max_len, dtype=weight.dtype, device=weight.device
        )
        self._requests: dict[Hashable, _Request] = {}
        self.vocab = DraftVocabulary(target, draft_vocab)

    # ----------------------------------------------------------------------------------------------
    # Weights

    def load_state(self, weights: Mapping[str, Tensor], version: int, *, rebuild: bool = True) -> None:
        """Swap in new trainable weights (same names and shapes as `head.state_dict()`) of a newer version.

        Copies in place (cast to the head's dtype), so the module and its prepacked inference weights stay
        valid. rebuild: recompute every request's cache from its kept features at the next `propose`;
        False keeps the cached pairs (see the module notes on hot swap).
        """
        if version <= self.version:
            raise ValueError(f"drafter version {version} is not newer than the loaded version {self.version}")
        params = dict(self.head.named_parameters())
        if set(weights) != set(params):
            missing, unexpected = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
            raise ValueError(f"drafter weights mismatch: missing {missing}, unexpected {unexpected}")
        for name, param in params.items():
            if tuple(weights[name].shape) != tuple(param.shape):
                raise ValueError(
                    f"drafter weight {name!r}: shape {tuple(weights[name].shape)}, expected {tuple(param.shape)}"
                )
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(weights[name])
        self.version = version
        if not rebuild:
            return
        for request in self._requests.values():
            request.cached, request.last_out = 0, None
            if request.slot is not None:
                self.cache.rollback(request.slot, 0)

    # ----------------------------------------------------------------------------------------------
    # Drafter interface

    def observe(self, state: DraftState) -> None:
        # Only record the features: the head runs lazily in `propose`, so with speculation switched off the
        # drafter costs one norm per commit.
        if state.hidden is not None:
            with torch.inference_mode():
                self._ingest(state)

    def reset(self, request_id: Hashable) -> None:
        request = self._requests.pop(request_id, None)
        if request is not None and request.slot is not None:
            self.cache.free(request.slot)

    @torch.inference_mode()
    def propose(self, states: Sequence[DraftState], depth: int, topk: int, verify: int) -> list[Draft]:
        drafts = [Draft.empty() for _ in states]
        ready: list[tuple[int, _Request, DraftState]] = []
        for i, state in enumerate(states):
            # No states, no draft: guessing features would only waste the verify pass.
            request = self._ingest(state) if state.hidden is not None else None
            if request is not None and request.slot is not None:
                ready.append((i, request, state))
        self._extend([(request, state) for _, request, state in ready])
        room = min(depth, verify) if topk == 1 else depth * topk
        ready = [
            (i, request, state)
            for i, request, state in ready
            # Draft only from a cache that covers every committed token (the pending one included).
            if request.last_out is not None
            and request.start + request.cached == len(state.tokens) - 1
            and request.cached + room <= self.cache.max_len
        ]
        if not ready or depth < 1 or verify < 1:
            return drafts
        if topk == 1:
            chains = self._draft_chains(
                [request for _, request, _ in ready], [state for _, _, state in ready], min(depth, verify)
            )
            for (i, _, _), chain in zip(ready, chains, strict=True):
                drafts[i] = Draft.chain(chain)
        else:
            for i, request, state in ready:
                drafts[i] = self._draft_tree(request, state, depth, topk, verify)
        return drafts

    # ----------------------------------------------------------------------------------------------
    # Committed pairs

    def _ingest(self, state: DraftState) -> _Request | None:
        """Append the features of `state.hidden` to the request's window; returns the request's state."""
        hidden = state.hidden
        assert hidden is not None
        n, t = len(state.tokens), hidden.shape[0]
        first = n - 1 - t  # position of hidden[0]
        if first < 0 or hidden.dim() != 2 or hidden.shape[1] != self.head.config.hidden_size:
            raise ValueError(
                f"request {state.request_id!r}: hidden must be [t < {n}, {self.head.config.hidden_size}]"
                f" for {n} tokens, got {tuple(hidden.shape)}"
            )
        request = self._requests.get(state.request_id)
        if t == 0:
            return request  # no new states, so no position to check either
        self.vocab.count(state.tokens[n - t :])  # the tokens these states sampled
        if request is not None and first > request.start + request.num_features:
            # A gap: states for some committed tokens never arrived. Start a fresh window after it.
            self.reset(state.request_id)
            request = None
        if request is None:
            if first < state.prompt_len:  # first sight of this request: its prompt counts too
                self.vocab.count(state.tokens[: state.prompt_len])
            start = max(state.prompt_len - 1, first, 0)
            if first + t <= start:
                return None  # nothing at or after the window start yet
            slot = self.cache.allocate() if self.cache.num_free_slots else None
            capacity = max(64, 2 * t)
            request = _Request(slot=slot, start=start, features=self._new_features(capacity))
            self._requests[state.request_id] = request
        skip = request.start + request.num_features - first  # rows already held (or before the window)
        if skip < t and request.slot is not None:
            weight = self.target.lm_head_weight  # the generator hands states over on the CPU
            new = target_features(self.target, hidden[skip:].to(device=weight.device, dtype=weight.dtype))
            self._append_features(request, new.to(request.features.dtype))
        return request

    def prime_counts(self, counts: Mapping[int, int]) -> None:
        """Add prior token counts (token id → count), e.g. those of the head's training data, so the draft
        vocabulary holds the task's tokens before this drafter has observed them. Ids out of range raise."""
        self.vocab.prime(counts)

    def _draft_logprobs(self, outs: Tensor, scale: float) -> Tensor:
        """Log-probs [n, V] over the draft vocabulary (-inf elsewhere), for ranking tree candidates."""
        logits, ids = self.vocab.logits(outs)
        logprobs = torch.log_softmax(logits.float() * scale, dim=-1)
        if ids is None:
            return logprobs
        full = logprobs.new_full((logprobs.shape[0], self.vocab.vocab_size), float("-inf"))
        return full.index_copy_(1, ids, logprobs)

    def _draft_pick(self, outs: Tensor, keys: _Keys | None, step: int) -> Tensor:
        """Each row's draft token [B] at `step` tokens past its pending one: the argmax, or for keyed
        sampling rows the draw made with the sampler's own noise at that position (`keyed_pick`)."""
        logits, ids = self.vocab.logits(outs)
        if keys is None:
            best = logits.argmax(-1)
            return best if ids is None else ids[best]
        temperature, seeds, positions = keys
        return keyed_pick(logits, temperature, seeds, positions + step, ids)

    def _new_features(self, capacity: int) -> Tensor:
        weight = self.head.fc.weight
        return torch.empty(capacity, self.head.config.hidden_size, dtype=weight.dtype, device=weight.device)

    def _append_features(self, request: _Request, new: Tensor) -> None:
        end = request.num_features + new.shape[0]
        if end > request.features.shape[0]:
            # Doubling keeps appends amortised O(1) per token over a long response.
            grown = self._new_features(max(end, 2 * request.features.shape[0]))
            grown[: request.num_features] = request.features[: request.num_features]
            request.features = grown
        request.features[request.num_features : end] = new
        request.num_features = end

    def _extend(self, work: Sequence[tuple[_Request, DraftState]]) -> None:
        """Run the head over every request's uncached pairs in one pass; write their K/V into the cache."""
        jobs = []
        for request, state in work:
            # A pair at window position p needs the token after it; the newest state pairs with the pending one.
            end = min(request.num_features, len(state.tokens) - 1 - request.start, self.cache.max_len)
            if end > request.cached:
                jobs.append((request, state, request.cached, end))
        if not jobs:
            return
        device = self.head.fc.weight.device
        tokens, features, positions = [], [], []
        for request, state, lo, hi in jobs:
            ids = state.tokens[request.start + lo + 1 : request.start + hi + 1]
            tokens.append(torch.as_tensor(ids, dtype=torch.int64).reshape(-1))
            features.append(request.features[lo:hi])
            positions.append(torch.arange(lo, hi))
        # Built on the host and moved once: one copy, not one per request.
        embeds = self.target.embed_tokens(torch.cat(tokens).to(device))
        x = self.head.fuse(embeds.to(features[0].dtype), torch.cat(features))  # [N, d]
        q, k, v = self.head.qkv(x, torch.cat(positions).to(device))
        keys, values = self.cache.keys[0], self.cache.values[0]
        attn, row = [], 0
        for request, _, lo, hi in jobs:
            rows = slice(row, row + hi - lo)
            row += hi - lo
            slot = request.slot
            keys[slot, :, lo:hi] = k[rows].transpose(0, 1)
            values[slot, :, lo:hi] = v[rows].transpose(0, 1)
            mask = torch.arange(hi, device=device)[None, :] <= torch.arange(lo, hi, device=device)[:, None]
            attn.append(attend(q[rows], keys[slot, :, :hi], values[slot, :, :hi], mask))
            self.cache.set_length(slot, hi)
        out = self.head.finish(x, torch.cat(attn))  # [N, d]
        row = 0
        for request, _, lo, hi in jobs:
            row += hi - lo
            request.cached, request.last_out = hi, out[row - 1].clone()

    # ----------------------------------------------------------------------------------------------
    # Draft pairs

    def _run_nodes(self, nodes: Sequence[_Node]) -> Tensor:
        """Head outputs [len(nodes), d] of draft pairs; each sees its request's committed prefix + `visible`."""
        device = self.head.fc.weight.device
        ids = torch.tensor([node.token for node in nodes], dtype=torch.int64, device=device)
        parent_out = torch.stack([node.parent_out for node in nodes])
        x = self.head.fuse(self.target.embed_tokens(ids).to(parent_out.dtype), parent_out)
        q, k, v = self.head.qkv(x, torch.tensor([node.position for node in nodes], device=device))
        keys, values = self.cache.keys[0], self.cache.values[0]
        for i, node in enumerate(nodes):
            keys[node.request.slot, :, node.write] = k[i]
            values[node.request.slot, :, node.write] = v[i]
        attn = []
        for i, node in enumerate(nodes):
            slot, cached = node.request.slot, node.request.cached
            end = max(node.visible) + 1
            mask = torch.zeros(1, end, dtype=torch.bool, device=device)
            mask[0, :cached] = True
            mask[0, node.visible] = True
            attn.append(attend(q[i : i + 1], keys[slot, :, :end], values[slot, :, :end], mask))
        return self.head.finish(x, torch.cat(attn))

    def _draft_chains(
        self, requests: Sequence[_Request], states: Sequence[DraftState], k: int
    ) -> list[Tensor]:
        """Chains of k tokens for several requests at once (k - 1 batched head passes): argmax tokens, or
        keyed draws for sampling requests that verification draws with keyed noise."""
        keys = _keys(states, self.head.fc.weight.device)
        outs = torch.stack([request.last_out for request in requests])  # [B, d]
        tokens = [self._draft_pick(outs, keys, 0)]  # [B] per step
        for j in range(1, k):
            nodes = [
                _Node(
                    request=request,
                    token=int(tokens[-1][b]),
                    parent_out=outs[b],
                    position=request.cached + j - 1,
                    write=request.cached + j - 1,
                    visible=list(range(request.cached, request.cached + j)),
                )
                for b, request in enumerate(requests)
            ]
            outs = self._run_nodes(nodes)
            tokens.append(self._draft_pick(outs, keys, j))
        return list(torch.stack(tokens, dim=1).cpu())  # B × [k]

    def _draft_tree(self, request: _Request, state: DraftState, depth: int, topk: int, verify: int) -> Draft:
        """An EAGLE-2 tree (`tree.build_tree`) whose children are the head's top-k tokens (point masses)."""
        temperature = state.params.temperature
        scale = 1.0 / temperature if temperature > 0 else 1.0
        keyed = state.keyed and temperature > 0
        device = self.head.fc.weight.device
        seed = torch.tensor([state.params.seed], dtype=torch.int64, device=device)

        def scores(outs: Tensor, positions: list[int]) -> Tensor:
            logprobs = self._draft_logprobs(outs, scale)
            if not keyed:
                return logprobs
            # Rank children by the sampler's own race at their position (the target's token is drawn there).
            return keyed_rank(
                logprobs,
                seed.expand(len(positions)),
                torch.tensor(positions, dtype=torch.int64, device=device),
            )

        root_out = request.last_out
        assert root_out is not None
        outs: dict[int, Tensor] = {}  # expanded candidate → its head output
        writes: dict[int, int] = {}  # expanded candidate → cache index of its pair

        def expand(tokens: Tensor, parents: Tensor, frontier: Tensor) -> Tensor:
            if frontier.tolist() == [-1]:
                return scores(root_out[None], [state.position])
            depths = tree_depths(parents).tolist()
            parent_of = parents.tolist()
            nodes = []
            for c in frontier.tolist():
                writes[c] = request.cached + len(writes)
                visible, a = [], c
                while a >= 0:
                    visible.append(writes[a])
                    a = parent_of[a]
                p = parent_of[c]
                nodes.append(
                    _Node(
                        request=request,
                        token=int(tokens[c]),
                        parent_out=root_out if p < 0 else outs[p],
                        position=request.cached + depths[c],
                        write=writes[c],
                        visible=visible,
                    )
                )
            result = self._run_nodes(nodes)
            for c, out in zip(frontier.tolist(), result, strict=True):
                outs[c] = out
            # A child of candidate c sits one past c, and the root's children at state.position.
            return scores(result, [state.position + depths[c] + 1 for c in frontier.tolist()])

        tree = build_tree(expand, depth, topk, verify)
        return Draft(tree.tokens, tree.parents)
