"""The fixed-shape step (engine/static_step.py): the Generator on it equals the dynamic path token for token
(plain, chains and trees, match and rejection, padding rows and nodes, more requests than slots), it has
no host read and no data-dependent shape (an op trace identical for different data, which a planted
`.item()` or `nonzero` breaks), and everything it reads follows a weight update in place. The cuda cases
capture it as CUDA graphs: replay bitwise equal to the eager step, no sync inside a replay.

The model runs in float64 on the CPU (as test_generator.py's), so both paths' logits agree far below any
sampling decision.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from slipstream.engine import static_step as static_step_module
from slipstream.engine.drafters import NGramDrafter, OracleDrafter
from slipstream.engine.generator import Completion, Generator, Request
from slipstream.engine.kv_cache import KVCache
from slipstream.engine.model import Transformer
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.speculator import SpecConfig
from slipstream.engine.static_step import PAGE_SIZE, StaticStep, StepKey, StepRow
from slipstream.engine.weights import load_model

VOCAB = 160


@pytest.fixture(scope="module")
def model(make_checkpoint: Callable[..., Path]) -> Transformer:
    return load_model(make_checkpoint("qwen2", seed=7), dtype=torch.float64)


def mixed_requests(count: int, seed: int = 0, max_tokens: int = 20) -> list[Request]:
    """Prompts with repeats (the n-gram drafter finds matches), every sampling setting mixed in one batch."""
    rng = random.Random(seed)
    settings = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9),
    ]
    out = []
    for i in range(count):
        motif = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 4))]
        base = settings[i % len(settings)]
        params = SamplingParams(
            temperature=base.temperature, top_k=base.top_k, top_p=base.top_p, seed=1000 + i,
            max_tokens=rng.randint(max_tokens // 2, max_tokens),
        )  # fmt: skip
        out.append(
            Request(
                request_id=f"r{i}", prompt_ids=(motif * 6)[: rng.randint(3, 18)], params=params,
                group_id=f"g{i // 2}",
            )
        )  # fmt: skip
    return out


def run(
    model: Transformer, requests: Sequence[Request], *, static: bool, **kwargs: object
) -> list[Completion]:
    kwargs = {"num_slots": 5, "token_budget": 64, "eos_token_ids": (), "max_len": 96, **kwargs}
    return Generator(model, static=static, **kwargs).generate(requests)  # type: ignore[arg-type]


def assert_same(a: Sequence[Completion], b: Sequence[Completion]) -> None:
    assert [c.request_id for c in a] == [c.request_id for c in b]
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids, x.request_id
        assert x.finish_reason == y.finish_reason
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-6, rtol=0)


def test_plain_decoding_equals_the_dynamic_path(model: Transformer) -> None:
    # 12 requests on 5 slots: admissions mid-run put prefill passes beside fixed-shape decode steps, and
    # the decode batch passes through several buckets (5 → 4 → 2 → 1) with padding rows.
    requests = mixed_requests(12)
    assert_same(run(model, requests, static=True), run(model, requests, static=False))


@pytest.mark.parametrize(
    "spec",
    [
        SpecConfig(method="ngram", depth=3, mode="rejection"),
        SpecConfig(method="ngram", depth=5, mode="reproducible"),
        SpecConfig(method="ngram", depth=3, topk=3, verify=7, mode="rejection"),
        SpecConfig(method="ngram", depth=4, topk=2, verify=6, mode="reproducible"),
    ],
    ids=["chain-rejection", "chain-reproducible", "tree-rejection", "tree-reproducible"],
)
def test_speculative_decoding_equals_the_dynamic_path(model: Transformer, spec: SpecConfig) -> None:
    requests = mixed_requests(10, seed=3)
    static = Generator(
        model, static=True, num_slots=5, token_budget=64, eos_token_ids=(), max_len=96, spec=spec,
        drafters={"ngram": NGramDrafter()},
    )  # fmt: skip
    dynamic = Generator(
        model, static=False, num_slots=5, token_budget=64, eos_token_ids=(), max_len=96, spec=spec,
        drafters={"ngram": NGramDrafter()},
    )  # fmt: skip
    a, b = static.generate(requests), dynamic.generate(requests)
    assert_same(a, b)
    assert static.stats["drafted"] == dynamic.stats["drafted"] > 0
    assert static.stats["accepted"] == dynamic.stats["accepted"] > 0
    assert static.position_stats == dynamic.position_stats
    if spec.mode == "reproducible":  # and both equal plain decoding
        assert_same(a, run(model, requests, static=False))


def test_self_draft_replays_a_recorded_run_on_the_static_path(model: Transformer) -> None:
    requests = mixed_requests(6, seed=5)
    first = run(model, requests, static=True)
    oracle = OracleDrafter({c.request_id: c.prompt_ids + c.token_ids for c in first})
    gen = Generator(
        model, static=True, num_slots=5, token_budget=64, eos_token_ids=(), max_len=96,
        spec=SpecConfig(method="self", depth=7, mode="reproducible"), drafters={"self": oracle},
    )  # fmt: skip
    second = gen.generate(requests)
    assert_same(second, first)
    assert gen.stats["accepted"] == gen.stats["drafted"] > 0
    assert sum(c.target_passes for c in second) < sum(c.target_passes for c in first) / 3


def test_hidden_states_and_stops_match_the_dynamic_path(model: Transformer) -> None:
    requests = mixed_requests(6, seed=9)
    spec = SpecConfig(method="ngram", depth=3, topk=2, verify=5, mode="reproducible")
    outs = []
    for static in (True, False):
        gen = Generator(
            model, static=static, num_slots=4, token_budget=64, eos_token_ids=(7, 11), max_len=40,
            return_hidden=True, spec=spec, drafters={"ngram": NGramDrafter()},
        )  # fmt: skip
        outs.append(gen.generate(requests))
    assert_same(*outs)
    for a, b in zip(*outs, strict=True):
        assert a.hidden is not None and b.hidden is not None
        torch.testing.assert_close(a.hidden, b.hidden, atol=1e-9, rtol=0)  # float64 both ways
    assert {c.finish_reason for c in outs[0]} >= {"stop"}


TRITON_SCRIPT = """
import sys, torch
from pathlib import Path
from slipstream.engine import attention
from slipstream.engine.drafters import OracleDrafter
from slipstream.engine.generator import Generator
from slipstream.engine.speculator import SpecConfig
from slipstream.engine.weights import load_model
from tests.engine.test_static_step import mixed_requests
assert attention.triton_enabled("cpu")
model = load_model(Path(sys.argv[1]), dtype=torch.float32)
requests = mixed_requests(6, seed=5, max_tokens=12)
kwargs = dict(num_slots=8, max_len=64, eos_token_ids=())
static = Generator(model, static=True, **kwargs).generate(requests)
dynamic = Generator(model, static=False, **kwargs).generate(requests)
assert [a.token_ids for a in static] == [b.token_ids for b in dynamic], "plain"
oracle = OracleDrafter({c.request_id: c.prompt_ids + c.token_ids for c in static})
gen = Generator(model, static=True, spec=SpecConfig(method="self", depth=3, mode="reproducible"),
                drafters={"self": oracle}, **kwargs)
