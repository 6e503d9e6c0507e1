"""engine/attention.py: paged attention (torch reference and Triton kernel) and the capture-safe KV store.

The reference is pinned to a naive per-row loop (positions listed by hand, plain softmax, GQA by repeat)
over plain decode, chains and random trees, GQA groups 1/3/6/7, pages 16/64 and shuffled page tables, so
a row's pages are scattered over the cache. The Triton kernel runs under Triton's interpreter in one
subprocess (TRITON_INTERPRET=1 must be set before triton is imported, which the rest of the suite may
already have done): this file run as a script prints each kernel case's error against the reference,
and one test per case checks it. bf16 is wrong under the interpreter on these hosts (GPU-ENGINE.md §5a),
so bf16, speed-relevant shapes and CUDA-graph capture are checked by the `gpu` tests only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from slipstream.engine import attention
from slipstream.engine.attention import (
    num_splits,
    paged_attention,
    paged_attention_ref,
    store_kv,
    triton_enabled,
)

CUDA = torch.cuda.is_available()


@dataclass(frozen=True)
class Case:
    """One attention problem: B rows with contexts `ctx` (None = a padding row) and n new tokens each."""

    name: str
    ctx: tuple[int | None, ...]
    kind: str = "plain"  # plain (n = 1), chain (causal) or tree (random ancestors)
    n: int = 1
    kv_heads: int = 2
    g: int = 3
    hd: int = 16
    page: int = 16
    max_len: int = 256
    shuffled: bool = True  # pages of a row scattered over the cache (else the slot layout)
    dtype: str = "float32"
    splits: int | None = 1
    width: int | None = None  # table pages per row (None: max_len / page)
    strided_q: bool = False  # q a view into a wider fused projection
    index_dtype: str = "int64"  # block table and ctx_lens
    seed: int = 0


def tree_bits(kind: str, n: int, gen: torch.Generator) -> list[int]:
    """Bit j of entry i: new node i sees new node j (ancestors and self)."""
    if kind in ("plain", "chain"):
        return [(1 << (i + 1)) - 1 for i in range(n)]
    bits = [1]
    for i in range(1, n):
        parent = int(torch.randint(0, i, (), generator=gen))
        bits.append(bits[parent] | (1 << i))
    return bits


def make_inputs(case: Case, device: str = "cpu") -> dict:
    gen = torch.Generator().manual_seed(case.seed)
    dtype = getattr(torch, case.dtype)
    batch, heads = len(case.ctx), case.kv_heads * case.g
    slots = batch + 1  # one more than the rows: some storage belongs to nobody
    pages_per_slot = case.max_len // case.page
    width = case.width or pages_per_slot
    if case.shuffled:
        table = torch.randperm(slots * pages_per_slot, generator=gen)[: batch * width].view(batch, width)
    else:
        row_slot = torch.randperm(slots, generator=gen)[:batch]
        table = row_slot[:, None] * pages_per_slot + torch.arange(width)
    k_cache = torch.randn(slots, case.kv_heads, case.max_len, case.hd, generator=gen).to(dtype)
    v_cache = torch.randn(slots, case.kv_heads, case.max_len, case.hd, generator=gen).to(dtype)
    if case.strided_q:
        fused = torch.randn(batch, case.n, heads + 2, case.hd, generator=gen).to(dtype)
        q = fused[:, :, 1 : heads + 1]
    else:
        q = torch.randn(batch, case.n, heads, case.hd, generator=gen).to(dtype)
    bits = []
    for c in case.ctx:
        # A padding row: no context and only its self bits, as the engine pads a bucket.
        bits.append([1 << i for i in range(case.n)] if c is None else tree_bits(case.kind, case.n, gen))
    index = getattr(torch, case.index_dtype)
    inputs = {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_table": table.to(index),
        "ctx_lens": torch.tensor([c or 0 for c in case.ctx], dtype=index),
        "tree_bits": torch.tensor(bits, dtype=torch.int64),
    }
    return {k: v.to(device) for k, v in inputs.items()}


def naive(q, k_cache, v_cache, block_table, ctx_lens, tree_bits, *, scale: float, page_size: int):
    """Row by row in float64: list each query's visible positions, look each up in the table."""
    batch, n, heads, hd = q.shape
    pages_per_slot = k_cache.shape[2] // page_size
    g = heads // k_cache.shape[1]
    out = torch.zeros(batch, n, heads, hd, dtype=torch.float64)
    for b in range(batch):
        ctx = int(ctx_lens[b])
        for i in range(n):
            seen = list(range(ctx)) + [ctx + j for j in range(n) if int(tree_bits[b, i]) >> j & 1]
            pages = [int(block_table[b, t // page_size]) for t in seen]
            slot = [p // pages_per_slot for p in pages]
            pos = [(p % pages_per_slot) * page_size + t % page_size for p, t in zip(pages, seen, strict=True)]
            keys = k_cache[slot, :, pos].double().repeat_interleave(g, dim=1)  # [T, H, HD]
            values = v_cache[slot, :, pos].double().repeat_interleave(g, dim=1)
            scores = torch.einsum("hd,thd->ht", q[b, i].double(), keys) * scale
            out[b, i] = torch.einsum("ht,thd->hd", scores.softmax(-1), values)
    return out


def run(fn, inputs: dict, case: Case):
    return fn(**inputs, scale=case.hd**-0.5, page_size=case.page)


# --- the reference against the naive loop --------------------------------------------------------------

REF_CASES = [
    Case(f"{kind}-g{g}-p{page}", ctx, kind, n, g=g, page=page, seed=seed)
    for seed, (kind, n, ctx) in enumerate(
        [("plain", 1, (5, None, 200, 64)), ("chain", 4, (0, 131, None, 17)), ("tree", 7, (199, 1, 64, None))]
    )
    for g in (1, 3, 6, 7)
    for page in (16, 64)
] + [
    Case("slot-layout", (3, 100, None), "tree", 5, g=6, page=64, shuffled=False),
    Case("narrow-table", (40, 100, 0), "chain", 3, page=16, width=7),
    Case("int32-strided", (12, 99), "tree", 6, g=7, strided_q=True, index_dtype="int32"),
]


@pytest.mark.parametrize("case", REF_CASES, ids=lambda c: c.name)
def test_reference_matches_naive(case: Case) -> None:
    inputs = make_inputs(case)
    expected = run(naive, inputs, case)
    torch.testing.assert_close(
        run(paged_attention_ref, inputs, case).double(), expected, atol=1e-5, rtol=1e-5
    )


def test_reference_fp16_matches_naive() -> None:
    case = Case("fp16", (30, None, 150), "tree", 6, g=6, dtype="float16")
    inputs = make_inputs(case)
    got = run(paged_attention_ref, inputs, case)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.double(), run(naive, inputs, case), atol=2e-3, rtol=2e-3)


def test_dispatch_on_cpu_runs_the_reference() -> None:
    case = REF_CASES[5]
    inputs = make_inputs(case)
    torch.testing.assert_close(run(paged_attention, inputs, case), run(paged_attention_ref, inputs, case))
    if not attention._INTERPRET:
        assert not triton_enabled("cpu")


def test_rejects_shapes_it_cannot_serve() -> None:
    inputs = make_inputs(Case("x", (3,)))
    with pytest.raises(ValueError, match="page_size"):
        paged_attention_ref(**inputs, scale=1.0, page_size=24)
    with pytest.raises(ValueError, match="tree_bits"):
        paged_attention_ref(**{**inputs, "tree_bits": inputs["tree_bits"].int()}, scale=1.0, page_size=16)


def test_num_splits() -> None:
    assert num_splits(256, 4, 2048) == 1  # the pairs fill the SMs already
    assert num_splits(1, 2, 64) == 1  # too short to split
    at_b1 = num_splits(1, 2, 2048)
    assert 8 <= at_b1 <= 32 and at_b1 * attention.MIN_SPLIT_KEYS <= 2048 + attention.MIN_SPLIT_KEYS
    assert num_splits(16, 4, 4096, sms=132) <= num_splits(4, 4, 4096, sms=132)
    for batch in (1, 2, 3, 8, 13, 32, 64):
        for max_ctx in (1, 100, 2048, 8192):
            assert 1 <= num_splits(batch, 2, max_ctx) <= attention.MAX_SPLITS


# --- the Triton kernel under the interpreter ---------------------------------------------------------------

KERNEL_CASES = [
    Case("plain-direct", (5, None, 130), g=1, page=16, splits=1),
    Case("plain-g6-splits3", (200, 64, 1), g=6, page=64, splits=3),
    Case("chain-g3-splits2", (0, 131, None, 17), "chain", 4, page=16, splits=2),
    Case("tree-g7-splits4", (150, None, 63), "tree", 7, g=7, page=64, splits=4),
    Case("tree-fp16-empty-splits", (9, 70, None), "tree", 8, g=6, page=16, dtype="float16", splits=5),
    Case("chain-fp16-direct", (127, 128), "chain", 2, g=7, page=64, dtype="float16", splits=1),
    Case("tile-edges", (64, 128, 192), "chain", 3, g=2, page=64, splits=2),
    Case("hd24-kvh1", (90, 3), "tree", 5, kv_heads=1, g=6, hd=24, page=16, splits=3),
    Case("int32-strided-slotlayout", (40, 110), "tree", 6, g=3, strided_q=True, index_dtype="int32", shuffled=False, splits=2),
    Case("narrow-table-default-splits", (40, 100, 0), "chain", 3, page=16, width=7, splits=None),
]  # fmt: skip
KERNEL_TOL = {"float32": 1e-5, "float16": 2e-3}


def _kernel_errors() -> dict:
    """Run in a TRITON_INTERPRET=1 process: each case's max |kernel - reference|, and the store's."""
    torch.set_num_threads(1)
    errors = {"triton_cpu": triton_enabled("cpu")}
    for case in KERNEL_CASES:
        inputs = make_inputs(case)
        got = paged_attention(**inputs, scale=case.hd**-0.5, page_size=case.page, splits=case.splits)
        want = run(paged_attention_ref, inputs, case)
        errors[case.name] = [str(got.dtype), (got.double() - want.double()).abs().max().item()]
    k_cache, v_cache, k, v, slots, positions = store_inputs()
    expected = [c.clone() for c in (k_cache, v_cache)]
    attention._store_kv_torch(*expected, k, v, slots, positions)
    store_kv(k_cache, v_cache, k, v, slots, positions)
    errors["store_kv"] = bool(torch.equal(k_cache, expected[0]) and torch.equal(v_cache, expected[1]))
    return errors


@pytest.fixture(scope="module")
def kernel_errors() -> dict:
    import triton  # noqa: F401  (the dev extra pins it: a missing triton fails here, never skips)

    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=110, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_interpreter_runs_the_kernels(kernel_errors: dict) -> None:
    assert kernel_errors["triton_cpu"]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: c.name)
def test_kernel_matches_reference(kernel_errors: dict, case: Case) -> None:
    dtype, error = kernel_errors[case.name]
    assert dtype == f"torch.{case.dtype}"
    assert error <= KERNEL_TOL[case.dtype], f"max error {error}"


def test_kernel_store_kv_matches_torch(kernel_errors: dict) -> None:
    assert kernel_errors["store_kv"]


# --- the KV store ----------------------------------------------------------------------------------------


def store_inputs(device: str = "cpu", dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(7)
    k_cache = torch.randn(4, 3, 32, 24, generator=gen).to(dtype)
    v_cache = torch.randn(4, 3, 32, 24, generator=gen).to(dtype)
    k, v = (torch.randn(5, 3, 24, generator=gen).to(dtype) for _ in range(2))
    slots = torch.tensor([2, 0, 2, 3, 1])
    positions = torch.tensor([0, 31, 5, 17, 8])
    return [x.to(device) for x in (k_cache, v_cache, k, v, slots, positions)]


def test_store_kv_writes_exactly_the_addressed_positions() -> None:
    k_cache, v_cache, k, v, slots, positions = store_inputs()
    before = [c.clone() for c in (k_cache, v_cache)]
    store_kv(k_cache, v_cache, k, v, slots, positions)
    for cache, old, new in ((k_cache, before[0], k), (v_cache, before[1], v)):
        expected = old.clone()
        for t in range(len(slots)):
            expected[slots[t], :, positions[t]] = new[t]
        assert torch.equal(cache, expected)


class _OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_store_kv_avoids_index_put() -> None:
    inputs = store_inputs()
    with _OpNames() as torch_ops:
        attention._store_kv_torch(*inputs)
    assert "aten.index_copy_.default" in torch_ops.names
    assert not any("index_put" in name for name in torch_ops.names), torch_ops.names
    with _OpNames() as public:
        store_kv(*inputs)
    assert not any("index_put" in name for name in public.names), public.names


def test_reference_and_store_run_on_fake_tensors() -> None:
    # What capture needs: no host reads and no data-dependent shapes (FakeTensor raises on either).
    case = Case("fake", (10, 50), "tree", 4, g=6)
    real = make_inputs(case)
    with FakeTensorMode() as mode:
        fake = {name: mode.from_tensor(x) for name, x in real.items()}
        out = run(paged_attention_ref, fake, case)
        assert out.shape == real["q"].shape and out.dtype == real["q"].dtype
        op_out = torch.ops.slipstream.paged_attention(**fake, scale=0.25, page_size=case.page, splits=3)
        assert op_out.shape == real["q"].shape and op_out.dtype == real["q"].dtype
        store = [mode.from_tensor(x) for x in store_inputs()]
        attention._store_kv_torch(*store)
        store_kv(*store)


def test_custom_ops_pass_opcheck() -> None:
    case = Case("opcheck", (10, None), "chain", 3, g=3)
    inputs = make_inputs(case)
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(
        torch.ops.slipstream.paged_attention.default,
        tuple(inputs.values()),
        {"scale": 0.25, "page_size": case.page},
        test_utils=tests,
    )
    torch.library.opcheck(torch.ops.slipstream.store_kv.default, tuple(store_inputs()), test_utils=tests)


# --- on a GPU: bf16, bench shapes, capture and replay ----------------------------------------------------

GPU_SHAPES = {"1.5b": (2, 6, 128), "7b": (4, 7, 128)}  # kv heads, g, head dim


def gpu_case(shape: str, n: int, page: int, ctx: tuple[int | None, ...], seed: int = 0) -> Case:
    kv_heads, g, hd = GPU_SHAPES[shape]
    kind = "plain" if n == 1 else ("tree" if page == 16 else "chain")
    return Case(
        f"{shape}", ctx, kind, n, kv_heads, g, hd, page, 2304, dtype="bfloat16", splits=None, seed=seed
    )


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("n", [1, 4, 8])
@pytest.mark.parametrize("page", [16, 64])
def test_gpu_kernel_matches_reference_bf16(shape: str, n: int, page: int) -> None:
    assert triton_enabled("cuda")
    case = gpu_case(shape, n, page, (2047, None, 64, 1, 700, 129))
    inputs = make_inputs(case, "cuda")
    want = run(paged_attention_ref, inputs, case).float()
    for splits in (None, 1, 2, 7, 33):
        torch.cuda.set_sync_debug_mode("error")  # the launch path must not read the device back
        try:
            got = paged_attention(**inputs, scale=case.hd**-0.5, page_size=page, splits=splits)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2, msg=f"splits={splits}")


@pytest.mark.gpu
def test_gpu_store_kv_matches_torch() -> None:
    k_cache, v_cache, k, v, slots, positions = store_inputs("cuda", torch.bfloat16)
    expected = [c.clone() for c in (k_cache, v_cache)]
    attention._store_kv_torch(*expected, k, v, slots, positions)
    store_kv(k_cache, v_cache, k, v, slots, positions)
    assert torch.equal(k_cache, expected[0]) and torch.equal(v_cache, expected[1])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("n", [1, 4])
def test_gpu_graph_replay_follows_new_contexts(shape: str, n: int) -> None:
    # One graph per bucket: the store and the attention captured at one context, replayed at others
    # with new table contents, lengths, tree bits and K/V, each replay equal to the reference.
    page, batch = 64, 4
    first = gpu_case(shape, n, page, (100, None, 5, 1500), seed=1)
    static = make_inputs(first, "cuda")
    kv_heads, hd = first.kv_heads, first.hd
    splits = num_splits(batch, kv_heads, 2048, attention._sm_count(torch.cuda.current_device()))
    new_k = torch.zeros(batch * n, kv_heads, hd, dtype=torch.bfloat16, device="cuda")
    new_v = torch.zeros_like(new_k)
    slots = torch.zeros(batch * n, dtype=torch.int64, device="cuda")
    positions = torch.zeros_like(slots)

    def step() -> torch.Tensor:
        store_kv(static["k_cache"], static["v_cache"], new_k, new_v, slots, positions)
        return paged_attention(**static, scale=hd**-0.5, page_size=page, splits=splits)

    def load(case: Case) -> None:
        fresh = make_inputs(case, "cuda")
        for name in ("q", "block_table", "ctx_lens", "tree_bits"):
            static[name].copy_(fresh[name])
        # Where the new nodes' K/V go, through the page table, as a paged writer would address them.
        pages_per_slot = first.max_len // page
        at = (static["ctx_lens"][:, None] + torch.arange(n, device="cuda")).view(-1)  # [B·n]
        phys = static["block_table"].gather(1, (at // page).view(batch, n)).view(-1)
        slots.copy_(phys // pages_per_slot)
        positions.copy_((phys % pages_per_slot) * page + at % page)
        new_k.copy_(torch.randn_like(new_k))
        new_v.copy_(torch.randn_like(new_v))

    load(first)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed, ctx in enumerate([(100, None, 5, 1500), (2000, 7, None, 0), (63, 64, 65, 1024)], start=2):
        load(gpu_case(shape, n, page, ctx, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        want = run(paged_attention_ref, static, first)  # reads the K/V the graph stored
        torch.testing.assert_close(out.float(), want.float(), atol=1e-2, rtol=1e-2, msg=f"ctx={ctx}")


if __name__ == "__main__":  # the interpreter run behind `kernel_errors`
    print(json.dumps(_kernel_errors()))


_NO_DYNAMO = """
import sys, torch
from slipstream.engine.weights import load_model
from slipstream.engine.attention import paged_attention, store_kv
load_model(sys.argv[1])  # built on the meta device, then loaded: no random init runs
k_cache = torch.zeros(2, 1, 32, 8)
v_cache = torch.zeros_like(k_cache)
one = torch.zeros(1, dtype=torch.long)
store_kv(k_cache, v_cache, torch.ones(1, 1, 8), torch.ones(1, 1, 8), one, one)
out = paged_attention(torch.ones(1, 1, 1, 8), k_cache, v_cache, torch.zeros(1, 2, dtype=torch.long),
                      one, torch.ones(1, 1, dtype=torch.long), scale=0.5, page_size=16)
assert float(out.abs().sum()) > 0
print("torch._dynamo" in sys.modules)
"""


def test_a_cpu_process_loads_a_model_and_attends_without_importing_dynamo(make_checkpoint) -> None:
    """On plain CPU tensors the kernels run without their custom op's dispatch, whose first call imports
    torch._dynamo (~1.5 s of every rollout's start-up, ~90 MB resident), and a model built on the meta
    device skips nn.Embedding's random init, which imports it too. A fresh process, as an actor is."""
    model = make_checkpoint("llama")
    done = subprocess.run([sys.executable, "-c", _NO_DYNAMO, str(model)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False", "torch._dynamo was imported on the CPU path"
