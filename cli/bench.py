"""`slipstream bench NAME`: every benchmark's flags, one subcommand each, and the calls into benchmarks/.

    slipstream bench transport --json                           # ipc, shared-memory lane, tcp, tcp+CURVE
    slipstream bench decode [--drafter DIR] --json              # plain vs speculative tokens/s per batch
    slipstream bench rollout [--config F] [key=value …] --json  # deploy/configs/bench-rollout.yaml
    slipstream bench e2e [--config F] [key=value …] --json      # train vs --baseline, each a child process
    slipstream bench soak [--steps N] --json                    # a run under random SIGKILLs vs without
    slipstream bench sync [--dtype bfloat16] --json             # a cross-host push: full vs XOR delta
    slipstream bench learner [--ranks 1,2] --json               # per-rank memory and step, sharded vs not
    slipstream bench gpu --json [--quick] [--shapes S]          # the GPU runbook (docs/gpu.md)
    slipstream bench reward --json                              # rewards/s: per completion vs batched; judge
    slipstream bench scale [--fractions 1/8,1] --json           # a users'-size step through the head's paths

Only this module parses a bench's command line (`slipstream bench NAME --help` lists NAME's flags); it
calls the typed `run` of benchmarks/NAME.py. Each bench's flags are declared once, in the function beside
the one that reads them (here, not in benchmarks/: those import torch, and the parser is built on every
`slipstream` command). Each bench prints one JSON object with --json (fields: docs/benchmarks.md);
rollout, e2e and soak also take a config and key=value overrides.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.cli.common import packaged_config, run_training

if TYPE_CHECKING:  # the benchmarks import torch; the command line imports them only to run one
    from slipstream.benchmarks.rollout_config import RolloutBenchConfig

CONFIGURED = ("rollout", "e2e", "soak")
"""The benches that read a config: --config F and key=value overrides."""


def _print(result: Any, as_json: bool, render: Any) -> None:
    """One JSON object with --json, else `render(result)`."""
    import msgspec

    print(msgspec.json.encode(result).decode() if as_json else render(result))


def _ints(text: str, flag: str) -> list[int]:
    """ "1,4,16" → [1, 4, 16] ("" → []); a clear error naming `flag` otherwise."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if values and min(values) < 1:
        raise ValueError(f"{flag} must list positive integers, got {text!r}")
    return values


def _json(p: argparse.ArgumentParser, result: str) -> None:
    p.add_argument("--json", action="store_true", help=f"one JSON object ({result}) on stdout")


def _configured(p: argparse.ArgumentParser, default: str) -> None:
    """--config and KEY=VALUE overrides (rollout, e2e, soak)."""
    p.add_argument("--config", type=Path, default=None, help=f"a YAML config (default: {default})")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. key.sub=value")


# -- the benches: each one's flags, then the call that reads them ----------------------------------------


def _transport_arguments(p: argparse.ArgumentParser) -> None:
    _json(p, "TransportResult")


def _transport(args: argparse.Namespace) -> int:
    import msgspec

    from slipstream.benchmarks import transport

    figures = transport.run()
    table = lambda f: "\n".join(f"{k:>16}  {v}" for k, v in msgspec.structs.asdict(f).items())  # noqa: E731
    _print(figures, args.json, table)
    return 0


def _decode_arguments(p: argparse.ArgumentParser) -> None:
    _json(p, "DecodeResult")
    p.add_argument("--model", default=None, help="model directory or name (default smollm2-135m)")
    p.add_argument("--batches", default="", help="comma-separated batch sizes (default 1,4,16,32)")
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens per request")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--repeats", type=int, default=1, help="interleaved rounds (median per config)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default OMP_NUM_THREADS)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--drafter", type=Path, default=None,
                   help="an exported EAGLE head (a directory or a shipped name): adds eagle rows")  # fmt: skip
    p.add_argument("--history", type=Path, default=None,
                   help="a run directory: replay its last step with the history arms (HistoryResult)")  # fmt: skip
    p.add_argument(
        "--step", type=int, default=None, help="with --history: the step replayed (default: the last)"
    )


