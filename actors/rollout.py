"""The rollout actor: decodes GRPO groups with continuous batching and tuned, lossless speculation.

One per device. A `GenerateRequest` (one prompt, G samples, a policy version) joins the continuous batch;
each `Completion` streams out the moment it finishes (tokens, behaviour log-probs, its text, finish reason,
version) to the learner rank that trains its group (`learn_at`; else to the coordinator), its hidden states
to the drafters (`hidden_to`); a drained queue reports `Idle`, so the device can be leased to drafter
training. Per decode iteration the tuner picks the speculation arm for the live batch size, rewarded with
that iteration's committed tokens per second; arms change speed, never output (tested). A request with a
dataset row (`row_json`) is a multi-turn episode its environment actor opens and answers. Between
iterations it swaps in the newest `DrafterUpdate` and applies a complete `WeightUpdate` once no request is
in flight (engine/weight_staging.py). Non-obvious: sample i of a group samples with `sample_seed(seed, i)`,
so in reproducible mode its tokens depend on its seed alone; tuner rewards skip iterations with prefill; a
request it cannot serve is answered with error completions naming the problem. More: docs/actors.md.
"""

from __future__ import annotations

import os
import time
import uuid
from functools import partial
from typing import Literal

import msgspec
import torch

from slipstream.actors.rollout_history import RolloutHistory
from slipstream.actors.rollout_samples import (
    InFlight,
    Sample,
    accept_length,
    completion_msg,
    hidden_states,
    requested,
    sampling_params,
)
from slipstream.actors.rollout_tuning import HeadSwap, TunerFile, start_eagle
from slipstream.engine import hub
from slipstream.engine.arm_setup import held_drafters, max_draft, runnable_methods, warm_up_arms
from slipstream.engine.config import dtype_from_name
from slipstream.engine.device import parse_device, require_device
from slipstream.engine.drafters import EagleDrafter, SuffixDrafter
from slipstream.engine.episodes import EpisodeLimits, Episodes, Finished
from slipstream.engine.generator import Completion, Generator, Request
from slipstream.engine.history import HistoryConfig
from slipstream.engine.iteration import Iteration, timed_step
from slipstream.engine.request import StepOutput
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.tokenizer import Tokenizer
from slipstream.engine.tuner import Tuner, TunerConfig
from slipstream.engine.weight_receiver import WeightReceiver
from slipstream.engine.weight_staging import WeightStaging
from slipstream.engine.weights import load_model
from slipstream.protocols.control import Idle
from slipstream.protocols.drafter import DrafterUpdate
from slipstream.protocols.environment import (
    Answer,
    CloseEpisode,
    EnvironmentUp,
    EpisodeOpened,
    OpenEpisode,
    RolloutUp,
    Turn,
)
from slipstream.protocols.learner import CUDA_IPC, WeightAck, WeightUpdate
from slipstream.protocols.rollout import GenerateRequest, IterationStats
from slipstream.runtime import cuda_ipc
from slipstream.runtime.actor import COORDINATOR, Actor, handler
from slipstream.runtime.codec import checksum
from slipstream.runtime.process import memory_now, release_freed_memory


