"""The verifier actor: a pool of worker processes that run the user's reward, each call under a deadline.

A reward is user code (`tasks.rewards.load_reward`): it may raise, hang or return garbage, and each of
those costs only its sample. The `Reward` goes out with reward None and the reason (never a silent 0),
the reason is logged and counted, and the actor serves on. Calls run in worker *processes* because only
a process can be stopped anywhere, C code included: past `timeout_s` the worker gets SIGKILL and a fresh
one takes its place, so the pool keeps its size. Every ScoreRequest gets exactly one Reward, at stop too.

A reward may start processes of its own (a subprocess, a sandbox); none may outlive its worker. Each
worker leads its own session, so one killpg (at a deadline, at stop) takes everything it started. If
the actor is SIGKILLed, PR_SET_PDEATHSIG kills a worker even inside C code, but then nothing of it runs:
so each worker first forks a guard into its group, which waits for the worker's death and kills the
group, itself included. A helper that leaves the group (setsid) leaves that reach too.

Workers come from the "forkserver" context (fork is unsafe here: this process holds zmq sockets and
threads). The server preloads the worker's module (`tasks/reward_worker.py`, which imports no torch) and
the built-in rewards, so a worker starts in milliseconds; each worker loads the reward itself, and one
that cannot is a start-up error naming the path. Jobs and outcomes cross the pipe as msgspec bytes, never
pickles. A reward is a finite real number (`judge`);
None means "cannot score"; a bool is garbage (True would pass for 1.0 unnoticed). Counts go to the
coordinator as `Status(topic="verifier")` every `report_every_s` while they change, and at stop.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import time
from collections import Counter, deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Annotated, Any

import msgspec

from slipstream.protocols.control import Status
from slipstream.protocols.reward import Reward, ScoreRequest
from slipstream.runtime.actor import COORDINATOR, Actor, Fatal, handler
from slipstream.tasks.reward_worker import REASONS, Job, Outcome, Started, worker_main

_POLL_S = 0.01  # the longest one step waits on the workers: messages are never kept waiting for long
_RESERVED = frozenset(("prompt", "completion"))  # passed by name, so a row may not carry them


def _exit_text(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


# -- the actor -----------------------------------------------------------------------------------


@dataclass
class _Task:
    request: ScoreRequest
    job: bytes  # the encoded Job
    job_id: int
    started: float = 0.0  # monotonic time a worker took it


@dataclass
class _Worker:
    proc: BaseProcess
    conn: Connection
    ready: bool = False  # the reward is loaded
    task: _Task | None = None


class VerifierActor(Actor):
    role = "verifier"

    class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
        reward: Annotated[str, msgspec.Meta(pattern=r"^\w+(\.\w+)*:\w+$")]  # "pkg.mod:fn": function or class
        workers: Annotated[int, msgspec.Meta(ge=1)] = 2  # worker processes: one still scores while one hangs
        timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0  # wall-clock limit of one call, then SIGKILL
        results_to: str = COORDINATOR  # where Rewards go: "coordinator" or a peer "role:rank"
        max_pending: Annotated[int, msgspec.Meta(ge=1)] = 1024  # held requests before senders are pushed back
        report_every_s: Annotated[float, msgspec.Meta(ge=0)] = 10.0  # Status period (0: only at stop)
        start_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 120.0  # for the workers to load the reward

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
        self._from_worker = msgspec.msgpack.Decoder(Started | Outcome)
        self._row = msgspec.json.Decoder(dict[str, Any])
        self._workers: list[_Worker] = []
        try:
            self._workers = [self._spawn() for _ in range(cfg.workers)]
            deadline = time.monotonic() + cfg.start_timeout_s
            while not all(w.ready for w in self._workers):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"reward {cfg.reward!r}: workers not ready after {cfg.start_timeout_s} s"
                    )
                self._pump(0.1)
        except BaseException:
            for w in self._workers:
                self._stop_worker(w)
            raise
        self.log.info(
            "verifier_started",
            reward=cfg.reward,
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
            self._finish(msg, None, "bad_row", f"bad row: {e}", 0.0)
            return
        self._queue.append(_Task(request=msg, job=job, job_id=self._job_ids))
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
        for w in self._workers:
            if w.task is not None:
                task, w.task = w.task, None
                self._fail(task, "stopped", "stopped: the verifier shut down while scoring it", now)
        while self._queue:
            self._fail(
                self._queue.popleft(), "stopped", "stopped: the verifier shut down before scoring it", now
            )
        self._report()
        for w in self._workers:
            self._stop_worker(w)

    # -- the pool -----------------------------------------------------------------------------------

    def _pending(self) -> int:
        return len(self._queue) + sum(w.task is not None for w in self._workers)

    def _pump(self, wait_s: float) -> None:
        """Dispatch, wait up to `wait_s` (less before a deadline), take outcomes, enforce deadlines."""
        self._dispatch()
        now = time.monotonic()
        deadlines = [w.task.started + self.config.timeout_s for w in self._workers if w.task is not None]
        timeout = max(0.0, min([wait_s, *(d - now for d in deadlines)]))
        wait([w.conn for w in self._workers] + [w.proc.sentinel for w in self._workers], timeout)
        for w in list(self._workers):
            self._collect(w)
        now = time.monotonic()
        for w in list(self._workers):
            if w.task is not None and now - w.task.started > self.config.timeout_s:
                task, w.task = w.task, None
                self._fail(task, "timeout", f"timeout after {self.config.timeout_s} s", now)
                self._replace(w, "timeout")
        self._dispatch()

    def _dispatch(self) -> None:
        for w in self._workers:
            if not self._queue:
                return
            if w.ready and w.task is None:
                task = self._queue.popleft()
                try:
                    w.conn.send_bytes(task.job)
                except OSError:  # it died since the last look (`_collect` replaces it); the job never ran
                    self._queue.appendleft(task)
                    continue
                task.started = time.monotonic()
                w.task = task

    def _collect(self, w: _Worker) -> None:
        """Takes what `w` sent; replaces it if it died."""
        try:
            while w.conn.poll():
                msg = self._from_worker.decode(w.conn.recv_bytes())
                if isinstance(msg, Started):
                    if msg.error is not None:
                        raise Fatal(msg.error)
                    w.ready = True
                elif w.task is not None and w.task.job_id == msg.job_id:
                    task, w.task = w.task, None
                    self._finish(task.request, msg.reward, msg.reason, msg.error, msg.elapsed_s)
        except (EOFError, OSError, msgspec.DecodeError):
            pass  # the pipe closed (or carries nonsense): the worker is gone or going
        else:
            if w.proc.exitcode is None:
                return
        w.proc.join(1.0)
        code = w.proc.exitcode
        if not w.ready:  # no retry loop for a reward that kills its process as it loads
            raise Fatal(f"reward {self.config.reward!r}: a worker {_exit_text(code)} while loading it")
        if w.task is not None:
            task, w.task = w.task, None
            why = f"crashed: the worker {_exit_text(code)} while scoring it"
            self._fail(task, "crashed", why, time.monotonic())
        self._replace(w, f"worker {_exit_text(code)}")

    def _spawn(self) -> _Worker:
        ours, theirs = self._mp.Pipe()
        proc = self._mp.Process(
            target=worker_main, args=(theirs, self.config.reward), name=f"{self.name}-reward", daemon=True
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
        self._finish(task.request, None, reason, error, now - task.started if task.started else 0.0)

    def _finish(
        self, req: ScoreRequest, reward: float | None, reason: str | None, error: str | None, elapsed_s: float
    ) -> None:
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
        )
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

    def _report(self) -> None:
        counts = dict(self._counts)
        self._reported = counts
        fields: dict[str, int | float | str | bool | None] = {
            "reward": self.config.reward,
            "scored": counts.get("scored", 0),
            "invalid": sum(counts.get(f"invalid_{r}", 0) for r in REASONS),
            **{f"invalid_{r}": counts.get(f"invalid_{r}", 0) for r in REASONS},
            "restarts": counts.get("restarts", 0),
            "workers": sum(w.proc.exitcode is None for w in self._workers),
            "pending": self._pending(),
        }
        self.log.info("verifier_counts", **fields)
        self.send(COORDINATOR, Status(topic="verifier", fields=fields))
