"""Learner benchmark: what a learner rank holds and how long its step takes, at 1 and at N sharded ranks.

    slipstream bench learner --ranks 1,2 --json          # SmolLM2-135M, gloo, 3 steps each

For each rank count, that many processes (spawned, gloo through a TCP store this process hosts) train the
embedded policy on the demo-shaped batch of benchmarks/sync.py (32 samples, on-policy behaviour log-probs),
each rank on its share, for `steps` identical steps. A row: `state_bytes_per_rank` (weights + gradients +
AdamW state resident on rank 0 at the step's peak, summed from the tensors' local shards),
`plan_state_bytes_per_rank` and `plan_activation_bytes_per_rank` (engine/memory_plan.py's prediction),
`peak_rss_mb` (rank 0's), `step_s` (median), and `max_abs_weight_diff` against the 1-rank run's weights
after the same steps. `state_ratio` = state bytes a rank at the largest count / at 1. The rank counts run one
after another, never at once (2 cores).
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slipstream.benchmarks.sync import DEMO_LR, _on_policy
from slipstream.engine import hub
from slipstream.engine.config import ModelConfig
from slipstream.engine.memory_plan import plan_learner
from slipstream.engine.policy_train import OptimConfig, PolicyTrainer
from slipstream.engine.sharding import full_tensors, shard_policy
from slipstream.engine.weights import load_model

__all__ = ["run"]

MICRO_BATCH_TOKENS = 2048  # deploy/configs/demo.yaml's learner.optim.micro_batch_tokens


def _rank(rank: int, world: int, port: int, model: str, steps: int, threads: int, out: str) -> None:
    torch.set_num_threads(threads)
    if world > 1:
        dist.init_process_group(
            "gloo",
            store=dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120)),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=300),
        )
    try:
        path = Path(hub.resolve(model))
        config = ModelConfig.from_pretrained(path)
        optim = OptimConfig(lr=DEMO_LR, micro_batch_tokens=MICRO_BATCH_TOKENS)
        policy = load_model(path, dtype=torch.float32)
        # Behaviour log-probs from the plain model, the same on every rank (then sharded).
        samples = _on_policy(PolicyTrainer(policy, optim=optim), path, config.vocab_size, seed=0)
        if world > 1:
            policy = shard_policy(policy)
        trainer = PolicyTrainer(policy, optim=optim)
        times, state = [], {}
        for _ in range(steps):
            started = time.perf_counter()
            trainer.step(samples[rank::world])
            times.append(time.perf_counter() - started)
            state = trainer.state_bytes()  # at the peak: gradients still held
            trainer.free_gradients()
        weights = {n: t.clone() for n, t in full_tensors(list(policy.named_parameters()))}
        if rank == 0:
            torch.save(
                {
                    "weights": weights,
                    "state": state,
                    "step_s": times,
                    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                },
                os.path.join(out, f"ranks{world}.pt"),
            )
        if world > 1:
            dist.barrier()
    finally:
        if world > 1:
            dist.destroy_process_group()


def _spawn(world: int, model: str, steps: int, threads: int, out: str, timeout_s: float) -> None:
    ctx = multiprocessing.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [
        ctx.Process(target=_rank, args=(r, world, store.port, model, steps, threads, out), daemon=True)
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    codes = [proc.exitcode for proc in procs]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    if codes != [0] * world:
        raise RuntimeError(f"bench learner: {world} rank(s) exited {codes} (or outlived {timeout_s} s)")


def run(
    model: str = "smollm2-135m", ranks: tuple[int, ...] = (1, 2), steps: int = 3, timeout_s: float = 1200.0
) -> dict[str, Any]:
    """Returns {"model", "steps", "rows": [{"ranks", "state_bytes_per_rank", ...}], "state_ratio"}."""
    if 1 not in ranks:
        raise ValueError("--ranks must include 1: every row's weights are compared with the 1-rank run's")
    config = ModelConfig.from_pretrained(hub.resolve(model))
    cores = len(os.sched_getaffinity(0))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-learner-") as out:
        for world in sorted(ranks):
            _spawn(world, model, steps, max(1, cores // world), out, timeout_s)
        results = {w: torch.load(Path(out) / f"ranks{w}.pt", weights_only=True) for w in sorted(ranks)}
    reference = results[1]["weights"]
    for world, result in results.items():
        plan = plan_learner(config, ranks=world, micro_batch_tokens=MICRO_BATCH_TOKENS)
        diff = max(float((result["weights"][n] - t).abs().max()) for n, t in reference.items())
        rows.append(
            {
                "ranks": world,
                "state_bytes_per_rank": sum(result["state"].values()),
                "state_parts": result["state"],
                "plan_state_bytes_per_rank": plan.state,
                "plan_activation_bytes_per_rank": plan.activations,
                "plan_total_bytes_per_rank": plan.total,
                "peak_rss_mb": round(result["peak_rss_mb"], 1),
                "step_s": round(statistics.median(result["step_s"]), 3),
                "max_abs_weight_diff": diff,
            }
        )
    top = rows[-1]["state_bytes_per_rank"] / rows[0]["state_bytes_per_rank"]
    return {"model": model, "steps": steps, "rows": rows, "state_ratio": round(top, 4)}
