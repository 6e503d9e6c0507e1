"""`slipstream train`: the command line onto the GRPO loop (rl/loop.py), a node agent, and the run's `hf/`.

    slipstream train                                  # the demo: deploy/configs/demo.yaml (SmolLM2, this CPU)
    slipstream train my.yaml learner.optim.lr=2e-6    # a config file, then key.sub=value overrides
    slipstream train --baseline                       # the same run with no speculation, no drafter training
    slipstream train --resume runs/train-…            # continue from the run's newest checkpoint
    slipstream train CONFIG --nnodes 2 --node-rank R --head HOST:PORT --run-dir SHARED   # on each node

The loop itself, its config and its run directory live in rl/; this module only turns arguments into a
config and a run directory, runs the loop (node 0) or the node's agent (every other node), and copies the
last checkpoint's policy into the run's `hf/` (cli/export.py) once the loop is done.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from slipstream.cli.common import packaged_config, run_training, until_sigterm
from slipstream.rl import loop
from slipstream.rl import run_dir as run_dir_files
from slipstream.rl.run_config import TrainConfig, load_config, require_transport
from slipstream.rl.run_plan import actor_names
from slipstream.runtime.cluster import KEY_DIR, Cluster

__all__ = ["TrainConfig", "actor_names", "load_config", "run", "serve_node", "train"]


def run(args: argparse.Namespace) -> int:
    """`slipstream train ARGS` (cli/main.py parses them)."""
    import msgspec

    from slipstream.runtime.cluster import resolve_cluster
    from slipstream.runtime.turns import Turns

    cluster = resolve_cluster(nnodes=args.nnodes, node_rank=args.node_rank, head=args.head)
    if cluster.multi and args.run_dir is None and args.resume is None:
        raise ValueError(
            f"--run-dir: a run on {cluster.nnodes} nodes needs one run directory that every node sees "
            "(a shared filesystem), the same on each node's command line"
        )
    overrides = list(args.overrides)
    config_path = args.config
    if config_path is not None and "=" in config_path and not Path(config_path).exists():
        overrides.insert(0, config_path)  # `slipstream train steps=3`: no file, an override
        config_path = None
    if args.resume is not None:
        run_dir = args.resume
        resolved = run_dir / "config.json"
        if not resolved.is_file():
            raise ValueError(f"--resume {run_dir}: not a training run directory (no config.json)")
        # The run's own config, then this command line's overrides (`--resume RUN steps=20`), recorded in it.
        cfg = load_config(resolved, overrides)
        if overrides:
            resolved.write_text(json.dumps(msgspec.to_builtins(cfg)))
            with (run_dir / "overrides.log").open("a") as log_file:
                log_file.write(json.dumps({"resumed_at": time.time(), "overrides": overrides}) + "\n")
    else:
        cfg = load_config(config_path or packaged_config("demo.yaml"), overrides)
        run_dir = args.run_dir or Path(f"runs/train-{time.strftime('%Y%m%d-%H%M%S')}")
    if cluster.node_rank > 0:  # a node agent: starts what the head places here, until the run ends
        import uvloop

        from slipstream.runtime import logs

        log = logs.configure(role="agent", rank=cluster.node_rank, run_dir=run_dir, echo=args.verbose)
        return uvloop.run(
            until_sigterm(
                serve_node(
                    cfg, run_dir, cluster, keys_dir=args.keys, log=log, join_timeout_s=args.join_timeout
                )
            )
        )
    summary = run_training(
        cfg,
        run_dir,
        baseline=args.baseline,
        resume=args.resume is not None,
        echo=args.verbose,
        step_lines=sys.stdout,  # a line per step as it finishes, on a terminal or not
        cluster=cluster,
        keys_dir=args.keys,
        join_timeout_s=args.join_timeout,
        turns=Turns.parse(args.turns) if args.turns else None,
    )
    print(run_dir_files.render(summary))
    return 0


async def train(cfg: TrainConfig, run_dir: Path, **options: Any) -> dict[str, Any]:
    """The loop (`rl.loop.train`, `options` its keywords), then, with `checkpoint_hf`, the last checkpoint's
    policy as an HF model directory in run_dir/hf (named in the summary as "hf")."""
    from slipstream.cli.export import export_checkpoint

    summary = await loop.train(cfg, run_dir, **options)
    if cfg.checkpoint_hf and summary["steps"]:
        last = run_dir_files.read_state(run_dir)  # the last step always checkpoints
        summary["hf"] = str(
            export_checkpoint(
                run_dir / last["checkpoint"], model=cfg.model, out=run_dir / "hf", step=int(last["step"]),
                overwrite=True,
            )
        )  # fmt: skip
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


async def serve_node(
    cfg: TrainConfig, run_dir: Path, cluster: Cluster, *, keys_dir: Path | None, log: Any,
    join_timeout_s: float = 300.0,
) -> int:  # fmt: skip
    """Node `cluster.node_rank` > 0 of a multi-node run: its agent starts the actors the head places here.
    Returns 0 when the head ends the run, 1 when the head is lost or never answers."""
    from slipstream.runtime.agent import run_agent

    require_transport(cfg, cluster)
    key_file = None
    if cfg.transport.security == "curve":
        # Node 0 writes the run's key when it starts (a shared filesystem), unless every node has --keys.
        key_file = (keys_dir or run_dir / KEY_DIR) / "run.key"
        deadline = time.monotonic() + join_timeout_s
        while not key_file.is_file():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no run key at {key_file} after {join_timeout_s:g}s: is node 0 started?")
            await asyncio.sleep(0.5)
    return await run_agent(
        cluster, run_dir, key_file=key_file, log=log, join_timeout_s=join_timeout_s,
        head_timeout_s=cfg.faults.node_lost_s,
    )  # fmt: skip
