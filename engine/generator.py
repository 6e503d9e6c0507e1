"""Continuous-batching generator over the native model and a slot KV cache.

`Generator.step()` is one iteration: waiting requests take free cache slots, every running sequence that
has a pending token decodes it (one token each), and whatever is left of the per-iteration token budget
goes to prompt prefill in chunks, oldest request first — so a long prompt is spread over several
iterations instead of stalling everyone's decoding. All of it is one flat forward pass (`BatchLayout`).
Sequences join and leave between iterations; a finished sequence's slot is free for the next request at
once.

Sampling goes through `sampling.sample` with noise keyed by (request seed, index of the new token in
prompt + response), so a request's output does not depend on what else shares its batch.

A sequence in decode state holds exactly one *pending* token: sampled, returned to the caller, but not yet
fed through the model (its K/V are not cached). Speculative decoding builds on that: `score_trees` runs
one verify pass for several sequences, each feeding its pending token as the root of a draft tree (tokens
+ parent indices) under a tree attention mask, and returns logits for every node; the caller verifies and
keeps the accepted path with `KVCache.commit_path`.

Finish reasons: "stop" (a stop or EOS id was emitted; it is kept in token_ids, since the policy must
learn to emit it), "length" (max_tokens reached, or prompt + response filled the cache slot's max_len).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from slipstream.engine.batch import BatchLayout
from slipstream.engine.kv_cache import KVCache
from slipstream.engine.model import Transformer
from slipstream.engine.sampling import SamplingParams, params_tensors, sample
from slipstream.engine.tree import tree_attention_mask


@dataclass(frozen=True, kw_only=True)
class Request:
    """One prompt to complete."""

    request_id: str
    prompt_ids: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    group_id: str | None = None
    """GRPO group (siblings sampled from the same prompt); carried through to the completion."""


@dataclass(frozen=True, kw_only=True)
class Completion:
    """A finished request."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    """Log-prob of each sampled token under the processed sampling distribution (0 for greedy)."""
    finish_reason: str
    """"stop" or "length"."""
    group_id: str | None = None
    hidden: Tensor | None = None
    """[len(token_ids), hidden] last-layer pre-norm state at the position that sampled each token."""


@dataclass(frozen=True, kw_only=True)
class StepOutput:
    """What one iteration produced for one request."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    completion: Completion | None = None
    """Set when the request finished in this iteration."""


@dataclass(eq=False)
class _Sequence:
    request: Request
    slot: int
    tokens: list[int]
    """Prompt + response so far; the last one is pending (not yet cached) once decoding started."""
    num_prompt: int
    stop_ids: frozenset[int]
    num_cached: int = 0
    logprobs: list[float] = field(default_factory=list)
    hidden: list[Tensor] = field(default_factory=list)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt


