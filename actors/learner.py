"""The learner actor: GRPO steps on scored groups, then versioned, exact weight pushes to the rollouts.

Each sample of a group this rank trains comes straight from its rollout (`Completion`: tokens, log-probs,
text); the learner holds it and answers the coordinator a `SampleReceipt` (a later copy of a held or
trained sample is dropped and counted). `TrainStep` names the rank's groups with their prompts and rewards
(None: invalid); once it holds them all it assembles the `ScoredGroup`s, writes its share of the samples
record (protocols/samples_record.py; a replay reads it back instead), turns rewards into group advantages
(`engine.grpo`), takes one `PolicyTrainer` step and reports `StepStats`. `PushWeights` then has rank 0
send the new weights to `to` and the drafter's head parts to `head_to` as `WeightUpdate` buckets
(checksummed, zero-copy frames); `SaveCheckpoint` has it save them.

Non-obvious choices:
- fp32 masters whatever the checkpoint's dtype; pushes are cast to `push_dtype` (default: the checkpoint's,
  what a rollout loading the same directory holds). The cast copy is what is checksummed and sent, so a
  rollout's bitwise re-hash matches; checkpoints keep the masters.
- Several ranks form one torch.distributed group (NCCL on CUDA, gloo on CPU) through a file store in the
  run directory and shard the policy with FSDP2 (engine/sharding.py): each holds 1/N of the weights,
  gradients and AdamW's moments and trains on the groups dealt to it. A rank dealt no group still steps
  (the others wait for it in their collectives); alone, a step without groups trains nothing. Every rank
  takes `PushWeights` and `SaveCheckpoint`: a push gathers one bucket at a time from the shards (rank 0
  sends it, the others drop it), a checkpoint has each rank write its shards (engine/policy_checkpoint.py).
  On stop the ranks meet at a store barrier: none tears the group down while a peer is in a collective.
- Across hosts (tcp:// destinations) a push sends XOR deltas, zstd-compressed (engine/weight_delta.py),
  against the version a destination acknowledged (`PushWeights.delta_base`) when rank 0 kept a copy of it,
  else full buckets; `WeightsPushed` reports the bytes that crossed hosts against full buckets'.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.api as dcp_api

from slipstream.actors.learner_samples import check_group, policy_samples, without_samples
from slipstream.engine import hub
from slipstream.engine.config import ModelConfig, dtype_from_name
from slipstream.engine.device import capabilities, parse_device, require_device
from slipstream.engine.grpo import LossConfig
from slipstream.engine.policy_checkpoint import load_policy, save_policy
from slipstream.engine.policy_train import OptimConfig, PolicyTrainer
from slipstream.engine.sharding import full_tensors, shard_policy
from slipstream.engine.weight_delta import blob_tensor, xor_delta
from slipstream.engine.weights import HEAD_PARTS, load_model
from slipstream.protocols import samples_record
from slipstream.protocols.control import CheckpointSaved, SaveCheckpoint
from slipstream.protocols.learner import (
    CUDA_IPC,
    XOR_ZSTD,
    PushWeights,
    ScoredGroup,
    StepStats,
    TrainStep,
    WeightAck,
    WeightsPushed,
    WeightUpdate,
)
from slipstream.protocols.rollout import Completion
from slipstream.runtime import cuda_ipc
from slipstream.runtime.actor import COORDINATOR, Actor, handler
from slipstream.runtime.codec import checksum
from slipstream.runtime.process import memory_now

STOP_BARRIER_S = 60.0  # how long a stopping rank waits for its peers before tearing down anyway


RENDEZVOUS_FILE = "learner-rendezvous"
"""The ranks' torch.distributed rendezvous, in the run directory (a stale one must go before they start)."""


