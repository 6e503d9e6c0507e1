"""`slipstream drafter warmup` and `slipstream drafter export`: the drafter as a deployment asset.

    slipstream drafter warmup --model smollm2-135m --task basic_arithmetic --steps 300 --out drafters/smol
    slipstream drafter export runs/RUN --model smollm2-135m --out drafters/from-run

warmup trains an EAGLE head offline on the model's own sampled outputs: reasoning-gym prompts (generated
offline) through the chat template, responses sampled by the engine with hidden states kept, then
`steps` optimizer steps on them. Users run it before the first RL step, so speculation pays from step
one. It then measures accept length on held-out prompts of the same task, using the real speculative
generator. Chains k=3/5/7 and one tree are measured greedy; one chain at k=5 is measured at the
sampling temperature. It writes the drafter in the EAGLE draft-model layout (`engine/eagle_export.py`),
which vLLM/SGLang load and `generate --spec eagle --drafter DIR` uses.

export turns a run's newest drafter checkpoint (what the drafter actor trained online) into that layout.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress

from slipstream.engine import eagle_export, hub
from slipstream.engine.buffer import OnlineBuffer
from slipstream.engine.drafter_train import DrafterTrainer
from slipstream.engine.eagle import EagleDrafter, EagleHead
from slipstream.engine.generator import Completion, Generator, Request
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.speculator import SpecConfig
from slipstream.engine.tokenizer import Tokenizer
from slipstream.engine.weights import load_model
from slipstream.runtime.generate import progress, run_requests

EVAL_STRATEGIES = [(3, 1, 0), (5, 1, 0), (7, 1, 0), (4, 4, 16)]  # (depth, topk, verify): chains and one tree


def task_prompts(task: str, n: int, seed: int, tokenizer: Tokenizer) -> list[list[int]]:
    """`n` reasoning-gym questions of `task`, as chat-templated token ids.

    reasoning-gym derives item i of a dataset from seed + i, so the questions of seeds s and s + k overlap
    unless k >= n: keep training and evaluation seeds further apart than their sizes."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise RuntimeError("reasoning-gym is missing: pip install 'slipstream[tasks]'") from e
    try:
        dataset = reasoning_gym.create_dataset(task, size=n, seed=seed)
    except Exception as e:  # reasoning-gym raises several types for an unknown name
        raise ValueError(f"unknown reasoning-gym task {task!r}: {e}") from None
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": entry["question"]}]) for entry in dataset
    ]


def _generate(
    gen: Generator, prompts: list[list[int]], params: list[SamplingParams], label: str
) -> list[Completion]:
    requests = [
        Request(request_id=f"{label}-{i}", prompt_ids=p, params=s)
        for i, (p, s) in enumerate(zip(prompts, params, strict=True))
    ]
    with progress(len(requests), label) as (on_done, on_tokens):
        return run_requests(gen, requests, on_done=on_done, on_tokens=on_tokens)


def accept_length(completions: list[Completion]) -> float:
    """Committed tokens per target pass, over all completions."""
    passes = sum(c.target_passes for c in completions)
    return sum(len(c.token_ids) for c in completions) / max(passes, 1)


