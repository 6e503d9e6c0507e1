"""The run config's `environment:` section mapped onto actors (issue 42): environment actors placed by the
rollouts they serve, each rollout told its actor and caps, each actor told the rollouts to notify."""

from __future__ import annotations

from pathlib import Path

from slipstream.actors.environment import EnvironmentActor
from slipstream.actors.rollout import RolloutActor
from slipstream.rl.run_config import load_config
from slipstream.rl.run_plan import actor_specs
from slipstream.runtime.host import actor_path
from slipstream.runtime.placement import environment_nodes


def test_environment_actors_go_where_their_first_rollout_runs() -> None:
    assert environment_nodes(2, [0, 1, 1]) == [0, 1]  # rollout 0 -> actor 0, rollout 1 -> actor 1
    assert environment_nodes(3, [1]) == [1, 0, 0]  # actors serving no rollout stay at the head


def test_specs_wire_rollouts_to_their_environment_actors(tmp_path: Path) -> None:
    cfg = load_config(None, [
        "rollout.devices=3", "max_tokens=64", "environment.env=slipstream.tasks.environments:GuessNumber",
        "environment.actors=2", "environment.max_total_tokens=300", "environment.max_turns=5",
        "environment.turn_timeout_s=7", "environment.options={high: 20}",
    ])  # fmt: skip
    specs = actor_specs(cfg, tmp_path, baseline=False, resume_from="")
    rollouts = [s for s in specs if s.actor == actor_path(RolloutActor)]
    envs = [s for s in specs if s.actor == actor_path(EnvironmentActor)]
    assert [s.config.environments for s in rollouts] == [["environment:0", "environment:1"]] * 3
    assert [s.config.episodes.max_turns for s in rollouts] == [5] * 3
    assert rollouts[0].config.episodes.turn_timeout_s == 12.0  # the environment's deadline + the wire's
    assert rollouts[0].config.max_len == 1024 + 300  # an episode's tokens, not max_tokens
    assert [s.config.notify for s in envs] == [["rollout:0", "rollout:2"], ["rollout:1"]]
    assert [(s.config.env, s.config.options, s.config.turn_timeout_s) for s in envs] == [
        ("slipstream.tasks.environments:GuessNumber", {"high": 20}, 7.0)
    ] * 2
    single = actor_specs(load_config(None, []), tmp_path, baseline=False, resume_from="")
    assert not [s for s in single if s.actor == actor_path(EnvironmentActor)]
    assert all(s.config.environments == [] for s in single if s.actor == actor_path(RolloutActor))
