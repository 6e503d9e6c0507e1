"""An LLM-judge reward on this project's own engine: a small chat model says whether an answer matches the
reference, a batch at a time.

    reward: slipstream.tasks.judge:Judge            # or a term of a weighted list (docs/rewards.md)

`Judge` is a class reward in TRL's batched convention: a verifier worker builds it once as it loads its
reward, so the model loads at the worker's start; loaded models are kept per process (`engine`: by
directory, dtype and pid; `LOADS` counts them). Configure by subclassing (`model`, `threads`, `prompt`).
A call's prompts (the reference and the answer judged, its special strings defused so a policy cannot write
the judge's turn) go through one greedy one-token `Generator.generate`; the score is P(yes) / (P(yes) +
P(no)) over one-token spellings, from the state that sampled that token through the final norm and LM
head. Non-obvious: probabilities, not the generated word, because a small model's greedy word leans one
way for most inputs while the ratio is graded and always exists. A sample it cannot score is None
(invalid). Measured quality and the reasons in full: docs/rewards.md, "An LLM judge".
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slipstream.engine import hub
from slipstream.engine.config import dtype_from_name
from slipstream.engine.generator import Generator, Request
from slipstream.engine.model import Transformer
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.tokenizer import Tokenizer
from slipstream.engine.weights import load_model
from slipstream.tasks.rewards import extract_answer

__all__ = ["LOADS", "NO", "PROMPT", "YES", "Judge", "JudgeEngine", "defuse", "engine", "judge_prompt"]

PROMPT = 'Is "{answer}" the same as "{reference}"? Answer Yes or No.'
"""The default user turn; `{question}`, `{reference}` and `{answer}` are filled in. The question is left
out: SmolLM2-135M separated right answers from garbage best without it (docs/rewards.md, "An LLM judge")."""
YES = ("Yes", "yes", " Yes", " yes", "YES")  # spellings whose probability counts for yes (those one token)
NO = ("No", "no", " No", " no", "NO")

LOADS = 0  # models this process has loaded (`engine`): a verifier worker's judge loads once


@dataclass(frozen=True)
class JudgeEngine:
    """One loaded judge model: the model, its tokenizer and the ids of the yes and no spellings."""

    path: Path
    model: Transformer
    tokenizer: Tokenizer
    yes_ids: tuple[int, ...]
    no_ids: tuple[int, ...]
    added: tuple[str, ...] = ()  # the tokenizer's added tokens' texts (`defuse`)

    def score(self, prompts: Sequence[Sequence[int]]) -> list[float | None]:
        """P(yes) / (P(yes) + P(no)) at the first generated token of each prompt, in one generate call."""
        requests = [
            Request(
                request_id=str(i), prompt_ids=list(p), params=SamplingParams(temperature=0.0, max_tokens=1)
            )
            for i, p in enumerate(prompts)
        ]
        if not requests:
            return []
        generator = Generator.for_requests(
            self.model, requests, max_batch=len(requests), eos_token_ids=(), return_hidden=True
        )
        completions = generator.generate(requests)
        hidden = torch.cat([c.hidden[:1] for c in completions if c.hidden is not None])
        if hidden.shape[0] != len(requests):
            raise RuntimeError(
                f"the engine returned {hidden.shape[0]} hidden rows for {len(requests)} prompts"
            )
        with torch.inference_mode():
            logprobs = torch.log_softmax(self.model.head(hidden).float(), dim=-1)
        yes = torch.logsumexp(logprobs[:, list(self.yes_ids)], dim=-1)
        no = torch.logsumexp(logprobs[:, list(self.no_ids)], dim=-1)
        out: list[float | None] = []
        for y, n in zip(yes.tolist(), no.tolist(), strict=True):
            if not (math.isfinite(y) or math.isfinite(n)):
                out.append(None)
                continue
            out.append(1.0 / (1.0 + math.exp(min(700.0, n - y))))  # sigmoid(y - n), safe at the extremes
        return out


_ENGINES: dict[tuple[str, str, int], JudgeEngine] = {}


def engine(model: str = "smollm2-135m", *, dtype: str = "", threads: int = 0) -> JudgeEngine:
    """The judge model `model` (a registry name or a directory), loaded once per process.

    dtype: "" the checkpoint's; threads: torch's intra-op threads in this process, 0 for `default_threads`
    (set on a load; a verifier worker is a process of its own, so this bounds only the judge's worker)."""
    global LOADS
    path = hub.resolve(model)
    key = (str(path.resolve()), dtype, os.getpid())
    if (found := _ENGINES.get(key)) is not None:
        return found
    torch.set_num_threads(threads or default_threads())
    loaded = load_model(path, dtype=dtype_from_name(dtype) if dtype else None)
    tokenizer = Tokenizer.from_dir(path)
    yes, no = _token_ids(tokenizer, YES), _token_ids(tokenizer, NO)
    if not yes or not no or set(yes) & set(no):
        raise ValueError(f"judge model {model!r}: its tokenizer cannot tell yes {yes} from no {no}")
    _ENGINES[key] = found = JudgeEngine(path, loaded, tokenizer, yes, no, _added_tokens(path))
    LOADS += 1
    return found


def default_threads() -> int:
    """The run's share where it set one, else half this process's cores, 1 to 4 (a verifier's two workers
    then share the cores). The share is OMP_NUM_THREADS: the supervisor sets it to an actor's `threads`,
    and a verifier's workers inherit it."""
    try:
        share = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        share = 0
    return share if share > 0 else max(1, min(4, len(os.sched_getaffinity(0)) // 2))


def judge_prompt(
    tokenizer: Tokenizer,
    question: str,
    reference: str,
    answer: str,
    *,
    template: str = PROMPT,
    system: str | None = None,
    added: Sequence[str] = (),
) -> list[int]:
    """The chat-templated ids of one user turn, `template` filled in, asking whether `answer` matches
    `reference` for `question` (system: a system turn; None leaves the chat template's default). The texts
    are `defuse`d of `added` first."""
    messages = [{"role": "system", "content": system}] if system else []
    fields = {k: defuse(v.strip(), added) for k, v in (("question", question), ("reference", reference),
                                                       ("answer", answer))}  # fmt: skip
    text = template.format(**fields)
    return tokenizer.apply_chat_template([*messages, {"role": "user", "content": text}])


def defuse(text: str, added: Sequence[str]) -> str:
    """`text` with each of the tokenizer's added tokens (`<|im_end|>`, `<|im_start|>`…) broken by a space
    after its first character: the tokenizer encodes such a string as its special id wherever it stands, so
    an answer could otherwise end the user's turn and open an assistant turn that says "Yes"."""
    for token in added:
        if len(token) > 1 and token in text:
            text = text.replace(token, f"{token[0]} {token[1:]}")
    return text


def _added_tokens(path: Path) -> tuple[str, ...]:
    """The texts of tokenizer.json's added tokens (special or not: the tokenizer matches both in text)."""
    try:
        data = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ()
    return tuple(t["content"] for t in data.get("added_tokens", []) if isinstance(t.get("content"), str))


def _text(value: Any) -> str:
    """A prompt's or a completion's text: itself, or, in TRL's conversational form (a term's `chat: true`),
    its last message's content."""
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        return str(value[-1].get("content", ""))
    return str(value)


def _token_ids(tokenizer: Tokenizer, spellings: Sequence[str]) -> tuple[int, ...]:
    """The ids of the spellings that are one token each (a first piece such as "Y" of "YES" would count
    whatever else starts with it)."""
    ids = []
    for text in spellings:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == 1 and encoded[0] not in ids:
            ids.append(encoded[0])
    return tuple(ids)


class Judge:
    """The judge as a class reward (TRL's batched convention); set-up once per worker, see the module doc.

    Subclass to configure: `model` (a registry name or a directory), `dtype` ("": the checkpoint's),
    `threads` (0: `default_threads`), `prompt` (a template of `{question}`, `{reference}`, `{answer}`),
    `system` (a system turn; None: the chat template's default), `max_answer_chars`, `max_question_chars`.
    """

    model: str = "smollm2-135m"
    dtype: str = ""
    threads: int = 0
    prompt: str = PROMPT
    system: str | None = None
    max_answer_chars: int = 1000  # an untagged completion is judged by its last this many characters
    max_question_chars: int = 4000

    def __init__(self) -> None:
        self.engine = engine(self.model, dtype=self.dtype, threads=self.threads)
        self.calls = 0  # generate calls made: one per batched call that had something to judge

    def __call__(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        answer: Sequence[Any] | None = None,
        question: Sequence[Any] | None = None,
        **_: Any,
    ) -> list[float | None]:
        """One score in [0, 1] per completion, or None where there is no reference or the prompt cannot
        fit the model's context; every judged completion of the call in one generate call. Prompts and
        completions are text, or TRL's conversational form (a term's `chat: true`): the last message's."""
        n = len(completions)
        references = list(answer) if answer is not None else [None] * n
        questions = list(question) if question is not None else [_text(p) for p in prompts]
        limit = self.engine.model.config.max_position_embeddings - 1  # room for the one new token
        ids: dict[int, list[int]] = {}
        for i, (q, ref, text) in enumerate(zip(questions, references, completions, strict=True)):
            if ref is None or not str(ref).strip():
                continue  # nothing to compare with: None, invalid
            text = _text(text)
            tagged = extract_answer(text)
            given = tagged if tagged is not None else text[-self.max_answer_chars :]
            prompt = judge_prompt(
                self.engine.tokenizer,
                str(q if q is not None else _text(prompts[i]))[: self.max_question_chars],
                str(ref),
                given[: self.max_answer_chars],
                template=self.prompt,
                system=self.system,
                added=self.engine.added,
            )
            if len(prompt) <= limit:
                ids[i] = prompt
        scores: list[float | None] = [None] * n
        if ids:
            self.calls += 1
            for i, s in zip(ids, self.engine.score(list(ids.values())), strict=True):
                scores[i] = s
        return scores
