"""The environment actor (issue 42): hosts multi-turn episodes for the rollouts, many at once.

`env` names a factory "pkg.module:Name" (tasks/environments.py's contract: `env(row, **options)` is an
episode with `opening()`, `stop_sequences` and `reply(turn)`). Rollouts talk to it directly: `OpenEpisode`
→ `EpisodeOpened`, each `Turn` → `Answer`. Every call into the environment runs on one asyncio loop in a
thread of its own, bounded by `turn_timeout_s`: a coroutine `reply` is awaited there, a plain one runs in
a pool of `reply_threads` threads, so one slow episode never holds the others. An episode whose factory,
opening or reply raises, passes its deadline or answers garbage is answered with `error` (the rollout
makes that one sample invalid, recorded and masked) and dropped; the actor serves on. A turn for an
episode it does not hold is answered `unknown`. At start it tells its rollouts `EnvironmentUp` with a
fresh incarnation: a restarted process holds none of its predecessor's episodes, and they are replayed.
A restarted rollout says `RolloutUp`: the episodes of its dead predecessor are dropped (a call in flight for
one is dropped when it returns, unanswered), never held until this actor restarts.

Non-obvious: a plain `reply` that hangs cannot be killed (a thread); past its deadline its sample is
invalid and its thread stays busy until it returns, so `reply_threads` hung calls at once make every
later plain reply time out as well (a coroutine's deadline cancels it). Answers go out from the compute
loop (`step`), never from the loop's thread: a socket belongs to one thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from slipstream.protocols.base import Message
from slipstream.protocols.environment import (
    Answer,
    ChatMessage,
    CloseEpisode,
    EnvironmentUp,
    EpisodeOpened,
    OpenEpisode,
    RolloutUp,
    Turn,
)
from slipstream.runtime.actor import Actor, Fatal, handler
from slipstream.tasks.datasets import Row
from slipstream.tasks.environments import Observation, load_environment

ROLES = frozenset({"tool", "user", "system", "ipython", "environment"})


class EnvironmentActor(Actor):
    role = "environment"

    class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
        env: str  # the episode factory, "pkg.module:Name" (tasks/environments.py)
        options: dict[str, Any] = {}  # keyword arguments of the factory after the row
        turn_timeout_s: float = 30.0  # one call into the environment (factory, opening, a reply)
        max_episodes: int = 4096  # episodes held at once; past it an opening is refused (the sample invalid)
        reply_threads: int = 16  # threads for plain (not async) calls
        notify: list[str] = []  # rollouts told EnvironmentUp at start

        def __post_init__(self) -> None:
            if not self.turn_timeout_s > 0:
                raise ValueError(f"turn_timeout_s must be > 0, got {self.turn_timeout_s}")
            for name in ("max_episodes", "reply_threads"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def on_start(self) -> None:
        cfg = self.config
        try:
            self.factory = load_environment(cfg.env, cfg.options)
        except ValueError as exc:
            raise Fatal(str(exc)) from None
        self.incarnation = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.episodes: dict[str, Any] = {}  # episode id -> the environment's episode object
        self.turns: dict[str, int] = {}  # episode id -> the next turn it expects
        self.busy: set[str] = set()  # episodes with a call in flight
        self.closed: set[str] = set()  # of those, closed meanwhile: dropped when the call returns
        self.counts = {"opened": 0, "turns": 0, "errors": 0, "unknown": 0, "orphans": 0}
        self._out: queue.SimpleQueue[tuple[str, Message]] = queue.SimpleQueue()
        self._pool = concurrent.futures.ThreadPoolExecutor(cfg.reply_threads, thread_name_prefix="env-reply")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="env-loop", daemon=True)
        self._thread.start()
        for rollout in cfg.notify:
            self.send(rollout, EnvironmentUp(incarnation=self.incarnation))
        self.log.info("environment_up", env=cfg.env, incarnation=self.incarnation, notify=cfg.notify)

    def on_stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=2.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.log.info("environment_stopped", **self.counts, held=len(self.episodes))

    # -- handlers (compute thread): state changes here, calls on the loop ---------------------------------

    @handler
    def on_open(self, msg: OpenEpisode, sender: str) -> None:
        if msg.episode_id in self.episodes or msg.episode_id in self.busy:
            self._answer(sender, EpisodeOpened(episode_id=msg.episode_id, error="episode id already open"))
            return
        if len(self.episodes) + len(self.busy) >= self.config.max_episodes:
            why = f"{self.config.max_episodes} episodes held already (max_episodes)"
            self._answer(sender, EpisodeOpened(episode_id=msg.episode_id, error=why))
            return
        try:
            fields = json.loads(msg.row_json)
            row = Row(
                question=str(fields["question"]),
                answer=fields.get("answer"),
                metadata=dict(fields.get("metadata") or {}),
            )
        except (ValueError, KeyError, TypeError) as exc:
            why = f"malformed row: {type(exc).__name__}: {exc}"
            self._answer(sender, EpisodeOpened(episode_id=msg.episode_id, error=why))
            return
        self.busy.add(msg.episode_id)
        self._submit(self._open(msg.episode_id, row, sender))

    @handler
    def on_turn(self, msg: Turn, sender: str) -> None:
        episode = self.episodes.get(msg.episode_id)
        if episode is None:
            self.counts["unknown"] += 1
            self._answer(sender, Answer(episode_id=msg.episode_id, turn=msg.turn, unknown=True))
            return
        expected = self.turns[msg.episode_id]
        if msg.episode_id in self.busy or msg.turn != expected:
            why = (
                f"turn {msg.turn} while {'a turn is in flight' if msg.episode_id in self.busy else expected}"
            )
            self._drop(msg.episode_id)
            self._answer(sender, Answer(episode_id=msg.episode_id, turn=msg.turn, error=why))
            return
        self.busy.add(msg.episode_id)
        self.turns[msg.episode_id] = expected + 1
        self._submit(self._reply(msg.episode_id, episode, msg.turn, msg.text, sender))

    @handler
    def on_close(self, msg: CloseEpisode, sender: str) -> None:
        self._drop(msg.episode_id)

    @handler
    def on_rollout_up(self, msg: RolloutUp, sender: str) -> None:
        """A (re)started rollout: its predecessors' episodes go (ids `owner@incarnation/…`)."""
        prefix, own = f"{msg.owner}@", f"{msg.owner}@{msg.incarnation}/"
        orphans = [e for e in {*self.episodes, *self.busy} if e.startswith(prefix) and not e.startswith(own)]
        for episode_id in orphans:
            self._drop(episode_id)
        self.counts["orphans"] += len(orphans)
        if orphans:
            self.log.warning("episodes_orphaned", owner=msg.owner, dropped=len(orphans))

    # -- calls into the environment (the loop's thread) ---------------------------------------------------

    def _submit(self, coro: Any) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """`fn()` within the deadline: awaited if it gives an awaitable, a plain call in the pool."""
        loop = asyncio.get_running_loop()
        timeout = self.config.turn_timeout_s

        async def run() -> Any:
            result = await loop.run_in_executor(self._pool, fn)
            if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                result = await result
            return result

        try:
            return await asyncio.wait_for(run(), timeout)
        except TimeoutError:
            raise TimeoutError(f"no answer within {timeout:g} s (turn_timeout_s)") from None

    async def _open(self, episode_id: str, row: Row, sender: str) -> None:
        try:
            episode = await self._call(lambda: self.factory(row))
            opening = await self._call(episode.opening)
            messages = [_message(m) for m in opening]
            if not messages:
                raise ValueError("opening() gave no messages")
            stops = list(getattr(episode, "stop_sequences", ()) or ())
            if not all(isinstance(s, str) and s for s in stops):
                raise ValueError(f"stop_sequences must be non-empty strings, got {stops!r}")
        except Exception as exc:
            self._done(sender, EpisodeOpened(episode_id=episode_id, error=_why(exc)), episode_id, None)
            return
        opened = EpisodeOpened(
            episode_id=episode_id, messages=messages, stop_sequences=stops, incarnation=self.incarnation
        )
        self._done(sender, opened, episode_id, episode)

    async def _reply(self, episode_id: str, episode: Any, turn: int, text: str, sender: str) -> None:
        started = time.monotonic()
        try:
            obs = _observation(await self._call(lambda: episode.reply(text)))
            answer = Answer(
                episode_id=episode_id, turn=turn, text=obs.text, role=obs.role, done=obs.done,
                reward=obs.reward, elapsed_s=time.monotonic() - started,
            )  # fmt: skip
        except Exception as exc:
            answer = Answer(
                episode_id=episode_id, turn=turn, error=_why(exc), elapsed_s=time.monotonic() - started
            )
        self._done(sender, answer, episode_id, None if answer.done or answer.error else episode)

    def _done(self, dest: str, msg: Message, episode_id: str, keep: Any) -> None:
        """Hands an answer to the compute loop (it sends, and keeps `keep` as the episode, or drops it)."""
        self._out.put((dest, msg, episode_id, keep))  # type: ignore[arg-type]
        self.inbox.wake()

    # -- the compute loop ----------------------------------------------------------------------------------

    def step(self) -> bool:
        sent = False
        while True:
            try:
                dest, msg, episode_id, keep = self._out.get_nowait()  # type: ignore[misc]
            except queue.Empty:
                return sent
            self.busy.discard(episode_id)
            if episode_id in self.closed:  # closed while its call ran (its rollout ended it, or died)
                self.closed.discard(episode_id)
                continue
            if isinstance(msg, EpisodeOpened):
                self.counts["opened"] += msg.error is None
                if msg.error is None:
                    self.episodes[episode_id], self.turns[episode_id] = keep, 0
            elif keep is None:
                self.counts["turns"] += 1
                self._drop(episode_id)
            else:
                self.counts["turns"] += 1
            if getattr(msg, "error", None) is not None:
                self.counts["errors"] += 1
                self.log.warning("episode_invalid", episode=episode_id, kind=msg.kind, error=msg.error)
            self._answer(dest, msg)
            sent = True

    def _answer(self, dest: str, msg: Message) -> None:
        self.send(dest, msg)

    def _drop(self, episode_id: str) -> None:
        self.episodes.pop(episode_id, None)
        self.turns.pop(episode_id, None)
        if episode_id in self.busy:
            self.closed.add(episode_id)


