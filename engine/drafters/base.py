"""The drafter interface: what the generator asks of any drafter (n-gram, oracle, EAGLE head).

A drafter sees one `DraftState` per live request and returns one `Draft` per request: a tree (tokens,
parents) and, for a stochastic drafter, the distribution each token was drawn from. Drafts never change
the output — verification (`verify.py`) makes every draft lossless — so a drafter may be wrong, slow
to learn, or swapped mid-run; it can only change speed.

Drafters are told about committed tokens through `observe` even while speculation is switched off, so
model-free tables stay current for the moment the tuner turns them on; `reset` / `reset_group` free the
state of a finished request / prompt group. Group state outlives a request on purpose: a finished
sibling's response is the best source of drafts for the siblings still decoding.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from slipstream.engine.sampling import SamplingParams
from slipstream.engine.tree import chain_parents

__all__ = ["Draft", "DraftState", "Drafter", "stack_chains"]


@dataclass(frozen=True, kw_only=True)
class DraftState:
    """What a drafter knows about one request when asked to propose."""

    request_id: Hashable
    """Unique per request (sample) for the drafter's lifetime, until `reset`."""
    group_id: Hashable
    """The GRPO prompt group: requests of a group share their prompt."""
    tokens: Sequence[int] | Tensor
    """Prompt + generated tokens so far (a list or a 1-D int tensor); the draft continues it."""
    prompt_len: int
    """How many of `tokens` are the prompt."""
    params: SamplingParams
    """The request's sampling settings (a stochastic drafter drafts from the processed distribution)."""
    hidden: Tensor | None = None
    """[t, hidden] the target's last-layer hidden states for the tokens committed since the last call, or
    None (model-free drafters ignore it)."""
    keyed: bool = False
    """True when verification draws the target's token at each position with the sampler's own keyed
    noise ("match" rows: greedy requests, and every request in reproducible mode). A drafter may then draw
    with that same noise (`sampling.keyed_pick`) and guess the very token plain decoding will sample, not
    just a likely one. Set by the speculator per pass; only speed depends on it."""

    @property
    def position(self) -> int:
        """The position the first drafted token will occupy."""
        return len(self.tokens)


@dataclass(frozen=True)
class Draft:
    """One request's proposal: a tree in topological order (a chain has parents i − 1)."""

    tokens: Tensor
    """[n] int64."""
    parents: Tensor
    """[n] int64, -1 = child of the root (the last committed token)."""
    draft_probs: Tensor | None = None
    """[n, V] the processed draft distribution each token was drawn from, or None: a point mass
    (deterministic drafters, and top-k trees whose children are chosen, not drawn)."""

    def __post_init__(self) -> None:
        n = self.tokens.numel()
        if self.tokens.dim() != 1 or self.parents.shape != (n,):
            raise ValueError(
                f"tokens and parents must be [n], got {tuple(self.tokens.shape)}, {tuple(self.parents.shape)}"
            )
        if self.draft_probs is not None and (self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != n):
            raise ValueError(f"draft_probs must be [n={n}, V], got {tuple(self.draft_probs.shape)}")

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @property
    def is_chain(self) -> bool:
        return bool(torch.equal(self.parents, chain_parents(len(self), self.parents.device)))

    @classmethod
    def chain(
        cls,
        tokens: Sequence[int] | Tensor,
        draft_probs: Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> Draft:
        """A chain of `tokens` on `device` (None: where a tensor of tokens is, a list's on the CPU)."""
        tokens = torch.as_tensor(tokens, dtype=torch.int64, device=device).reshape(-1)
        return cls(tokens, chain_parents(tokens.numel(), tokens.device), draft_probs)

    @classmethod
    def empty(cls, device: torch.device | str | None = None) -> Draft:
        return cls.chain([], device=device)


class Drafter(ABC):
    """Proposes draft trees for a batch of requests; informed of commits; forgets finished requests."""

    name: str = "drafter"
    uses_hidden: bool = True
    """Whether `DraftState.hidden` should carry the target's states; gathering them costs the generator a
    copy per commit, so model-free drafters say False."""

    @abstractmethod
    def propose(self, states: Sequence[DraftState], depth: int, topk: int, verify: int) -> list[Draft]:
        """One draft per state: at most `depth` levels, `topk` children per node, `verify` nodes in all.

        topk == 1 asks for a chain of at most min(depth, verify) tokens. An empty draft means "no
        proposal" (the generator then decodes that request plainly).
        """

    def observe(self, state: DraftState) -> None:
        """`state.tokens` has grown since the last call (accepted tokens were committed)."""
        return None

    def reset(self, request_id: Hashable) -> None:
        """The request has finished or was evicted: drop its per-request state."""
        return None

    def reset_group(self, group_id: Hashable) -> None:
        """Every request of the group has finished: drop the group's shared state."""
        return None


def stack_chains(
    drafts: Sequence[Draft], vocab: int | None = None, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Pad chain drafts for `verify_chain`: (draft_tokens [B, k], draft_lengths [B], draft_probs [B, k, V]
    or None) on `device` (None: the first draft's). Rows without draft_probs get the point mass of their
    tokens when any row has them."""
    if not all(d.is_chain for d in drafts):
        raise ValueError("stack_chains needs chain drafts (parents i - 1); verify trees with verify_tree")
    if device is None:
        device = drafts[0].tokens.device if drafts else "cpu"
    b = len(drafts)
    sizes = [len(d) for d in drafts]
    k = max(sizes, default=0)
    lengths = torch.tensor(sizes, dtype=torch.int64, device=device)
    tokens = torch.zeros(b, k, dtype=torch.int64, device=device)
    for row, d in enumerate(drafts):
        tokens[row, : len(d)] = d.tokens
    with_probs = [d.draft_probs for d in drafts if d.draft_probs is not None]
    if not with_probs:
        return tokens, lengths, None
    v = vocab if vocab is not None else with_probs[0].shape[-1]
    probs = torch.zeros(b, k, v, device=device)
    for row, d in enumerate(drafts):
        if d.draft_probs is not None:
            probs[row, : len(d)] = d.draft_probs
        else:
            probs[row, torch.arange(len(d), device=device), d.tokens.to(device)] = 1.0
    return tokens, lengths, probs