replayed = gen.generate(requests)
assert [a.token_ids for a in replayed] == [b.token_ids for b in static], "self-draft"
assert gen.stats["accepted"] == gen.stats["drafted"] > 0, gen.stats
# The EAGLE drafter's batched passes (the same Triton attention and store) against the head's packed
# causal forward (torch attention): chains of greedy drafts along a recorded run.
from slipstream.engine.draft_vocab import draft_logits
from slipstream.engine.drafters.base import DraftState
from slipstream.engine.drafters.eagle import EagleDrafter
from slipstream.engine.eagle import EagleHead, target_features
from slipstream.engine.generator import Request
from slipstream.engine.sampling import SamplingParams
greedy = SamplingParams(temperature=0.0, max_tokens=16)
run = Generator(model, return_hidden=True, **kwargs).generate(
    [Request(request_id=f"e{i}", prompt_ids=[3 + i, 40, 7 * i + 1, 9], params=greedy) for i in range(2)])
torch.manual_seed(0)
head = EagleHead.for_target(model.config)
drafter = EagleDrafter(head, model, num_slots=2, max_len=64)
def state(c, j, hidden):
    return DraftState(request_id=c.request_id, group_id=0, tokens=[*c.prompt_ids, *c.token_ids[: j + 1]],
                      prompt_len=len(c.prompt_ids), params=greedy, hidden=hidden)
