"""Fixed-shape rounds of the EAGLE drafter: its committed-pairs pass, and a whole chain, one step each.

An `EagleDrafter` built static (the default where the device replays CUDA graphs, as for the Generator's
`StaticStep`) runs both through `EagleRounds`: the host packs one int64 block (slot, cached pairs, new
pairs, seed, position, temperature bits, tokens) into pinned memory, copies it once, and a `GraphRunner`
replays the pass for its key — ("extend", rows, width) or ("chain", rows, k, keyed, restricted) — so the
k - 1 head steps of a chain are one graph, and its tokens come back in one copy. Rows are bucketed
(static_step.BATCH_BUCKETS), padding rows point at the drafter cache's dummy slot; an extend pass's width
is a bucket of EXTEND_WIDTHS. On a CPU the same functions run eagerly (how the suite tests them).

Non-obvious choices:
- Attention gets the whole slot's page table and reads lengths from the device: no host `reach`.
- Everything a replay reads is updated in place: the head (`load_state`), the target's embedding and head
  (the rollout's weight updates), the draft vocabulary's rows, ids and bias (`DraftVocabulary.fix`:
  re-chosen and re-gathered on the host before each round), the cache, the features and `last`.
- EAGLE-2 trees still expand node by node on the dynamic path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from slipstream.engine.graphs import GraphRunner
from slipstream.engine.static_step import BATCH_BUCKETS, bucket

if TYPE_CHECKING:
    from slipstream.engine.drafters.base import DraftState
    from slipstream.engine.drafters.eagle import EagleDrafter, _Request

__all__ = ["EXTEND_PAIRS", "EXTEND_WIDTHS", "MAX_CHAIN", "EagleRounds", "extend_rows"]

EXTEND_PAIRS = 32
"""Committed pairs a row in one pass of the head (more wait for the next pass)."""
EXTEND_WIDTHS = (1, 2, 4, 8, 16, EXTEND_PAIRS)
"""Pairs a row an extend pass is shaped for (the smallest bucket holding the widest row runs)."""
MAX_CHAIN = 32
"""The longest chain a round drafts (longer ones take the dynamic path)."""

_SLOT, _CTX, _COUNT, _SEED, _POS, _TEMP = range(6)
_FIXED = 6  # columns before the tokens


def extend_rows(jobs: Sequence[tuple[_Request, DraftState, int, int]], width: int) -> list[list[int]]:
    """Per job (request, state, lo, hi) the ints of its pass row: slot, cached pairs, new pairs, then the
    tokens after window positions lo … hi - 1, zero-padded to `width`."""
    rows = []
    for request, state, lo, hi in jobs:
        ids = state.tokens[request.start + lo + 1 : request.start + hi + 1]
        ids = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        rows.append([request.slot, lo, hi - lo, *ids, *[0] * (width - (hi - lo))])
    return rows


class EagleRounds:
    """Persistent buffers and the fixed-shape passes of one `EagleDrafter` (see the module docstring)."""

    def __init__(self, drafter: EagleDrafter, *, graphs: bool = True) -> None:
        cache = drafter.cache
        if cache.dummy_slot is None:
            raise ValueError("fixed-shape drafter rounds need a drafter cache with a dummy slot")
        self.drafter = drafter
        self.device = cache.device
        self.max_rows = bucket(min(cache.num_slots, BATCH_BUCKETS[-1]), BATCH_BUCKETS)
        pinned = self.device.type == "cuda"
        width = _FIXED + EXTEND_PAIRS
        self.inp = torch.zeros(self.max_rows, width, dtype=torch.int64, device=self.device)
        self.staging = torch.zeros(self.max_rows, width, dtype=torch.int64, pin_memory=pinned)
        self.tokens = torch.zeros(self.max_rows, MAX_CHAIN, dtype=torch.int64, device=self.device)
        """[max_rows, MAX_CHAIN] the last chain round's tokens."""
        self.tokens_host = torch.zeros(self.tokens.shape, dtype=torch.int64, pin_memory=pinned)
        self._staged = self.staging.numpy()
        drafter.vocab.fix()
        self.runner = GraphRunner(self._run, self.device, enabled=graphs)
        self.rounds = 0

    # -----------------------------------------------------------------------------------------------------
    # Host side

    def extend(self, jobs: Sequence[tuple[_Request, DraftState, int, int]]) -> None:
        """Run the head over pairs [lo, hi) (at most EXTEND_PAIRS) of each job's request, then the host's
        bookkeeping (`EagleDrafter.extended`)."""
        for at in range(0, len(jobs), self.max_rows):
            part = jobs[at : at + self.max_rows]
            width = bucket(max(hi - lo for _, _, lo, hi in part), EXTEND_WIDTHS)
            rows = bucket(len(part), BATCH_BUCKETS)
            block = self._padding(rows)
            block[: len(part), : _FIXED + width] = _with_keys(extend_rows(part, width))
            self._launch(("extend", rows, width), rows)
            self.drafter.extended(part)

    def chains(self, requests: Sequence[_Request], states: Sequence[DraftState], k: int) -> list[Tensor]:
        """Chains of k tokens (host tensors) for `requests`, as `EagleDrafter.chain_pass` drafts them."""
        if k > MAX_CHAIN:
            raise ValueError(f"a chain round drafts at most {MAX_CHAIN} tokens, got {k}")
        restricted = self.drafter.vocab.refresh()  # host: re-choose / re-gather in place before the replay
        out: list[Tensor] = []
        for at in range(0, len(requests), self.max_rows):
            part, part_states = requests[at : at + self.max_rows], states[at : at + self.max_rows]
            n, rows = len(part), bucket(len(part), BATCH_BUCKETS)
            keyed = any(s.keyed and not s.params.greedy for s in part_states)
            block = self._padding(rows)
            block[:n, _SLOT] = [r.slot for r in part]
            block[:n, _CTX] = [r.cached for r in part]
            if keyed:
                block[:n, _SEED] = [s.params.seed for s in part_states]
                block[:n, _POS] = [s.position for s in part_states]
                temperature = [s.params.temperature if s.keyed else 0.0 for s in part_states]
                block[:n, _TEMP] = np.array(temperature, dtype=np.float64).view(np.int64)
            self._launch(("chain", rows, k, keyed, restricted), rows)
            host = self.tokens_host[:n]
            host.copy_(self.tokens[:n], non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            out.extend(host[:, :k].clone())
        return out

    def keys_for(self, rows: int, ks: Sequence[int]) -> list[tuple]:
        """Every key rounds of at most `rows` rows drafting chains of `ks` tokens can meet: extend passes of
        every width, chains keyed or not, over the draft vocabulary or the whole."""
        top = bucket(min(max(rows, 1), self.max_rows), BATCH_BUCKETS)
        sizes = [r for r in BATCH_BUCKETS if r <= top]
        keys: list[tuple] = [("extend", r, w) for r in sizes for w in EXTEND_WIDTHS]
        flags = [(keyed, restricted) for keyed in (False, True) for restricted in (False, True)]
        return keys + [("chain", r, k, *f) for r in sizes for k in ks for f in flags]

    def capture(self, rows: int, ks: Sequence[int]) -> int:
        """Capture `keys_for(rows, ks)` now, on padding rows (the dummy slot): nothing real is written.
        Returns the new graphs (0 where none are replayed)."""
        self._padding(self.max_rows)
        self.inp.copy_(self.staging)
        return self.runner.capture(self.keys_for(rows, ks), size=lambda key: key[1] * key[2])

    def stage(self, slots: Sequence[int], cached: Sequence[int], count: Sequence[int] | None = None) -> int:
        """Load rows of slots with `cached` pairs (and `count` new ones of token 0) into the device block,
        padding to the bucket; returns the bucket. For timing a round's key on chosen rows (bench gpu)."""
        rows = bucket(len(slots), BATCH_BUCKETS)
        block = self._padding(rows)
        block[: len(slots), _SLOT] = slots
        block[: len(slots), _CTX] = cached
        if count is not None:
            block[: len(slots), _COUNT] = count
        self.inp[:rows].copy_(self.staging[:rows])
        return rows

    def _padding(self, rows: int) -> np.ndarray:
        """The staging block's first `rows` rows as padding (dummy slot, nothing cached, no pairs)."""
        block = self._staged[:rows]
        block[:] = 0
        block[:, _SLOT] = self.drafter.cache.dummy_slot
        return block

    def _launch(self, key: tuple, rows: int) -> None:
        self.inp[:rows].copy_(self.staging[:rows], non_blocking=True)
        self.runner(key)
        self.rounds += 1

    # -----------------------------------------------------------------------------------------------------
    # Device side: no host reads, no data-dependent shapes

    def _run(self, key: tuple) -> None:
        drafter = self.drafter
        if key[0] == "extend":
            _, rows, width = key
            block = self.inp[:rows]
            ids = block[:, _FIXED : _FIXED + width]
            drafter.extend_pass(block[:, _SLOT], block[:, _CTX], block[:, _COUNT], ids, reach=None)
            return
        _, rows, k, keyed, restricted = key
        block = self.inp[:rows]
        keys = (
            (block[:, _TEMP].view(torch.float64).float(), block[:, _SEED], block[:, _POS]) if keyed else None
        )
        tokens = drafter.chain_pass(
            block[:, _SLOT], block[:, _CTX], keys, k, reach=None, restricted=restricted
        )
        self.tokens[:rows, :k].copy_(tokens)


def _with_keys(rows: list[list[int]]) -> np.ndarray:
    """Extend-pass rows (slot, cached, count, tokens…) laid out in the block's columns (no keys)."""
    block = np.asarray(rows, dtype=np.int64)
    out = np.zeros((block.shape[0], block.shape[1] + _FIXED - 3), dtype=np.int64)
    out[:, :3] = block[:, :3]
    out[:, _FIXED:] = block[:, 3:]
    return out
