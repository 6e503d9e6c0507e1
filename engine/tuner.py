"""The speculation tuner: a bandit per batch-size bucket that picks how (and whether) to speculate.

Each decode iteration the caller (the rollout actor) asks `Tuner.choose(batch_size)` for an arm — a drafter
kind, depth, top-k and verify budget — runs it through `Generator.set_spec(tuner.arm(name).spec(mode))`, and
feeds back `Tuner.record(batch_size, arm, committed_tokens, seconds)`. Each bucket of batch sizes is its own
bandit (what pays depends mostly on the live batch); "off" is an arm in every bucket, so speculation switches
itself off where it loses. Pure Python: the caller logs every `Decision` and persists `state_dict()`. The
arms, their grammar and `TunerConfig`: `tuner_config.py`.

Non-obvious choices (why, with the measurements: docs/engine.md, "Tuner"):
- The reward is the iteration's speedup over plain decoding at the same batch size, from a cost model of
  recent "off" iterations: raw tokens/s would favour arms measured at larger batches.
- Per bucket: `hold` iterations pool into one sample (a look, an arm's first there or an exploration, spans
  `hold` sequence-passes: one iteration at batch >= hold, since a cold start tries every arm everywhere and
  exploring a losing arm at a large batch costs several plain iterations each), the estimate is a
  sliding-window median, untried arms go first, then ε-greedy explores the least-measured arm, less often
  the longer its iterations and the less it pays (its reward's share of the best's: plain decoding where a
  drafter doubles the speed is looked at half as often); `forget(method)` restarts a method's arms when its
  drafter changes. All draws come from one seeded `random.Random`.
- `max_batch` caps the batch sizes at which an arm is offered at all: a prior (a CPU core's verify pass costs
  several plain ones past batch ~4) that spares the looks the bandit would otherwise keep paying there.
- A stale drafter (eagle, hybrid: a trained head, e.g. one lagging a policy update) is benched: when the
  caller's `record_acceptance` shows under `stale_accept` accepted draft tokens per sequence per pass over
  the method's last `stale_window` iterations, `choose` skips its arms until `refresh(method)` (a new head
  arrived) or `forget(method)`. The bandit alone would keep exploring them; benched, they cost nothing.
"""

from __future__ import annotations

import bisect
import random
import statistics
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import msgspec

from slipstream.engine.tuner_config import OFF, Arm, TunerConfig, parse_arm
from slipstream.engine.tuner_config import is_int as _is_int

__all__ = ["STALE_METHODS", "Arm", "Decision", "StaleDrafter", "Tuner", "TunerConfig", "parse_arm"]

Sample = tuple[float, float, float, int]
"""One reward sample, pooled over `hold` iterations (fewer for an arm's first look): committed tokens per
sequence, seconds, mean batch size, iterations."""
Why = Literal["untried", "exploit", "explore", "forced", "hold"]
Available = Callable[[str], bool] | Collection[str] | None

_STATE_VERSION = 3
PLAIN_WINDOW = 8
"""Recent "off" iteration times kept per batch size for the plain cost model."""
STALE_METHODS = ("eagle", "hybrid", "cascade")
"""Methods whose drafter is a trained head that a newer one replaces, so a stale one can be benched until then
(an n-gram table has no successor: a spell of text without repeats would bench it for good)."""


