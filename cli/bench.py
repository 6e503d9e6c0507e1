"""`slipstream bench …`: the benchmarks' subcommand, its arguments and dispatch (each bench lives in benchmarks/).

    slipstream bench transport --json      # ipc, shared-memory lane, tcp and tcp+CURVE between nodes
    slipstream bench e2e [--config F] [key=value …] --json   # train vs --baseline, each a child process
    slipstream bench sync [--dtype bfloat16] --json          # a cross-host push: full vs XOR delta

Each prints one JSON object with --json (fields: docs/benchmarks.md). `bench gpu` and `bench sync` parse
their own flags; rollout, e2e and soak take a config and key=value overrides.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from slipstream.cli.common import packaged_config, run_training


def _bench_e2e(args: argparse.Namespace) -> int:
    import msgspec
    import yaml

    from slipstream.benchmarks import e2e
    from slipstream.cli import train

    # The demo's config at 4 steps unless the command line says otherwise (a bad key fails here).
    # No HF copy of each run's last checkpoint: four runs a bench, ~0.5 GB each, and nothing reads them.
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
        rounds=args.rounds,
        isolated=True,
        interleave=not args.sequential,
    )
    print(msgspec.json.encode(result).decode() if args.json else e2e.render(result))
    return 0


def _bench_soak(args: argparse.Namespace) -> int:
    import msgspec

    from slipstream.benchmarks import soak
    from slipstream.cli import train

    root = Path(args.run_dir or f"runs/bench-soak-{time.strftime('%Y%m%d-%H%M%S')}")
    model = args.model or str(soak.tiny_model(root / "model"))
    overrides = [*soak.OVERRIDES, f"model={model}", f"steps={args.steps or 30}", *args.overrides]
    cfg = train.load_config(args.config or packaged_config("demo.yaml"), overrides)
    plan = soak.SoakPlan(
        actors=[a for names in train.actor_names(cfg, baseline=False) for a in names],
        steps=cfg.steps,
        prompts_per_step=cfg.prompts_per_step,
        group_size=cfg.group_size,
        max_tokens=cfg.max_tokens,
        max_restarts=cfg.faults.max_restarts,
        kill_every_s=args.kill_every,
        kills=args.kills,
        seed=args.seed or 0,
    )
    result = soak.run(lambda run_dir: run_training(cfg, run_dir, baseline=False), root, plan)
    print(msgspec.json.encode(result).decode() if args.json else soak.render(result))
    return 0 if result.ok else 1


def run(args: argparse.Namespace) -> int:
    """`slipstream bench WHAT`: one benchmark, its JSON on stdout with --json."""
    if args.what not in ("rollout", "e2e", "soak") and (args.config is not None or args.overrides):
        raise ValueError(
            f"--config and key=value overrides are for bench rollout, e2e and soak, not {args.what}"
        )
    import msgspec

    if args.what == "e2e":
        return _bench_e2e(args)
    if args.what == "soak":
        return _bench_soak(args)
    if args.what == "sync":  # its own flags (--lr, --dtype), and bench's --model, --steps, --threads
        from slipstream.benchmarks import sync

        shared = [(flag, value) for flag, value in
                  (("--model", args.model), ("--steps", args.steps), ("--threads", args.threads)) if value is not None]  # fmt: skip
        return sync.main(
            [*(str(x) for pair in shared for x in pair), *args.gpu_args] + (["--json"] if args.json else [])
        )
    if args.what == "gpu":
        from slipstream.benchmarks import gpu

        # Exits 2 at once, naming the missing device, on a host without CUDA. --batches is bench's own
        # flag (decode's), so it is passed on when given.
        given = ["--batches", args.batches] if args.batches is not None else []
        return gpu.main(given + args.gpu_args + (["--json"] if args.json else []))

    if args.what == "rollout":
        from slipstream.benchmarks import rollout

        if args.config is None:
            args.config = packaged_config("bench-rollout.yaml")
        config = rollout.config_from_args(args)  # a bad key or value fails here, before any process starts
        result = rollout.run(config, trace=args.trace)
        print(msgspec.json.encode(result).decode() if args.json else rollout.render(result))
        return 0
    if args.what == "decode":
        from slipstream.benchmarks import decode

        result = decode.run(
            args.model,
            batches=decode.parse_batches(args.batches or "1,4,16,32"),
            max_tokens=args.max_tokens if args.max_tokens is not None else 256,
            repeats=args.repeats,
            threads=args.threads,
            drafter=args.drafter,
            temperature=args.temperature if args.temperature is not None else 1.0,
            device=args.device,
        )
        print(msgspec.json.encode(result).decode() if args.json else decode.render(result))
        return 0
    from slipstream.benchmarks import transport

    figures = transport.run()
    if args.json:
        print(msgspec.json.encode(figures).decode())
    else:
        for key, value in msgspec.structs.asdict(figures).items():
            print(f"{key:>16}  {value}")
    return 0


def add_parser(sub: Any) -> None:
    """The `bench` subcommand on `sub` (the `slipstream` command's subparsers)."""
    s = sub.add_parser(
        "bench",
        help="benchmarks printing JSON: transport, decode, rollout, e2e, soak, gpu",
        description="Benchmarks; each prints one JSON object with --json (fields: docs/benchmarks.md). "
        "bench rollout reads deploy/configs/bench-rollout.yaml (or --config F), then its flags, then "
        "KEY=VALUE overrides such as prompts=4 or tuner.buckets=[1,4]. bench e2e runs `slipstream train` "
        "and its --baseline on the same config (default: deploy/configs/demo.yaml with steps=4, then "
        "KEY=VALUE overrides), then times the learner against a forward pass on the run's samples. bench soak "
        "trains a tiny random model (or --model) under random SIGKILLs of rollout, verifier and drafter actors, "
        "then without, and compares the samples (exit 1 if any was lost or differs). bench gpu "
        "is the GPU runbook (docs/gpu.md); it exits at once where there is no CUDA device. bench sync measures "
        "a cross-host weight push, full vs XOR delta, after real optimizer steps (--dtype, --lr, --steps).",
    )
    s.add_argument("what", choices=["transport", "decode", "rollout", "e2e", "soak", "gpu", "sync"])
    s.add_argument("--device", default="cpu", help="decode: cpu, cuda or cuda:N")
    s.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="rollout, e2e, soak: config overrides (key.sub=value)",
    )
    s.add_argument("--json", action="store_true", help="one JSON object on stdout")
    s.add_argument(
        "--config",
        type=Path,
        default=None,
        help="rollout, e2e, soak: a YAML config (default: the packaged one)",
    )
    s.add_argument(
        "--model",
        default=None,
        help="decode, rollout, soak: model directory or name (default smollm2-135m; soak: a tiny random one)",
    )
    s.add_argument(
        "--batches", default=None, help="decode (default 1,4,16,32), gpu: comma-separated batch sizes"
    )
    s.add_argument(
        "--max-tokens", type=int, default=None, help="decode, rollout: new tokens per request (256, 512)"
    )
    s.add_argument("--repeats", type=int, default=1, help="decode: interleaved rounds (median per config)")
    s.add_argument(
        "--threads",
        type=int,
        default=None,
        help="decode: torch threads (default OMP_NUM_THREADS); e2e: learner-cost threads (learner.threads)",
    )
    s.add_argument("--task", default=None, help="rollout: reasoning-gym task (task=)")
    s.add_argument(
        "--prompts", type=int, default=None, help="rollout: prompts (GRPO groups) per step (prompts=)"
    )
    s.add_argument("--samples", type=int, default=None, help="rollout: responses per prompt, G (samples=)")
    s.add_argument(
        "--temperature", type=float, default=None, help="decode, rollout: sampling temperature (1.0, 0.7)"
    )
    s.add_argument(
        "--seed",
        type=int,
        default=None,
        help="rollout: prompt and sampling seed (seed=); soak: the kills' RNG",
    )
    s.add_argument(
        "--steps",
        type=int,
        default=None,
        help="rollout: RL steps per mode; all but the first are measured (steps=); soak: steps per run (30)",
    )
    s.add_argument(
        "--modes", default=None, help="rollout: comma-separated subset of plain,ngram,adaptive (modes=)"
    )
    s.add_argument(
        "--trace", type=Path, default=None, help="rollout: write every decode iteration's stats here (JSONL)"
    )
    s.add_argument(
        "--drafter",
        type=Path,
        default=None,
        help="decode, rollout: an exported EAGLE drafter (decode: adds eagle rows)",
    )
    s.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="e2e, soak: where both runs go (runs/bench-e2e-…, bench-soak-…)",
    )
    s.add_argument("--kill-every", type=float, default=3.0, help="soak: mean seconds between kills")
    s.add_argument("--kills", type=int, default=0, help="soak: the most kills (0 = no cap)")
    s.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="e2e: 2 (default) runs Slipstream, baseline, baseline, Slipstream and pools them; 1: S, B only",
    )
    s.add_argument(
        "--sequential",
        action="store_true",
        help="e2e: a round's two runs one after the other, each alone on the host (default: both at once, "
        "taking turns step by step, so a drifting host slows both alike; two resident runs must fit)",
    )
