"""Node agents: the processes that start a multi-node run's actors on the nodes other than the head.

`slipstream train CONFIG --nnodes N --node-rank R --head HOST:PORT` with R > 0 runs `run_agent`: it connects
to the head's agents port (CURVE, the run's keys), says which node it serves and what the node has (cores,
GPUs, its routable address), then starts the actor processes the head's `AgentLauncher` asks for, reports
each one's exit, and stops them all when the head says the run is over — or when the head falls silent for
`head_timeout_s` (fail together: no actor outlives its run on any node). Actors die with their agent too
(PR_SET_PDEATHSIG), and a node's start removes the shared-memory segments a crashed earlier attempt left.

The non-obvious choice: an agent relays no actor traffic. Each actor connects to the head's control socket
and its peers' data sockets itself, over CURVE, so a message crosses the network once and a tensor frame
is never copied through a relay; the agent is about processes only (start, exit, kill). On the head, an
agent's node is served by `AgentLauncher`, whose handles the supervisor watches like local processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
import zmq
import zmq.asyncio

from slipstream.protocols import PROTOCOL_VERSION, Message
from slipstream.protocols.control import Heartbeat
from slipstream.protocols.node import AgentHello, Exited, Kill, Launch, Launched, StopAgent
from slipstream.runtime.cluster import AGENTS, CONTROL, EVENTS, Cluster, node_env
from slipstream.runtime.codec import Codec, ProtocolError
from slipstream.runtime.fork_server import ForkServers
from slipstream.runtime.launcher import ActorLaunch, NodeLost, ProcessHandle, actor_command, spawn
from slipstream.runtime.shm import cleanup as cleanup_shm
from slipstream.runtime.transport import CurveKeys, make_socket, run_tag, start_authenticator

__all__ = ["AgentLauncher", "RemoteProcess", "run_agent"]

HEARTBEAT_S = 1.0
LOST_AFTER_S = 10.0  # an agent (or the head) silent this long is lost


class RemoteProcess:
    """A handle on an actor process another node's agent started: the supervisor watches it as a local one."""

    def __init__(self, launcher: AgentLauncher, name: str, node: int) -> None:
        self._launcher, self.name, self.node = launcher, name, node
        self.pid = 0
        self.returncode: int | None = None
        self.exit_reason = ""  # set when the node was lost rather than the process seen to exit
        self._exited = asyncio.get_running_loop().create_future()

    def _exit(self, code: int, reason: str = "") -> None:
        if self.returncode is None:
            self.returncode, self.exit_reason = code, reason
            self._exited.set_result(code)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self._launcher.signal(self, int(sig))

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class AgentLauncher:
    """The head's side of the node agents: waits for them, then starts actors on their nodes."""

    def __init__(
        self,
        cluster: Cluster,
        *,
        curve: CurveKeys | None,
        log: Any = None,
        lost_after_s: float = LOST_AFTER_S,
    ) -> None:
        self.cluster, self.log, self.lost_after_s = cluster, log, lost_after_s
        self.ctx = zmq.asyncio.Context()
        self._auth = start_authenticator(self.ctx, curve, self._refused) if curve is not None else None
        endpoint = f"tcp://{cluster.address}:{cluster.port(AGENTS)}"
        self._router = make_socket(self.ctx, zmq.ROUTER, bind=endpoint, curve=curve)
        self._codec = Codec()
        self.agents: dict[int, AgentHello] = {}
        self._seen: dict[int, float] = {}
        self._procs: dict[str, RemoteProcess] = {}
        self._launched: dict[str, tuple[int, asyncio.Future[Launched]]] = {}  # name -> (node, reply)
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    @property
    def nodes(self) -> Collection[int]:
        """Every node but the head's: one whose agent is lost fails a launch naming it."""
        return tuple(range(1, self.cluster.nnodes))

    async def wait_for_agents(self, timeout_s: float) -> dict[int, AgentHello]:
        """Returns once every other node's agent has said hello; TimeoutError names the missing nodes."""
        self._tasks.append(asyncio.create_task(self._recv_loop(), name="agents-recv"))
        deadline = time.monotonic() + timeout_s
        want = set(range(1, self.cluster.nnodes))
        while set(self.agents) != want:
            if time.monotonic() > deadline:
                missing = sorted(want - set(self.agents))
                raise TimeoutError(
                    f"node(s) {missing} did not join within {timeout_s:g}s: start `slipstream train ... "
                    f"--nnodes {self.cluster.nnodes} --node-rank R --head {self.cluster.head_host}:"
                    f"{self.cluster.head_port}` there (same config, same keys)"
                )
            await asyncio.sleep(0.05)
        self._tasks.append(asyncio.create_task(self._watch_loop(), name="agents-watch"))
        return dict(self.agents)

    async def launch(self, a: ActorLaunch) -> RemoteProcess:
        if a.node not in self.agents:  # the supervisor restarts it on the head's node instead
            raise NodeLost(a.node, "has no agent (lost, or never joined)")
        proc = RemoteProcess(self, a.name, a.node)
        self._procs[a.name] = proc
        reply: asyncio.Future[Launched] = asyncio.get_running_loop().create_future()
        self._launched[a.name] = (a.node, reply)
        msg = Launch(
            name=a.name, actor=a.actor, rank=a.rank, env=a.env, cpus=a.cpus,
            data_port=a.data_port, handshake_timeout_s=a.handshake_timeout_s,
        )  # fmt: skip
        await self._send(a.node, msg)
        try:
            launched = await reply  # or the node is declared lost meanwhile
        finally:
            self._launched.pop(a.name, None)
        if not launched.pid:
            raise OSError(f"{a.name}: node {a.node} could not start it: {launched.error}")
        proc.pid = launched.pid
        return proc

    def signal(self, proc: RemoteProcess, sig: int) -> None:
        task = asyncio.ensure_future(self._send(proc.node, Kill(name=proc.name, signal=sig)))
        self._tasks.append(task)

    async def close(self, reason: str = "done") -> None:
        """Tells every agent the run is over (they stop their actors and exit). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for node in self.agents:
            await self._send(node, StopAgent(reason=reason))
        await asyncio.sleep(0.2)  # let the stops leave before the socket closes (linger 0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._router.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()

    # -- internals ----------------------------------------------------------------------------------

    def _refused(self, client_key: str) -> None:
        self._emit("peer_refused", socket="agents", client_key=client_key[:8], level="warning")

    async def _send(self, node: int, msg: Message) -> None:
        with contextlib.suppress(zmq.ZMQError):  # an agent gone: its watch loop reports the node lost
            await self._router.send_multipart([f"agent:{node}".encode(), *self._codec.encode(msg)])

    async def _recv_loop(self) -> None:
        while True:
            frames = await self._router.recv_multipart(copy=False)
            sender = frames[0].bytes.decode(errors="replace")
            try:
                msg = self._codec.decode(frames[1:])
            except ProtocolError as e:
                self._emit("dropped_malformed", sender=sender, error=str(e), level="warning")
                continue
            node = _node_of(sender)
            if node is None:
                self._emit("unknown_sender", sender=sender, kind=msg.kind, level="warning")
                continue
            self._seen[node] = time.monotonic()
            if isinstance(msg, AgentHello):
                if msg.protocol_version != PROTOCOL_VERSION or msg.node != node:
                    self._emit("agent_refused", node=node, protocol=msg.protocol_version, level="error")
                    await self._send(
                        node, StopAgent(reason=f"protocol {msg.protocol_version} != {PROTOCOL_VERSION}")
                    )
                    continue
                if node not in self.agents:
                    self._emit("agent_joined", node=node, host=msg.host, address=msg.address, cores=msg.cores,
                               gpus=msg.gpus)  # fmt: skip
                self.agents[node] = msg
                await self._send(node, Heartbeat(seq=0, sent_ns=time.time_ns()))  # the hello is answered
            elif isinstance(msg, Launched):
                if (pending := self._launched.get(msg.name)) is not None and not pending[1].done():
                    pending[1].set_result(msg)
            elif isinstance(msg, Exited):
                proc = self._procs.get(msg.name)
                if proc is not None and proc.pid in (0, msg.pid):
                    proc._exit(msg.code)

    async def _watch_loop(self) -> None:
        seq = 0
        while True:
            seq += 1
            now = time.monotonic()
            for node in list(self.agents):
                if now - self._seen.get(node, now) > self.lost_after_s:
                    self._lost(node, now - self._seen[node])
                    continue
                await self._send(node, Heartbeat(seq=seq, sent_ns=time.time_ns()))
            await asyncio.sleep(HEARTBEAT_S)

    def _lost(self, node: int, silent_s: float) -> None:
        self._emit("node_lost", node=node, silent_s=round(silent_s, 1), level="error")
        self.agents.pop(node, None)
        for where, reply in self._launched.values():
            if where == node and not reply.done():
                reply.set_exception(NodeLost(node, "lost while starting an actor there"))
        for proc in self._procs.values():
            if proc.node == node:
                proc._exit(-signal.SIGKILL, f"node {node} lost (its agent silent for {silent_s:.0f}s)")

    def _emit(self, event: str, level: str = "info", **fields: Any) -> None:
        if self.log is not None:
            getattr(self.log, level)(event, **fields)


def _node_of(identity: str) -> int | None:
    role, _, rank = identity.partition(":")
    return int(rank) if role == "agent" and rank.isdecimal() else None


# -- the node's side ----------------------------------------------------------------------------------------


async def run_agent(
    cluster: Cluster,
    run_dir: Path,
    *,
    key_file: Path | None,
    log: Any,
    join_timeout_s: float = 300.0,
    head_timeout_s: float = LOST_AFTER_S,
) -> int:
    """Serves this node's part of a run until the head stops it (0) or is lost (1)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cleanup_shm(run_tag(run_dir, cluster.node_rank))  # what a crashed earlier attempt on this node left
    agent = _NodeAgent(cluster, run_dir, key_file=key_file, log=log)
    log.info(
        "agent_started", node=cluster.node_rank, head=cluster.head_endpoint(AGENTS), address=cluster.address
    )
    code = 1
    try:
        code = await agent.serve(join_timeout_s=join_timeout_s, head_timeout_s=head_timeout_s)
        return code
    finally:
        await agent.close(stopped=code == 0)


