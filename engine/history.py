"""The run's own history: earlier steps' responses to each prompt, kept to draft from (issue 52).

RL trains for many epochs over one prompt set, and a policy's answers to a prompt change slowly from one
epoch to the next, so the continuation of a response's last tokens in an earlier response to the same
prompt is a draft that costs a lookup (RhymeRL's HistoSpec, DAS). `History` keeps, per prompt (a hash of
its token ids, `prompt_key`), the responses of earlier steps with the policy version that sampled them, one
after another in an int array, and hash chains over their n-grams (zlib's: the newest position after each
n-gram's hash, and per position the one before it), ~80 bytes a token where a dict of n-gram tuples cost
~900: `SuffixDrafter` (engine/drafters/suffix.py) walks a chain newest first and extends each occurrence
backwards. A response is stored after the last `tail` tokens of its prompt, so its first tokens have a
context to match.

Bounded: `per_prompt` responses a prompt (its oldest out first) and `max_tokens` in all (the oldest
anywhere out first). Non-obvious: `visible(before=v)` hides what version v or later sampled, so a step
drafts from earlier steps only (its own siblings are the group's), and a restarted rollout or a resumed run
sees what the uninterrupted one saw. `open_journal` keeps it in a file, a msgspec record appended per
response (never a pickle), so a killed rollout's successor replays it; `compact` rewrites it.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from array import array
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import msgspec

__all__ = ["History", "HistoryConfig", "JournalRecord", "prompt_key", "read_journal"]


class HistoryConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """How much history a rollout keeps and how it drafts from it (the "history" and "cascade" arms)."""

    per_prompt: int = 32  # responses kept a prompt, the oldest out first (8 epochs of a group of 4)
    max_tokens: int = 4_000_000  # tokens kept in all, the oldest anywhere out first (~80 B a token: 320 MB)
    n: int = 2  # a match starts from the last n tokens, then is measured backwards up to `max_extend`
    tail: int = 8  # the prompt's last tokens kept before each response (its first tokens' context)
    max_extend: int = 64
    growth: float = 1.0  # draft tokens per matched token (DAS), at least 1, at most the arm's depth
    head_depth: int = 3  # the cascade's EAGLE chain where nothing matches (its 4th+ tokens rarely pay)
    head_below: int = 5  # the cascade drafts from a match this long or longer, else from the head

    def __post_init__(self) -> None:
        for name, least in (("per_prompt", 1), ("max_tokens", 1), ("n", 1), ("tail", 0), ("head_depth", 1),
                            ("head_below", 1)):  # fmt: skip
            if getattr(self, name) < least:
                raise ValueError(f"history.{name} must be >= {least}, got {getattr(self, name)}")
        if self.max_extend < self.n:
            raise ValueError(f"history.max_extend must be >= n ({self.n}), got {self.max_extend}")
        if not self.growth > 0:
            raise ValueError(f"history.growth must be > 0, got {self.growth}")

    def build(self) -> History:
        return History(per_prompt=self.per_prompt, max_tokens=self.max_tokens, n=self.n, tail=self.tail)


def prompt_key(prompt_ids: Sequence[int]) -> str:
    """A prompt's identity across steps: a hash of its token ids (the same prompt, the same key)."""
    return hashlib.blake2b(array("q", [int(t) for t in prompt_ids]).tobytes(), digest_size=8).hexdigest()


@dataclass
class _Doc:
    version: int  # the policy version (step) that sampled it
    size: int  # its tokens: the prompt's last `tail` tokens, then the response (held in its prompt's `text`)
    start: int  # where the response begins among them
    at: int = 0  # where they begin in the prompt's `text`


@dataclass
class _Prompt:
    """A prompt's responses one after another in `text`, and hash chains over their n-grams: `head` maps an
    n-gram's hash to the newest position right after it, `prev` each position to the one before with the
    same hash (-1: none). An evicted response stays in `text` until the dead outweigh the live (re-packed)."""

    docs: dict[int, _Doc] = field(default_factory=dict)  # doc id -> doc, oldest first
    text: array = field(default_factory=lambda: array("i"))
    prev: array = field(default_factory=lambda: array("q"))
    head: dict[int, int] = field(default_factory=dict)
    starts: list[int] = field(default_factory=list)  # each doc's `at`, in `text` order (bisect: whose is p)
    ids: list[int] = field(default_factory=list)  # the doc id at each of `starts`
    dead: int = 0  # tokens of evicted docs still in `text`


