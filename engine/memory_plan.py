"""The learner's memory plan: per-rank bytes of weights, gradients, AdamW's moments and peak activations.

`plan_learner(config, ranks=…, micro_batch_tokens=…, …)` predicts what one learner rank holds at a step's
peak from the model's shapes alone, before anything is loaded; `MemoryPlan.check(capacity)` raises
`PlanDoesNotFit` naming the config field that would make it fit (`learner.ranks`,
`learner.activation_checkpointing`, `learner.optim.micro_batch_tokens`). The run prints the plan in its
first lines, keeps it in summary.json and checks it before any actor starts (rl/run.py); `slipstream bench
learner` measures the same quantities from the tensors (benchmarks/learner.py) beside the prediction.

Non-obvious choices:
- Shards as FSDP2 cuts them: each parameter along dim 0, ceil(rows / ranks) rows a rank (rank 0 holds
  the most), so the state term is exact for rank 0, not an average.
- Activations are an upper estimate per token per layer from the tensors autograd saves (norm inputs,
  projection inputs, q/k/v and the attention output, SwiGLU's three), in the compute dtype; with
  checkpointing a layer keeps its input alone and one layer at a time is recomputed. The LM head counts
  one chunk of fp32 logits (`logprob_chunk_tokens`) and the log-softmax's fixed 256-row temporaries.
- Sharded, a rank also holds gathered weights: the largest layer twice (FSDP prefetches the next unit)
  and the root (embedding, LM head) for the whole pass, in the compute dtype, plus that layer's unsharded
  fp32 gradients before their reduce-scatter.
Run: `python -c "from slipstream.engine.memory_plan import plan_learner; ..."`, or see summary.json.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from slipstream.engine.config import ModelConfig

__all__ = ["MemoryPlan", "PlanDoesNotFit", "parameter_shapes", "plan_learner"]

LOGSOFTMAX_ROWS = 256  # grpo.processed_logprobs' chunk_rows: its fp32 [rows, vocab] temporaries
HEADROOM = 0.9  # of a device's memory the plan may use: allocator fragmentation, the runtime, buffers


class PlanDoesNotFit(ValueError):
    """A learner config whose memory plan exceeds its device; the message names the field to change."""


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every trainable parameter of engine/model.py's Transformer for `config`."""
    h, hd = config.hidden_size, config.head_dim
    heads, kv, inner = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        shapes[p + "input_norm.weight"] = (h,)
        shapes[p + "attn.qkv.weight"] = ((heads + 2 * kv) * hd, h)
        if config.qkv_bias:
            shapes[p + "attn.qkv.bias"] = ((heads + 2 * kv) * hd,)
        shapes[p + "attn.o_proj.weight"] = (h, heads * hd)
        if config.o_bias:
            shapes[p + "attn.o_proj.bias"] = (h,)
        shapes[p + "post_norm.weight"] = (h,)
        shapes[p + "mlp.gate_up.weight"] = (2 * inner, h)
        shapes[p + "mlp.down.weight"] = (h, inner)
        if config.mlp_bias:
            shapes[p + "mlp.gate_up.bias"] = (2 * inner,)
            shapes[p + "mlp.down.bias"] = (h,)
    shapes["final_norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _shard_numel(shape: tuple[int, ...], ranks: int) -> int:
    """Elements rank 0 holds of a parameter FSDP2 shards along dim 0 over `ranks`."""
    return math.ceil(shape[0] / ranks) * _numel(shape[1:])


@dataclass(frozen=True)
class MemoryPlan:
    """Per-rank bytes at a step's peak. `state` = weights + gradients + optimizer (what stays resident)."""

    ranks: int
    parameters: int
    weights: int
    gradients: int
    optimizer: int
    reference: int
    gathered: int
    activations: int
    gather_if_sharded: int
    """What `gathered` is at more than one rank: the check's estimate for a one-rank plan told to shard."""
    activations_checkpointed: int
    """What `activations` is with activation checkpointing on: the check's estimate for turning it on."""
    micro_batch_tokens: int
    activation_checkpointing: bool
    compute_dtype: str
    device: str

    @property
    def state(self) -> int:
        return self.weights + self.gradients + self.optimizer

    @property
    def total(self) -> int:
        return self.state + self.reference + self.gathered + self.activations

    def as_dict(self) -> dict[str, int | str | bool]:
        return {**asdict(self), "state": self.state, "total": self.total}

    def line(self) -> str:
        """One line for the run's first lines: GiB per rank by part."""
        gib = lambda n: f"{n / 2**30:.2f}"  # noqa: E731
        return (
            f"learner memory plan per rank ({self.ranks} rank{'s' * (self.ranks > 1)}, {self.device}, "
            f"{self.compute_dtype}): weights {gib(self.weights)} + gradients {gib(self.gradients)} + "
            f"moments {gib(self.optimizer)} + reference {gib(self.reference)} + gathered "
            f"{gib(self.gathered)} + activations {gib(self.activations)} "
            f"({self.micro_batch_tokens} tokens a micro-batch, checkpointing "
            f"{'on' if self.activation_checkpointing else 'off'}) = {gib(self.total)} GiB"
        )

    def check(self, capacity: int) -> None:
        """Raises PlanDoesNotFit when the plan exceeds HEADROOM of `capacity` bytes, naming the field that
        would make it fit: more ranks where the state dominates, else checkpointing, else fewer tokens."""
        budget = int(capacity * HEADROOM)
        if self.total <= budget:
            return
        gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
        problem = (
            f"the learner needs {gib(self.total)} a rank on {self.device} ({gib(self.state)} weights, "
            f"gradients and moments at {self.ranks} rank(s), {gib(self.activations)} activations), "
            f"more than {gib(budget)} ({HEADROOM:.0%} of {gib(capacity)})"
        )
        # The cheapest change that fits, in order: checkpointing (compute), more ranks (devices), fewer
        # tokens a micro-batch (more passes).
        best = min(self.activations, self.activations_checkpointed)
        if not self.activation_checkpointing and self.total - self.activations + best <= budget:
            raise PlanDoesNotFit(f"{problem}: set learner.activation_checkpointing: true")
        room = budget - self.gather_if_sharded - best  # sharded state shrinks as 1/ranks, the rest does not
        held = self.state + self.reference
        if room > 0 and held > room / 2:
            need = max(math.ceil(self.ranks * held / room), self.ranks + 1)
            also = "" if self.activation_checkpointing else " with learner.activation_checkpointing: true"
            raise PlanDoesNotFit(f"{problem}: raise learner.ranks (to {need} or more){also}")
        fixed = self.total - self.activations
        if fixed < budget:
            fit = max(1, int(self.micro_batch_tokens * (budget - fixed) / max(best, 1)))
            also = "" if self.activation_checkpointing else " with learner.activation_checkpointing: true"
            raise PlanDoesNotFit(f"{problem}: lower learner.optim.micro_batch_tokens (to about {fit}){also}")
        raise PlanDoesNotFit(
            f"{problem}: raise learner.ranks and lower learner.optim.micro_batch_tokens (the weights, "
            "gradients and moments alone leave no room for a micro-batch)"
        )


def _layer_activation_elements(config: ModelConfig) -> int:
    """Elements autograd keeps per token for one decoder layer (an upper estimate): the two norms' inputs
    and outputs, q, k and v as the attention reads them (k and v repeated to every query head) and its
    output twice (attention's and the output projection's input), and SwiGLU's gate, up, activation and
    product."""
    h, hd = config.hidden_size, config.head_dim
    heads, kv, inner = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    return 4 * h + 6 * heads * hd + 2 * kv * hd + 5 * inner


def plan_learner(
    config: ModelConfig,
    *,
    ranks: int = 1,
    micro_batch_tokens: int = 4096,
    logprob_chunk_tokens: int = 4096,
    activation_checkpointing: bool = False,
    compute_dtype: str = "float32",
    reference: bool = False,
    device: str = "cpu",
) -> MemoryPlan:
    """The per-rank plan of a learner training `config` (see the module docstring); compute_dtype
    "float32" or "bfloat16"; reference: a frozen reference model (KL) sharded the same way."""
    if ranks < 1 or micro_batch_tokens < 1:
        raise ValueError(f"ranks ({ranks}) and micro_batch_tokens ({micro_batch_tokens}) must be >= 1")
    shapes = parameter_shapes(config)
    parameters = sum(_numel(s) for s in shapes.values())
    local = sum(_shard_numel(s, ranks) for s in shapes.values()) if ranks > 1 else parameters
    item = 2 if compute_dtype == "bfloat16" else 4
    layer = sum(_numel(s) for n, s in shapes.items() if n.startswith("layers.0."))
    root = sum(_numel(s) for n, s in shapes.items() if not n.startswith("layers."))
    gather = (2 * layer + root) * item + layer * 4  # two layers and the root gathered, one's gradients
    tokens, hidden, vocab = micro_batch_tokens, config.hidden_size, config.vocab_size
    per_layer = _layer_activation_elements(config) * item
    layers = config.num_hidden_layers
    # Checkpointed: every layer's input kept, one layer's activations at a time in its recompute.
    checkpointed = tokens * (layers * hidden * item + per_layer)
    body = checkpointed if activation_checkpointing else tokens * layers * per_layer
    chunk = min(tokens, logprob_chunk_tokens) if logprob_chunk_tokens > 0 else tokens
    # Embedding output and the residual's gradient; the head's input rows (final norm in and out); one
    # chunk's fp32 logits (their gradient overwrites them) and the log-softmax's temporaries.
    head = tokens * hidden * (2 * item + 3 * 4) + chunk * vocab * 4 + 3 * LOGSOFTMAX_ROWS * vocab * 4
    return MemoryPlan(
        ranks=ranks,
        parameters=parameters,
        weights=4 * local,
        gradients=4 * local,
        optimizer=8 * local,
        reference=4 * local if reference else 0,
        gathered=gather if ranks > 1 else 0,
        activations=body + head,
        gather_if_sharded=gather,
        activations_checkpointed=checkpointed + head,
        micro_batch_tokens=micro_batch_tokens,
        activation_checkpointing=activation_checkpointing,
        compute_dtype=compute_dtype,
        device=device,
    )
