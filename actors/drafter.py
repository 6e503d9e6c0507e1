"""The drafter actor: trains the EAGLE head online in leased idle device time, and publishes it.

Dormant until the coordinator leases it a device, it buffers the `HiddenStates` rollouts stream to it
(copies: received tensors alias frames or shared-memory slots). While leased, each `step()` is one short
optimizer step, abandoned between phases when control arrives; a `Preempt` is served next, and `Released`
carries the latency from the coordinator's send. Of the target it holds only what the head reads
(embedding, final norm, LM head: `load_head_parts`), updated in place from the learner's pushes (deltas
from another host) between two steps, so it trains against the moving policy.

Several ranks (`world_size`) train one drafter by periodic averaging: rank 0 owns it and alone versions,
checkpoints and publishes it; the others send `DrafterDelta`s (local − base), folded in as
global += delta / n (n: ranks training now), and adopt the `DrafterUpdate`s it sends back. Versions count
optimizer steps folded in; checkpoints let a restarted owner resume. The protocol: docs/actors.md.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import msgspec
import torch

from slipstream.engine import hub
from slipstream.engine.buffer import OnlineBuffer
from slipstream.engine.device import parse_device, require_device
from slipstream.engine.drafter_train import DrafterTrainer
from slipstream.engine.eagle import EagleHead
from slipstream.engine.weight_receiver import WeightReceiver, mistyped
from slipstream.engine.weights import load_head_parts
from slipstream.protocols.control import Lease, Preempt, Released, SaveCheckpoint, Status
from slipstream.protocols.drafter import DrafterDelta, DrafterStats, DrafterUpdate, HeadAck, HiddenStates
from slipstream.protocols.learner import WeightUpdate
from slipstream.runtime import cuda_ipc
from slipstream.runtime.actor import COORDINATOR, Actor, handler
from slipstream.runtime.codec import checksum
from slipstream.runtime.process import memory_now, pin_threads, release_freed_memory
from slipstream.runtime.transport import actor_name

ROLE = "drafter"
OWNER = actor_name(ROLE, 0)  # the rank that owns the one drafter of a run


def _crossed(last: int, now: int, every: int) -> bool:
    """True when a multiple of `every` lies in (last, now]: versions may advance by more than one."""
    return every > 0 and now // every > last // every


class DrafterActor(Actor):
    role = ROLE

    class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
        model: str  # the target (policy) model: a directory or a registry name
        buffer_bytes: int = 256 << 20  # online buffer bound (tokens + hidden states)
        batch_tokens: int = 2048  # tokens per training step (keeps a step, hence preemption, short)
        min_buffer_tokens: int = 64  # do not train on less than this
        lr: float = 1e-3  # AdamW learning rate
        unroll_steps: int = 1  # draft steps simulated per batch (1 = no unroll)
        # Steps over which the learning rate ramps up from lr / warmup_steps (0: none): a head started from a
        # trained one (init_from) was knocked off its optimum by AdamW's first full-size steps (docs/actors.md)
        warmup_steps: Annotated[int, msgspec.Meta(ge=0)] = 0
        publish_to: list[str] = []  # actors ("rollout:0", "coordinator") that receive DrafterUpdate (owner)
        publish_every_steps: int = 20
        publish_min_interval_s: float = 1.0  # and at most this often: rollouts use only the newest anyway
        checkpoint_every_steps: int = 50  # 0 = never (owner)
        seed: int = 0
        world_size: Annotated[int, msgspec.Meta(ge=1)] = 1  # drafter ranks training this drafter; 0 owns it
        sync_every_steps: Annotated[int, msgspec.Meta(ge=1)] = 10  # local steps between deltas/updates
        init_from: str = ""  # owner: an exported EAGLE head to start from when no checkpoint exists
        device: str = "cpu"  # where the target's head parts, the drafter, its optimizer and batches live
        # Re-hash the applied head parts into head_synced's `checksum` (proves the sync exact, as the
        # rollout's verify_applied_weights). Off by default: a sha256 of the embedding on the core the
        # rollout applies its weights on, at the same moment (the buckets are checked on arrival anyway).
        verify_applied_head: bool = False
        # Niceness of the compute thread (and the threads it starts: OpenMP's, the checkpoint writer), not of
        # the IO thread that heartbeats. Drafter training is opportunistic: on a core it shares with a reward
        # worker, the coordinator or a rollout's message handling, it must yield at once (0: no change).
        nice: Annotated[int, msgspec.Meta(ge=0, le=19)] = 19

        def __post_init__(self) -> None:
            parse_device(self.device)

    def on_start(self) -> None:
        cfg = self.config
        if self.rank >= cfg.world_size:
            raise ValueError(f"world_size: {cfg.world_size} ranks, but this is rank {self.rank}")
        self.owner = self.rank == 0
        self.group = [actor_name(ROLE, r) for r in range(1, cfg.world_size)] if self.owner else [OWNER]
        missing = [name for name in self.group if name not in self.peers]
        if missing:
            raise ValueError(f"world_size: {cfg.world_size} ranks, but {missing} are not in this run")
        self.device = require_device(cfg.device)
        if cfg.nice and hasattr(os, "setpriority"):
            # Linux: a thread id names one thread here, so the IO thread (started before) keeps its priority.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), cfg.nice)
        torch.manual_seed(cfg.seed + self.rank)
        # Only the embedding, final norm and LM head: the drafter never runs the target's layers.
        self.target = load_head_parts(hub.resolve(cfg.model), device=self.device)
        self.target.requires_grad_(False)
        self.head = EagleHead.for_target(self.target.config).to(self.device)
        self.trainer = DrafterTrainer(
            self.head, self.target, lr=cfg.lr, unroll_steps=cfg.unroll_steps, warmup_steps=cfg.warmup_steps
        )
        self.buffer = OnlineBuffer(cfg.buffer_bytes, seed=cfg.seed + self.rank)
        self.version = 0  # owner: of the drafter; other ranks: of the newest global adopted
        # The newest policy version whose hidden states these weights have trained on (own steps, folded
        # deltas, adopted updates); data merely buffered does not count: it has not shaped the drafter.
        self.policy_version = 0
        self.leases: dict[int, Lease] = {}  # lease id -> lease: the devices (cores) it may train on now
        # The policy version of the target's head parts held (0: as loaded), and the learner's pushes of
        # them staged by version: bucket → {name: tensor} (clones), applied once every bucket is in.
        self.head_version = 0
        self._head_params = dict(self.target.named_parameters())
        self._head_staged: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
        self.receiver = WeightReceiver(
            expected={name: (p.shape, p.dtype) for name, p in self._head_params.items()},
            base=lambda name: self._head_params[name].detach(),
            checksum=checksum,
            map_refs=cuda_ipc.map_refs,
            device_checksum=cuda_ipc.device_checksum,
            version=self.head_version,
            held_as="the head's {}",
            holds="the head is v{}",
        )
        self._shapes = {name: (t.shape, t.dtype) for name, t in self.head.state_dict().items()}
        self._names = sorted(self._shapes)
        self._last_loss = float("nan")
        self._trained_s = 0.0
        # owner: where the version stood when last sent to the group / published / checkpointed
        self._shared_version = self._published_version = self._checkpointed_version = 0
        self._published_at = float("-inf")
        self._remote_merged = False  # deltas folded in since the group last heard
        self._lease_started: dict[int, int] = {}  # lease id -> when it arrived (monotonic ns), its span
        self._active: dict[str, float] = {}  # rank → monotonic time until which it counts as training
        self._last_delta_at: dict[str, float] = {}
        # other ranks: the base deltas are taken against, and what was trained since it
        self._base: dict[str, torch.Tensor] | None = None
        self._unsent_steps = self._unsent_tokens = 0
        self._unsent_s = 0.0
        self.ckpt_dir = Path(self.run_dir or ".") / "drafter" / f"rank-{self.rank}"
        self._ckpt_jobs: queue.Queue[tuple[int, dict[str, Any]] | None] = queue.Queue(maxsize=1)
        self._ckpt_done: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
        self._ckpt_thread: threading.Thread | None = None
        if self.owner:
            self._ckpt_thread = threading.Thread(
                target=self._checkpoint_worker, name="checkpoint", daemon=True
            )
            self._ckpt_thread.start()
            self._resume()
        else:
            self._send_delta(final=True)  # zero steps: asks the owner for the global weights

    def on_stop(self) -> None:
        if self._ckpt_thread is not None:
            self._ckpt_jobs.put(None)
            self._ckpt_thread.join(30)

    # -- messages -----------------------------------------------------------------------------------

    @handler
    def on_hidden(self, msg: HiddenStates, sender: str) -> None:
        # clone: the received tensors alias a zmq frame or a shared-memory slot of the sender
        self.buffer.add(msg.token_ids.clone(), msg.hidden.clone(), msg.response_start, msg.policy_version)

    @handler
    def on_lease(self, msg: Lease, sender: str) -> None:
        self.leases[msg.lease_id] = msg
        self._lease_started[msg.lease_id] = time.monotonic_ns()
        self._fit_to_leases()
        self.log.info("leased", lease_id=msg.lease_id, device=msg.device, threads=msg.threads, cpus=msg.cpus)

    @handler
    def on_preempt(self, msg: Preempt, sender: str) -> None:
        lease = self.leases.pop(msg.lease_id, None)
        if lease is None:
            self.log.warning("preempt_unknown_lease", lease_id=msg.lease_id)
        if self.leases:
            self._fit_to_leases()  # off the returned device at once, on with the others
        else:
            # What the training steps kept for reuse goes back to the host before the core does: the
            # learner, next, peaks while this drafter idles. The next lease faults its pages in again.
            release_freed_memory()
        latency = max(0, time.time_ns() - msg.sent_ns)
        self.send(COORDINATOR, Released(lease_id=msg.lease_id, latency_ns=latency))
        leased_at = self._lease_started.pop(msg.lease_id, None)
        if leased_at is not None:  # from the lease to its release: what this device did for the drafter
            self.spans.add(
                "lease",
                leased_at,
                time.monotonic_ns() - leased_at,
                self.policy_version,
                lease_id=msg.lease_id,
                device=lease.device if lease is not None else None,
                preempt_ms=round(latency / 1e6, 3),
                reason=msg.reason,
            )
        self.log.info(
            "released",
            lease_id=msg.lease_id,
            latency_ms=round(latency / 1e6, 3),
            reason=msg.reason,
            **memory_now(),
        )
        self.send(COORDINATOR, self._stats())  # training seconds so far: the coordinator's reclaimed time
        # after Released: the release latency never includes a delta or an update
        if self.owner:
            self._share(group_now=True)
        else:
            self._send_delta(final=True)

    def _fit_to_leases(self) -> None:
        """Threads and cores to what the leases held grant: their threads summed, their cores joined. Every
        thread of the process is pinned (an OpenMP worker keeps the cores it was created with), so training
        never runs on a core whose rollout has it back."""
        threads = sum(lease.threads for lease in self.leases.values())
        if threads > 0:
            torch.set_num_threads(threads)
        cpus = {cpu for lease in self.leases.values() for cpu in lease.cpus}
        if cpus:
            pin_threads(cpus)

    @handler
    def on_checkpoint(self, msg: SaveCheckpoint, sender: str) -> None:
        """The run checkpoints (step `msg.step`): the owner saves its drafter too, whatever its own cadence,
        so a restarted or resumed drafter starts from at most one checkpoint interval back."""
        if self.owner and self.version != self._checkpointed_version:
            if self._checkpoint(wait=True):
                self._checkpointed_version = self.version

    @handler
    def on_delta(self, msg: DrafterDelta, sender: str) -> None:
        """Owner: folds a rank's delta into the global drafter (or drops it, saying why)."""
        why = self._check_delta(msg, sender)
        if why is not None:
            self.log.warning("delta_dropped", sender=sender, base_version=msg.base_version, why=why)
            return
        now = time.monotonic()
        if msg.steps:
            n = self._training_ranks(now, sender)
            weights = self.head.state_dict()  # views of the parameters: updated in place
            with torch.no_grad():
                for name, delta in zip(msg.names, msg.tensors, strict=True):
                    weights[name].add_(delta.to(weights[name].device), alpha=1.0 / n)
            self.version += msg.steps
            self.policy_version = max(self.policy_version, msg.policy_version)
            self._remote_merged = True
            self.log.info(
                "delta_merged",
                sender=sender,
                steps=msg.steps,
                tokens=msg.tokens,
                ranks=n,
                base_version=msg.base_version,
                version=self.version,
                policy_version=self.policy_version,
            )
        if msg.final:
            self._active.pop(sender, None)
            self._last_delta_at.pop(sender, None)
        elif msg.steps:
            # expected back within about one interval; after twice that (+ 1 s) it no longer counts
            gap = now - self._last_delta_at.get(sender, now - msg.elapsed_s)
            self._last_delta_at[sender] = now
            self._active[sender] = now + 2.0 * gap + 1.0
        if not msg.steps:
            self.send(sender, self._update())  # it is not training: it only wants the current weights

    @handler
    def on_update(self, msg: DrafterUpdate, sender: str) -> None:
        """Other ranks: adopts the owner's global weights, carrying over what it has not sent yet."""
        if self.owner or sender != OWNER:
            self.log.warning("update_ignored", sender=sender, version=msg.version, why="not from the owner")
            return
        why = self._check_weights(list(msg.names), list(msg.tensors))
        if why is None and checksum(msg.names, msg.tensors) != msg.checksum:
            why = "checksum mismatch"
        if why is not None:
            self.log.error("update_refused", version=msg.version, why=why)
            return
        exact = self._base is None or self._unsent_steps == 0
        weights = self.head.state_dict()
        with torch.no_grad():
            if self._base is None:
                self._base = {name: torch.empty_like(weights[name]) for name in self._names}
            for name, received in zip(msg.names, msg.tensors, strict=True):
                new = received.to(weights[name].device)
                if exact:
                    weights[name].copy_(new)
                else:
                    weights[name].add_(new - self._base[name])  # local = global + (local − base)
                self._base[name].copy_(new)
        self.version = msg.version
        self.policy_version = max(self.policy_version, msg.policy_version)
        if exact:
            # Computed from this rank's own weights, so the coordinator can see the ranks agree bitwise.
            digest = checksum(self._names, [weights[n] for n in self._names])
            fields = {"rank": self.rank, "version": self.version, "checksum": digest}
            self.send(COORDINATOR, Status(topic="drafter_synced", fields=fields))
        self.log.info("adopted", version=msg.version, exact=exact, unsent_steps=self._unsent_steps)

    @handler
    def on_weights(self, msg: WeightUpdate, sender: str) -> None:
        """Stages a bucket of the learner's push of the head parts; applies a complete version, between two
        `step()`s. What a bucket is (duplicate, dropped, refused, accepted) is the one receiver's call, as a
        rollout's; a refused one is logged and said to the coordinator, and serving goes on."""
        verdict = self.receiver.receive(
            version=msg.version, bucket=msg.bucket, num_buckets=msg.num_buckets, names=msg.names,
            tensors=msg.tensors, checksum=msg.checksum, encoding=msg.encoding, base_version=msg.base_version,
            ipc=msg.ipc,
        )  # fmt: skip
        if verdict.kind == "duplicate":
            # The head it holds, again: after a restart the learner's push in flight when it died (queued by
            # the learner's socket) and the coordinator's re-push both arrive; it applied one already.
            self.log.info("head_duplicate", version=msg.version, bucket=msg.bucket)
            return
        if verdict.kind == "dropped":
            self.log.info("head_delta_dropped", version=msg.version, bucket=msg.bucket, why=verdict.error)
            return
        if verdict.kind == "refused":
            self._head_staged.pop(msg.version, None)  # that version can no longer complete
            self.receiver.forget(msg.version)
            self._head_refused(msg.version, f"bucket {msg.bucket}: {verdict.error}")
            return
        assert verdict.tensors is not None
        buckets = self._head_staged.setdefault(msg.version, {})
        this = dict(zip(msg.names, verdict.tensors, strict=True))
        received = {n: t for bucket in buckets.values() for n, t in bucket.items()} | this
        # Complete when it holds every head part: the head's buckets lead the learner's push to the rollouts
        # too (numbered over that whole push), or make a push of their own (numbered over themselves).
        if received.keys() != self._head_params.keys():
            if len(buckets) + (msg.bucket not in buckets) == msg.num_buckets:  # every bucket of the push
                del self._head_staged[msg.version]
                self.receiver.forget(msg.version)
                missing = sorted(self._head_params.keys() - received.keys())
                self._head_refused(msg.version, f"the buckets lack {missing}")
                return
            # clone: the received tensors alias a zmq frame or a shared-memory slot of the sender, and this
            # bucket waits for the others. The completing bucket is copied once, into the parameters.
            buckets[msg.bucket] = this if verdict.decoded else {n: t.clone() for n, t in this.items()}
            return
        buckets[msg.bucket] = this
        for version in [v for v in self._head_staged if v <= msg.version]:
            del self._head_staged[version]  # this one, and older ones that can no longer complete
        with torch.no_grad():
            for name, param in self._head_params.items():
                # In place: the packed LM-head copies the trainer keeps follow the tensor's version counter.
                param.copy_(received[name])
        self.head_version = msg.version
        self.receiver.applied(msg.version)
        digest = ""
        if self.config.verify_applied_head:
            digest = checksum(sorted(received), [self._head_params[n] for n in sorted(received)])
        self.log.info("head_synced", version=msg.version, buckets=len(buckets))
        self.send(COORDINATOR, HeadAck(rank=self.rank, version=msg.version, ok=True, checksum=digest))

    def _head_refused(self, version: int, why: str) -> None:
        self.log.error("head_refused", version=version, why=why, head_version=self.head_version)
        self.send(COORDINATOR, HeadAck(rank=self.rank, version=version, ok=False, why=why))

    # -- training -----------------------------------------------------------------------------------

    def step(self) -> bool:
        if self.owner:
            self._report_checkpoints()
            if self._remote_merged:
                self._share()
        if not self.leases or self.buffer.stats().tokens < self.config.min_buffer_tokens:
            return False
        if not self.owner and self._base is None:
            return False  # not before adopting the owner's weights: no forked starting points
        if self.owner:
            self._set_lr_scale(self._training_ranks(time.monotonic()))
        batch = self.buffer.sample_batch(self.config.batch_tokens)
        if batch is None:
            return False
        batch = batch.to(self.device)  # the buffer stays in host memory; one batch at a time moves
        started = time.perf_counter()
        started_ns = time.monotonic_ns()
        # A control message (a preemption) abandons the step between its phases: the device goes back
        # within one phase instead of a whole step (releases came 80-640 ms late at 512 tokens on a core;
        # the latency after this change is not measured yet).
        metrics = self.trainer.step(batch, stop=self.control_pending)
        elapsed = time.perf_counter() - started
        self._trained_s += elapsed * len(self.leases)  # device-seconds: what the coordinator's account caps
        self.spans.add(
            "train_step",
            started_ns,
            time.monotonic_ns() - started_ns,
            self.policy_version,
            tokens=int(batch.token_ids.numel()),
            leases=len(self.leases),
            loss=None if metrics is None else round(float(metrics["loss"]), 5),
            abandoned=metrics is None,
        )
        if metrics is None:
            return True  # the loop serves the control message next
        self._last_loss = float(metrics["loss"])
        self.policy_version = max(self.policy_version, *batch.policy_versions)
        if self.owner:
            self.version += 1
            self._share()
        else:
            self._unsent_steps += 1
            self._unsent_tokens += int(batch.token_ids.numel())
            self._unsent_s += elapsed
            if self._unsent_steps >= self.config.sync_every_steps:
                self._send_delta(final=False)
        return True

    def _training_ranks(self, now: float, sender: str | None = None) -> int:
        """Owner: n, the ranks training now (docs/actors.md); at least one."""
        active = {rank for rank, until in self._active.items() if until > now}
        if sender is not None:
            active.add(sender)
        if self.leases and self.buffer.stats().tokens >= self.config.min_buffer_tokens:
            active.add(self.name)
        return max(1, len(active))

    def _set_lr_scale(self, n: int) -> None:
        self.trainer.lr_scale = 1.0 / n

    # -- owner: sharing the global drafter ----------------------------------------------------------

    def _update(self) -> DrafterUpdate:
        weights = self.trainer.weights()  # a copy: the sent tensors are never modified afterwards
        tensors = [weights[n].cpu() for n in self._names]  # the wire carries host tensors
        return DrafterUpdate(
            version=self.version,
            policy_version=self.policy_version,
            names=list(self._names),
            tensors=tensors,
            checksum=checksum(self._names, tensors),
        )

    def _share(self, *, group_now: bool = False, publish_now: bool = False) -> None:
        """Sends the global drafter where it is due: to the other ranks, to `publish_to`, to disk."""
        cfg, v = self.config, self.version
        to_group = (
            bool(self.group)
            and v != self._shared_version
            and (group_now or self._remote_merged or v - self._shared_version >= cfg.sync_every_steps)
        )
        publish = publish_now or (
            _crossed(self._published_version, v, cfg.publish_every_steps)
            and time.monotonic() - self._published_at >= cfg.publish_min_interval_s
        )
        update = self._update() if to_group or publish else None
        if to_group and update is not None:
            for peer in self.group:
                self.send(peer, update)
            self._shared_version = v
        if publish and update is not None:
            self._publish(update)
            self._published_version = v
            self._published_at = time.monotonic()
        if _crossed(self._checkpointed_version, v, cfg.checkpoint_every_steps) and self._checkpoint():
            self._checkpointed_version = v
        self._remote_merged = False

    def _publish(self, update: DrafterUpdate) -> None:
        for dest in self.config.publish_to:
            self.send(dest, update)
        self.send(COORDINATOR, self._stats())

    def _stats(self) -> DrafterStats:
        return DrafterStats(
            rank=self.rank,
            version=self.version,
            steps=self.trainer.steps,
            loss=self._last_loss,
            buffer_tokens=self.buffer.stats().tokens,
            elapsed_s=self._trained_s,
        )

    def _check_delta(self, msg: DrafterDelta, sender: str) -> str | None:
        if not self.owner:
            return "not the owner"
        if sender not in self.group or sender != actor_name(ROLE, msg.rank):
            return f"sender {sender} (rank {msg.rank}) is not a rank of this drafter"
        if msg.steps == 0:
            return None if not msg.names and not msg.tensors else "a zero-step delta carries no tensors"
        if msg.base_version > self.version:
            return f"based on version {msg.base_version}, newer than this drafter's {self.version}"
        return self._check_weights(list(msg.names), list(msg.tensors))

    def _check_weights(self, names: list[str], tensors: list[torch.Tensor]) -> str | None:
        """None if names/shapes/dtypes are exactly the head's trainable weights and every value is finite."""
        if names != self._names:
            return f"names {names[:3]}… ({len(names)}) are not the head's {len(self._names)} weights"
        why = mistyped(names, tensors, self._shapes)
        if why is not None:
            return why
        for name, t in zip(names, tensors, strict=True):
            if not bool(torch.isfinite(t).all()):
                return f"{name}: non-finite values"
        return None

    # -- other ranks: deltas ------------------------------------------------------------------------

    def _send_delta(self, *, final: bool) -> None:
        """Sends the owner local − base (then base = local), or with nothing unsent a zero-step notice."""
        names: list[str] = []
        deltas: list[torch.Tensor] = []
        if self._unsent_steps and self._base is not None:
            weights = self.head.state_dict()
            with torch.no_grad():
                for name in self._names:
                    # a new host tensor: safe to send zero-copy
                    deltas.append((weights[name] - self._base[name]).cpu())
                    self._base[name].copy_(weights[name])
            names = list(self._names)
        msg = DrafterDelta(
            rank=self.rank,
            base_version=self.version,
            policy_version=self.policy_version,
            steps=self._unsent_steps if names else 0,
            tokens=self._unsent_tokens if names else 0,
            elapsed_s=self._unsent_s if names else 0.0,
            final=final,
            names=names,
            tensors=deltas,
        )
        self.send(OWNER, msg)
        if names:
            self.send(COORDINATOR, self._stats())
            self.log.info("delta_sent", steps=msg.steps, base_version=msg.base_version, final=final)
        self._unsent_steps = self._unsent_tokens = 0
        self._unsent_s = 0.0

    # -- checkpoints (owner) ------------------------------------------------------------------------

    def _checkpoint(self, *, wait: bool = False) -> bool:
        """Queues a checkpoint for the writer thread; `wait`: behind a write still running (a run checkpoint
        must not be skipped), else skipped then. True if queued."""
        # trainer.state_dict() is a deep copy: safe to write later
        state = {"version": self.version, "policy_version": self.policy_version, **self.trainer.state_dict()}
        try:
            self._ckpt_jobs.put((self.version, state), block=wait, timeout=60.0 if wait else None)
        except queue.Full:
            self.log.info("checkpoint_skipped", version=self.version, why="previous write still running")
            return False
        return True

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
            self.inbox.wake()  # `step` reports it now, not at the next idle wakeup

    def _report_checkpoints(self) -> None:
        while not self._ckpt_done.empty():
            version, path = self._ckpt_done.get()
            self.log.info("checkpointed", version=version, path=path)
            self.send(
                COORDINATOR, Status(topic="drafter_checkpoint", fields={"version": version, "path": path})
            )

    def _init_from(self, path: str) -> None:
        """Starts the owner's drafter from an exported head (e.g. `drafter warmup`), at its version, so
        rollouts holding that head take this actor's updates as newer."""
        from slipstream.engine import eagle_export

        head, self.version = eagle_export.load_head(path, self.target)  # no drafter: its KV cache is waste
        self.head.load_state_dict(
            {name: t.to(self.head.fc.weight.dtype) for name, t in head.state_dict().items()}
        )
        self._shared_version = self._published_version = self._checkpointed_version = self.version
        self.log.info("initialised", path=path, version=self.version)

    def _resume(self) -> None:
        ckpts = sorted(self.ckpt_dir.glob("ckpt-*.pt"))
        if not ckpts:
            if self.config.init_from:
                self._init_from(self.config.init_from)
            return
        state = torch.load(ckpts[-1], map_location=self.device, weights_only=True)
        self.trainer.load_state_dict(state)
        for group in self.trainer.optimizer.param_groups:
            group["lr"] = self.config.lr  # the checkpoint holds the lr / n the owner trained at last
        self.version = int(state["version"])
        self.policy_version = int(state.get("policy_version", 0))  # absent from checkpoints before it
        self._published_version = self._checkpointed_version = self.version
        self.log.info(
            "resumed", version=self.version, policy_version=self.policy_version, path=str(ckpts[-1])
        )
        self._share(group_now=bool(self.group), publish_now=True)  # peers get the restored weights at once
