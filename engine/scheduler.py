"""The generator's scheduler: which requests hold a KV cache slot, and which of them decode or prefill.

`Scheduler` keeps the waiting requests (arrival order) and the running sequences (admission order), hands
slots out as they free, splits the running ones into decodes (a pending token) and prefills (prompt left
to feed), plans a pass's prefill chunks within a token budget, and lets a GRPO group's siblings share
their prompt's prefill (`share_prompts`). What runs the model, samples and commits is the Generator's
(generator.py); the scheduler only says who and how much.

Non-obvious choices:
- Decodes go in slot order: a compact decode batch reads K/V as one strided view of the cache.
- A sibling whose prompt a running sequence holds copies its K/V (all but the last token) instead of
  prefilling it; while the first sibling is still prefilling, the others wait for it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from slipstream.engine.drafters.base import DraftState
from slipstream.engine.kv_cache import KVCache
from slipstream.engine.request import Request

__all__ = ["Running", "Scheduler", "group_key"]


@dataclass(eq=False)
class Running:
    """A request that holds a cache slot: its tokens so far and what it has produced."""

    request: Request
    slot: int
    tokens: list[int]
    """Prompt + response so far; the last one is pending (not yet cached) once decoding started."""
    num_prompt: int
    prompt_key: tuple[int, ...]
    """The prompt's tokens: siblings with the same key share its prefill (`Scheduler.share_prompts`)."""
    stop_ids: frozenset[int]
    group: Hashable
    draft_state: DraftState
    """Built once: it shares the live `tokens` list, so drafters read the current history at every call."""
    num_cached: int = 0
    logprobs: list[float] = field(default_factory=list)
    hidden: list[Tensor] = field(default_factory=list)
    target_passes: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def decoding(self) -> bool:
        """It has a pending token (its prompt is cached)."""
        return self.num_cached == len(self.tokens) - 1


class Scheduler:
    """Waiting and running requests over one KV cache; see the module docstring."""

    def __init__(self, cache: KVCache, eos_token_ids: frozenset[int], *, share_prompts: bool = True) -> None:
        self.cache = cache
        self.eos_token_ids = eos_token_ids
        self.share_prompts = share_prompts
        self.waiting: dict[str, Request] = {}  # insertion order = arrival order; by id for add/abort
        self.running: dict[str, Running] = {}  # insertion order = admission order (prefill FIFO)
        self._group_live: dict[Hashable, int] = {}  # waiting + running requests per prompt group
        # prompt → its running sequences, in admission order (`share_prompts`)
        self._by_prompt: dict[tuple[int, ...], list[Running]] = {}

    def add(self, request: Request, vocab_size: int) -> None:
        """Queue a request (ValueError naming it if its prompt is empty, too long or out of vocabulary, or
        its id is already queued or running)."""
        prompt = list(request.prompt_ids)
        if not prompt:
            raise ValueError(f"request {request.request_id!r}: empty prompt")
        if len(prompt) >= self.cache.max_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {len(prompt)} tokens leaves no room in "
                f"max_len {self.cache.max_len}"
            )
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise ValueError(f"request {request.request_id!r}: prompt ids must lie in [0, {vocab_size})")
        if request.request_id in self.running or request.request_id in self.waiting:
            raise ValueError(f"request id {request.request_id!r} is already queued or running")
        self.waiting[request.request_id] = request
        group = group_key(request)
        self._group_live[group] = self._group_live.get(group, 0) + 1

    def admit(self) -> None:
        """Waiting requests take free slots, oldest first."""
        while self.waiting and self.cache.num_free_slots:
            request = self.waiting.pop(next(iter(self.waiting)))
            prompt = list(request.prompt_ids)
            group = group_key(request)
            seq = self.running[request.request_id] = Running(
                request=request,
                slot=self.cache.allocate(),
                tokens=prompt,
                num_prompt=len(prompt),
                prompt_key=tuple(prompt),
                stop_ids=self.eos_token_ids | frozenset(request.params.stop_token_ids),
                group=group,
                draft_state=DraftState(
                    request_id=request.request_id,
                    group_id=group,
                    tokens=prompt,
                    prompt_len=len(prompt),
                    params=request.params,
                ),
            )
            if self.share_prompts:
                self._by_prompt.setdefault(seq.prompt_key, []).append(seq)

    def compact(self) -> None:
        """Move live slots down where the cache is sparse (a grown cache shrinks to the live batch)."""
        if self.cache.sparse:
            moved = self.cache.compact()
            for seq in self.running.values():
                seq.slot = moved.get(seq.slot, seq.slot)

    def finish(self, seq: Running) -> bool:
        """A running sequence left (finished or aborted): its slot frees, it no longer lends its prompt.
        Returns whether its group still has requests waiting or running."""
        del self.running[seq.request.request_id]
        self.cache.free(seq.slot)
        peers = self._by_prompt.get(seq.prompt_key)
        if peers is not None:
            peers.remove(seq)
            if not peers:
                del self._by_prompt[seq.prompt_key]
        return self._release(seq.group)

    def drop_waiting(self, request_id: str) -> bool | None:
        """Remove a waiting request: whether its group still has requests (None: it was not waiting)."""
        request = self.waiting.pop(request_id, None)
        return None if request is None else self._release(group_key(request))

    def _release(self, group: Hashable) -> bool:
        live = self._group_live[group] - 1
        if live:
            self._group_live[group] = live
        else:
            del self._group_live[group]
        return bool(live)

    def split(self) -> tuple[list[Running], list[Running]]:
        """Sequences with a pending token (in slot order) and sequences still prefilling (FIFO)."""
        decodes, prefills = [], []
        for seq in self.running.values():
            (decodes if seq.decoding else prefills).append(seq)
        decodes.sort(key=lambda s: s.slot)
        return decodes, prefills

    def share(self, prefills: list[Running]) -> tuple[list[Running], int]:
        """The prefills to plan this pass after prompt sharing among siblings, and the prompt tokens copied.

        A sequence that has not started its prompt copies the K/V of all of it but the last token from a
        running sibling that holds them (`KVCache.copy_prefix`), and feeds only that last token itself: its
        first logits and hidden state come from its own pass, as without sharing."""
        kept, copied = [], 0
        for seq in prefills:
            need = seq.num_prompt - 1
            if seq.num_cached == 0 and need > 0:
                siblings = self._by_prompt[seq.prompt_key]  # seq among them, not started
                donor = next((p for p in siblings if p.num_cached >= need), None)
                if donor is not None:
                    self.cache.copy_prefix(donor.slot, seq.slot, need)
                    seq.num_cached = need
                    copied += need
                elif siblings[0] is not seq or any(p.num_cached > 0 for p in siblings):
                    continue  # a sibling leads this prompt's prefill: wait for it
            kept.append(seq)
        return kept, copied

    @staticmethod
    def prefill_plan(prefills: Sequence[Running], budget: int) -> list[tuple[Running, int]]:
        """(sequence, prompt tokens to feed) for this pass: chunks in admission order within `budget`."""
        plan = []
        for seq in prefills:
            if budget <= 0:
                break
            n = min(len(seq.tokens) - seq.num_cached, budget)
            plan.append((seq, n))
            budget -= n
        return plan


def group_key(request: Request) -> Hashable:
    """Drafters share state per prompt group; a request without a group is its own."""
    return request.group_id if request.group_id is not None else ("request", request.request_id)
