"""The synchronous GRPO loop, top to bottom: what `slipstream train` runs (cli/train.py parses its arguments).

    summary = await train(load_config("deploy/configs/demo.yaml", ["steps=2"]), Path("runs/x"))

One step: deal the step's prompts to the rollout actors → stream each completion to a verifier the moment
it arrives (rewards overlap the tail), while idle rollout devices are leased to drafter training → preempt
when the last completion is in → the groups' plans (prompts, rewards) → one learner step → the learner pushes the weights and
every rollout acknowledges the new version → a checkpoint when due → the step's record (metrics.jsonl, the
sinks of `metrics.sinks`, a line on `step_lines`), the run's in summary.json. The verbs are rl/run.py's;
a dead actor is restarted and its work dealt again (rl/recovery.py). Samples go from the rollouts to the
learner ranks, never through this loop. A dead learner restarts from its newest checkpoint and replays
the steps after it from their samples records; then the step trains again (rolled out again first, if
the samples died with the learner before it recorded them).
Configuration: `TrainConfig` and the actors it makes, in rl/run_config.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TextIO

from slipstream.engine.device import require_device
from slipstream.rl.coordinator import ActorDiedError
from slipstream.rl.run import Run
from slipstream.rl.run_config import TrainConfig, require_transport
from slipstream.runtime.cluster import Cluster
from slipstream.runtime.progress import ProgressFactory, silent
from slipstream.runtime.sinks import require_sinks
from slipstream.runtime.turns import Turns

__all__ = ["train"]


async def train(
    cfg: TrainConfig,
    run_dir: Path,
    *,
    baseline: bool = False,
    resume: bool = False,
    progress: ProgressFactory = silent,
    log: Any = None,
    step_lines: TextIO | None = None,
    cluster: Cluster | None = None,
    keys_dir: Path | None = None,
    join_timeout_s: float = 300.0,
    turns: Turns | None = None,
) -> dict[str, Any]:
    """Runs the loop; returns the summary also written to run_dir/summary.json. `step_lines`: where each
    step's line is printed as it finishes (None: nowhere). With a multi-node `cluster` this is node 0, the
    head: it waits for the other nodes' agents (`join_timeout_s`), then places actors on every node.
    `turns`: start-up, each step, and the shutdown each wait for this run's turn (runtime/turns.py: bench
    e2e interleaves two runs step by step); the waits are in no step's time."""
    cluster = cluster or Cluster()
    require_device(cfg.device)  # refused before anything starts, naming the field
    require_sinks(cfg.metrics)  # so is a sink whose package is missing
    require_transport(cfg, cluster)  # and plaintext TCP across hosts that the config does not allow
    run = Run(cfg, run_dir, baseline=baseline, resume=resume, log=log, step_lines=step_lines, turns=turns)
    try:
        await run.open(cluster, keys_dir=keys_dir, join_timeout_s=join_timeout_s)  # actors, coordinator
        for step in range(run.start, cfg.steps):
            await run.take_turn()
            work = run.batch(step)  # the step's prompts, from the data stream
            with progress(f"step {step + 1}/{cfg.steps}", len(work.rows) * cfg.group_size) as bar:
                while True:
                    try:
                        if not work.completions:  # deal → decode → score; idle devices train the drafter
                            await run.roll_out_and_score(work, bar.advance)
                        await run.learn(work)  # one GRPO step: policy version step + 1
                        await run.push(work)  # the weights to every rollout, the head to the drafters
                        await run.checkpoint(work)  # when due: policy, optimizer, drafter
                        break
                    except ActorDiedError as died:  # a learner: its checkpoint, a replay, then again
                        await run.recover_learners(died)
                        work = await run.lost(work)  # unless recorded, its samples died with it
            run.record(work)  # metrics, the run's state, the step line
            run.end_turn()
    finally:
        await run.close()
    return run.summary()