def _decode(args: argparse.Namespace) -> int:
    from slipstream.benchmarks import decode

    if args.history is not None:
        from slipstream.benchmarks import decode_history

        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        replayed = decode_history.run(args.history, step=args.step, batches=_ints(args.batches, "--batches")
                                      or (1, 4), repeats=args.repeats, drafter=args.drafter, log=not args.json)  # fmt: skip
        _print(replayed, args.json, decode_history.render)
        return 0
    result = decode.run(
        args.model,
        batches=_ints(args.batches, "--batches") or decode.DEFAULT_BATCHES,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        threads=args.threads,
        drafter=args.drafter,
        temperature=args.temperature,
        device=args.device,
    )
    _print(result, args.json, decode.render)
    return 0


def rollout_arguments(p: argparse.ArgumentParser) -> None:
    """`bench rollout`'s flags; each but --trace is a shorthand for a field of RolloutBenchConfig."""
    _configured(p, "deploy/configs/bench-rollout.yaml")
    _json(p, "RolloutBenchResult")
    p.add_argument(
        "--trace", type=Path, default=None, help="write every decode iteration's stats here (JSONL)"
    )
    p.add_argument("--model", default=None, help="model directory or name (model=)")
    p.add_argument("--task", default=None, help="reasoning-gym task (task=)")
    p.add_argument("--prompts", type=int, default=None, help="prompts (GRPO groups) per step (prompts=)")
    p.add_argument("--samples", type=int, default=None, help="responses per prompt, G (samples=)")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (max_tokens=)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (temperature=)")
    p.add_argument("--seed", type=int, default=None, help="prompt and sampling seed (seed=)")
    p.add_argument("--steps", type=int, default=None,
                   help="RL steps per mode; all but the first are measured (steps=)")  # fmt: skip
    p.add_argument("--modes", default=None, help="comma-separated subset of plain,ngram,adaptive (modes=)")
    p.add_argument("--drafter", type=Path, default=None, help="an exported EAGLE drafter (drafter=)")


def rollout_config(args: argparse.Namespace) -> RolloutBenchConfig:
    """The config a parsed `bench rollout` line describes: --config (default: the packaged
    bench-rollout.yaml), then the shorthand flags, then KEY=VALUE; a bad key or value raises here."""
    from slipstream.benchmarks.rollout_config import SHORTHANDS, load_config

    flags = {key: getattr(args, key) for key in SHORTHANDS}
    if flags["drafter"] is not None:
        flags["drafter"] = str(flags["drafter"])
    modes = None if args.modes is None else [m.strip() for m in args.modes.split(",") if m.strip()]
    path = args.config or packaged_config("bench-rollout.yaml")
    return load_config(path, args.overrides, **flags, modes=modes)


def _rollout(args: argparse.Namespace) -> int:
    from slipstream.benchmarks import rollout

    config = rollout_config(args)  # before any process starts
    _print(rollout.run(config, trace=args.trace), args.json, rollout.render)
    return 0


def _e2e_arguments(p: argparse.ArgumentParser) -> None:
    _configured(p, "deploy/configs/demo.yaml")
    _json(p, "E2EResult")
    p.add_argument("--run-dir", type=Path, default=None, help="where both runs go (runs/bench-e2e-…)")
    p.add_argument("--threads", type=int, default=None, help="learner-cost threads (learner.threads)")
    p.add_argument("--cost-steps", type=int, default=3,
                   help="batches the learner's cost is measured on, on the CPU (0: not measured)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=2,
                   help="2: runs Slipstream, baseline, baseline, Slipstream and pools them; 1: S, B only")  # fmt: skip
    p.add_argument(
        "--sequential",
        action="store_true",
        help="a round's two runs one after the other, each alone on the host (default: both at once, "
        "taking turns step by step, so a drifting host slows both alike; two resident runs must fit)",
    )