@dataclass(frozen=True)
class Decision:
    """One choice of the tuner, for the caller to apply and to log."""

    batch_size: int
    bucket: int
    """Index of the batch-size bucket."""
    label: str
    """The bucket's batch sizes: "1", "3-4", "17+"."""
    arm: str
    """Canonical arm name; `Tuner.arm(name).spec(mode)` is what to run."""
    why: Why
    """untried (cold start), exploit (best median), explore (epsilon), forced (only "off" is available),
    hold (kept from this bucket's previous decision, `TunerConfig.hold`)."""
    estimate: float | None
    """The arm's median reward in this bucket before this decision (speedup over plain decoding; tokens/s per
    sequence before plain decoding was timed); None without rewards."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StaleDrafter:
    """Why a drafter method is benched: its acceptance over its last `TunerConfig.stale_window` iterations."""

    method: str
    """"eagle", "hybrid" or "cascade"."""
    acceptance: float
    """Accepted draft tokens per sequence per pass over the window (below `TunerConfig.stale_accept`)."""
    iterations: int
    """The window: iterations of this method judged."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Tuner:
    """ε-greedy bandit per batch-size bucket over speculation arms; see the module docstring."""

    def __init__(self, config: TunerConfig | None = None) -> None:
        self.config = config if config is not None else TunerConfig()
        arms = [parse_arm(text) for text in self.config.arms]
        self.arms: tuple[Arm, ...] = tuple(arms if OFF in arms else [OFF, *arms])
        self.edges: tuple[int, ...] = tuple(self.config.buckets)
        self._index = {arm.name: i for i, arm in enumerate(self.arms)}
        # arm index → the largest batch size it is offered at
        self._max_batch = {self._index[parse_arm(t).name]: cap for t, cap in self.config.max_batch.items()}
        nb, na = len(self.edges), len(self.arms)
        # [bucket][arm] → the latest reward samples: (committed tokens per sequence, seconds, mean batch size),
        # each pooled over `hold` iterations
        self._windows: list[list[deque[Sample]]] = [
            [deque(maxlen=self.config.window) for _ in range(na)] for _ in range(nb)
        ]
        self._trials = [[0] * na for _ in range(nb)]  # lifetime samples, for the summary
        self._attempt = [[-1] * na for _ in range(nb)]  # decision count of the latest exploration attempt
        # (arm, decisions still held, look: -1, or for a look (a first look or an exploration) the arm's
        # window length when it began: the hold ends once that look's sample closed)
        self._hold: list[tuple[int, int, int] | None] = [None] * nb
        # [bucket][arm] → [committed per sequence, seconds, iterations, batch sizes summed] pooled so far
        # towards the next reward sample
        self._pending = [[_no_pending() for _ in range(na)] for _ in range(nb)]
        self._plain: dict[int, deque[float]] = {}  # batch size → recent seconds of "off" iterations
        self._plain_fit: _PlainCost | None = None  # built from _plain when first needed after a change
        # method → its latest iterations' (accepted draft tokens, sequences), for the stale test
        self._acceptance: dict[str, deque[tuple[int, int]]] = {
            m: deque(maxlen=self.config.stale_window) for m in STALE_METHODS
        }
        self._stale: dict[str, StaleDrafter] = {}
        self._too_wide: frozenset[int] = frozenset()  # arms whose verify pass exceeds the captured nodes
        self.decisions = 0
        self._rng = random.Random(self.config.seed)

    # -- buckets and arms -----------------------------------------------------------------------------

    def bucket(self, batch_size: int) -> int:
        """Index of the bucket holding `batch_size` (>= 1; above the last edge: the last bucket)."""
        if not _is_int(batch_size) or batch_size < 1:
            # An iteration without decodes speculates nothing: asking about it is a caller bug.
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        b = 0
        while b + 1 < len(self.edges) and self.edges[b + 1] <= batch_size:
            b += 1
        return b

    def label(self, bucket: int) -> str:
        """The batch sizes of a bucket as text: "1", "3-4", "17+"."""
        lo = self.edges[bucket]
        if bucket + 1 == len(self.edges):
            return f"{lo}+"
        hi = self.edges[bucket + 1] - 1
        return str(lo) if hi == lo else f"{lo}-{hi}"

    def arm(self, name: str) -> Arm:
        """The arm called `name` (any spelling of it)."""
        return self.arms[self._arm_index(name)]

    def max_batch(self, name: str) -> int | None:
        """The largest batch size arm `name` is offered at (None: every batch size)."""
        return self._max_batch.get(self._arm_index(name))

    def _arm_index(self, name: str) -> int:
        i = self._index.get(name)
        if i is None:
            try:
                i = self._index.get(parse_arm(name).name)
            except ValueError:
                pass
        if i is None:
            raise ValueError(f"unknown arm {name!r}; the tuner's arms are {[a.name for a in self.arms]}")
        return i

    # -- the bandit -----------------------------------------------------------------------------------

    def choose(self, batch_size: int, available: Available = None) -> Decision:
        """The arm for the next iteration at this batch size.

        available: the methods that can run now — a predicate or a collection of method names (e.g. no
        "eagle" before a drafter exists); None: all. "off" is always available; a stale method never is.
        """
        b = self.bucket(batch_size)
        candidates = self._offered(batch_size, available)
        windows = self._windows[b]
        self.decisions += 1
        held = self._hold[b]
        looked = held is not None and held[2] >= 0 and len(windows[held[0]]) > held[2]  # its sample closed
        if held is not None and held[1] > 0 and held[0] in candidates and not looked:
            self._hold[b] = (held[0], held[1] - 1, held[2])
            return self._decision(batch_size, b, held[0], "hold")
        why: Why
        if len(candidates) == 1:
            i, why = candidates[0], "forced"
        elif untried := [i for i in candidates if len(windows[i]) < self.config.min_trials]:
            prior = self._prior(b)
            i, why = min(untried, key=lambda i: (len(windows[i]), -prior[i], i)), "untried"
        else:
            best = max(candidates, key=lambda i: (self._score(windows[i], i), -i))
            i, why = best, "exploit"
            if self._rng.random() < self.config.epsilon:
                # Fewest samples first (the least-measured estimate is the likeliest to be wrong), then in turn.
                turn = min(
                    (j for j in candidates if j != best),
                    key=lambda j: (len(windows[j]), self._attempt[b][j], j),
                )
                self._attempt[b][turn] = self.decisions
                # Rationed by the time a look takes (1 / slower), then by the throughput it gives up in that
                # time (its reward's share of the best's): module docstring.
                slower = _median_seconds(windows[turn]) / max(_median_seconds(windows[best]), 1e-12)
                share = self._median_reward(windows[turn]) / max(self._median_reward(windows[best]), 1e-12)
                if self._rng.random() * max(slower, 1.0) < min(share, 1.0):
                    i, why = turn, "explore"
        # A first look or an exploration is a look: held until its sample closes (module docstring).
        look = len(windows[i]) if not windows[i] or why == "explore" else -1
        self._hold[b] = (i, self.config.hold - 1, look) if self.config.hold > 1 and why != "forced" else None
        return self._decision(batch_size, b, i, why)

    def _offered(self, batch_size: int, available: Available) -> list[int]:
        """The candidates (`_candidates`) offered at this batch size: within their `max_batch`."""
        return [i for i in self._candidates(available) if batch_size <= self._max_batch.get(i, batch_size)]

    def _candidates(self, available: Available) -> list[int]:
        ok = available if available is None or callable(available) else frozenset(available).__contains__
        return [
            i
            for i, arm in enumerate(self.arms)
            if arm.method == "off"
            or (arm.method not in self._stale and i not in self._too_wide and (ok is None or ok(arm.method)))
        ]

    def limit_nodes(self, max_nodes: int | None) -> list[str]:
        """Offer only arms whose verify pass (the pending token and the arm's draft budget) fits `max_nodes`
        a row: a fixed-shape generator's largest captured node bucket (`Generator.max_nodes`; None: no
        limit). A wider arm would have its drafts cut to fit and be measured as another arm. Returns the
        names of the arms no longer offered."""
        self._too_wide = frozenset(
            i
            for i, arm in enumerate(self.arms)
            if max_nodes is not None and arm.method != "off" and 1 + arm.spec().verify_budget > max_nodes
        )
        return [self.arms[i].name for i in sorted(self._too_wide)]

    def _decision(self, batch_size: int, b: int, i: int, why: Why) -> Decision:
        window = self._windows[b][i]
        estimate = self._median_reward(window) if window else None
        return Decision(batch_size, b, self.label(b), self.arms[i].name, why, estimate)

    def _prior(self, b: int) -> list[float]:
        """Per arm: its median reward over the best median in the nearest bucket where it has rewards (1.0
        where it has none) — a ratio, because throughput itself grows with the batch."""
        prior = [1.0] * len(self.arms)
        nearest = sorted(range(len(self.edges)), key=lambda o: (abs(o - b), o))[1:]
        for i in range(len(self.arms)):
            for o in nearest:
                if self._windows[o][i]:
                    top = max(self._median_reward(w) for w in self._windows[o] if w)
                    prior[i] = self._median_reward(self._windows[o][i]) / top if top > 0 else 1.0
                    break
        return prior

    def record(self, batch_size: int, arm: str, committed_tokens: float, seconds: float) -> None:
        """Feed back one iteration run with `arm` at `batch_size` (the reward: its speedup over plain decoding
        at that batch size, see the module docstring; "off" iterations also time plain decoding).
        An iteration with seconds <= 0 (a clock that did not move) tells nothing and is ignored."""
        b, i = self.bucket(batch_size), self._arm_index(arm)
        if not committed_tokens >= 0:
            raise ValueError(f"committed_tokens must be >= 0, got {committed_tokens!r}")
        if not seconds > 0:
            return
        if self.arms[i] is OFF:
            self._plain.setdefault(batch_size, deque(maxlen=PLAIN_WINDOW)).append(float(seconds))
            self._plain_fit = None
        pending = self._pending[b][i]
        pending[0] += committed_tokens / batch_size  # per sequence: see the module docstring
        pending[1] += seconds
        pending[2] += 1
        pending[3] += batch_size
        # A look (an arm's first in a bucket, or an exploration) ends once it spans `hold` sequence-passes
        # (module docstring).
        held = self._hold[b]
        looking = held is not None and held[0] == i and held[2] == len(self._windows[b][i])
        if pending[2] >= self.config.hold or (
            (looking or not self._windows[b][i]) and pending[3] >= self.config.hold
        ):
            sample = (float(pending[0]), float(pending[1]), pending[3] / pending[2], int(pending[2]))
            self._windows[b][i].append(sample)
            self._trials[b][i] += 1
            self._pending[b][i] = _no_pending()

    def record_acceptance(
        self, arm: str, batch_size: int, accepted: int, drafted: int
    ) -> StaleDrafter | None:
        """Feed back the draft tokens one iteration run with `arm` proposed (`drafted`, all sequences) and
        accepted, for `batch_size` decoding sequences; any iteration counts, prefill or not. Returns the
        `StaleDrafter` when this iteration makes the arm's method stale (once: log it), else None.
        Methods outside STALE_METHODS, and iterations that drafted nothing, tell nothing and are ignored."""
        method = self.arm(arm).method
        if not (_is_int(accepted) and _is_int(drafted) and 0 <= accepted <= drafted):
            raise ValueError(f"need 0 <= accepted <= drafted, integers; got {accepted!r}, {drafted!r}")
        if method not in self._acceptance or method in self._stale or drafted == 0:
            return None
        if not _is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        window = self._acceptance[method]
        window.append((accepted, batch_size))
        if len(window) < self.config.stale_window:
            return None
        acceptance = sum(a for a, _ in window) / sum(n for _, n in window)
        if acceptance >= self.config.stale_accept:
            return None
        self._stale[method] = StaleDrafter(method, acceptance, len(window))
        return self._stale[method]

    def stale(self) -> dict[str, StaleDrafter]:
        """The benched methods and why (see `record_acceptance`)."""
        return dict(self._stale)

    def refresh(self, method: str) -> StaleDrafter | None:
        """A new drafter for `method` was installed: if the method was stale, it gets another chance — the
        mark goes, and so do its acceptance window (the new drafter is judged on its own iterations) and its
        arms' rewards (they measured the stale drafter: `forget`). Returns the mark it cleared, or None.
        A method that was not stale keeps its window: a collapse that spans small version steps still shows."""
        mark = self._stale.get(method)
        if mark is not None:
            self.forget(method)
        return mark

    def plain_seconds(self, batch_size: float) -> float | None:
        """The plain cost model: seconds of one "off" iteration at `batch_size` (None before any was timed)."""
        plain = self._plain_cost()
        return None if plain is None else plain(batch_size)

    def _plain_cost(self) -> _PlainCost | None:
        if self._plain_fit is None and self._plain:
            self._plain_fit = _PlainCost({b: statistics.median(s) for b, s in self._plain.items()})
        return self._plain_fit

    def _score(self, window: Iterable[Sample], i: int) -> float:
        """What arm i is ranked by when exploiting: its median reward, less `margin` for a speculating arm."""
        return self._median_reward(window) - (0.0 if self.arms[i] is OFF else self.config.margin)

    def _median_reward(self, window: Iterable[Sample]) -> float:
        """Median reward of a window's samples under the current plain cost model (module docstring)."""
        plain = self._plain_cost()
        if plain is None:
            return statistics.median(c / s for c, s, _, _ in window)
        return statistics.median(c * plain(batch) / s for c, s, batch, _ in window)

    def forget(self, method: str) -> int:
        """Empty the windows of `method`'s arms in every bucket (a new drafter version made their rewards
        stale): they are re-tried `min_trials` times before the tuner exploits again. A stale mark and the
        acceptance window go too. Returns the number of non-empty windows emptied."""
        self._stale.pop(method, None)
        if method in self._acceptance:
            self._acceptance[method].clear()
        cleared = 0
        for windows in self._windows:
            for arm, window in zip(self.arms, windows, strict=True):
                if arm.method == method and window:
                    window.clear()
                    cleared += 1
        for pending in self._pending:
            for arm, p in zip(self.arms, pending, strict=True):
                if arm.method == method:
                    p[:] = _no_pending()
        return cleared

    def best(self, batch_size: int, available: Available = None) -> str | None:
        """The arm the tuner would exploit at this batch size (no side effects); None without rewards."""
        windows = self._windows[self.bucket(batch_size)]
        scored = [
            (self._score(windows[i], i), -i) for i in self._offered(batch_size, available) if windows[i]
        ]
        return self.arms[-max(scored)[1]].name if scored else None

    def estimate(self, batch_size: int, arm: str) -> float | None:
        """Median reward of `arm` in the bucket of `batch_size` (speedup over plain decoding; tokens/s per
        sequence before plain decoding was timed); None without rewards."""
        window = self._windows[self.bucket(batch_size)][self._arm_index(arm)]
        return self._median_reward(window) if window else None

    def summary(self) -> list[dict[str, Any]]:
        """Per bucket: the best arm and its median reward, and per arm its median reward (as `estimate`), the
        median seconds of one iteration and its lifetime number of samples (for logs and
        bench JSON)."""
        out = []
        for b, windows in enumerate(self._windows):
            best = self.best(self.edges[b])
            arms = {
                arm.name: {
                    "median": self._median_reward(w) if w else None,
                    "seconds": _median_seconds(w) if w else None,
                    "trials": self._trials[b][i],
                }
                for i, (arm, w) in enumerate(zip(self.arms, windows, strict=True))
            }
            median = arms[best]["median"] if best is not None else None
            out.append({"bucket": self.label(b), "best": best, "median": median, "arms": arms})
        return out

    # -- persistence ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything the tuner has learnt, as JSON-serialisable values."""
        version, internal, gauss = self._rng.getstate()
        return {
            "version": _STATE_VERSION,
            "config": msgspec.to_builtins(self.config),
            "buckets": list(self.edges),
            "arms": [arm.name for arm in self.arms],
            "windows": [[[list(sample) for sample in w] for w in windows] for windows in self._windows],
            "trials": [list(t) for t in self._trials],
            "attempt": [list(t) for t in self._attempt],
            "hold": [list(h) if h is not None else None for h in self._hold],
            "pending": [[list(p) for p in pending] for pending in self._pending],
            "plain": [[b, list(s)] for b, s in sorted(self._plain.items())],
            "acceptance": {m: [list(x) for x in w] for m, w in self._acceptance.items()},
            "stale": {m: [s.acceptance, s.iterations] for m, s in self._stale.items()},
            "decisions": self.decisions,
            "rng": [version, list(internal), gauss],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output (also after a JSON round trip). Buckets and arms must match this
        tuner's; epsilon, min_trials, hold and the stale knobs may differ (the new values apply from now on),
        and a shorter window keeps the newest iterations. State saved before stale tracking loads as none."""
        version = state.get("version")
        if version not in (1, 2, _STATE_VERSION):
            raise ValueError(f"tuner state version {version!r}, expected {_STATE_VERSION} (or 1, 2)")
        if list(state["buckets"]) != list(self.edges):
            raise ValueError(
                f"tuner state buckets {state['buckets']} differ from TunerConfig.buckets {list(self.edges)}"
            )
        names = [arm.name for arm in self.arms]
        if list(state["arms"]) != names:
            raise ValueError(f"tuner state arms {state['arms']} differ from this tuner's arms {names}")
        window = self.config.window
        # Version 1 kept no batch sizes: its samples count as taken at their bucket's lower edge. Versions 1
        # and 2 kept no iteration counts: every sample pooled the saving config's `hold`.
        held = int(state.get("config", {}).get("hold", self.config.hold))
        self._windows = [
            [
                deque(
                    (
                        (float(c), float(s), float(x[0] if x else edge), int(x[1] if len(x) > 1 else held))
                        for c, s, *x in w
                    ),
                    maxlen=window,
                )
                for w in windows
            ]
            for edge, windows in zip(self.edges, state["windows"], strict=True)
        ]
        self._trials = [[int(n) for n in t] for t in state["trials"]]
        self._attempt = [[int(n) for n in t] for t in state["attempt"]]
        self._hold = [
            # state saved before explorations were looks held a bool: a first look (window 0) or none
            (int(h[0]), int(h[1]), _look(h[2]) if len(h) > 2 else -1) if h is not None else None
            for h in state["hold"]
        ]
        self._pending = [
            [[float(c), float(s), int(n), int(x[0] if x else n * edge)] for c, s, n, *x in pending]
            for edge, pending in zip(self.edges, state["pending"], strict=True)
        ]
        self._plain = {
            int(b): deque((float(x) for x in s), maxlen=PLAIN_WINDOW) for b, s in state.get("plain", [])
        }
        self._plain_fit = None
        saved = state.get("acceptance", {})
        self._acceptance = {
            m: deque(((int(a), int(n)) for a, n in saved.get(m, [])), maxlen=self.config.stale_window)
            for m in STALE_METHODS
        }
        self._stale = {
            m: StaleDrafter(m, float(acceptance), int(iterations))
            for m, (acceptance, iterations) in state.get("stale", {}).items()
        }
        self.decisions = int(state["decisions"])
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))


def _look(value: bool | int) -> int:
    if isinstance(value, bool):
        return 0 if value else -1
    return int(value)


def _no_pending() -> list[float]:
    """An empty pooled sample: [committed per sequence, seconds, iterations, batch sizes summed]."""
    return [0.0, 0.0, 0, 0]


def _median_seconds(window: Iterable[Sample]) -> float:
    """Median seconds of one iteration (a first look pools fewer than `hold`)."""
    return statistics.median(s / n for _, s, _, n in window)


class _PlainCost:
    """Seconds of one plain iteration as a function of the batch size, from per-size medians: linear between
    measured sizes, the least-squares slope (clamped at >= 0) beyond them, constant from a single size."""

    def __init__(self, medians: dict[int, float]) -> None:
        self.sizes = sorted(medians)
        self.seconds = [medians[b] for b in self.sizes]
        n = len(self.sizes)
        mean_b, mean_s = sum(self.sizes) / n, sum(self.seconds) / n
        spread = sum((b - mean_b) ** 2 for b in self.sizes)
        covariance = sum((b - mean_b) * (t - mean_s) for b, t in zip(self.sizes, self.seconds, strict=True))
        self.slope = max(0.0, covariance / spread) if spread else 0.0

    def __call__(self, batch: float) -> float:
        sizes, seconds = self.sizes, self.seconds
        if batch <= sizes[0]:
            # Below the smallest timed size, never less than half its time: a pass has a fixed cost.
            return max(seconds[0] - self.slope * (sizes[0] - batch), seconds[0] / 2)
        if batch >= sizes[-1]:
            return seconds[-1] + self.slope * (batch - sizes[-1])
        j = bisect.bisect_right(sizes, batch)
        lo, hi = sizes[j - 1], sizes[j]
        return seconds[j - 1] + (seconds[j] - seconds[j - 1]) * (batch - lo) / (hi - lo)