def warmup(
    *,
    model: str,
    task: str,
    steps: int,
    out: Path,
    samples: int = 64,
    eval_samples: int = 16,
    max_tokens: int = 128,
    temperature: float = 1.0,
    seed: int = 0,
    batch_tokens: int = 2048,
    lr: float = 1e-3,
    server: str = "vllm",
    init_from: Path | None = None,
    unroll: int = 1,
) -> dict[str, Any]:
    """Sample `samples` prompts of `task` from the model, train an EAGLE head on its own outputs (from
    scratch, or continuing the exported head `init_from`, whose token counts are carried over), export it
    to `out` and measure held-out accept lengths; returns the summary also written to out/warmup.json."""
    started = time.perf_counter()
    model_dir = hub.resolve(model)
    target = load_model(model_dir)
    target.requires_grad_(False)
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = task_prompts(task, samples + eval_samples, seed, tokenizer)
    train_prompts, eval_prompts = prompts[:samples], prompts[samples:]
    eos = sorted(tokenizer.stop_ids)

    t0 = time.perf_counter()
    gen = Generator(target, num_slots=min(32, samples), return_hidden=True, eos_token_ids=eos)
    params = [
        SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i) for i in range(samples)
    ]
    completions = _generate(gen, train_prompts, params, "sampling the model's own outputs")
    gen_s = time.perf_counter() - t0

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
    with Progress(transient=True) as bar:
        task_id = bar.add_task("training the drafter", total=steps)
        for _ in range(steps):
            batch = buffer.sample_batch(batch_tokens)
            if batch is None:
                raise RuntimeError("the sampled outputs hold no training pairs (responses too short?)")
            losses.append(float(trainer.step(batch)["loss"]))
            bar.advance(task_id)
    train_s = time.perf_counter() - t0
    head.eval()
    # The training data's token counts travel with the head: a rollout's draft vocabulary starts from them.
    counts = prior + Counter(t for c in completions for t in [*c.prompt_ids, *c.token_ids])
    version = start_version + steps
    eagle_export.export(head, target.config, out, server=server, version=version, token_counts=counts)

    evals: dict[str, float] = {}
    greedy = [SamplingParams(temperature=0.0, max_tokens=max_tokens) for _ in eval_prompts]
    sampled = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=10_000 + i) for i in range(len(eval_prompts))]  # fmt: skip

    def evaluate(spec: SpecConfig, params: list[SamplingParams], label: str) -> float:
        """Held-out accept length of the exported head (primed with the training counts) under `spec`."""
        drafter = EagleDrafter(head, target)
        drafter.prime_counts(counts)
        gen = Generator(
            target, num_slots=min(32, len(eval_prompts)), eos_token_ids=eos, spec=spec, drafter=drafter
        )
        return round(accept_length(_generate(gen, eval_prompts, params, label)), 3)

    for depth, topk, verify in EVAL_STRATEGIES:
        name = f"chain{depth}" if topk == 1 else f"tree{depth}x{topk}v{verify}"
        spec = SpecConfig(method="eagle", depth=depth, topk=topk, verify=verify)
        evals[f"greedy_{name}"] = evaluate(spec, greedy, f"eval {name}")
    evals[f"t{temperature:g}_chain5"] = evaluate(SpecConfig(method="eagle", depth=5), sampled, "eval sampled")
    # Reproducible mode: the same sampled tokens, but the head drafts with the sampler's own noise (keyed).
    for depth in (5, 7):
        spec = SpecConfig(method="eagle", depth=depth, mode="reproducible")
        evals[f"t{temperature:g}_chain{depth}_keyed"] = evaluate(spec, sampled, f"eval sampled keyed {depth}")
    summary = {
        "model": str(model_dir),
        "task": task,
        "out": str(out),
        "samples": samples,
        "sampled_tokens": sum(len(c.token_ids) for c in completions),
        "sample_s": round(gen_s, 1),
        "steps": steps,
        "init_from": None if init_from is None else str(init_from),
        "version": version,
        "unroll": unroll,
        "train_s": round(train_s, 1),
        "loss_first": round(losses[0], 4),
        "loss_last": round(sum(losses[-10:]) / len(losses[-10:]), 4),
        "accept_length": evals,
        "eval_samples": len(eval_prompts),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    (Path(out) / "warmup.json").write_text(json.dumps(summary, indent=2))
    return summary


def export_run(run_or_ckpt: Path, *, model: str, out: Path, server: str = "vllm") -> dict[str, Any]:
    """Exports the newest drafter checkpoint of a run (or a given checkpoint file) in the EAGLE layout."""
    path = Path(run_or_ckpt)
    if path.is_dir():
        ckpts = sorted(path.glob("drafter/rank-*/ckpt-*.pt"), key=lambda p: p.name)
        if not ckpts:
            raise ValueError(
                f"{path}: no drafter checkpoints (drafter/rank-*/ckpt-*.pt) in this run directory"
            )
        path = ckpts[-1]
    state = torch.load(path, weights_only=True)
    target = load_model(hub.resolve(model))
    head = EagleHead.for_target(target.config)
    head.load_state_dict(state["head"])
    version = int(state.get("version", 0))
    eagle_export.export(head, target.config, out, server=server, version=version)
    return {"checkpoint": str(path), "version": version, "out": str(out)}