with torch.no_grad():
    for j in range(6):
        for c in run:
            drafter.observe(state(c, j, c.hidden[j : j + 1]))
        chains = drafter.propose([state(c, j, c.hidden[:0]) for c in run], depth=3, topk=1, verify=3)
        for c, chain in zip(run, chains):
            tokens = torch.tensor([c.prompt_ids[-1], *c.token_ids[: j + 1]])
            features = target_features(model, c.hidden[: j + 1])
            expected = []
            for _ in range(3):
                outs = head(model.embed_tokens(tokens[1:]), features, torch.arange(len(features)), [0, len(features)])
                expected.append(int(draft_logits(model, outs[-1]).argmax()))
                tokens = torch.cat([tokens, torch.tensor(expected[-1:])])
                features = torch.cat([features, outs[-1:]])
            assert chain.tokens.tolist() == expected, (j, chain.tokens.tolist(), expected)
print("ok")
"""


def test_the_triton_kernels_in_the_step_equal_the_dynamic_path(make_checkpoint: Callable[..., Path]) -> None:
    """The step with its Triton attention and KV store (Triton's interpreter, fp32, six rows in an
    eight-row bucket) decodes the dynamic path's tokens, and a self-draft replay is accepted whole; the
    EAGLE drafter's batched passes on the same kernels draft what the head's torch forward does. Rows
    past the first read their context lengths from a strided column of the packed input block: a kernel
    that read it as contiguous gave them wrong contexts (found on an H200, 2026-11-27)."""
    checkpoint = make_checkpoint("qwen2", seed=7)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", TRITON_SCRIPT, str(checkpoint)], capture_output=True, text=True, env=env,
        timeout=110, check=False, cwd=root,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


# ---- capture safety --------------------------------------------------------------------------------------

FORBIDDEN = {"aten.nonzero", "aten._local_scalar_dense", "aten.masked_select", "aten.item", "aten.is_nonzero"}
"""Host reads (item, bool) and data-shaped ops. A CPU tensor's `.tolist()` reads memory without an op:
the FakeTensor run below catches that one."""


class OpTrace(TorchDispatchMode):
    """Every aten call of a stretch of code: its name and output shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        shapes = tuple(
            tuple(t.shape)
            for t in (out if isinstance(out, tuple | list) else (out,))
            if isinstance(t, torch.Tensor)
        )
        self.calls.append((str(func.overloadpacket), shapes))
        return out


def step_for(model: Transformer, max_nodes: int = 8) -> tuple[StaticStep, KVCache]:
    cache = KVCache.for_model(
        model.config, num_slots=6, max_len=100, dtype=torch.float64, page_size=PAGE_SIZE, dummy_slot=True
    )
    return StaticStep(model, cache, max_batch=6, max_nodes=max_nodes, graphs=False), cache


def rows_for(cache: KVCache, seed: int, *, tree: bool) -> list[StepRow]:
    """Four real rows (of a six-row bucket: two padding rows) with random context, tokens and drafts."""
    rng = random.Random(seed)
    rows = []
    for i in range(4):
        slot = cache.allocate()
        ctx = rng.randint(1, 60)
        cache.set_length(slot, ctx)
        n = rng.randint(0, 7)
        parents = [rng.randint(-1, j - 1) for j in range(n)] if tree else None
        params = SamplingParams(
            temperature=[0.0, 0.8, 1.0, 1.2][i], top_k=[0, 0, 9, 0][i], seed=rng.randrange(99)
        )
        tokens = [rng.randrange(VOCAB) for _ in range(n + 1)]
        rows.append(
            StepRow(
                slot=slot, context=ctx, params=params, tokens=tokens, parents=parents, rejection=i % 2 == 1
            )
        )
    return rows


