"""The learner's optimisation step: GRPO on scored samples, micro-batched by a token budget, AdamW.

`PolicyTrainer.step(samples)` scores every response token under the distribution the rollout sampled
from (`grpo.processed_logprobs`), takes the clipped GRPO loss against the rollout's log-probs (the
behaviour policy), accumulates gradients over micro-batches, clips the global norm and steps AdamW with
a warmup-then-constant-or-cosine learning rate.

Non-obvious choices:
- fp32 master weights only: trainable parameters in another dtype are refused (a bf16 weight swallows
  an lr-1e-6 update); the caller casts what it pushes to the rollouts' dtype. `precision="bf16"` runs the
  forward and backward under bf16 autocast (masters, gradients and AdamW's moments stay fp32; the
  log-softmax over the bf16 logits is computed in fp32).
- Token-mean over the GLOBAL batch: every micro-batch's and rank's loss is divided by the total response-
  token count, so micro-batching and ranks change nothing but rounding.
- Several ranks: the model is sharded with FSDP2 (engine/sharding.py: each rank holds 1/N of the weights,
  gradients and moments; gradients reduce-scattered as sums). Every forward and backward gathers weights
  collectively, so every rank runs as many micro-batches as the busiest one (an idle pass adds exact
  zeros), an empty rank too, and reduces the same sorted stats vector (the keys `grpo_loss` reports for
  this config, zeros or -inf where a rank has none). No token on any rank: no optimizer step.
  One rank: the plain model (FSDP over one rank holds the same bytes and gathers nothing).
- Micro-batches pack length-sorted sequences up to `micro_batch_tokens` padded tokens; the LM head runs on
  response positions only, `logprob_chunk_tokens` rows at a time (each chunk's logits recomputed in
  backward; within a chunk the logits' gradient overwrites them): an 8k-token sample never holds its
  [tokens, vocab] fp32 logits whole. With `activation_checkpointing` each decoder layer keeps only its
  input. The activations scale with the budget: it is the learner's memory knob (engine/memory_plan.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from slipstream.engine.grpo import LossConfig, grpo_loss, pad_sequences, processed_logprobs
from slipstream.engine.model import Transformer
from slipstream.engine.sharding import is_sharded, local_bytes

__all__ = ["PRECISIONS", "OptimConfig", "PolicySample", "PolicyTrainer", "Precision", "micro_batches"]

Precision = Literal["fp32", "bf16"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16")


@dataclass(frozen=True, kw_only=True)
class PolicySample:
    """One response to learn from, with what the rollout reported and its group-relative advantage."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    behaviour_logprobs: Sequence[float]
    """Per response token, under the processed sampling distribution (the rollout's `Completion.logprobs`)."""
    advantage: float
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    policy_mask: Sequence[bool] | None = None
    """Per response token: sampled by the policy (True) or an environment's answer in a multi-turn episode
    (False: context, never trained on or counted); None: every token is the policy's."""

    def __post_init__(self) -> None:
        if len(self.response_ids) != len(self.behaviour_logprobs):
            raise ValueError(
                f"{len(self.response_ids)} response ids but {len(self.behaviour_logprobs)} behaviour log-probs"
            )
        if self.policy_mask is not None and len(self.policy_mask) != len(self.response_ids):
            raise ValueError(
                f"{len(self.response_ids)} response ids but {len(self.policy_mask)} mask entries"
            )

        if not self.prompt_ids:
            raise ValueError("empty prompt")
        if not math.isfinite(self.advantage):
            raise ValueError(f"advantage must be finite, got {self.advantage}")

    @property
    def num_policy_tokens(self) -> int:
        """Response tokens the policy sampled: what the loss averages over."""
        return len(self.response_ids) if self.policy_mask is None else sum(map(bool, self.policy_mask))


class OptimConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """AdamW and its schedule (a struct, so a run config's misspelt key fails naming the field)."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0  # 0 = no clipping
    warmup_steps: int = 0  # linear warmup from lr / (warmup_steps + 1)
    total_steps: int = 0  # > 0: cosine decay to min_lr_ratio * lr at total_steps; 0: constant after warmup
    min_lr_ratio: float = 0.1
    micro_batch_tokens: int = 4096  # padded (prompt + response) tokens per forward/backward pass
    logprob_chunk_tokens: int = 4096  # response rows whose [rows, vocab] logits exist at once (0: all)

    def __post_init__(self) -> None:
        checks = {
            "lr": self.lr > 0,
            "weight_decay": self.weight_decay >= 0,
            "max_grad_norm": self.max_grad_norm >= 0,
            "warmup_steps": self.warmup_steps >= 0,
            "total_steps": self.total_steps >= 0,
            "min_lr_ratio": 0 <= self.min_lr_ratio <= 1,
            "micro_batch_tokens": self.micro_batch_tokens >= 1,
            "logprob_chunk_tokens": self.logprob_chunk_tokens >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"optim.{name}: invalid value {getattr(self, name)!r}")

    def lr_factor(self, step: int) -> float:
        """Multiplier of `lr` at optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.total_steps <= self.warmup_steps:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _scorer(
    tokens: Tensor, sampling: dict[str, Tensor], *, overwrite: bool
) -> Callable[[Tensor, int, int], Tensor]:
    """score(logits, start, end): the log-probs of `tokens[start:end]` under their rows' processed sampling
    distribution (`grpo.processed_logprobs`), for `Transformer.forward_scored`'s chunks."""

    def score(logits: Tensor, start: int, end: int) -> Tensor:
        part = {name: value[start:end] for name, value in sampling.items()}
        return processed_logprobs(logits, tokens[start:end], **part, overwrite_logits=overwrite)

    return score


def _own(sample: PolicySample) -> Sequence[bool]:
    """The sample's policy mask (all True for a single turn)."""
    return [True] * len(sample.response_ids) if sample.policy_mask is None else sample.policy_mask


def micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices grouped so that each group's count × its longest length ≤ budget (a longer one goes alone).

    Sorted by length first, so a group pads little; the order within and across groups is deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > budget:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def _adamw(params: list[torch.nn.Parameter], optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW, fused where this torch supports the parameters' device and dtype (~10x faster step on CPU
    for 135M parameters, 0.11 s against 1.16 s), else the foreach implementation."""
    kwargs = {"lr": optim.lr, "weight_decay": optim.weight_decay, "betas": optim.betas}
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, ValueError, TypeError):
        return torch.optim.AdamW(params, **kwargs)


class _Totals:
    """Per-step sums over micro-batches (weighted by tokens) and maxima, over a fixed key set so that every
    rank reduces vectors of one layout; a key nobody reported stays 0 (sums) or -inf (maxima)."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.sums = {k: 0.0 for k in keys if not k.endswith(("_max", "_min"))}
        self.maxima = {k: -math.inf for k in keys if k.endswith(("_max", "_min"))}

    def add(self, stats: dict[str, float], tokens: int) -> None:
        for key, value in stats.items():
            if key == "tokens":
                continue
            if key.endswith("_max"):
                self.maxima[key] = max(self.maxima[key], value)
            elif key.endswith("_min"):
                self.maxima[key] = max(self.maxima[key], -value)  # max of the negation
            else:
                self.sums[key] += value * tokens


def _stat_keys(loss: LossConfig, with_ref: bool) -> list[str]:
    """The stats `grpo_loss` reports under `loss`, read off a one-token call rather than listed here, so
    the reduced key set follows grpo.py."""
    one = torch.zeros(1, 1)
    _, stats = grpo_loss(
        one, one, torch.zeros(1), torch.ones(1, 1, dtype=torch.bool), config=loss,
        ref_logprobs=one if with_ref else None,
    )  # fmt: skip
    return sorted(k for k in stats if k != "tokens")


