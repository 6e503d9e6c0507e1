"""What the supervisor starts and what it reports: `ActorSpec` (one actor process: its class, rank, typed
config, threads, cores, node) and `ActorDied` (a death: who, why, how it was seen).

The spec travels as data: the config as plain values, converted back strictly in the actor's process, so a
bad config names its field there and, before anything spawns, in `Supervisor.start` (`actor_class`).

    spec = ActorSpec.of(RolloutActor, rank=0, config=RolloutActor.Config(model="smollm2-135m"), cpus=[0])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from slipstream.runtime.actor import Actor
from slipstream.runtime.config import convert
from slipstream.runtime.host import actor_path, import_actor
from slipstream.runtime.transport import actor_name

__all__ = ["ActorDied", "ActorSpec"]


class ActorSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One actor process to start: `ActorSpec.of(RolloutActor, rank=0, config=RolloutActor.Config(…))`.

    The config travels to the process as plain values and is converted back, strictly, to the actor's
    `Config` there. Plain values (a dict) are accepted too, for configs read from files and for tests of
    bad configs; either way `Supervisor.start` checks every config before it spawns anything.
    """

    actor: str  # import path "pkg.module:Class": what the spawned process imports
    rank: int = 0  # rank within its role
    config: msgspec.Struct | dict[str, Any] = {}  # an instance of the actor's Config, or its plain values
    threads: int = 1  # torch/OpenMP threads: the actor's share of this host's cores
    cpus: list[int] = []  # cores to pin to (empty: no pinning)
    env: dict[str, str] = {}
    # A hang deadline: ready, heartbeats arriving, but its compute loop made no turn (and a long handler
    # no `tick()`) for this long (seen at heartbeats: up to one interval more) -> killed and reported dead as
    # hung. 0 = off.
    hang_s: float = 0.0
    # The node of the run that starts it (0: this host). The supervisor's launcher must serve it: a local
    # launcher serves node 0 alone, node agents (issue 20) the others.
    node: int = 0

    @classmethod
    def of(
        cls,
        actor: type[Actor],
        *,
        rank: int = 0,
        config: msgspec.Struct | None = None,
        threads: int = 1,
        cpus: Sequence[int] = (),
        env: Mapping[str, str] | None = None,
        hang_s: float = 0.0,
        node: int = 0,
    ) -> ActorSpec:
        """The spec of Actor subclass `actor` with its typed `config` (default: `actor.Config()`)."""
        if not (isinstance(actor, type) and issubclass(actor, Actor)):
            raise TypeError(f"{actor!r} is not an Actor subclass")
        if config is None:
            config = actor.Config()
        if not isinstance(config, actor.Config):
            raise TypeError(
                f"{actor.__qualname__}: config is a {type(config).__qualname__}, "
                f"expected {actor.__qualname__}.Config"
            )
        return cls(
            actor=actor_path(actor),
            rank=rank,
            config=config,
            threads=threads,
            cpus=list(cpus),
            env=dict(env or {}),
            node=node,
            hang_s=hang_s,
        )

    def plain_config(self) -> dict[str, Any]:
        """The config as plain values: what Init carries (`msgspec.to_builtins`)."""
        return msgspec.to_builtins(self.config)

    def actor_class(self) -> type[Actor]:
        """The Actor subclass this spec starts, checked before anything spawns: importable, a valid name
        with its rank, and a config that converts to the class's `Config` as the actor's process will
        convert it. Raises ValueError (a ConfigError for the config) naming the actor."""
        try:
            cls = import_actor(self.actor)
        except (ImportError, ValueError) as e:
            raise ValueError(f"{self.actor}: cannot load actor: {e}") from None
        try:
            name = actor_name(cls.role, self.rank)
        except ValueError as e:
            raise ValueError(f"{self.actor}: {e}") from None
        if isinstance(self.config, msgspec.Struct) and not isinstance(self.config, cls.Config):
            raise ValueError(
                f"{name} config: a {type(self.config).__qualname__}, expected {cls.__qualname__}.Config"
            )
        convert(self.plain_config(), cls.Config, where=f"{name} config")  # what the actor will do with it
        return cls


@dataclass(frozen=True)
class ActorDied:
    name: str
    reason: str
    exit_code: int | None  # negative: killed by that signal; None: unknown (it stopped beating)
    detected_after_s: float  # from the last sign of life to detection
