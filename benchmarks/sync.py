"""Sync benchmark: bytes per cross-host weight push, full vs XOR delta, after real optimizer steps.

    slipstream bench sync --json                   # smollm2-135m, 3 steps at the demo's lr
    slipstream bench sync --dtype bfloat16 --json  # pushed in bf16 (a GPU rollout's dtype)

What a push across hosts moves (actors/learner.py): each parameter cast to the push dtype, sent as
`engine.weight_delta.xor_delta` against the previous version. Here the learner's side is replayed in one
process: fp32 masters, `PolicyTrainer` (AdamW, the GRPO loss) at the demo's learning rate on a demo-shaped
batch (8 prompts x 4 responses; "What is a + b?" through the chat template, answers right or wrong with
advantage +1/-1, log-probs on-policy; random ids for a model without a tokenizer), then per step: the
full bytes, the delta bytes (and their ratio), the encode and apply times, the share of elements whose
bits changed, a bitwise check of every applied tensor, and the same XOR compressed without byte planes
(what the choice in engine/weight_delta.py buys). `run` returns a JSON-ready dict (`SyncResult` fields).
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import msgspec
import torch
import zstandard

from slipstream.engine import hub
from slipstream.engine.config import ModelConfig, dtype_from_name
from slipstream.engine.policy_train import OptimConfig, PolicySample, PolicyTrainer
from slipstream.engine.tokenizer import Tokenizer
from slipstream.engine.weight_delta import LEVEL, apply_xor_delta, xor_delta
from slipstream.engine.weights import load_model
from slipstream.tasks.datasets import chat_prompt_ids

__all__ = ["DEMO_LR", "SyncResult", "SyncStep", "run"]

DEMO_LR = 2.0e-5  # deploy/configs/demo.yaml learner.optim.lr (a test keeps the two equal)
GROUPS, GROUP_SIZE = 8, 4  # the demo's prompts_per_step and group_size


class SyncStep(msgspec.Struct, frozen=True, kw_only=True):
    """One optimizer step's push of every parameter, as the next version's delta against this one's."""

    step: int
    train_s: float  # the optimizer step (forward, backward, AdamW)
    changed_share: float  # elements whose bits differ from the previous version, over all elements
    full_bytes: int  # every parameter in the push dtype: what a full push sends each destination
    delta_bytes: int  # the xor-zstd blobs of the same: what a delta push sends
    ratio: float  # full_bytes / delta_bytes
    encode_s: float  # xor_delta over every parameter (the learner, once per push)
    apply_s: float  # apply_xor_delta over every parameter (each receiver)
    exact: bool  # every applied tensor equals the new one bit for bit
    interleaved_bytes: int  # the same XOR compressed at the same level without byte planes
    interleaved_encode_s: float


class SyncResult(msgspec.Struct, frozen=True, kw_only=True):
    """What `run` measured (returned as a dict of these fields)."""

    model: str
    push_dtype: str
    lr: float
    params: int
    zstd_level: int
    zstd_threads: int
    torch_threads: int
    trainer: str  # what made the updates
    steps: list[SyncStep]
    mean_ratio: float
    encode_mb_s: float  # full bytes per second of encode, over all steps
    apply_mb_s: float


def _samples(path: Path, vocab: int, seed: int) -> list[tuple[list[int], list[int], float]]:
    """(prompt ids, response ids, advantage) of a demo-shaped GRPO batch: half of each group right."""
    rng = random.Random(seed)
    tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
    out = []
    for _ in range(GROUPS):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        question = f"What is {a} + {b}? Give the final answer in <answer></answer> tags."
        for i in range(GROUP_SIZE):
            right = i % 2 == 0
            c = a + b if right else a + b + rng.choice([-2, -1, 1, 2])
            answer = f"{a} + {b} = {c}. <answer>{c}</answer>"
            if tokenizer is not None:
                prompt = chat_prompt_ids(tokenizer, question)
                response = tokenizer.encode(answer, add_special_tokens=False)
            else:
                prompt = [rng.randrange(vocab) for _ in range(24)]
                response = [rng.randrange(vocab) for _ in range(12)]
            out.append((prompt, response, 1.0 if right else -1.0))
    return out