class _NodeAgent:
    """One node's agent: its socket to the head, and the actor processes it started for the head."""

    def __init__(self, cluster: Cluster, run_dir: Path, *, key_file: Path | None, log: Any) -> None:
        self.cluster, self.run_dir, self.key_file, self.log = cluster, run_dir, key_file, log
        self.ctx = zmq.asyncio.Context()
        self.sock, self.key_mtime = self._connect()
        self.codec = Codec()
        self.children: dict[str, ProcessHandle] = {}
        self.forks = ForkServers(log)  # actors forked, not exec'd, where they can be (runtime/fork_server.py)
        self.watchers: list[asyncio.Task[None]] = []
        self.hello = AgentHello(
            node=cluster.node_rank, host=socket.gethostname(), address=cluster.address, pid=os.getpid(),
            cores=len(os.sched_getaffinity(0)),
            gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0,
            protocol_version=PROTOCOL_VERSION,
        )  # fmt: skip

    def _connect(self) -> tuple[zmq.asyncio.Socket, float]:
        """A DEALER to the head's agents port, with the run's key as it is now; and the key file's mtime."""
        # The key as it is now: node 0 makes a new one for every start of a run, and a node that started
        # first may have read the last attempt's (it reconnects when the file changes, until it has joined).
        keys = CurveKeys.load(self.key_file) if self.key_file is not None else None
        mtime = self.key_file.stat().st_mtime if self.key_file is not None else 0.0
        identity = f"agent:{self.cluster.node_rank}"
        return make_socket(
            self.ctx, zmq.DEALER, identity=identity, connect=self.cluster.head_endpoint(AGENTS), curve=keys
        ), mtime

    async def send(self, msg: Message) -> None:
        """Sends one message to the head."""
        await self.sock.send_multipart(self.codec.encode(msg))

    async def serve(self, *, join_timeout_s: float, head_timeout_s: float) -> int:
        """Says hello until the head answers, then heartbeats and does what it asks: 0 stopped, 1 lost."""
        joined, last_heard, next_hello, next_beat = False, time.monotonic(), 0.0, 0.0
        join_deadline = time.monotonic() + join_timeout_s
        while True:
            now = time.monotonic()
            if not joined and now >= next_hello:
                if now > join_deadline:
                    self.log.error(
                        "join_timeout", seconds=join_timeout_s, head=self.cluster.head_endpoint(AGENTS)
                    )
                    return 1
                if self.key_file is not None and self.key_file.stat().st_mtime != self.key_mtime:
                    self.sock.close(linger=0)
                    self.sock, self.key_mtime = self._connect()
                await self.send(self.hello)  # again until answered: the head may not be up yet
                next_hello = now + HEARTBEAT_S
            if joined and now - last_heard > head_timeout_s:
                self.log.error("head_lost", silent_s=round(now - last_heard, 1))
                await self.stop_all(grace_s=2.0)
                return 1
            if joined and now >= next_beat:
                await self.send(Heartbeat(seq=0, sent_ns=time.time_ns()))
                next_beat = now + HEARTBEAT_S
            if (msg := await self._receive()) is None:
                continue
            last_heard, joined = time.monotonic(), True
            if await self._handle(msg):
                return 0

    async def _receive(self) -> Message | None:
        """The head's next message within a heartbeat interval; None if none came or it was malformed."""
        if not await self.sock.poll(int(HEARTBEAT_S * 1000)):
            return None
        try:
            return self.codec.decode(await self.sock.recv_multipart(copy=False))
        except ProtocolError as e:
            self.log.warning("dropped_malformed", error=str(e))
            return None

    async def _handle(self, msg: Message) -> bool:
        """Starts, signals or stops actors as the head asks: True once it said the run is over."""
        if isinstance(msg, Launch):
            await self._start(msg)
        elif isinstance(msg, Kill):
            if (proc := self.children.get(msg.name)) is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(msg.signal)
        elif isinstance(msg, StopAgent):
            self.log.info("stop", reason=msg.reason)
            await self.stop_all(grace_s=5.0)
            return True
        return False

    async def _start(self, msg: Launch) -> None:
        """Spawns the actor the head asked for, tells the head its pid (or why not), and watches its exit."""
        cluster = self.cluster
        launch = ActorLaunch(
            name=msg.name, actor=msg.actor, rank=msg.rank, node=cluster.node_rank, run_dir=str(self.run_dir),
            env=msg.env, cpus=msg.cpus, handshake_timeout_s=msg.handshake_timeout_s, data_port=msg.data_port,
        )  # fmt: skip
        cmd = actor_command(
            launch, control=cluster.head_endpoint(CONTROL), events=cluster.head_endpoint(EVENTS),
            curve_key=str(self.key_file or ""), data_host=cluster.address, parent_pid=os.getpid(),
        )  # fmt: skip
        try:
            env = {**node_env(cluster.address), **msg.env}
            cpus = [c for c in msg.cpus if c in os.sched_getaffinity(0)]
            proc = await spawn(cmd, env=env, cpus=cpus, forks=self.forks)
        except OSError as e:
            await self.send(Launched(name=msg.name, pid=0, error=str(e)))
            return
        self.children[msg.name] = proc
        self.log.info("actor_started", actor=msg.name, pid=proc.pid)
        self.watchers.append(asyncio.create_task(self._watch(msg.name, proc)))
        await self.send(Launched(name=msg.name, pid=proc.pid))

    async def _watch(self, name: str, proc: ProcessHandle) -> None:
        """Tells the head when an actor exits, and with what code."""
        code = await proc.wait()
        self.log.info("actor_exited", actor=name, pid=proc.pid, code=code)
        with contextlib.suppress(zmq.ZMQError):
            await self.send(Exited(name=name, pid=proc.pid, code=code))

    async def stop_all(self, grace_s: float) -> None:
        """SIGTERM to every live actor, SIGKILL to those still alive after `grace_s`."""
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            alive = [p for p in self.children.values() if p.returncode is None]
            for p in alive:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(sig)
            if alive:
                await asyncio.wait([asyncio.ensure_future(p.wait()) for p in alive], timeout=wait)

    async def close(self, *, stopped: bool) -> None:
        """Stops the actors (unless the head's stop already did: `stopped`), ends the watchers, closes the socket."""
        if not stopped:
            await self.stop_all(grace_s=0.5)
        for task in self.watchers:
            task.cancel()
        await asyncio.gather(*self.watchers, return_exceptions=True)
        self.sock.close(linger=0)
        self.ctx.term()