def _message(m: Any) -> ChatMessage:
    role = m.get("role") if isinstance(m, dict) else getattr(m, "role", None)
    content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
    if not isinstance(role, str) or not isinstance(content, str):
        raise ValueError(f"opening() gave a message without string role and content: {m!r:.200}")
    return ChatMessage(role=role, content=content)


def _observation(obs: Any) -> Observation:
    """`obs` if it is a well-formed observation, else ValueError saying what is wrong (garbage)."""
    if not isinstance(obs, Observation):
        raise ValueError(f"reply() answered garbage: a {type(obs).__name__}, not an Observation")
    if not isinstance(obs.text, str) or not isinstance(obs.done, bool) or obs.role not in ROLES:
        raise ValueError(
            f"reply() answered garbage: {obs!r:.200} (text str, done bool, role in {sorted(ROLES)})"
        )
    if obs.reward is not None:
        if not obs.done:
            raise ValueError("reply() answered garbage: a reward without done")
        if (
            isinstance(obs.reward, bool)
            or not isinstance(obs.reward, int | float)
            or not math.isfinite(obs.reward)
        ):
            raise ValueError(f"reply() answered garbage: reward {obs.reward!r} is not a finite number")
    if not obs.done and not obs.text:
        raise ValueError("reply() answered garbage: an empty observation that does not end the episode")
    return obs


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return f"timeout: {exc}"
    text = str(exc)
    return (
        text
        if text.startswith(("reply() answered garbage", "opening()"))
        else f"raised {type(exc).__name__}: {exc}"
    )


__all__ = ["EnvironmentActor"]