class PolicyTrainer:
    """AdamW on every parameter of `model`; one `step` per RL step's batch; checkpointable."""

    def __init__(
        self,
        model: Transformer,
        *,
        optim: OptimConfig | None = None,
        loss: LossConfig | None = None,
        ref_model: Transformer | None = None,
        precision: Precision = "fp32",
        activation_checkpointing: bool = False,
    ) -> None:
        """precision: "fp32", or "bf16" for the forward and backward under bf16 autocast (fp32 masters).
        A sharded `model` (engine/sharding.py) is trained as such; activation_checkpointing: each decoder
        layer keeps only its input for backward."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.precision = precision
        self.model = model
        self.optim = optim or OptimConfig()
        self.loss = loss or LossConfig()
        if self.loss.kl_coef > 0 and ref_model is None:
            raise ValueError("loss.kl_coef > 0 needs a frozen reference model")
        self.ref_model = ref_model
        if ref_model is not None:
            ref_model.requires_grad_(False)
        self.sharded = is_sharded(model)
        for layer in model.layers:
            layer.checkpointing = activation_checkpointing
        self.params = [p for p in model.parameters() if p.requires_grad]
        dtypes = sorted({str(p.dtype) for p in self.params if p.dtype != torch.float32})
        if dtypes:
            raise ValueError(
                f"trainable parameters must be float32 master weights, got {', '.join(dtypes)}: "
                "load the policy with load_model(path, dtype=torch.float32) and cast what is pushed"
            )
        self.optimizer = _adamw(self.params, self.optim)
        self.steps = 0
        self._stat_keys = _stat_keys(self.loss, with_ref=ref_model is not None)

    def step(
        self, samples: Sequence[PolicySample], on_progress: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        """One optimizer step on this rank's `samples` (every rank of a data-parallel group calls it, with
        no samples too: the collectives need every rank). `on_progress` is called after each micro-batch:
        a step of any size shows its owner that it moves (the learner actor's hang deadline)."""
        device = self.model.embed_tokens.weight.device
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        counts = torch.tensor(
            [sum(s.num_policy_tokens for s in samples), sum(1 for s in samples if s.num_policy_tokens)],
            dtype=torch.float64,
            device=device,
        )
        if world > 1:
            dist.all_reduce(counts)
        num_tokens, num_seqs = (int(c) for c in counts.tolist())
        for group in self.optimizer.param_groups:
            group["lr"] = self.optim.lr * self.optim.lr_factor(self.steps)
        totals = _Totals(self._stat_keys)
        if num_tokens == 0:
            # Nothing to learn from on any rank (all agree: the counts are global). A zero-gradient AdamW
            # step would still move the weights along its momentum.
            return self._summary(totals, 0.0, 0.0, 0, 0, world=1, device=device)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        losses = 0.0
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        batches = [
            batch
            for group in micro_batches(lengths, self.optim.micro_batch_tokens)
            if (batch := [samples[i] for i in group if samples[i].response_ids])
        ]
        idle = self._idle_passes(len(batches), world, device)
        for batch in batches:
            loss, stats, tokens = self._micro_step(batch, num_tokens, num_seqs, device)
            loss.backward()
            losses += float(loss.detach())
            totals.add(stats, tokens)
            if on_progress is not None:
                on_progress()
        for _ in range(idle):
            self._idle_pass(device)
            if on_progress is not None:
                on_progress()
        grad_norm = self._reduce_and_clip(world)
        self.optimizer.step()
        self.steps += 1
        return self._summary(totals, losses, grad_norm, num_tokens, num_seqs, world, device)

    def _idle_passes(self, passes: int, world: int, device: torch.device) -> int:
        """How many idle passes this rank adds so that every rank runs as many forward/backward passes as
        the busiest (a sharded model gathers weights collectively in each); 0 when not sharded."""
        if not self.sharded or world == 1:
            return 0
        most = torch.tensor([passes], dtype=torch.int64, device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most) - passes

    def _idle_pass(self, device: torch.device) -> None:
        """A forward and backward of a one-token sequence whose loss is 0 · its log-prob: every gradient it
        adds is an exact zero, and the weights' gathers and reduce-scatters match the other ranks'."""
        ids = torch.zeros(1, 1, dtype=torch.int64, device=device)
        rows = torch.zeros(1, dtype=torch.int64, device=device)
        logp = self._forward(self.model, ids, rows, lambda logits, _s, _e: logits.float().logsumexp(-1))
        (logp.sum() * 0.0).backward()

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now of the policy's weights, their gradients and AdamW's state (measured
        from the tensors: a sharded rank's local shards), for the memory plan's check."""
        params = self.params
        moments = [
            t for state in self.optimizer.state.values() for t in state.values() if isinstance(t, Tensor)
        ]
        return {
            "weights": local_bytes(params),
            "gradients": local_bytes([p.grad for p in params]),
            "optimizer": local_bytes(moments),
        }

    def warm_up(self) -> None:
        """One forward and backward over a synthetic micro-batch of the full token budget, gradients then
        dropped, and AdamW's moments created (zeros, as its first step makes them): the step's largest
        buffers are allocated (and fail here, at start, if they do not fit) before the first real step.
        Nothing learned changes: no weight, no schedule advance, and the first step is a fresh one's."""
        device = self.model.embed_tokens.weight.device
        length = min(self.optim.micro_batch_tokens, self.model.config.max_position_embeddings)
        if length < 2:
            return
        # Every position but the first is a response token: the most logit rows a micro-batch can have.
        sample = PolicySample(
            prompt_ids=[0],
            response_ids=[0] * (length - 1),
            behaviour_logprobs=[0.0] * (length - 1),
            advantage=1.0,
        )
        if not self.optimizer.state:  # a fresh optimizer (a resumed one has its moments already)
            self._create_moments()
        was_training = self.model.training
        self.model.train()
        loss, _, _ = self._micro_step([sample], length - 1, 1, device)
        loss.backward()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.train(was_training)

    def _create_moments(self) -> None:
        """Make AdamW create its moments now, as its first step would: two model's worth of zeros that step
        0 otherwise allocates and first-touches inside the timed step. (It did not close the demo's
        first-step gap with the method on: docs/training.md.) The optimizer builds them itself, so their
        dtypes and devices are its own: one step at lr 0 on zero gradients, which leaves the weights
        bit-identical (x·(1 - 0·wd), x - 0·m) and the moments zero; the step counts are then reset, and
        the first real step is a fresh optimizer's (tested bitwise)."""
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        for param in self.params:
            param.grad = torch.zeros_like(param)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), Tensor):
                state["step"].zero_()
            else:
                state["step"] = 0

    def free_gradients(self) -> None:
        """Drop the last step's gradients (a model's worth of memory). `step` keeps them for inspection;
        the next step starts from zero either way, so a caller that pushes or checkpoints in between
        frees them first."""
        self.optimizer.zero_grad(set_to_none=True)

    @torch.inference_mode()
    def logprobs(self, samples: Sequence[PolicySample]) -> list[Tensor]:
        """Each sample's response log-probs under the current weights and its processed distribution.

        The same micro-batches and kernels as `step`, forward only: the "forward pass over the same tokens"
        that the learner's cost is measured against (`slipstream bench e2e`), and a recompute of old
        log-probs where a caller wants them."""
        device = self.model.embed_tokens.weight.device
        out: list[Tensor] = [torch.empty(0) for _ in samples]
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        for group in micro_batches(lengths, self.optim.micro_batch_tokens):
            index = [i for i in group if samples[i].response_ids]
            if not index:
                continue
            batch = [samples[i] for i in index]
            ids, rows, tokens, sampling, per_token = self._inputs(batch, device)
            logp = self._forward(self.model, ids, rows, _scorer(tokens, sampling, overwrite=False))
            for i, part in zip(index, torch.split(logp, per_token), strict=True):
                out[i] = part.cpu()
        return out

    def _inputs(
        self, batch: list[PolicySample], device: torch.device
    ) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor], list[int]]:
        """(input ids [B, L - 1], response rows of the flattened positions, response tokens, per-token
        sampling parameters, response lengths) for one micro-batch."""
        ids, _ = pad_sequences(
            [torch.tensor([*s.prompt_ids, *s.response_ids], dtype=torch.int64) for s in batch], pad=0
        )
        ids = ids.to(device)
        # Response token j of a sequence sits at position P + j and is predicted by the logits at P + j - 1.
        rows = torch.cat(
            [
                b * (ids.shape[1] - 1)
                + torch.arange(len(s.prompt_ids) - 1, len(s.prompt_ids) - 1 + len(s.response_ids))
                for b, s in enumerate(batch)
            ]
        ).to(device)  # [tokens] rows of the flattened [B * (L - 1)] positions
        tokens = torch.cat([torch.as_tensor(s.response_ids, dtype=torch.int64) for s in batch]).to(device)
        per_token = [len(s.response_ids) for s in batch]

        def params(name: str, dtype: torch.dtype) -> Tensor:
            return torch.cat(
                [
                    torch.full((n,), getattr(s, name), dtype=dtype)
                    for s, n in zip(batch, per_token, strict=True)
                ]
            ).to(device)

        sampling = {
            "temperature": params("temperature", torch.float32),
            "top_p": params("top_p", torch.float32),
            "top_k": params("top_k", torch.int64),
        }
        return ids[:, :-1], rows, tokens, sampling, per_token

    def _micro_step(
        self, batch: list[PolicySample], num_tokens: int, num_seqs: int, device: torch.device
    ) -> tuple[Tensor, dict[str, float], int]:
        ids, rows, tokens, sampling, per_token = self._inputs(batch, device)
        # Nothing reads a chunk's logits after backward: their gradient may take their place.
        logp = self._forward(self.model, ids, rows, _scorer(tokens, sampling, overwrite=True))
        ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref = self._forward(self.ref_model, ids, rows, _scorer(tokens, sampling, overwrite=False))
        pad = lambda x: pad_sequences(list(torch.split(x, per_token)))  # noqa: E731
        logp_padded, mask = pad(logp)
        if any(s.policy_mask is not None for s in batch):
            # An environment's tokens are context: out of the loss, the token count and the mismatch stats.
            own = torch.tensor([bool(x) for s in batch for x in _own(s)], dtype=torch.bool, device=device)
            mask = mask & pad(own)[0]
        behaviour = torch.cat([torch.as_tensor(s.behaviour_logprobs, dtype=torch.float32) for s in batch])
        behaviour_padded, _ = pad(behaviour.to(device))
        advantages = torch.tensor([s.advantage for s in batch], dtype=torch.float32, device=device)
        loss, stats = grpo_loss(
            logp_padded,
            behaviour_padded,
            advantages,
            mask,
            config=self.loss,
            ref_logprobs=None if ref is None else pad(ref)[0],
            num_tokens=num_tokens,
            num_seqs=num_seqs,
        )
        return loss, stats, int(mask.sum())

    def _forward(
        self, model: Transformer, ids: Tensor, rows: Tensor, score: Callable[[Tensor, int, int], Tensor]
    ) -> Tensor:
        """`score` over `model`'s logits at `rows`, chunk by chunk (`Transformer.forward_scored`), at the
        trainer's precision (logits in bf16 under autocast)."""
        chunk = self.optim.logprob_chunk_tokens
        if self.precision == "fp32":
            return model.forward_scored(ids, rows, score, chunk=chunk)
        with torch.autocast(ids.device.type, dtype=torch.bfloat16):
            return model.forward_scored(ids, rows, score, chunk=chunk)

    def _reduce_and_clip(self, world: int) -> float:
        """Clips the global gradient norm; returns it. Sharded, the gradients are reduce-scattered already
        (FSDP) and the norm is summed over the shards; one rank has nothing to reduce."""
        if world > 1 and not self.sharded:
            raise RuntimeError("several learner ranks need the sharded model (engine/sharding.py)")
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        max_norm = self.optim.max_grad_norm if self.optim.max_grad_norm > 0 else math.inf
        grads = [p.grad for p in self.params]
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # the shards' partial norms, combined
        torch.nn.utils.clip_grads_with_norm_(self.params, max_norm, norm)
        return float(norm)

    def _summary(
        self,
        totals: _Totals,
        losses: float,
        grad_norm: float,
        num_tokens: int,
        num_seqs: int,
        world: int,
        device: torch.device,
    ) -> dict[str, Any]:
        sums, maxima = sorted(totals.sums), sorted(totals.maxima)
        if world > 1:
            summed = torch.tensor(
                [totals.sums[k] for k in sums] + [losses], dtype=torch.float64, device=device
            )
            dist.all_reduce(summed)
            highs = torch.tensor([totals.maxima[k] for k in maxima], dtype=torch.float64, device=device)
            if len(highs):
                dist.all_reduce(highs, op=dist.ReduceOp.MAX)
            *sum_values, losses = summed.tolist()
            totals.sums = dict(zip(sums, sum_values, strict=True))
            totals.maxima = dict(zip(maxima, highs.tolist(), strict=True))
        out: dict[str, Any] = {
            "step": self.steps,
            "loss": losses,
            "grad_norm": grad_norm,
            "lr": self.optimizer.param_groups[0]["lr"],
            "tokens": num_tokens,
            "sequences": num_seqs,
        }
        for key in sums:
            out[key] = totals.sums[key] / max(num_tokens, 1)
        for key in maxima:
            high = totals.maxima[key]
            if math.isinf(high):  # no token anywhere
                out[key] = 0.0
            else:
                out[key] = -high if key.endswith("_min") else high
        return out

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state and step count (the model's weights are saved by the caller)."""
        return {"optimizer": self.optimizer.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
