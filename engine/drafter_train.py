"""Training the EAGLE head online: the loss, packed training pairs, the k-step unroll, and `DrafterTrainer`.

Every buffered sequence (tokens + the target's pre-norm last-layer states, row-aligned) gives one training
pair per row but the last: (feature f_i, token x_{i+1}) → f_{i+1}, where f = the target's final norm of
its state (see `eagle.py` for why the head works on post-norm features). The loss (`drafter_loss`) is
EAGLE's: smooth-L1 between predicted and true features plus 0.1 × cross-entropy of the head's logits
against the *target's* distribution at i + 1 (soft labels: what the verifier will compare drafts with),
on pairs whose drafted token x_{i+2} is a response token the rollout would actually draft.

Sequences are packed without padding (`EagleHead.forward`: one GEMM per projection over all rows,
attention within each sequence, positions restarting at 0 per sequence).

The unroll closes the gap between training and drafting. When drafting, only the first draft step sees a
true feature; step k sees its own prediction from step k - 1, and its attention sees the committed prefix
(true features) plus the k draft pairs before it (predicted ones). `unrolled_forward` simulates exactly
that for every position at once: step k's row i takes out_{k-1}[i-1] as its feature, and attends to
step-0 keys at positions <= i - k plus, for s = 1..k, the step-s key at position i - k + s (a diagonal).
Step losses are weighted by decay^k. Gradients flow through the chained predictions, as they do at test
time through the draft.

`DrafterTrainer.step` is one optimizer step on one packed batch, short by construction (the batch's
token budget bounds it), so a drafter actor can honour a preemption between any two steps.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from slipstream.engine.buffer import PackedBatch
from slipstream.engine.eagle import EagleHead, target_features, varlen_attention
from slipstream.engine.model import Transformer

__all__ = ["DraftPairs", "DrafterTrainer", "drafter_loss", "make_pairs", "unroll_mask", "unrolled_forward"]


def drafter_loss(
    pred_hidden: Tensor,
    target_hidden: Tensor,
    pred_logits: Tensor,
    target_logits: Tensor,
    mask: Tensor,
    *,
    ce_weight: float = 0.1,
) -> tuple[Tensor, dict[str, float]]:
    """EAGLE loss on the rows where mask is True: smooth-L1 + ce_weight × soft cross-entropy.

    pred_hidden, target_hidden: [N, d]; pred_logits, target_logits: [N, V]; mask: [N] bool.
    smooth-L1 (beta 1) is averaged over the hidden dimension, then both terms over the masked rows; the
    cross-entropy is -Σ_v softmax(target_logits)_v · log_softmax(pred_logits)_v. Computed in float32.
    parts: smooth_l1, ce, accuracy (the head's argmax equals the target's), tokens.
    """
    mask = mask.bool()
    tokens = int(mask.sum())
    if tokens == 0:
        zero = pred_hidden.sum() * 0.0 + pred_logits.sum() * 0.0  # keeps the graph: backward() still works
        return zero, {"smooth_l1": 0.0, "ce": 0.0, "accuracy": 0.0, "tokens": 0}
    pred_h, true_h = pred_hidden[mask].float(), target_hidden[mask].float()
    pred_l, true_l = pred_logits[mask].float(), target_logits[mask].float()
    smooth_l1 = F.smooth_l1_loss(pred_h, true_h, reduction="none").mean(-1).mean()
    ce = -(torch.softmax(true_l, dim=-1) * torch.log_softmax(pred_l, dim=-1)).sum(-1).mean()
    loss = smooth_l1 + ce_weight * ce
    accuracy = (pred_l.argmax(-1) == true_l.argmax(-1)).float().mean()
    return loss, {
        "smooth_l1": float(smooth_l1.detach()),
        "ce": float(ce.detach()),
        "accuracy": float(accuracy),
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
    target_logits: Tensor
    """[M, V] the target's logits at i + 1 (its distribution over x_{i+2})."""
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
    rows_in, rows_next = torch.cat(inputs), torch.cat(nexts)
    states = batch.hidden.to(device=device, dtype=target.lm_head_weight.dtype)
    features = target_features(target, states)  # [N, d]
    return DraftPairs(
        tokens=batch.token_ids.to(device)[rows_next.to(device)],
        features=features[rows_in.to(device)].to(dtype),
        target_features=features[rows_next.to(device)].to(dtype),
        target_logits=target.head(states[rows_next.to(device)]),
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
    ) -> None:
        """lr, weight_decay, betas: AdamW; grad_clip: max global grad norm (None: no clipping);
        unroll_steps: draft steps simulated per batch (1 = no unroll); unroll_decay: weight of step k is
        decay^k; ce_weight: weight of the cross-entropy term."""
        if unroll_steps < 1:
            raise ValueError(f"unroll_steps must be >= 1, got {unroll_steps}")
        self.head = head
        self.target = target
        self.unroll_steps = unroll_steps
        self.unroll_decay = unroll_decay
        self.ce_weight = ce_weight
        self.grad_clip = grad_clip
        self.steps = 0
        self.optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay, betas=betas)

    def step(self, batch: PackedBatch) -> dict[str, float]:
        """One optimizer step on `batch`; returns loss, smooth_l1, ce, accuracy (step 0), tokens, grad_norm,
        step_s."""
        start = time.perf_counter()
        self.head.train()
        dtype = self.head.fc.weight.dtype
        pairs = make_pairs(self.target, batch, dtype)
        with torch.no_grad():
            embeds = self.target.embed_tokens(pairs.tokens).to(dtype)
        outputs = unrolled_forward(
            self.head, embeds, pairs.features, pairs.positions, pairs.cu_seqlens, self.unroll_steps
        )
        # The target's LM head, detached: its weights may require grad (the learner's copy) but never get it.
        lm_head = self.target.lm_head_weight.detach()
        local = pairs.positions  # index within its sequence
        total = torch.zeros((), device=embeds.device)
        weight_sum = 0.0
        metrics: dict[str, float] = {}
        for k, out in enumerate(outputs):
            logits = F.linear(out.to(lm_head.dtype), lm_head)
            mask = pairs.mask & (local >= k)
            loss, parts = drafter_loss(
                out, pairs.target_features, logits, pairs.target_logits, mask, ce_weight=self.ce_weight
            )
            weight = self.unroll_decay**k
            total = total + weight * loss
            weight_sum += weight
            if k == 0:
                metrics = {**parts}
            else:
                metrics[f"accuracy_{k}"] = parts["accuracy"]
        loss = total / weight_sum
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for p in self.head.parameters() if p.grad is not None]
        if self.grad_clip is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip))
        else:
            grad_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
        self.optimizer.step()
        self.steps += 1
        self.head.eval()
        return {
            **metrics,
            "loss": float(loss.detach()),
            "grad_norm": grad_norm,
            "step_s": time.perf_counter() - start,
        }

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
