"""`slipstream generate`: complete a file of prompts with the engine, speculation on or off.

    slipstream generate --model smollm2-135m --prompts prompts.jsonl --json
    slipstream generate --model DIR --prompts p.jsonl --spec ngram --depth 5 --temperature 0 --json
    slipstream generate --model smollm2-135m --prompts p.jsonl --spec self --reproducible

Prompts: a JSONL as `tasks/prompts.py` reads it. Output: stdout, in file order, each request as soon as
it and every earlier one are done — with --json one object per line (`completion_record`), else a
readable block; the summary and the progress bar go to stderr. Stop ids: the model's EOS ids plus the
tokenizer's stop ids; the stop token is kept in token_ids.

- Seeds: request i (0-based, file order) samples with seed `seed * 2**24 + i` (`sampling.sample_seed`,
  as sample i of a rollout group with that seed). Noise is keyed by (request seed, position), so a request's
  output depends on its seed and index only — not on its batch, nor on speculation with --reproducible.
- --spec self replays the target's own output, recorded first by a plain run with the same seeds (the
  mechanical ceiling, DESIGN §11); at T > 0 pair it with --reproducible (rejection mode accepts a
  replayed token x with probability q(x) only). --spec eagle needs --drafter DIR (`drafter warmup` or
  `drafter export` writes one). --spec auto drafts with ngram: the per-batch-size tuner is the rollout's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

import torch

from slipstream.engine import eagle_export, hub
from slipstream.engine.drafters import Drafter, NGramDrafter, OracleDrafter
from slipstream.engine.generator import Completion, Generator, Request, run_requests
from slipstream.engine.model import Transformer
from slipstream.engine.sampling import MAX_SEED, SamplingParams, sample_seed
from slipstream.engine.speculator import SpecConfig
from slipstream.engine.tokenizer import Tokenizer
from slipstream.engine.weights import load_model
from slipstream.runtime.progress import bar
from slipstream.tasks.prompts import PromptSpec, read_prompts

__all__ = [
    "SPEC_METHODS",
    "completion_record",
    "make_drafters",
    "make_requests",
    "run",
    "spec_config",
]

SPEC_METHODS = ("off", "ngram", "self", "eagle", "auto")
"""What --spec accepts (the CLI lists the same choices)."""


def spec_config(
    method: str,
    *,
    depth: int | None = None,
    topk: int | None = None,
    verify: int | None = None,
    reproducible: bool = False,
) -> SpecConfig | None:
    """The engine's speculation settings for a CLI method; None for plain decoding."""
    if method == "off":
        return None
    shape = {k: v for k, v in (("depth", depth), ("topk", topk), ("verify", verify)) if v is not None}
    return SpecConfig(
        method="ngram" if method == "auto" else method,
        mode="reproducible" if reproducible else "rejection",
        **shape,
    )


def make_drafters(
    method: str,
    recorded: dict[str, list[int]] | None = None,
    *,
    drafter_dir: Path | None = None,
    target: Transformer | None = None,
) -> dict[str, Drafter]:
    """Fresh drafters for a CLI method, keyed by the engine method that drafts with them (what
    `Generator(drafters=...)` holds); drafters hold per-run tables, so never share them between runs."""
    if method == "eagle":
        if drafter_dir is None or target is None:
            raise ValueError("--spec eagle needs --drafter DIR (a trained EAGLE head)")
        return {"eagle": eagle_export.load(drafter_dir, target)}
    if method in ("ngram", "auto"):
        return {"ngram": NGramDrafter()}
    if method == "self":
        return {"self": OracleDrafter(recorded or {})}
    return {}


def make_requests(specs: Sequence[PromptSpec], params: SamplingParams, seed: int) -> list[Request]:
    """One request per prompt, in file order, request i with seed `sample_seed(seed, i)`."""
    return [
        Request(
            request_id=spec.id,
            prompt_ids=spec.prompt_ids,
            params=replace(params, seed=sample_seed(seed, i)),
            group_id=spec.group_id,
        )
        for i, spec in enumerate(specs)
    ]


def completion_record(completion: Completion, tokenizer: Tokenizer | None) -> dict[str, Any]:
    """The JSON object printed for one request: id, token_ids, text (when there is a tokenizer),
    finish_reason, num_tokens, and the speculation stats target_passes (verify passes), drafted, accepted
    and accept_length (tokens per target pass; 1.0 for plain decoding)."""
    record: dict[str, Any] = {"id": completion.request_id, "token_ids": completion.token_ids}
    if tokenizer is not None:
        record["text"] = tokenizer.decode(completion.token_ids)
    passes = completion.target_passes
    record.update(
        finish_reason=completion.finish_reason,
        num_tokens=len(completion.token_ids),
        target_passes=passes,
        drafted=completion.drafted,
        accepted=completion.accepted,
        accept_length=round(len(completion.token_ids) / passes, 3) if passes else 0.0,
    )
    return record


