"""Structured logs: structlog JSON lines, one file per actor in the run directory, plus a live stream.

Every record is one JSON object per line with `ts` (unix seconds, float: latency analysis needs more
than ISO-second precision), `level`, `event`, `role`, `rank` and the call's fields. The file is the
durable record; the live stream is a PUB socket connected to the coordinator's event proxy (XSUB →
XPUB), which `slipstream logs RUN --follow` subscribes to. PUB drops instead of blocking when nobody
keeps up, so logging never stalls a compute loop.

Metrics are not logs: the coordinator reduces its actors' stats messages per step into the record the
loop appends to metrics.jsonl (rl/loop.py).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, BinaryIO

import msgspec
import structlog
import zmq

from slipstream.runtime.transport import (
    CurveKeys,
    SocketOptions,
    actor_name,
    make_socket,
    start_authenticator,
)

_json = msgspec.json.Encoder()


class _Sink:
    """Writes rendered lines to a file, the live stream and (optionally) stderr. Thread-safe."""

    def __init__(self, file: BinaryIO | None, pub: zmq.Socket | None, topic: bytes, echo: bool) -> None:
        self._file, self._pub, self._topic, self._echo = file, pub, topic, echo
        self._lock = threading.Lock()

    def msg(self, line: bytes) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write(line + b"\n")
                self._file.flush()
            if self._pub is not None:
                try:
                    self._pub.send_multipart([self._topic, line], flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # a slow or absent subscriber must never stall the actor
            if self._echo:
                sys.stderr.buffer.write(line + b"\n")
                sys.stderr.flush()

    debug = info = warning = warn = error = critical = exception = fatal = log = msg

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            if self._pub is not None:
                self._pub.close(linger=200)
                self._pub = None


_sink: _Sink | None = None


def _render(_: Any, __: str, event: dict[str, Any]) -> bytes:
    return _json.encode(event)


def _default(obj: Any) -> Any:
    return repr(obj)


def configure(
    *,
    role: str,
    rank: int | None = None,
    run_dir: Path | None = None,
    events_endpoint: str | None = None,
    level: str = "info",
    echo: bool = False,
    curve: CurveKeys | None = None,
) -> structlog.stdlib.BoundLogger:
    """Configures this process's logging and returns a logger bound with role and rank.

    Writes to `run_dir/logs/{role}-{rank}.jsonl` when `run_dir` is given; publishes to
    `events_endpoint` when given (with `curve`, the run's keys, in a multi-node run); echoes to stderr
    when `echo`.
    """
    global _sink
    if _sink is not None:
        _sink.close()
    name = role if rank is None else f"{role}-{rank}"
    file = None
    if run_dir is not None:
        log_dir = Path(run_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        file = open(log_dir / f"{name}.jsonl", "ab")
    pub = None
    if events_endpoint is not None:
        pub = make_socket(
            zmq.Context.instance(),
            zmq.PUB,
            connect=events_endpoint,
            options=SocketOptions(sndhwm=10_000),
            curve=curve,
        )
    topic = (role if rank is None else actor_name(role, rank)).encode()
    _sink = _Sink(file, pub, topic, echo)
    global _json
    _json = msgspec.json.Encoder(enc_hook=_default)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt=None, utc=True, key="ts"),
            structlog.processors.format_exc_info,
            _render,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=lambda *_: _sink,
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger().bind(role=role, rank=rank)


def close() -> None:
    """Flushes and closes the sink (end of process)."""
    global _sink
    if _sink is not None:
        _sink.close()
        _sink = None


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of every actor log in `run_dir`, merged by time (malformed lines are skipped)."""
    records: list[dict[str, Any]] = []
    for path in sorted((Path(run_dir) / "logs").glob("*.jsonl")):
        with open(path, "rb") as f:
            for line in f:
                try:
                    rec = msgspec.json.decode(line)
                except msgspec.DecodeError:
                    continue  # a torn last line of a killed actor
                if isinstance(rec, dict):
                    records.append(rec)
    records.sort(key=lambda r: r.get("ts", 0.0))
    return records


def log_tail(path: Path, n: int, max_chars: int = 400) -> list[str]:
    """The last `n` lines of an actor's JSON-lines log, "error"-level and "dead" records first."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))
            raw = f.read().splitlines()[-200:]
    except OSError:
        return []
    lines = [line.decode(errors="replace") for line in raw if line.strip()]

    def grave(line: str) -> bool:
        try:
            rec = msgspec.json.decode(line)
        except msgspec.DecodeError:
            return False  # a torn last line of a killed process
        return isinstance(rec, dict) and (rec.get("level") == "error" or rec.get("event") == "dead")

    graves = [line for line in lines if grave(line)][-n:]
    rest = [line for line in lines if line not in graves][-(n - len(graves)) :] if len(graves) < n else []
    return [line if len(line) <= max_chars else line[:max_chars] + "…" for line in graves + rest]


class EventProxy:
    """XSUB (actors' log PUBs connect) → XPUB (log followers connect), on its own thread. A multi-node run's
    XSUB also listens on `tcp` (the head's events port), CURVE with the run's keys on both its endpoints."""

    def __init__(self, inbound: str, outbound: str, *, tcp: str = "", curve: CurveKeys | None = None) -> None:
        self.inbound, self.outbound, self.tcp, self.curve = inbound, outbound, tcp, curve
        self._ctx = zmq.Context()
        self._auth = start_authenticator(self._ctx, curve) if curve is not None else None
        self._thread: threading.Thread | None = None
        self._ctrl_endpoint = f"inproc://events-ctrl-{id(self)}"

    def start(self) -> None:
        xsub = make_socket(self._ctx, zmq.XSUB, bind=self.inbound, curve=self.curve)
        if self.tcp:
            xsub.bind(self.tcp)
        xpub = make_socket(self._ctx, zmq.XPUB, bind=self.outbound)
        ctrl = self._ctx.socket(zmq.PAIR)
        ctrl.bind(self._ctrl_endpoint)
        self._ctrl = self._ctx.socket(zmq.PAIR)
        self._ctrl.connect(self._ctrl_endpoint)

        def run() -> None:
            try:
                zmq.proxy_steerable(xsub, xpub, None, ctrl)
            except zmq.ContextTerminated:
                pass
            finally:
                for s in (xsub, xpub, ctrl):
                    s.close(linger=0)

        self._thread = threading.Thread(target=run, name="event-proxy", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._ctrl.send(b"TERMINATE")
            self._thread.join(5)
            self._ctrl.close(linger=0)
            self._thread = None
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