def _e2e(args: argparse.Namespace) -> int:
    import msgspec
    import yaml

    from slipstream.benchmarks import e2e
    from slipstream.cli import train

    # The demo's config at 4 steps unless the command line says otherwise (a bad key fails here).
    # No HF copy of each run's last checkpoint: four runs a bench, each a model's size, nothing reads them.
    cfg = train.load_config(
        args.config or packaged_config("demo.yaml"), ["steps=4", "checkpoint_hf=false", *args.overrides]
    )
    root = Path(args.run_dir or f"runs/bench-e2e-{time.strftime('%Y%m%d-%H%M%S')}")
    root.mkdir(parents=True, exist_ok=True)
    resolved = root / "config.yaml"  # the resolved config both runs start from
    resolved.write_text(yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False))

    def run_train(run_dir: Path, baseline: bool, turns: str | None) -> dict[str, Any]:
        # A child process, as a user runs it: what this process holds is not the run's memory.
        cmd = [sys.executable, "-m", "slipstream.cli.main", "train", str(resolved), "--run-dir", str(run_dir)]
        cmd += ["--baseline"] if baseline else []
        cmd += ["--turns", turns] if turns else []
        with (root / f"{run_dir.name}.out").open("w") as out:
            done = subprocess.run(cmd, stdout=out, stderr=out)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}: see {out.name}")
        return json.loads((run_dir / "summary.json").read_text())

    result = e2e.run(
        run_train,
        root,
        threads=args.threads or cfg.learner.threads,
        cost_steps=args.cost_steps,
        rounds=args.rounds,
        isolated=True,
        interleave=not args.sequential,
    )
    _print(result, args.json, e2e.render)
    return 0


def _soak_arguments(p: argparse.ArgumentParser) -> None:
    _configured(p, "deploy/configs/demo.yaml")
    _json(p, "SoakResult")
    p.add_argument("--run-dir", type=Path, default=None, help="where both runs go (runs/bench-soak-…)")
    p.add_argument("--model", default=None, help="model directory or name (default: a tiny random one)")
    p.add_argument("--steps", type=int, default=30, help="steps per run")
    p.add_argument("--kill-every", type=float, default=3.0, help="mean seconds between kills")
    p.add_argument("--kills", type=int, default=0, help="the most random actor kills (0 = no cap)")
    p.add_argument("--seed", type=int, default=0, help="the kills' RNG")
    p.add_argument("--nodes", type=int, default=1,
                   help="1: the loop in this process; 2: `slipstream train` per node, two network namespaces "
                   "(root), node 1's agent and the coordinator killed once each too")  # fmt: skip
    p.add_argument("--agent-kill-step", type=int, default=None,
                   help="--nodes 2: kill node 1's agent once this many steps are recorded (-1: never; "
                   "default steps/3)")  # fmt: skip
    p.add_argument("--coordinator-kill-step", type=int, default=None,
                   help="--nodes 2: kill the head once this many steps are recorded and a checkpoint exists, "
                   "then --resume both nodes (-1: never; default 2*steps/3)")  # fmt: skip
    p.add_argument("--port", type=int, default=29500, help="--nodes 2: the head's port (in its namespace)")
    p.add_argument("--timeout", type=float, default=3600.0, help="--nodes 2: seconds each run may take")