def trace_step(model: Transformer, seed: int, *, tree: bool) -> list[tuple[str, tuple]]:
    step, cache = step_for(model)
    rows = rows_for(cache, seed, tree=tree)
    key = StepKey(batch=6, nodes=8, filtered=True, rejection=True, tree=tree)
    step.pack(rows, key)
    step.inp.copy_(step.staging)
    with torch.inference_mode(), OpTrace() as trace:
        step._step(key)
    return trace.calls


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_the_step_reads_nothing_back_and_its_shapes_do_not_follow_the_data(
    model: Transformer, tree: bool
) -> None:
    a, b = trace_step(model, 1, tree=tree), trace_step(model, 2, tree=tree)
    assert a == b  # the same ops with the same shapes for other rows, contexts, drafts and settings
    assert not FORBIDDEN & {name for name, _ in a}
    assert len(a) > 100  # a real step was traced (30+ ops a layer)


def fake_step(model: Transformer, *, tree: bool) -> None:
    """The step on FakeTensors (shapes and dtypes only): any read of a value raises."""
    step, cache = step_for(model)
    rows = rows_for(cache, 1, tree=tree)
    key = StepKey(batch=6, nodes=8, filtered=True, rejection=True, tree=tree)
    step.pack(rows, key)
    step.inp.copy_(step.staging)
    with torch.inference_mode(), FakeTensorMode(allow_non_fake_inputs=True):
        step._step(key)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_the_step_runs_on_fake_tensors(model: Transformer, tree: bool) -> None:
    fake_step(model, tree=tree)


