"""The learner's policy sharded with torch's FSDP2: each rank holds 1/N of the weights, gradients and moments.

`shard_policy(model)` applies `fully_shard` to each decoder layer, then to the root (embedding, final norm,
LM head), over the default process group (gloo on a CPU, NCCL on CUDA); `full_tensors` gathers parameters
back, one group at a time, for a push or an export. The model's training path does not go through
`nn.Module.__call__`, so the methods it calls are registered with FSDP (`register_fsdp_forward_method`):
`DecoderLayer.forward_train` per layer (the gather wraps its activation-checkpointed recompute too) and
`Transformer.forward_scored` / `forward_train` on the root.

Non-obvious choices:
- Gradients are SUMMED across ranks (divide factor 1, SUM reductions: gloo has neither AVG nor
  PREMUL_SUM), not averaged: the loss is already divided by the global token count
  (engine/policy_train.py), so the sum is the global batch's gradient.
- Mixed precision through FSDP's policy: parameters gathered in the compute dtype (bf16), gradients reduced
  in fp32, masters and AdamW's moments fp32 on the shard.
- Projections never use packed copies when sharded (`Transformer.train_only`): FSDP frees a gathered
  weight's storage and refills it, and a pack keyed on that storage could outlive the values it copied.
Run: `python -m pytest tests/engine/test_sharding.py` (two gloo ranks in real processes).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor

from slipstream.engine.model import Transformer

__all__ = ["full_tensors", "is_sharded", "local_bytes", "shard_policy"]


def shard_policy(model: Transformer, *, compute_dtype: torch.dtype = torch.float32) -> Transformer:
    """Shards `model` in place over the default process group (one FSDP unit per decoder layer, then the
    root) and returns it. compute_dtype: what forward and backward run in (gathered weights); gradients
    are reduced in fp32 and the sharded masters stay fp32."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("shard_policy needs an initialised process group (torch.distributed)")
    model.train_only()
    policy = (
        MixedPrecisionPolicy()
        if compute_dtype == torch.float32
        else MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    )
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
        register_fsdp_forward_method(layer, "forward_train")
    fully_shard(model, mp_policy=policy)
    for method in ("forward_scored", "forward_train"):
        register_fsdp_forward_method(model, method)
    for unit in model.modules():  # each unit's own setting: the root's covers its parameters alone
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` was sharded by `shard_policy` (its parameters are DTensors)."""
    return isinstance(model, FSDPModule)


def full_tensors(named: Sequence[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """(name, full value) for each of `named`, gathered from the ranks' shards one tensor at a time (a
    collective: every rank iterates the same names in the same order); a plain tensor passes through.
    The caller drops each value when done: no rank holds more than its shard and the values in hand."""
    for name, tensor in named:
        value = tensor.detach()
        yield name, value.full_tensor() if isinstance(value, DTensor) else value


def local_bytes(tensors: Sequence[Tensor | None]) -> int:
    """Bytes of `tensors` resident on this rank: a DTensor's local shard, a plain tensor whole, None 0."""
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total
