"""What several `slipstream` subcommands share: running one training (`train`, `bench soak`), SIGTERM as an
orderly stop, and the configs shipped with the package.

    summary = run_training(cfg, run_dir, baseline=False)   # config.json, the coordinator's log, the loop
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

if TYPE_CHECKING:
    from slipstream.rl.run_config import TrainConfig

T = TypeVar("T")


def run_training(
    cfg: TrainConfig,
    run_dir: Path,
    *,
    baseline: bool,
    resume: bool = False,
    echo: bool = False,
    step_lines: TextIO | None = None,
    **multi_node: Any,
) -> dict[str, Any]:
    """One `slipstream train` run: config.json (a fresh run), the coordinator's log, the loop; its summary.
    `multi_node`: train's cluster, keys_dir and join_timeout_s (node 0 of a run across nodes), and turns."""
    import msgspec
    import uvloop

    from slipstream.cli import train
    from slipstream.runtime import logs
    from slipstream.runtime.progress import bar

    if not resume:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(msgspec.to_builtins(cfg)))
    log = logs.configure(role="coordinator", run_dir=run_dir, echo=echo)
    log.info("config", **msgspec.to_builtins(cfg))
    return uvloop.run(
        until_sigterm(
            train.train(
                cfg,
                run_dir,
                baseline=baseline,
                resume=resume,
                progress=bar,
                log=log,
                step_lines=step_lines,
                **multi_node,
            )
        )
    )


async def until_sigterm(coro: Coroutine[Any, Any, T]) -> T:
    """Runs `coro`; SIGTERM (scancel, a launcher stopping its nodes) cancels it, so its `finally` blocks shut
    the actors down in order (Shutdown, grace, SIGTERM, SIGKILL), then raises naming the signal."""
    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    stopped: list[bool] = []
    loop.add_signal_handler(signal.SIGTERM, lambda: (stopped.append(True), task.cancel()))
    try:
        return await task
    except asyncio.CancelledError:
        if stopped:
            raise RuntimeError("stopped by SIGTERM; every actor was shut down") from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def packaged_config(name: str) -> Path:
    """A config shipped in deploy/configs/ (package data of slipstream.deploy)."""
    from importlib.resources import files

    return Path(str(files("slipstream.deploy").joinpath("configs", name)))
