"""Offline drafter warmup: train an EAGLE head on the target's own sampled outputs, export it, measure it.

Users run it (`slipstream drafter warmup`) before the first RL step so speculation pays from step one; the
rollout benchmark makes one on first use. Responses are sampled by the engine with hidden states kept,
the head trains `steps` optimizer steps on them, and held-out accept length is measured with the real
speculative generator: greedy chains k=3/5/7 and one tree, a sampled chain at k=5, and keyed sampled
chains k=3/5/7 (reproducible mode, the head drafting with the sampler's own noise). The head is written in
the EAGLE draft-model layout (`eagle_export`), with its training data's token counts, optionally in bf16;
the evals load that export back, so they measure the head as shipped (bf16-rounded), not the fp32 one.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slipstream.engine import eagle_export
from slipstream.engine.buffer import OnlineBuffer
from slipstream.engine.config import dtype_name
from slipstream.engine.drafter_train import DrafterTrainer
from slipstream.engine.drafters.eagle import EagleDrafter
from slipstream.engine.eagle import EagleHead
from slipstream.engine.generator import Completion, Generator, Request, run_requests
from slipstream.engine.model import Transformer
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.speculator import SpecConfig

ProgressFactory = Callable[[str, int], contextlib.AbstractContextManager[Any]]
"""(label, total) → a context yielding an object with advance() and add_tokens(n): `runtime.progress.bar`."""

EVAL_STRATEGIES = [(3, 1, 0), (5, 1, 0), (7, 1, 0), (4, 4, 16)]  # (depth, topk, verify): chains and one tree


def _generate(
    gen: Generator,
    prompts: list[list[int]],
    params: list[SamplingParams],
    label: str,
    progress: ProgressFactory | None,
) -> list[Completion]:
    requests = [
        Request(request_id=f"{label}-{i}", prompt_ids=p, params=s)
        for i, (p, s) in enumerate(zip(prompts, params, strict=True))
    ]
    if progress is None:
        return run_requests(gen, requests)
    with progress(label, len(requests)) as bar:
        return run_requests(gen, requests, on_done=lambda *_: bar.advance(), on_tokens=bar.add_tokens)


def accept_length(completions: list[Completion]) -> float:
    """Committed tokens per target pass, over all completions."""
    passes = sum(c.target_passes for c in completions)
    return sum(len(c.token_ids) for c in completions) / max(passes, 1)


def warmup(
    target: Transformer,
    train_prompts: list[list[int]],
    eval_prompts: list[list[int]],
    *,
    eos: list[int],
    steps: int,
    out: Path,
    max_tokens: int = 128,
    temperature: float = 1.0,
    seed: int = 0,
    batch_tokens: int = 2048,
    lr: float = 1e-3,
    server: str = "vllm",
    init_from: Path | None = None,
    unroll: int = 1,
    export_dtype: torch.dtype | None = None,
    progress: ProgressFactory | None = None,
) -> dict[str, Any]:
    """Sample the model's own responses to `train_prompts`, train an EAGLE head on them (from scratch, or
    continuing the exported head `init_from`, whose token counts are carried over), export it to `out`
    and measure accept lengths on `eval_prompts`; returns the summary also written to out/warmup.json.
    export_dtype: the exported tensors' dtype (None = the head's fp32; bf16 halves the file).
    progress: a bar factory (`runtime.progress.bar` in the CLI), None for silence."""
    started = time.perf_counter()
    target.requires_grad_(False)
    t0 = time.perf_counter()
    completions = _sample_own_outputs(
        target, train_prompts, eos=eos, max_tokens=max_tokens, temperature=temperature, seed=seed,
        progress=progress,
    )  # fmt: skip
    gen_s = time.perf_counter() - t0
    trained = _train_head(
        target, completions, steps=steps, batch_tokens=batch_tokens, lr=lr, unroll=unroll, seed=seed,
        init_from=init_from, progress=progress,
    )  # fmt: skip
    eagle_export.export(
        trained.head, target.config, out, server=server, version=trained.version, dtype=export_dtype,
        token_counts=trained.counts,
    )  # fmt: skip
    head, _ = eagle_export.load_head(out, target)  # what a user loads: bf16-rounded when exported so
    head.eval()
    evals = _accept_lengths(
        target, head, trained.counts, eval_prompts, eos=eos, max_tokens=max_tokens, temperature=temperature,
        progress=progress,
    )  # fmt: skip
    losses = trained.losses
    summary = {
        "out": str(out),
        "samples": len(train_prompts),
        "sampled_tokens": sum(len(c.token_ids) for c in completions),
        "sample_s": round(gen_s, 1),
        "steps": steps,
        "init_from": None if init_from is None else str(init_from),
        "version": trained.version,
        "unroll": unroll,
        "dtype": dtype_name(export_dtype or torch.float32),
        "train_s": round(trained.train_s, 1),
        "loss_first": round(losses[0], 4),
        "loss_last": round(sum(losses[-10:]) / len(losses[-10:]), 4),
        "accept_length": evals,
        "eval_samples": len(eval_prompts),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    (Path(out) / "warmup.json").write_text(json.dumps(summary, indent=2))
    return summary


def _sample_own_outputs(
    target: Transformer,
    prompts: list[list[int]],
    *,
    eos: list[int],
    max_tokens: int,
    temperature: float,
    seed: int,
    progress: ProgressFactory | None,
) -> list[Completion]:
    """The target's own responses to `prompts`, hidden states kept: the head's training data."""
    gen = Generator(target, num_slots=min(32, len(prompts)), return_hidden=True, eos_token_ids=eos)
    params = [
        SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i)
        for i in range(len(prompts))
    ]
    return _generate(gen, prompts, params, "sampling the model's own outputs", progress)


@dataclass
class _Trained:
    """A trained head, its export version, the token counts it carries, and how its training went."""

    head: EagleHead
    version: int
    counts: Counter[int]
    losses: list[float]
    train_s: float


def _train_head(
    target: Transformer,
    completions: list[Completion],
    *,
    steps: int,
    batch_tokens: int,
    lr: float,
    unroll: int,
    seed: int,
    init_from: Path | None,
    progress: ProgressFactory | None,
) -> _Trained:
    """Trains a head (new, or continuing the export `init_from`) for `steps` optimizer steps on `completions`."""
    buffer = OnlineBuffer(4 << 30, dtype=torch.float32)
    for c in completions:
        buffer.add_completion(c, policy_version=0)
    torch.manual_seed(seed)
    prior: Counter[int] = Counter()
    start_version = 0
    if init_from is not None:
        head, start_version = eagle_export.load_head(init_from, target)
        head = head.float()
        prior.update(eagle_export.load_token_counts(init_from))
    else:
        head = EagleHead.for_target(target.config)
    trainer = DrafterTrainer(head, target, lr=lr, unroll_steps=unroll)
    t0 = time.perf_counter()
    losses: list[float] = []
    with contextlib.ExitStack() as stack:
        bar = stack.enter_context(progress("training the drafter", steps)) if progress else None
        for _ in range(steps):
            batch = buffer.sample_batch(batch_tokens)
            if batch is None:
                raise RuntimeError("the sampled outputs hold no training pairs (responses too short?)")
            metrics = trainer.step(batch)  # no `stop`: never abandoned, never None
            assert metrics is not None
            losses.append(float(metrics["loss"]))
            if bar is not None:
                bar.advance()
    train_s = time.perf_counter() - t0
    # The training data's token counts travel with the head: a rollout's draft vocabulary starts from them.
    counts = prior + Counter(t for c in completions for t in [*c.prompt_ids, *c.token_ids])
    return _Trained(head, start_version + steps, counts, losses, train_s)


def _accept_lengths(
    target: Transformer,
    head: EagleHead,
    counts: Counter[int],
    eval_prompts: list[list[int]],
    *,
    eos: list[int],
    max_tokens: int,
    temperature: float,
    progress: ProgressFactory | None,
) -> dict[str, float]:
    """Held-out accept lengths of `head` on `eval_prompts`: greedy chains and a tree, sampled, keyed sampled."""
    evals: dict[str, float] = {}
    greedy = [SamplingParams(temperature=0.0, max_tokens=max_tokens) for _ in eval_prompts]
    sampled = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=10_000 + i) for i in range(len(eval_prompts))]  # fmt: skip

    def evaluate(spec: SpecConfig, params: list[SamplingParams], label: str) -> float:
        """Held-out accept length of the exported head (primed with the training counts) under `spec`."""
        drafter = EagleDrafter(head, target)
        drafter.prime_counts(counts)
        gen = Generator(
            target,
            num_slots=min(32, len(eval_prompts)),
            eos_token_ids=eos,
            spec=spec,
            drafters={"eagle": drafter},
        )
        return round(accept_length(_generate(gen, eval_prompts, params, label, progress)), 3)

    for depth, topk, verify in EVAL_STRATEGIES:
        name = f"chain{depth}" if topk == 1 else f"tree{depth}x{topk}v{verify}"
        spec = SpecConfig(method="eagle", depth=depth, topk=topk, verify=verify)
        evals[f"greedy_{name}"] = evaluate(spec, greedy, f"eval {name}")
    evals[f"t{temperature:g}_chain5"] = evaluate(SpecConfig(method="eagle", depth=5), sampled, "eval sampled")
    # Reproducible mode: the same sampled tokens, but the head drafts with the sampler's own noise (keyed).
    for depth in (3, 5, 7):
        spec = SpecConfig(method="eagle", depth=depth, mode="reproducible")
        evals[f"t{temperature:g}_chain{depth}_keyed"] = evaluate(spec, sampled, f"eval sampled keyed {depth}")
    return evals


__all__ = ["EVAL_STRATEGIES", "accept_length", "warmup"]
