"""Paged attention for fixed-shape decode and verify steps (CUDA-graph safe), and the KV store it reads.

One kernel covers plain decode (one new token per row), chain verification (n new tokens, causal) and
tree verification (n new tokens, ancestor mask): query i of a row sees the row's cached positions
[0, ctx) plus new node j wherever bit j of `tree_bits[b, i]` is set, so the three differ only in bits.
Keys are addressed through a page table (physical page p = slot p // (L/P), positions (p % (L/P))·P..),
so the slot cache is the special table `slot·(L/P) + j` and a paged allocator later changes nothing here.

The non-obvious choice is split-KV with a split count fixed on the host (`num_splits`, per graph bucket)
while the work split follows the data: each program reads its row's ctx from memory and takes an equal
share of that row's key tiles (the n new nodes are the last keys), so a graph captured at one context
replays correctly at any other, and a split with no keys writes an empty partial that the log-sum-exp
merge weighs at zero. The g·n query rows of one kv head share a program (padded to 16 rows) so QKᵀ and
PV are tensor-core dots.

Dispatch: CUDA runs the Triton kernels through custom ops (opaque to graphs and torch.compile); CPU calls
the same code without the op's dispatch, `paged_attention_ref` (gather + masked softmax), except
under TRITON_INTERPRET=1 (set before this module is imported), where the kernels run on CPU tensors: that
is how the CPU suite tests them. triton is optional: without it everything takes the torch path.
"""

from __future__ import annotations

import functools
import math
import os

import torch
from torch import Tensor

triton = None
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    # Optional, and only where it can run: a CPU process (every actor of a CPU run) skips its ~0.2 s import.
    try:
        import triton
        import triton.language as tl
    except ImportError:  # pragma: no cover - exercised on installs without triton
        triton = None

__all__ = [
    "BLOCK_N",
    "PAGE_SIZE",
    "num_splits",
    "paged_attention",
    "paged_attention_ref",
    "store_kv",
    "triton_enabled",
]

