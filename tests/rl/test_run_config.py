"""The run config's newer fields reach the actors they are for (rl/run_config.py): the learner's precision,
GPU memory shares on every actor that shares a card (a simulated one-GPU node), the verifier's batching
and a weighted reward's terms; bad values fail at start naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.rl import run_config, run_plan
from slipstream.runtime.config import ConfigError
from slipstream.runtime.placement import GPU_MEMORY_ENV, Host

H100 = 80 * 2**30


def configs(specs: list, kind: str) -> list:
    return [s for s in specs if s.actor.endswith(f":{kind}")]


def test_the_learner_precision_is_bf16_on_cuda_and_fp32_on_a_cpu_unless_set(tmp_path: Path) -> None:
    cpu = run_config.load_config(None, [])
    assert run_config.learner_precision(cpu) == "fp32"
    assert run_config.learner_precision(run_config.load_config(None, ["device=cuda"])) == "bf16"
    bf16 = run_config.load_config(None, ["learner.precision=bf16"])
    (learner,) = configs(run_plan.actor_specs(bf16, tmp_path, baseline=True, resume_from=""), "LearnerActor")
    assert learner.config.precision == "bf16"
    with pytest.raises(ConfigError, match=r"^learner\.precision: "):
        run_config.load_config(None, ["learner.precision=fp8"])


def test_every_actor_on_a_shared_gpu_carries_its_memory_share(tmp_path: Path) -> None:
    cfg = run_config.load_config(None, ["device=cuda", "placement.gpu_memory.learner=0.3"])
    specs = run_plan.actor_specs(cfg, tmp_path, baseline=False, resume_from="", hosts=[Host(16, 1, H100)])
    shared = configs(specs, "RolloutActor") + configs(specs, "DrafterActor") + configs(specs, "LearnerActor")
    assert len(shared) == 5 and all(s.env[GPU_MEMORY_ENV].startswith("cuda:0=") for s in shared)
    assert configs(specs, "LearnerActor")[0].env[GPU_MEMORY_ENV] == "cuda:0=0.3000"
    assert all(GPU_MEMORY_ENV not in s.env for s in configs(specs, "VerifierActor"))  # no GPU
    too_much = run_config.load_config(None, ["device=cuda", "placement.gpu_memory.rollout=0.49"])
    with pytest.raises(ValueError, match=r"cuda:0 \(80\.0 GiB\) cannot hold 2 rollouts × 39\.2 GiB"):
        run_plan.actor_specs(too_much, tmp_path, baseline=False, resume_from="", hosts=[Host(16, 1, H100)])
    with pytest.raises(ConfigError, match=r"^placement\.gpu_memory\.learner: "):
        run_config.load_config(None, ["placement.gpu_memory.learner=1.5"])


def test_the_verifier_gets_its_batching_and_a_weighted_rewards_terms(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(
        "reward:\n"
        "  - {fn: 'slipstream.tasks.rewards:reasoning_gym', weight: 0.8}\n"
        "  - {fn: 'slipstream.tasks.rewards:answer_format', weight: 0.2, name: format}\n"
        "verifier: {batch_size: 8, batch_wait_s: 0.2}\n"
    )
    cfg = run_config.load_config(config, [])
    (verifier,) = configs(run_plan.actor_specs(cfg, tmp_path, baseline=True, resume_from=""), "VerifierActor")
    assert [t.weight for t in verifier.config.terms] == [0.8, 0.2] and verifier.config.terms[
        1
    ].label == "format"
    assert (verifier.config.batch_size, verifier.config.batch_wait_s) == (8, 0.2)
    assert verifier.config.data_source == cfg.task
