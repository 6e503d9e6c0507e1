"""The rollout's loop over turns (issue 42): multi-turn episodes on one `Generator`, without sockets.

Per sample: the environment's opening is rendered by the chat template into the prompt; the policy decodes
until its turn ends — a stop sequence of the episode (found in the turn's text, the turn cut at the token
that completes it), a stop id (`Request.pause_on_stop`: the engine pauses there) or `max_turn_tokens` — and
the request is paused (`Generator.pause`: slot and K/V kept) while the environment answers; the batch goes
on decoding the others meanwhile. The answer is rendered as a chat message and only the *delta* the
template adds (the assistant turn's close, the message, the next assistant header) is tokenized and
appended (`resume`: prefilled on the same cache, masked out of training, log-prob 0), so the policy's own
tokens are never re-tokenized. Done, `max_turns` or the request's `max_tokens` (every token after the
opening) end the episode (`finish`). Cutting a speculative step's tokens at the turn's end keeps the
output what plain decoding gives; drafters read the live history, observations included.
Each turn's environment wait (the turn's end to its answer, an error, a loss or a timeout; the opening
not counted) is timed on an injected clock, reported to `on_wait` and summed per sample across replays.
The messages and the deadlines are the rollout actor's (actors/rollout.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec
import torch
from torch import Tensor

from slipstream.engine.generator import Completion, Generator, Request, StepOutput
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.tokenizer import Tokenizer

__all__ = ["EpisodeLimits", "Episodes", "Finished", "TurnEnd", "WaitHook", "policy_windows"]

# on_wait(start_ns, dur_ns, episode=…, turn=…, outcome=…): one turn's wait for its environment, as it ends
WaitHook = Callable[..., None]

_SENTINEL = "\u2063turn\u2063"  # stands for the assistant's turn when the template's delta is rendered


class EpisodeLimits(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Caps of one multi-turn episode (a run config's `environment` section sets them)."""

    max_turns: Annotated[int, msgspec.Meta(ge=1)] = 8  # policy turns; past it the episode ends unscored
    max_turn_tokens: Annotated[int, msgspec.Meta(ge=1)] = 256  # one policy turn's tokens
    # How long the rollout waits for an answer: the environment's own deadline plus slack for the wire. Past
    # it the environment is taken as lost (the sample invalid).
    turn_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 35.0
    max_replays: Annotated[int, msgspec.Meta(ge=0)] = 3  # replays of one sample after environment restarts


@dataclass(frozen=True, kw_only=True)
class TurnEnd:
    """A policy turn that ended: send it to the environment."""

    request_id: str
    episode_id: str
    turn: int
    text: str
    token_ids: list[int]


@dataclass(frozen=True, kw_only=True)
class Finished:
    """An episode that ended: its engine completion (None when it failed before any), turns, the
    environment's reward (None: the run's reward scores the transcript) or why the sample is invalid."""

    request_id: str
    episode_id: str
    completion: Completion | None
    prompt_ids: list[int]
    turns: int
    reward: float | None = None
    error: str | None = None
    env_wait_s: float = 0.0  # waiting for the environment's answers, every turn and replay of the sample

    def counts(self) -> dict[str, float | int]:
        """What the sample's `Completion` carries of its turns: `turns` and `env_wait_s`."""
        return {"turns": self.turns, "env_wait_s": self.env_wait_s}


@dataclass
class _Episode:
    request_id: str
    params: SamplingParams
    group_id: str | None
    row_json: str  # what the environment opens it from (again, on a replay)
    attempt: int = 0  # replays so far: an episode id names its attempt, so a stale answer is told apart
    incarnation: str = ""  # the environment process that opened it
    state: Literal["opening", "decoding", "waiting"] = "opening"
    messages: list[dict[str, str]] = field(default_factory=list)
    stop_sequences: tuple[str, ...] = ()
    prompt_ids: list[int] = field(default_factory=list)
    turn_start: int = 0  # tokens after the prompt when the current turn began
    scanned: int = 0  # tokens of the current turn already searched for a stop sequence (none found)
    turns: int = 0
    since: float = field(default_factory=time.monotonic)  # when it began waiting for the environment
    sent_ns: int | None = None  # the injected clock's reading when the turn waiting for its answer was sent
    wait_ns: int = 0  # waits of its turns so far (its earlier attempts' included)


