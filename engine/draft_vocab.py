"""The draft vocabulary of an EAGLE drafter: the tokens it may propose, and its logits over them.

At small batch a draft step is a matrix-vector product bound by reading the LM head ([V, d]: 113 MB for
SmolLM2 in fp32, 13 ms per step on one CPU core, as much as the rest of a chain). Drafts are proposals,
verified by the target over the full vocabulary, so restricting which tokens a drafter may propose changes
speed, never output. `DraftVocabulary` keeps the `size` most frequent tokens counted so far (prompts and
committed responses, plus optional priors such as the head's training data) and a packed copy of their LM
head rows, re-chosen as the counts move: EAGLE-3's reduced draft vocabulary, learnt online. The rows are
a copy, so they are re-gathered whenever the LM head changes (a rollout applies weight updates in place:
the check is the head tensor's storage and version counter, per draft call).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from slipstream.engine.model import Transformer, _linear, _PackedWeight

__all__ = ["DraftVocabulary", "draft_logits"]

RECHOOSE_EVERY = 256
"""Counted tokens after which the vocabulary is re-chosen (each choice copies and repacks its rows)."""


def draft_logits(target: Transformer, out: Tensor) -> Tensor:
    """Logits [..., V] of head outputs [..., d] through the target's LM head alone (inference path)."""
    out = out.to(target.lm_head_weight.dtype)
    if target.lm_head is not None:
        return target.lm_head(out)
    # Tied head: reuse the target's prepacked copy of the embedding matrix rather than packing another.
    return _linear(out, target.embed_tokens.weight, None, target._tied_head_pack)


class DraftVocabulary:
    """Token counts and the `size` most frequent tokens' LM head rows (size 0: the full vocabulary)."""

    def __init__(self, target: Transformer, size: int) -> None:
        if size < 0:
            raise ValueError(f"draft_vocab must be >= 0, got {size}")
        self.target = target
        self.size = size
        self.counts = [0] * target.config.vocab_size
        """Per token id: how often it was counted."""
        self.frozen = False
        """While True, `count` ignores what it is given (a warm-up's synthetic tokens are not the task's)."""
        self._distinct = 0
        self._counted_since = 0  # tokens counted since the vocabulary was last chosen
        self._held: tuple[Tensor, Tensor, _PackedWeight] | None = None  # (ids [U], head rows [U, d], pack)
        self._held_from: tuple[int, int] | None = None  # (data_ptr, _version) of the head the rows copy
        # `fix`: ids, rows, bias and their pack, in buffers that keep their addresses.
        self._fixed: tuple[Tensor, Tensor, Tensor, _PackedWeight] | None = None

    @property
    def vocab_size(self) -> int:
        return len(self.counts)

    @property
    def ids(self) -> Tensor | None:
        """The ids [U] (sorted) drafts are restricted to now, or None before the first choice."""
        return None if self._held is None else self._held[0]

    def count(self, tokens: Iterable[int]) -> None:
        """Count observed tokens (ids known to be in range), unless `frozen`."""
        if self.frozen:
            return
        for token in tokens:
            self._add(token, 1)

    def prime(self, counts: Mapping[int, int]) -> None:
        """Add prior counts (token id → count); the vocabulary is re-chosen at the next draft. Ids out of
        range raise."""
        bad = [t for t in counts if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token counts: ids {bad[:5]} out of range for vocabulary {self.vocab_size}")
        for token, n in counts.items():
            if n > 0:
                self._add(token, int(n))
        self._held = None

    def _add(self, token: int, n: int) -> None:
        if not self.counts[token]:
            self._distinct += 1
        self.counts[token] += n
        self._counted_since += n

    def logits(self, outs: Tensor) -> tuple[Tensor, Tensor | None]:
        """(logits [..., U] of head outputs over the draft vocabulary, its ids [U]; None: all V ids)."""
        if not self.refresh():
            return draft_logits(self.target, outs), None
        assert self._held is not None
        ids, rows, pack = self._held
        return _linear(outs.to(rows.dtype), rows, None, pack), ids

    def refresh(self) -> bool:
        """Re-choose the vocabulary if the counts moved enough, re-gather its rows if the LM head changed in
        place; False where drafts use the whole vocabulary. (Host bookkeeping: a fixed-shape draft round
        calls it before it runs, `logits` on every call.)"""
        if not self.size or self.size >= self.vocab_size or not self._distinct:
            return False
        # Re-choose when enough has been counted, and while the vocabulary is not full, once the new
        # tokens are 1/16 of it (not on every new token).
        held = 0 if self._held is None else self._held[0].numel()
        if (
            self._held is None
            or self._counted_since >= RECHOOSE_EVERY
            or (held < self.size and self._distinct >= held + max(1, held // 16))
        ):
            device = self.target.lm_head_weight.device
            counts = torch.tensor(self.counts, device=device)  # [V]
            ids = counts.topk(min(self.size, self._distinct)).indices.sort().values  # [U]
            if self._held is None or not torch.equal(ids, self._held[0]):
                self._gather(ids)
            self._counted_since = 0
        assert self._held is not None
        weight = self.target.lm_head_weight
        if (weight.data_ptr(), weight._version) != self._held_from:
            self._gather(self._held[0])  # the head changed under the rows (an in-place weight update)
        return True

    def fix(self) -> None:
        """Hold the vocabulary in buffers of `size` rows that keep their addresses (what a captured draft
        round binds): ids [size], head rows [size, d] and a bias [size] of 0 for held rows and -inf for the
        padding past them, re-written in place by every re-choice and re-gather."""
        if self._fixed is not None or not self.size or self.size >= self.vocab_size:
            return
        weight = self.target.lm_head_weight
        with torch.inference_mode(False):  # normal tensors: the CPU pack is keyed by their version counter
            rows = torch.zeros(self.size, weight.shape[1], dtype=weight.dtype, device=weight.device)
        ids = torch.zeros(self.size, dtype=torch.int64, device=weight.device)
        bias = torch.full((self.size,), float("-inf"), dtype=weight.dtype, device=weight.device)
        self._fixed = (ids, rows, bias, _PackedWeight())
        if self._held is not None:
            self._gather(self._held[0])

    def fixed_logits(self, outs: Tensor) -> tuple[Tensor, Tensor]:
        """(logits [..., size] over the fixed buffers, -inf past the held tokens; ids [size]): no host work,
        so it can run inside a captured round after `refresh` returned True (`fix` first)."""
        assert self._fixed is not None, "fix() the vocabulary first"
        ids, rows, bias, pack = self._fixed
        return _linear(outs.to(rows.dtype), rows, None, pack) + bias, ids

    def _gather(self, ids: Tensor) -> None:
        """Hold the LM head's rows of `ids` [U] (on the head's device), with a fresh pack for them."""
        weight = self.target.lm_head_weight
        if self._fixed is not None:
            fixed_ids, fixed_rows, bias, _ = self._fixed
            u = ids.numel()
            with torch.inference_mode(False):
                torch.index_select(weight.detach(), 0, ids, out=fixed_rows[:u])
                fixed_rows[u:].zero_()
            fixed_ids[:u].copy_(ids)
            fixed_ids[u:].zero_()
            bias[:u].zero_()
            bias[u:].fill_(float("-inf"))
            self._held = (ids, fixed_rows[:u], _PackedWeight())
        else:
            # A normal tensor, not an inference one: its prepacked copy is keyed by its version counter.
            with torch.inference_mode(False):
                rows = weight.detach().index_select(0, ids).contiguous()  # [U, d]
            self._held = (ids, rows, _PackedWeight())
        self._held_from = (weight.data_ptr(), weight._version)
