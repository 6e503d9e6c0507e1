"""Fixed-shape sampling (`sample_static`) against today's `sampling` functions, and its capture safety.

Equality is bitwise (`torch.equal`) for probabilities, tokens and log-probs: the static functions run the
same float operations on the same values, so any difference is a bug, not rounding. Batches are seeded
loops over temperature (0, 0.5, 1, 1.7), top-k, top-p, greedy/sampled mixes, ties (quantised logits),
vocabularies that are not multiples of 64 and rows whose tail wins the race.

Capture safety: a step run under FakeTensorMode cannot read a value back (`.item()`, `bool(t)`) or make a
data-dependent shape (`nonzero`, boolean masks); each check is also run on a planted `.nonzero()` /
`.item()` and on today's `sample`, and must fail there. An op trace (name and output shapes of every aten
call) must not depend on the data.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from slipstream.engine import sample_static as static
from slipstream.engine.sample_static import (
    HEAD_SLOTS,
    _tail_mass,
    processed_probs_static,
    race_sample_static,
    sample_static,
)
from slipstream.engine.sampling import (
    HEAD_MIN_PROB,
    STREAM_RESIDUAL,
    STREAM_RESIDUAL_TAIL,
    _blocks,
    _cutoffs,
    processed_probs,
    race_sample,
    sample,
)

TEMPERATURES = (0.0, 0.5, 1.0, 1.7)
TOP_P = (1.0, 1.0, 0.95, 0.7, 0.3, 0.05)
VOCABS = (37, 64, 100, 1000)


def top_ks(vocab: int) -> tuple[int, ...]:
    return (0, 0, 1, 2, 5, 17, vocab - 1, vocab, vocab + 3)


def pick(g: torch.Generator, values: tuple, rows: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)[torch.randint(len(values), (rows,), generator=g)]


def random_params(g: torch.Generator, rows: int, vocab: int, *, greedy: bool = True, filtered: bool = True):
    """(temperature, top_p, top_k) [rows], each row drawn independently."""
    temperatures = TEMPERATURES if greedy else TEMPERATURES[1:]
    temperature = pick(g, temperatures, rows, torch.float32)
    top_p = pick(g, TOP_P if filtered else (1.0,), rows, torch.float32)
    top_k = pick(g, top_ks(vocab) if filtered else (0, vocab, vocab + 3), rows, torch.int64)
    return temperature, top_p, top_k


def random_logits(g: torch.Generator, rows: int, vocab: int, case: int) -> torch.Tensor:
    """Flat, ordinary or peaked rows; every third case quantised to a few values (many exact ties)."""
    logits = torch.randn(rows, vocab, generator=g) * (0.05, 1.0, 3.0, 8.0)[case % 4]
    return (logits * 2).round() / 2 if case % 3 == 0 else logits


def keys(g: torch.Generator, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(seeds, positions) [rows]: seeds over the full 63-bit range the hash accepts."""
    return torch.randint(0, 2**62, (rows,), generator=g), torch.randint(0, 10_000, (rows,), generator=g)


# ---------------------------------------------------------------------------------------------------------
# Equality with today's functions


@pytest.mark.parametrize("vocab", VOCABS)
def test_processed_probs_static_is_processed_probs(vocab):
    g = torch.Generator().manual_seed(vocab)
    for case in range(24):
        logits = random_logits(g, 10, vocab, case)
        params = random_params(g, 10, vocab)
        expected = processed_probs(logits, *params)
        assert torch.equal(processed_probs_static(logits, *params, filtered=True), expected), case


@pytest.mark.parametrize("vocab", VOCABS)
def test_unfiltered_variant_skips_only_work(vocab):
    # No row filters: filtered=False is the cheap variant, and both variants equal today's.
    g = torch.Generator().manual_seed(vocab + 1)
    for case in range(8):
        logits = random_logits(g, 8, vocab, case)
        params = random_params(g, 8, vocab, filtered=False)
        expected = processed_probs(logits, *params)
        assert torch.equal(processed_probs_static(logits, *params, filtered=False), expected)
        assert torch.equal(processed_probs_static(logits, *params, filtered=True), expected)