class History:
    """Earlier steps' responses per prompt, with hash chains over their n-grams; see the module docstring."""

    def __init__(
        self, *, per_prompt: int = 64, max_tokens: int = 4_000_000, n: int = 2, tail: int = 8
    ) -> None:
        for name, value, least in (("per_prompt", per_prompt, 1), ("max_tokens", max_tokens, 1), ("n", n, 1),
                                   ("tail", tail, 0)):  # fmt: skip
            if value < least:
                raise ValueError(f"History.{name} must be >= {least}, got {value}")
        self.per_prompt, self.max_tokens, self.n, self.tail = per_prompt, max_tokens, n, tail
        self._prompts: dict[str, _Prompt] = {}
        self._order: deque[tuple[int, str]] = deque()  # (doc id, key), oldest first
        self._next_id = 0
        self.tokens = 0  # tokens held, prompt tails included
        self.evicted = 0  # responses dropped to stay within the bounds
        self._journal_path: Path | None = None  # `open_journal`: where every response is appended
        self._journal: BinaryIO | None = None

    def __len__(self) -> int:
        return sum(len(p.docs) for p in self._prompts.values())

    def __contains__(self, key: str) -> bool:
        return key in self._prompts

    def add(self, key: str, version: int, prompt_ids: Sequence[int], response: Sequence[int]) -> None:
        """Keeps `response` to the prompt `key` (its ids `prompt_ids`), sampled by policy `version`."""
        if not response:
            return
        tail = [int(t) for t in prompt_ids[max(0, len(prompt_ids) - self.tail) :]] if self.tail else []
        self._add(key, version, len(tail), tail + [int(t) for t in response])

    def _add(self, key: str, version: int, start: int, tokens: list[int]) -> None:
        prompt = self._prompts.setdefault(key, _Prompt())
        doc_id = self._next_id
        self._next_id += 1
        prompt.docs[doc_id] = doc = _Doc(version, len(tokens), start)
        if self._journal is not None:
            self._journal.write(_framed(key, doc, tokens))
            self._journal.flush()  # in the page cache: a killed process loses nothing of it
        self._order.append((doc_id, key))
        self.tokens += len(tokens)
        self._index(prompt, doc_id, doc, tokens)
        while len(prompt.docs) > self.per_prompt:
            self._evict(key, next(iter(prompt.docs)))
        while self.tokens > self.max_tokens and self._order:
            old_id, old_key = self._order[0]
            self._evict(old_key, old_id)

    def _index(self, prompt: _Prompt, doc_id: int, doc: _Doc, tokens: Sequence[int]) -> None:
        """Appends `doc` (its `tokens`) to the prompt's text and links each of its n-grams into the chains."""
        n, at = self.n, len(prompt.text)
        doc.at = at
        prompt.starts.append(at)
        prompt.ids.append(doc_id)
        prompt.text.extend(tokens)
        prompt.prev.extend([-1] * len(tokens))
        head = prompt.head
        for i in range(n, len(tokens)):
            h = hash(tuple(tokens[i - n : i]))
            prompt.prev[at + i] = head.get(h, -1)
            head[h] = at + i

    def _evict(self, key: str, doc_id: int) -> None:
        prompt = self._prompts[key]
        doc = prompt.docs.pop(doc_id, None)
        if doc is None:
            return
        self.tokens -= doc.size
        self.evicted += 1
        prompt.dead += doc.size
        if not prompt.docs:
            del self._prompts[key]
        elif prompt.dead > len(prompt.text) - prompt.dead:
            self._repack(prompt)
        while self._order and self._doc(*self._order[0]) is None:
            self._order.popleft()  # evicted per prompt earlier: gone from the global order too

    def _repack(self, prompt: _Prompt) -> None:
        """The prompt's live docs indexed afresh, the evicted ones' tokens and chain links gone."""
        old = prompt.text
        prompt.text, prompt.prev, prompt.head = array("i"), array("q"), {}
        prompt.starts, prompt.ids, prompt.dead = [], [], 0
        for doc_id, doc in prompt.docs.items():
            self._index(prompt, doc_id, doc, old[doc.at : doc.at + doc.size])

    def _doc(self, doc_id: int, key: str) -> _Doc | None:
        prompt = self._prompts.get(key)
        return None if prompt is None else prompt.docs.get(doc_id)

    def _kept(self) -> list[tuple[str, int, _Doc]]:
        """(key, doc id, doc) of every kept response, oldest first."""
        return [(key, i, doc) for i, key in self._order if (doc := self._doc(i, key)) is not None]

    def _tokens(self, key: str, doc: _Doc) -> list[int]:
        return self._prompts[key].text[doc.at : doc.at + doc.size].tolist()

    def occurrences(
        self, key: str, gram: Sequence[int], before: int
    ) -> Iterator[tuple[array, int, int, int]]:
        """Where `gram` (n tokens) occurs in the prompt's responses sampled before version `before`, newest
        first: (the prompt's text, the position right after it, its response's first and end positions)."""
        prompt = self._prompts.get(key)
        if prompt is None or len(gram) != self.n:
            return
        want = array("i", gram)
        text, prev, starts, ids, docs = prompt.text, prompt.prev, prompt.starts, prompt.ids, prompt.docs
        pos = prompt.head.get(hash(tuple(gram)), -1)
        while pos >= 0:
            k = bisect.bisect_right(starts, pos) - 1
            doc = docs.get(ids[k])
            if doc is not None and doc.version < before and text[pos - self.n : pos] == want:
                yield text, pos, doc.at, doc.at + doc.size
            pos = prev[pos]

    def responses(self, key: str, before: int | None = None) -> list[list[int]]:
        """The prompt's kept responses (prompt tails stripped), oldest first; `before`: versions below it."""
        prompt = self._prompts.get(key)
        if prompt is None:
            return []
        return [prompt.text[d.at + d.start : d.at + d.size].tolist() for d in prompt.docs.values()
                if before is None or d.version < before]  # fmt: skip

    def visible(self, key: str, before: int) -> int:
        """How many of the prompt's responses a step at version `before` drafts from."""
        prompt = self._prompts.get(key)
        return 0 if prompt is None else sum(d.version < before for d in prompt.docs.values())

    def drop_from(self, version: int) -> int:
        """Forgets every response sampled at `version` or later (a resumed run redoes those steps); returns
        how many."""
        gone = [(key, i) for key, i, doc in self._kept() if doc.version >= version]
        for key, doc_id in gone:
            self._evict(key, doc_id)
        self.evicted -= len(gone)
        if gone:
            self.compact()
        return len(gone)

    def stats(self) -> dict[str, int]:
        """Prompts, responses and tokens held, n-grams indexed, and responses evicted so far."""
        grams = sum(len(p.head) for p in self._prompts.values())
        return {"prompts": len(self._prompts), "responses": len(self), "tokens": self.tokens,
                "ngrams": grams, "evicted": self.evicted}  # fmt: skip

    # -- the journal ------------------------------------------------------------------------------------

    def open_journal(self, path: Path) -> tuple[int, int]:
        """Replays the responses a journal at `path` holds (none if it is missing), then appends every later
        `add` to it. Returns (responses replayed, bytes dropped): a record cut short by a kill, or one that
        does not decode, ends the replay, and the file is rewritten without it."""
        records, dropped = read_journal(path)
        for record in records:
            self._add(record.key, record.version, record.start, list(record.tokens))
        self._journal_path = path
        self.compact()
        return len(records), dropped

    def entries(self) -> list[tuple[str, int, list[int]]]:
        """Every kept response as (prompt key, version, response tokens), oldest first."""
        return [(key, doc.version, self._tokens(key, doc)[doc.start :]) for key, _, doc in self._kept()]

    def compact(self) -> None:
        """Rewrites the journal with the responses kept now (atomically), dropping the evicted ones."""
        path = self._journal_path
        if path is None:
            return
        if self._journal is not None:
            self._journal.close()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with tmp.open("wb") as f:
            for key, _, doc in self._kept():
                f.write(_framed(key, doc, self._tokens(key, doc)))
        os.replace(tmp, path)
        self._journal = path.open("ab")

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None


def read_journal(path: Path) -> tuple[list[JournalRecord], int]:
    """The records of the journal at `path` (none if it is missing) and the bytes after the last whole one
    that decodes (a record cut short by a kill, or garbage), which a replay drops."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], 0
    records: list[JournalRecord] = []
    decoder = msgspec.msgpack.Decoder(JournalRecord)
    at = 0
    while at + 4 <= len(data):
        size = int.from_bytes(data[at : at + 4], "little")
        if at + 4 + size > len(data):
            break
        try:
            records.append(decoder.decode(data[at + 4 : at + 4 + size]))
        except msgspec.DecodeError:
            break
        at += 4 + size
    return records, len(data) - at


class JournalRecord(msgspec.Struct, array_like=True, frozen=True):
    """One response in a journal: its prompt, the version that sampled it, where it starts, its tokens."""

    key: str
    version: int
    start: int
    tokens: list[int]


def _framed(key: str, doc: _Doc, tokens: list[int]) -> bytes:
    body = msgspec.msgpack.encode(JournalRecord(key, doc.version, doc.start, tokens))
    return len(body).to_bytes(4, "little") + body
