"""Oracle ("self-draft") drafter: replays the target's own recorded output — the mechanical ceiling.

For benchmarks only. Record each request's plain-decoding output once (same seeds, same sampling
settings), then decode again with this drafter: it proposes exactly the tokens the target will emit, at
~zero cost. In "match" verification every draft is accepted, so the run measures the engine's verify
mechanics alone — (k+1) tokens per target pass against the cost of scoring k+1 positions, KV-cache
rollback and bookkeeping — the upper bound any real drafter can approach (DESIGN.md §11). It says nothing
about draft quality. (In "rejection" mode a point-mass draft x is accepted with probability q(x) < 1 at
T > 0, so use "match" for the ceiling.)

If a request's history leaves the recording (different seed, settings or weights), it proposes nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch
from torch import Tensor

from slipstream.engine.drafters.base import Draft, Drafter, DraftState

__all__ = ["OracleDrafter"]


class OracleDrafter(Drafter):
    """Proposes the recorded continuation of each request as a chain."""

    name = "oracle"
    uses_hidden = False

    def __init__(
        self,
        recorded: Mapping[Hashable, Sequence[int] | Tensor] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """recorded: request id → its recorded sequence (`record`); device: where drafts are made."""
        self.device = torch.device(device)
        self._recorded: dict[Hashable, list[int]] = {}
        for request_id, tokens in (recorded or {}).items():
            self.record(request_id, tokens)

    def record(self, request_id: Hashable, tokens: Sequence[int] | Tensor) -> None:
        """The full sequence (prompt + response) that plain decoding produced for this request."""
        self._recorded[request_id] = (
            tokens.tolist() if isinstance(tokens, Tensor) else [int(t) for t in tokens]
        )

    def reset(self, request_id: Hashable) -> None:
        # Recordings are the benchmark's input, not per-run state: a re-run of the request replays again.
        return None

    def propose(self, states: Sequence[DraftState], depth: int, topk: int, verify: int) -> list[Draft]:
        # A chain whatever topk is: with the answer known, branching would only spend verify budget.
        k = min(depth, verify)
        return [self._propose_one(state, k) for state in states]

    def _propose_one(self, state: DraftState, k: int) -> Draft:
        recorded = self._recorded.get(state.request_id)
        n = len(state.tokens)
        if recorded is None or n >= len(recorded) or k < 1:
            return Draft.empty(self.device)
        # Cheap divergence check on the last few tokens (a full prefix compare would be O(length) per call).
        tail = state.tokens[max(0, n - 4) : n]
        tail = tail.tolist() if isinstance(tail, Tensor) else list(tail)
        if [int(t) for t in tail] != recorded[max(0, n - 4) : n]:
            return Draft.empty(self.device)
        return Draft.chain(recorded[n : n + k], device=self.device)