def test_greedy_rows_are_the_first_argmax():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, 3.0, 0.0, 3.0]])
    temperature, top_p, top_k = torch.tensor([0.0, 0.0, 1.0]), torch.ones(3), torch.zeros(3, dtype=torch.long)
    probs = processed_probs_static(logits, temperature, top_p, top_k, filtered=True)
    assert probs[:2].tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]
    assert torch.equal(probs, processed_probs(logits, temperature, top_p, top_k))


def reference_filter(probs, top_p, top_k):
    """`processed_probs`' filtering step on given probability rows, through today's `_cutoffs`."""
    cut = _cutoffs(probs, top_p, top_k)
    kept = probs.masked_fill(probs < cut[:, None], 0.0)
    return kept.mul_(kept.sum(-1, keepdim=True).reciprocal_())


def test_cutoffs_on_exact_boundaries():
    # Dyadic rows (multiples of 2**-6 summing to exactly 1) and top_p in eighths: the mass before an
    # entry often equals top_p exactly, where "strictly below" decides; plus ties at the boundary.
    g = torch.Generator().manual_seed(4)
    for vocab in (6, 13, 70):
        units = torch.multinomial(torch.ones(vocab), 64, replacement=True, generator=g)
        probs = torch.stack([torch.bincount(units.roll(i), minlength=vocab) for i in range(8)]).float() / 64
        probs = probs[:, torch.randperm(vocab, generator=g)]
        top_p = torch.arange(1, 9, dtype=torch.float32) / 8
        for top_k in (torch.zeros(8, dtype=torch.long), torch.arange(8) % 4 + 1):
            ours = static._filter(probs, top_p, top_k, torch.ones(8, dtype=torch.bool))
            assert torch.equal(ours, reference_filter(probs, top_p, top_k)), (vocab, top_k)


def test_top_p_mass_is_summed_in_vocabulary_order():
    # The top-p mass of a row without top-k is `probs.sum(-1)` as `_cutoffs` sums it; summed in sorted
    # order it can differ in the last bit. Pick top_p values on the boundaries where that flips a keep.
    g = torch.Generator().manual_seed(6)
    rows, top_ps = [], []
    while len(rows) < 8:
        probs = torch.softmax(torch.randn(40, generator=g) * 2, -1)
        vals = probs.sort(descending=True).values
        mass, sorted_mass = probs.sum(), vals.sum()
        before = vals.cumsum(0) - vals
        for j in range(1, 10):
            top_p = (before[j] / mass).float()
            for _ in range(3):
                if (top_p * mass > before[j]) != (top_p * sorted_mass > before[j]):
                    rows.append(probs)
                    top_ps.append(top_p)
                    break
                top_p = torch.nextafter(top_p, torch.tensor(2.0))
    probs, top_p = torch.stack(rows), torch.stack(top_ps)
    top_k = torch.zeros(len(rows), dtype=torch.long)
    ours = static._filter(probs, top_p, top_k, torch.ones(len(rows), dtype=torch.bool))
    assert torch.equal(ours, reference_filter(probs, top_p, top_k))


def race_rows(g: torch.Generator) -> list[torch.Tensor]:
    """Families of rows [r, V] for the race: processed probs, all-tail, tail-heavy with a few head tokens,
    unnormalised residuals, float64 rows, one-hot and all-zero rows."""
    out = []
    for vocab in (100, 1000, 3000):
        params = random_params(g, 6, vocab)
        out.append(processed_probs(random_logits(g, 6, vocab, vocab), *params))
    out.append(torch.full((4, 3000), 1 / 3000))  # every token in the tail
    mixed = torch.full((6, 2000), 0.95 / 1997)  # three head tokens holding 5%, a heavy tail
    mixed[:, [3, 700, 1999]] = 0.05 / 3
    out.append(mixed)
    q = torch.softmax(torch.randn(6, 500, generator=g) * 2, -1)
    p = torch.softmax(torch.randn(6, 500, generator=g) * 2, -1)
    out.append((q - p).clamp_min(0.0))  # a residual: mass below 1
    out.append(torch.softmax(torch.randn(5, 300, generator=g, dtype=torch.float64), -1))  # like `rest`
    edge = torch.zeros(3, 130)
    edge[0, 129] = 1.0  # one-hot in the last, padded block
    edge[1, :2] = 0.5  # an exact tie between two head tokens
    out.append(edge)  # row 2 is all zero: V
    return out