class Generator:
    """Continuous batching with chunked prefill; see the module docstring."""

    def __init__(
        self,
        model: Transformer,
        *,
        num_slots: int = 32,
        max_len: int = 2048,
        token_budget: int = 512,
        eos_token_ids: Sequence[int] | None = None,
        return_hidden: bool = False,
    ) -> None:
        """num_slots: concurrent sequences; max_len: prompt + response tokens per sequence;
        token_budget: tokens per forward pass (decodes first, prefill chunks fill the rest; must exceed
        num_slots so prefill always progresses); eos_token_ids: stop ids for every request (default: the
        model config's); return_hidden: keep per-token hidden states in completions."""
        if token_budget <= num_slots:
            raise ValueError(f"token_budget ({token_budget}) must exceed num_slots ({num_slots})")
        self.model = model
        weight = model.embed_tokens.weight
        self.cache = KVCache.for_model(
            model.config, num_slots=num_slots, max_len=max_len, dtype=weight.dtype, device=weight.device
        )
        self.token_budget = token_budget
        self.eos_token_ids = frozenset(model.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.return_hidden = return_hidden
        self._waiting: deque[Request] = deque()
        self._running: dict[str, _Sequence] = {}  # insertion order = admission order (prefill FIFO)

    def add(self, request: Request) -> None:
        """Queue a request; it joins the batch at the next iteration with a free slot."""
        prompt = list(request.prompt_ids)
        vocab = self.model.config.vocab_size
        if not prompt:
            raise ValueError(f"request {request.request_id!r}: empty prompt")
        if len(prompt) >= self.cache.max_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {len(prompt)} tokens leaves no room in "
                f"max_len {self.cache.max_len}"
            )
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"request {request.request_id!r}: prompt ids must lie in [0, {vocab})")
        if request.request_id in self._running or any(
            r.request_id == request.request_id for r in self._waiting
        ):
            raise ValueError(f"request id {request.request_id!r} is already queued or running")
        self._waiting.append(request)

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request (no completion is produced); False if unknown."""
        for request in self._waiting:
            if request.request_id == request_id:
                self._waiting.remove(request)
                return True
        seq = self._running.pop(request_id, None)
        if seq is None:
            return False
        self.cache.free(seq.slot)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """One iteration: admit, decode every pending token, prefill within the budget, sample."""
        self._admit()
        if not self._running:
            return []
        plan = self._schedule()
        input_ids: list[int] = []
        logit_rows: list[int] = []
        sampled: list[_Sequence] = []
        for seq, n in plan:
            input_ids.extend(seq.tokens[seq.num_cached : seq.num_cached + n])
            if seq.num_cached + n == len(seq.tokens):
                logit_rows.append(len(input_ids) - 1)
                sampled.append(seq)
        layout = BatchLayout.build(
            self.cache, [seq.slot for seq, _ in plan], [n for _, n in plan], logit_rows=logit_rows
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.cache.device)
        logits, hidden = self.model(ids, layout.positions, layout, self.cache)
        for seq, n in plan:
            seq.num_cached += n
        if not sampled:
            return []
        temperature, top_p, top_k, seeds = params_tensors([seq.request.params for seq in sampled])
        positions = torch.tensor([len(seq.tokens) for seq in sampled], dtype=torch.int64)
        tokens, logprobs = sample(logits.cpu(), temperature, top_p, top_k, seeds, positions)
        rows_hidden = None
        if self.return_hidden:
            rows_hidden = (
                hidden if layout.logit_rows is None else hidden.index_select(0, layout.logit_rows)
            ).cpu()
        outputs = []
        for i, (seq, token, logprob) in enumerate(
            zip(sampled, tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            if rows_hidden is not None:
                seq.hidden.append(rows_hidden[i].clone())  # a view would pin the whole pass's states
            outputs.append(self._emit(seq, [token], [logprob]))
        return outputs

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """Run `requests` to completion (the generator must be idle); completions in request order."""
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle generator; drive step() yourself to mix workloads")
        for request in requests:
            self.add(request)
        done: dict[str, Completion] = {}
        while self.has_unfinished():
            for output in self.step():
                if output.completion is not None:
                    done[output.request_id] = output.completion
        return [done[request.request_id] for request in requests]

    def _admit(self) -> None:
        while self._waiting and self.cache.num_free_slots:
            request = self._waiting.popleft()
            prompt = list(request.prompt_ids)
            self._running[request.request_id] = _Sequence(
                request=request,
                slot=self.cache.allocate(),
                tokens=prompt,
                num_prompt=len(prompt),
                stop_ids=self.eos_token_ids | frozenset(request.params.stop_token_ids),
            )

    def _schedule(self) -> list[tuple[_Sequence, int]]:
        """(sequence, tokens to feed) for this pass: every pending decode, then prefill chunks in order."""
        decodes, prefills = [], []
        for seq in self._running.values():
            (decodes if seq.num_cached == len(seq.tokens) - 1 else prefills).append(seq)
        # Slot order lets a compact decode batch read K/V as one strided view of the cache.
        decodes.sort(key=lambda s: s.slot)
        plan = [(seq, 1) for seq in decodes]
        budget = self.token_budget - len(decodes)
        for seq in prefills:
            if budget <= 0:
                break
            n = min(len(seq.tokens) - seq.num_cached, budget)
            plan.append((seq, n))
            budget -= n
        return plan

    def _emit(self, seq: _Sequence, token_ids: list[int], logprobs: list[float]) -> StepOutput:
        reason = None
        if seq.tokens[-1] in seq.stop_ids:
            reason = "stop"
        elif seq.num_generated >= seq.request.params.max_tokens or len(seq.tokens) >= self.cache.max_len:
            reason = "length"
        if reason is None:
            return StepOutput(request_id=seq.request.request_id, token_ids=token_ids, logprobs=logprobs)
        del self._running[seq.request.request_id]
        self.cache.free(seq.slot)
        completion = Completion(
            request_id=seq.request.request_id,
            prompt_ids=seq.tokens[: seq.num_prompt],
            token_ids=seq.tokens[seq.num_prompt :],
            logprobs=seq.logprobs,
            finish_reason=reason,
            group_id=seq.request.group_id,
            hidden=torch.stack(seq.hidden) if seq.hidden else None,
        )
        return StepOutput(
            request_id=seq.request.request_id,
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=reason,
            completion=completion,
        )


@dataclass(frozen=True, kw_only=True)
class VerifyTree:
    """A draft tree to verify for one sequence."""

    slot: int
    tokens: Sequence[int]
    """[n] node tokens in topological order; node 0 is the root: the sequence's pending token."""
    parents: Sequence[int]
    """[n] parent node of each node; -1 for the root."""