PAGE_SIZE = 64
"""Positions per page of the page tables the engine's fixed-shape steps build (a static cache's length is
rounded up to it); one page is one key tile, so a tile costs one table read."""
BLOCK_N = 64
"""Keys per tile of the split kernel (64 × head_dim 128 × bf16 = 16 KB of K per tile)."""
MIN_SPLIT_KEYS = 128
"""`num_splits` gives a split at least this many keys at the maximum context. A split's partials (written,
then read by the merge) cost ~1/10 of its bf16 KV reads at g = 6–7, n = 1, and ~3/4 at n = 8."""
MAX_SPLITS = 128
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""What the split kernel computes in (its running max and sum are fp32); float64 takes the reference."""
INVARIANT_SPLIT_TILES = 8
"""Key tiles per split in the batch-invariant mode (engine/invariant.py): 512 keys a split."""
MERGE_BLOCK = 32
"""Splits the merge kernel loads per step."""
_LOG2E = 1.4426950408889634
_EMPTY_MAX = -1.0e30
"""Running max of a row that has seen no key: finite, so exp2(max_old - max_new) is 1, not NaN."""


# --- Triton kernels -------------------------------------------------------------------------------------

if triton is not None:
    _EMPTY = tl.constexpr(_EMPTY_MAX)  # jit code reads globals only as constexpr

    @triton.jit
    def _tile(
        q, m_i, l_i, acc, start, k_base, v_base, bt_row, pages_per_slot,
        stride_ks, stride_kl, stride_vs, stride_vl, ctx, total, bits, qk_scale, d, d_ok,
        PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """One key tile [start, start + BLOCK_N) folded into the running (max, sum, acc) of M query rows.

        MASKED=False: every key is a cached position < ctx (no masks at all). MASKED=True: the tail tiles,
        where keys past `total` are dropped and the new nodes (ctx <= t < total) obey the tree bits."""
        t = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] logical positions
        t_ok = t < total
        if PAGE % BLOCK_N == 0:
            # The tile lies inside one page: one table read, and keys contiguous in memory.
            page = tl.load(bt_row + start // PAGE).to(tl.int32)
            slot = (page // pages_per_slot).to(tl.int64)
            pos = (page % pages_per_slot) * PAGE + t % PAGE
        else:
            if MASKED:
                page = tl.load(bt_row + t // PAGE, mask=t_ok, other=0).to(tl.int32)
            else:
                page = tl.load(bt_row + t // PAGE).to(tl.int32)
            slot = (page // pages_per_slot).to(tl.int64)
            pos = (page % pages_per_slot) * PAGE + t % PAGE
        k_ptrs = k_base + (slot * stride_ks + pos * stride_kl)[:, None] + d[None, :]  # [BLOCK_N, HD_PAD]
        v_ptrs = v_base + (slot * stride_vs + pos * stride_vl)[:, None] + d[None, :]
        if MASKED:
            kv_mask = t_ok[:, None] & d_ok[None, :]
        else:
            kv_mask = d_ok[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, BLOCK_N], log2 units
        if MASKED:
            rel = t - ctx
            new = (rel >= 0) & t_ok  # t < total <= ctx + n, so rel < n
            shift = tl.where(new, rel, 0).to(tl.int64)
            sees = ((bits[:, None] >> shift[None, :]) & 1) != 0
            visible = ((rel < 0) & t_ok)[None, :] | (new[None, :] & sees)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l_i * alpha + tl.sum(p, 1), acc

    @triton.jit
    def _split_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, bits_ptr, out_ptr, ml_ptr, acc_ptr, qk_scale,
        stride_qb, stride_qn, stride_qh, stride_ks, stride_kh, stride_kl, stride_vs, stride_vh, stride_vl,
        stride_bt, table_width, pages_per_slot, stride_tb, stride_tn, stride_ob, stride_on, stride_oh,
        partial_rows,
        G: tl.constexpr, N_NEW: tl.constexpr, M: tl.constexpr, HD: tl.constexpr, HD_PAD: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr,
        SPLIT_KEYS: tl.constexpr,
    ):  # fmt: skip
        """Program (b, kv head, split): the G·N_NEW query rows of one kv head against this split's keys
        (SPLIT_KEYS > 0: split s takes keys [s·SPLIT_KEYS, (s+1)·SPLIT_KEYS), whatever the row's length and
        node count, so a query's partials are the same at any batch: the batch-invariant mode).

        DIRECT (one split): writes the normalised output. Otherwise writes the partial (max, sum) to
        ml[0 / 1, row, split] and the unnormalised acc to acc[row, split, :], row = (b·N + i)·H + h."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        nsplit = tl.num_programs(2)
        heads = tl.num_programs(1) * G
        rows = tl.arange(0, M)  # packed query row r = token i, head-in-group hg
        i = rows // G
        h = kvh * G + rows % G
        row_ok = rows < G * N_NEW
        d = tl.arange(0, HD_PAD)
        d_ok = d < HD
        q = tl.load(
            q_ptr + b * stride_qb + i[:, None] * stride_qn + h[:, None] * stride_qh + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [M, HD_PAD]
        # Padded rows see no new node, only the prefix: their scores stay finite and are never stored.
        bits = tl.load(bits_ptr + b * stride_tb + i * stride_tn, mask=row_ok, other=0).to(tl.int64)

        # This split's share of the row's keys [0, ctx + N), in whole tiles; read from memory, so the
        # grid (and a captured graph) does not depend on ctx. Positions past the table are never read.
        capacity = table_width * PAGE
        ctx = tl.minimum(tl.load(ctx_ptr + b).to(tl.int32), capacity)
        total = tl.minimum(ctx + N_NEW, capacity)
        if SPLIT_KEYS > 0:
            per_split = SPLIT_KEYS
        else:
            per_split = tl.cdiv(tl.cdiv(total, BLOCK_N), nsplit) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(lo + per_split, total)
        full_end = lo + tl.maximum(tl.minimum(hi, ctx) - lo, 0) // BLOCK_N * BLOCK_N

        m_i = tl.full([M], _EMPTY, tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, HD_PAD], tl.float32)
        k_base = k_ptr + kvh * stride_kh
        v_base = v_ptr + kvh * stride_vh
        bt_row = bt_ptr + b * stride_bt
        for start in range(lo, full_end, BLOCK_N):
            m_i, l_i, acc = _tile(
                q, m_i, l_i, acc, start, k_base, v_base, bt_row, pages_per_slot,
                stride_ks, stride_kl, stride_vs, stride_vl, ctx, total, bits, qk_scale, d, d_ok,
                PAGE, BLOCK_N, False, PRECISION,
            )  # fmt: skip
        for start in range(full_end, hi, BLOCK_N):
            m_i, l_i, acc = _tile(
                q, m_i, l_i, acc, start, k_base, v_base, bt_row, pages_per_slot,
                stride_ks, stride_kl, stride_vs, stride_vl, ctx, total, bits, qk_scale, d, d_ok,
                PAGE, BLOCK_N, True, PRECISION,
            )  # fmt: skip

        if DIRECT:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            out_ptrs = out_ptr + b * stride_ob + i[:, None] * stride_on + h[:, None] * stride_oh + d[None, :]
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        else:
            part = ((b * N_NEW + i) * heads + h) * nsplit + split  # [M]
            tl.store(ml_ptr + part, m_i, mask=row_ok)
            tl.store(ml_ptr + partial_rows * nsplit + part, l_i, mask=row_ok)
            acc_ptrs = acc_ptr + part[:, None].to(tl.int64) * HD + d[None, :]
            tl.store(acc_ptrs, acc, mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _merge_kernel(
        ml_ptr, acc_ptr, out_ptr, partial_rows, nsplit, heads, stride_ob, stride_on, stride_oh,
        N_NEW: tl.constexpr, HD: tl.constexpr, HD_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        """Program per query row (b, i, h): log-sum-exp merge of its splits' partials."""
        row = tl.program_id(0)
        h = row % heads
        i = (row // heads) % N_NEW
        b = row // (heads * N_NEW)
        d = tl.arange(0, HD_PAD)
        d_ok = d < HD
        m_g = tl.full([1], _EMPTY, tl.float32)
        l_g = tl.zeros([1], tl.float32)
        acc_g = tl.zeros([HD_PAD], tl.float32)
        for s0 in range(0, nsplit, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            s_ok = s < nsplit
            part = row * nsplit + s  # [BLOCK_S]
            m_s = tl.load(ml_ptr + part, mask=s_ok, other=_EMPTY)
            l_s = tl.load(ml_ptr + partial_rows * nsplit + part, mask=s_ok, other=0.0)
            a_s = tl.load(
                acc_ptr + part[:, None].to(tl.int64) * HD + d[None, :],
                mask=s_ok[:, None] & d_ok[None, :],
                other=0.0,
            )  # [BLOCK_S, HD_PAD]
            m_new = tl.maximum(m_g, tl.max(m_s, 0, keep_dims=True))
            w = tl.exp2(m_s - m_new)  # an empty split has l = 0 and acc = 0, whatever its weight
            c = tl.exp2(m_g - m_new)
            l_g = l_g * c + tl.sum(l_s * w, 0, keep_dims=True)
            acc_g = acc_g * c + tl.sum(a_s * w[:, None], 0)
            m_g = m_new
        out = acc_g / tl.where(l_g > 0, l_g, 1.0)
        out_ptrs = out_ptr + b * stride_ob + i * stride_on + h * stride_oh + d
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_ok)

    @triton.jit
    def _store_kv_kernel(
        k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, pos_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_kcs, stride_kch, stride_kcl, stride_vcs, stride_vch, stride_vcl,
        KVH: tl.constexpr, KVH_PAD: tl.constexpr, HD: tl.constexpr, HD_PAD: tl.constexpr,
    ):  # fmt: skip
        """Program per token: its K and V for every kv head into (slot, :, position)."""
        t = tl.program_id(0)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        hh = tl.arange(0, KVH_PAD)[:, None]
        d = tl.arange(0, HD_PAD)[None, :]
        mask = (hh < KVH) & (d < HD)
        k = tl.load(k_ptr + t * stride_kt + hh * stride_kh + d, mask=mask)
        tl.store(kc_ptr + slot * stride_kcs + hh * stride_kch + pos * stride_kcl + d, k, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + hh * stride_vh + d, mask=mask)
        tl.store(vc_ptr + slot * stride_vcs + hh * stride_vch + pos * stride_vcl + d, v, mask=mask)

    _INTERPRET = type(_split_kernel).__name__ == "InterpretedFunction"
    if _INTERPRET:
        # triton 3.6's interpreter turns a loop bound into a Python int with int(array of shape (1,)),
        # which numpy >= 2.4 refuses (triton-lang/triton#9171, fixed upstream by a squeeze): every
        # data-dependent `range` here would fail. Same fix, applied to the interpreter only.
        from triton.runtime import interpreter as _interpreter

        _patch_tensor = _interpreter._patch_lang_tensor

        def _patch_tensor_index(tensor, scope) -> None:
            _patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        if not getattr(_patch_tensor, "_slipstream_index", False):
            _patch_tensor_index._slipstream_index = True
            _interpreter._patch_lang_tensor = _patch_tensor_index
else:  # pragma: no cover
    _INTERPRET = False


def triton_enabled(device: torch.device | str) -> bool:
    """Whether `paged_attention` / `store_kv` run the Triton kernels for tensors on `device`: on CUDA when
    triton imports, on the CPU only under TRITON_INTERPRET=1 (set before this module was imported)."""
    if triton is None:
        return False
    kind = torch.device(device).type
    return kind == "cpu" if _INTERPRET else kind == "cuda"


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_splits(batch: int, kv_heads: int, max_ctx: int, sms: int = 132) -> int:
    """Splits per (row, kv head) for a step of `batch` rows whose contexts stay <= max_ctx: a host
    constant per graph bucket. FlashAttention-2's rule: one split once the (row, head) pairs fill ~80% of
    the SMs; otherwise the fewest splits within 85% of the best wave efficiency (a split count that gives
    each split the same number of tiles as a smaller one is skipped), with >= MIN_SPLIT_KEYS keys each."""
    pairs = batch * kv_heads
    if pairs >= 0.8 * sms:
        return 1
    tiles = max(1, -(-max_ctx // BLOCK_N))
    most = max(1, min(MAX_SPLITS, sms, -(-max_ctx // MIN_SPLIT_KEYS)))

    def efficiency(splits: int) -> float:
        waves = pairs * splits / sms
        return waves / math.ceil(waves)

    def eligible(splits: int) -> bool:
        return splits == 1 or -(-tiles // splits) != -(-tiles // (splits - 1))

    candidates = [s for s in range(1, most + 1) if eligible(s)]
    best = max(efficiency(s) for s in candidates)
    return next(s for s in candidates if efficiency(s) >= 0.85 * best)


# --- paged attention ------------------------------------------------------------------------------------


def _check(q: Tensor, k_cache: Tensor, block_table: Tensor, tree_bits: Tensor, page_size: int) -> None:
    # Host-side shape checks only: nothing here reads device memory.
    batch, n, heads, hd = q.shape
    _, kv_heads, max_len, cache_hd = k_cache.shape
    if cache_hd != hd or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of shape {tuple(k_cache.shape)}")
    if page_size <= 0 or page_size & (page_size - 1) or max_len % page_size:
        raise ValueError(f"page_size {page_size} must be a power of two dividing max_len {max_len}")
    if not 1 <= n <= 63 or tree_bits.shape != (batch, n) or tree_bits.dtype != torch.int64:
        got = f"{tree_bits.dtype} {tuple(tree_bits.shape)}"
        raise ValueError(f"tree_bits must be int64 [B, N] with 1 <= N <= 63, got {got}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must be [B, pages], got {tuple(block_table.shape)}")


def paged_attention_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    ctx_lens: Tensor,
    tree_bits: Tensor,
    *,
    scale: float,
    page_size: int,
    splits: int | None = None,
) -> Tensor:
    """Pure-torch paged attention on any device: gathers every page of the table (fixed shapes, no host
    reads, so it runs under FakeTensor and graph capture), masked softmax in fp32 (float64 for a float64
    model). Same contract as
    `paged_attention`; `splits` is accepted and ignored. A row that sees nothing gets zeros."""
    _check(q, k_cache, block_table, tree_bits, page_size)
    batch, n, heads, hd = q.shape
    slots, kv_heads, max_len, _ = k_cache.shape
    g = heads // kv_heads
    pages_per_slot = max_len // page_size
    width = block_table.shape[1]
    # Unused table entries may hold anything; clamping keeps the gather in bounds, the mask drops them.
    table = block_table.long().clamp(0, slots * pages_per_slot - 1)
    slot, page = table // pages_per_slot, table % pages_per_slot  # [B, W] each

    compute = torch.promote_types(q.dtype, torch.float32)  # fp32 at least; a float64 model stays float64

    def gather(cache: Tensor) -> Tensor:
        paged = cache.view(slots, kv_heads, pages_per_slot, page_size, hd)
        pages = paged[slot, :, page]  # [B, W, KVH, P, HD]
        return pages.permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, 1, width * page_size, hd).to(compute)

    keys, values = gather(k_cache), gather(v_cache)  # [B, KVH, 1, T, HD]
    t = torch.arange(width * page_size, device=q.device)
    rel = t - ctx_lens.long()[:, None]  # [B, T]
    new = (rel >= 0) & (rel < n)
    sees = (tree_bits[:, :, None] >> rel.clamp(0, 63)[:, None, :]) & 1  # [B, N, T]
    visible = (rel < 0)[:, None, :] | (new[:, None, :] & sees.bool())  # [B, N, T]

    qf = q.to(compute).view(batch, n, kv_heads, g, hd).permute(0, 2, 3, 1, 4)  # [B, KVH, g, N, HD]
    scores = torch.matmul(qf, keys.transpose(-1, -2)) * scale  # [B, KVH, g, N, T]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.where(visible.any(-1)[:, None, None, :, None], scores.softmax(-1), 0.0)
    out = torch.matmul(probs, values)  # [B, KVH, g, N, HD]
    return out.permute(0, 3, 1, 2, 4).reshape(batch, n, heads, hd).to(q.dtype).contiguous()


def _paged_attention_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    ctx_lens: Tensor,
    tree_bits: Tensor,
    scale: float,
    page_size: int,
    splits: int | None,
) -> Tensor:
    batch, n, heads, hd = q.shape
    _, kv_heads, max_len, _ = k_cache.shape
    g = heads // kv_heads
    if splits is not None and splits < 1:
        raise ValueError(f"splits must be at least 1, got {splits}")
    from slipstream.engine import invariant  # (it imports this module)

    split_keys = 0
    if invariant.enabled():
        # Fixed key ranges: a query's partials and their merge do not depend on the batch or node count.
        split_keys = INVARIANT_SPLIT_TILES * BLOCK_N
        splits = max(1, -(-block_table.shape[1] * page_size // split_keys))
    elif splits is None:
        sms = _sm_count(q.device.index if q.device.index is not None else 0) if q.is_cuda else 132
        splits = num_splits(batch, kv_heads, block_table.shape[1] * page_size, sms)
    # The kernels index the last dim (and the table's pages) with unit stride; everything else by stride.
    q, k_cache, v_cache = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_cache, v_cache))
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    ctx_lens = (
        ctx_lens.contiguous()
    )  # read as ctx_lens[b]: a strided column (a packed input block) would not be
    out = torch.empty(batch, n, heads, hd, dtype=q.dtype, device=q.device)  # [B, N, H, HD]
    direct = splits == 1
    partial_rows = batch * n * heads
    # Scratch sized by shapes and the host constant `splits` only, so capture allocates it once.
    if direct:  # no partials: the kernel writes `out`, and never touches these two
        ml = acc = out
    else:
        ml = torch.empty(2, partial_rows, splits, dtype=torch.float32, device=q.device)
        acc = torch.empty(partial_rows, splits, hd, dtype=torch.float32, device=q.device)
    m_rows = max(16, triton.next_power_of_2(g * n))
    hd_pad = max(16, triton.next_power_of_2(hd))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 caches: no TF32 rounding
    _split_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, block_table, ctx_lens, tree_bits, out, ml, acc, scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0), block_table.shape[1], max_len // page_size,
        tree_bits.stride(0), tree_bits.stride(1), out.stride(0), out.stride(1), out.stride(2),
        partial_rows,
        G=g, N_NEW=n, M=m_rows, HD=hd, HD_PAD=hd_pad, PAGE=page_size, BLOCK_N=BLOCK_N, DIRECT=direct,
        PRECISION=precision, SPLIT_KEYS=split_keys, num_warps=4 if m_rows <= 16 else 8, num_stages=2,
    )  # fmt: skip
    if not direct:
        _merge_kernel[(partial_rows,)](
            ml, acc, out, partial_rows, splits, heads, out.stride(0), out.stride(1), out.stride(2),
            N_NEW=n, HD=hd, HD_PAD=hd_pad, BLOCK_S=min(MERGE_BLOCK, triton.next_power_of_2(splits)),
            num_warps=4,
        )  # fmt: skip
    return out


def _plain_cpu(x: Tensor) -> bool:
    """True where the custom op's dispatch buys nothing: a plain CPU tensor, no dispatch mode active (a
    FakeTensor, an op trace and torch.compile's tracing all go through the op and its fake). There the
    dispatch only costs: ~10 µs a call, and its first call imports torch._dynamo (~1.5 s of a rollout's
    start-up). The same implementation runs either way."""
    return type(x) is Tensor and x.device.type == "cpu" and torch._C._len_torch_dispatch_stack() == 0


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    ctx_lens: Tensor,
    tree_bits: Tensor,
    *,
    scale: float,
    page_size: int,
    splits: int | None = None,
) -> Tensor:
    """Attention of N new tokens per row over the row's cached keys and the new nodes it may see.

    q [B, N, H, HD] (H = KVH·g; query head h reads kv head h // g); k_cache, v_cache [S, KVH, L, HD];
    block_table [B, W] int32/int64, logical page j of row b = physical page block_table[b, j] (slot p //
    (L/P), positions (p % (L/P))·P ..); ctx_lens [B] int32/int64, cached tokens before the N new ones,
    whose K/V are already stored at positions ctx..ctx+N-1; tree_bits [B, N] int64, bit j of [b, i] = new
    node i sees new node j (N <= 63). Query i sees positions [0, ctx) and ctx+j for its set bits. Returns
    out [B, N, H, HD] in q's dtype (fp32 accumulation). splits: the split-KV constant (None:
    `num_splits` at the table's capacity); a graph should pass its bucket's value. Positions past the
    table's W·P are never read."""
    args = (q, k_cache, v_cache, block_table, ctx_lens, tree_bits)
    if not _plain_cpu(q):
        return _paged_attention_op(*args, scale=scale, page_size=page_size, splits=splits)
    with torch.no_grad():  # as through the op, which has no autograd formula
        return _paged_attention(*args, scale=scale, page_size=page_size, splits=splits)


def _paged_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, ctx_lens: Tensor, tree_bits: Tensor,
    *, scale: float, page_size: int, splits: int | None = None,
) -> Tensor:  # fmt: skip
    """`paged_attention` itself, with or without the custom op around it."""
    _check(q, k_cache, block_table, tree_bits, page_size)
    if triton_enabled(q.device) and q.dtype in TRITON_DTYPES:
        return _paged_attention_triton(
            q, k_cache, v_cache, block_table, ctx_lens, tree_bits, scale, page_size, splits
        )
    return paged_attention_ref(
        q, k_cache, v_cache, block_table, ctx_lens, tree_bits, scale=scale, page_size=page_size
    )


@torch.library.custom_op("slipstream::paged_attention", mutates_args=())
def _paged_attention_op(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, ctx_lens: Tensor, tree_bits: Tensor,
    *, scale: float, page_size: int, splits: int | None = None,
) -> Tensor:  # fmt: skip
    return _paged_attention(
        q, k_cache, v_cache, block_table, ctx_lens, tree_bits, scale=scale, page_size=page_size, splits=splits
    )


@_paged_attention_op.register_fake
def _(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, ctx_lens: Tensor, tree_bits: Tensor,
    *, scale: float, page_size: int, splits: int | None = None,
) -> Tensor:  # fmt: skip
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# --- KV store ---------------------------------------------------------------------------------------------


def _store_kv_torch(
    k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slots: Tensor, positions: Tensor
) -> None:
    # index_copy_ on the flat [S·KVH·L, HD] view: capture-safe, where index_put_ is unverified (§3.4).
    slot_count, kv_heads, max_len, hd = k_cache.shape
    heads = torch.arange(kv_heads, device=k_cache.device)
    rows = (slots.long()[:, None] * kv_heads + heads) * max_len + positions.long()[:, None]  # [T, KVH]
    for cache, x in ((k_cache, k), (v_cache, v)):
        flat = cache.view(slot_count * kv_heads * max_len, hd)
        flat.index_copy_(0, rows.view(-1), x.reshape(-1, hd).to(cache.dtype))


def store_kv(
    k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slots: Tensor, positions: Tensor
) -> None:
    """Write token t's K/V (k, v [T, KVH, HD]) at (slots[t], :, positions[t]) of k_cache, v_cache
    [S, KVH, L, HD] (contiguous). slots, positions [T] int64 (or int32). No host reads; one Triton launch
    for K and V where `triton_enabled`, index_copy_ on a flat view otherwise."""
    if not _plain_cpu(k_cache):
        _store_kv_op(k_cache, v_cache, k, v, slots, positions)
        return
    with torch.no_grad():  # as through the op: a cache view written in place is no autograd's business
        _store_kv(k_cache, v_cache, k, v, slots, positions)


def _store_kv(
    k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slots: Tensor, positions: Tensor
) -> None:
    """`store_kv` itself, with or without the custom op around it."""
    if not triton_enabled(k_cache.device):
        _store_kv_torch(k_cache, v_cache, k, v, slots, positions)
        return
    tokens, kv_heads, hd = k.shape
    if tokens == 0:
        return
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    _store_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slots, positions, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        KVH=kv_heads, KVH_PAD=triton.next_power_of_2(kv_heads), HD=hd,
        HD_PAD=triton.next_power_of_2(hd), num_warps=4,
    )  # fmt: skip


@torch.library.custom_op("slipstream::store_kv", mutates_args=("k_cache", "v_cache"))
def _store_kv_op(
    k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slots: Tensor, positions: Tensor
) -> None:
    _store_kv(k_cache, v_cache, k, v, slots, positions)


@_store_kv_op.register_fake
def _(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slots: Tensor, positions: Tensor) -> None:
    return None
