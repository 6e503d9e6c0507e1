"""`slipstream bench decode --history RUN`: the speculation arms on a recorded multi-epoch workload.

    slipstream bench decode --history runs/train-… --drafter smollm2-135m-chain-sum-long --batches 1,4 --json

A run whose prompts recur (`dataset_size` ≤ its steps × `prompts_per_step`) leaves its samples in
samples/step-N.jsonl. This replays its last step (or `--step N`): that step's groups, each sample with the
run's own seed and sampling, decoded by the run's trained policy (RUN/hf, else its config's model) in
reproducible mode, so every arm commits the same tokens. History is what the run sampled before that step
(engine/history.py). A batch of B is the tail: the B samples whose recorded responses were longest, their
groups' other samples already done (their responses are the siblings the drafters see, as in a rollout's
tail). Rows per batch size: plain, the n-gram drafter (siblings), history alone, and with --drafter the
EAGLE head and the cascade (history and siblings, else the head); each with tokens/s against plain's,
accept length and drafting time per drafted token. The arms of a batch size take turns one iteration each
(benchmarks/decode.py `interleaved_round`).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from slipstream.engine import eagle_export, hub
from slipstream.engine.drafters import Drafter, DraftState, NGramDrafter, SuffixDrafter
from slipstream.engine.generator import Generator, Request
from slipstream.engine.history import History, HistoryConfig, prompt_key
from slipstream.engine.model import Transformer
from slipstream.engine.sampling import SamplingParams, group_seed, sample_seed
from slipstream.engine.speculator import SpecConfig
from slipstream.engine.weights import load_model

__all__ = ["HistoryResult", "HistoryRow", "render", "run"]

ARMS = ("off", "ngram:d3", "history:d8", "eagle:d3", "cascade:d8")


class HistoryRow(msgspec.Struct, frozen=True, kw_only=True):
    batch: int
    arm: str
    tokens_per_s: float  # median over the rounds
    ratio: float | None  # to plain's at this batch size
    accept_length: float  # tokens per target pass
    draft_ms_per_token: float  # drafting time per drafted token (0: plain)
    drafted: int
    accepted: int


class HistoryResult(msgspec.Struct, frozen=True, kw_only=True):
    run_dir: str
    step: int  # the step replayed
    history_responses: int  # responses of earlier steps drafted from
    history_tokens: int
    model: str  # the policy decoding it
    rows: list[HistoryRow]
    repeats: int
    wall_s: float


class _Tally(msgspec.Struct):
    seconds: float = 0.0
    draft_s: float = 0.0
    tokens: int = 0
    passes: int = 0
    drafted: int = 0
    accepted: int = 0


def _records(run_dir: Path, step: int) -> list[dict]:
    paths = sorted((run_dir / "samples").glob(f"step-{step}*.jsonl"))
    if not paths:
        raise ValueError(f"--history {run_dir}: no samples of step {step} (samples/step-{step}.jsonl)")
    rows = [json.loads(line) for path in paths for line in path.read_text().splitlines()]
    return sorted(rows, key=lambda r: (r["group_id"], r["sample_index"]))


def load_workload(
    run_dir: Path, step: int | None
) -> tuple[dict, int, list[Request], History, dict[str, list[int]]]:
    """The run's config, the step replayed, its requests (each sample with its own seed, the longest recorded
    response first), the history of the steps before it, and each request's recorded response."""
    config = json.loads((run_dir / "config.json").read_text())
    steps = sorted(
        int(p.stem.split("-")[1].split(".")[0]) for p in (run_dir / "samples").glob("step-*.jsonl")
    )
    if not steps:
        raise ValueError(f"--history {run_dir}: no samples/step-N.jsonl")
    step = steps[-1] if step is None else step
    if step < 1:
        raise ValueError(f"--step {step}: the replayed step needs earlier steps to draw history from")
    history = HistoryConfig(**config.get("rollout", {}).get("history", {})).build()
    for earlier in range(step):
        for r in _records(run_dir, earlier):
            history.add(prompt_key(r["prompt_ids"]), earlier, r["prompt_ids"], r["token_ids"])
    requests = [
        Request(
            request_id=f"{r['group_id']}:{r['sample_index']}", prompt_ids=r["prompt_ids"], group_id=str(r["group_id"]),
            params=SamplingParams(temperature=config["temperature"], top_p=config.get("top_p", 1.0),
                                  top_k=config.get("top_k", 0), max_tokens=config["max_tokens"],
                                  seed=sample_seed(group_seed(config["seed"], r["group_id"]), r["sample_index"])),
        )
        for r in _records(run_dir, step)
    ]  # fmt: skip
    recorded = {f"{r['group_id']}:{r['sample_index']}": r["token_ids"] for r in _records(run_dir, step)}
    requests.sort(key=lambda r: -len(recorded[r.request_id]))
    return config, step, requests, history, recorded


def _done_siblings(
    gen: Generator, tail: list[Request], everyone: list[Request], recorded: dict[str, list[int]]
) -> None:
    """The drafters of `gen` see the responses of the tail's groups' other samples, already finished."""
    groups = {r.group_id for r in tail}
    decoding = {r.request_id for r in tail}
    for r in everyone:
        if r.group_id in groups and r.request_id not in decoding:
            done = DraftState(request_id=r.request_id, group_id=r.group_id, prompt_len=len(r.prompt_ids),
                              tokens=[*r.prompt_ids, *recorded[r.request_id]], params=r.params)  # fmt: skip
            for drafter in gen.speculator.drafters.values():
                drafter.observe(done)
                drafter.reset(r.request_id)


