"""The supervisor: spawns actor processes, shakes hands, watches them, restarts on request, stops all.

It lives in the coordinator's asyncio loop and owns the coordinator's ROUTER (control, and the work
that goes on `inbox`; runtime/control_socket.py). Start-up is all or nothing: every actor sends Hello,
gets Init (its config, its peers) and must answer Ready within the handshake timeout, else every process
is killed and `SupervisorError` names the actor and why. A multi-node run (runtime/cluster.py) also
listens on the head's TCP port, CURVE on every socket; the other nodes' actors start through `remote`.

Death is a process exit (SIGKILL is seen at once), `missed_beats` silent heartbeat intervals, or, with a
spec's `hang_s`, ticks that froze while the IO thread still beats (killed). The owner gets an `ActorDied`
on `deaths` and decides: `await restart(name)` respawns it after a backoff, at the same data endpoints
(peers reconnect by themselves); past `max_restarts`, `SupervisorError` quotes its last log lines. Sends
wait for a full peer, never drop (`send_waiting`). Shutdown: Shutdown, a grace period, SIGTERM, SIGKILL.
Also runs the live event proxy (actors' log PUBs → XSUB → XPUB, for `slipstream logs --follow`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from slipstream.protocols import PROTOCOL_VERSION, Message
from slipstream.protocols.control import Dead, Heartbeat, Hello, Init, Peers, Ready, Shutdown
from slipstream.runtime import logs
from slipstream.runtime.actor import Actor
from slipstream.runtime.cluster import CONTROL, EVENTS, Cluster
from slipstream.runtime.control_socket import ControlSocket
from slipstream.runtime.launcher import (
    ActorLaunch,
    Launcher,
    LocalLauncher,
    NodeLost,
    ProcessHandle,
    actor_env,
    wait_all,
)
from slipstream.runtime.process import exit_code_text, exit_how
from slipstream.runtime.shm import cleanup as cleanup_shm
from slipstream.runtime.spec import ActorDied, ActorSpec
from slipstream.runtime.transport import PEER_FULL, CurveKeys, actor_name, ipc_endpoint, run_tag

__all__ = ["ActorDied", "ActorSpec", "Supervisor", "SupervisorError"]


class SupervisorError(RuntimeError):
    """Start-up or a restart failed, or a restart budget is spent; the message names the actor and why."""


MAX_BACKOFF_S = 30.0  # the longest wait before one restart
_LOG_TAIL_LINES = 10


@dataclass
class _Proc:
    spec: ActorSpec
    name: str
    proc: ProcessHandle
    role: str = ""
    hello: Hello | None = None
    hello_recv_ns: int = 0  # our monotonic clock when the Hello arrived (span clock alignment)
    ready: bool = False
    dead: bool = False
    reason: str = ""
    last_seen: float = field(default_factory=time.monotonic)
    ticks: int = -1  # the compute loop's turns, as its last heartbeat said
    moved_at: float = field(default_factory=time.monotonic)  # when its ticks last changed (or it got ready)
    watcher: asyncio.Task[None] | None = None
    restarting: bool = False  # in a restart's handshake: a death here is raised, not put on `deaths`


class Supervisor:
    def __init__(
        self,
        run_dir: Path | str,
        *,
        heartbeat_s: float = 1.0,
        missed_beats: int = 3,
        handshake_timeout_s: float = 120.0,
        inbox_size: int = 10_000,
        curve_key: Path | None = None,
        log: Any = None,
        max_restarts: int = 3,
        restart_backoff_s: float = 0.5,
        trace: bool = False,
        launcher: Launcher | None = None,
        cluster: Cluster | None = None,
        remote: Launcher | None = None,
    ) -> None:
        for field_name, value in (("max_restarts", max_restarts), ("restart_backoff_s", restart_backoff_s)):
            if value < 0:
                raise ValueError(f"{field_name} must be >= 0, got {value}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.heartbeat_s, self.missed_beats = heartbeat_s, missed_beats
        self.handshake_timeout_s = handshake_timeout_s
        self.log = log
        self.trace = trace  # actors record spans into RUN/spans/ (runtime/spans.py)
        self.launcher: Launcher = launcher or LocalLauncher(log)  # starts node 0's actors (this host)
        self.remote = remote  # starts the other nodes' actors (runtime/agent.py), in a multi-node run
        self.cluster = cluster or Cluster()
        # With the run's key every socket of the run is CURVE (multi-node runs); refused peers are logged.
        self.curve_key = str(curve_key or "")
        self.curve = CurveKeys.load(Path(curve_key)) if curve_key else None
        if self.cluster.multi and remote is None:
            raise ValueError("a multi-node supervisor needs a launcher for the other nodes (remote=)")
        self._ports: dict[str, int] = {}  # actor -> its index in the run: its data port, stable over restarts
        self._procs: dict[str, _Proc] = {}
        self.inbox: asyncio.Queue[tuple[str, Message]] = asyncio.Queue(maxsize=inbox_size)
        self._backpressure = False  # the receive loop waits for inbox room (liveness is not judged then)
        self.deaths: asyncio.Queue[ActorDied] = asyncio.Queue()
        self.max_restarts, self.restart_backoff_s = max_restarts, restart_backoff_s
        self._restarts: dict[str, int] = {}  # restarts tried per actor, failed ones included
        self._last_death: dict[str, ActorDied] = {}
        self._restarting: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._open_endpoints()

    def _open_endpoints(self) -> None:
        """The head's sockets: the control ROUTER and the event proxy, at ipc paths in the run directory
        (and on the head's TCP ports across nodes), announced in RUN/endpoints.json."""
        self.control_endpoint = ipc_endpoint(self.run_dir, "control")
        self.events_in = ipc_endpoint(self.run_dir, "events-in")
        self.events_out = ipc_endpoint(self.run_dir, "events")
        cleanup_shm(run_tag(self.run_dir))  # segments a crashed earlier start of this run left behind
        multi, address = self.cluster.multi, self.cluster.address
        control_tcp = f"tcp://{address}:{self.cluster.port(CONTROL)}" if multi else ""
        self.control = ControlSocket(
            self.control_endpoint, tcp=control_tcp, curve=self.curve, emit=self._emit
        )
        self.traffic = self.control.traffic  # what the receive loop decoded, by kind (runtime/traffic.py)
        self.outbound = self.control.outbound  # what `send` handed to it, by kind (bench scale reads it)
        events_tcp = f"tcp://{address}:{self.cluster.port(EVENTS)}" if multi else ""
        self._proxy = logs.EventProxy(self.events_in, self.events_out, tcp=events_tcp, curve=self.curve)
        (self.run_dir / "endpoints.json").write_bytes(
            msgspec.json.encode({"control": self.control_endpoint, "events": self.events_out})
        )

    # -- start --------------------------------------------------------------------------------------

    async def start(self, specs: list[ActorSpec]) -> None:
        """Spawns every actor and completes the handshake, or kills them all and raises."""
        self._proxy.start()
        self._tasks.append(asyncio.create_task(self._recv_loop(), name="supervisor-recv"))
        if self.cluster.multi:  # who knocks on the head's TCP port and is turned away
            self._tasks.append(asyncio.create_task(self.control.watch_handshakes(), name="handshakes"))
        # Beat from the first Hello on: an actor that is ready early must not hear silence (and stop)
        # while a slower one is still loading its model.
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="supervisor-heartbeat"))
        try:
            classes = [self._check(spec) for spec in specs]  # every config is valid before anything spawns
            for spec, cls in zip(specs, classes, strict=True):
                if self._launcher_of(spec.node) is None:  # nor is any spawned where nothing can start it
                    raise SupervisorError(
                        f"{actor_name(cls.role, spec.rank)}: ActorSpec.node is {spec.node}, but this "
                        f"supervisor's launchers start actors on node(s) {sorted(self._nodes())} "
                        "(a run across nodes needs a node agent there)"
                    )
            for spec, cls in zip(specs, classes, strict=True):
                if (name := actor_name(cls.role, spec.rank)) in self._procs:
                    raise SupervisorError(f"{name}: two actors with the same role and rank")
                await self._spawn(spec, cls.role)
            await self._handshake(list(self._procs.values()))
            self._emit("all_ready", actors=sorted(self._procs))
        except BaseException:
            await self.shutdown(reason="start-up failed", grace_s=0.5)
            raise

    @staticmethod
    def _check(spec: ActorSpec) -> type[Actor]:
        try:
            return spec.actor_class()
        except ValueError as e:  # a ConfigError too
            raise SupervisorError(str(e)) from None

    def _nodes(self) -> set[int]:
        return {*self.launcher.nodes, *(self.remote.nodes if self.remote is not None else ())}

    def _launcher_of(self, node: int) -> Launcher | None:
        remote = self.remote if self.remote is not None and node in self.remote.nodes else None
        return self.launcher if node in self.launcher.nodes else remote

    async def _spawn(self, spec: ActorSpec, role: str, *, restarting: bool = False) -> _Proc:
        """Starts the process of `spec`; its entry replaces any earlier one of the same name."""
        name = actor_name(role, spec.rank)
        launch = ActorLaunch(
            name=name,
            actor=spec.actor,
            rank=spec.rank,
            node=spec.node,
            run_dir=str(self.run_dir),
            env=actor_env(spec.env, spec.threads),
            cpus=list(spec.cpus),
            handshake_timeout_s=self.handshake_timeout_s,
            data_port=self.cluster.data_port(self._ports.setdefault(name, len(self._ports))),
            control=self.control_endpoint,
            events=self.events_in,
            curve_key=self.curve_key,
            data_host=self.cluster.address if self.cluster.multi else "",
        )
        launcher = self._launcher_of(spec.node)
        assert launcher is not None  # checked in start
        proc = await launcher.launch(launch)
        entry = _Proc(spec=spec, name=name, proc=proc, role=role, restarting=restarting)
        self._procs[name] = entry
        # The watcher holds its own entry: the old process's watcher can never mark a successor dead.
        entry.watcher = asyncio.create_task(self._watch_exit(entry), name=f"watch-{name}")
        self._emit("spawned", actor=name, pid=proc.pid, threads=spec.threads)
        return entry

    async def _handshake(self, entries: list[_Proc]) -> None:
        """Hello from each of `entries`, then Init with the peer directory, then Ready from each."""
        deadline = time.monotonic() + self.handshake_timeout_s

        async def until(done: Any, what: str) -> None:
            while not all(done(p) for p in entries):
                if self._closing:
                    raise SupervisorError("the supervisor shut down during the handshake")
                for p in entries:
                    if p.dead:
                        raise SupervisorError(f"{p.name} died during start-up: {p.reason}")
                if time.monotonic() > deadline:
                    missing = [p.name for p in entries if not done(p)]
                    raise SupervisorError(
                        f"handshake timed out after {self.handshake_timeout_s}s waiting for {what} from {missing}"
                    )
                await asyncio.sleep(0.01)

        await until(lambda p: p.hello is not None, "hello")
        for p in entries:
            init = Init(
                config=msgspec.Raw(msgspec.msgpack.encode(p.spec.plain_config())),
                run_dir=str(self.run_dir),
                peers=self.endpoints(p.spec.node),
                heartbeat_s=self.heartbeat_s,
                threads=p.spec.threads,
                trace=self.trace,
                hello_recv_ns=p.hello_recv_ns,
                sent_ns=time.monotonic_ns(),
            )
            await self.send(p.name, init)
        await until(lambda p: p.ready, "ready")

    # -- messaging ----------------------------------------------------------------------------------

    async def send(self, name: str, msg: Message, *, wait: bool = True) -> None:
        """Sends a message to actor `name`. While its queue is full it waits (`send_waiting`; in call order
        per actor), or, with `wait` False, skips it: heartbeats (an actor that full hears from the head
        anyway; a heartbeat loop stuck behind one would starve the others). Failures are logged."""
        gone = lambda: not wait or self._closing or (p := self._procs.get(name)) is None or p.dead  # noqa: E731
        error = await self.control.send(name, msg, gone, wait=wait)
        if error is not None and not self._closing and (wait or error != PEER_FULL):
            self._emit("send_failed", actor=name, kind=msg.kind, error=error, level="warning")

    async def broadcast(self, msg: Message) -> None:
        for name, p in self._procs.items():
            if not p.dead:
                await self.send(name, msg)

    def alive(self) -> list[str]:
        return [name for name, p in self._procs.items() if not p.dead]

    def pid(self, name: str) -> int:
        return self._procs[name].proc.pid

    def endpoints(self, node: int | None = None) -> dict[str, str]:
        """Data endpoints of the actors that said Hello ("role:rank" → endpoint), as an actor on `node` reaches
        them: ipc:// on its own node, tcp:// across nodes (None: as they were announced). A dead peer's
        endpoint is where its successor binds (ipc path and tcp port are fixed per actor)."""
        out = {}
        for n, p in self._procs.items():
            if p.hello is not None:
                local = p.hello.local_endpoint and p.spec.node == node
                out[n] = p.hello.local_endpoint if local else p.hello.data_endpoint
        return out

    async def _recv_loop(self) -> None:
        while True:
            sender, msg = await self.control.recv()
            entry = self._procs.get(sender)
            if entry is None:
                self._emit("unknown_sender", sender=sender, kind=msg.kind, level="warning")
                continue
            if entry.hello is None and not isinstance(msg, Hello):
                # An actor says Hello first: anything else under its name is its dead predecessor's last
                # words, still queued (a late Dead must not kill the restarted process's entry).
                self._emit("dropped_from_predecessor", actor=sender, kind=msg.kind, level="warning")
                continue
            entry.last_seen = time.monotonic()
            if isinstance(msg, Heartbeat):
                if msg.ticks != entry.ticks:
                    entry.ticks, entry.moved_at = msg.ticks, entry.last_seen
                continue
            if isinstance(msg, Hello):
                if msg.protocol_version != PROTOCOL_VERSION:
                    self._emit("protocol_mismatch", actor=sender, theirs=msg.protocol_version, level="error")
                    await self.send(
                        sender, Shutdown(reason=f"protocol {msg.protocol_version} != {PROTOCOL_VERSION}")
                    )
                    continue
                entry.hello, entry.hello_recv_ns = msg, time.monotonic_ns()
            elif isinstance(msg, Ready):
                entry.ready, entry.moved_at = True, time.monotonic()
                self._emit("ready", actor=sender)
            elif isinstance(msg, Dead):
                self._mark_dead(entry, msg.reason, msg.exit_code)
            elif not self.inbox.full():
                self.inbox.put_nowait((sender, msg))
            else:
                # Backpressure, never a drop: stop reading until the coordinator catches up, so the actors'
                # sends queue in zmq and their IO threads park them. Silence is no sign of death meanwhile.
                self._emit("inbox_full_backpressure", sender=sender, kind=msg.kind, level="warning")
                self._backpressure = True
                try:
                    await self.inbox.put((sender, msg))
                finally:
                    self._backpressure = False
                    now = time.monotonic()
                    for p in self._procs.values():
                        p.last_seen = max(p.last_seen, now)  # unheard while this loop waited
                        p.moved_at = max(p.moved_at, now)  # blocked sends stop compute loops too

    # -- liveness -----------------------------------------------------------------------------------

    async def _watch_exit(self, entry: _Proc) -> None:
        code = await entry.proc.wait()
        if not self._closing and not entry.dead:
            how = getattr(entry.proc, "exit_reason", "") or exit_how(code)  # a remote one: "node 1 lost"
            self._mark_dead(entry, how, code)
        entry.dead = True

    async def _heartbeat_loop(self) -> None:
        seq = 0
        limit = self.missed_beats * self.heartbeat_s
        while True:
            seq += 1
            beat = Heartbeat(seq=seq, sent_ns=time.time_ns())
            now = time.monotonic()
            for name, p in list(self._procs.items()):
                if p.dead or p.hello is None:  # not connected yet: the handshake deadline covers start-up
                    continue
                # Liveness is judged once an actor is ready: until then it may be busy loading a model
                # on its compute thread while its IO thread still beats.
                hang = p.spec.hang_s
                if p.ready and not self._backpressure:
                    reason = ""
                    if now - p.last_seen > limit:  # the whole process is silent: stopped, or its IO stuck
                        reason = f"no heartbeat for {now - p.last_seen:.2f}s"
                    # Ticks are seen at heartbeats: a tick just after one shows at the next, up to one
                    # interval late. Judged against hang_s alone, a hang deadline equal to the interval killed
                    # a ticking actor whose heartbeat came a little late (on a loaded CI host).
                    elif hang > 0 and now - p.moved_at > hang + self.heartbeat_s:
                        still = f"{now - p.moved_at:.1f}s (hang_s {hang:g})"
                        reason = f"hung: no progress for {still} while its heartbeats arrived"
                    if reason:
                        self._mark_dead(p, reason, None)
                        with contextlib.suppress(ProcessLookupError):
                            p.proc.kill()
                        continue
                await self.send(name, beat, wait=False)
            await asyncio.sleep(self.heartbeat_s)

    def _mark_dead(self, entry: _Proc, reason: str, code: int | None) -> None:
        if entry.dead:
            return
        entry.dead = True
        entry.reason = reason
        after = time.monotonic() - entry.last_seen
        self._emit("actor_dead", actor=entry.name, reason=reason, exit_code=code,
                   detected_after_s=round(after, 3), level="error")  # fmt: skip
        died = ActorDied(entry.name, reason, code, after)
        self._last_death[entry.name] = died
        if not entry.restarting:  # a failed restart is reported by `restart` raising
            self.deaths.put_nowait(died)

    # -- restart ------------------------------------------------------------------------------------

    def restarts(self, name: str) -> int:
        """How many restarts of `name` were tried this run (failed ones included)."""
        return self._restarts.get(name, 0)

    def config(self, name: str) -> msgspec.Struct | dict[str, Any]:
        """The config actor `name` runs with now (a restart with `config=` replaces it)."""
        return self._procs[name].spec.config

    def last_death(self, name: str) -> ActorDied | None:
        """The last death of `name` (reason, exit code), or None if it never died."""
        return self._last_death.get(name)

    async def restart(self, name: str, *, config: msgspec.Struct | None = None) -> None:
        """Respawns dead actor `name` from its spec and returns once it is Ready (and watched again). The
        k-th restart waits `restart_backoff_s * 2**(k-1)` (at most MAX_BACKOFF_S) first. Raises ValueError
        if `name` is unknown, alive or already restarting; SupervisorError if its restart budget is spent
        (with its last words) or this restart fails (the process is then killed, the actor stays dead, and
        the attempt counts). `config` replaces the actor's config from now on (a learner restarted from
        the newest checkpoint); it is checked as at start."""
        old = self._procs.get(name)
        if old is None:
            raise ValueError(f"{name}: no such actor (known: {sorted(self._procs)})")
        if name in self._restarting:
            raise ValueError(f"{name}: a restart is already under way")
        if not old.dead:
            raise ValueError(f"{name} is alive (pid {old.proc.pid}): only a dead actor is restarted")
        if self._closing:
            raise SupervisorError(f"{name}: cannot restart, the supervisor is shut down")
        attempt = self.restarts(name) + 1
        if attempt > self.max_restarts:
            raise SupervisorError(
                f"{name}: restart budget spent ({self.max_restarts} restarts per run); "
                f"{self._last_words(old)}"
            )
        if config is not None:
            spec = msgspec.structs.replace(old.spec, config=config)
            self._check(spec)  # a bad config is refused before anything is killed or counted
            old.spec = spec
        self._restarts[name] = attempt
        self._restarting.add(name)
        try:
            await self._restart(old, attempt)
        finally:
            self._restarting.discard(name)

    async def _restart(self, old: _Proc, attempt: int) -> None:
        name = old.name
        backoff = min(self.restart_backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)
        self._emit("restarting", actor=name, attempt=attempt, backoff_s=backoff, after=old.reason)
        # The predecessor must be gone before its successor binds the same data endpoint (one killed
        # for silence may not have been reaped yet).
        with contextlib.suppress(ProcessLookupError):
            old.proc.kill()
        await asyncio.gather(wait_all([old.proc], 5.0), asyncio.sleep(backoff))
        if old.watcher is not None:
            old.watcher.cancel()
        if self._closing:
            raise SupervisorError(f"{name}: restart {attempt} abandoned, the supervisor shut down")
        moved = False
        try:
            try:
                entry = await self._spawn(old.spec, old.role, restarting=True)
            except NodeLost as e:
                moved = True  # its node is gone: node 0 takes its work, unpinned
                self._emit(
                    "relocated", actor=name, from_node=e.node, to_node=0, reason=str(e), level="warning"
                )
                old.spec = msgspec.structs.replace(old.spec, node=0, cpus=[])
                entry = await self._spawn(old.spec, old.role, restarting=True)
        except OSError as e:
            raise SupervisorError(f"{name}: restart {attempt} failed to spawn: {e}") from None
        try:
            await self._handshake([entry])
        except BaseException as e:  # a cancelled restart must not leave a half-started process either
            why = str(e) if isinstance(e, SupervisorError) else f"interrupted ({type(e).__name__})"
            reason = f"restart {attempt} failed: {why}"
            self._mark_dead(entry, reason, None)  # before the kill: its watcher must not call it a SIGKILL
            with contextlib.suppress(ProcessLookupError):
                entry.proc.kill()
            await wait_all([entry.proc], 5.0)
            entry.reason = reason
            after = time.monotonic() - entry.last_seen
            self._last_death[name] = ActorDied(name, reason, entry.proc.returncode, after)
            self._emit("restart_failed", actor=name, attempt=attempt, error=why, level="error")
            if not isinstance(e, SupervisorError):
                raise
            raise SupervisorError(
                f"{name}: restart {attempt} of {self.max_restarts} failed: {why}; {self._last_words(entry)}"
            ) from None
        entry.restarting = False
        self._emit("restarted", actor=name, attempt=attempt, pid=entry.proc.pid)
        if moved:  # every peer reaches it somewhere else now (ipc on node 0, the head's address elsewhere)
            for p in [p for p in self._procs.values() if p.ready and not p.dead and p is not entry]:
                await self.send(p.name, Peers(peers={name: self.endpoints(p.spec.node)[name]}))

    def _last_words(self, entry: _Proc) -> str:
        """How `entry` died and the tail of its log (errors and Dead first), for an error message."""
        died = self._last_death.get(entry.name)
        code = entry.proc.returncode if died is None or died.exit_code is None else died.exit_code
        reason = died.reason if died is not None else entry.reason
        path = self.run_dir / "logs" / f"{entry.role}-{entry.spec.rank}.jsonl"
        tail = logs.log_tail(path, _LOG_TAIL_LINES)
        lines = "\n  ".join(tail) if tail else f"(nothing in {path})"
        return f"last death: {reason} ({exit_code_text(code)}); last log lines ({path}):\n  {lines}"

    # -- shutdown -----------------------------------------------------------------------------------

    def kill(self, name: str) -> None:
        """SIGKILLs actor `name` (its death is then reported on `deaths` like any other)."""
        with contextlib.suppress(ProcessLookupError):
            self._procs[name].proc.kill()

    async def shutdown(self, *, reason: str = "done", grace_s: float = 5.0) -> None:
        """Shutdown to all, wait `grace_s`, then SIGTERM, then SIGKILL. Idempotent."""
        if self._closing:
            return
        self._closing = True
        self._emit("shutdown", reason=reason)
        for task in self._tasks[1:]:  # heartbeats stop first; the receive loop still hears Dead/Status
            task.cancel()
        for name, p in self._procs.items():
            if p.proc.returncode is None:
                await self.send(name, Shutdown(reason=reason))
        procs = [p.proc for p in self._procs.values()]
        if not await wait_all(procs, grace_s):
            for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
                for proc in procs:
                    if proc.returncode is None:
                        with contextlib.suppress(ProcessLookupError):
                            proc.send_signal(sig)
                if await wait_all(procs, wait):
                    break
        for task in self._tasks + [p.watcher for p in self._procs.values() if p.watcher]:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.control.close()
        self._proxy.stop()
        cleanup_shm(run_tag(self.run_dir))  # segments of actors that died holding them

    async def __aenter__(self) -> Supervisor:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown(reason="exit")

    def _emit(self, event: str, level: str = "info", **fields: Any) -> None:
        if self.log is not None:
            getattr(self.log, level)(event, **fields)
