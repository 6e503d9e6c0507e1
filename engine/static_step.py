"""The fixed-shape decode and verify step: what a GPU replays as a CUDA graph, and a CPU runs eagerly.

One call scores N nodes for each of B rows (N = 1: plain decoding; N > 1: the pending token plus a
chain or tree of drafts) and decides, on the device, what each row emits: sampling
(`sample_static`), match or rejection verification (`verify_static`), and for trees the commit of the
accepted path's K/V. Every shape is fixed by the key `StepKey(batch, nodes, filtered, rejection, tree)`
(batch and nodes are buckets; rows and nodes past the real ones are padding) and every input and output
lives in a persistent buffer: the host packs one int64 block (one host→device copy), the graph runs,
and one int64 block comes back (one device→host copy). Nothing inside reads the device or allocates by
data, so `GraphRunner` captures it per key (engine/graphs.py).

Non-obvious choices:
- Padding rows point at the cache's dummy slot with no context; a real row's padding nodes write their
  K/V there too and see only the row's cached prefix, so a bucket never writes past a row's max_len.
- Attention reads context lengths and a page table from device memory (engine/attention.py); the table
  of the slot layout is slot × pages-per-slot + j, made on the device from the slot.
- Prefill stays eager (its shapes are the prompts'); a decode iteration with prompts to prefill runs
  them as their own pass first (engine/generator.py).
- Floats travel in the int64 blocks as float64 bits, so one copy each way carries everything.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from slipstream.engine.attention import PAGE_SIZE, paged_attention, store_kv
from slipstream.engine.graphs import GraphRunner
from slipstream.engine.kv_cache import KVCache
from slipstream.engine.model import Transformer
from slipstream.engine.sample_static import processed_probs_static, sample_static
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.verify_static import (
    draw_static,
    emitted,
    match_walk,
    rejection_chain_static,
    rejection_tree_static,
)

if TYPE_CHECKING:
    from slipstream.engine.speculator import SpecConfig

__all__ = [
    "BATCH_BUCKETS",
    "NODE_BUCKETS",
    "PAGE_SIZE",
    "StaticStep",
    "StepKey",
    "StepResult",
    "StepRow",
    "bucket",
]

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
"""Rows a step is shaped for (the smallest bucket holding the batch runs)."""
NODE_BUCKETS = (1, 2, 4, 8, 16)
"""Nodes per row: the pending token plus up to 15 drafts."""

# Input block columns: per row, then five per-node sections of width max_nodes.
_SLOT, _CTX, _TEMP, _TOP_P, _TOP_K, _SEED, _REJECT = range(7)
_FIXED = 7
_TOKENS, _PARENTS, _DEPTHS, _VALID, _BITS = range(5)


def bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n (ValueError past the largest)."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass(frozen=True)
class StepKey:
    """What a fixed-shape step is shaped for: one CUDA graph per key."""

    batch: int
    """Rows (a bucket)."""
    nodes: int
    """Nodes per row, the pending token first (a bucket; 1 = plain decoding)."""
    filtered: bool
    """Some row uses top-k or top-p (the sampler computes exact cut-offs)."""
    rejection: bool
    """Some row verifies by rejection sampling (the others by matching the target's draw)."""
    tree: bool
    """Some row's draft is a tree (the accepted path's K/V is moved; rejection walks children)."""


@dataclass(frozen=True)
class StepResult:
    """What one step emits per real row (host arrays)."""

    tokens: np.ndarray
    """[rows, nodes] int64: accepted drafts, then the target's own token; garbage past accept_length + 1."""
    logprobs: np.ndarray
    """[rows, nodes] float64: log-prob of each emitted token under the processed distribution."""
    path: np.ndarray
    """[rows, nodes] int64: the verify-pass node that sampled each emitted token (0 = the root)."""
    accept_length: np.ndarray
    """[rows] int64: accepted draft tokens."""


@dataclass(frozen=True)
class StepRow:
    """One row's input (host data)."""

    slot: int
    context: int
    """Tokens cached before the pending one (its position)."""
    params: SamplingParams
    tokens: Sequence[int]
    """The pending token, then draft tokens in topological order."""
    parents: Sequence[int] | None = None
    """Per draft token its parent draft index (-1 = the pending token), or None for a chain."""
    rejection: bool = False


class StaticStep:
    """Persistent buffers and the fixed-shape step over them; see the module docstring."""

    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        *,
        max_batch: int,
        max_nodes: int = 1,
        graphs: bool = True,
    ) -> None:
        """max_batch / max_nodes: the largest rows and nodes per row a step will see (bucketed up);
        graphs: capture and replay CUDA graphs where the device is CUDA (False: always eager)."""
        if cache.storage is None or cache.dummy_slot is None:
            raise ValueError("a fixed-shape step needs a static KV cache with a dummy slot")
        if cache.storage_len % PAGE_SIZE:
            raise ValueError(f"the KV cache's storage length must be a multiple of {PAGE_SIZE}")
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.max_batch = bucket(max_batch, BATCH_BUCKETS)
        self.max_nodes = bucket(max_nodes, NODE_BUCKETS)
        config = model.config
        self.vocab = config.vocab_size
        width = _FIXED + 5 * self.max_nodes
        pinned = self.device.type == "cuda"
        self.inp = torch.zeros(self.max_batch, width, dtype=torch.int64, device=self.device)
        self.staging = torch.zeros(self.max_batch, width, dtype=torch.int64, pin_memory=pinned)
        self.out = torch.zeros(self.max_batch, 3 * self.max_nodes + 1, dtype=torch.int64, device=self.device)
        self.out_host = torch.zeros(self.out.shape, dtype=torch.int64, pin_memory=pinned)
        self.hidden = torch.zeros(
            self.max_batch, self.max_nodes, config.hidden_size, dtype=cache.dtype, device=self.device
        )
        """[max_batch, max_nodes, hidden] the last step's last-layer states (before the final norm) of the
        nodes that sampled each emitted token, in the order of `StepResult.path`."""
        # Held here so a later, longer table elsewhere never frees what a graph reads.
        self.cos, self.sin = model.rotary.tables(cache.storage_len, self.device, cache.dtype)
        self._pages = cache.storage_len // PAGE_SIZE
        self._staged = self.staging.numpy()
        self._padding(self._staged)
        self.inp.copy_(self.staging)
        self.runner = GraphRunner(self._step, self.device, enabled=graphs)
        self.steps = 0
        self.last_host_s = 0.0
        """Host seconds of the last `run` up to the launch (pack, copy, replay): what a GPU waits on."""

    # -----------------------------------------------------------------------------------------------------
    # Host side

    def key(self, rows: Sequence[StepRow], *, nodes: int | None = None) -> StepKey:
        """The key `run` would use for `rows` (nodes: at least this many per row)."""
        n = max(len(r.tokens) for r in rows)
        return StepKey(
            batch=bucket(len(rows), BATCH_BUCKETS),
            nodes=bucket(max(n, nodes or 1), NODE_BUCKETS),
            filtered=any(_filtered(r.params, self.vocab) for r in rows),
            rejection=any(r.rejection for r in rows),
            tree=any(r.parents is not None and len(r.tokens) > 1 for r in rows),
        )

    def run(self, rows: Sequence[StepRow], *, nodes: int | None = None) -> StepResult:
        """Score and decide `rows` (at most max_batch, each at most max_nodes nodes) in one step. The result's
        arrays are views of a pinned buffer: valid until the next `run`."""
        if not rows or len(rows) > self.max_batch:
            raise ValueError(f"a step takes 1..{self.max_batch} rows, got {len(rows)}")
        started = time.perf_counter()
        key = self.key(rows, nodes=nodes)
        if key.nodes > self.max_nodes:
            raise ValueError(f"{key.nodes} nodes a row exceed this step's max_nodes {self.max_nodes}")
        self.pack(rows, key)
        self.inp[: key.batch].copy_(self.staging[: key.batch], non_blocking=True)
        self.runner(key)
        self.last_host_s = time.perf_counter() - started
        self.steps += 1
        count = len(rows)
        out = self.out_host[:count]
        out.copy_(self.out[:count], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        block = out.numpy()
        n = self.max_nodes
        return StepResult(
            tokens=block[:, :n],
            logprobs=block[:, n : 2 * n].view(np.float64),
            path=block[:, 2 * n : 3 * n],
            accept_length=block[:, 3 * n],
        )

    def pack(self, rows: Sequence[StepRow], key: StepKey) -> None:
        """Write `rows` (and padding up to the bucket) into the pinned staging block: column by column for
        what every row has, a loop only over rows with drafts."""
        block = self._staged
        n, m, count = key.nodes, self.max_nodes, len(rows)
        self._padding(block[: key.batch])
        real = block[:count]
        params = [r.params for r in rows]
        real[:, _SLOT] = [r.slot for r in rows]
        real[:, _CTX] = [r.context for r in rows]
        real[:, _TEMP] = np.array([p.temperature for p in params], dtype=np.float64).view(np.int64)
        real[:, _TOP_P] = np.array([p.top_p for p in params], dtype=np.float64).view(np.int64)
        real[:, _TOP_K] = [p.top_k for p in params]
        real[:, _SEED] = [p.seed for p in params]
        real[:, _REJECT] = [r.rejection for r in rows]
        tokens, bits = _FIXED + _TOKENS * m, _FIXED + _BITS * m
        real[:, tokens] = [r.tokens[0] for r in rows]  # the pending token: parent -1, depth 0, bit 0
        real[:, _FIXED + _VALID * m] = 1
        # A real row's padding nodes see its cached prefix only (bits 0) and write to the dummy slot.
        real[:, bits + 1 : bits + n] = 0
        for b, row in enumerate(rows):
            size = len(row.tokens)
            if size == 1:
                continue
            parents = _pass_parents(row.parents, size)
            depths, node_bits = _depths_and_bits(parents)
            real[b, tokens : tokens + size] = row.tokens
            real[b, _FIXED + _PARENTS * m : _FIXED + _PARENTS * m + size] = parents
            real[b, _FIXED + _DEPTHS * m : _FIXED + _DEPTHS * m + size] = depths
            real[b, _FIXED + _VALID * m : _FIXED + _VALID * m + size] = 1
            real[b, bits : bits + size] = node_bits

    def _padding(self, block: np.ndarray) -> None:
        """Padding rows: the dummy slot, no context, every node its own only visible new node."""
        m = self.max_nodes
        block[:] = 0
        block[:, _SLOT] = self.cache.dummy_slot
        block[:, _TEMP] = _f64_bits(1.0)
        block[:, _TOP_P] = _f64_bits(1.0)
        block[:, _FIXED + _BITS * m : _FIXED + (_BITS + 1) * m] = 1 << np.arange(m, dtype=np.int64)
        block[:, _FIXED + _PARENTS * m : _FIXED + (_PARENTS + 1) * m] = -1

    def keys_for(self, spec: SpecConfig | None, rows: int) -> list[StepKey]:
        """Every key steps of at most `rows` rows can meet decoding under `spec` (None: plain): each batch
        bucket and node bucket up to those (capped at this step's), rows with and without top-k/top-p,
        verification by matching (and by rejection in its mode), chains (and trees where topk > 1)."""
        on = spec is not None and spec.enabled
        top_batch = bucket(min(max(rows, 1), self.max_batch), BATCH_BUCKETS)
        top_nodes = bucket(min(1 + spec.verify_budget if on else 1, self.max_nodes), NODE_BUCKETS)
        keys = []
        for b in (b for b in BATCH_BUCKETS if b <= top_batch):
            for n in (n for n in NODE_BUCKETS if n <= top_nodes):
                for rej in (False, True) if on and spec.mode == "rejection" and n > 1 else (False,):
                    for tree in (False, True) if on and spec.topk > 1 and n > 1 else (False,):
                        keys += [StepKey(b, n, filtered, rej, tree) for filtered in (False, True)]
        return keys

    def capture(self, keys: Sequence[StepKey]) -> int:
        """Capture `keys` now (largest first), on padding rows only: nothing real is written. Returns how
        many were new (0 where graphs are off)."""
        self._padding(self._staged)
        self.inp.copy_(self.staging)
        return self.runner.capture(keys, size=lambda k: k.batch * k.nodes)

    # -----------------------------------------------------------------------------------------------------
    # Device side: no host reads, no data-dependent shapes, outputs into persistent buffers

    def _step(self, key: StepKey) -> None:
        batch, n, m = key.batch, key.nodes, self.max_nodes
        inp = self.inp[:batch]
        slot, ctx = inp[:, _SLOT], inp[:, _CTX]  # [B]
        temperature = inp[:, _TEMP].view(torch.float64).float()
        top_p = inp[:, _TOP_P].view(torch.float64).float()
        top_k, seeds = inp[:, _TOP_K], inp[:, _SEED]
        section = [inp[:, _FIXED + s * m : _FIXED + s * m + n] for s in range(5)]
        tokens, parents, depths = section[_TOKENS], section[_PARENTS], section[_DEPTHS]  # [B, N]
        valid = section[_VALID] != 0
        bits = section[_BITS]
        node = torch.arange(n, device=self.device)  # [N]
        # [B, N, V], [B, N, hidden]; every node's K/V is in the cache from here on
        logits, states = self._score(slot, ctx, tokens, depths, valid, bits, node)

        out = self.out[:batch]
        positions = ctx + 1  # where the token after the pending one goes
        if n == 1:
            token, logprob = sample_static(
                logits[:, 0], temperature, top_p, top_k, seeds, positions, filtered=key.filtered
            )
            out[:, 0] = token
            out[:, m] = logprob.double().view(torch.int64)
            out[:, 2 * m] = 0
            out[:, 3 * m] = 0
            self.hidden[:batch, :1].copy_(states)
            return
        drawn, drawn_lp = draw_static(
            logits, temperature, top_p, top_k, seeds, positions, depths, filtered=key.filtered
        )
        path, accept = match_walk(tokens, parents, valid, drawn, n - 1)  # [B, N], [B]
        out_tokens, out_lp = emitted(path, accept, drawn, drawn_lp)  # [B, N] ×2
        if key.rejection:
            reject = inp[:, _REJECT] != 0  # [B]
            r_path, r_accept, r_tokens, r_lp = self._rejection(
                key, logits, tokens, parents, valid, temperature, top_p, top_k, seeds, positions, node
            )
            path = torch.where(reject[:, None], r_path, path)
            accept = torch.where(reject, r_accept, accept)
            out_tokens = torch.where(reject[:, None], r_tokens, out_tokens)
            out_lp = torch.where(reject[:, None], r_lp.to(out_lp.dtype), out_lp)
        if key.tree:
            self._commit(slot, ctx, path, accept)
        # The states that sampled each emitted token, in emission order (a chain's path is 0, 1, …).
        self.hidden[:batch, :n].copy_(states.gather(1, path[..., None].expand(-1, -1, states.shape[-1])))
        out[:, :n] = out_tokens
        out[:, m : m + n] = out_lp.double().view(torch.int64)
        out[:, 2 * m : 2 * m + n] = path
        out[:, 3 * m] = accept

    def _score(
        self,
        slot: Tensor,
        ctx: Tensor,
        tokens: Tensor,
        depths: Tensor,
        valid: Tensor,
        bits: Tensor,
        node: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """The model over every node: logits [B, N, V] and last-layer states [B, N, hidden]; each node's K/V
        is written to the cache (a padding node's to the dummy slot) as its layer runs."""
        batch, n = tokens.shape
        model, cache = self.model, self.cache
        config = model.config
        assert cache.dummy_slot is not None
        rope = (ctx[:, None] + depths).reshape(-1)  # [B*N]
        store_slot = torch.where(valid, slot[:, None], cache.dummy_slot).reshape(-1)
        store_pos = torch.where(valid, ctx[:, None] + node, node).reshape(-1)
        table = slot[:, None] * self._pages + torch.arange(self._pages, device=self.device)  # [B, pages]
        cos, sin = self.cos[rope][:, None], self.sin[rope][:, None]  # [B*N, 1, hd]
        heads, hd = config.num_attention_heads, config.head_dim

        x = model.embed_tokens(tokens.reshape(-1))  # [B*N, hidden]
        for layer, k_cache, v_cache in zip(model.layers, cache.keys, cache.values, strict=True):
            attn = layer.attn
            q, k, v = attn._qkv(layer.input_norm(x), cos, sin)  # [B*N, H, hd], [B*N, KVH, hd] ×2
            store_kv(k_cache, v_cache, k, v, store_slot, store_pos)
            o = paged_attention(
                q.reshape(batch, n, heads, hd), k_cache, v_cache, table, ctx, bits,
                scale=hd**-0.5, page_size=PAGE_SIZE,
            )  # fmt: skip
            x = x + attn.o_proj(o.reshape(batch * n, heads * hd))
            x = x + layer.mlp(layer.post_norm(x))
        return model.head(x).view(batch, n, -1), x.view(batch, n, -1)

    def _rejection(
        self,
        key: StepKey,
        logits: Tensor,
        tokens: Tensor,
        parents: Tensor,
        valid: Tensor,
        temperature: Tensor,
        top_p: Tensor,
        top_k: Tensor,
        seeds: Tensor,
        positions: Tensor,
        node: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Every row verified by rejection sampling, a tree's or a chain's law by the key: (path [B, N],
        accept_length [B], tokens [B, N], log-probs [B, N]); the caller keeps them for the rows that ask."""
        batch, n = tokens.shape
        q = processed_probs_static(
            logits.reshape(batch * n, -1),
            temperature.repeat_interleave(n),
            top_p.repeat_interleave(n),
            top_k.repeat_interleave(n),
            filtered=key.filtered,
        ).view(batch, n, -1)  # [B, N, V]
        if key.tree:
            return rejection_tree_static(tokens, parents, valid, q, seeds, positions, n - 1, n - 1)
        lengths = valid[:, 1:].sum(1)
        r_accept, r_tokens, r_lp = rejection_chain_static(tokens[:, 1:], None, q, seeds, positions, lengths)
        return node.expand(batch, n), r_accept, r_tokens, r_lp

    def _commit(self, slot: Tensor, ctx: Tensor, path: Tensor, accept: Tensor) -> None:
        """Move each row's accepted nodes' K/V to ctx, ctx+1, … in every layer at once (one gather, one
        scatter over the cache's storage); entries past the accepted path copy onto themselves."""
        storage = self.cache.storage
        assert storage is not None
        _, layers, slots, kv_heads, length, hd = storage.shape
        n = path.shape[1]
        node = torch.arange(n, device=self.device)
        keep = node[None, :] <= accept[:, None]  # [B, N]
        source = ctx[:, None] + torch.where(keep, path, node)  # [B, N]
        target = ctx[:, None] + node
        head = torch.arange(kv_heads, device=self.device)
        base = (slot[:, None] * kv_heads + head[None, :]) * length  # [B, KVH]
        src = (base[:, :, None] + source[:, None, :]).reshape(-1)  # [B*KVH*N]
        dst = (base[:, :, None] + target[:, None, :]).reshape(-1)
        flat = storage.view(2 * layers, slots * kv_heads * length, hd)
        flat.index_copy_(1, dst, flat.index_select(1, src))


def _filtered(params: SamplingParams, vocab: int) -> bool:
    return params.temperature > 0 and (params.top_p < 1 or 0 < params.top_k < vocab)


def _f64_bits(value: float) -> int:
    return int(np.array(value, dtype=np.float64).view(np.int64))


def _pass_parents(parents: Sequence[int] | None, size: int) -> list[int]:
    """[size] parents in verify-pass numbering: the pending token -1, then each draft's node."""
    if parents is None:
        return list(range(-1, size - 1))
    if len(parents) != size - 1:
        raise ValueError(f"{size - 1} draft tokens need as many parents, got {len(parents)}")
    return [-1, *(p + 1 for p in parents)]


def _depths_and_bits(parents: Sequence[int]) -> tuple[list[int], list[int]]:
    """Depth of every node and its visibility bits (self and ancestors) from topological parents."""
    depths: list[int] = []
    bits: list[int] = []
    for i, p in enumerate(parents):
        if p < 0:
            depths.append(0)
            bits.append(1 << i)
        else:
            depths.append(depths[p] + 1)
            bits.append(bits[p] | (1 << i))
    return depths, bits