class Episodes:
    """The live episodes of one generator; see the module docstring."""

    def __init__(
        self, generator: Generator, tokenizer: Tokenizer, limits: EpisodeLimits, owner: str,
        *, on_wait: WaitHook | None = None, clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:  # fmt: skip
        """owner: names this rollout in episode ids (unique across the run's rollouts); on_wait: told each
        turn's environment wait (a span); clock: nanoseconds, monotonic (a test's fake)."""
        self.generator, self.tokenizer, self.limits, self.owner = generator, tokenizer, limits, owner
        self.on_wait, self.clock = on_wait, clock
        self.live: dict[str, _Episode] = {}
        self._eos_text = {tokenizer.decode([i], skip_special_tokens=False) for i in generator.eos_token_ids}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.live

    @property
    def waiting(self) -> int:
        """Episodes waiting for their environment (opening or answer): nothing to decode for them now."""
        return sum(ep.state != "decoding" for ep in self.live.values())

    def begin(self, request_id: str, params: SamplingParams, group_id: str | None, row_json: str) -> str:
        """A sample's episode, waiting for its opening; its episode id."""
        if request_id in self.live:
            raise ValueError(f"episode {request_id!r} is live already")
        self.live[request_id] = _Episode(request_id, params, group_id, row_json)
        return self.episode_id(request_id)

    def episode_id(self, request_id: str) -> str:
        return f"{self.owner}/{request_id}/{self.live[request_id].attempt}"

    def row_json(self, request_id: str) -> str:
        return self.live[request_id].row_json

    def current(self, episode_id: str) -> str | None:
        """The live request an environment's message is for; None if stale (an earlier attempt's, or ended)."""
        parts = episode_id.split("/")
        live = len(parts) == 3 and parts[1] in self.live
        return parts[1] if live and self.episode_id(parts[1]) == episode_id else None

    def opened(
        self, request_id: str, messages: Sequence[dict[str, str]], stops: Sequence[str], incarnation: str = ""
    ) -> None:
        """The opening arrived: its rendered prompt joins the batch (ValueError if the engine refuses it)."""
        ep = self.live[request_id]
        ep.incarnation = incarnation
        ep.messages, ep.stop_sequences = [dict(m) for m in messages], tuple(stops)
        ep.prompt_ids = self.tokenizer.apply_chat_template(ep.messages)
        request = Request(
            request_id=request_id, prompt_ids=ep.prompt_ids, params=ep.params, group_id=ep.group_id,
            pause_on_stop=True,
        )  # fmt: skip
        self.generator.add(request)
        ep.state = "decoding"

    def turn_ends(self, outputs: Sequence[StepOutput]) -> list[TurnEnd | Finished]:
        """The turns that ended in this iteration's `outputs`; each such request is paused at its turn's end
        (tokens a speculative step emitted past it dropped). An episode whose budget ran out (`max_tokens`,
        `max_len`) inside a turn that had not ended is finished (unscored by its environment, as
        `finished`): where the turn's end came first, even in the same speculative step, the turn goes to
        the environment, as in plain decoding."""
        ends: list[TurnEnd | Finished] = []
        for out in outputs:
            ep = self.live.get(out.request_id)
            if ep is None or out.completion is not None or ep.state != "decoding":
                continue
            seq = self.generator.scheduler.get(out.request_id)
            turn = seq.tokens[seq.num_prompt + ep.turn_start :]
            cuts = [self._stop_at(turn, ep.stop_sequences, ep.scanned)]
            ep.scanned = len(turn)
            if len(turn) >= self.limits.max_turn_tokens:
                cuts.append(self.limits.max_turn_tokens)
            cut = min((c for c in cuts if c is not None), default=None)
            if cut is None and not out.paused:
                continue
            if cut is None and out.finish_reason == "length":
                ends.append(self.finished(self.generator.finish(out.request_id, "length")))
                continue
            if cut is not None and cut < len(turn):
                self.generator.pause(out.request_id, keep=ep.turn_start + cut)
                turn = turn[:cut]
            elif not out.paused:
                self.generator.pause(out.request_id)
            ep.state, ep.since, ep.sent_ns = "waiting", time.monotonic(), self.clock()
            text = self.tokenizer.decode(turn, skip_special_tokens=True)
            end = TurnEnd(request_id=out.request_id, episode_id=self.episode_id(out.request_id), turn=ep.turns,
                          text=text, token_ids=list(turn))  # fmt: skip
            ends.append(end)
            ep.turns += 1
            ep.messages.append({"role": "assistant", "content": text})
        return ends

    def _stop_at(self, turn: list[int], stops: tuple[str, ...], scanned: int = 0) -> int | None:
        """The fewest tokens of `turn` whose text holds a stop sequence, or None. The first `scanned` tokens
        held none, so only a window reaching back from them by the longest stop's length (a C-character
        stop spans at most C tokens; 4 more for tokens that decode to part of a character) is decoded:
        a step costs the new tokens, not the whole turn again."""
        if not stops:
            return None
        start = max(0, scanned - max(map(len, stops)) - 4)
        if not any(s in self.tokenizer.decode(turn[start:]) for s in stops):
            return None
        for k in range(max(start + 1, scanned), len(turn) + 1):
            text = self.tokenizer.decode(turn[start:k])
            if any(s in text for s in stops):
                return k
        return None  # unreachable: the window holds one

    def answer(
        self, request_id: str, text: str, role: str, done: bool, reward: float | None
    ) -> Finished | None:
        """The environment's answer to the waiting turn: the episode ends (done, `max_turns`, no room for the
        answer within `max_tokens`) or the rendered answer is appended and decoding goes on."""
        ep = self.live[request_id]
        self._stop_waiting(ep, "answered")
        if done:
            return self._end(ep, "stop", reward)
        if ep.turns >= self.limits.max_turns:
            return self._end(ep, "length", None)
        seq = self.generator.scheduler.get(request_id)
        tokens = self._delta(ep, text, role, ended_at_stop_id=seq.tokens[-1] in seq.stop_ids)
        room = min(ep.params.max_tokens - seq.num_generated, self.generator.cache.max_len - len(seq.tokens))
        if len(tokens) + 1 >= room:  # no token of the next turn would fit
            return self._end(ep, "length", None)
        self.generator.resume(request_id, tokens)
        ep.messages.append({"role": role, "content": text})
        ep.turn_start, ep.scanned, ep.state = seq.num_generated, 0, "decoding"
        return None

    def _stop_waiting(self, ep: _Episode, outcome: str) -> None:
        """The waiting turn's wait ends (answered, failed, lost): summed into the sample's, told to on_wait."""
        if (sent := ep.sent_ns) is None:
            return  # decoding, or waiting for its opening (not a turn)
        now, ep.sent_ns = self.clock(), None
        ep.wait_ns += now - sent
        if self.on_wait is not None:
            episode = f"{self.owner}/{ep.request_id}/{ep.attempt}"
            self.on_wait(sent, now - sent, episode=episode, turn=ep.turns - 1, outcome=outcome)

    def _delta(self, ep: _Episode, text: str, role: str, *, ended_at_stop_id: bool) -> list[int]:
        """The tokens the chat template adds after the policy's turn: its close (less the stop id the policy
        emitted itself), the answer's message, the next assistant header."""
        history = ep.messages[:-1]
        turn = {"role": "assistant", "content": _SENTINEL}
        before = self.tokenizer.render_chat([*history, turn], add_generation_prompt=False)
        after = self.tokenizer.render_chat([*history, turn, {"role": role, "content": text}])
        if not after.startswith(before):
            raise ValueError("the chat template renders a conversation's prefix differently once it grows")
        close = before[before.rindex(_SENTINEL) + len(_SENTINEL) :]
        if ended_at_stop_id:
            close = next((close[len(e) :] for e in self._eos_text if e and close.startswith(e)), close)
        return self.tokenizer.encode(close + after[len(before) :], add_special_tokens=False)

    def _end(self, ep: _Episode, reason: str, reward: float | None) -> Finished:
        completion = self.generator.finish(ep.request_id, reason)
        return self._pop(ep.request_id, completion, ep.turns, reward=reward)

    def finished(self, completion: Completion) -> Finished:
        """An episode the engine ended itself (its `max_tokens` or `max_len`): unscored by its environment."""
        return self._pop(completion.request_id, completion, self.live[completion.request_id].turns + 1)

    def fail(self, request_id: str, error: str) -> Finished:
        """The episode is invalid (its environment raised, hung, answered garbage or was lost): dropped."""
        self._stop_waiting(self.live[request_id], "failed")
        self.generator.abort(request_id)
        return self._pop(request_id, None, self.live[request_id].turns, error=error)

    def _pop(self, request_id: str, completion: Completion | None, turns: int, **end: object) -> Finished:
        episode_id, ep = self.episode_id(request_id), self.live.pop(request_id)
        return Finished(
            request_id=request_id, episode_id=episode_id, completion=completion, prompt_ids=ep.prompt_ids,
            turns=turns, env_wait_s=ep.wait_ns / 1e9, **end,  # type: ignore[arg-type]
        )  # fmt: skip

    def replay(self, request_id: str) -> str | None:
        """From its start again (its environment lost it): same seed, so the same tokens in reproducible
        mode; waiting for a new opening under a new episode id (returned). None once `max_replays` are
        spent (then `fail` it)."""
        ep = self.live[request_id]
        if ep.attempt >= self.limits.max_replays:
            return None  # `fail` ends its wait
        self._stop_waiting(ep, "lost")
        self.generator.abort(request_id)
        self.live[request_id] = _Episode(
            request_id, ep.params, ep.group_id, ep.row_json, attempt=ep.attempt + 1, wait_ns=ep.wait_ns
        )
        return self.episode_id(request_id)

    def lost_to(self, incarnation: str) -> list[str]:
        """Episodes not opened on environment process `incarnation` (just started): it holds none of them."""
        return [r for r, ep in self.live.items() if ep.incarnation != incarnation]

    def expired(self, now: float | None = None) -> list[str]:
        """Episodes that waited for their environment past `turn_timeout_s`."""
        now = time.monotonic() if now is None else now
        limit = self.limits.turn_timeout_s
        return [r for r, ep in self.live.items() if ep.state != "decoding" and now - ep.since > limit]


def policy_windows(completion: Completion) -> list[tuple[Tensor, Tensor, int]]:
    """(token_ids [T], hidden [T, d], 1) per run of policy tokens of a multi-turn completion, as
    `engine.buffer.completion_window` gives for a single turn: the hidden rows are the policy's alone, and
    each run's first token was sampled at the token before it (the prompt's last, or an answer's last)."""
    hidden, mask, ids = completion.hidden, completion.policy_mask, completion.token_ids
    if hidden is None or mask is None:
        return []
    windows, row, start = [], 0, None
    for j, own in enumerate([*mask, False]):
        if own and start is None:
            start = j
        elif not own and start is not None:
            n = j - start
            before = completion.prompt_ids[-1] if start == 0 else ids[start - 1]
            if n >= 2:
                tokens = torch.tensor([before, *ids[start : j - 1]], dtype=torch.int64)
                windows.append((tokens, hidden[row : row + n], 1))
            row, start = row + n, None
    return windows
