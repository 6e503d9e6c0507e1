"""`slipstream drafter warmup` and `slipstream drafter export`: the drafter as a deployment asset.

    slipstream drafter warmup --model smollm2-135m --task basic_arithmetic --steps 300 --out drafters/smol
    slipstream drafter warmup --model smollm2-135m --task chain_sum --task-options '{"max_terms": 2}' …
    slipstream drafter export runs/RUN --model smollm2-135m --out drafters/from-run

warmup trains an EAGLE head offline on the model's own sampled outputs: the task's questions (a
reasoning-gym task with its options, or a JSONL/Parquet file) made into prompts exactly as `train` makes
them (`tasks.datasets.load_rows`, then `chat_prompt_ids` with the same optional system turn), responses
sampled by the engine with hidden states kept, then `steps` optimizer steps on them. Users run it before the first RL step, so speculation pays from step
one. It then measures accept length on held-out prompts of the same task, using the real speculative
generator. Chains k=3/5/7 and one tree are measured greedy; one chain at k=5 is measured at the
sampling temperature. It writes the drafter in the EAGLE draft-model layout (`engine/eagle_export.py`),
which vLLM/SGLang load and `generate --spec eagle --drafter DIR` uses.

export turns a run's newest drafter checkpoint (what the drafter actor trained online) into that layout.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from slipstream.engine import eagle_export, hub
from slipstream.engine import warmup as engine_warmup
from slipstream.engine.config import ModelConfig, dtype_from_name
from slipstream.engine.eagle import EagleHead
from slipstream.engine.tokenizer import Tokenizer
from slipstream.engine.weights import load_model
from slipstream.runtime.progress import bar
from slipstream.tasks.datasets import chat_prompt_ids, load_rows


def warmup_prompts(
    task: str,
    n: int,
    seed: int,
    tokenizer: Tokenizer,
    *,
    task_options: Mapping[str, Any] | None = None,
    system_prompt: str = "",
) -> list[list[int]]:
    """The first `n` rows of `task` (`train`'s task, task_options and system_prompt fields) as chat prompt
    ids, built as `slipstream train` builds its prompts, so the head trains on the prompts it will see."""
    rows, _ = load_rows(task, seed=seed, size=n, options=task_options)
    if len(rows) < n:
        raise ValueError(f"{task}: {len(rows)} rows, the warmup needs {n} (samples + eval samples)")
    return [chat_prompt_ids(tokenizer, row.question, system=system_prompt or None) for row in rows[:n]]


def warmup(
    *,
    model: str,
    task: str,
    steps: int,
    out: Path,
    samples: int = 64,
    eval_samples: int = 16,
    task_options: Mapping[str, Any] | None = None,
    system_prompt: str = "",
    dtype: str = "float32",
    **options: Any,
) -> dict[str, Any]:
    """`drafter warmup`: `samples` training and `eval_samples` held-out prompts of `task` (one dataset, so
    they are disjoint rows), then `engine.warmup.warmup` (its options pass through; `dtype` is the
    export's)."""
    model_dir = hub.resolve(model)
    target = load_model(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = warmup_prompts(
        task, samples + eval_samples, options.get("seed", 0), tokenizer, task_options=task_options,
        system_prompt=system_prompt,
    )  # fmt: skip
    summary = engine_warmup.warmup(
        target, prompts[:samples], prompts[samples:], eos=sorted(tokenizer.stop_ids), steps=steps, out=out,
        progress=bar, export_dtype=dtype_from_name(dtype, field="--dtype"), **options,
    )  # fmt: skip
    result = {
        "model": str(model_dir), "task": task, "task_options": dict(task_options or {}),
        "system_prompt": system_prompt, **summary,
    }  # fmt: skip
    (Path(out) / "warmup.json").write_text(json.dumps(result, indent=2))
    return result


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
    config = ModelConfig.from_pretrained(hub.resolve(model))  # the shapes alone: no weights are read
    head = EagleHead.for_target(config)
    head.load_state_dict(state["head"])
    version = int(state.get("version", 0))
    eagle_export.export(head, config, out, server=server, version=version)
    return {"checkpoint": str(path), "version": version, "out": str(out)}
