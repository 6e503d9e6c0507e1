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

import torch
from torch import Tensor

from slipstream.engine.drafters.base import DraftState
from slipstream.engine.kv_cache import KVCache
from slipstream.engine.request import Request

__all__ = ["Running", "Scheduler", "group_key", "keep_answer_states"]


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
    parked: bool = False
    """Its turn ended (`park`): it keeps its slot and pending token, and decodes nothing until `unpark`."""
    policy: list[bool] | None = None
    """Per token after the prompt: sampled by the policy (True) or appended by `unpark` (False); None while
    every one is the policy's (a single turn)."""
    answer_states: list[Tensor] | None = None
    """While an environment's answer prefills (`unpark`): its chunks' last-layer states, for the drafters
    (`keep_answer_states`): EAGLE pairs each token with the state before it, the answer's tokens too."""

    def take_answer_states(self, last: Tensor | None) -> Tensor | None:
        """The states of the tokens committed since the drafters last saw this sequence: the answer's
        prefill rows (their last is `last`, the row that sampled the new token) once it is done, else
        `last`."""
        if not self.answer_states:
            return last
        states, self.answer_states = torch.cat(self.answer_states), None
        return states

    @property
    def num_generated(self) -> int:
        """Tokens after the prompt (the environment's too)."""
        return len(self.tokens) - self.num_prompt

    @property
    def decoding(self) -> bool:
        """It has a pending token (everything before it cached) and is not parked."""
        return not self.parked and self.num_cached == len(self.tokens) - 1


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

    def park(self, seq: Running, keep: int | None = None) -> int:
        """End `seq`'s turn (or cut a paused one's shorter): it decodes nothing until `unpark`. keep: tokens
        after the prompt to keep (None:
        all); the policy's tokens past it are dropped (speculation emitted beyond the turn's end) and their
        K/V rolled back. Returns how many were dropped; ValueError where `keep` would cut into what the
        environment appended or leave no pending token."""
        shorter = seq.parked and keep is not None and keep < seq.num_generated
        if not (seq.decoding or shorter):
            # A parked one may be parked again, shorter: its turn ended at a stop id after a stop sequence.
            raise ValueError(f"request {seq.request.request_id!r} is not decoding: only a decoding turn ends")
        generated = seq.num_generated
        keep = generated if keep is None else keep
        floor = 1 if seq.policy is None else max(i for i, own in enumerate(seq.policy) if not own) + 2
        if not floor <= keep <= generated:
            raise ValueError(
                f"request {seq.request.request_id!r}: keep must lie in [{floor}, {generated}], got {keep}"
            )
        dropped = generated - keep
        if dropped:
            del seq.tokens[seq.num_prompt + keep :]  # in place: drafters read the same list
            del seq.logprobs[keep:]
            if seq.hidden:
                del seq.hidden[len(seq.hidden) - dropped :]
            if seq.policy is not None:
                del seq.policy[keep:]
            seq.num_cached = len(seq.tokens) - 1
            self.cache.rollback(seq.slot, min(seq.num_cached, self.cache.length(seq.slot)))
        seq.parked = True
        return dropped

    def get(self, request_id: str) -> Running:
        """The running request `request_id` (ValueError naming it if it is not running)."""
        seq = self.running.get(request_id)
        if seq is None:
            raise ValueError(f"request {request_id!r} is not running")
        return seq

    def unpark(self, seq: Running, tokens: Sequence[int], vocab_size: int) -> None:
        """Append the environment's `tokens` to a parked sequence (not the policy's: masked, log-prob 0); it
        prefills them, then decodes its next turn. ValueError naming what is wrong (not parked, ids out of
        the vocabulary, no room left in max_len)."""
        name = seq.request.request_id
        if not seq.parked:
            raise ValueError(f"request {name!r} is not paused")
        if not tokens or min(tokens) < 0 or max(tokens) >= vocab_size:
            raise ValueError(
                f"request {name!r}: observation ids must be non-empty and lie in [0, {vocab_size})"
            )
        if len(seq.tokens) + len(tokens) >= self.cache.max_len:
            raise ValueError(
                f"request {name!r}: {len(tokens)} observation tokens leave no room in max_len "
                f"{self.cache.max_len} ({len(seq.tokens)} held)"
            )
        if seq.policy is None:
            seq.policy = [True] * seq.num_generated
        seq.tokens.extend(tokens)
        seq.logprobs.extend([0.0] * len(tokens))
        seq.policy.extend([False] * len(tokens))
        seq.parked = False
        seq.answer_states = []

    def split(self) -> tuple[list[Running], list[Running]]:
        """Sequences with a pending token (in slot order) and sequences still prefilling (FIFO); parked ones
        are neither."""
        decodes, prefills = [], []
        for seq in self.running.values():
            if seq.parked:
                continue
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


def keep_answer_states(plan: Sequence[tuple[Running, int]], hidden: Tensor, first_row: int = 0) -> None:
    """Keep the states of every chunk of `plan` that prefills an environment's answer (`unpark`): the pass's
    rows from `first_row` on, in `plan` order, as `hidden` [rows, d] holds them."""
    row = first_row
    for seq, n in plan:
        if seq.answer_states is not None:
            seq.answer_states.append(hidden[row : row + n].clone())  # a clone: a view pins the whole pass
        row += n
