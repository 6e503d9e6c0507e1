"""What a `slipstream train` run is made of: its typed config (`TrainConfig` and its sections, every field
documented where it is declared, each section checked where it is built, naming the field), and what the
config resolves to (the data stream, the reward, the dtypes, an episode's tokens). How it maps onto actors
(names, placement, the lease plan, each actor's spec) is rl/run_plan.py's.

The non-obvious choice: every section is a frozen msgspec struct read strictly (an unknown key fails at
load, naming it); YAML in deploy/configs/ with `key.sub=value` overrides on top.

    cfg = load_config("deploy/configs/demo.yaml", ["steps=4"])
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from slipstream.engine import hub
from slipstream.engine.episodes import EpisodeLimits
from slipstream.engine.grpo import LossConfig
from slipstream.engine.history import HistoryConfig
from slipstream.engine.policy_train import OptimConfig
from slipstream.engine.sampling import GROUP_BITS, MAX_SEED
from slipstream.engine.tuner_config import TunerConfig
from slipstream.runtime import config as run_config
from slipstream.runtime.cluster import Cluster
from slipstream.runtime.sinks import MetricsConfig
from slipstream.tasks.datasets import DEFAULT_DATASET_SIZE, load_rows
from slipstream.tasks.environments import check_environment
from slipstream.tasks.reward_conventions import RewardTerm
from slipstream.tasks.stream import DataStream

Positive = Annotated[int, msgspec.Meta(ge=1)]


class RolloutSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    devices: Positive = 2  # rollout actors, one device (here: one pinned core) each
    spec_mode: Literal["rejection", "reproducible"] = (
        "reproducible"  # reproducible: tokens independent of speculation
    )
    tuner: TunerConfig = TunerConfig()  # buckets and speculation arms ("off" alone = plain decoding)
    verify_weights: bool = False  # re-hash the applied weights (and drafters' heads): proves sync exact
    # Sequences one rollout decodes at once (its KV cache slots, as vLLM's max_num_seqs); the rest of what it
    # is dealt waits for a free slot. 0: all it can be dealt in a step, ceil(prompts_per_step / devices) x
    # group_size. Tokens do not depend on it in reproducible mode (a sample's seed fixes them).
    max_batch: Annotated[int, msgspec.Meta(ge=0)] = 0
    # The rollouts' policy dtype: "" = bfloat16 on cuda, the checkpoint's own on cpu. The learner keeps fp32
    # masters and pushes in this dtype.
    dtype: Literal["", "float32", "bfloat16", "float16"] = ""
    # What a rollout keeps of earlier steps' responses per prompt, and how the "history" and "cascade" arms
    # draft from it (engine/history.py); kept only where an arm drafts from it.
    history: HistoryConfig = HistoryConfig()


class DrafterSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    enabled: bool = True  # train an EAGLE drafter in leased idle device time
    # The head to start from: a shipped name (engine/hub.py DRAFTERS, e.g. smollm2-135m-chain-sum) or an
    # exported head's directory; "" = untrained (the tuner keeps it off until it pays).
    init_from: str = ""
    batch_tokens: Positive = 512  # tokens per drafter step: bounds the preemption latency
    lr: float = 1e-3
    # Steps over which lr ramps up (0: none). Started from a trained head, AdamW's first full-size steps
    # knocked it off its optimum and the rollouts drafted with a worse head for most of a run (longtail.yaml
    # sets 50; the demo's figures were measured without, docs/training.md)
    warmup_steps: Annotated[int, msgspec.Meta(ge=0)] = 0
    unroll_steps: Positive = 1  # draft steps simulated per training batch (the offline recipe's stage 2: 3)
    publish_every_steps: Positive = 10

    def __post_init__(self) -> None:
        if self.init_from:  # a misspelt name fails here, at start, not in every actor's on_start
            try:
                hub.drafter_dir(self.init_from)
            except ValueError as e:
                raise ValueError(f"init_from: {e}") from None


class VerifierSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    actors: Positive = 1
    workers: Positive = 1  # reward worker processes per verifier actor
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0  # per reward call; past it the sample is invalid
    batch_size: Positive = 32  # most completions in one call of a batched reward (docs/rewards.md)
    batch_wait_s: Annotated[float, msgspec.Meta(ge=0)] = 0.05  # longest a batch waits to fill
    batch_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0  # limit of one batched call


class EnvironmentSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Multi-turn episodes (issue 42, docs/environments.md): each sample is an episode of `env`, opened
    from its dataset row; environment actors answer the policy's turns. Unset `env`: single-turn."""

    env: str = ""  # the episode factory "pkg.module:Name" (tasks/environments.py); "" = no environment
    options: dict[str, Any] = {}  # the factory's keyword arguments after the row
    actors: Positive = 1  # environment actors; rollout r talks to actor r % actors
    max_turns: Positive = 8  # policy turns of an episode; past it the episode ends, scored by the reward
    max_turn_tokens: Positive = 256  # one policy turn's tokens
    # An episode's tokens after its opening, the policy's and the environment's (its requests' max_tokens);
    # 0 = the run's max_tokens
    max_total_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    # One call into the environment (its factory, opening or a reply); past it the sample is invalid. The
    # rollout waits 5 s more for the answer (the wire) before it takes the environment as lost.
    turn_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    max_replays: Annotated[int, msgspec.Meta(ge=0)] = 3  # replays of one sample after environment restarts

    def __post_init__(self) -> None:
        if self.env:  # a misspelt path or option fails here, at start, naming the field
            check_environment(self.env, self.options)
        elif self.options:
            raise ValueError("options: set without env")
        if self.max_total_tokens and self.max_turn_tokens > self.max_total_tokens:
            raise ValueError(
                f"max_turn_tokens: {self.max_turn_tokens} exceeds max_total_tokens ({self.max_total_tokens})"
            )

    def limits(self) -> EpisodeLimits:
        """The rollouts' caps of one episode."""
        return EpisodeLimits(
            max_turns=self.max_turns, max_turn_tokens=self.max_turn_tokens,
            turn_timeout_s=self.turn_timeout_s + 5.0, max_replays=self.max_replays,
        )  # fmt: skip


class LearnerSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    # learner ranks (gloo on CPU, NCCL on CUDA); several shard the policy (FSDP2): each holds 1/ranks of the
    # weights, gradients and AdamW's moments
    ranks: Positive = 1
    threads: Positive = 2  # torch threads per rank: the rollouts are idle while the learner trains
    # Pushes to other hosts as XOR deltas against the version each acknowledged (zstd); false: full buckets
    # (for a network faster than the encode, ~0.5 GB/s a core in fp32: docs/cluster.md)
    push_deltas: bool = True
    delta_threads: Annotated[int, msgspec.Meta(ge=0)] = (
        0  # zstd threads encoding a delta (0: the pusher's own)
    )
    optim: OptimConfig = OptimConfig()
    loss: LossConfig = LossConfig()
    # Forward and backward under bf16 autocast with fp32 masters and optimizer state ("bf16"), or fp32
    # throughout; "auto": bf16 on cuda, fp32 on a CPU (until a CPU measures it faster and learning as well).
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    push_ipc: bool = True  # on a GPU, pushes to the same node as CUDA IPC refs; false: through host memory
    # each decoder layer keeps only its input for backward and recomputes the rest: long samples (8k-32k
    # tokens) train in a fraction of the activations, for ~a third more learner compute
    activation_checkpointing: bool = False


