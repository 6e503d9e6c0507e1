"""Continuous-batching generator over the native model and a slot KV cache.

`Generator.step()` is one iteration: waiting requests take free cache slots, every running sequence with
a pending token (sampled, returned, not yet fed through the model) decodes it, and what is left of the
token budget prefills prompts in chunks, oldest first; siblings with one prompt (a GRPO group) prefill it
once and copy its K/V. Sampling noise is keyed by (request seed, index of the new token), so a request's
output does not depend on its batch. Speculative decoding (`SpecConfig`, `speculator.py`) makes the
pending token the root of a draft verified losslessly; only the accepted path stays in the KV cache, and a
run of accepted tokens is cut where plain decoding would stop. Drafters are held per method (`hold`).

Two paths, the same results (inputs packed by `pass_inputs.py`): one flat pass (`BatchLayout`; the CPU's,
its cache grown with the live batch), or on CUDA (`static`) the pending tokens and drafts in a fixed-shape
step (`StaticStep`, a replayed CUDA graph), prompts prefilled in eager passes of their own. The host reads
tokens and log-probs once an iteration. Finish reasons: "stop" (a stop or EOS id, kept in token_ids: the
policy must learn to emit it), "length" (max_tokens, or the slot's max_len filled).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch
from torch import Tensor

from slipstream.engine.batch import BatchLayout
from slipstream.engine.device import capabilities
from slipstream.engine.drafters.base import Drafter
from slipstream.engine.kv_cache import KVCache
from slipstream.engine.model import Transformer
from slipstream.engine.pass_inputs import FlatPass, step_rows
from slipstream.engine.request import Completion, Request, StepOutput, run_requests
from slipstream.engine.sampling import params_tensors, sample
from slipstream.engine.scheduler import Running, Scheduler, keep_answer_states
from slipstream.engine.speculator import SpecConfig, Speculator, verify_drafts
from slipstream.engine.static_step import BATCH_BUCKETS, NODE_BUCKETS, PAGE_SIZE, StaticStep
from slipstream.engine.verify import EMPTY, Proposal

# Request, Completion, StepOutput and run_requests live in request.py; re-exported here.
__all__ = ["Completion", "Generator", "Request", "SpecConfig", "StepOutput", "run_requests"]


class Generator:
    """Continuous batching with chunked prefill; see the module docstring."""

    def __init__(
        self,
        model: Transformer,
        *,
        num_slots: int = 32,
        max_len: int = 2048,
        token_budget: int | None = None,
        max_draft: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        return_hidden: bool = False,
        spec: SpecConfig | None = None,
        drafters: Mapping[str, Drafter] | None = None,
        grow_cache: bool | None = None,
        share_prompts: bool = True,
        static: bool | None = None,
    ) -> None:
        """num_slots: concurrent sequences; max_len: prompt + response tokens per sequence;
        token_budget: tokens per forward pass (decodes and their drafts first, prefill chunks fill the
        rest; must exceed num_slots so prefill always progresses), None: derived from num_slots and
        max_draft (`_default_token_budget`); max_draft: draft nodes per sequence the derived budget must fit
        (None: the spec's verify budget, 0 without one; pass the deepest spec `set_spec` will choose);
        eos_token_ids: stop ids for every request (default: the model config's); return_hidden: keep
        per-token hidden states in completions; spec: speculative decoding (None: plain decoding);
        drafters: method → drafter to hold (see `hold`); grow_cache: KV storage grown to the live batch
        (`KVCache`, grow=True) or num_slots × max_len up front (False); None: up front on CUDA only, whose
        caching allocator and CUDA graphs want a fixed footprint; share_prompts: a request whose prompt a
        running one holds copies its K/V instead of prefilling it (`Scheduler.share`; False: every request
        prefills its own, for A/B measurements); static: decode and verify in fixed-shape steps
        (`StaticStep`: CUDA graphs on a GPU, eager elsewhere) with a static cache; None: where the device's
        capabilities say so (CUDA)."""
        if max_draft is None:
            max_draft = spec.verify_budget if spec is not None and spec.enabled else 0
        if token_budget is None:
            token_budget = _default_token_budget(num_slots, max_draft)
        if token_budget <= num_slots:
            raise ValueError(f"token_budget ({token_budget}) must exceed num_slots ({num_slots})")
        self.model = model
        self.cache, self._static = _cache_and_step(model, num_slots, max_len, max_draft, grow_cache, static)
        self.token_budget = token_budget
        self.eos_token_ids = frozenset(model.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.return_hidden = return_hidden
        self.scheduler = Scheduler(self.cache, self.eos_token_ids, share_prompts=share_prompts)
        self._stats = dict.fromkeys(
            ("iterations", "target_passes", "drafted", "accepted", "committed", "shared_prompt_tokens"), 0
        )
        # Per draft depth d (0-based): sequence-passes whose draft reached depth d+1, and those where the
        # token at that depth was accepted. Falling acceptance at depth 0 is a stale drafter's first sign.
        self._offered_at: list[int] = []
        self._accepted_at: list[int] = []
        # The last step's make-up, for the caller's spans: nanoseconds spent drafting (0: a plain step)
        # and prompt tokens prefilled in its pass.
        self.last_draft_ns = 0
        self.last_prefill_tokens = 0
        self.speculator = Speculator(model.config.vocab_size, drafters)
        self.speculator.set(spec)

    def hold(self, method: str, drafter: Drafter) -> None:
        """Hold `drafter` for `method` ("ngram", "self" or "eagle"), replacing the one held for it; allowed
        between iterations and while that method is active (drafts only change speed, never output).
        Held drafters observe every commit, also while another method or none is active."""
        self.speculator.hold(method, drafter)

    def set_spec(self, spec: SpecConfig | None) -> None:
        """Change the speculation strategy between iterations (None or method "off": plain decoding).
        ValueError, naming the method, if no drafter is held for it ("hybrid": for "ngram" and "eagle")."""
        self.speculator.set(spec)

    @property
    def spec(self) -> SpecConfig:
        return self.speculator.config

    @property
    def stats(self) -> dict[str, int]:
        """Running totals: iterations (steps that ran the model), target_passes, drafted, accepted, committed
        (tokens emitted), shared_prompt_tokens (prompt positions copied from a sibling, not prefilled)."""
        return dict(self._stats)

    @property
    def position_stats(self) -> tuple[list[int], list[int]]:
        """Running totals per draft depth: (offered, accepted) sequence-passes, index 0 = the first draft
        token. Acceptance at depth d is accepted[d] / offered[d]."""
        return list(self._offered_at), list(self._accepted_at)

    def add(self, request: Request) -> None:
        """Queue a request; it joins the batch at the next iteration with a free slot (ValueError naming it
        if its prompt is empty, too long or out of vocabulary, or its id is in use)."""
        self.scheduler.add(request, self.model.config.vocab_size)

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request (no completion is produced); False if unknown."""
        live, group = self.scheduler.drop_waiting(request_id), None
        if live is None:
            if (seq := self.scheduler.running.get(request_id)) is None:
                return False
            live, group = self.scheduler.finish(seq), seq.group
        self.speculator.finish(request_id, None if live else group)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_decoding(self) -> int:
        """Sequences with a pending token: the decode batch of the next iteration (the tuner's batch size)."""
        return sum(seq.decoding for seq in self.scheduler.running.values())

    @property
    def num_prefilling(self) -> int:
        """Requests whose prompt is not fully cached yet, waiting ones included: the next iteration will
        spend part of its pass on their prefill if any of them gets a slot."""
        waiting = len(self.scheduler.waiting) if self.cache.num_free_slots else 0
        return len(self.scheduler.running) - self.num_decoding - self.num_parked + waiting

    @property
    def num_parked(self) -> int:
        """Requests whose turn ended (`pause`), waiting for `resume`."""
        return sum(seq.parked for seq in self.scheduler.running.values())

    def pause(self, request_id: str, keep: int | None = None) -> int:
        """End a decoding request's turn (multi-turn: the caller saw a tool call; `Scheduler.park`): it
        holds its slot and decodes nothing until `resume`; its tokens past `keep` are dropped (speculation
        emitted beyond the turn's end). Returns how many were dropped."""
        dropped = self.scheduler.park(self.scheduler.get(request_id), keep)
        if dropped:
            self.speculator.finish(request_id, None)  # drafters forget what they saw of the dropped tokens
        return dropped

    def finish(self, request_id: str, reason: str = "stop") -> Completion:
        """End a paused request (its environment is done with it): its completion, its slot freed."""
        if not (seq := self.scheduler.get(request_id)).parked:
            raise ValueError(f"request {request_id!r} is not paused: only a paused request is finished")
        return self._complete(seq, reason)

    def resume(self, request_id: str, tokens: Sequence[int]) -> None:
        """Append the environment's answer to a paused request (`Scheduler.unpark`): prefilled on the same
        cache and masked out of training; then the request decodes its next turn."""
        self.scheduler.unpark(self.scheduler.get(request_id), tokens, self.model.config.vocab_size)

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """One iteration: admit, decode (or draft and verify) every pending token, prefill within the
        budget, sample."""
        scheduler = self.scheduler
        scheduler.admit()
        if not scheduler.running:
            return []
        scheduler.compact()
        decodes, prefills = scheduler.split()
        if scheduler.share_prompts:
            prefills, copied = scheduler.share(prefills)
            self._stats["shared_prompt_tokens"] += copied
        if not decodes and not prefills:
            return []  # every running request is paused (or waits for a sibling's prefill)
        self.last_draft_ns = 0
        if self._static is not None:
            return self._static_iteration(decodes, prefills)
        if self.speculator.enabled and decodes:
            return self._speculative_step(decodes, prefills)
        return self._plain_pass(decodes, prefills)

    def _plain_pass(
        self, decodes: list[Running], prefills: list[Running], budget: int | None = None
    ) -> list[StepOutput]:
        """One flat pass: every pending token, then prefill chunks within the budget (default: the token
        budget); sample."""
        budget = self.token_budget if budget is None else budget
        plan = [(seq, 1) for seq in decodes] + self.scheduler.prefill_plan(prefills, budget - len(decodes))
        self.last_prefill_tokens = sum(n for seq, n in plan[len(decodes) :])
        flat = FlatPass.plain(plan)
        layout = flat.layout(self.cache)
        logits, hidden = self._forward(flat.input_ids, layout)
        for seq, n in plan:
            seq.num_cached += n
        if self.speculator.needs_hidden:
            keep_answer_states(plan, hidden)
        sampled = flat.emitting
        if not sampled:
            return []
        device = logits.device
        temperature, top_p, top_k, seeds = params_tensors([seq.request.params for seq in sampled], device)
        positions = torch.tensor([len(seq.tokens) for seq in sampled], dtype=torch.int64, device=device)
        tokens, logprobs = sample(logits, temperature, top_p, top_k, seeds, positions)
        rows_hidden = self._logit_hidden(hidden, layout)
        return [
            # A row's clone, not a view: a view would pin the whole pass's states.
            self._extend(
                seq, [token], [logprob], None if rows_hidden is None else rows_hidden[i : i + 1].clone()
            )
            for i, (seq, token, logprob) in enumerate(
                zip(sampled, tokens.tolist(), logprobs.tolist(), strict=True)
            )
        ]

    def _draft(self, decodes: list[Running], budget: int, max_nodes: int | None = None) -> list[Proposal]:
        """Every decode's draft, `budget` nodes in all and at most `max_nodes` each (None: what its cache
        slot has room for); the time it took adds to `last_draft_ns`."""
        # Every node needs a cache position; a level beyond what the request may still emit is wasted.
        rooms = [self.cache.max_len - len(seq.tokens) for seq in decodes]
        depth_caps = [
            min(seq.request.params.max_tokens - seq.num_generated, room) - 1
            for seq, room in zip(decodes, rooms, strict=True)
        ]
        node_caps = rooms if max_nodes is None else [min(room, max_nodes) for room in rooms]
        states = [seq.draft_state for seq in decodes]
        if self.speculator.needs_hidden:  # every commit was observed with its states: none are new
            none_new = torch.empty(
                0, self.model.config.hidden_size, dtype=self.cache.dtype, device=self.cache.device
            )
            states = [replace(state, hidden=none_new) for state in states]
        drafting = time.perf_counter_ns()
        proposals = self.speculator.draft(states, depth_caps, node_caps, budget)
        self.last_draft_ns += time.perf_counter_ns() - drafting
        return proposals

    def _speculative_step(
        self,
        decodes: list[Running],
        prefills: list[Running],
        proposals: list[Proposal] | None = None,
    ) -> list[StepOutput]:
        """Draft for every decode (unless `proposals` are given), verify all drafts in one pass with the
        prefill chunks, commit."""
        spare = self.token_budget - len(decodes)
        if proposals is None:
            draft_budget = spare
            if prefills:
                # Prefill keeps half the spare budget (or what it needs): drafts never starve newcomers.
                pending = sum(len(seq.tokens) - seq.num_cached for seq in prefills)
                draft_budget -= min(pending, max(1, spare // 2))
            proposals = self._draft(decodes, draft_budget)
        plan = self.scheduler.prefill_plan(prefills, spare - sum(p.size for p in proposals))
        self.last_prefill_tokens = sum(n for _, n in plan)
        flat = FlatPass.verify(decodes, proposals, plan, self.cache.device)
        layout = flat.layout(self.cache)
        logits, hidden = self._forward(flat.input_ids, layout)
        for seq, n in plan:
            seq.num_cached += n
        if self.speculator.needs_hidden:
            keep_answer_states(plan, hidden, sum(flat.sizes[: len(decodes)]))
        results = verify_drafts(logits, flat.entries, self.speculator.config.mode)
        rows_hidden = self._logit_hidden(hidden, layout)
        outputs = []
        for i, (seq, entry, result) in enumerate(zip(flat.emitting, flat.entries, results, strict=True)):
            rows = [entry.row + node for node in result.nodes]
            output = self._extend(
                seq,
                result.tokens,
                result.logprobs,
                None if rows_hidden is None else rows_hidden[rows],
                drafted=entry.proposal.size,
            )
            self._count_positions(max(entry.proposal.depths()), len(result.nodes) - 1)
            if i < len(decodes) and output.completion is None:
                # Keep the root and the accepted nodes; the last emitted token is the new pending one.
                self.cache.commit_path(seq.slot, layout.starts[i], result.nodes)
                seq.num_cached = len(seq.tokens) - 1
            outputs.append(output)
        return outputs

    def _static_iteration(self, decodes: list[Running], prefills: list[Running]) -> list[StepOutput]:
        """The fixed-shape path: pending tokens (and their drafts) in `StaticStep`s of at most its batch,
        prompts in an eager pass of their own."""
        outputs: list[StepOutput] = []
        self.last_prefill_tokens = 0
        step = self._static
        assert step is not None
        for lo in range(0, len(decodes), step.max_batch):
            outputs.extend(self._static_decode(decodes[lo : lo + step.max_batch]))
        if prefills:
            # A pass of prompts alone: it may take more than a mixed pass's budget (a GRPO step's prompts
            # arrive at once; on the eager path each pass costs host time, 32 of them at batch 256).
            budget = max(self.token_budget, STATIC_PREFILL_TOKENS)
            outputs.extend(
                self._plain_pass([], prefills, budget)
            )  # `_forward` counts an iteration and a pass
        if decodes and not prefills:
            self._stats["iterations"] += 1
        return outputs

    def _static_decode(self, decodes: list[Running]) -> list[StepOutput]:
        """Draft (if speculating), then score, verify and commit every row in one fixed-shape step."""
        step = self._static
        assert step is not None
        proposals = [EMPTY] * len(decodes)
        spec = self.speculator.config
        if self.speculator.enabled:
            # At most the step's node bucket a row, the pending token aside.
            proposals = self._draft(decodes, self.token_budget - len(decodes), step.max_nodes - 1)
            if any(p.draft_probs is not None for p in proposals):
                # Stochastic drafts (a [n, V] distribution per draft) verify on the dynamic path: no
                # drafter in this package makes them, and a buffer of B x N x V floats is not worth keeping.
                return self._speculative_step(decodes, [], proposals)
        rows = step_rows(decodes, proposals, spec.mode == "rejection")
        result = step.run(rows)
        self._stats["target_passes"] += 1
        hidden = None
        if self.return_hidden or self.speculator.needs_hidden:
            # One copy of the step's states (the buffer is the next step's); rows take views of it.
            hidden = step.hidden[: len(rows)].clone()
        accepted = result.accept_length.tolist()
        tokens, logprobs = result.tokens.tolist(), result.logprobs.tolist()
        outputs = []
        for i, (seq, proposal) in enumerate(zip(decodes, proposals, strict=True)):
            a = accepted[i]
            seq.num_cached += 1 + a
            self.cache.set_length(seq.slot, seq.num_cached)  # the root and the accepted nodes
            output = self._extend(
                seq,
                tokens[i][: a + 1],
                logprobs[i][: a + 1],
                None if hidden is None else hidden[i, : a + 1],
                drafted=proposal.size,
            )
            if proposal.size:
                self._count_positions(max(proposal.depths()), a)
            outputs.append(output)
        return outputs

    def _count_positions(self, depth: int, accepted: int) -> None:
        grow = max(0, depth - len(self._offered_at))
        self._offered_at.extend([0] * grow)
        self._accepted_at.extend([0] * grow)
        for d in range(depth):
            self._offered_at[d] += 1
            self._accepted_at[d] += d < accepted

    def capture_graphs(self, plans: Sequence[tuple[SpecConfig | None, int]]) -> int:
        """Capture now every fixed-shape step decoding under each plan (a speculation config or None, and
        the most rows it decodes at) can meet, so none lands inside a rollout; returns the new graphs."""
        step = self._static
        return 0 if step is None else step.capture([k for p in plans for k in step.keys_for(*p)])

    @property
    def max_nodes(self) -> int | None:
        """Nodes a row the fixed-shape step verifies at most (the pending token and its drafts: the largest
        node bucket captured); None on the dynamic path, where the token budget is the only limit."""
        return None if self._static is None else self._static.max_nodes

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """Run `requests` to completion (the generator must be idle); completions in request order."""
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle generator; drive step() yourself to mix workloads")
        return run_requests(self, requests)

    @classmethod
    def for_requests(
        cls,
        model: Transformer,
        requests: Sequence[Request],
        *,
        max_batch: int = 32,
        spec: SpecConfig | None = None,
        drafters: Mapping[str, Drafter] | None = None,
        eos_token_ids: Sequence[int] | None = None,
        return_hidden: bool = False,
        share_prompts: bool = True,
        static: bool | None = None,
    ) -> Generator:
        """A generator sized for `requests`: slots and length fit the job (a static cache's bytes, a grown
        one's limits). eos_token_ids: stop ids for every request (None: the model config's; () decodes to
        max_tokens); share_prompts, static: as in `__init__`."""
        num_slots = max(1, min(max_batch, len(requests)))
        longest = max(len(r.prompt_ids) + r.params.max_tokens for r in requests)
        # Room for one verify pass's nodes past the last committed token before they are rolled back.
        slack = 0 if spec is None else spec.verify_budget + 2
        return cls(
            model,
            num_slots=num_slots,
            max_len=min(longest + slack, model.config.max_position_embeddings),
            eos_token_ids=eos_token_ids,
            return_hidden=return_hidden,
            spec=spec,
            drafters=drafters,
            share_prompts=share_prompts,
            static=static,
        )

    def _forward(self, input_ids: list[int], layout: BatchLayout) -> tuple[Tensor, Tensor]:
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.cache.device)
        self._stats["iterations"] += 1
        self._stats["target_passes"] += 1
        return self.model(ids, layout.positions, layout, self.cache)

    def _logit_hidden(self, hidden: Tensor, layout: BatchLayout) -> Tensor | None:
        """[num_logits, hidden] states of the logit rows, on the model's device, if completions or drafters
        use them (a completion takes its own to the CPU once, when it finishes)."""
        if not (self.return_hidden or self.speculator.needs_hidden):
            return None
        return hidden if layout.logit_rows is None else hidden.index_select(0, layout.logit_rows)

    def _extend(
        self,
        seq: Running,
        tokens: list[int],
        logprobs: list[float],
        hidden: Tensor | None = None,
        drafted: int = 0,
    ) -> StepOutput:
        """Append one pass's emitted tokens (accepted drafts, then the target's own token) up to the first
        stop id or length limit — what follows would never have existed in plain decoding — and finish the
        request if a limit was met. hidden: [len(tokens), hidden] states that sampled them, or None."""
        reason = None
        taken = 0
        for token in tokens:
            seq.tokens.append(token)
            taken += 1
            if token in seq.stop_ids:
                reason = "stop"
            elif seq.num_generated >= seq.request.params.max_tokens or len(seq.tokens) >= self.cache.max_len:
                reason = "length"
            if reason is not None:
                break
        accepted = min(taken, len(tokens) - 1) if drafted else 0  # the last token is the target's own
        if taken < len(tokens):
            tokens, logprobs = tokens[:taken], logprobs[:taken]
        seq.logprobs.extend(logprobs)
        if seq.policy is not None:
            seq.policy.extend([True] * taken)
        if hidden is not None:
            hidden = hidden[:taken]
            if self.return_hidden:
                seq.hidden.extend(hidden.unbind(0))
        seq.target_passes += 1
        seq.drafted += drafted
        seq.accepted += accepted
        self._stats["drafted"] += drafted
        self._stats["accepted"] += accepted
        self._stats["committed"] += taken
        if self.speculator.drafters:
            state = seq.draft_state
            if self.speculator.needs_hidden:  # after an answer, its tokens' states too
                state = replace(state, hidden=seq.take_answer_states(hidden))
            self.speculator.observe(state)
        request_id = seq.request.request_id
        if reason is not None and seq.request.pause_on_stop:
            # A stop id, or the budget ran out: paused either way, so the caller cuts at the turn's own end
            # (a stop sequence, its cap) where one came first, as plain decoding does, even in one step.
            seq.parked = True
            return StepOutput(request_id=request_id, token_ids=tokens, logprobs=logprobs, paused=True,
                              finish_reason=reason)  # fmt: skip
        if reason is None:
            return StepOutput(request_id=request_id, token_ids=tokens, logprobs=logprobs)
        completion = self._complete(seq, reason)
        return StepOutput(request_id=request_id, token_ids=tokens, logprobs=logprobs, finish_reason=reason,
                          completion=completion)  # fmt: skip

    def _complete(self, seq: Running, reason: str) -> Completion:  # `seq` leaves: its slot frees
        live = self.scheduler.finish(seq)
        self.speculator.finish(seq.request.request_id, None if live else seq.group)
        return Completion(
            request_id=seq.request.request_id, prompt_ids=seq.tokens[: seq.num_prompt], token_ids=seq.tokens[seq.num_prompt :],
            logprobs=seq.logprobs, finish_reason=reason, group_id=seq.request.group_id,
            hidden=torch.stack(seq.hidden).cpu() if seq.hidden else None, target_passes=seq.target_passes,
            drafted=seq.drafted, accepted=seq.accepted, policy_mask=seq.policy,
        )  # fmt: skip


STATIC_PREFILL_TOKENS = 8192
"""Prompt tokens a prefill pass of the fixed-shape path may take at least (its own pass, not a mixed one)."""


def _cache_and_step(
    model: Transformer,
    num_slots: int,
    max_len: int,
    max_draft: int,
    grow_cache: bool | None,
    static: bool | None,
) -> tuple[KVCache, StaticStep | None]:
    """The generator's KV cache, and its fixed-shape step where it decodes in one (`Generator.__init__`
    says how `grow_cache` and `static` choose)."""
    weight = model.embed_tokens.weight
    if static is None:
        # SLIPSTREAM_STATIC_STEP=1 takes the fixed-shape path on any device (a CPU runs it eagerly): how
        # the suite runs the Generator's tests over the path a GPU replays.
        static = not grow_cache and (
            capabilities(weight.device).cuda_graphs or os.environ.get("SLIPSTREAM_STATIC_STEP") == "1"
        )
    if static and grow_cache:
        raise ValueError("static (fixed-shape) decoding needs a static KV cache: grow_cache must be False")
    cache = KVCache.for_model(
        model.config,
        num_slots=num_slots,
        max_len=max_len,
        dtype=weight.dtype,
        device=weight.device,
        grow=not static and (weight.device.type != "cuda" if grow_cache is None else grow_cache),
        page_size=PAGE_SIZE if static else 1,
        dummy_slot=static,
    )
    if not static:
        return cache, None
    batch, nodes = min(num_slots, BATCH_BUCKETS[-1]), min(1 + max_draft, NODE_BUCKETS[-1])
    return cache, StaticStep(model, cache, max_batch=batch, max_nodes=nodes)


def _default_token_budget(num_slots: int, max_draft: int) -> int:
    """The derived tokens per forward pass: every sequence's pending token and `max_draft` draft nodes fit
    in one pass, with room left for prefill chunks (at least 512, so prefill moves on at small batches)."""
    if max_draft < 0:
        raise ValueError(f"max_draft must be >= 0, got {max_draft}")
    return max(512, num_slots * (1 + max_draft) + 64)