def _soak(args: argparse.Namespace) -> int:
    from slipstream.benchmarks import soak, soak_nodes
    from slipstream.cli import train

    if args.nodes not in (1, 2):
        raise ValueError(f"--nodes must be 1 (in-process) or 2 (two namespaced nodes), got {args.nodes}")
    root = Path(args.run_dir or f"runs/bench-soak-{time.strftime('%Y%m%d-%H%M%S')}")
    model = args.model or str(soak.tiny_model(root / "model"))
    layout = soak_nodes.OVERRIDES if args.nodes == 2 else ()
    overrides = [*soak.OVERRIDES, *layout, f"model={model}", f"steps={args.steps}", *args.overrides]
    cfg = train.load_config(args.config or packaged_config("demo.yaml"), overrides)
    if args.nodes == 2:
        return _soak_nodes(args, cfg, root)
    plan = soak.SoakPlan(
        actors=[a for names in train.actor_names(cfg, baseline=False) for a in names],
        steps=cfg.steps,
        prompts_per_step=cfg.prompts_per_step,
        group_size=cfg.group_size,
        max_tokens=cfg.max_tokens,
        max_restarts=cfg.faults.max_restarts,
        kill_every_s=args.kill_every,
        kills=args.kills,
        seed=args.seed,
    )
    result = soak.run(lambda run_dir: run_training(cfg, run_dir, baseline=False), root, plan)
    _print(result, args.json, soak.render)
    return 0 if result.ok else 1


