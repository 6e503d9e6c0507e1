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
- The committed pairs' pass and every chain step are single fixed-shape passes over all requests
  ([rows, pairs], padding masked): features gathered from one [slots, ring, d] buffer, K/V written by
  `attention.store_kv`, attention by `attention.paged_attention` (the target's kernels), no per-request
  loop and no host read until the chain's tokens are returned; trees still expand node by node.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Hashable, Mapping, Sequence

import torch
from torch import Tensor

from slipstream.engine.attention import PAGE_SIZE, paged_attention, store_kv
from slipstream.engine.device import capabilities
from slipstream.engine.draft_vocab import DraftVocabulary, draft_logits
from slipstream.engine.drafters.base import Draft, Drafter, DraftState
from slipstream.engine.drafters.eagle_rounds import EXTEND_PAIRS, EagleRounds, extend_rows
from slipstream.engine.eagle import EagleHead, attend, target_features
from slipstream.engine.kv_cache import KVCache
from slipstream.engine.model import Transformer
from slipstream.engine.sampling import keyed_pick, keyed_rank
from slipstream.engine.tree import build_tree, tree_depths

__all__ = ["EXTEND_PAIRS", "FEATURE_RING", "EagleDrafter"]

FEATURE_RING = 512
"""Window positions whose features a slot holds (a ring): more than a request ever has waiting for the
head unless speculation was off for that long, when its window starts again from the newest states."""


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
    num_features: int = 0
    """Features held for window positions [0, num_features) (in the drafter's buffer, row `slot`)."""
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
        static: bool | None = None,
    ) -> None:
        """num_slots: requests drafted at once; max_len: window pairs + draft nodes per request;
        draft_vocab: draft only among this many of the most frequent observed tokens (0: the full vocabulary;
        see the class notes); static: committed pairs and chains in fixed-shape rounds (`EagleRounds`: CUDA
        graphs on a GPU, eager elsewhere); None: where the device replays CUDA graphs (or
        SLIPSTREAM_STATIC_STEP=1), as the Generator decides."""
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
            head.config, num_slots=num_slots, max_len=max_len, dtype=weight.dtype, device=weight.device,
            page_size=PAGE_SIZE, dummy_slot=True,
        )  # fmt: skip
        d = head.config.hidden_size
        # Every slot's window features in one buffer, so a batched pass gathers its pairs in one index; a
        # ring: only pairs the head has not run over yet are needed (`_ingest` keeps them within it).
        self.ring = min(max_len, FEATURE_RING)
        self.features = torch.zeros(num_slots + 1, self.ring, d, dtype=weight.dtype, device=weight.device)
        """[slots + 1, ring, d] features of window position p at p % ring, per slot (the last row: the dummy
        slot's, read by padding rows)."""
        self._cos, self._sin = head.rotary.tables(self.cache.storage_len, weight.device, weight.dtype)
        self.last = torch.zeros(num_slots + 1, d, dtype=weight.dtype, device=weight.device)
        """[slots + 1, d] each slot's newest head output (`_Request.last_out` views a row; the last row is
        the dummy slot's, which padding rows of a fixed-shape round read and write)."""
        self._requests: dict[Hashable, _Request] = {}
        self.vocab = DraftVocabulary(target, draft_vocab)
        if static is None:
            static = (
                capabilities(weight.device).cuda_graphs or os.environ.get("SLIPSTREAM_STATIC_STEP") == "1"
            )
        self.rounds = EagleRounds(self) if static else None
        """The fixed-shape rounds, or None (dynamic passes)."""

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
        # A window longer than the ring lost its oldest features: it starts again with the next states.
        for request_id in [i for i, r in self._requests.items() if r.num_features > self.ring]:
            self.reset(request_id)
        for request in self._requests.values():
            request.cached, request.last_out = 0, None  # (`last` keeps its rows: graphs bind it)
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
            request = self._open(state, max(first, first + t - self.ring))
        elif first + t - request.start - request.cached > self.ring:
            # More pairs waiting for the head than the ring holds (speculation was off for a long while):
            # a fresh window over the newest states.
            self.reset(state.request_id)
            request = self._open(state, first + t - self.ring)
        if request is None:
            return None
        skip = request.start + request.num_features - first  # rows already held (or before the window)
        if skip < t and request.slot is not None:
            weight = self.target.lm_head_weight  # the generator hands states over on the CPU
            new = target_features(self.target, hidden[skip:].to(device=weight.device, dtype=weight.dtype))
            self._append_features(request, new.to(self.features.dtype))
        return request

    def _open(self, state: DraftState, at: int) -> _Request | None:
        """A new window for `state`'s request from sequence position `at` (not before the last prompt
        token), or None while no state reaches it."""
        start = max(state.prompt_len - 1, at, 0)
        if len(state.tokens) - 1 <= start:
            return None  # nothing at or after the window start yet
        slot = self.cache.allocate() if self.cache.num_free_slots else None
        request = _Request(slot=slot, start=start)
        self._requests[state.request_id] = request
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

    def _draft_pick(self, outs: Tensor, keys: _Keys | None, step: int, restricted: bool) -> Tensor:
        """Each row's draft token [B] at `step` tokens past its pending one: the argmax, or for keyed
        sampling rows the draw made with the sampler's own noise at that position (`keyed_pick`); over the
        draft vocabulary where `restricted` (held in place-kept buffers for a static drafter)."""
        ids: Tensor | None = None
        if not restricted:
            logits = draft_logits(self.target, outs)
        elif self.rounds is not None:
            logits, ids = self.vocab.fixed_logits(outs)
        else:
            logits, ids = self.vocab.logits(outs)
        if keys is None:
            best = logits.argmax(-1)
            return best if ids is None else ids[best]
        temperature, seeds, positions = keys
        return keyed_pick(logits, temperature, seeds, positions + step, ids)

    def _append_features(self, request: _Request, new: Tensor) -> None:
        """Hold `new` [t <= ring, d] for the next window positions (in the ring)."""
        assert request.slot is not None
        lo = request.num_features
        at = torch.arange(lo, lo + new.shape[0], device=new.device) % self.ring
        self.features[request.slot].index_copy_(0, at, new)
        request.num_features = lo + new.shape[0]

    def _extend(self, work: Sequence[tuple[_Request, DraftState]]) -> None:
        """Run the head over every request's uncached pairs in fixed-shape passes ([rows, pairs], padding
        masked out) of at most EXTEND_PAIRS pairs a row: K/V into the cache, each request's newest output
        kept. No host read."""
        jobs = []
        for request, state in work:
            # A pair at window position p needs the token after it; the newest state pairs with the pending one.
            end = min(request.num_features, len(state.tokens) - 1 - request.start, self.cache.max_len)
            if end > request.cached:
                jobs.append((request, state, request.cached, end))
        while jobs:
            # A request that drafted nothing for a while (the tuner ran plain decoding) has many pairs to
            # catch up on: passes of a bounded width (the attention's tree bits hold 63 pairs).
            chunk = [(r, s, lo, min(hi, lo + EXTEND_PAIRS)) for r, s, lo, hi in jobs]
            if self.rounds is not None:
                self.rounds.extend(chunk)
            else:
                self._extend_pass(chunk)
            jobs = [
                (r, s, cut, hi) for (r, s, _, hi), (_, _, _, cut) in zip(jobs, chunk, strict=True) if cut < hi
            ]

    def _extend_pass(self, jobs: Sequence[tuple[_Request, DraftState, int, int]]) -> None:
        """One pass over pairs [lo, hi) of each job's request."""
        device = self.head.fc.weight.device
        width = max(hi - lo for _, _, lo, hi in jobs)  # pairs a row
        # One host→device copy of the whole pass's small ints: slot, cached, pair count, then the tokens.
        meta = torch.tensor(extend_rows(jobs, width), dtype=torch.int64).to(device)
        slot, ctx, count, ids = meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3:]  # [R], [R], [R], [R, E]
        self.extend_pass(slot, ctx, count, ids, reach=max(hi for *_, hi in jobs))
        self.extended(jobs)

    def extended(self, jobs: Sequence[tuple[_Request, DraftState, int, int]]) -> None:
        """Host bookkeeping after a pass over `jobs`: lengths, cached pairs, each request's newest output."""
        for request, _, _, hi in jobs:
            assert request.slot is not None
            self.cache.set_length(request.slot, hi)
            request.cached, request.last_out = hi, self.last[request.slot]

    def extend_pass(
        self, slot: Tensor, ctx: Tensor, count: Tensor, ids: Tensor, *, reach: int | None
    ) -> None:
        """The head over `count` [R] new pairs (tokens ids [R, E]) a row after the ctx [R] cached in each
        slot [R]: K/V into the cache, each row's newest output into `last[slot]`. No host read; reach: the
        most positions any row reads (None: the whole slot, a fixed shape)."""
        rows, width = ids.shape
        pair = torch.arange(width, device=ids.device)
        valid = pair[None, :] < count[:, None]  # [R, E]
        position = ctx[:, None] + pair  # window positions [R, E]
        features = self.features[slot[:, None], position % self.ring]  # [R, E, d]
        x = self.head.fuse(
            self.target.embed_tokens(ids.reshape(-1)).to(features.dtype), features.reshape(rows * width, -1)
        )  # [R*E, d]
        causal = (2 << pair) - 1  # pair i sees pairs 0..i
        bits = torch.where(valid, causal[None, :], 0)  # padding sees nothing new (and writes nowhere real)
        out = self._layer(x, slot, ctx, position, valid, bits, width, cached=reach)
        # A padding row (no pairs) writes its garbage to the dummy slot's row.
        last = out.view(rows, width, -1)[torch.arange(rows, device=ids.device), (count - 1).clamp_min(0)]
        self.last.index_copy_(0, slot, last.to(self.last.dtype))

    def _layer(
        self,
        x: Tensor,
        slot: Tensor,
        ctx: Tensor,
        position: Tensor,
        valid: Tensor,
        bits: Tensor,
        width: int,
        *,
        cached: int | None,
    ) -> Tensor:
        """The head's layer over x [R*N, d]: N new pairs a row at window positions `position` [R, N], each
        row seeing its slot's first ctx [R] cached pairs plus the new pairs its `bits` [R, N] name; writes
        the valid pairs' K/V (padding to the dummy slot). `cached`: the most positions any row reads (host
        data: the table covers just those pages; None: the whole slot). Returns outputs [R*N, d]."""
        rows = slot.shape[0]
        config = self.head.config
        heads, hd = config.num_attention_heads, config.head_dim
        rope = position.reshape(-1)
        cos, sin = self._cos[rope][:, None], self._sin[rope][:, None]  # [R*N, 1, hd]
        q, k, v = self.head.layer.attn._qkv(x, cos, sin)  # the target's projection + RoPE arithmetic
        dummy = self.cache.dummy_slot
        assert dummy is not None
        node = torch.arange(width, device=x.device)
        store_kv(
            self.cache.keys[0], self.cache.values[0], k, v,
            torch.where(valid, slot[:, None], dummy).reshape(-1), torch.where(valid, position, node).reshape(-1),
        )  # fmt: skip
        pages = self.cache.storage_len // PAGE_SIZE if cached is None else -(-cached // PAGE_SIZE)
        table = slot[:, None] * (self.cache.storage_len // PAGE_SIZE) + torch.arange(pages, device=x.device)
        attn = paged_attention(
            q.reshape(rows, width, heads, hd), self.cache.keys[0], self.cache.values[0], table, ctx, bits,
            scale=hd**-0.5, page_size=PAGE_SIZE,
        )  # fmt: skip
        return self.head.finish(x, attn.reshape(rows * width, heads * hd))

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
        """Chains of k tokens for several requests at once (k - 1 batched head steps, each a fixed-shape
        pass over one new pair a row): argmax tokens, or keyed draws for sampling requests that
        verification draws with keyed noise. Tokens stay on the device until the caller reads them."""
        if self.rounds is not None:
            return self.rounds.chains(requests, states, k)
        device = self.head.fc.weight.device
        keys = _keys(states, device)
        meta = torch.tensor([[r.slot, r.cached] for r in requests], dtype=torch.int64).to(device)
        reach = max(r.cached for r in requests)
        restricted = self.vocab.refresh()
        tokens = self.chain_pass(meta[:, 0], meta[:, 1], keys, k, reach=reach, restricted=restricted)
        return list(tokens.cpu())  # B × [k]

    def chain_pass(
        self, slot: Tensor, cached: Tensor, keys: _Keys | None, k: int, *, reach: int | None, restricted: bool
    ) -> Tensor:
        """Chains [B, k] drafted from each slot's [B] newest output after its cached [B] pairs: k - 1 head
        steps, each a fixed-shape pass over one new pair a row, no host read. reach: the most cached pairs
        of any row (None: the whole slot, a fixed shape); restricted: over the draft vocabulary (`refresh`
        said so; its fixed buffers when the drafter is static)."""
        rows = slot.shape[0]
        outs = self.last[slot]  # [B, d]
        valid = torch.ones(rows, 1, dtype=torch.bool, device=slot.device)
        itself = torch.ones(rows, 1, dtype=torch.int64, device=slot.device)
        tokens = [self._draft_pick(outs, keys, 0, restricted)]  # [B] per step
        for j in range(1, k):
            # Draft pair j - 1 sits right after the committed ones: the pairs before it are its prefix.
            x = self.head.fuse(self.target.embed_tokens(tokens[-1]).to(outs.dtype), outs)
            ctx = cached + j - 1
            at = None if reach is None else reach + j
            outs = self._layer(x, slot, ctx, ctx[:, None], valid, itself, 1, cached=at)
            tokens.append(self._draft_pick(outs, keys, j, restricted))
        return torch.stack(tokens, dim=1)

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