def test_a_planted_host_read_or_data_dependent_shape_is_caught(
    model: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = static_step_module.match_walk

    def reads_back(tokens, parents, valid, drawn, max_depth):  # type: ignore[no-untyped-def]
        if int(valid.sum()) > 0:  # a host read
            valid = valid & (tokens >= 0)
        return real(tokens, parents, valid, drawn, max_depth)

    monkeypatch.setattr(static_step_module, "match_walk", reads_back)
    assert FORBIDDEN & {name for name, _ in trace_step(model, 1, tree=True)}
    with pytest.raises(DataDependentOutputException):
        fake_step(model, tree=True)

    def lists(tokens, parents, valid, drawn, max_depth):  # type: ignore[no-untyped-def]
        _ = valid.tolist()  # a host read no CPU op trace sees
        return real(tokens, parents, valid, drawn, max_depth)

    monkeypatch.setattr(static_step_module, "match_walk", lists)
    with pytest.raises(DataDependentOutputException):
        fake_step(model, tree=True)

    def data_shaped(tokens, parents, valid, drawn, max_depth):  # type: ignore[no-untyped-def]
        _ = valid.nonzero()  # a data-dependent shape
        return real(tokens, parents, valid, drawn, max_depth)

    monkeypatch.setattr(static_step_module, "match_walk", data_shaped)
    a, b = trace_step(model, 1, tree=True), trace_step(model, 2, tree=True)
    assert "aten.nonzero" in {name for name, _ in a} and a != b


def test_outputs_and_buffers_keep_their_addresses(model: Transformer) -> None:
    step, cache = step_for(model)
    pointers = [t.data_ptr() for t in (step.inp, step.out, step.hidden, step.cos, step.sin, cache.storage)]
    rows = rows_for(cache, 4, tree=True)
    for _ in range(3):
        step.run(rows)
    assert pointers == [
        t.data_ptr() for t in (step.inp, step.out, step.hidden, step.cos, step.sin, cache.storage)
    ]


def test_weight_updates_are_in_place(model: Transformer) -> None:
    """Graphs bind addresses: `write_parameter` must copy into the tensors a captured step reads, never
    swap them. A planted swap (a new tensor in place of the old) is caught by the address check."""
    clone = load_model_clone(model)
    before = {name: p.data_ptr() for name, p in clone.named_parameters()}
    for name, p in list(clone.named_parameters()):
        clone.write_parameter(name, p.detach() * 1.5)
    assert before == {name: p.data_ptr() for name, p in clone.named_parameters()}
    # The planted bug: a parameter replaced, not written.
    layer = clone.layers[0].mlp.down
    layer.weight = torch.nn.Parameter(layer.weight.detach() * 2, requires_grad=False)
    assert before != {name: p.data_ptr() for name, p in clone.named_parameters()}


def load_model_clone(model: Transformer) -> Transformer:
    clone = Transformer(model.config).to(torch.float64)
    clone.load_state_dict(model.state_dict())
    return clone.eval()


def test_a_step_refuses_a_cache_it_cannot_address(model: Transformer) -> None:
    grown = KVCache.for_model(model.config, num_slots=2, max_len=64, grow=True)
    with pytest.raises(ValueError, match="static KV cache with a dummy slot"):
        StaticStep(model, grown, max_batch=2)
    odd = KVCache.for_model(model.config, num_slots=2, max_len=65, dummy_slot=True)
    with pytest.raises(ValueError, match=f"multiple of {PAGE_SIZE}"):
        StaticStep(model, odd, max_batch=2)
    with pytest.raises(ValueError, match="grow_cache must be False"):
        Generator(model, static=True, grow_cache=True)


# ---- CUDA graphs -----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("batch,nodes", [(1, 1), (13, 4), (64, 8), (3, 1)])
def test_graph_replay_is_bitwise_the_eager_step_and_never_syncs(
    make_checkpoint: Callable[..., Path], batch: int, nodes: int
) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    model = load_model(make_checkpoint("qwen2", seed=7), dtype=torch.bfloat16, device=device)
    results = []
    for graphs in (True, False):
        cache = KVCache.for_model(
            model.config, num_slots=batch, max_len=128, dtype=torch.bfloat16, device=device,
            page_size=PAGE_SIZE, dummy_slot=True,
        )  # fmt: skip
        torch.manual_seed(0)
        cache.storage.normal_()  # a context to attend to
        step = StaticStep(model, cache, max_batch=batch, max_nodes=nodes, graphs=graphs)
        rng = random.Random(batch * 100 + nodes)
        slots = [cache.allocate() for _ in range(batch)]
        outs = []
        for it in range(4):
            rows = []
            for i, slot in enumerate(slots):
                n = rng.randint(1, nodes)
                parents = [rng.randint(-1, j - 1) for j in range(n - 1)] if it % 2 else None
                rows.append(
                    StepRow(
                        slot=slot, context=20 + it * 9 + i % 5, tokens=[rng.randrange(VOCAB) for _ in range(n)],
                        parents=parents, params=SamplingParams(temperature=[0.0, 1.0, 0.7][i % 3], seed=i),
                        rejection=i % 2 == 1,
                    )
                )  # fmt: skip
            if graphs:
                key = step.key(rows)
                step.pack(rows, key)
                step.inp[: key.batch].copy_(step.staging[: key.batch], non_blocking=True)
                if key not in step.runner.keys:
                    step.runner(key)  # capture (its warm-up and capture may synchronise)
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    step.runner(key)  # a replay: the step again on the same input (it is idempotent)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            result = step.run(rows)
            # Real rows only: a padding row reads the dummy slot, which padding nodes write racily.
            real = step.hidden[:batch].clone()
            outs.append((result.tokens.copy(), result.path.copy(), result.accept_length.copy(), real))
        results.append((outs, cache.storage[:, :, :batch].clone()))  # the dummy slot's garbage aside
    (graph_outs, graph_cache), (eager_outs, eager_cache) = results
    for g, e in zip(graph_outs, eager_outs, strict=True):
        assert (g[0] == e[0]).all() and (g[1] == e[1]).all() and (g[2] == e[2]).all()
        assert torch.equal(g[3], e[3])
    assert torch.equal(graph_cache, eager_cache)


@pytest.mark.gpu
def test_graphs_follow_weight_updates_in_place(make_checkpoint: Callable[..., Path]) -> None:
    """A generator whose graphs were captured before a weight update decodes, after it, exactly what a
    generator capturing its graphs after the update decodes: same kernels, same shapes, so any stale
    tensor a graph kept (a weight, the tied head, a table) would show as different tokens."""
    device = torch.device("cuda", torch.cuda.current_device())
    model = load_model(make_checkpoint("qwen2", seed=7), dtype=torch.bfloat16, device=device)
    requests = mixed_requests(4, seed=2)
    gen = Generator(model, static=True, num_slots=4, max_len=96, eos_token_ids=())
    before = gen.generate(requests)  # captures
    for name, p in list(model.named_parameters()):
        model.write_parameter(name, p.detach().flip(0) if p.dim() else p.detach())
    after = gen.generate(requests)
    fresh = Generator(model, static=True, num_slots=4, max_len=96, eos_token_ids=()).generate(requests)
    assert [c.token_ids for c in after] == [c.token_ids for c in fresh]
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
