"""The host side of a `Generator` iteration: running sequences packed into one pass's inputs.

Two shapes, one per path. `FlatPass` is the dynamic path's flat forward pass (`BatchLayout`): the
decodes' pending tokens (each followed by its draft in a verify pass), then prefill chunks; a prompt
completed in the pass samples its first token there, as a decode with an empty draft. `step_rows` is the
fixed-shape path's: one `StepRow` per decode for `StaticStep`, which prefills nothing.

Non-obvious choices:
- Pass node 0 of a decode is its pending token, nodes 1.. its draft: a chain keeps the causal mask, a
  tree gets its ancestor-or-self mask (`tree.tree_attention_mask`), made on the cache's device.
- Logit rows are only the tokens that sample: a prefill chunk that does not finish its prompt has none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from slipstream.engine.batch import BatchLayout
from slipstream.engine.kv_cache import KVCache
from slipstream.engine.scheduler import Running
from slipstream.engine.static_step import StepRow
from slipstream.engine.tree import tree_attention_mask
from slipstream.engine.verify import EMPTY, Proposal, VerifyEntry

__all__ = ["FlatPass", "step_rows"]


@dataclass
class FlatPass:
    """One flat forward pass: per sequence its slot, new tokens and tree mask; the rows that sample."""

    slots: list[int] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    """[num_tokens] the new tokens of every sequence, in order."""
    sizes: list[int] = field(default_factory=list)
    """New tokens per sequence."""
    masks: list[Tensor | None] = field(default_factory=list)
    """Per sequence its [n, n] tree mask, None for causal."""
    logit_rows: list[int] = field(default_factory=list)
    """Flat rows whose logits are read: every node of a verified draft, a prompt's last token."""
    emitting: list[Running] = field(default_factory=list)
    """The sequences that sample in this pass, in the order of their logit rows."""
    entries: list[VerifyEntry] = field(default_factory=list)
    """A verify pass's: one per emitting sequence (decodes first, then prompts completed in this pass)."""

    @classmethod
    def plain(cls, plan: Sequence[tuple[Running, int]]) -> FlatPass:
        """Plain decoding: `plan` is (sequence, new tokens) with the decodes first, each with its pending
        token (1)."""
        flat = cls()
        for seq, n in plan:
            flat.slots.append(seq.slot)
            flat.sizes.append(n)
            flat.masks.append(None)
            flat.input_ids.extend(seq.tokens[seq.num_cached : seq.num_cached + n])
            if seq.num_cached + n == len(seq.tokens):
                flat.logit_rows.append(len(flat.input_ids) - 1)
                flat.emitting.append(seq)
        return flat

    @classmethod
    def verify(
        cls,
        decodes: Sequence[Running],
        proposals: Sequence[Proposal],
        plan: Sequence[tuple[Running, int]],
        device: torch.device,
    ) -> FlatPass:
        """A verify pass: every decode's pending token and its proposal, then the prefill chunks of `plan`;
        tree masks on `device`."""
        flat = cls()
        for seq, proposal in zip(decodes, proposals, strict=True):
            flat.slots.append(seq.slot)
            flat.entries.append(
                VerifyEntry(len(flat.logit_rows), proposal, seq.request.params, len(seq.tokens))
            )
            flat.emitting.append(seq)
            flat.logit_rows.extend(range(len(flat.input_ids), len(flat.input_ids) + proposal.size + 1))
            flat.input_ids.append(seq.tokens[-1])
            flat.input_ids.extend(proposal.tokens)
            flat.sizes.append(proposal.size + 1)
            flat.masks.append(None if proposal.parents is None else _tree_mask(proposal, device))
        for seq, n in plan:
            flat.slots.append(seq.slot)
            flat.input_ids.extend(seq.tokens[seq.num_cached : seq.num_cached + n])
            flat.sizes.append(n)
            flat.masks.append(None)
            if seq.num_cached + n == len(seq.tokens):  # prompt done: its first token, an empty draft
                flat.entries.append(
                    VerifyEntry(len(flat.logit_rows), EMPTY, seq.request.params, len(seq.tokens))
                )
                flat.emitting.append(seq)
                flat.logit_rows.append(len(flat.input_ids) - 1)
        return flat

    def layout(self, cache: KVCache) -> BatchLayout:
        """The pass's attention plan, its positions reserved in `cache` (`BatchLayout.build`)."""
        return BatchLayout.build(
            cache,
            self.slots,
            self.sizes,
            tree_masks=self.masks if any(m is not None for m in self.masks) else None,
            logit_rows=self.logit_rows,
        )


def _tree_mask(proposal: Proposal, device: torch.device) -> Tensor:
    """[n + 1, n + 1] visibility among a tree proposal's verify-pass nodes, on `device`."""
    parents = torch.tensor(proposal.pass_parents(), dtype=torch.int64, device=device)
    return tree_attention_mask(parents, depth=max(proposal.depths()))


def step_rows(
    decodes: Sequence[Running], proposals: Sequence[Proposal], rejection_mode: bool
) -> list[StepRow]:
    """One fixed-shape row per decode: its pending token and proposal; verified by rejection where the mode
    is "rejection" (`rejection_mode`), the draft not empty and the row not greedy."""
    return [
        StepRow(
            slot=seq.slot,
            context=seq.num_cached,
            params=seq.request.params,
            tokens=[seq.tokens[-1], *proposal.tokens],
            parents=proposal.parents,
            rejection=rejection_mode and proposal.size > 0 and not seq.request.params.greedy,
        )
        for seq, proposal in zip(decodes, proposals, strict=True)
    ]
