"""SIGTERM (scancel, a launcher stopping its nodes) stops `slipstream train` in order: every actor is told to
shut down and does, the command says why and exits non-zero, and no process of the run is left."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from slipstream.runtime.process import pid_alive
from tests.cli.conftest import config

pytestmark = pytest.mark.timeout(300)


def test_sigterm_shuts_the_actors_down_and_names_the_signal(tiny_chat: Path, tmp_path: Path) -> None:
    cfg = config(tiny_chat, steps=50, rollout={"devices": 1})
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps(msgspec.to_builtins(cfg)))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "slipstream.cli.main", "train", str(cfg_file), "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and metrics.read_text().strip()):  # one step done: every actor is up
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not reach its first step"
        time.sleep(0.2)
    logs = run_dir / "logs"
    pids = {}
    for path in logs.glob("*.jsonl"):
        for line in path.read_bytes().splitlines():
            record = msgspec.json.decode(line)
            if record.get("event") == "spawned":
                pids[record["actor"]] = record["pid"]
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "stopped by SIGTERM" in stderr
    assert pids and not [name for name, pid in pids.items() if pid_alive(pid)]
    # Each actor heard the Shutdown and stopped on its own (its log's last word), none was killed.
    for name in pids:
        role, rank = name.split(":")
        events = [
            msgspec.json.decode(line)["event"]
            for line in (logs / f"{role}-{rank}.jsonl").read_bytes().splitlines()
        ]
        assert "stopped" in events, f"{name} was killed, not shut down: {events[-5:]}"
