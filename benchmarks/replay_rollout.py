"""The stand-in rollout of `slipstream bench scale`: the rollout protocol answered from recorded text.

`ReplayRollout` takes a rollout's name and place (benchmarks/scale.py `ScaleRun` swaps it in), so the
coordinator cannot tell it from a real one: GenerateRequest in; IterationStats, Completion and Idle out,
each completion to the learner rank named in its request. Instead of a model, response i of a group is a
window of recorded token ids chosen by its seed, every other one ending in a tagged answer, all exactly
`tokens` long, sent as fast as the sockets take them. The non-obvious choice: each drain is recorded under
run_dir/scale/ (`RECORD_DIR`) with when its last completion left, which is where bench scale starts the
clock of "last completion to the learner holding every group".
"""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path
from typing import Annotated, Any

import msgspec
import torch

from slipstream.engine import hub
from slipstream.engine.sampling import sample_seed
from slipstream.engine.tokenizer import Tokenizer
from slipstream.protocols.control import Idle
from slipstream.protocols.rollout import Completion, GenerateRequest, IterationStats
from slipstream.runtime.actor import COORDINATOR, Actor, handler

__all__ = ["RECORD_DIR", "ReplayRollout"]

RECORD_DIR = "scale"  # run_dir/scale/rollout-R.jsonl: each stand-in's drains (step, last completion sent)
Positive = Annotated[int, msgspec.Meta(ge=1)]


class ReplayRollout(Actor):
    """A stand-in rollout: the real rollout protocol (GenerateRequest in; IterationStats, Completion, Idle
    out), with recorded tokens instead of a model, answered as fast as the sockets take them."""

    role = "rollout"  # it takes a rollout's name and place: the coordinator cannot tell them apart

    class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
        tokens: Positive  # every response's length (at most the request's max_tokens): each runs to the cap
        corpus: list[int]  # recorded token ids; response i of a group is a window of them chosen by its seed
        answer_ids: list[int] = []  # the tail of every even-numbered response (a tagged answer)
        max_batch: Positive = 1 << 30  # sequences decoded at once: a wave sends `tokens` IterationStats
        gather_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.05  # a wave waits this long for more requests
        model: str = ""  # whose tokenizer decodes each response's text, as a rollout does for its learner

    def on_start(self) -> None:
        self._queue: deque[tuple[GenerateRequest, int]] = deque()  # (request, sample index) to answer
        corpus = torch.tensor(self.config.corpus, dtype=torch.int64)
        self._corpus = corpus.repeat(-(-2 * self.config.tokens // corpus.numel()))  # any window fits twice
        self._last_request = 0.0
        self._iteration = 0
        self._idle_sent = True  # nothing to report until work arrives
        self._wave: dict[str, Any] = {}  # this drain's record: step, completions, iterations, last_sent
        self._record = Path(self.run_dir or ".") / RECORD_DIR / f"rollout-{self.rank}.jsonl"
        self._record.parent.mkdir(parents=True, exist_ok=True)
        self._tokenizer = Tokenizer.from_dir(hub.resolve(self.config.model)) if self.config.model else None

    @handler
    def on_generate(self, msg: GenerateRequest, sender: str) -> None:
        indices = msg.sample_indices or range(msg.num_samples)
        self._queue.extend((msg, i) for i in indices)
        self._last_request = time.monotonic()
        self._idle_sent = False

    def step(self) -> bool:
        cfg = self.config
        if not self._queue:
            if not self._idle_sent:  # drained: say when its last completion left, then Idle (as a rollout)
                self._idle_sent = True
                with self._record.open("a") as out:
                    out.write(json.dumps(self._wave) + "\n")
                self._wave = {}
                self.send(COORDINATOR, Idle(role=self.role, rank=self.rank, policy_version=0))
            return False
        if len(self._queue) < cfg.max_batch and time.monotonic() - self._last_request < cfg.gather_s:
            time.sleep(0.002)  # the deal is still arriving: a real rollout would batch it too
            return True
        wave = [self._queue.popleft() for _ in range(min(cfg.max_batch, len(self._queue)))]
        # One decode iteration a token: every response of the wave runs to the cap.
        for _ in range(cfg.tokens):
            self.send(COORDINATOR, IterationStats(
                rank=self.rank, iteration=self._iteration, batch_size=len(wave), arm="off", drafted=0,
                accepted=0, committed=len(wave), iter_s=0.0,
            ))  # fmt: skip
            self._iteration += 1
        for request, index in wave:  # as a rollout sends them: to the group's learner rank, else the head
            self.send(request.learn_at or COORDINATOR, self._completion(request, index))
        record = self._wave
        record["step"] = wave[-1][0].policy_version  # the loop's requests carry their step there
        record["completions"] = record.get("completions", 0) + len(wave)
        record["iterations"] = record.get("iterations", 0) + cfg.tokens
        record["last_sent"] = time.monotonic()
        return True

    def _completion(self, request: GenerateRequest, index: int) -> Completion:
        cfg = self.config
        length = min(cfg.tokens, request.sampling.max_tokens)
        gen = torch.Generator().manual_seed(sample_seed(request.seed, index))
        start = int(torch.randint(0, self._corpus.numel() - length + 1, (1,), generator=gen))
        ids = self._corpus[start : start + length].clone()  # a window of the recorded text
        if index % 2 == 0 and cfg.answer_ids and length >= len(cfg.answer_ids):
            ids[-len(cfg.answer_ids) :] = torch.tensor(cfg.answer_ids, dtype=torch.int64)
        logprobs = -torch.rand(length, generator=gen) * 4.0  # float32, what a sampler reports
        decode = request.learn_at and self._tokenizer is not None
        return Completion(
            group_id=request.group_id, sample_index=index, token_ids=ids, logprobs=logprobs,
            finish_reason="length", policy_version=request.policy_version,
            text=self._tokenizer.decode(ids.tolist(), skip_special_tokens=True) if decode else "",
        )  # fmt: skip