def test_race_sample_static_is_race_sample():
    g = torch.Generator().manual_seed(7)
    tail_wins = total = 0
    for rows in race_rows(g):
        for _ in range(12):
            seeds, positions = keys(g, rows.shape[0])
            for streams in ((), (STREAM_RESIDUAL, STREAM_RESIDUAL_TAIL)):
                expected = race_sample(rows, seeds, positions, *streams)
                assert torch.equal(race_sample_static(rows, seeds, positions, *streams), expected)
                won = rows.gather(1, expected.clamp_max(rows.shape[1] - 1)[:, None])[:, 0]
                tail_wins += int(((won < HEAD_MIN_PROB) & (won > 0)).sum())
                total += rows.shape[0]
    assert tail_wins > total // 10, f"the tail won only {tail_wins} of {total} races: too few to test"


def test_all_zero_row_gives_vocab():
    rows = torch.zeros(2, 70)
    out = race_sample_static(rows, torch.tensor([1, 2]), torch.tensor([3, 4]))
    assert out.tolist() == [70, 70]


def reference_tail_mass(probs: torch.Tensor) -> torch.Tensor:
    """`race_sample`'s block tail masses, step by step as it computes them."""
    blocks = _blocks(probs, 0.0)
    block_mass = blocks.sum(-1)
    br, bc = (blocks.amax(-1) >= HEAD_MIN_PROB).nonzero(as_tuple=True)
    sub = blocks[br, bc]
    block_mass[br, bc] = sub.masked_fill(sub >= HEAD_MIN_PROB, 0.0).sum(-1)
    return block_mass


def test_tail_mass_is_bitwise_race_samples():
    # Magnitudes spread over 10 decades make every float sum order-sensitive.
    g = torch.Generator().manual_seed(3)
    probs = torch.exp(-torch.rand(8, 1000, generator=g) * 23) * torch.rand(8, 1000, generator=g)
    probs[:, ::37] = 0.01  # head tokens in most blocks
    ours = _tail_mass(_blocks(probs, 0.0))
    assert torch.equal(ours, reference_tail_mass(probs))
    # The check has teeth: the same masses reduced another way (all minus head) differ in the last bits.
    blocks = _blocks(probs, 0.0)
    other = blocks.sum(-1) - blocks.masked_fill(blocks < HEAD_MIN_PROB, 0.0).sum(-1)
    assert not torch.equal(other, ours)


def test_head_slots_hold_every_head_token():
    # 1024 entries of exactly HEAD_MIN_PROB: the fullest head a row of mass 1 can have.
    row = torch.zeros(1, 5000)
    row[0, torch.randperm(5000, generator=torch.Generator().manual_seed(0))[:HEAD_SLOTS]] = HEAD_MIN_PROB
    for seed in range(20):
        seeds, positions = torch.tensor([seed]), torch.tensor([seed * 7])
        assert torch.equal(race_sample_static(row, seeds, positions), race_sample(row, seeds, positions))


@pytest.mark.parametrize("vocab", VOCABS)
def test_sample_static_is_sample(vocab):
    g = torch.Generator().manual_seed(100 + vocab)
    for case in range(24):
        rows = 9
        logits = random_logits(g, rows, vocab, case)
        params = random_params(g, rows, vocab)
        if case % 8 == 0:
            params = (torch.zeros(rows), *params[1:])  # all greedy: `sample`'s argmax shortcut
        seeds, positions = keys(g, rows)
        tokens, logprobs = sample(logits, *params, seeds, positions)
        ours = sample_static(logits, *params, seeds, positions, filtered=True)
        assert torch.equal(ours[0], tokens) and torch.equal(ours[1], logprobs), case