def _print_completion(record: dict[str, Any], *, as_json: bool, out: TextIO) -> None:
    if as_json:
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
    else:
        head = (
            f"### {record['id']}  ({record['finish_reason']}, {record['num_tokens']} tokens, "
            f"accept length {record['accept_length']})"
        )
        body = record["text"] if "text" in record else " ".join(map(str, record["token_ids"]))
        out.write(f"{head}\n{body}\n\n")
    out.flush()


def _load(model_name: str, prompts: Path) -> tuple[Transformer, Tokenizer | None, list[PromptSpec]]:
    # Cheap checks first: resolving a registry name may convert a model (~20 s) and loading reads weights.
    if not prompts.exists():
        raise ValueError(f"prompts file {prompts} not found")
    if not prompts.is_file():
        raise ValueError(f"prompts file {prompts} is not a file")
    model_path = hub.resolve(model_name)
    tokenizer = Tokenizer.from_dir(model_path) if (model_path / "tokenizer.json").is_file() else None
    specs = read_prompts(prompts, tokenizer)
    return load_model(model_path), tokenizer, specs


def _check_options(args: argparse.Namespace) -> None:
    if args.spec == "eagle":
        if args.drafter is None:
            raise ValueError("--spec eagle needs --drafter DIR (a trained EAGLE head)")
        try:  # a shipped drafter's name or a directory
            args.drafter = hub.drafter_dir(args.drafter)
        except ValueError as exc:
            raise ValueError(f"--drafter {args.drafter}: not an exported EAGLE drafter: {exc}") from None
    elif args.drafter is not None:
        raise ValueError(f"--drafter is for --spec eagle only (got --spec {args.spec})")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    if not 0 <= args.seed < MAX_SEED:
        raise ValueError(f"--seed must be in [0, 2**39), got {args.seed}")


def _spec_notes(args: argparse.Namespace) -> None:
    """What --spec does that a user may not expect, said on stderr."""
    if args.spec == "auto":
        print(
            "slipstream generate: --spec auto picks ngram (the tuner that picks per batch size runs in the "
            "rollout actor)",
            file=sys.stderr,
        )
    if args.spec == "self" and args.temperature > 0 and not args.reproducible:
        print(
            "slipstream generate: note: --spec self without --reproducible accepts a replayed token x "
            "with probability q(x) only; add --reproducible for the ceiling",
            file=sys.stderr,
        )


def _record_plain(model: Transformer, requests: list[Request], max_batch: int) -> dict[str, list[int]]:
    """What plain decoding produces for `requests` with their very seeds (prompt + response by request
    id): the script --spec self replays."""
    recorded: dict[str, list[int]] = {}
    plain = Generator.for_requests(model, requests, max_batch=max_batch)
    with bar("recording plain run", len(requests)) as p:
        done = run_requests(plain, requests, on_done=lambda *_: p.advance(), on_tokens=p.add_tokens)
        for c in done:
            recorded[c.request_id] = [*c.prompt_ids, *c.token_ids]
    return recorded  # the generator and its KV cache go with this frame


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """The `generate` command; raises ValueError / OSError with a one-line message on bad input."""
    out = out or sys.stdout
    _check_options(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens
    )
    spec = spec_config(
        args.spec, depth=args.depth, topk=args.topk, verify=args.verify, reproducible=args.reproducible
    )
    _spec_notes(args)
    model, tokenizer, specs = _load(args.model, args.prompts)
    stops = tuple(sorted(tokenizer.stop_ids)) if tokenizer is not None else ()
    requests = make_requests(specs, replace(params, stop_token_ids=stops), args.seed)

    recorded = _record_plain(model, requests, args.max_batch) if args.spec == "self" else {}
    generator = Generator.for_requests(
        model,
        requests,
        max_batch=args.max_batch,
        spec=spec,
        drafters=make_drafters(args.spec, recorded, drafter_dir=args.drafter, target=model),
    )
    started = time.perf_counter()
    with bar(f"generate ({args.spec})", len(requests)) as p:

        def emit(i: int, completion: Completion) -> None:
            p.advance()
            _print_completion(completion_record(completion, tokenizer), as_json=args.json, out=out)

        completions = run_requests(generator, requests, on_done=emit, on_tokens=p.add_tokens)
    seconds = time.perf_counter() - started
    tokens = sum(len(c.token_ids) for c in completions)
    passes = sum(c.target_passes for c in completions)
    print(
        f"slipstream generate: {len(completions)} requests, {tokens} tokens in {seconds:.1f} s "
        f"({tokens / max(seconds, 1e-9):.1f} tok/s), spec {args.spec}, mean accept length "
        f"{tokens / max(passes, 1):.2f}",
        file=sys.stderr,
    )
    return 0