class LearnerActor(Actor):
    role = "learner"

    class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
        model: str  # the initial policy: a model directory or a registry name
        optim: OptimConfig = OptimConfig()  # AdamW, schedule, micro-batch token budget
        loss: LossConfig = LossConfig()  # clip, aggregation, KL, TIS, advantage normalisation
        world_size: Annotated[int, msgspec.Meta(ge=1)] = 1  # learner ranks (data parallel)
        bucket_bytes: Annotated[int, msgspec.Meta(ge=1)] = 64 << 20  # weight-update bucket size
        resume_from: str = ""  # a checkpoint written by a TrainStep (policy + optimizer) to start from
        seed: int = 0
        device: str = "cpu"  # "cpu", "cuda" or "cuda:N": where the fp32 masters and optimizer state live
        push_dtype: Literal["", "float32", "bfloat16", "float16"] = ""  # pushed weights; "": the checkpoint's
        warm_up: bool = True  # one forward and backward of a full micro-batch before Ready (PolicyTrainer)
        # Where the ranks meet (torch.distributed init_method): "tcp://HOST:PORT", derived from a multi-node
        # run's head (rank 0 must run on HOST); "" = a file in the run directory (one host).
        rendezvous: str = ""
        # Cross-host (tcp://) pushes as XOR deltas against what each destination acknowledged; False: full
        # buckets everywhere (for a network faster than the encode: `bench sync` measures encode_mb_s).
        push_deltas: bool = True
        delta_threads: Annotated[int, msgspec.Meta(ge=0)] = 0  # zstd threads per delta (0: this one alone)
        # bf16: forward and backward under bf16 autocast, fp32 masters and optimizer state (PolicyTrainer)
        precision: Literal["fp32", "bf16"] = "fp32"
        # Each decoder layer keeps only its input for backward and recomputes the rest (long samples)
        activation_checkpointing: bool = False
        # Weights on a GPU go to destinations on the same node as CUDA IPC refs (runtime/cuda_ipc.py):
        # no host copy; False: through host memory as on a CPU.
        push_ipc: bool = True
        # `bench scale` only (benchmarks/scale.py): hold, receipt, assemble, check and record each step's
        # samples as a training learner does, then answer StepStats at once (no model, no optimizer, no
        # push, no checkpoint), its `metrics` saying when its last sample came ("held_at",
        # time.monotonic()) and what it held (groups, samples, tokens). A CPU cannot train on those sizes.
        hold_only: bool = False

        def __post_init__(self) -> None:
            parse_device(self.device)
            if self.rendezvous and not self.rendezvous.startswith("tcp://"):
                raise ValueError(f"rendezvous: {self.rendezvous!r} is not tcp://HOST:PORT (or '')")

    def on_start(self) -> None:
        cfg = self.config
        if self.rank >= cfg.world_size:
            raise ValueError(f"world_size: {cfg.world_size} ranks, but this is rank {self.rank}")
        torch.manual_seed(cfg.seed)
        self.version = 0
        self._held: dict[tuple[int, int], Completion] = {}  # (group, sample) -> the sample, until trained on
        self._duplicates = 0  # samples dropped: a copy of one held or trained on already
        self._held_at = 0.0  # when the newest sample came (time.monotonic())
        self._pending: TrainStep | None = None
        self.sharded = False  # FSDP2 over the ranks (set below when there are several)
        if cfg.hold_only:
            return  # no rank group, no model: what it skips is said at `hold_only`
        device = require_device(cfg.device)
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)  # NCCL binds each rank to the current device
        if cfg.world_size > 1:
            rendezvous = cfg.rendezvous or f"file://{(Path(self.run_dir or '.') / RENDEZVOUS_FILE).resolve()}"
            dist.init_process_group(
                capabilities(device).dist_backend,
                init_method=rendezvous,
                rank=self.rank,
                world_size=cfg.world_size,
            )
        path = hub.resolve(cfg.model)
        self.push_dtype = (
            dtype_from_name(cfg.push_dtype) if cfg.push_dtype else ModelConfig.from_pretrained(path).dtype
        )
        # fp32 masters whatever the checkpoint holds: a bf16 weight would swallow small updates.
        self.model = load_model(path, dtype=torch.float32, device=device)
        ref = None
        if cfg.loss.kl_coef > 0:
            ref = load_model(path, dtype=torch.float32, device=device)
        self.sharded = cfg.world_size > 1
        if self.sharded:
            compute = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
            shard_policy(self.model, compute_dtype=compute)
            if ref is not None:
                shard_policy(ref, compute_dtype=compute)
        self.trainer = PolicyTrainer(
            self.model,
            optim=cfg.optim,
            loss=cfg.loss,
            ref_model=ref,
            precision=cfg.precision,
            activation_checkpointing=cfg.activation_checkpointing,
        )
        if cfg.resume_from:
            self._load(cfg.resume_from)
        if cfg.warm_up:
            self.trainer.warm_up()  # step 0 then costs what every step does, and an OOM shows at start
        # What this rank holds (the run's memory plan predicted it: rl/run.py `check_memory`).
        self.log.info("memory_held", **self.trainer.state_bytes())
        # name -> (version, tensor) as last pushed to a cross-host destination: the base of its next delta.
        # Memory: one model copy in the push dtype on the CPU (the cast copies a push makes anyway, kept),
        # held only once a push has had a tcp:// destination, so never in a one-host run.
        self._pushed: dict[str, tuple[int, torch.Tensor]] = {}
        self._ipc_buffers: dict[int, list[tuple[str, torch.Tensor]]] = {}  # bucket -> its GPU cast copies

    def on_stop(self) -> None:
        if dist.is_available() and dist.is_initialized():
            _stop_barrier(self.config.world_size, STOP_BARRIER_S)
            dist.destroy_process_group()

    @handler
    def on_completion(self, msg: Completion, sender: str) -> None:
        """A sample of a group this rank trains, straight from its rollout: held (cloned: received tensors
        alias frames that are recycled), and the coordinator told (`SampleReceipt`). A second copy (a
        requeue's, its first rollout presumed dead) is dropped and counted: the first one is the sample."""
        key = (msg.group_id, msg.sample_index)
        # A copy of one held of the same or a newer try, or older than the policy this rank holds (a copy of
        # a sample whose step it trained on already). A newer try's copy replaces the older's.
        held = self._held.get(key)
        if (held is not None and held.attempt >= msg.attempt) or msg.policy_version < self.version:
            self._duplicates += 1
            self.log.warning("duplicate_dropped", group_id=key[0], sample_index=key[1], sender=sender)
            return
        self._held[key] = msgspec.structs.replace(
            msg,
            token_ids=msg.token_ids.clone(),
            logprobs=msg.logprobs.clone(),
            policy_mask=msg.policy_mask.clone(),
            prompt_ids=msg.prompt_ids.clone(),
        )
        self._held_at = time.monotonic()
        self.send(COORDINATOR, samples_record.receipt_of(msg))

    @handler
    def on_train(self, msg: TrainStep, sender: str) -> None:
        self._pending = msg

    @handler
    def on_checkpoint(self, msg: SaveCheckpoint, sender: str) -> None:
        """The named verb `save_checkpoint`: rank 0 saves the policy and optimizer to `msg.path` (atomic),
        then says so; the coordinator records the run's state only after that. Sharded, every rank takes it
        and writes its shards; rank 0 answers once the checkpoint is whole."""
        if self.rank != 0 and not self.sharded:
            return
        error = ""
        try:
            if self.config.hold_only:
                raise RuntimeError("a hold_only learner (bench scale) holds no policy to save")
            self._save(msg.path)
        except (OSError, RuntimeError, dcp_api.CheckpointException) as exc:  # a full disk, on any rank
            # Said, not only logged: the coordinator waits for this answer and ends the run with it.
            self.log.error("checkpoint_failed", step=msg.step, path=msg.path, error=str(exc))
            error = str(exc)
        if self.rank == 0:
            self.send(
                COORDINATOR, CheckpointSaved(step=msg.step, path=msg.path, version=self.version, error=error)
            )

    @handler
    def on_push(self, msg: PushWeights, sender: str) -> None:
        """The named verb `push_weights`: the current policy to `to` (and the head parts to `head_to`).
        Handlers run between steps, so a push never sees half-updated weights. Sharded, every rank takes it
        and gathers each bucket with rank 0, which alone sends."""
        if self.rank != 0 and not self.sharded:
            self.log.warning("push_ignored", version=msg.version, why="only rank 0 pushes")
            return
        if self.rank != 0:
            if not self.config.hold_only and msg.version == self.version and (msg.to or msg.head_to):
                self._gather_only(self._push_groups(msg.to, msg.head_to or []))
            return
        error = ""
        if self.config.hold_only:
            error = "a hold_only learner (bench scale) holds no weights to push"
        elif msg.version != self.version:
            error = f"asked to push v{msg.version}, the learner holds v{self.version}"
        if error:
            self.log.error("push_refused", error=error)
            self.send(
                COORDINATOR,
                WeightAck(version=msg.version, role=self.role, rank=self.rank, ok=False, error=error),
            )
            return
        if msg.to or msg.head_to:
            self.push(msg.to, msg.version, delta_base=msg.delta_base, head_to=msg.head_to)

    def step(self) -> bool:
        msg = self._pending
        if msg is None or (groups := self._groups_of(msg)) is None:
            return False
        self._pending = None
        if self.config.hold_only:
            self._report_held(msg, groups)
            return True
        started = time.perf_counter()
        samples, counts = policy_samples(groups, self.config.loss)
        # Alone, a step without groups trains nothing. With peers, a rank dealt nothing still steps: the
        # others wait for it in their all-reduces.
        if self.config.world_size == 1 and not groups:
            stats = {"loss": 0.0, "grad_norm": 0.0, "tokens": 0}
        else:
            marks = [time.monotonic_ns()]

            def progress() -> None:  # after each micro-batch: a span for it, and a tick (not a hang)
                now = time.monotonic_ns()
                self.spans.add("micro_batch", marks[-1], now - marks[-1], msg.step, index=len(marks) - 1)
                marks.append(now)
                self.tick()

            stats = self.trainer.step(samples, on_progress=progress)
            # After the last micro-batch: the all-reduce, the clip and AdamW's step.
            self.spans.add("optimizer", marks[-1], time.monotonic_ns() - marks[-1], msg.step)
            # The checkpoint and the push after the step do not need its gradients (a model's worth): freed,
            # their memory serves the push's cast copies.
            self.trainer.free_gradients()
        self.version = msg.version
        elapsed = time.perf_counter() - started
        metrics = {k: float(v) for k, v in stats.items() if k not in ("step", "loss", "grad_norm", "tokens")}
        self.send(
            COORDINATOR,
            StepStats(
                step=msg.step,
                version=msg.version,
                loss=float(stats["loss"]),
                grad_norm=float(stats["grad_norm"]),
                tokens=int(stats["tokens"]),
                elapsed_s=elapsed,
                metrics={**metrics, **counts, "duplicates": float(self._duplicates)},  # since the last step
            ),
        )
        self._duplicates = 0
        self.log.info(
            "trained",
            step=msg.step,
            version=msg.version,
            elapsed_s=round(elapsed, 3),
            **counts,
            **memory_now(),
        )
        return True

    def _groups_of(self, msg: TrainStep) -> list[ScoredGroup] | None:
        """The step's groups once every sample of its plans is held (None before), assembled and recorded
        first; a replay's, read back from its record."""
        sampling = {"temperature": msg.temperature, "top_p": msg.top_p, "top_k": msg.top_k}
        if msg.replay:
            return samples_record.read_groups([Path(msg.samples_path)], msg.step, sampling)
        if any((plan.group_id, i) not in self._held for plan in msg.groups for i in range(len(plan.rewards))):
            return None
        groups, texts = [], []
        for plan in msg.groups:
            held = [self._held.pop((plan.group_id, i)) for i in range(len(plan.rewards))]
            group = samples_record.assemble(plan, held, msg.step, sampling)
            if (problem := check_group(group)) is not None:
                # The coordinator counts groups per step: a refused group is reported, never silently lost.
                self.log.error("group_refused", step=msg.step, group_id=plan.group_id, why=problem)
                group = without_samples(group)
            groups.append(group)
            texts.append([c.text for c in held] if group.response_ids else [])
        if msg.samples_path:  # before training on it: a learner that dies now replays the step from it
            samples_record.write_samples(Path(msg.samples_path), groups, texts)
        return groups

    def _report_held(self, msg: TrainStep, groups: list[ScoredGroup]) -> None:
        """`hold_only`: every group of the step is held; says when (its last sample's arrival), and what, in
        place of training on it."""
        held_at = self._held_at
        self.version = msg.version
        samples = sum(len(g.rewards) for g in groups)
        tokens = sum(t.numel() for g in groups for t in g.response_ids)
        invalid = sum(r is None for g in groups for r in g.rewards)
        self.send(
            COORDINATOR,
            StepStats(
                step=msg.step,
                version=msg.version,
                loss=0.0,
                grad_norm=0.0,
                tokens=tokens,
                elapsed_s=0.0,
                metrics={
                    "held_at": held_at,
                    "groups": float(len(groups)),
                    "samples": float(samples),
                    "invalid_samples": float(invalid),
                },
            ),
        )
        self.log.info(
            "held", step=msg.step, groups=len(groups), samples=samples, tokens=tokens, **memory_now()
        )

    def push(
        self,
        dests: list[str],
        version: int,
        *,
        delta_base: dict[str, int] | None = None,
        head_to: list[str] | None = None,
    ) -> None:
        """Sends every parameter to each of `dests`, and the parts an EAGLE drafter reads of its target
        (HEAD_PARTS: embedding, final norm, LM head when untied) alone to each of `head_to`, cast to
        `push_dtype`, as checksummed buckets: deltas to a cross-host destination whose `delta_base` entry is
        the version last pushed, else full.

        With drafters to feed, the head parts lead, in buckets of their own that both kinds of destination
        take from one cast, one checksum and one shared-memory copy (pushed apart, the tied 113 MB
        embedding of the demo's model was cast, hashed and copied twice a sync, on the step's critical
        path). A drafter completes a version when it holds every head part; the smaller parts come first,
        so its completing bucket is the embedding and it is copied once, into its parameters, not staged."""
        head_to = head_to or []
        groups = self._push_groups(dests, head_to)
        event = "weights_pushed" if dests else "head_pushed"
        span = "push" if dests else "push_head"
        with self.spans.span(span, version - 1, version=version, dests=[*dests, *head_to]) as fields:
            moved = self._push_buckets(groups, version, delta_base or {})
            fields.update(moved)
        # Said to the coordinator too: what crossed hosts is the run's to report (StepStats leave before this).
        self.send(
            COORDINATOR,
            WeightsPushed(
                version=version,
                head_only=not dests,
                full_bytes=moved["full_bytes"],
                wire_bytes=moved["wire_bytes"],
                bytes=moved["bytes"],
                deltas=moved["deltas"],
            ),
        )
        self.log.info(event, dests=dests, head_to=head_to, version=version, **moved)

    def _push_groups(
        self, dests: list[str], head_to: list[str]
    ) -> list[tuple[list[tuple[str, torch.nn.Parameter]], list[str]]]:
        """(parameters, destinations) in push order: the head parts first, smallest first, when drafters
        are fed (see `push`); every rank computes the same order (a sharded push gathers in it)."""
        params = list(self.model.named_parameters())
        head = sorted((p for p in params if p[0] in HEAD_PARTS), key=lambda p: p[1].numel())
        rest = [p for p in params if p[0] not in HEAD_PARTS]
        if not head_to:
            return [(params, dests)]
        if dests:
            return [(head, [*dests, *head_to]), (rest, dests)]
        return [(head, head_to)]

    def _gather_only(self, groups: list[tuple[list[tuple[str, torch.nn.Parameter]], list[str]]]) -> None:
        """A sharded rank other than 0: joins rank 0's gather of every bucket, in its order, and drops it."""
        for bucket, _ in _buckets(groups, self.push_dtype.itemsize, self.config.bucket_bytes):
            for _ in full_tensors(bucket):
                pass
            self.tick()

    def _push_buckets(
        self,
        groups: list[tuple[list[tuple[str, torch.nn.Parameter]], list[str]]],
        version: int,
        delta_base: dict[str, int],
    ) -> dict[str, int | float]:
        """Sends each group's parameters, as buckets numbered over all groups, to that group's destinations.
        Returns `bytes` (one copy of them) and, over the cross-host destinations, `full_bytes` (what full
        buckets would have moved), `wire_bytes` (what did), `deltas` (how many got deltas) and `encode_s`."""
        moved: dict[str, int | float] = {"bytes": 0, "full_bytes": 0, "wire_bytes": 0, "encode_s": 0.0}
        delta_dests: set[str] = set()
        buckets = _buckets(groups, self.push_dtype.itemsize, self.config.bucket_bytes)
        on_gpu = self.config.push_ipc and next(self.model.parameters()).device.type == "cuda"
        for index, (params, dests) in enumerate(buckets):
            # Gathered once from the shards (every sharded rank gathers it too: `_gather_only`); plain
            # parameters pass through. Dropped at the next bucket: one bucket in full at a time.
            bucket = list(full_tensors(params))
            remote = [d for d in dests if self.peers.get(d, "").startswith("tcp://")]
            if on_gpu and (local := [d for d in dests if d not in remote]):
                # Same node, same GPUs: the bucket stays in GPU memory, its IPC refs travel (no host copy).
                update = self._ipc_update(index, version, len(buckets), bucket)
                for dest in local:
                    self.send(dest, update)
                moved["bytes"] += sum(p.numel() for _, p in bucket) * self.push_dtype.itemsize
                dests = remote
                if not dests:
                    self.tick()
                    continue
            host = self._host_update(index, version, len(buckets), bucket)
            delta_dests.update(self._send_host_copy(host, dests, remote, delta_base, moved))
            self.tick()  # a push of many buckets is progress, not a hang
        return {**moved, "encode_s": round(moved["encode_s"], 3), "deltas": len(delta_dests)}

    def _host_update(
        self, index: int, version: int, num_buckets: int, bucket: list[tuple[str, torch.Tensor]]
    ) -> WeightUpdate:
        """Bucket `index` as one cast copy on the CPU for every destination: frames leave zero-copy, the next
        step must not change what is still in flight, and the copy, not the master, is what the checksum
        covers. (Same-host destinations then share one shared-memory slot per tensor: `broadcast`.)"""
        names = [n for n, _ in bucket]
        tensors = [p.to("cpu", self.push_dtype, copy=True) for _, p in bucket]
        return WeightUpdate(
            version=version,
            bucket=index,
            num_buckets=num_buckets,
            names=names,
            tensors=tensors,
            checksum=checksum(names, tensors),
        )

    def _send_host_copy(
        self,
        update: WeightUpdate,
        dests: list[str],
        remote: list[str],
        delta_base: dict[str, int],
        moved: dict[str, int | float],
    ) -> list[str]:
        """Sends a host bucket: as an XOR delta to each cross-host destination that acknowledged the version
        this learner kept of it, else whole; adds its bytes to `moved`. Returns the destinations of deltas."""
        names, tensors, version = update.names, update.tensors, update.version
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        kept = {self._pushed[n][0] if n in self._pushed else -1 for n in names}
        base = kept.pop() if len(kept) == 1 and self.config.push_deltas else -1  # one version: a base
        deltas = [d for d in remote if 0 <= base < version and delta_base.get(d) == base]
        self.broadcast([d for d in dests if d not in deltas], update)  # same-host: one shared copy
        if deltas:
            started = time.perf_counter()
            blobs = [
                blob_tensor(xor_delta(self._pushed[n][1], t, threads=self.config.delta_threads))
                for n, t in zip(names, tensors, strict=True)
            ]
            moved["encode_s"] += time.perf_counter() - started
            delta = msgspec.structs.replace(update, tensors=blobs, encoding=XOR_ZSTD, base_version=base)
            for dest in deltas:
                self.send(dest, delta)
            moved["wire_bytes"] += len(deltas) * sum(b.numel() for b in blobs)
        moved["wire_bytes"] += nbytes * (len(remote) - len(deltas))
        moved["full_bytes"] += nbytes * len(remote)
        moved["bytes"] += nbytes
        if remote:
            # The next delta's base. Kept, never written: a tensor still in flight as a frame stays valid.
            for name, tensor in zip(names, tensors, strict=True):
                self._pushed[name] = (version, tensor)
        return deltas

    def _ipc_update(
        self, index: int, version: int, num_buckets: int, bucket: list[tuple[str, torch.Tensor]]
    ) -> WeightUpdate:
        """Bucket `index` cast into this learner's GPU buffers for it (allocated once, rewritten in place, so
        receivers' mappings of them stay valid) and described by CUDA IPC refs, checksummed on the GPU."""
        names = [n for n, _ in bucket]
        held = self._ipc_buffers.get(index)
        if held is None or [n for n, _ in held] != names:
            held = [(n, torch.empty_like(p, dtype=self.push_dtype).detach()) for n, p in bucket]
            self._ipc_buffers[index] = held
        with torch.no_grad():
            for (_, buffer), (_, value) in zip(held, bucket, strict=True):
                buffer.copy_(value)
        tensors = [t for _, t in held]
        refs = [cuda_ipc.export(n, t) for n, t in held]
        torch.cuda.current_stream(tensors[0].device).synchronize()  # written before any receiver reads
        return WeightUpdate(
            version=version,
            bucket=index,
            num_buckets=num_buckets,
            names=names,
            tensors=[],
            checksum=cuda_ipc.device_checksum(names, tensors),
            encoding=CUDA_IPC,
            ipc=refs,
        )

    def _save(self, path: str) -> None:
        with self.spans.span("checkpoint", self.version - 1, path=path):
            self._save_now(path)

    def _save_now(self, path: str) -> None:
        # Atomic (a reader sees the old checkpoint or the new one); every rank writes its own shards.
        save_policy(path, self.model, self.trainer.optimizer, steps=self.trainer.steps, version=self.version)
        self.log.info("checkpoint_saved", path=path, version=self.version)

    def _load(self, path: str) -> None:
        info = load_policy(path, self.model, self.trainer.optimizer)
        self.trainer.steps = info["steps"]
        self.version = info["version"]
        self.log.info("checkpoint_loaded", path=path, version=self.version)


