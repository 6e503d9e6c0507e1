"""The drafter actor: trains the EAGLE head online on idle devices, and hands its weights to rollouts.

It stays dormant until the coordinator leases it a device, and until then only buffers. Rollout actors
stream `HiddenStates` of finished responses into its `OnlineBuffer`, and the buffer holds copies, never
views: received tensors alias zmq frames or shared-memory slots. While leased, each `step()` is one
short optimizer step. A `Preempt` is a control message, so the serve loop runs it before the next step:
preemption waits at most one training step. The actor answers `Released` with the latency measured from
the coordinator's send time.

Every `publish_every_steps` it sends a versioned, checksummed `DrafterUpdate` to `publish_to`, which is
rollout actors, or the coordinator. Every `checkpoint_every_steps` a background thread writes weights,
optimizer state and version atomically to the run directory. It writes with torch.save, read back with
weights_only=True: local disk, never the wire. A restarted actor (for example after SIGKILL) resumes
from its newest checkpoint with the same weights and version, and publishes them at once.

Several drafter actors training one drafter together (data parallel or periodic averaging) is not built
yet: one drafter actor per run for now.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

from slipstream.engine import hub
from slipstream.engine.buffer import OnlineBuffer
from slipstream.engine.drafter_train import DrafterTrainer
from slipstream.engine.eagle import EagleHead
from slipstream.engine.weights import load_model
from slipstream.protocols.control import Lease, Preempt, Released, Status
from slipstream.protocols.drafter import DrafterStats, DrafterUpdate, HiddenStates
from slipstream.runtime.actor import COORDINATOR, Actor, handler
from slipstream.runtime.codec import tensor_bytes


def weights_checksum(names: list[str], tensors: list[torch.Tensor]) -> str:
    """sha256 over names and raw tensor bytes, in order (what the receiver recomputes)."""
    h = hashlib.sha256()
    for name, t in zip(names, tensors, strict=True):
        h.update(name.encode())
        h.update(tensor_bytes(t).numpy().tobytes())
    return h.hexdigest()


class DrafterActor(Actor):
    role = "drafter"

    class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
        model: str  # the target (policy) model: a directory or a registry name
        buffer_bytes: int = 256 << 20  # online buffer bound (tokens + hidden states)
        batch_tokens: int = 2048  # tokens per training step (keeps a step, hence preemption, short)
        min_buffer_tokens: int = 64  # do not train on less than this
        lr: float = 1e-3  # AdamW learning rate
        unroll_steps: int = 1  # draft steps simulated per batch (1 = no unroll)
        publish_to: list[str] = []  # actors ("rollout:0", "coordinator") that receive DrafterUpdate
        publish_every_steps: int = 20
        checkpoint_every_steps: int = 50  # 0 = never
        seed: int = 0

    def on_start(self) -> None:
        cfg = self.config
        torch.manual_seed(cfg.seed + self.rank)
        self.target = load_model(hub.resolve(cfg.model))
        self.target.requires_grad_(False)
        self.head = EagleHead.for_target(self.target.config)
        self.trainer = DrafterTrainer(self.head, self.target, lr=cfg.lr, unroll_steps=cfg.unroll_steps)
        self.buffer = OnlineBuffer(cfg.buffer_bytes, seed=cfg.seed + self.rank)
        self.version = 0
        self.lease: Lease | None = None
        self.ckpt_dir = Path(self.run_dir or ".") / "drafter" / f"rank-{self.rank}"
        self._ckpt_jobs: queue.Queue[tuple[int, dict[str, Any]] | None] = queue.Queue(maxsize=1)
        self._ckpt_done: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
        self._ckpt_thread = threading.Thread(target=self._checkpoint_worker, name="checkpoint", daemon=True)
        self._ckpt_thread.start()
        self._last_loss = float("nan")
        self._trained_s = 0.0
        self._resume()

    def on_stop(self) -> None:
        self._ckpt_jobs.put(None)
        self._ckpt_thread.join(30)

    # -- messages -----------------------------------------------------------------------------------

    @handler
    def on_hidden(self, msg: HiddenStates, sender: str) -> None:
        # clone: the received tensors alias a zmq frame or a shared-memory slot of the sender
        self.buffer.add(msg.token_ids.clone(), msg.hidden.clone(), msg.response_start, msg.policy_version)

    @handler
    def on_lease(self, msg: Lease, sender: str) -> None:
        self.lease = msg
        if msg.threads > 0:
            torch.set_num_threads(msg.threads)
        if msg.cpus:
            os.sched_setaffinity(0, set(msg.cpus))
        self.log.info("leased", lease_id=msg.lease_id, device=msg.device, threads=msg.threads)

    @handler
    def on_preempt(self, msg: Preempt, sender: str) -> None:
        if self.lease is None or self.lease.lease_id != msg.lease_id:
            self.log.warning("preempt_unknown_lease", lease_id=msg.lease_id)
        self.lease = None
        latency = max(0, time.time_ns() - msg.sent_ns)
        self.send(COORDINATOR, Released(lease_id=msg.lease_id, latency_ns=latency))
        self.log.info(
            "released", lease_id=msg.lease_id, latency_ms=round(latency / 1e6, 3), reason=msg.reason
        )

    # -- training -----------------------------------------------------------------------------------

    def step(self) -> bool:
        self._report_checkpoints()
        if self.lease is None or self.buffer.stats().tokens < self.config.min_buffer_tokens:
            return False
        batch = self.buffer.sample_batch(self.config.batch_tokens)
        if batch is None:
            return False
        started = time.perf_counter()
        metrics = self.trainer.step(batch)
        self._trained_s += time.perf_counter() - started
        self._last_loss = float(metrics["loss"])
        self.version += 1
        cfg = self.config
        if cfg.publish_every_steps and self.version % cfg.publish_every_steps == 0:
            self._publish()
        if cfg.checkpoint_every_steps and self.version % cfg.checkpoint_every_steps == 0:
            self._checkpoint()
        return True

    def _publish(self) -> None:
        weights = self.trainer.weights()
        names = sorted(weights)
        tensors = [weights[n] for n in names]
        update = DrafterUpdate(
            version=self.version,
            policy_version=0,
            names=names,
            tensors=tensors,
            checksum=weights_checksum(names, tensors),
        )
        for dest in self.config.publish_to:
            self.send(dest, update)
        stats = DrafterStats(
            rank=self.rank,
            version=self.version,
            steps=self.trainer.steps,
            loss=self._last_loss,
            buffer_tokens=self.buffer.stats().tokens,
            elapsed_s=self._trained_s,
        )
        self.send(COORDINATOR, stats)

    # -- checkpoints --------------------------------------------------------------------------------

    def _checkpoint(self) -> None:
        state = {"version": self.version, **self.trainer.state_dict()}  # a deep copy: safe to write later
        try:
            self._ckpt_jobs.put_nowait((self.version, state))
        except queue.Full:
            self.log.info("checkpoint_skipped", version=self.version, why="previous write still running")

    def _checkpoint_worker(self) -> None:
        while (job := self._ckpt_jobs.get()) is not None:
            version, state = job
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            path = self.ckpt_dir / f"ckpt-{version:08d}.pt"
            tmp = path.with_suffix(".tmp")
            torch.save(state, tmp)
            os.replace(tmp, path)  # atomic: a reader never sees a half-written checkpoint
            for old in sorted(self.ckpt_dir.glob("ckpt-*.pt"))[:-2]:
                old.unlink(missing_ok=True)
            self._ckpt_done.put((version, str(path)))

    def _report_checkpoints(self) -> None:
        while not self._ckpt_done.empty():
            version, path = self._ckpt_done.get()
            self.log.info("checkpointed", version=version, path=path)
            self.send(
                COORDINATOR, Status(topic="drafter_checkpoint", fields={"version": version, "path": path})
            )

    def _resume(self) -> None:
        ckpts = sorted(self.ckpt_dir.glob("ckpt-*.pt"))
        if not ckpts:
            return
        state = torch.load(ckpts[-1], weights_only=True)
        self.trainer.load_state_dict(state)
        self.version = int(state["version"])
        self.log.info("resumed", version=self.version, path=str(ckpts[-1]))
        self._publish()  # peers get the restored weights at once
