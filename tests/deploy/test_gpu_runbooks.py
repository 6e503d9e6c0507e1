"""The GPU runbooks' CPU-side parts (deploy/gpu_env.sh, deploy/gpu_smollm2.sh): what a GPU session runs
must import every package the tree maps, and SmolLM2's GGUF must split into the carries' parts and join
back byte for byte. The GPU parts themselves run only on a GPU machine (docs/gpu.md)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_gpu_env_links_every_package_the_tree_maps() -> None:
    mapped = set(re.findall(r'"slipstream\.(\w+)" = "(\w+)"', (REPO / "pyproject.toml").read_text()))
    linked = re.search(r"for d in ([\w ]+); do", (REPO / "deploy" / "gpu_env.sh").read_text())
    assert linked is not None
    assert {folder for _, folder in mapped} == set(linked.group(1).split())


def test_smollm2_splits_into_the_carries_parts_and_joins_back(tmp_path: Path) -> None:
    (tmp_path / "deploy").mkdir()
    script = tmp_path / "deploy" / "gpu_smollm2.sh"
    shutil.copy(REPO / "deploy" / "gpu_smollm2.sh", script)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(os.urandom(2500))
    env = {
        **os.environ,
        "SMOL_GGUF": str(gguf),
        "PART1_BYTES": "1000",
        "PART2_BYTES": "900",
        "OUT": str(tmp_path / "out"),
    }
    done = subprocess.run(
        ["bash", str(script), "prepare"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    parts = [(tmp_path / ".gpusmol" / f"part-{i}").read_bytes() for i in (1, 2, 3)]
    assert [len(p) for p in parts] == [1000, 900, 600] and b"".join(parts) == gguf.read_bytes()
    missing = {**env, "SMOL_GGUF": str(tmp_path / "none.gguf")}
    done = subprocess.run(
        ["bash", str(script), "prepare"], env=missing, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "no GGUF at" in done.stderr
    done = subprocess.run(
        ["bash", str(script), "nonsense"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "usage" in done.stderr