def _cast(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {n: p.detach().to("cpu", dtype, copy=True) for n, p in model.named_parameters()}


def _changed(prev: torch.Tensor, new: torch.Tensor) -> int:
    """Elements of `new` whose bits differ from `prev`'s."""
    differ = prev.reshape(-1).view(torch.uint8) != new.reshape(-1).view(torch.uint8)
    return int(differ.reshape(new.numel(), -1).any(1).sum())


def _interleaved(prev: torch.Tensor, new: torch.Tensor, compressor: zstandard.ZstdCompressor) -> int:
    """Bytes of the XOR compressed as it lies in memory (no byte planes), for the comparison."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[new.element_size()]
    x = torch.bitwise_xor(prev.reshape(-1).view(ints), new.reshape(-1).view(ints))
    return len(compressor.compress(x.view(torch.uint8).numpy()))


def _on_policy(trainer: PolicyTrainer, path: Path, vocab: int, seed: int) -> list[PolicySample]:
    """The demo-shaped batch as the trainer's samples, with on-policy behaviour log-probs: the step-0
    ratio is 1, as in a synchronous run."""
    plain = [PolicySample(prompt_ids=p, response_ids=r, behaviour_logprobs=[0.0] * len(r), advantage=a)
             for p, r, a in _samples(path, vocab, seed)]  # fmt: skip
    return [
        PolicySample(prompt_ids=s.prompt_ids, response_ids=s.response_ids,
                     behaviour_logprobs=lp.tolist(), advantage=s.advantage)
        for s, lp in zip(plain, trainer.logprobs(plain), strict=True)
    ]  # fmt: skip


def _push(
    step: int,
    train_s: float,
    prev: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    *,
    threads: int,
    interleaved: zstandard.ZstdCompressor,
) -> SyncStep:
    """One push of `new` as XOR deltas against `prev`: its bytes full and as deltas, the encode and apply
    times, whether every applied tensor is `new` bit for bit, and the same XOR without byte planes."""
    started = time.perf_counter()
    blobs = {n: xor_delta(prev[n], t, threads=threads) for n, t in new.items()}
    encode_s = time.perf_counter() - started
    started = time.perf_counter()
    applied = {n: apply_xor_delta(prev[n], blob) for n, blob in blobs.items()}
    apply_s = time.perf_counter() - started
    exact = all(torch.equal(applied[n].view(torch.uint8), t.view(torch.uint8)) for n, t in new.items())
    started = time.perf_counter()
    plain_bytes = sum(_interleaved(prev[n], t, interleaved) for n, t in new.items())
    interleaved_s = time.perf_counter() - started
    full = sum(t.numel() * t.element_size() for t in new.values())
    delta = sum(len(b) for b in blobs.values())
    changed = sum(_changed(prev[n], t) for n, t in new.items())
    return SyncStep(
        step=step, train_s=round(train_s, 3),
        changed_share=round(changed / sum(t.numel() for t in new.values()), 4),
        full_bytes=full, delta_bytes=delta, ratio=round(full / delta, 3),
        encode_s=round(encode_s, 3), apply_s=round(apply_s, 3), exact=exact,
        interleaved_bytes=plain_bytes, interleaved_encode_s=round(interleaved_s, 3),
    )  # fmt: skip


def run(
    model: str = "smollm2-135m",
    steps: int = 3,
    lr: float = DEMO_LR,
    dtype: str = "",
    *,
    threads: int = 0,
    seed: int = 0,
    log: bool = True,
) -> dict:
    """Trains `model` (a registry name or a model directory) for `steps` optimizer steps at `lr` and
    measures every step's push in `dtype` ("": the checkpoint's, what the learner pushes by default) as
    full bytes vs XOR-zstd deltas (`threads`: zstd's), checking each applied delta bitwise. Returns
    `SyncResult` as a JSON-ready dict (see the module docstring)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    path = hub.resolve(model)
    push_dtype = dtype_from_name(dtype) if dtype else ModelConfig.from_pretrained(path).dtype
    torch.manual_seed(seed)
    masters = load_model(path, dtype=torch.float32)  # as the learner: fp32 masters, pushes cast
    trainer = PolicyTrainer(masters, optim=OptimConfig(lr=lr, max_grad_norm=1.0, micro_batch_tokens=512))
    samples = _on_policy(trainer, path, masters.config.vocab_size, seed)
    interleaved = zstandard.ZstdCompressor(level=LEVEL)
    prev = _cast(masters, push_dtype)
    rows: list[SyncStep] = []
    for step in range(steps):
        started = time.perf_counter()
        trainer.step(samples)
        train_s = time.perf_counter() - started
        new = _cast(masters, push_dtype)
        row = _push(step, train_s, prev, new, threads=threads, interleaved=interleaved)
        rows.append(row)
        if log:
            full, delta = row.full_bytes, row.delta_bytes
            print(f"bench sync: step {step}: {full / 1e6:.1f} MB full, {delta / 1e6:.1f} MB delta "
                  f"({full / delta:.2f}x), encode {row.encode_s:.2f} s, apply {row.apply_s:.2f} s, "
                  f"exact {row.exact}", file=sys.stderr, flush=True)  # fmt: skip
        prev = new
    full_all = sum(r.full_bytes for r in rows)
    result = SyncResult(
        model=model,
        push_dtype=str(push_dtype).removeprefix("torch."),
        lr=lr,
        params=sum(p.numel() for p in masters.parameters()),
        zstd_level=LEVEL,
        zstd_threads=threads,
        torch_threads=torch.get_num_threads(),
        trainer="PolicyTrainer: AdamW + GRPO loss, fp32 masters, max_grad_norm 1.0",
        steps=rows,
        mean_ratio=round(sum(r.ratio for r in rows) / len(rows), 3),
        encode_mb_s=round(full_all / 1e6 / max(sum(r.encode_s for r in rows), 1e-9), 1),
        apply_mb_s=round(full_all / 1e6 / max(sum(r.apply_s for r in rows), 1e-9), 1),
    )
    return msgspec.to_builtins(result)