def _drafters(arm: str, model: Transformer, history: History, cfg: HistoryConfig, eagle: Path | None) -> dict:
    drafters: dict[str, Drafter] = {}
    method = arm.split(":")[0]
    if method in ("history", "cascade"):
        drafters["history"] = SuffixDrafter(history, max_extend=cfg.max_extend, growth=cfg.growth,
                                            head_depth=cfg.head_depth, head_below=cfg.head_below)  # fmt: skip
    if method == "ngram":
        drafters["ngram"] = NGramDrafter()
    if method in ("eagle", "cascade"):
        assert eagle is not None
        drafters["eagle"] = eagle_export.load(eagle, model)
    return drafters


def _round(model: Transformer, requests: list[Request], arms: Sequence[str], history: History,
           cfg: HistoryConfig, eagle: Path | None, everyone: list[Request],
           recorded: dict[str, list[int]]) -> list[_Tally]:  # fmt: skip
    gens = []
    for arm in arms:
        spec = None
        if arm != "off":
            depth = int(arm.split(":d")[1])
            spec = SpecConfig(method=arm.split(":")[0], depth=depth, mode="reproducible")  # type: ignore[arg-type]
        # The model config's stop ids, as the run's rollouts had: responses end where they ended.
        gen = Generator.for_requests(model, requests, max_batch=len(requests), spec=spec,
                                     drafters=_drafters(arm, model, history, cfg, eagle))  # fmt: skip
        _done_siblings(gen, requests, everyone, recorded)
        for request in requests:
            gen.add(request)
        gens.append(gen)
    tallies = [_Tally() for _ in arms]
    live = list(range(len(arms)))
    while live:
        for a in list(live):
            started = time.perf_counter()
            outputs = gens[a].step()
            tallies[a].seconds += time.perf_counter() - started
            tallies[a].draft_s += gens[a].last_draft_ns / 1e9
            for output in outputs:
                if (c := output.completion) is not None:
                    t = tallies[a]
                    t.tokens, t.passes = t.tokens + len(c.token_ids), t.passes + c.target_passes
                    t.drafted, t.accepted = t.drafted + c.drafted, t.accepted + c.accepted
            if not gens[a].has_unfinished():
                live.remove(a)
    return tallies


def run(run_dir: Path, *, step: int | None = None, batches: Sequence[int] = (1, 4), repeats: int = 1,
        drafter: Path | None = None, log: bool = True) -> HistoryResult:  # fmt: skip
    """Replays step `step` (default: the last) of `run_dir` with each arm; see the module docstring."""
    started = time.perf_counter()
    config, step, requests, history, recorded = load_workload(run_dir, step)
    eagle = hub.drafter_dir(drafter) if drafter is not None else None
    arms = [a for a in ARMS if eagle is not None or a.split(":")[0] not in ("eagle", "cascade")]
    model_dir = run_dir / "hf" if (run_dir / "hf" / "config.json").is_file() else hub.resolve(config["model"])
    model = load_model(model_dir)
    cfg = HistoryConfig(**config.get("rollout", {}).get("history", {}))
    rows: list[HistoryRow] = []
    for batch in batches:
        chosen = requests[:batch]
        rounds = [
            _round(model, chosen, arms, history, cfg, eagle, requests, recorded) for _ in range(repeats)
        ]
        rates = [statistics.median(rd[a].tokens / rd[a].seconds for rd in rounds) for a in range(len(arms))]
        for a, arm in enumerate(arms):
            t = _Tally(**{f: sum(getattr(rd[a], f) for rd in rounds) for f in _Tally.__struct_fields__})
            rows.append(HistoryRow(
                batch=batch, arm=arm, tokens_per_s=round(rates[a], 2), ratio=round(rates[a] / rates[0], 3),
                accept_length=round(t.tokens / t.passes, 3) if t.passes else 0.0,
                draft_ms_per_token=round(1e3 * t.draft_s / t.drafted, 4) if t.drafted else 0.0,
                drafted=t.drafted, accepted=t.accepted,
            ))  # fmt: skip
            if log:
                print(f"bench decode --history: batch {batch} {arm}: {rows[-1].tokens_per_s} tok/s "
                      f"({rows[-1].ratio}x), accept {rows[-1].accept_length}", flush=True)  # fmt: skip
    stats = history.stats()
    return HistoryResult(
        run_dir=str(run_dir), step=step, history_responses=stats["responses"], history_tokens=stats["tokens"],
        model=str(model_dir), rows=rows, repeats=repeats, wall_s=round(time.perf_counter() - started, 1),
    )  # fmt: skip


def render(result: HistoryResult) -> str:
    """A readable table of `run`'s result."""
    lines = [f"{result.run_dir} step {result.step}: history of {result.history_responses} responses "
             f"({result.history_tokens} tokens), policy {result.model}",
             f"{'batch':>5}  {'arm':<12} {'tok/s':>8} {'ratio':>6} {'accept':>6} {'draft ms/tok':>12}"]  # fmt: skip
    for r in result.rows:
        lines.append(f"{r.batch:>5}  {r.arm:<12} {r.tokens_per_s:>8.1f} {r.ratio or 0:>6.2f} {r.accept_length:>6.2f} "
                     f"{r.draft_ms_per_token:>12.3f}")  # fmt: skip
    return "\n".join(lines)