def test_sample_static_bf16_logits():
    g = torch.Generator().manual_seed(5)
    logits = random_logits(g, 6, 300, 1).bfloat16()
    params = random_params(g, 6, 300)
    seeds, positions = keys(g, 6)
    expected = sample(logits, *params, seeds, positions)
    ours = sample_static(logits, *params, seeds, positions, filtered=True)
    assert torch.equal(ours[0], expected[0]) and torch.equal(ours[1], expected[1])


# ---------------------------------------------------------------------------------------------------------
# Capture safety


def fake_run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run fn with every tensor argument made fake: a value read or a data-dependent shape raises."""
    mode = torch._subclasses.fake_tensor.FakeTensorMode()
    fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    with mode:
        return fn(*fake, **kwargs)


HOST_READ_ERRORS = (
    torch._subclasses.fake_tensor.DataDependentOutputException,
    torch._subclasses.fake_tensor.DynamicOutputShapeException,
)


class OpTrace(TorchDispatchMode):
    """Records (aten op, output shapes) of every call."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = tuple(tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        self.ops.append((str(func), shapes))
        return out


def op_trace(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[tuple[str, tuple]]:
    with OpTrace() as trace:
        fn(*args, **kwargs)
    return trace.ops


def sample_inputs(seed: int, rows: int = 6, vocab: int = 200) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (random_logits(g, rows, vocab, seed), *random_params(g, rows, vocab), *keys(g, rows))


@pytest.mark.parametrize("filtered", [False, True])
def test_sample_static_runs_on_fake_tensors(filtered):
    tokens, logprobs = fake_run(sample_static, *sample_inputs(0), filtered=filtered)
    assert tokens.shape == (6,) and tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    rows = torch.rand(4, 300, dtype=torch.float64)
    assert fake_run(race_sample_static, rows, torch.arange(4), torch.arange(4)).shape == (4,)


@pytest.mark.parametrize("plant", ["nonzero", "item"])
def test_fake_harness_catches_planted_host_reads(monkeypatch, plant):
    inner = static._uniform_at

    def leaky(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        if plant == "nonzero":
            keys.nonzero()
        else:
            keys.sum().item()
        return inner(keys, index)

    monkeypatch.setattr(static, "_uniform_at", leaky)
    with pytest.raises(HOST_READ_ERRORS):
        fake_run(sample_static, *sample_inputs(0), filtered=True)


def test_fake_harness_catches_todays_sample():
    with pytest.raises(HOST_READ_ERRORS):
        fake_run(sample, *sample_inputs(0))


def test_op_trace_does_not_depend_on_data():
    first = op_trace(sample_static, *sample_inputs(1), filtered=True)
    second = op_trace(sample_static, *sample_inputs(2), filtered=True)
    assert first == second
    assert not any("nonzero" in op or "_local_scalar_dense" in op for op, _ in first)
    # The same trace of today's `sample` changes with the data (its head set and tail rows do).
    assert op_trace(sample, *sample_inputs(1)) != op_trace(sample, *sample_inputs(2))


HOST_READ_METHODS = {"item", "tolist", "nonzero", "numpy", "cpu", "argwhere", "masked_select"}


def host_reads(module: Any) -> list[str]:
    """Calls in a module's source that read the device back or make data-dependent shapes (FakeTensor
    cannot see `torch.tensor(list, device=...)`, an H2D copy and a stream sync: this scan does)."""
    found = []
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            base = node.func.value
            if name in HOST_READ_METHODS or (name == "tensor" and getattr(base, "id", None) == "torch"):
                found.append(f"line {node.lineno}: .{name}()")
    return found


def test_source_has_no_host_reads():
    assert host_reads(static) == []