def _soak_nodes(args: argparse.Namespace, cfg: Any, root: Path) -> int:
    """`bench soak --nodes 2`: each node's `slipstream train` in a namespace of its own, reading the
    resolved config from root/config.json; the run without kills on one node from root/reference.json."""
    import msgspec

    from slipstream.benchmarks import soak_nodes

    root.mkdir(parents=True, exist_ok=True)
    config, reference = root / "config.json", root / "reference.json"
    config.write_text(json.dumps(msgspec.to_builtins(cfg)))
    reference.write_text(json.dumps(msgspec.to_builtins(msgspec.structs.replace(cfg, nodes=[]))))
    agent = max(1, cfg.steps // 3) if args.agent_kill_step is None else args.agent_kill_step
    coordinator = (
        max(agent + 1, 2 * cfg.steps // 3)
        if args.coordinator_kill_step is None
        else args.coordinator_kill_step
    )
    plan = soak_nodes.NodesPlan(
        config=str(config),
        reference=str(reference),
        steps=cfg.steps,
        prompts_per_step=cfg.prompts_per_step,
        group_size=cfg.group_size,
        max_restarts=cfg.faults.max_restarts,
        kill_every_s=args.kill_every,
        kills=args.kills,
        seed=args.seed,
        agent_kill_step=agent,
        coordinator_kill_step=coordinator,
        port=args.port,
        timeout_s=args.timeout,
    )  # fmt: skip
    result = soak_nodes.run(plan, root)
    _print(result, args.json, soak_nodes.render)
    return 0 if result.ok else 1


def _sync_arguments(p: argparse.ArgumentParser) -> None:
    _json(p, "SyncResult")
    p.add_argument("--model", default="smollm2-135m", help="model directory or name")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps, each one push")
    p.add_argument(
        "--lr", type=float, default=None, help="learning rate (default: the demo's learner.optim.lr)"
    )
    p.add_argument(
        "--dtype", default="", help="push dtype (float32, bfloat16, float16); '': the checkpoint's"
    )
    p.add_argument("--threads", type=int, default=0, help="zstd threads (0: one)")


def _sync(args: argparse.Namespace) -> int:
    from slipstream.benchmarks import sync

    lr = sync.DEMO_LR if args.lr is None else args.lr
    result = sync.run(args.model, args.steps, lr, args.dtype, threads=args.threads)
    _print(result, args.json, str)  # without --json: the dict as Python prints it
    return 0


def _learner_arguments(p: argparse.ArgumentParser) -> None:
    _json(p, "the learner bench's dict")
    p.add_argument("--model", default="smollm2-135m", help="model directory or name")
    p.add_argument("--ranks", default="1,2", help="comma-separated rank counts (must include 1)")
    p.add_argument("--steps", type=int, default=3, help="identical optimizer steps per rank count")


def _learner(args: argparse.Namespace) -> int:
    from slipstream.benchmarks import learner

    ranks = tuple(int(r) for r in args.ranks.split(",") if r.strip())
    _print(learner.run(args.model, ranks, args.steps), args.json, str)
    return 0


def _gpu_arguments(p: argparse.ArgumentParser) -> None:
    _json(p, "GpuResult")
    p.add_argument("--quick", action="store_true", help="one shape, batches 1/16/128")
    p.add_argument("--shapes", default="", help="comma-separated subset of qwen2.5-1.5b,qwen2.5-7b")
    p.add_argument("--no-tests", action="store_true", help="skip the gpu-marked tests")
    p.add_argument("--no-peer", action="store_true", help="skip transformers' generate")
    p.add_argument("--batches", default="", help="comma-separated batch sizes (default 1,4,16,64,128,256)")
    p.add_argument("--peer-batches", default=None,
                   help="batch sizes where HF generate runs ('all': every one; default 1,64)")  # fmt: skip
    p.add_argument("--eager-batches", default=None,
                   help="batch sizes where the dynamic eager path runs too (default 1,16)")  # fmt: skip
    p.add_argument("--tests-log", type=Path, default=None, help="write the gpu tests' whole output here")
    p.add_argument("--tests-timeout", type=int, default=600, help="seconds the gpu tests may take")


def _gpu(args: argparse.Namespace) -> int:
    import msgspec

    from slipstream.benchmarks import gpu
    from slipstream.engine.device import require_device

    try:  # exit 2 at once, naming the missing device, on a host without CUDA
        require_device("cuda", field="device")
    except ValueError as exc:
        print(f"slipstream bench gpu: {exc}", file=sys.stderr)
        return 2
    peers = args.peer_batches
    result = gpu.run(
        quick=args.quick,
        shapes=[n for n in args.shapes.split(",") if n],
        tests=not args.no_tests,
        peer=not args.no_peer,
        peer_batches=gpu.PEER_BATCHES if peers is None else None if peers == "all" else _ints(peers, "--peer-batches"),
        eager_batches=gpu.EAGER_BATCHES if args.eager_batches is None else _ints(args.eager_batches, "--eager-batches"),
        batches=_ints(args.batches, "--batches") or None,
        tests_log=args.tests_log,
        tests_timeout_s=args.tests_timeout,
        say=lambda message: print(message, file=sys.stderr, flush=True),
    )  # fmt: skip
    _print(result, args.json, lambda r: msgspec.json.format(msgspec.json.encode(r)).decode())
    return 0


def _reward_arguments(p: argparse.ArgumentParser) -> None:
    _json(p, "RewardBenchResult")
    p.add_argument("--completions", type=int, default=2048, help="completions per pool round")
    p.add_argument("--rounds", type=int, default=2, help="rounds per arm (A B B A …)")
    p.add_argument("--workers", type=int, default=2, help="verifier worker processes")
    p.add_argument("--batch-size", type=int, default=32, help="most completions in a batched call")
    p.add_argument("--judge-model", default="smollm2-135m", help="the judge's model directory or name")
    p.add_argument("--judge-completions", type=int, default=32, help="completions the judge scores a round")
    p.add_argument("--judge-batch", type=int, default=16, help="completions per judge call (vs 1)")
    p.add_argument("--judge-threads", type=int, default=0, help="judge torch threads (0: its default)")


def _reward(args: argparse.Namespace) -> int:
    from slipstream.benchmarks import reward

    result = reward.run(
        completions=args.completions,
        rounds=args.rounds,
        workers=args.workers,
        batch_size=args.batch_size,
        judge_model=args.judge_model,
        judge_completions=args.judge_completions,
        judge_batch=args.judge_batch,
        judge_threads=args.judge_threads,
    )
    _print(result, args.json, reward.render)
    return 0


def _scale_arguments(p: argparse.ArgumentParser) -> None:
    _json(p, "ScaleResult")
    p.add_argument("--prompts", type=int, default=512, help="prompts (GRPO groups) per step at fraction 1")
    p.add_argument("--samples", type=int, default=16, help="responses per prompt (G)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of every response")
    p.add_argument("--fractions", default="1/8,1/4,1/2,1", help="fractions of --prompts, one run each")
    p.add_argument("--steps", type=int, default=2, help="steps per size; the row holds the last")
    p.add_argument("--rollouts", type=int, default=2, help="stand-in rollout processes")
    p.add_argument("--verifier-workers", type=int, default=1, help="reward worker processes")
    p.add_argument("--step-timeout", type=float, default=600.0,
                   help="seconds a step may take before its size is reported failed")  # fmt: skip
    p.add_argument("--run-dir", type=Path, default=None, help="keep the runs here (default: a temp dir)")


def _scale(args: argparse.Namespace) -> int:
    from slipstream.benchmarks import scale

    result = scale.run(
        prompts=args.prompts,
        samples=args.samples,
        tokens=args.tokens,
        fractions=scale.parse_fractions(args.fractions),
        steps=args.steps,
        rollouts=args.rollouts,
        verifier_workers=args.verifier_workers,
        step_timeout_s=args.step_timeout,
        run_dir=args.run_dir,
    )
    _print(result, args.json, scale.render)
    return 0 if all(r.complete or r.skipped for r in result.rows) else 1


def _startup_arguments(p: argparse.ArgumentParser) -> None:
    _json(p, "StartupResult")
    p.add_argument("--actors", type=int, default=4, help="actors started per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds per mode, exec'd and forked, A B B A")


def _startup(args: argparse.Namespace) -> int:
    from slipstream.benchmarks import startup

    _print(startup.run(actors=args.actors, rounds=args.rounds), args.json, startup.render)
    return 0


# -- the command line ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bench:
    """One `slipstream bench NAME`: its line in `bench --help`, its own --help paragraph, the function
    declaring its flags and the one running it."""

    help: str
    description: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


BENCHES = {
    "transport": Bench(
        "tensor-message GB/s vs memcpy, RTT p50/p99, msgs/s; tcp and tcp+CURVE",
        "Two processes over ipc:// (the shared-memory lane, then plain frames), then tcp:// and "
        "tcp+CURVE on loopback: tensor-message GB/s against memcpy, small-message round trip and rate.",
        _transport_arguments,
        _transport,
    ),
    "decode": Bench(
        "plain vs speculative decode tokens/s at batch 1/4/16/32",
        "Plain vs n-gram vs self-draft (and, with --drafter, EAGLE) tokens/s per batch size, "
        "the configs of a batch size interleaved iteration by iteration.",
        _decode_arguments,
        _decode,
    ),
    "rollout": Bench(
        "long-tail GRPO rollout: plain vs n-gram vs adaptive",
        "A long-tail GRPO rollout on real actor processes, plain vs n-gram vs adaptive. Reads "
        "deploy/configs/bench-rollout.yaml (or --config F), then its flags, then KEY=VALUE overrides such as "
        "prompts=4 or tuner.buckets=[1,4].",
        rollout_arguments,
        _rollout,
    ),
    "e2e": Bench(
        "RL steps, Slipstream vs --baseline, and the learner's cost",
        "Runs `slipstream train` and its --baseline on the same config (default: "
        "deploy/configs/demo.yaml with steps=4, then KEY=VALUE overrides), each a child process, then times "
        "the learner against a forward pass on the run's samples.",
        _e2e_arguments,
        _e2e,
    ),
    "soak": Bench(
        "a training run under random SIGKILLs vs one without",
        "Trains a tiny random model (or --model) under random SIGKILLs of rollout, verifier, "
        "drafter and learner actors, then without, and compares the samples (exit 1 if any was lost or "
        "differs). With --nodes 2, on two nodes in network namespaces, node 1's agent and the coordinator "
        "killed once each (the coordinator then resumed).",
        _soak_arguments,
        _soak,
    ),
    "sync": Bench(
        "a cross-host weight push: full vs XOR delta bytes",
        "Bytes per cross-host weight push, full vs XOR delta, after real optimizer steps.",
        _sync_arguments,
        _sync,
    ),
    "learner": Bench(
        "learner memory per rank and step seconds, at 1 and N sharded ranks",
        "Trains the policy for --steps identical steps at each of --ranks (FSDP2 over gloo, real "
        "processes, one count at a time): per rank count, the weights, gradients and optimizer state a rank "
        "holds (from its tensors) beside the memory plan's prediction, peak RSS, step seconds, and the "
        "weights' largest difference from the 1-rank run's (benchmarks/learner.py).",
        _learner_arguments,
        _learner,
    ),
    "gpu": Bench(
        "the GPU runbook (docs/gpu.md)",
        "The GPU runbook (docs/gpu.md): the gpu-marked tests, then per model shape and batch "
        "size plain decode vs HF generate, verify costs and the self-draft ceiling. Exits 2 at once where "
        "there is no CUDA device.",
        _gpu_arguments,
        _gpu,
    ),
    "reward": Bench(
        "completions scored/s: a per-completion reward vs batched, the LLM judge at batch 1 vs 16",
        "Completions scored per second through the verifier's worker pool, a per-completion "
        "reward vs the same scoring batched (TRL's convention), then the LLM judge (tasks/judge.py) in this "
        "process at batch 1 vs --judge-batch; each pair interleaved A B B A.",
        _reward_arguments,
        _reward,
    ),
    "scale": Bench(
        "a step of the size users run through the real coordinator, verifier and learner paths",
        "Streams steps of --prompts x --samples x --tokens (at each of --fractions of the prompts) "
        "from stand-in rollout processes replaying recorded text through the real coordinator, verifier "
        "and a learner that holds its groups without training: the coordinator's CPU seconds, bytes and "
        "messages in and out per step, and the seconds from the last completion to the learner holding "
        "every group (benchmarks/scale.py). Exit 1 if a group did not reach the learner or a step failed.",
        _scale_arguments,
        _scale,
    ),
    "startup": Bench(
        "actor start-up and restart: exec'd vs forked from a fork server",
        "Starts --actors actors through a real supervisor, exec'd (SLIPSTREAM_FORK_SERVER=0) and "
        "forked from a fork server (runtime/fork_server.py), alternating A B B A: seconds to every actor "
        "Ready, seconds for one restart, CPU seconds of the processes started; medians and ratios.",
        _startup_arguments,
        _startup,
    ),
}
"""Every bench, in the order `slipstream bench --help` lists them."""


def run(args: argparse.Namespace) -> int:
    """`slipstream bench NAME`: one benchmark, its JSON on stdout with --json."""
    if args.what not in CONFIGURED and args.overrides:
        raise ValueError(f"key=value overrides are for bench rollout, e2e and soak, not {args.what}")
    return BENCHES[args.what].run(args)


def add_parser(sub: Any) -> None:
    """The `bench` subcommand on `sub` (the `slipstream` command's subparsers), a subcommand per bench."""
    bench = sub.add_parser(
        "bench",
        help="benchmarks printing JSON: transport, decode, rollout, e2e, soak, sync, learner, gpu, reward, scale, "
        "startup",
        description="Benchmarks; each prints one JSON object with --json (fields: docs/benchmarks.md). "
        "`slipstream bench NAME --help` lists a bench's flags.",
    )
    names = bench.add_subparsers(dest="what", required=True, metavar="NAME")
    for name, spec in BENCHES.items():
        p = names.add_parser(name, help=spec.help, description=spec.description)
        spec.arguments(p)
        if name not in CONFIGURED:  # KEY=VALUE left over by the parser lands here, and is refused
            p.set_defaults(overrides=[])
