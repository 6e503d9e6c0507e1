"""Prompt files: a JSONL of prompts read into token ids once, before any rollout starts.

One JSON object per line (blank lines are skipped):

    {"id": "q1", "prompt": "What is 2+3?", "answer": "5"}
    {"id": "q2", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    {"id": "q3", "prompt_ids": [1, 4093, 198], "group_id": "q1"}

- `id` (string or integer, unique in the file) and exactly one of:
  `prompt` (text, wrapped as one user message in the chat template when the tokenizer has one,
  encoded plainly otherwise), `messages` (a chat, through the template) or `prompt_ids` (ids as is).
- Optional: `answer` (any JSON value, handed to the reward), `group_id` (prompts that share an
  n-gram drafter table; defaults to `id`), `metadata` (a JSON object, handed to the reward).

Unknown keys are an error (a misspelt `promt` fails at load time); every error names file and line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slipstream.engine.tokenizer import Tokenizer

__all__ = ["PromptSpec", "read_prompts"]

_SOURCES = ("prompt", "messages", "prompt_ids")
_OPTIONAL = ("answer", "group_id", "metadata")
_KNOWN = frozenset(("id", *_SOURCES, *_OPTIONAL))


@dataclass(frozen=True, kw_only=True)
class PromptSpec:
    """One prompt, tokenized."""

    id: str
    """Unique within its file; integer ids are turned into strings."""
    prompt_ids: tuple[int, ...]
    """The ids the model is given (chat template already applied)."""
    text: str | None = None
    """The `prompt` text as written, when the line gave one (for logs and rewards)."""
    answer: Any = None
    """Reference answer for the reward, any JSON value."""
    group_id: str = ""
    """Prompts with the same group share drafting state; the prompt's own id when not given."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """Free-form JSON object handed to the reward."""


def read_prompts(path: str | os.PathLike[str], tokenizer: Tokenizer | None = None) -> list[PromptSpec]:
    """Read and tokenize a prompts JSONL; `tokenizer` is needed only for `prompt`/`messages` lines."""
    path = Path(path)
    specs: list[PromptSpec] = []
    first_line: dict[str, int] = {}
    with path.open(encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            spec = _parse_line(line, tokenizer, where=f"{path}:{lineno}")
            if spec.id in first_line:
                raise ValueError(
                    f"{path}:{lineno}: duplicate id {spec.id!r} (first on line {first_line[spec.id]})"
                )
            first_line[spec.id] = lineno
            specs.append(spec)
    if not specs:
        raise ValueError(f"{path}: no prompts")
    return specs


def _parse_line(line: str, tokenizer: Tokenizer | None, *, where: str) -> PromptSpec:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    unknown = sorted(set(record) - _KNOWN)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(_KNOWN)}")

    raw_id = record.get("id")
    if isinstance(raw_id, bool) or not isinstance(raw_id, str | int) or raw_id == "":
        raise ValueError(f"{where}: 'id' must be a non-empty string or an integer, got {raw_id!r}")
    prompt_id = str(raw_id)

    given = [k for k in _SOURCES if k in record]
    if len(given) != 1:
        raise ValueError(f"{where}: need exactly one of {list(_SOURCES)}, got {given or 'none'}")
    text: str | None = None
    if "prompt_ids" in record:
        ids = _check_ids(record["prompt_ids"], tokenizer, where=where)
    else:
        if tokenizer is None:
            raise ValueError(
                f"{where}: {given[0]!r} needs a tokenizer (only 'prompt_ids' lines can do without)"
            )
        if "prompt" in record:
            text = record["prompt"]
            if not isinstance(text, str) or not text:
                raise ValueError(f"{where}: 'prompt' must be a non-empty string")
            # Without a template apply_chat_template encodes a lone message's text plainly.
            ids = _render(tokenizer, [{"role": "user", "content": text}], where=where)
        else:
            messages = _check_messages(record["messages"], where=where)
            ids = _render(tokenizer, messages, where=where)
        if not ids:
            raise ValueError(f"{where}: the prompt encodes to no tokens")

    group_id = record.get("group_id", prompt_id)
    if isinstance(group_id, bool) or not isinstance(group_id, str | int):
        raise ValueError(f"{where}: 'group_id' must be a string or an integer, got {group_id!r}")
    metadata = record.get("metadata", {})
    if not isinstance(metadata, dict):
        raise ValueError(f"{where}: 'metadata' must be a JSON object")
    return PromptSpec(
        id=prompt_id,
        prompt_ids=tuple(ids),
        text=text,
        answer=record.get("answer"),
        group_id=str(group_id),
        metadata=metadata,
    )


def _check_ids(value: Any, tokenizer: Tokenizer | None, *, where: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: 'prompt_ids' must be a non-empty list of integers")
    limit = tokenizer.vocab_size if tokenizer is not None else None
    for i, token in enumerate(value):
        # bool is an int subclass; true/false in a token list is a bug in whatever wrote the file.
        if isinstance(token, bool) or not isinstance(token, int):
            raise ValueError(f"{where}: prompt_ids[{i}] is {token!r}, not an integer")
        if token < 0 or (limit is not None and token >= limit):
            bound = f" [0, {limit})" if limit is not None else " (negative)"
            raise ValueError(f"{where}: prompt_ids[{i}] = {token} is outside the vocabulary{bound}")
    return value


def _check_messages(value: Any, *, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    for i, message in enumerate(value):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or "content" not in message
        ):
            raise ValueError(f"{where}: messages[{i}] must be an object with a string 'role' and a 'content'")
    return value


def _render(tokenizer: Tokenizer, messages: list[dict[str, Any]], *, where: str) -> list[int]:
    try:
        return tokenizer.apply_chat_template(messages)
    except Exception as e:
        # Templates reject conversations they cannot format (raise_exception); say which line did it.
        raise ValueError(f"{where}: chat template failed: {e}") from e