def _buckets(
    groups: list[tuple[list[tuple[str, torch.nn.Parameter]], list[str]]], itemsize: int, bucket_bytes: int
) -> list[tuple[list[tuple[str, torch.nn.Parameter]], list[str]]]:
    """Each group's parameters cut into buckets of at most `bucket_bytes` (a larger parameter alone), each
    with its group's destinations: a group's buckets hold its parameters alone."""
    buckets: list[tuple[list[tuple[str, torch.nn.Parameter]], list[str]]] = []
    for params, dests in groups:
        if not params:
            continue
        buckets.append(([], dests))
        size = 0
        for name, param in params:
            nbytes = param.numel() * itemsize
            if buckets[-1][0] and size + nbytes > bucket_bytes:
                buckets.append(([], dests))
                size = 0
            buckets[-1][0].append((name, param))
            size += nbytes
    return buckets


def _stop_barrier(world_size: int, timeout_s: float) -> None:
    """Waits (at most `timeout_s`) until every rank is stopping, so none tears down its process group while a
    peer may still use it. Through the store, not a collective: a dead peer costs a timeout, never a hang."""
    store = dist.distributed_c10d._get_default_store()
    store.add("learner/stopping", 1)
    deadline = time.monotonic() + timeout_s
    while store.add("learner/stopping", 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.01)


__all__ = ["LearnerActor", "policy_samples"]
