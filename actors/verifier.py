"""The verifier actor: a pool of worker processes that run the user's reward, each call under a deadline.

A reward is user code: it may raise, hang or return garbage, and each costs only its sample: the `Reward`
goes out with reward None and the reason (never a silent 0), logged and counted. Calls run in worker
*processes*, as only a process can be stopped anywhere (C code included): past its deadline a worker is
SIGKILLed with its whole session (what its reward started; a guard process does it if the actor itself
dies) and a fresh one takes its place. Every ScoreRequest gets exactly one Reward, at stop too.

`reward` is a path or weighted terms, each called by its convention (tasks/reward_conventions.py). A
batched one (TRL's, verl's plural) gets what has arrived: a free worker takes up to `batch_size` once
that many wait or the oldest has waited `batch_wait_s`; others go one sample a worker. A worker names the
samples of each call it starts (`Calling`): past `timeout_s` (a sample's call) or `batch_timeout_s` (a
batched one) those are invalid and the batch's others are scored again. Workers come from a forkserver
preloading the torchless worker module and built-in rewards (docs/rewards.md, "The verifier"). Counts go
out as `Status(topic="verifier")`; each call's time (`Called`) as a `reward_batch` span and, per term, in
`RewardCalls` ahead of the Rewards, so a step's record holds its reward time.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Annotated, Any

import msgspec

from slipstream.protocols.control import Status
from slipstream.protocols.reward import CallTotals, Reward, RewardCalls, ScoreRequest
from slipstream.runtime.actor import COORDINATOR, Actor, Fatal, handler
from slipstream.runtime.process import exit_how
from slipstream.tasks.reward_conventions import REWARD_PATH, RewardTerm, describe
from slipstream.tasks.reward_worker import (
    REASONS,
    Batch,
    Called,
    Calling,
    Job,
    Outcome,
    Started,
    WorkerSpec,
    worker_main,
)

_POLL_S = 0.01  # the longest one step waits on the workers: messages are never kept waiting for long
_RESERVED = frozenset(("prompt", "completion"))  # passed by name, so a row may not carry them
_CALLS_EVERY_S = 1.0  # while busy, the longest the calls' totals wait to go out (idle: at once)


def _exit_text(code: int | None) -> str:
    return "stopped answering" if code is None else exit_how(code)


# -- the actor -----------------------------------------------------------------------------------


@dataclass
class _Task:
    request: ScoreRequest
    job: bytes  # the encoded Job
    job_id: int
    arrived: float  # monotonic time it was queued
    started: float = 0.0  # monotonic time a worker took it


@dataclass
class _Worker:
    proc: BaseProcess
    conn: Connection
    ready: bool = False  # the reward is loaded
    batch: dict[int, _Task] = field(default_factory=dict)  # taken and not yet answered, by job id
    calling: list[int] = field(default_factory=list)  # the job ids of the call it runs now
    component: str = ""  # the term that call runs ("" once it returned, or none was named)
    call_started: float = 0.0  # monotonic time its Calling arrived
    limit: float = 0.0  # that call's limit in seconds
    deadline: float = 0.0  # monotonic time past which that call is killed


class VerifierActor(Actor):
    role = "verifier"

    class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
        # "pkg.mod:fn" (function or class), or weighted terms [{fn, weight, name, convention, fields, chat}]
        reward: Annotated[str, msgspec.Meta(pattern=REWARD_PATH)] | tuple[RewardTerm, ...]
        workers: Annotated[int, msgspec.Meta(ge=1)] = 2  # worker processes: one still scores while one hangs
        timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0  # wall-clock limit of one call, then SIGKILL
        batch_size: Annotated[int, msgspec.Meta(ge=1)] = (
            32  # most completions in one call of a batched reward
        )
        batch_wait_s: Annotated[float, msgspec.Meta(ge=0)] = 0.05  # longest a batch waits to fill
        batch_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0  # wall-clock limit of one batched call
        data_source: str = ""  # verl's data_source where a row names none (the run's task)
        results_to: str = COORDINATOR  # where Rewards go: "coordinator" or a peer "role:rank"
        max_pending: Annotated[int, msgspec.Meta(ge=1)] = 1024  # held requests before senders are pushed back
        report_every_s: Annotated[float, msgspec.Meta(ge=0)] = 10.0  # Status period (0: only at stop)
        start_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 120.0  # for the workers to load the reward

        def __post_init__(self) -> None:
            if isinstance(self.reward, tuple):
                if not self.reward:
                    raise ValueError("reward: no terms")
                names = [t.label for t in self.reward]
                if dups := sorted({n for n in names if names.count(n) > 1}):
                    raise ValueError(f"reward: terms named {dups} more than once (give each a name)")

        @property
        def terms(self) -> tuple[RewardTerm, ...]:
            return (RewardTerm(fn=self.reward),) if isinstance(self.reward, str) else self.reward

    def on_start(self) -> None:
        cfg = self.config
        if cfg.results_to != COORDINATOR and cfg.results_to not in self.peers:
            raise ValueError(f"results_to: {cfg.results_to!r} is not in this run")
        self._mp = multiprocessing.get_context("forkserver")
        self._mp.set_forkserver_preload(["slipstream.tasks.reward_worker", "slipstream.tasks.rewards"])
        self._queue: deque[_Task] = deque()
        self._counts: Counter[str] = Counter()
        self._reported: dict[str, int] | None = None
        self._next_report = time.monotonic() + cfg.report_every_s
        self._job_ids = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._from_worker = msgspec.msgpack.Decoder(Started | Calling | Called | Outcome)
        self._row = msgspec.json.Decoder(dict[str, Any])
        # Each component's [sum, scored, invalid] since start: the Reward carries only the weighted sum.
        self._parts: dict[str, list[float]] = {t.label: [0.0, 0, 0] for t in cfg.terms}
        # Each component's calls, [calls, samples, seconds, largest, invalid]: since start (the Status) and
        # not yet sent (the next RewardCalls).
        self._calls_total: dict[str, list[float]] = {t.label: [0, 0, 0.0, 0, 0] for t in cfg.terms}
        self._calls_unsent: dict[str, list[float]] = {}
        self._calls_sent = time.monotonic()
        self._spec = msgspec.msgpack.encode(WorkerSpec(terms=cfg.terms, data_source=cfg.data_source))
        self._conventions: dict[str, str] = {}
        self._batched = False  # whether a component is called once per batch (workers say so at start)
        self._workers: list[_Worker] = []
        try:
            self._workers = [self._spawn() for _ in range(cfg.workers)]
            deadline = time.monotonic() + cfg.start_timeout_s
            while not all(w.ready for w in self._workers):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"reward {describe(cfg.reward)!r}: workers not ready after {cfg.start_timeout_s} s"
                    )
                self._pump(0.1)
        except BaseException:
            for w in self._workers:
                self._stop_worker(w)
            raise
        self.log.info(
            "verifier_started",
            reward=describe(cfg.reward),
            conventions=self._conventions,
            batch_size=cfg.batch_size if self._batched else 1,
            workers=cfg.workers,
            timeout_s=cfg.timeout_s,
            results_to=cfg.results_to,
            pids=[w.proc.pid for w in self._workers],
        )

    @handler
    def on_score(self, msg: ScoreRequest, sender: str) -> None:
        try:
            row = self._row.decode(msg.row_json)
            if clash := sorted(_RESERVED & row.keys()):
                raise ValueError(f"{clash} are passed by name, not as row fields")
            self._job_ids += 1
            job = self._encoder.encode(Job(self._job_ids, msg.prompt, msg.completion, row))
        except (msgspec.DecodeError, msgspec.EncodeError, ValueError, OverflowError) as e:
            outcome = Outcome(job_id=0, reward=None, reason="bad_row", error=f"bad row: {e}", elapsed_s=0.0)
            self._finish(msg, outcome, 0.0)
            return
        self._queue.append(_Task(request=msg, job=job, job_id=self._job_ids, arrived=time.monotonic()))
        self._dispatch()
        # Past max_pending, work the pool here instead of taking more requests: the inbox then fills
        # and ZeroMQ's high-water marks push back on the senders. Control still comes first.
        while self._pending() > self.config.max_pending and not self.control_pending():
            self._pump(_POLL_S)

    def step(self) -> bool:
        self._pump(_POLL_S if self._pending() else 0.0)
        cfg = self.config
        if cfg.report_every_s and time.monotonic() >= self._next_report:
            self._next_report = time.monotonic() + cfg.report_every_s
            if self._reported != dict(self._counts):
                self._report()
        return self._pending() > 0

    def on_stop(self) -> None:
        now = time.monotonic()
        self._send_calls()  # the calls' totals ahead of the Rewards below, as always
        for w in self._workers:
            for task in w.batch.values():
                self._fail(task, "stopped", "stopped: the verifier shut down while scoring it", now)
            w.batch.clear()
        while self._queue:
            self._fail(
                self._queue.popleft(), "stopped", "stopped: the verifier shut down before scoring it", now
            )
        self._report()
        for w in self._workers:
            self._stop_worker(w)

    # -- the pool -----------------------------------------------------------------------------------

    def _pending(self) -> int:
        return len(self._queue) + sum(len(w.batch) for w in self._workers)

    def _pump(self, wait_s: float) -> None:
        """Dispatch, wait up to `wait_s` (less before a deadline or a batch's wait), take outcomes, enforce
        deadlines."""
        self._dispatch()
        now = time.monotonic()
        wakes = [w.deadline for w in self._workers if w.batch]
        if self._batched and self._queue and any(w.ready and not w.batch for w in self._workers):
            wakes.append(self._queue[0].arrived + self.config.batch_wait_s)  # a free worker may take it
        timeout = max(0.0, min([wait_s, *(t - now for t in wakes)]))
        wait([w.conn for w in self._workers] + [w.proc.sentinel for w in self._workers], timeout)
        for w in list(self._workers):
            self._collect(w)
        now = time.monotonic()
        for w in list(self._workers):
            if w.batch and now > w.deadline:
                self._lose(w, "timeout", f"timeout after {w.limit} s", now)
                self._replace(w, "timeout")
        self._dispatch()

    def _limit(self, batched: bool) -> float:
        return self.config.batch_timeout_s if batched else self.config.timeout_s

    def _dispatch(self) -> None:
        cfg = self.config
        for w in self._workers:
            if not self._queue:
                return
            if not w.ready or w.batch:
                continue
            n = 1
            if self._batched:
                waited = time.monotonic() - self._queue[0].arrived
                if len(self._queue) < cfg.batch_size and waited < cfg.batch_wait_s:
                    return  # a batched call costs about the same for one or many: let more arrive
                n = min(cfg.batch_size, len(self._queue))
            tasks = [self._queue.popleft() for _ in range(n)]
            try:
                w.conn.send_bytes(self._encoder.encode(Batch(jobs=[msgspec.Raw(t.job) for t in tasks])))
            except OSError:  # it died since the last look (`_collect` replaces it); the jobs never ran
                self._queue.extendleft(reversed(tasks))
                continue
            now = time.monotonic()
            for t in tasks:
                t.started = now
            w.batch = {t.job_id: t for t in tasks}
            # Until it says which call runs, the most any of its calls may take.
            w.calling, w.limit = [], max(cfg.timeout_s, cfg.batch_timeout_s if self._batched else 0.0)
            w.deadline = now + w.limit
            self._counts["batches"] += 1
            self._counts["batched"] += n

    def _collect(self, w: _Worker) -> None:
        """Takes what `w` sent; replaces it if it died."""
        try:
            while w.conn.poll():
                msg = self._from_worker.decode(w.conn.recv_bytes())
                if isinstance(msg, Started):
                    if msg.error is not None:
                        raise Fatal(msg.error)
                    w.ready = True
                    self._conventions = msg.conventions
                    self._batched = any(c.endswith("batched") for c in msg.conventions.values())
                elif isinstance(msg, Calling):
                    w.calling, w.limit, w.component = msg.job_ids, self._limit(msg.batched), msg.component
                    w.call_started = time.monotonic()
                    w.deadline = w.call_started + w.limit
                elif isinstance(msg, Called):
                    w.component = ""
                    self._charge(w, msg.component, msg.size, msg.started_ns, msg.seconds, msg.invalid)
                elif (task := w.batch.pop(msg.job_id, None)) is not None:
                    self._finish(task.request, msg, msg.elapsed_s)
        except (EOFError, OSError, msgspec.DecodeError):
            pass  # the pipe closed (or carries nonsense): the worker is gone or going
        else:
            if w.proc.exitcode is None:
                return
        w.proc.join(1.0)
        code = w.proc.exitcode
        if not w.ready:  # no retry loop for a reward that kills its process as it loads
            raise Fatal(
                f"reward {describe(self.config.reward)!r}: a worker {_exit_text(code)} while loading it"
            )
        self._lose(w, "crashed", f"crashed: the worker {_exit_text(code)} while scoring it", time.monotonic())
        self._replace(w, f"worker {_exit_text(code)}")

    def _lose(self, w: _Worker, reason: str, error: str, now: float) -> None:
        """The samples of the call `w` was in are invalid; the rest of its batch waits to be scored again."""
        blamed = [i for i in w.calling if i in w.batch] or list(w.batch)  # no call known: all of them
        if w.component:  # the call it was in counts up to now, its samples invalid
            took = max(0.0, now - w.call_started)
            started_ns = time.monotonic_ns() - int(took * 1e9)
            self._charge(w, w.component, len(w.calling), started_ns, took, len(blamed), killed=reason)
            w.component = ""
        for job_id in blamed:
            self._fail(w.batch.pop(job_id), reason, error, now)
        again = list(w.batch.values())
        w.batch.clear()
        for task in again:
            task.started = 0.0
        self._queue.extendleft(reversed(again))

    def _spawn(self) -> _Worker:
        ours, theirs = self._mp.Pipe()
        proc = self._mp.Process(
            target=worker_main, args=(theirs, self._spec), name=f"{self.name}-reward", daemon=True
        )
        proc.start()
        theirs.close()
        return _Worker(proc=proc, conn=ours)

    def _replace(self, w: _Worker, why: str) -> None:
        pid = w.proc.pid
        self._stop_worker(w)
        fresh = self._spawn()
        self._workers[self._workers.index(w)] = fresh
        self._counts["restarts"] += 1
        self.log.warning("worker_replaced", pid=pid, why=why, new_pid=fresh.proc.pid)

    def _stop_worker(self, w: _Worker) -> None:
        if w.proc.exitcode is None:
            # Not yet reaped, its pid cannot name another process, nor can the group it leads: this
            # takes the worker, its guard and whatever its reward started. (One that died by itself
            # is reaped by now; its guard kills what it left.)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.proc.pid, signal.SIGKILL)
            w.proc.kill()  # a worker too young to lead its group yet
            w.proc.join(1.0)
        w.conn.close()
        if w.proc.exitcode is not None:
            w.proc.close()  # its file descriptors now, not whenever it is garbage-collected

    # -- results and counts -------------------------------------------------------------------------

    def _fail(self, task: _Task, reason: str, error: str, now: float) -> None:
        """An invalid Reward for `task`; its elapsed time runs from when a worker took it (if one did)."""
        outcome = Outcome(job_id=task.job_id, reward=None, reason=reason, error=error, elapsed_s=0.0)
        self._finish(task.request, outcome, now - task.started if task.started else 0.0)

    def _finish(self, req: ScoreRequest, outcome: Outcome, elapsed_s: float) -> None:
        reward, reason, error = outcome.reward, outcome.reason, outcome.error
        for name, value in outcome.components.items():
            part = self._parts.setdefault(name, [0.0, 0, 0])
            part[0] += value
            part[1] += 1
        if outcome.blame is not None:
            self._parts.setdefault(outcome.blame, [0.0, 0, 0])[2] += 1
        if reward is None:
            self._counts[f"invalid_{reason}"] += 1
            self.log.warning(
                "reward_invalid",
                group_id=req.group_id,
                sample_index=req.sample_index,
                reason=reason,
                error=error,
            )
        else:
            self._counts["scored"] += 1
        ended = time.monotonic_ns()
        took = int(max(0.0, elapsed_s) * 1e9)
        self.spans.add(
            "reward",
            ended - took,
            took,
            req.policy_version,
            group=req.group_id,
            index=req.sample_index,
            ok=reward is not None,
            **({"reason": reason} if reward is None else {}),
            **({"components": outcome.components} if len(self._parts) > 1 else {}),
        )
        if self._calls_unsent and (
            self._pending() == 0 or time.monotonic() - self._calls_sent >= _CALLS_EVERY_S
        ):
            self._send_calls()
        self.send(
            self.config.results_to,
            Reward(
                group_id=req.group_id,
                sample_index=req.sample_index,
                reward=reward,
                error=error if reward is None else None,
                elapsed_s=max(0.0, elapsed_s),
                policy_version=req.policy_version,
            ),
        )

    def _charge(
        self, w: _Worker, name: str, size: int, started_ns: int, seconds: float, invalid: int, **why: str
    ) -> None:
        """One call of component `name` over `size` samples: its span, and its part of the totals."""
        for totals in (self._calls_total, self._calls_unsent):
            cell = totals.setdefault(name, [0, 0, 0.0, 0, 0])
            cell[0] += 1
            cell[1] += size
            cell[2] += seconds
            cell[3] = max(cell[3], size)
            cell[4] += invalid
        step = next((w.batch[i].request.policy_version for i in w.calling if i in w.batch), None)
        self.spans.add(
            "reward_batch", started_ns, int(seconds * 1e9), step, term=name, size=size, invalid=invalid, **why
        )

    def _send_calls(self) -> None:
        """The calls since the last RewardCalls, per component, to the coordinator (rl/step.py's totals)."""
        if self._calls_unsent:
            terms = {
                name: CallTotals(
                    calls=int(c), samples=int(n), seconds=s, max_batch=int(top), invalid=int(bad)
                )
                for name, (c, n, s, top, bad) in self._calls_unsent.items()
            }
            self.send(COORDINATOR, RewardCalls(terms=terms))
            self._calls_unsent = {}
        self._calls_sent = time.monotonic()

    def _report(self) -> None:
        counts = dict(self._counts)
        self._reported = counts
        fields: dict[str, int | float | str | bool | None] = {
            "reward": describe(self.config.reward),
            "scored": counts.get("scored", 0),
            "invalid": sum(counts.get(f"invalid_{r}", 0) for r in REASONS),
            **{f"invalid_{r}": counts.get(f"invalid_{r}", 0) for r in REASONS},
            "restarts": counts.get("restarts", 0),
            "workers": sum(w.proc.exitcode is None for w in self._workers),
            "pending": self._pending(),
            "batches": counts.get("batches", 0),  # worker calls: a per-completion reward's are its samples
            "batch_mean": round(counts["batched"] / counts["batches"], 3) if counts.get("batches") else 0.0,
        }
        for name, (total, scored, invalid) in self._parts.items():  # sums, so a reader can difference them
            fields[f"component_{name}_sum"] = total
            fields[f"component_{name}_scored"] = int(scored)
            fields[f"component_{name}_invalid"] = int(invalid)
        for name, (calls, samples, seconds, top, _) in self._calls_total.items():
            fields[f"component_{name}_calls"] = int(calls)
            fields[f"component_{name}_seconds"] = round(seconds, 6)
            fields[f"component_{name}_batch_mean"] = round(samples / calls, 3) if calls else 0.0
            fields[f"component_{name}_batch_max"] = int(top)
        self.log.info("verifier_counts", **fields)
        self.send(COORDINATOR, Status(topic="verifier", fields=fields))
