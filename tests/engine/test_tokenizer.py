"""Tests for engine/tokenizer.py and tasks/prompts.py against the converted SmolLM2 (the shared home's copy,
pulled once, ~17 s, where it is not there yet), with transformers' AutoTokenizer as the reference for ids
and chat formatting.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import Tokenizer as Backend

from slipstream.engine import hub
from slipstream.engine.tokenizer import Tokenizer
from slipstream.tasks.prompts import PromptSpec, read_prompts

TEXTS = [
    "Hello world",
    "  leading spaces and trailing  ",
    "héllo wörld — ünïcode 你好 👋🏽",
    "line one\nline two\n\n\ttabbed",
    "x = [1, 2, 3]; print(sum(x)) # 6",
    "",
]

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is 2+3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋\n  there"}],
    [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "1, 2, 3"},
        {"role": "user", "content": "Again <|im_end|> please"},
    ],
]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    # The shared home's copy (read only here): the train tests pull it too, and tests/engine/test_hub.py
    # times a conversion of its own into a fresh home.
    return hub.pull("smollm2-135m")


@pytest.fixture(scope="session")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="session")
def hf_tok(model_dir: Path) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir)


def test_special_ids(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)
    assert tok.stop_ids == frozenset({2})
    assert tok.token_to_id("<|im_start|>") == 1 and tok.token_to_id("not a token ~~~") is None
    assert tok.has_chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_parity(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode_batch([text, text]) == [ids, ids]


def test_decode_keeps_special_tokens_on_request(tok: Tokenizer) -> None:
    ids = [*tok.encode("ok"), tok.eos_id]
    assert tok.decode(ids) == "ok"
    assert tok.decode(ids, skip_special_tokens=False) == "ok<|im_end|>"


def test_decode_batch_is_decode_of_each(tok: Tokenizer) -> None:
    seqs = [
        tok.encode("Hello, world!"),
        tok.encode("<|im_start|>user 12 + 7<|im_end|>"),
        [],
        tok.encode("é ∑ 😀"),
    ]
    for skip in (True, False):
        assert tok.decode_batch(seqs, skip_special_tokens=skip) == [
            tok.decode(s, skip_special_tokens=skip) for s in seqs
        ]


@pytest.mark.parametrize("chat", CHATS, ids=["user", "system", "multi-turn"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tok: Any, chat: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    ours = tok.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(
        chat, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert ours == list(theirs)
    assert tok.render_chat(chat, add_generation_prompt=add_generation_prompt) == hf_tok.apply_chat_template(
        chat, add_generation_prompt=add_generation_prompt, tokenize=False
    )


def test_default_system_prompt_and_generation_header(tok: Tokenizer) -> None:
    text = tok.render_chat([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}])[0] == tok.bos_id


def _tokenizer_dir(model_dir: Path, tmp_path: Path, tok_config: dict[str, Any], **extra: str) -> Path:
    """A directory holding the converted tokenizer.json with the given configs."""
    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    for name, text in extra.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_config_variants(model_dir: Path, tmp_path: Path) -> None:
    # AddedToken-style special tokens, a list of eos ids and a template in chat_template.jinja.
    d = _tokenizer_dir(
        model_dir,
        tmp_path,
        {"eos_token": {"content": "<|endoftext|>", "special": True}, "bos_token": None},
        **{
            "generation_config.json": json.dumps({"eos_token_id": [2, 0]}),
            "chat_template.jinja": "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{{ eos_token }}",
        },
    )
    tok = Tokenizer.from_dir(d)
    assert tok.eos_id == 0 and tok.bos_id is None
    assert tok.stop_ids == frozenset({0, 2})
    assert tok.render_chat([{"role": "user", "content": "a"}]) == "[a]<|endoftext|>"


def test_without_template_encodes_plainly(model_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_tokenizer_dir(model_dir, tmp_path, {}))
    assert not tok.has_chat_template and tok.stop_ids == frozenset()
    assert tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}]) == tok.encode(
        "What is 2+3?"
    )


def test_template_sandbox_and_raise_exception(model_dir: Path) -> None:
    backend = Backend.from_file(str(model_dir / "tokenizer.json"))
    strict = Tokenizer(
        backend,
        chat_template="{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok",
    )
    assert strict.render_chat([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(jinja2.exceptions.TemplateError, match="user first"):
        strict.render_chat([{"role": "assistant", "content": "x"}])
    # The sandbox is immutable: a template cannot modify the caller's messages.
    mutating = Tokenizer(backend, chat_template="{{ messages.append(1) }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        mutating.render_chat([{"role": "user", "content": "x"}])
    # tojson does not HTML-escape, as transformers' does not.
    js = Tokenizer(backend, chat_template="{{ messages[0] | tojson }}")
    assert js.render_chat([{"role": "user", "content": "<a&b>"}]) == '{"role": "user", "content": "<a&b>"}'


def _write(path: Path, *lines: Any) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_read_prompts(tok: Tokenizer, tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    path = _write(
        tmp_path / "prompts.jsonl",
        {"id": "q1", "prompt": "What is 2+3?", "answer": "5"},
        "",
        {"id": 7, "prompt_ids": [1, 4093, 198], "group_id": "q1", "metadata": {"task": "chain_sum"}},
        {"id": "q3", "messages": messages, "answer": 12},
    )
    specs = read_prompts(path, tok)
    assert [s.id for s in specs] == ["q1", "7", "q3"]
    assert specs[0] == PromptSpec(
        id="q1",
        prompt_ids=tuple(tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}])),
        text="What is 2+3?",
        answer="5",
        group_id="q1",
    )
    assert specs[1].prompt_ids == (1, 4093, 198) and specs[1].group_id == "q1" and specs[1].text is None
    assert specs[1].metadata == {"task": "chain_sum"}
    assert specs[2].prompt_ids == tuple(tok.apply_chat_template(messages)) and specs[2].answer == 12


def test_read_prompts_ids_only_needs_no_tokenizer(tmp_path: Path) -> None:
    path = _write(tmp_path / "p.jsonl", {"id": "a", "prompt_ids": [5, 6]})
    assert read_prompts(path)[0].prompt_ids == (5, 6)


def test_read_prompts_plain_text_without_template(model_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_tokenizer_dir(model_dir, tmp_path, {}))
    path = _write(tmp_path / "p.jsonl", {"id": "a", "prompt": "2+3="})
    assert read_prompts(path, tok)[0].prompt_ids == tuple(tok.encode("2+3="))


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"prompt": "x"}, "'id' must be"),
        ({"id": True, "prompt": "x"}, "'id' must be"),
        ({"id": "b"}, "need exactly one of"),
        ({"id": "b", "prompt": "x", "prompt_ids": [1]}, "need exactly one of"),
        ({"id": "b", "promt": "x"}, "unknown field"),
        ({"id": "b", "prompt": ""}, "'prompt' must be a non-empty string"),
        ({"id": "b", "prompt_ids": []}, "non-empty list of integers"),
        ({"id": "b", "prompt_ids": [1, "2"]}, r"prompt_ids\[1\] is '2', not an integer"),
        ({"id": "b", "prompt_ids": [1, True]}, "not an integer"),
        ({"id": "b", "prompt_ids": [49152]}, "outside the vocabulary"),
        ({"id": "b", "prompt_ids": [-1]}, "outside the vocabulary"),
        ({"id": "b", "messages": [{"content": "x"}]}, r"messages\[0\] must be an object"),
        ({"id": "b", "messages": [{"role": "user", "content": 3}]}, "chat template failed"),
        ({"id": "b", "prompt_ids": [1], "metadata": [1]}, "'metadata' must be a JSON object"),
        ({"id": "b", "prompt_ids": [1], "group_id": None}, "'group_id' must be"),
        ({"id": "a", "prompt_ids": [1]}, r"duplicate id 'a' \(first on line 1\)"),
    ],
)
def test_read_prompts_bad_line(tok: Tokenizer, tmp_path: Path, line: Any, problem: str) -> None:
    # The bad line is line 3: errors must name the file and that line.
    path = _write(tmp_path / "bad.jsonl", {"id": "a", "prompt": "fine"}, "", line)
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: .*{problem}"):
        read_prompts(path, tok)


def test_read_prompts_text_needs_a_tokenizer(tmp_path: Path) -> None:
    path = _write(tmp_path / "p.jsonl", {"id": "a", "prompt": "hi"})
    with pytest.raises(ValueError, match=r"p\.jsonl:1: 'prompt' needs a tokenizer"):
        read_prompts(path)


def test_read_prompts_empty_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "empty.jsonl", "", "  ")
    with pytest.raises(ValueError, match=r"empty\.jsonl: no prompts"):
        read_prompts(path)