class RolloutActor(Actor):
    role = "rollout"

    class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
        model: str  # the policy: a model directory or a registry name
        device: str = "cpu"  # where the policy, KV cache, sampling and drafts live: cpu, cuda, cuda:N
        # The policy's dtype here ("" = the checkpoint's): bfloat16 on a GPU. The learner pushes weights in it
        # (its push_dtype) and keeps fp32 masters of its own.
        dtype: Literal["", "float32", "bfloat16", "float16"] = ""
        max_batch: int = 32  # concurrent sequences (KV cache slots)
        max_len: int = 2048  # prompt + response tokens per sequence
        token_budget: int = 0  # tokens per forward pass; 0 = sized from max_batch and the arms
        # How sampled rows are verified. "reproducible" (the RL default): a sample's tokens depend on its seed
        # alone, so speculation, the tuner and batch composition never change what is learned, and a run
        # replays; "rejection" keeps the target's law only (each token still exact in distribution).
        spec_mode: Literal["rejection", "reproducible"] = "reproducible"
        tuner: TunerConfig = TunerConfig()  # buckets and arms; arms ["off"] = plain decoding
        drafter: str = ""  # exported EAGLE head to start with (e.g. `drafter warmup --out`); "" = untrained
        draft_vocab: int = 4096  # EAGLE proposes among this many most frequent observed tokens (0 = all)
        hidden_to: list[str] = []  # drafter actors that receive each response's hidden states
        hidden_dtype: Literal["bfloat16", "float32"] = "bfloat16"
        retune_drafter_versions: int = 100  # drafter versions (training steps) after which eagle is retried
        policy_version: int = 0  # version of the weights loaded from `model`
        # After applying an update, hash the live parameters bucket by bucket and compare with the learner's
        # checksums: proves the model now holds exactly the learner's weights (one hash pass per update).
        verify_applied_weights: bool = False
        # Before `ready`: decode one synthetic full batch with every arm, so the first real step does not pay
        # first touches (KV and scratch pages, packed weights, each arm's paths); the learner still loads.
        warm_up: bool = True
        # Multi-turn episodes (issue 42): the environment actors (this rollout's is rank % len) and their caps.
        environments: list[str] = []
        episodes: EpisodeLimits = EpisodeLimits()
        # Earlier steps' responses kept per prompt for the "history" and "cascade" arms (none without them).
        history: HistoryConfig = HistoryConfig()

        def __post_init__(self) -> None:
            parse_device(self.device)
            if self.max_batch < 1:
                raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
            if self.token_budget and self.token_budget <= self.max_batch:
                raise ValueError(
                    f"token_budget must exceed max_batch ({self.max_batch}), got {self.token_budget}"
                )

    def on_start(self) -> None:
        cfg = self.config
        self.model = load_model(
            hub.resolve(cfg.model),
            dtype=dtype_from_name(cfg.dtype) if cfg.dtype else None,
            device=require_device(cfg.device),
        )
        # Decoding reads only the packed projections: holding the plain ones too was a model's worth.
        self.log.info("packed_only", freed_mb=round(self.model.keep_packed_only() / 2**20, 1))
        self._load_tuner()
        self._build_generator()
        self.policy_version = cfg.policy_version
        self.in_flight = InFlight()  # request id -> its sample, its arrival
        self._arm = "off"
        self._iteration = 0
        self._idle_sent = True  # nothing to report until work arrives
        self._start_weight_sync()
        self._hidden_dtype = dtype_from_name(cfg.hidden_dtype)
        self.episodes: Episodes | None = None  # the loop over turns: engine/episodes.py
        self._env = cfg.environments[self.rank % len(cfg.environments)] if cfg.environments else ""
        self.tokenizer = Tokenizer.from_dir(hub.resolve(cfg.model)) if cfg.environments else None
        if self.tokenizer is not None:
            self._start_episodes(self.tokenizer)
        if cfg.warm_up:
            self._warm_up()

    def _load_tuner(self) -> None:
        """The tuner, with what this rank's predecessor learned if it saved any (`_save_tuner`)."""
        self.tuner = Tuner(self.config.tuner)
        self.tuner_file = TunerFile(self.run_dir, self.rank)
        if self.tuner_file.restore(self.tuner):
            self.log.info("tuner_restored", path=str(self.tuner_file.path))

    def _build_generator(self) -> None:
        """The generator and the drafters the tuner's arms need; `methods`: the arms that can run."""
        cfg = self.config
        eagle = partial(start_eagle, cfg.drafter, self.model, self.log, num_slots=cfg.max_batch,
                        max_len=cfg.max_len, draft_vocab=cfg.draft_vocab)  # fmt: skip
        # An EAGLE head is worth holding only if it starts trained or will be trained online.
        drafters = held_drafters(self.tuner.arms, device=self.model.lm_head_weight.device,
                                 eagle=eagle if cfg.drafter or cfg.hidden_to else None,
                                 history=cfg.history)  # fmt: skip
        self.eagle: EagleDrafter | None = drafters.get("eagle")  # type: ignore[assignment]
        suffix = drafters.get("history")
        self.history = (
            RolloutHistory(suffix, self.run_dir, self.rank, self.log)
            if isinstance(suffix, SuffixDrafter)
            else None
        )
        self.generator = Generator(
            self.model,
            num_slots=cfg.max_batch,
            max_len=cfg.max_len,
            token_budget=cfg.token_budget or None,  # None: sized for the deepest arm's drafts
            max_draft=max_draft(self.tuner.arms),
            return_hidden=bool(cfg.hidden_to),
            drafters=drafters,
        )
        if narrowed := self.tuner.limit_nodes(self.generator.max_nodes):  # past the largest node bucket
            self.log.warning("tuner_arms_not_offered", arms=narrowed, max_nodes=self.generator.max_nodes)
        self.head_swap: HeadSwap | None = None  # newer heads from the drafters, swapped in before decoding
        if self.eagle is not None:
            self.head_swap = HeadSwap(self.eagle, self.tuner, retune_versions=cfg.retune_drafter_versions,
                                      log=self.log)  # fmt: skip
        self.methods = runnable_methods(drafters)

    def _start_weight_sync(self) -> None:
        # Accepted buckets until their version is whole: written in place when idle, else staged.
        self.staging = WeightStaging(self.model, checksum, cuda_ipc.device_checksum)
        self._staged = self.staging.staged  # version -> bucket -> what is kept of it
        # What each pushed bucket is: duplicate, dropped, refused or accepted (the drafter uses the same).
        self.receiver = WeightReceiver(
            expected={name: (p.shape, p.dtype) for name, p in self.model.named_parameters()},
            base=self.model.weight,
            checksum=checksum,
            map_refs=cuda_ipc.map_refs,
            device_checksum=cuda_ipc.device_checksum,
            version=self.policy_version,
        )

    def _start_episodes(self, tokenizer: Tokenizer) -> None:
        # Episode ids name this process: a restarted rollout's never collide with its predecessor's,
        # which its environment drops on RolloutUp (the same samples are dealt to it again).
        incarnation = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"

        def wait(start: int, dur: int, **at: object) -> None:  # a turn's wait for its environment: a span
            self.spans.add("env_wait", start, dur, self.policy_version, **at)

        self.episodes = Episodes(
            self.generator, tokenizer, self.config.episodes, f"{self.name}@{incarnation}", on_wait=wait
        )
        self.send(self._env, RolloutUp(owner=self.name, incarnation=incarnation))

    def _warm_up(self) -> None:
        """Decodes max_batch synthetic requests for two iterations with each arm while the run's other actors
        still start (`warm_up`); the draft vocabulary's counts and the tuner see none of it."""
        started, started_ns = time.perf_counter(), time.monotonic_ns()
        cfg = self.config
        arms = [arm for arm in self.tuner.arms if arm.method in self.methods]
        # Every CUDA graph the run can meet, now, not on first use in a rollout's tail (docs/gpu.md).
        caps = [self.tuner.max_batch(arm.name) or cfg.max_batch for arm in arms]
        graphs = warm_up_arms(self.generator, arms, caps, mode=cfg.spec_mode, eagle=self.eagle,
                              num_requests=cfg.max_batch, max_len=cfg.max_len)  # fmt: skip
        self.spans.add("warm_up", started_ns, time.monotonic_ns() - started_ns, arms=len(arms), graphs=graphs)
        seconds = round(time.perf_counter() - started, 3)
        self.log.info(
            "warmed_up", arms=[a.name for a in arms], graphs=graphs, seconds=seconds, **memory_now()
        )

    def on_stop(self) -> None:
        self._save_tuner()
        if self.history is not None:
            self.history.close()

    # -- requests -----------------------------------------------------------------------------------

    @handler
    def on_generate(self, msg: GenerateRequest, sender: str) -> None:
        if msg.policy_version != self.policy_version:
            self.log.warning("policy_version_mismatch", group_id=msg.group_id, asked=msg.policy_version,
                             have=self.policy_version)  # fmt: skip
        samples = requested(msg)  # request id -> its sample
        ids = msg.prompt_ids
        if ids.dtype != torch.int64 or ids.dim() != 1:
            # Checked at the boundary: a float id would be truncated, a 2-D one would fail deep in the engine.
            why = f"prompt_ids must be a 1-D int64 tensor, got {ids.dtype} of shape {tuple(ids.shape)}"
            self.log.error("bad_request", group_id=msg.group_id, error=why)
            for sample in samples.values():
                self._send_completion(sample, [], [], "error", 0.0)
            self._idle_sent = False
            return
        prompt = ids.tolist()
        if self.history is not None and not msg.row_json:
            self.history.admit(msg.group_id, prompt, msg.policy_version)
        for request_id, sample in samples.items():
            if (old := self.in_flight.get(request_id)) is not None and old.attempt < msg.attempt:
                self._supersede(request_id)
            try:
                self._admit(request_id, sampling_params(msg.sampling, msg.seed, sample.index), msg, prompt)
            except ValueError as exc:
                # The coordinator waits for every sample: answer with an error completion, never silence.
                self.log.error(
                    "bad_request", group_id=msg.group_id, sample_index=sample.index, error=str(exc)
                )
                self._send_completion(sample, [], [], "error", 0.0, error=str(exc))
                continue
            self.in_flight.add(request_id, sample)
        self._idle_sent = False

    def _admit(
        self, request_id: str, params: SamplingParams, msg: GenerateRequest, prompt: list[int]
    ) -> None:
        """Into the continuous batch, or, for a request with a dataset row, to its environment to open."""
        if msg.row_json:  # an episode: its prompt is the environment's opening
            if self.episodes is None:
                raise ValueError("an episode's request, but this rollout has no environments")
            episode_id = self.episodes.begin(request_id, params, str(msg.group_id), msg.row_json)
            self.send(self._env, OpenEpisode(episode_id=episode_id, row_json=msg.row_json))
        else:
            self.generator.add(Request(request_id=request_id, prompt_ids=prompt, params=params,
                                       group_id=str(msg.group_id)))  # fmt: skip

    def _supersede(self, request_id: str) -> None:
        """The same sample of an older try (its step was given up when its learner died): dropped, with no
        completion, for the newer try's request (the head and the learner take only the newer try's)."""
        if self.episodes is not None and request_id in self.episodes:
            self.send(
                self._env, CloseEpisode(episode_id=self.episodes.fail(request_id, "superseded").episode_id)
            )
        else:
            self.generator.abort(request_id)
        self.in_flight.pop(request_id)
        self.log.info("superseded", request=request_id)

    # -- episodes (engine/episodes.py drives the turns; the environment actor answers them) --------------

    def _episode(self, episode_id: str) -> str | None:
        return self.episodes.current(episode_id) if self.episodes is not None else None

    @handler
    def on_episode_opened(self, msg: EpisodeOpened, sender: str) -> None:
        if (request_id := self._episode(msg.episode_id)) is None or self.episodes is None:
            return  # stale: an earlier attempt's, or an episode that ended
        try:
            if msg.error is not None:
                raise ValueError(f"{sender}: {msg.error}")
            messages = [{"role": m.role, "content": m.content} for m in msg.messages]
            self.episodes.opened(request_id, messages, msg.stop_sequences, msg.incarnation)
        except ValueError as exc:
            self._end_episode(self.episodes.fail(request_id, str(exc)))

    @handler
    def on_answer(self, msg: Answer, sender: str) -> None:
        if (request_id := self._episode(msg.episode_id)) is None or self.episodes is None:
            return
        if msg.unknown:  # the process holding it died and was restarted: from its start, same seeds
            self._replay(request_id, f"{sender} holds no such episode")
            return
        try:
            if msg.error is not None:
                raise ValueError(f"{sender}: {msg.error}")
            finished = self.episodes.answer(request_id, msg.text, msg.role, msg.done, msg.reward)
        except ValueError as exc:
            finished = self.episodes.fail(request_id, str(exc))
        if finished is not None:
            self._end_episode(finished)

    @handler
    def on_environment_up(self, msg: EnvironmentUp, sender: str) -> None:
        """A (re)started environment process: the episodes it did not open are lost there, and replayed."""
        if self.episodes is not None and sender == self._env:
            for request_id in self.episodes.lost_to(msg.incarnation):
                self._replay(request_id, f"{sender} restarted")

    def _replay(self, request_id: str, why: str) -> None:
        assert self.episodes is not None
        self.send(self._env, CloseEpisode(episode_id=self.episodes.episode_id(request_id)))
        if (episode_id := self.episodes.replay(request_id)) is None:
            self._end_episode(self.episodes.fail(request_id, f"{why} (replays spent)"))
            return
        self.log.warning("episode_replayed", episode=episode_id, why=why)
        self.send(self._env, OpenEpisode(episode_id=episode_id, row_json=self.episodes.row_json(request_id)))

    def _end_episode(self, finished: Finished) -> None:
        self.send(self._env, CloseEpisode(episode_id=finished.episode_id))  # the environment may hold it
        if finished.completion is not None:
            self._finish(finished.completion, finished)
            return
        sample, _ = self.in_flight.pop(finished.request_id)
        self.log.warning(
            "episode_invalid", group_id=sample.group_id, sample_index=sample.index, error=finished.error
        )
        self._send_completion(sample, [], [], "error", 0.0, error=finished.error, **finished.counts())

    # -- updates --------------------------------------------------------------------------------------

    @handler
    def on_drafter_update(self, msg: DrafterUpdate, sender: str) -> None:
        if self.head_swap is None:
            self.log.warning("drafter_update_unused", version=msg.version, why="no eagle arm configured")
            return
        self.head_swap.offer(msg)  # the newest only, swapped in before the next iteration

    @handler
    def on_weights(self, msg: WeightUpdate, sender: str) -> None:
        verdict = self.receiver.receive(
            version=msg.version, bucket=msg.bucket, num_buckets=msg.num_buckets, names=msg.names,
            tensors=msg.tensors, checksum=msg.checksum, encoding=msg.encoding, base_version=msg.base_version,
            ipc=msg.ipc,
        )  # fmt: skip
        if verdict.kind == "duplicate":
            # The version it holds, again: after a restart both the push in flight when it died (queued by
            # the learner's socket) and the coordinator's re-push arrive. It applied and acked one already.
            self.log.info("weights_duplicate", version=msg.version, bucket=msg.bucket)
            return
        if verdict.kind == "dropped":
            self.log.info("delta_dropped", version=msg.version, bucket=msg.bucket, why=verdict.error)
            return
        if verdict.kind == "refused":
            self._refuse(msg, f"bucket {msg.bucket}: {verdict.error}", want_full=verdict.want_full)
            return
        assert verdict.tensors is not None
        if self.staging.superseded(msg.version):
            # A newer version is already being written over it (a re-push after a learner restart).
            self.log.warning("weights_superseded", version=msg.version, by=self.staging.writing)
            return
        if self.staging.add(
            msg.version, msg.bucket, msg.num_buckets, msg.names, verdict.tensors, msg.checksum,
            device_hashed=msg.encoding == CUDA_IPC, owned=verdict.decoded, busy=self.generator.has_unfinished(),
        ):  # fmt: skip
            self._apply_weights()

    def _refuse(self, msg: WeightUpdate, error: str, *, want_full: bool = False) -> None:
        self.log.error("weights_refused", version=msg.version, bucket=msg.bucket, error=error)
        # Acks go to the coordinator, which waits for every rollout before the next step starts.
        self.send(COORDINATOR, WeightAck(version=msg.version, role=self.role, rank=self.rank, ok=False,
                                         error=error, want_full=want_full))  # fmt: skip

    def _apply_weights(self) -> None:
        applied = self.staging.apply(verify=self.config.verify_applied_weights)
        version, error = applied.version, None
        self.policy_version = version
        self.receiver.applied(version)
        if applied.differing:
            error = f"applied weights differ from the learner's in buckets {applied.differing}"
            self.log.error("weights_differ", version=version, buckets=applied.differing)
        if (first := applied.first_bucket_ns) is not None:  # first bucket in -> applied: a push's flow ends
            self.spans.add("apply_weights", first, time.monotonic_ns() - first, version - 1, version=version)
        self.log.info(
            "weights_applied", version=version, verified=self.config.verify_applied_weights, **memory_now()
        )
        ack = WeightAck(version=version, role=self.role, rank=self.rank, ok=error is None, error=error)
        self.send(COORDINATOR, ack)

    # -- decoding -------------------------------------------------------------------------------------

    def step(self) -> bool:
        """One decode iteration: what waits between iterations first (a weight version, a drafter swap,
        Idle), then the tuner's arm for the live batch, the iteration, its record, and what it finished."""
        if self.staging.writing is not None:
            return False  # the parameters hold part of a version: wait for its other buckets
        if self.head_swap is not None and self.head_swap.pending is not None:
            self.head_swap.swap()
        generator = self.generator
        if not generator.has_unfinished() and not (self.episodes is not None and self.episodes.live):
            self._idle()
            return False
        if self.episodes is not None:
            for request_id in self.episodes.expired():
                why = f"no answer from {self._env} within {self.config.episodes.turn_timeout_s:g} s"
                self._end_episode(self.episodes.fail(request_id, why))
            if generator.num_decoding == 0 and generator.num_prefilling == 0:
                return False  # every live request waits for its environment: sleep until an answer comes
        clean = generator.num_decoding > 0 and generator.num_prefilling == 0
        decision = self.tuner.choose(max(generator.num_decoding, 1), self.methods)
        if decision.arm != self._arm:
            arm = self.tuner.arm(decision.arm)
            self.generator.set_spec(None if arm.method == "off" else arm.spec(self.config.spec_mode))
            self._arm = decision.arm
        self.log.info("tuner_decision", iteration=self._iteration, **decision.as_dict())
        outputs, it = timed_step(generator)
        self._record(it, decision.arm, clean)
        self._iteration += 1
        self._commit(outputs)
        return True

    def _idle(self) -> None:
        """Nothing in flight: a version whose buckets all came is applied, and Idle said once."""
        if self.staging.ready is not None:
            self._apply_weights()
        if self._idle_sent:
            return
        self._idle_sent = True
        self._save_tuner()
        if self.history is not None:
            self.log.info("history", **self.history.idle())
        # The step's KV cache and decode buffers go back to the host before the learner peaks (it trains
        # while this rollout idles), and before Idle leases this core to a drafter.
        release_freed_memory()
        self.send(COORDINATOR, Idle(role=self.role, rank=self.rank, policy_version=self.policy_version))
        self.log.info("idle", policy_version=self.policy_version, **memory_now())

    def _record(self, it: Iteration, arm: str, clean: bool) -> None:
        """An iteration's spans, the tuner's rewards (throughput only from a `clean` one: no prefill),
        a stale drafter's warning, and its `IterationStats` to the coordinator."""
        self.spans.add(
            "iteration", it.started_ns, it.ended_ns - it.started_ns, self.policy_version, batch=it.batch,
            prefilling=it.prefilling, prefill_tokens=it.prefill_tokens, arm=arm, drafted=it.drafted,
            accepted=it.accepted, committed=it.committed,
        )  # fmt: skip
        if it.draft_ns:  # a speculative iteration: drafting, then the verify pass and commit
            drafted_at = it.started_ns + it.draft_ns
            self.spans.add("draft", it.started_ns, it.draft_ns, self.policy_version)
            self.spans.add(
                "verify", drafted_at, it.ended_ns - drafted_at, self.policy_version, nodes=it.drafted
            )
        if clean:
            self.tuner.record(it.batch, arm, it.committed, it.seconds)
        # Acceptance needs no clean clock: prefill rows draft nothing, so every iteration's decodes count.
        stale = self.tuner.record_acceptance(arm, it.batch, it.accepted, it.drafted)
        if stale is not None:
            self.log.warning(
                "drafter_stale",
                **stale.as_dict(),
                threshold=self.config.tuner.stale_accept,
                drafter_version=self.eagle.version if self.eagle is not None else None,
                policy_version=self.policy_version,
            )
        self.send(
            COORDINATOR,
            IterationStats(
                rank=self.rank, iteration=self._iteration, batch_size=it.batch, arm=arm,
                drafted=it.drafted, accepted=it.accepted, committed=it.committed, iter_s=it.seconds,
                offered_at=it.offered_at, accepted_at=it.accepted_at, draft_s=it.draft_ns / 1e9,
            ),
        )  # fmt: skip

    def _commit(self, outputs: list[StepOutput]) -> None:
        """What an iteration finished: completions out, ended episodes closed, ended turns to the
        environment."""
        episodes = self.episodes
        for output in outputs:
            if output.completion is None:
                continue
            if episodes is not None and output.request_id in episodes:  # its max_tokens or max_len ended it
                self._end_episode(episodes.finished(output.completion))
            else:
                self._finish(output.completion)
        for end in episodes.turn_ends(outputs) if episodes is not None else ():
            if isinstance(end, Finished):  # its budget ran out before its turn ended
                self._end_episode(end)
                continue
            self.send(
                self._env,
                Turn(episode_id=end.episode_id, turn=end.turn, text=end.text, token_ids=end.token_ids),
            )

    def _finish(self, completion: Completion, episode: Finished | None = None) -> None:
        sample, queued = self.in_flight.pop(completion.request_id)
        if queued is not None:  # from the request's arrival to its last token: the long-tail view's bar
            self.spans.add(
                "sample",
                queued,
                time.monotonic_ns() - queued,
                self.policy_version,
                group=sample.group_id,
                index=sample.index,
                tokens=len(completion.token_ids),
                finish=completion.finish_reason,
                passes=completion.target_passes,
            )
        extra = {}
        if episode is not None:
            extra = {"prompt_ids": episode.prompt_ids, "env_reward": episode.reward, **episode.counts()}
        self._send_completion(sample, completion.token_ids, completion.logprobs, completion.finish_reason,
                              accept_length(completion), mask=completion.policy_mask, **extra)  # fmt: skip
        if self.history is not None and episode is None:
            self.history.finished(sample.group_id, completion.token_ids, completion.finish_reason)
        if self.config.hidden_to:
            for msg in hidden_states(completion, sample, self._hidden_dtype, self.policy_version):
                for dest in self.config.hidden_to:
                    self.send(dest, msg)

    def _send_completion(
        self, sample: Sample, tokens: list[int], logprobs: list[float], reason: str, accept: float,
        **fields: object,
    ) -> None:  # fmt: skip
        """To the learner rank that trains the group (with its text), else to the coordinator."""
        text = self._text(tokens) if sample.learner else ""
        msg = completion_msg(sample, tokens, logprobs, reason, accept, policy_version=self.policy_version,
                             text=text, **fields)  # type: ignore[arg-type]  # fmt: skip
        self.send(sample.learner or COORDINATOR, msg)

    def _text(self, tokens: list[int]) -> str:  # loads the tokenizer at the first text
        if self.tokenizer is None:
            self.tokenizer = Tokenizer.from_dir(hub.resolve(self.config.model))
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _save_tuner(self) -> None:
        if (error := self.tuner_file.save(self.tuner)) is not None:
            self.log.warning("tuner_save_failed", error=error)


__all__ = ["RolloutActor"]
