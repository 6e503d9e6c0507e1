"""The "hybrid" drafter: per request, the n-gram draft where the group's tables hold a match, else the EAGLE
head's. The "cascade" arm is the same with the history drafter's view over history and siblings in front.

Why: in a GRPO rollout the two drafters are right in different places. Where a response repeats its prompt
or a sibling (the common case in the tail, and in degenerate loops) an n-gram chain is long, free to make
and mostly accepted; elsewhere it has nothing to offer, and a request without a draft decodes one token
per pass. The head drafts everywhere, at a cost (a few ms per step on a CPU core) and with a shorter
accept length than a good n-gram match. Asking the head only for the requests without a match gets both.

It owns nothing: it drafts with the speculator's own n-gram and EAGLE drafters, which the speculator keeps
informed (`observe`, `reset`) as it does every held drafter, so the hybrid's own hooks do nothing and no
commit is seen twice. Drafts change speed only: verification makes every draft lossless.
"""

from __future__ import annotations

from collections.abc import Sequence

from slipstream.engine.drafters.base import Draft, Drafter, DraftState

__all__ = ["HybridDrafter"]


class HybridDrafter(Drafter):
    """The first drafter's draft where it has one (n-gram, or history and siblings), the EAGLE head's elsewhere
    (see the module docstring)."""

    name = "hybrid"
    uses_hidden = True

    def __init__(self, ngram: Drafter, eagle: Drafter, head_depth: int = 0) -> None:
        """head_depth: the most levels the head drafts (0: the arm's depth). A long arm (cascade:d8) drafts
        long where text repeats; the head's later tokens are rarely accepted and each costs a head step."""
        self.ngram, self.eagle, self.head_depth = ngram, eagle, head_depth

    def propose(self, states: Sequence[DraftState], depth: int, topk: int, verify: int) -> list[Draft]:
        drafts = self.ngram.propose(states, depth, topk, verify)
        missing = [i for i, draft in enumerate(drafts) if len(draft) == 0]
        if missing:
            shallow = min(depth, self.head_depth) if self.head_depth else depth
            heads = self.eagle.propose(
                [states[i] for i in missing], shallow, topk, min(verify, shallow * topk)
            )
            for i, draft in zip(missing, heads, strict=True):
                drafts[i] = draft
        return drafts
