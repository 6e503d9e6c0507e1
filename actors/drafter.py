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
import threading
import time
from pathlib import Path
from typing import Annotated

import msgspec
import torch

from slipstream.engine import hub
from slipstream.engine.buffer import OnlineBuffer
from slipstream.engine.device import parse_device, require_device
from slipstream.engine.drafter_averaging import TrainingRanks, adopt, check_weights, fold_delta, take_delta
from slipstream.engine.drafter_train import DrafterTrainer
from slipstream.engine.eagle import EagleHead
from slipstream.engine.head_staging import HeadStaging
from slipstream.engine.weight_receiver import WeightReceiver
from slipstream.engine.weights import load_head_parts
from slipstream.protocols.control import Lease, Preempt, Released, SaveCheckpoint, Status
from slipstream.protocols.drafter import DrafterDelta, DrafterStats, DrafterUpdate, HeadAck, HiddenStates
from slipstream.protocols.learner import WeightUpdate
from slipstream.runtime import cuda_ipc
from slipstream.runtime.actor import COORDINATOR, Actor, handler
from slipstream.runtime.checkpoint_writer import CheckpointWriter, checkpoints
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
        self.owner = self.rank == 0
        self.group = self._rank_group()
        self.device = require_device(cfg.device)
        if cfg.nice and hasattr(os, "setpriority"):
            # Linux: a thread id names one thread here, so the IO thread (started before) keeps its priority.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), cfg.nice)
        torch.manual_seed(cfg.seed + self.rank)
        self._load_models()
        self.buffer = OnlineBuffer(cfg.buffer_bytes, seed=cfg.seed + self.rank)
        self.version = 0  # owner: of the drafter; other ranks: of the newest global adopted
        # The newest policy version whose hidden states these weights have trained on (own steps, folded
        # deltas, adopted updates); data merely buffered does not count: it has not shaped the drafter.
        self.policy_version = 0
        self.leases: dict[int, Lease] = {}  # lease id -> lease: the devices (cores) it may train on now
        self._lease_started: dict[int, int] = {}  # lease id -> when it arrived (monotonic ns), its span
        self._last_loss = float("nan")
        self._trained_s = 0.0
        self._start_head_sync()
        # owner: where the version stood when last sent to the group / published / checkpointed
        self._shared_version = self._published_version = self._checkpointed_version = 0
        self._published_at = float("-inf")
        self._remote_merged = False  # deltas folded in since the group last heard
        self._ranks = TrainingRanks()
        # other ranks: the base deltas are taken against, and what was trained since it
        self._base: dict[str, torch.Tensor] | None = None
        self._unsent_steps = self._unsent_tokens = 0
        self._unsent_s = 0.0
        self.ckpt_dir = Path(self.run_dir or ".") / "drafter" / f"rank-{self.rank}"
        self._writer: CheckpointWriter | None = None
        if self.owner:
            # Started here, after the niceness above: the writer thread inherits it.
            self._writer = CheckpointWriter(self.ckpt_dir, on_written=self.inbox.wake)
            self._resume()
        else:
            self._send_delta(final=True)  # zero steps: asks the owner for the global weights

    def _rank_group(self) -> list[str]:
        """The ranks this one talks to: the owner's peers are every other rank; another rank's, the owner."""
        cfg = self.config
        if self.rank >= cfg.world_size:
            raise ValueError(f"world_size: {cfg.world_size} ranks, but this is rank {self.rank}")
        group = [actor_name(ROLE, r) for r in range(1, cfg.world_size)] if self.owner else [OWNER]
        missing = [name for name in group if name not in self.peers]
        if missing:
            raise ValueError(f"world_size: {cfg.world_size} ranks, but {missing} are not in this run")
        return group

    def _load_models(self) -> None:
        """The target's head parts and the EAGLE head trained against them, with its trainer."""
        cfg = self.config
        # Only the embedding, final norm and LM head: the drafter never runs the target's layers.
        self.target = load_head_parts(hub.resolve(cfg.model), device=self.device)
        self.target.requires_grad_(False)
        self.head = EagleHead.for_target(self.target.config).to(self.device)
        self.trainer = DrafterTrainer(
            self.head, self.target, lr=cfg.lr, unroll_steps=cfg.unroll_steps, warmup_steps=cfg.warmup_steps
        )
        self._shapes = {name: (t.shape, t.dtype) for name, t in self.head.state_dict().items()}
        self._names = sorted(self._shapes)

    def _start_head_sync(self) -> None:
        """The target's head parts as held (version 0: as loaded), and the learner's pushes of them: each
        bucket judged by the one receiver, staged by version until every part is in, then applied."""
        self.head_version = 0
        self._head_params = dict(self.target.named_parameters())
        self._head_staging = HeadStaging(self._head_params)
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

    def on_stop(self) -> None:
        if self._writer is not None:
            self._writer.close()

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
            # state_dict(): views of the parameters, updated in place
            fold_delta(self.head.state_dict(), list(msg.names), list(msg.tensors), n)
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
        self._ranks.heard(sender, now, steps=msg.steps, elapsed_s=msg.elapsed_s, final=msg.final)
        if not msg.steps:
            self.send(sender, self._update())  # it is not training: it only wants the current weights

    @handler
    def on_update(self, msg: DrafterUpdate, sender: str) -> None:
        """Other ranks: adopts the owner's global weights, carrying over what it has not sent yet."""
        if self.owner or sender != OWNER:
            self.log.warning("update_ignored", sender=sender, version=msg.version, why="not from the owner")
            return
        why = check_weights(list(msg.names), list(msg.tensors), self._shapes)
        if why is None and checksum(msg.names, msg.tensors) != msg.checksum:
            why = "checksum mismatch"
        if why is not None:
            self.log.error("update_refused", version=msg.version, why=why)
            return
        exact = self._base is None or self._unsent_steps == 0
        weights = self.head.state_dict()
        if self._base is None:
            self._base = {name: torch.empty_like(weights[name]) for name in self._names}
        adopt(weights, self._base, list(msg.names), list(msg.tensors), exact=exact)
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
            self._head_staging.drop(msg.version)  # that version can no longer complete
            self.receiver.forget(msg.version)
            self._head_refused(msg.version, f"bucket {msg.bucket}: {verdict.error}")
            return
        assert verdict.tensors is not None
        try:
            buckets = self._head_staging.add(
                msg.version, msg.bucket, msg.num_buckets, dict(zip(msg.names, verdict.tensors, strict=True)),
                owned=verdict.decoded,
            )  # fmt: skip
        except ValueError as exc:  # every bucket of the push came, a head part did not
            self.receiver.forget(msg.version)
            self._head_refused(msg.version, str(exc))
            return
        if buckets is None:
            return  # staged: the version's other buckets are still to come
        self.head_version = msg.version
        self.receiver.applied(msg.version)
        digest = ""
        if self.config.verify_applied_head:
            names = sorted(self._head_params)
            digest = checksum(names, [self._head_params[n] for n in names])
        self.log.info("head_synced", version=msg.version, buckets=buckets)
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
        also = [] if sender is None else [sender]
        if self.leases and self.buffer.stats().tokens >= self.config.min_buffer_tokens:
            also.append(self.name)
        return self._ranks.count(now, *also)

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
        return check_weights(list(msg.names), list(msg.tensors), self._shapes)

    # -- other ranks: deltas ------------------------------------------------------------------------

    def _send_delta(self, *, final: bool) -> None:
        """Sends the owner local − base (then base = local), or with nothing unsent a zero-step notice."""
        names: list[str] = []
        deltas: list[torch.Tensor] = []
        if self._unsent_steps and self._base is not None:
            deltas = take_delta(self.head.state_dict(), self._base, self._names)
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
        assert self._writer is not None
        # trainer.state_dict() is a deep copy: safe to write later
        state = {"version": self.version, "policy_version": self.policy_version, **self.trainer.state_dict()}
        if not self._writer.submit(self.version, state, wait=wait):
            self.log.info("checkpoint_skipped", version=self.version, why="previous write still running")
            return False
        return True

    def _report_checkpoints(self) -> None:
        for version, path in self._writer.written() if self._writer is not None else ():
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
        ckpts = checkpoints(self.ckpt_dir)
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