class GpuMemorySection(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Shares of a GPU's memory per actor of each role, where several actors share one (every role on a
    one-GPU host; a rollout and its drafter on a larger one); unset: an even split of what the set ones
    and the CUDA contexts leave (runtime/placement.py GpuShares). A plan that does not fit fails at start."""

    rollout: Annotated[float, msgspec.Meta(gt=0, lt=1)] | None = None
    drafter: Annotated[float, msgspec.Meta(gt=0, lt=1)] | None = None
    learner: Annotated[float, msgspec.Meta(gt=0, lt=1)] | None = None


class PlacementSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    gpu_memory: GpuMemorySection = GpuMemorySection()  # memory shares of a GPU that several actors share


class FaultsSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    # A dead rollout or verifier is restarted (same rank and config) and dealt again what it owed, up to
    # this many times per actor per run; past it the run ends naming the actor and its last words.
    max_restarts: Annotated[int, msgspec.Meta(ge=0)] = 3
    restart_backoff_s: Annotated[float, msgspec.Meta(ge=0.0)] = 0.5  # doubles with each restart of one actor
    # Steps in a row whose every sample's reward failed before the run ends naming the reward's error (such a
    # step changes nothing: no sample, no optimizer step).
    max_invalid_steps: Annotated[int, msgspec.Meta(ge=1)] = 3
    # An actor whose compute loop makes no progress for this long (no loop turn, no learner micro-batch)
    # while its heartbeats still arrive is killed and handled as dead: restarted, its work dealt again.
    # A stopped process (no heartbeats) is caught in ~3 s regardless. 0 = off. There is no fixed deadline
    # for a learner step or a weight sync: a step takes what its batch takes while its actors progress.
    hang_s: Annotated[float, msgspec.Meta(ge=0.0)] = 300.0
    # Across nodes: the head declares a node lost when its agent is silent this long (its actors restart on
    # node 0), and an agent that hears no head this long stops its actors and exits. Agents beat every 1 s:
    # at least 3 s, so one late beat never loses a node.
    node_lost_s: Annotated[float, msgspec.Meta(ge=3.0)] = 10.0


class NodeSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """What one node of a multi-node run runs (ranks are numbered across the nodes in order)."""

    rollouts: Annotated[int, msgspec.Meta(ge=0)] = 0  # rollout devices (each with its node's drafter)
    verifiers: Annotated[int, msgspec.Meta(ge=0)] = 0
    learners: Annotated[int, msgspec.Meta(ge=0)] = 0  # learner ranks: rank 0 must be on node 0 (the head)


class TransportSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    # TCP between the nodes of a run: "curve" (encrypted; only holders of the run's key connect) or
    # "plaintext", refused unless `insecure: true` says the network is trusted. One host: ipc, unaffected.
    security: Literal["curve", "plaintext"] = "curve"
    insecure: bool = False


class TrainConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    device: Literal["cpu", "cuda"] = "cpu"  # cuda: one GPU per rollout; placement in runtime/placement.py
    model: str = "smollm2-135m"  # model directory or registry name
    task: str = "chain_sum"  # reasoning-gym task name, or a JSONL file of {question, answer}
    task_options: dict[str, Any] = {}  # the reasoning-gym task's own options (difficulty)
    # Rows per epoch of a reasoning-gym task (generated as read); a file's epoch is its rows. Epochs are
    # shuffled by the seed; the cursor is checkpointed, so a resume neither skips nor replays a prompt.
    dataset_size: Positive = DEFAULT_DATASET_SIZE
    # "pkg.mod:fn" (a per-completion, TRL-style batched or verl compute_score function, or a class), or
    # weighted terms [{fn, weight, name, …}] (docs/rewards.md); "" = the task's scorer or math-verify
    reward: str | tuple[RewardTerm, ...] = ""
    system_prompt: str = ""  # a system turn before every question ("" = none)
    steps: Positive = 8
    prompts_per_step: Positive = 8
    group_size: Annotated[int, msgspec.Meta(ge=2)] = 4  # responses per prompt (G)
    max_tokens: Positive = 128
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=0)] = 0
    seed: Annotated[int, msgspec.Meta(ge=0, lt=MAX_SEED >> GROUP_BITS)] = 0
    checkpoint_every: Annotated[int, msgspec.Meta(ge=0)] = 10  # steps between checkpoints (0: by time alone)
    # ... and at least this often, whatever the steps (0 = off): a crash loses at most this much work
    checkpoint_minutes: Annotated[float, msgspec.Meta(ge=0.0)] = 30.0
    keep_checkpoints: Annotated[int, msgspec.Meta(ge=1)] = 2  # the newest K are kept, older ones deleted
    # The run's last checkpoint also as an HF model directory in RUN/hf (config.json, safetensors, tokenizer
    # files: transformers and vLLM load it); `slipstream export RUN --step N` writes any other one.
    checkpoint_hf: bool = True
    rollout: RolloutSection = RolloutSection()
    drafter: DrafterSection = DrafterSection()
    verifier: VerifierSection = VerifierSection()
    environment: EnvironmentSection = EnvironmentSection()  # multi-turn episodes; unset: single-turn
    learner: LearnerSection = LearnerSection()
    faults: FaultsSection = FaultsSection()
    metrics: MetricsConfig = MetricsConfig()  # TensorBoard, wandb: where step records also go
    # Every process records spans into RUN/spans/ (runtime/spans.py): `slipstream trace` and the report's
    # long-tail view read them. A clock read and a list append per span (overhead: docs/tracing.md).
    trace: bool = True
    # A run across nodes (`--nnodes`): what each node runs, one entry per node; [] = rollouts and verifiers
    # spread evenly over the nodes, every learner rank on node 0 (runtime/placement.py).
    nodes: list[NodeSection] = []
    transport: TransportSection = TransportSection()
    placement: PlacementSection = PlacementSection()


def load_config(path: Path | str | None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    return run_config.load(path, TrainConfig, overrides)


def require_transport(cfg: TrainConfig, cluster: Cluster) -> None:
    """Refuses plaintext TCP between nodes unless the config says the network is trusted."""
    if cluster.multi and cfg.transport.security == "plaintext" and not cfg.transport.insecure:
        raise run_config.ConfigError(
            "transport.insecure: plaintext TCP across hosts is refused; use transport.security: curve (the "
            "default), or say transport.insecure: true for a network you trust"
        )


def data_stream(cfg: TrainConfig, state: dict[str, Any], log: Any = None) -> DataStream:
    """The run's prompts as a stream of epochs, at the cursor `state` saved (or at the start)."""
    source, report = load_rows(cfg.task, seed=cfg.seed, size=cfg.dataset_size, options=cfg.task_options)
    if report is not None and log is not None:
        log.info("data", summary=report.summary(), rows=len(source), skipped=len(report.skipped))
    if "data" in state:
        return DataStream.from_state(source, cfg.seed, state["data"])
    stream = DataStream(source, cfg.seed)
    # A checkpoint from before the cursor was saved: the steps done read the rows in order.
    stream.seek(*divmod(int(state.get("step", 0)) * cfg.prompts_per_step, stream.size))
    return stream


def sampling_of(cfg: TrainConfig) -> dict[str, Any]:
    """How the run samples, as a ScoredGroup states it."""
    return {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k}


def default_reward(cfg: TrainConfig) -> str | tuple[RewardTerm, ...]:
    if cfg.reward:
        return cfg.reward
    name = "math_verify" if cfg.task.endswith((".jsonl", ".parquet")) else "reasoning_gym"
    return f"slipstream.tasks.rewards:{name}"


def episode_tokens(cfg: TrainConfig) -> int:
    """The tokens a sample may hold after its prompt: an episode's policy and environment tokens together."""
    return (cfg.environment.env and cfg.environment.max_total_tokens) or cfg.max_tokens


def learner_precision(cfg: TrainConfig) -> str:
    """The learner's precision ("auto": bf16 on cuda, fp32 on a CPU)."""
    if cfg.learner.precision != "auto":
        return cfg.learner.precision
    return "bf16" if cfg.device == "cuda" else "fp32"


def rollout_dtype(cfg: TrainConfig) -> str:
    """The rollouts' policy dtype name ("" = the checkpoint's own)."""
    if cfg.rollout.dtype:
        return cfg.rollout.dtype
    return "bfloat16" if cfg.device == "cuda" else ""
