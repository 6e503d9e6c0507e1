"""Tokenizer: tokenizer.json through the `tokenizers` library, plus the model's Jinja chat template.

transformers is deliberately not used at run time: it is a heavy optional extra (needed only by
`hub.pull`), and rollout workers only need encode, decode, the stop ids and the chat template.
The template is rendered the way transformers renders it (a sandboxed Jinja environment with
trim_blocks/lstrip_blocks, `raise_exception`, `strftime_now` and a non-escaping `tojson`; special
token strings passed as variables; the result encoded without adding special tokens), so the ids
match `AutoTokenizer.apply_chat_template` — a test checks that on the converted SmolLM2.

Stop ids are the union of the generation config's `eos_token_id` (an int or a list) and the
tokenizer config's `eos_token`: chat models often stop on an end-of-turn token that only one of
the two names.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Backend

__all__ = ["Tokenizer"]

# The special-token names transformers exposes to chat templates as variables.
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Encode, decode and chat-format text for one model directory."""

    def __init__(
        self,
        backend: _Backend,
        *,
        special_tokens: Mapping[str, str] | None = None,
        chat_template: str | None = None,
        extra_stop_ids: Iterable[int] = (),
    ) -> None:
        """Wrap a `tokenizers.Tokenizer`; `special_tokens` maps names like "eos_token" to token strings."""
        self._backend = backend
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.chat_template = chat_template or None
        self._template: jinja2.Template | None = (
            _compile_template(self.chat_template) if self.chat_template else None
        )
        self.bos_id = self._special_id("bos_token")
        self.eos_id = self._special_id("eos_token")
        self.pad_id = self._special_id("pad_token")
        stops = {int(i) for i in extra_stop_ids}
        if self.eos_id is not None:
            stops.add(self.eos_id)
        self.stop_ids: frozenset[int] = frozenset(stops)

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and (if present) generation_config.json from `path`."""
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file} not found (a model directory needs tokenizer.json)")
        backend = _Backend.from_file(str(tokenizer_file))
        tok_cfg = _read_json(root / "tokenizer_config.json")
        gen_cfg = _read_json(root / "generation_config.json")
        specials = {name: text for name in _SPECIAL_NAMES if (text := _token_text(tok_cfg.get(name)))}
        template = tok_cfg.get("chat_template")
        if not isinstance(template, str):
            # transformers >= 4.43 may keep the template in its own file instead.
            jinja_file = root / "chat_template.jinja"
            template = jinja_file.read_text(encoding="utf-8") if jinja_file.is_file() else None
        eos = gen_cfg.get("eos_token_id")
        extra = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(backend, special_tokens=specials, chat_template=template, extra_stop_ids=extra)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        """Whether `apply_chat_template` renders a template rather than plain text."""
        return self._template is not None

    def token_to_id(self, token: str) -> int | None:
        """The id of one token string, or None when it is not in the vocabulary."""
        return self._backend.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` runs tokenizer.json's post-processor (BOS and the like)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` for many texts, parallel inside the Rust library."""
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens are dropped unless `skip_special_tokens` is False."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, seqs: Sequence[Sequence[int]], *, skip_special_tokens: bool = True) -> list[str]:
        """`decode` for many sequences, parallel inside the Rust library (which lets go of the GIL)."""
        return self._backend.decode_batch(
            [list(ids) for ids in seqs], skip_special_tokens=skip_special_tokens
        )

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The chat template applied to `messages` as text (see `apply_chat_template`)."""
        if self._template is None:
            # No template (a base model): the conversation is just its contents, one per line.
            return "\n".join(str(m.get("content", "")) for m in messages)
        # Like transformers: a None field is dropped, so templates test for a missing key, not "None".
        plain = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {**self.special_tokens, **template_kwargs}
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        return self._template.render(messages=plain, add_generation_prompt=add_generation_prompt, **variables)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Ids of `messages` ({"role", "content"} dicts) formatted by the chat template.

        Extra keyword arguments are template variables (e.g. `enable_thinking`). Without a template
        the contents are joined by newlines and encoded plainly, special tokens added.
        """
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
        # A template writes its own BOS/turn markers, so the post-processor must not add them again.
        return self.encode(text, add_special_tokens=self._template is None)

    def _special_id(self, name: str) -> int | None:
        text = self.special_tokens.get(name)
        return None if text is None else self._backend.token_to_id(text)


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandbox transformers uses; templates are untrusted input."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson HTML-escapes; templates expect plain JSON.
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes a special token either as a string or as a serialised AddedToken.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data