@dataclass(frozen=True)
class TreeScores:
    """Per tree: logits [n, vocab] (row i scores the token after node i) and hidden [n, hidden]."""

    base_lengths: list[int]
    logits: list[Tensor]
    hidden: list[Tensor]


@torch.inference_mode()
def score_trees(model: Transformer, cache: KVCache, trees: Sequence[VerifyTree]) -> TreeScores:
    """One verify pass over several sequences' draft trees, with tree attention masks.

    Node i of a tree is written to cache position base + i (base = the slot's length before the pass) at
    RoPE position base + depth(i). Afterwards each slot's length is base + n: the caller keeps the
    accepted path with `cache.commit_path(slot, base, accepted_nodes)` (or `rollback`).
    """
    base_lengths = [cache.length(tree.slot) for tree in trees]
    sizes = [len(tree.tokens) for tree in trees]
    for tree, n in zip(trees, sizes, strict=True):
        parents = [int(p) for p in tree.parents]
        if (
            len(parents) != n
            or n == 0
            or parents[0] != -1
            or any(not 0 <= p < i for i, p in enumerate(parents[1:], 1))
        ):
            raise ValueError(
                f"slot {tree.slot}: need one parent per token, node 0 as the root (parent -1) and every "
                f"other node's parent an earlier node; got parents {parents}"
            )
    masks = [tree_attention_mask(torch.as_tensor(tree.parents, dtype=torch.int64)) for tree in trees]
    layout = BatchLayout.build(
        cache, [tree.slot for tree in trees], sizes, tree_masks=masks, logit_rows=range(sum(sizes))
    )
    ids = torch.tensor([t for tree in trees for t in tree.tokens], dtype=torch.int64, device=cache.device)
    logits, hidden = model(ids, layout.positions, layout, cache)
    offsets = layout.cu_seqlens
    return TreeScores(
        base_lengths=base_lengths,
        logits=[logits[offsets[i] : offsets[i + 1]] for i in range(len(trees))],
        hidden=[hidden[offsets[i] : offsets[i + 1]] for i in range(len(trees))],
    )


def score_tree(
    model: Transformer,
    cache: KVCache,
    slot: int,
    base_len: int,
    tokens: Sequence[int],
    parents: Sequence[int],
) -> tuple[Tensor, Tensor]:
    """Single-sequence `score_trees`: (logits [n, vocab], hidden [n, hidden]); checks the base length."""
    if cache.length(slot) != base_len:
        raise ValueError(f"slot {slot} holds {cache.length(slot)} tokens, not base_len {base_len}")
    scores = score_trees(model, cache, [VerifyTree(slot=slot, tokens=tokens, parents=parents)])
    return scores.logits[0], scores.hidden[0]
