"""Training the EAGLE head online: the loss, packed training pairs, the k-step unroll, and `DrafterTrainer`.

Every buffered sequence gives one training pair per row but the last: (feature f_i, token x_{i+1}) →
f_{i+1}, with f the target's final norm of its state (`eagle.py` says why). `drafter_loss` is EAGLE's:
smooth-L1 between predicted and true features plus 0.1 × cross-entropy against the *target's*
distribution at i + 1 (soft labels), on pairs whose drafted token x_{i+2} is a response token.

Non-obvious choices (measurements and the unroll's derivation: docs/engine.md, "Drafter training"):
- `head_cross_entropy` never builds the [N, V] logits whole: row chunks compute both logit blocks, the loss
  and its gradient in one go. `ce_vocab="topk"` (the default) takes both softmaxes over a candidate set
  shared by the batch (`ce_candidates`): biased, but as good as the full loss held out, and faster.
- Sequences are packed without padding (`EagleHead.forward`).
- The unroll (`unrolled_forward`) trains step k on its own step k - 1 predictions, attending as it does
  when drafting; step losses are weighted by decay^k.
- `DrafterTrainer.step` is one short optimizer step, abandoned between its phases when `stop` says so: a
  drafter actor honours a preemption within one phase.
- Everything runs on the target's device; a batch may arrive on the host (`make_pairs` moves it).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from slipstream.engine.buffer import PackedBatch
from slipstream.engine.device import packed_gemm
from slipstream.engine.eagle import EagleHead, target_features, varlen_attention
from slipstream.engine.model import Transformer, _linear, _PackedWeight

__all__ = [
    "CE_VOCABS",
    "DraftPairs",
    "DrafterTrainer",
    "ce_candidates",
    "drafter_loss",
    "head_cross_entropy",
    "make_pairs",
    "unroll_mask",
    "unrolled_forward",
]


CE_CHUNK_ELEMENTS = 1 << 22
"""Logits computed at once by the loss ([rows, vocab] float32: 16 MiB). Chunks this small stay in glibc's
heap instead of being mmapped afresh per call, and never hold a [N, V] tensor."""

CE_VOCABS = ("full", "topk")

CE_CHUNK_ROWS = 128
"""At most this many rows per chunk of the loss: a preemption (`stop`, polled between chunks) waits for one
chunk. At 512 tokens and ~12k candidates the loss was one ~250 ms block on a core, and the step's end
(the learner's start) waited ~90 ms on average for a leased drafter to let go (2026-11-26)."""


class _Abandoned(Exception):
    """Raised inside the loss and between a step's phases when `stop` says so: the step is abandoned
    before anything changed."""


def _poll(stop: Callable[[], bool] | None) -> None:
    if stop is not None and stop():
        raise _Abandoned


# Packed copies of LM heads (W and its transpose), per weight tensor: the fast CPU matmul path
# (`model._linear`) needs them, and building one costs ~100 ms for a 49k × 576 head, so they outlive a call.
# The tensor object only finds the pair (and lets it die with the tensor); each pack is rebuilt when the
# weight's data_ptr or version counter moves (`_PackedWeight`), so an in-place head update repacks.
_PACKS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _packs(weight: Tensor) -> tuple[_PackedWeight, _PackedWeight]:
    packs = _PACKS.get(weight)
    if packs is None:
        packs = _PACKS[weight] = (_PackedWeight(), _PackedWeight())  # W and Wᵀ
    return packs


class _HeadCrossEntropy(torch.autograd.Function):
    """Σ_i w_i · CE(softmax(t_i Wᵀ), softmax(p_i Wᵀ)) over row chunks, its gradient computed on the way.

    Never materialises [N, V]: per chunk the two logit blocks are built, reduced to the loss and to the
    gradient d/dp_i = w_i (softmax(p_i Wᵀ) - softmax(t_i Wᵀ)) W, and dropped. Same FLOPs as autograd
    (three [rows, d] × [d, V] products) but a fraction of the memory traffic. The loss is a scalar, so the
    backward pass only scales the gradient kept from the forward one (as Liger's fused linear CE does).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        pred: Tensor,
        target: Tensor,
        weight: Tensor,
        row_weights: Tensor,
        needs_grad: bool,
        stop: Callable[[], bool] | None,
    ) -> tuple[Tensor, Tensor]:
        pack, pack_t = _packs(weight)
        # float32 at least (float64 stays: gradcheck), whatever the head's dtype.
        compute = torch.promote_types(weight.dtype, torch.float32)
        chunk = max(1, min(CE_CHUNK_ELEMENTS // weight.shape[0], CE_CHUNK_ROWS))
        loss = torch.zeros((), dtype=compute, device=pred.device)
        correct = torch.empty(pred.shape[0], dtype=torch.bool, device=pred.device)  # [N]
        grad = torch.empty_like(pred) if needs_grad else None  # [N, d]
        if stop is not None and (gemm := packed_gemm(weight.device, weight.dtype, weight.shape[0])):
            # Packed before the first chunk's poll, not inside the chunk: a preemption waits for one piece.
            pack.get(weight, gemm)
            if needs_grad and (gemm_t := packed_gemm(weight.device, weight.dtype, weight.shape[1])):
                pack_t.get(weight.t(), gemm_t)
        for lo in range(0, pred.shape[0], chunk):
            if stop is not None and stop():
                raise _Abandoned
            rows = slice(lo, lo + chunk)
            logits = _linear(pred[rows], weight, None, pack).to(compute)  # [c, V]
            p = _linear(target[rows], weight, None, pack).to(compute)  # [c, V]
            w = row_weights[rows].to(compute)  # [c]
            # Every reduction below is one pass over [c, V], in place where it can be: these passes, not
            # the arithmetic, are what costs beside the products.
            logits_max, head_argmax = logits.max(-1, keepdim=True)
            correct[rows] = (head_argmax == p.argmax(-1, keepdim=True)).view(-1)
            p = torch.softmax(p, dim=-1)
            # CE = lse(z) - Σ_v p_v z_v (Σ p = 1); the sum is a batched dot product: no third [c, V].
            dot = torch.bmm(p[:, None, :], logits[:, :, None]).view(-1)  # [c]
            q = logits.sub_(logits_max).exp_()  # unnormalised softmax(z), in the logits' buffer
            q_sum = q.sum(-1, keepdim=True)
            loss += (w * ((logits_max + q_sum.log()).view(-1) - dot)).sum()
            if grad is not None:
                dlogits = q.div_(q_sum).sub_(p).mul_(w[:, None])  # [c, V] d loss / d logits
                grad[rows] = _linear(dlogits.to(weight.dtype), weight.t(), None, pack_t).to(pred.dtype)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, _: Any) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        # None when the forward pass needed none (a head output without grad, but a trainable lm_head).
        grad_pred = None if grad is None else (grad * grad_loss).to(grad.dtype)
        return grad_pred, None, None, None, None, None


def head_cross_entropy(
    pred_hidden: Tensor,
    target_hidden: Tensor,
    lm_head: Tensor,
    row_weights: Tensor,
    stop: Callable[[], bool] | None = None,
) -> tuple[Tensor, Tensor]:
    """Σ_i row_weights_i · soft cross-entropy of the head's logits against the target's, from features.

    pred_hidden, target_hidden: [N, d]; lm_head: [V, d] frozen (never gets a gradient; pass rows of it to
    normalise over a sub-vocabulary); row_weights: [N]. Logits are x Wᵀ in lm_head's dtype, reduced in
    float32 or wider, in chunks of rows. Returns (loss scalar, differentiable in pred_hidden; [N] bool:
    the head's argmax equals the target's). `stop` is polled between chunks; once it says True the loss
    raises `_Abandoned` (`DrafterTrainer.step` abandons the step).
    """
    needs_grad = torch.is_grad_enabled() and pred_hidden.requires_grad
    return _HeadCrossEntropy.apply(
        pred_hidden.to(lm_head.dtype),
        target_hidden.detach().to(lm_head.dtype),
        lm_head,  # not detached: the packs are cached per tensor object; backward gives it no gradient
        row_weights.detach(),
        needs_grad,
        stop,
    )


@torch.no_grad()
def ce_candidates(
    target_hidden: Tensor, lm_head: Tensor, tokens: Tensor, k: int, stop: Callable[[], bool] | None = None
) -> Tensor | None:
    """[U] sorted vocabulary ids: the union over rows of the target's top-k tokens, plus `tokens`.

    target_hidden: [N, d] target features; lm_head: [V, d]; tokens: [T] ids always included (the batch's
    own tokens: what the target actually emitted). The target's logits are built in row chunks, forward
    only: a third of the cost of the full-vocabulary loss, and the only full-vocabulary product left. It
    is most of a drafter step (~0.3 s of ~0.4 at 512 tokens on a core), so `stop` is polled between chunks:
    None once it says True (a preemption then waits for one chunk, not the whole product).
    """
    weight = lm_head.detach()
    pack, _ = _packs(lm_head)  # keyed by the tensor object: a fresh detached view would miss the cache
    k = min(k, weight.shape[0])
    chunk = max(1, CE_CHUNK_ELEMENTS // weight.shape[0])
    features = target_hidden.to(weight.dtype)
    # A membership mask rather than torch.unique: no sort of the N·k ids.
    chosen = torch.zeros(weight.shape[0], dtype=torch.bool, device=weight.device)  # [V]
    chosen[tokens.to(weight.device)] = True
    for lo in range(0, features.shape[0], chunk):
        if stop is not None and lo > 0 and stop():
            return None
        logits = _linear(features[lo : lo + chunk], weight, None, pack)  # [c, V]
        chosen[logits.topk(k, dim=-1, sorted=False).indices] = True
    return chosen.nonzero().view(-1)


def drafter_loss(
    pred_hidden: Tensor,
    target_hidden: Tensor,
    lm_head: Tensor,
    mask: Tensor,
    *,
    ce_weight: float = 0.1,
    candidates: Tensor | None = None,
    stop: Callable[[], bool] | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """EAGLE loss on the rows where mask is True: smooth-L1 + ce_weight × soft cross-entropy.

    pred_hidden, target_hidden: [N, d] head outputs and the target's features; lm_head: [V, d] the
    target's (frozen) LM head, which turns both into logits; mask: [N] bool. smooth-L1 (beta 1) is
    averaged over the hidden dimension, then both terms over the masked rows. The cross-entropy is
    -Σ_v softmax(target_logits)_v · log_softmax(pred_logits)_v, over the whole vocabulary, or over
    `candidates` ([U] vocabulary ids, see `ce_candidates`) with both softmaxes normalised there: a biased
    but much cheaper estimate when the candidates hold nearly all of both distributions' mass.
    parts: smooth_l1, ce, accuracy (the head's argmax equals the target's, among the candidates), tokens.
    """
    mask = mask.bool()
    tokens = int(mask.sum())
    if tokens == 0:
        zero = pred_hidden.sum() * 0.0  # keeps the graph: backward() still works
        return zero, {"smooth_l1": 0.0, "ce": 0.0, "accuracy": 0.0, "tokens": 0}
    pred_h, true_h = pred_hidden[mask], target_hidden[mask]  # [tokens, d]
    smooth_l1 = F.smooth_l1_loss(pred_h.float(), true_h.float(), reduction="none").mean(-1).mean()
    weight = lm_head if candidates is None else lm_head.detach()[candidates]  # [V or U, d]
    row_weights = torch.full((tokens,), 1.0 / tokens, device=pred_h.device)
    ce, correct = head_cross_entropy(pred_h, true_h, weight, row_weights, stop)
    loss = smooth_l1 + ce_weight * ce.to(smooth_l1.dtype)
    return loss, {
        "smooth_l1": float(smooth_l1.detach()),
        "ce": float(ce.detach()),
        "accuracy": float(correct.float().mean()),
        "tokens": tokens,
    }


@dataclass(frozen=True)
class DraftPairs:
    """Training pairs of a packed batch, all derived from the frozen target (no graph)."""

    tokens: Tensor
    """[M] int64 x_{i+1}, the token each pair embeds."""
    features: Tensor
    """[M, d] f_i, in the head's dtype."""
    target_features: Tensor
    """[M, d] f_{i+1}, the regression target."""
    positions: Tensor
    """[M] int64, restarting at 0 per sequence."""
    cu_seqlens: tuple[int, ...]
    """[S + 1] offsets of each sequence's pairs (one fewer than its rows)."""
    mask: Tensor
    """[M] bool: pairs whose drafted token x_{i+2} is one the rollout drafts (after the first response
    token, which the prefill samples)."""


@torch.no_grad()
def make_pairs(target: Transformer, batch: PackedBatch, dtype: torch.dtype) -> DraftPairs:
    """Pairs (f_i, x_{i+1}) → f_{i+1} of every sequence in `batch`; a sequence of T rows gives T - 1."""
    device = target.lm_head_weight.device
    inputs, nexts, positions, offsets, masks = [], [], [], [0], []
    for s in range(batch.num_seqs):
        lo, hi = batch.cu_seqlens[s], batch.cu_seqlens[s + 1]
        count = hi - lo - 1
        local = torch.arange(count)
        inputs.append(local + lo)
        nexts.append(local + lo + 1)
        positions.append(local)
        offsets.append(offsets[-1] + count)
        # Pair i drafts token i + 2; the first response token (index response_start) is never drafted.
        masks.append(local + 2 > batch.response_starts[s])
    # Index tensors are built on the host and moved once each.
    rows_in, rows_next = torch.cat(inputs).to(device), torch.cat(nexts).to(device)
    states = batch.hidden.to(device=device, dtype=target.lm_head_weight.dtype)
    features = target_features(target, states)  # [N, d]
    return DraftPairs(
        tokens=batch.token_ids.to(device)[rows_next],
        features=features[rows_in].to(dtype),
        target_features=features[rows_next].to(dtype),
        positions=torch.cat(positions).to(device),
        cu_seqlens=tuple(offsets),
        mask=torch.cat(masks).to(device),
    )


def unroll_mask(length: int, step: int, device: torch.device | str = "cpu") -> Tensor:
    """[length, (step + 1) * length] bool visibility of unroll step `step` within one sequence.

    Query i sees step-0 keys j <= i - step and, for s = 1..step, the step-s key at j = i - step + s (its
    own draft ancestors). Every row sees at least its own key (block `step`, j = i), so none is empty.
    """
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    blocks = [j <= i - step] + [j == i - step + s for s in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


def unrolled_forward(
    head: EagleHead,
    embeds: Tensor,
    features: Tensor,
    positions: Tensor,
    cu_seqlens: Sequence[int],
    steps: int,
) -> list[Tensor]:
    """Head outputs [M, d] for unroll steps 0..steps-1 over packed pairs (see the module docstring).

    Step 0 is the plain packed causal forward. At step k, row i's feature is step k-1's output at row
    i - 1; rows with i < k (local index) have no such history: their outputs are meaningless and must be
    masked out of the loss.
    """
    first_rows = torch.zeros(features.shape[0], dtype=torch.bool, device=features.device)
    first_rows[torch.tensor([int(b) for b in cu_seqlens[:-1]], device=features.device)] = True
    outputs: list[Tensor] = []
    keys: list[Tensor] = []
    values: list[Tensor] = []
    step_features = features
    for step in range(steps):
        if step > 0:
            shifted = torch.cat([features[:1], outputs[-1][:-1]])
            step_features = torch.where(first_rows[:, None], features, shifted)
        x = head.fuse(embeds, step_features)
        q, k, v = head.qkv(x, positions)
        keys.append(k)
        values.append(v)
        attn = varlen_attention(
            q, keys, values, cu_seqlens, lambda length, step=step: unroll_mask(length, step)
        )
        outputs.append(head.finish(x, attn))
    return outputs


class DrafterTrainer:
    """AdamW on the head's parameters only; one short `step` per packed batch; checkpointable."""

    def __init__(
        self,
        head: EagleHead,
        target: Transformer,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        grad_clip: float | None = 1.0,
        unroll_steps: int = 1,
        unroll_decay: float = 0.8,
        ce_weight: float = 0.1,
        ce_vocab: str = "topk",
        ce_topk: int = 64,
        warmup_steps: int = 0,
    ) -> None:
        """lr, weight_decay, betas: AdamW; warmup_steps: the learning rate ramps linearly from lr /
        warmup_steps to lr over this many steps (0: none) — AdamW's first steps, with empty moments, move
        every weight by about lr whatever its gradient, which knocks a trained head off its optimum;
        grad_clip: max global grad norm (None: no clipping); unroll_steps: draft steps simulated per batch
        (1 = no unroll); unroll_decay: weight of step k is decay^k; ce_weight: weight of the cross-entropy term;
        ce_vocab: "topk" (softmaxes over the batch's `ce_candidates`: each row's top-`ce_topk` target tokens
        and the batch's tokens; see the module docstring) or "full" (over the whole vocabulary, exact);
        ce_topk: k of "topk"."""
        if unroll_steps < 1:
            raise ValueError(f"unroll_steps must be >= 1, got {unroll_steps}")
        if ce_vocab not in CE_VOCABS:
            raise ValueError(f"ce_vocab must be one of {CE_VOCABS}, got {ce_vocab!r}")
        if ce_topk < 1:
            raise ValueError(f"ce_topk must be >= 1, got {ce_topk}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.head = head
        self.lr = lr
        self.lr_scale = 1.0
        """A multiplier of lr set by the caller (a drafter rank divides it by the ranks training at once)."""
        self.warmup_steps = warmup_steps
        self.target = target
        self.unroll_steps = unroll_steps
        self.unroll_decay = unroll_decay
        self.ce_weight = ce_weight
        self.ce_vocab = ce_vocab
        self.ce_topk = ce_topk
        self.grad_clip = grad_clip
        self.steps = 0
        self.abandoned = 0  # steps `stop` cut short (a preempted drafter)
        self.optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay, betas=betas)

    def step(self, batch: PackedBatch, stop: Callable[[], bool] | None = None) -> dict[str, float] | None:
        """One optimizer step on `batch`; returns loss, smooth_l1, ce, accuracy (step 0), tokens, grad_norm,
        step_s, and with ce_vocab="topk" ce_vocab_size (ce and accuracy are then over the candidates).

        `stop` is polled between the step's phases (candidates, forward, backward) and between the row
        chunks of the candidate product and of the loss: once it says True the
        step is abandoned before the optimizer changes anything, and None is returned. A drafter actor
        passes `control_pending`, so a preemption waits for one phase, not a whole step."""
        start = time.perf_counter()
        self.head.train()
        try:
            loss, metrics = self._loss(batch, stop)
            grad_norm = self._optimize(loss, stop)
        except _Abandoned:
            return self._abandon()
        self.steps += 1
        self.head.eval()
        return {
            **metrics,
            "loss": float(loss.detach()),
            "grad_norm": grad_norm,
            "step_s": time.perf_counter() - start,
        }

    def _loss(self, batch: PackedBatch, stop: Callable[[], bool] | None) -> tuple[Tensor, dict[str, float]]:
        """The forward phases: candidates, the unrolled head, and the decay-weighted mean of its steps'
        losses, with the first step's parts and later steps' accuracies. `_Abandoned` once `stop` says so."""
        dtype = self.head.fc.weight.dtype
        pairs = make_pairs(self.target, batch, dtype)
        # The target's LM head is frozen: its weights may require grad (the learner's copy) but never get it.
        lm_head = self.target.lm_head_weight
        candidates, vocab_size = None, lm_head.shape[0]
        if self.ce_vocab == "topk":
            # One candidate set per batch, shared by every row and unroll step: the target's distributions
            # do not depend on the step.
            rows = pairs.target_features[pairs.mask]  # [tokens, d] the rows the loss sees
            candidates = ce_candidates(rows, lm_head, batch.token_ids, self.ce_topk, stop=stop)
            if candidates is None:
                raise _Abandoned
            vocab_size = candidates.numel()
            if vocab_size == lm_head.shape[0]:
                candidates = None  # small vocabularies: the full loss, without a gathered copy of the head
        _poll(stop)
        with torch.no_grad():
            embeds = self.target.embed_tokens(pairs.tokens).to(dtype)
        outputs = unrolled_forward(
            self.head, embeds, pairs.features, pairs.positions, pairs.cu_seqlens, self.unroll_steps
        )
        _poll(stop)
        local = pairs.positions  # index within its sequence
        total = torch.zeros((), device=embeds.device)
        weight_sum = 0.0
        metrics: dict[str, float] = {}
        for k, out in enumerate(outputs):
            mask = pairs.mask & (local >= k)
            # The loss is most of the forward phase: it polls `stop` between its row chunks.
            loss, parts = drafter_loss(
                out,
                pairs.target_features,
                lm_head,
                mask,
                ce_weight=self.ce_weight,
                candidates=candidates,
                stop=stop,
            )
            weight = self.unroll_decay**k
            total = total + weight * loss
            weight_sum += weight
            if k == 0:
                metrics = {**parts}
            else:
                metrics[f"accuracy_{k}"] = parts["accuracy"]
        if self.ce_vocab == "topk":
            metrics["ce_vocab_size"] = vocab_size
        return total / weight_sum, metrics

    def _optimize(self, loss: Tensor, stop: Callable[[], bool] | None) -> float:
        """The backward pass and the optimizer step; returns the gradient norm (before clipping).
        `_Abandoned` once `stop` says so, before the optimizer changes anything."""
        _poll(stop)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        _poll(stop)
        params = [p for p in self.head.parameters() if p.grad is not None]
        for group in self.optimizer.param_groups:
            group["lr"] = self.current_lr()
        if self.grad_clip is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip))
        else:
            grad_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
        self.optimizer.step()
        return grad_norm

    def current_lr(self) -> float:
        """The learning rate of the next optimizer step: lr x lr_scale, ramped over the first warmup_steps."""
        ramp = min(1.0, (self.steps + 1) / self.warmup_steps) if self.warmup_steps else 1.0
        return self.lr * self.lr_scale * ramp

    def _abandon(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.head.eval()
        self.abandoned += 1

    def weights(self) -> dict[str, Tensor]:
        """A detached copy of the head's trainable weights (what `EagleDrafter.load_state` takes)."""
        return {name: tensor.detach().clone() for name, tensor in self.head.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        """Head weights + optimizer state + step count: everything to resume training.

        A deep copy: the optimizer's own state dict references its live moment tensors, which the next
        step updates in place — a checkpoint written asynchronously would otherwise drift while it is saved.
        """
        optimizer = copy.deepcopy(self.optimizer.state_dict())
        return {"head": self.weights(), "optimizer": optimizer, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
