"""Native Llama/Qwen2 decoder: one module for rollout (flat ragged tokens + KV cache) and learner.

`Transformer.forward` runs FLAT tokens (`input_ids [num_tokens]`, no padding) described by a
`BatchLayout`: every projection is one matrix multiply over all sequences' new tokens, and attention
follows the layout's plan straight out of the KV cache. It returns the LM head for the selected rows only,
plus the last layer's hidden states before the final norm (what an EAGLE drafter reads). `forward_train`
is the plain [B, T] causal forward the learner differentiates; both share the layers and the arithmetic,
so rollout and learner log-probs agree.

Non-obvious choices (figures: docs/engine.md, "Model"):
- q/k/v and gate/up are fused into single projections; the loader splits HF tensors into them.
- GQA without repeating K/V: query heads sharing a KV head fold into the query-length axis.
- On CPU, inference projections use prepacked weights (MKL's packed sgemm or oneDNN, engine/device.py's
  `packed_gemm`), repacked when a weight's storage or version changes (an in-place weight update bumps
  the version); elsewhere (CUDA, training with grad) projections are F.linear.
  A rollout keeps the packed copies only (`keep_packed_only`: the decoder's weights once, not twice).
- Decode attention is matmul → softmax → matmul with an additive mask; RoPE tables are built once, in
  float32 as transformers computes them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from slipstream.engine import invariant
from slipstream.engine.batch import AttentionGroup, BatchLayout
from slipstream.engine.config import ModelConfig
from slipstream.engine.device import MKL_PACK_ROWS, PAD_ROWS, onednn_pad_rows, packed_gemm, sdpa
from slipstream.engine.kv_cache import KVCache


class _PackedWeight:
    """A packed copy of a CPU weight for `packed_gemm`'s kernel, rebuilt when the weight's storage or
    version or the kernel changes."""

    __slots__ = ("fixups", "gemm", "key", "packed", "shape")

    def __init__(self) -> None:
        self.key: tuple[int, int, str] | None = None
        self.gemm: str | None = None
        self.packed: Tensor | None = None
        self.shape: Tensor | None = None  # MKL's kernel takes the output width from a weight-shaped tensor
        self.fixups: tuple[Tensor, Tensor, Tensor] | None = None  # what `unpack` cannot read back (MKL)

    def get(self, weight: Tensor, gemm: str) -> Tensor:
        if weight.is_meta:  # packed only (`Transformer.keep_packed_only`): the packed copy is the weight
            if self.packed is None or self.gemm != gemm:
                raise RuntimeError(f"a packed-only projection holds a {self.gemm} pack, not the {gemm} one")
            return self.packed
        key = (weight.data_ptr(), weight._version, gemm)
        if key != self.key:
            self.put(weight, gemm)
            self.key = key
        assert self.packed is not None
        return self.packed

    def put(self, value: Tensor, gemm: str, *, only_copy: bool = False) -> None:
        """Pack `value` for `gemm` now. only_copy: no plain copy is kept (a packed-only projection), so keep
        what `unpack` needs to read it back exactly."""
        with torch.inference_mode():
            self.packed = None  # drop the old pack first: two at once would double the peak per layer
            # contiguous(): a no-op for a weight, and a transposed view (Wᵀ in a backward product)
            # reorders ~6x faster from a plain copy than in place.
            plain = value.detach().contiguous()
            if gemm == "mkl":
                self.packed = torch.ops.mkl._mkl_reorder_linear_weight(plain, MKL_PACK_ROWS)
                self.shape = torch.zeros((), dtype=value.dtype).expand(value.shape)  # no storage
                self.fixups = None
                if only_copy:
                    # MKL's pack has no exact inverse: `unpack` multiplies it by the identity, exact but for a
                    # zero's sign and rows holding inf or NaN (0·inf). Those are kept aside (usually none).
                    self.fixups = _unpack_fixups(plain)
            else:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(plain, None)
                self.fixups = None
        self.gemm = gemm
        self.key = None

    def unpack(self) -> Tensor:
        """The packed weight's exact values, as a plain [out, in] tensor (a copy)."""
        assert self.packed is not None
        if self.gemm != "mkl":
            return self.packed.to_dense()  # oneDNN's reorder is exact both ways
        if self.shape is None or self.fixups is None:
            raise RuntimeError(
                "this MKL pack was not made as a projection's only copy: it has no exact read-back"
            )
        width = self.shape.shape[1]
        with torch.inference_mode():
            eye = torch.eye(width, dtype=self.shape.dtype)
            plain = torch.ops.mkl._mkl_linear(eye, self.packed, self.shape, None, width).t().contiguous()
            negative_zeros, bad_rows, rows = self.fixups
            plain.view(-1)[negative_zeros] = -0.0
            plain[bad_rows] = rows
        return plain


def _unpack_fixups(plain: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(flat indices of negative zeros, rows holding inf or NaN, those rows) of a float32 weight.

    Found first by two reductions that allocate nothing: a -0.0 is int32's minimum as bits, and inf or NaN
    shows in the min or max. Masks the weight's size, made on every push, left ~270 MB of freed
    temporaries resident in a SmolLM2 rollout (the allocator keeps them); usually there is nothing to find.
    """
    low, high = torch.aminmax(plain)
    negative_zero = bool(plain.view(torch.int32).min() == torch.iinfo(torch.int32).min)
    none = torch.empty(0, dtype=torch.int64)
    if not negative_zero and bool(low.isfinite() & high.isfinite()):
        return none, none, plain.new_empty(0, plain.shape[1])
    negative_zeros = ((plain == 0) & plain.signbit()).flatten().nonzero().squeeze(1)
    bad_rows = (~plain.isfinite()).any(1).nonzero().squeeze(1)
    return negative_zeros, bad_rows, plain[bad_rows].clone()


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None, pack: _PackedWeight | None) -> Tensor:
    """x @ weightᵀ + bias; pack None: never a packed copy (a sharded learner's weights are gathered into
    storage that FSDP frees and refills, so a pack keyed on it could outlive what it copied)."""
    if invariant.active(x, weight):
        return invariant.linear(x, weight, bias)  # rows independent of the batch (engine/invariant.py)
    gemm = None if pack is None else packed_gemm(x.device, weight.dtype, weight.shape[0])
    if gemm is not None and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)):
        assert pack is not None
        packed = pack.get(weight, gemm)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if gemm == "mkl":
            # The row count as the "prepacked batch size": MKL's packed weight serves any row count, and a
            # mismatch would make the op fall back to the plain weight, which `shape` only stands in for.
            return torch.ops.mkl._mkl_linear(x, packed, pack.shape, bias, rows)
        if 0 < rows < PAD_ROWS and rows in onednn_pad_rows(weight.dtype):
            # oneDNN streams the weights slower for one or two rows than for four on AVX-512: pad, drop.
            padded = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, PAD_ROWS - rows))  # one allocation
            out = torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], "")
            return out[:rows].reshape(*x.shape[:-1], out.shape[-1])
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if weight.is_meta and not x.is_meta:  # F.linear would return a meta tensor, silently
        raise RuntimeError("this projection keeps only its packed weight (keep_packed_only): inference only")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose inference path uses prepacked oneDNN weights on CPU."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self._pack = _PackedWeight()
        self.packable = True  # False: F.linear always (a sharded learner's, `Transformer.train_only`)

    def forward(self, x: Tensor) -> Tensor:
        return _linear(x, self.weight, self.bias, self._pack if self.packable else None)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Rotary:
    """RoPE tables: cos [P, head_dim] and signed sin [P, head_dim] so that rope(x) = x·cos + swap(x)·sin."""

    def __init__(self, config: ModelConfig) -> None:
        self.head_dim = config.head_dim
        self.inv_freq = _inv_freq(config)  # [head_dim/2] float32
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor]] = {}

    def tables(self, length: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Tables covering positions [0, length) or more, on `device` in `dtype`."""
        key = (device, dtype)
        cached = self._tables.get(key)
        if cached is None or cached[0].shape[0] < length:
            size = max(length, 2 * cached[0].shape[0] if cached is not None else 0)
            # Same arithmetic as transformers: float32 positions × float32 inverse frequencies.
            freqs = torch.arange(size, dtype=torch.float32, device="cpu")[:, None] * self.inv_freq[None, :]
            cos = torch.cat((freqs.cos(), freqs.cos()), -1).to(device=device, dtype=dtype)
            sin = torch.cat((-freqs.sin(), freqs.sin()), -1).to(device=device, dtype=dtype)
            cached = self._tables[key] = (cos, sin)
        return cached


def _inv_freq(config: ModelConfig) -> Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    )
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE on x [..., heads, head_dim] with cos/sin [..., 1, head_dim] (sin sign-folded)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.groups = config.queries_per_kv
        width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv = Linear(config.hidden_size, width, bias=config.qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.o_bias)

    def _qkv(self, h: Tensor, cos: Tensor, sin: Tensor, hooks: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        """q [..., heads, hd], k and v [..., kv_heads, hd] for normed input h [..., hidden]; hooks=False:
        the projection's `.forward` directly (the rollout path, see `Transformer.forward`)."""
        qkv = self.qkv(h) if hooks else self.qkv.forward(h)
        lead = qkv.shape[:-1]
        qk_heads = self.num_heads + self.num_kv_heads
        # One RoPE call rotates q and k together: they are adjacent in the fused projection.
        # split rather than slices: a slice's backward zero-fills a full-size gradient, split's concatenates.
        qk, v = qkv.split([qk_heads * self.head_dim, self.num_kv_heads * self.head_dim], dim=-1)
        qk = _rope(qk.unflatten(-1, (qk_heads, self.head_dim)), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=-2)
        return q, k, v.view(*lead, self.num_kv_heads, self.head_dim)

    def forward_cached(
        self,
        h: Tensor,
        cos: Tensor,
        sin: Tensor,
        layout: BatchLayout,
        k_cache: Tensor,
        v_cache: Tensor,
        masks: list[Tensor],
    ) -> Tensor:
        """Attention for flat tokens h [N, hidden]; writes their K/V into this layer's cache first."""
        q, k, v = self._qkv(h, cos, sin, hooks=False)  # [N, heads, hd], [N, kv_heads, hd] ×2
        k_cache[layout.write_slots, :, layout.write_positions] = k
        v_cache[layout.write_slots, :, layout.write_positions] = v
        groups = layout.groups
        if len(groups) == 1 and groups[0].token_slice == slice(0, h.shape[0]):
            out = self._attend(q, k_cache, v_cache, groups[0], masks[0])
        else:
            out = h.new_empty(h.shape[0], self.num_heads * self.head_dim)
            for group, mask in zip(groups, masks, strict=True):
                o = self._attend(q, k_cache, v_cache, group, mask)
                if group.token_slice is not None:
                    out[group.token_slice] = o
                else:
                    out.index_copy_(0, group.token_rows, o.index_select(0, group.output_index))
        return self.o_proj.forward(out)

    def _attend(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, group: AttentionGroup, mask: Tensor
    ) -> Tensor:
        """Padded queries of one group against its keys; returns [rows * q_len, heads * hd]."""
        rows, q_len, kvh, g, hd = group.rows, group.q_len, self.num_kv_heads, self.groups, self.head_dim
        qg = q[group.token_slice] if group.token_slice is not None else q.index_select(0, group.query_index)
        if q_len == 1:
            qg = qg.view(rows, kvh, g, hd)
        else:
            qg = qg.view(rows, q_len, kvh, g, hd).permute(0, 2, 3, 1, 4).reshape(rows, kvh, g * q_len, hd)
        if group.slot_index is None:
            keys = k_cache[group.slot_start : group.slot_start + rows, :, : group.kv_len]
            values = v_cache[group.slot_start : group.slot_start + rows, :, : group.kv_len]
        else:
            keys = k_cache[group.slot_index, :, : group.kv_len]
            values = v_cache[group.slot_index, :, : group.kv_len]
        if mask.dtype != torch.bool:
            # Decode (one query per sequence): plain matmul-softmax-matmul with an additive mask beats the
            # flash kernel here, whose tiling overhead dominates at 1–3 query rows per head.
            # One baddbmm scales the products and adds the mask; the cache's [rows, kvh] dims merge into
            # one batch dim without a copy (a slot's heads are adjacent in the cache).
            batch = rows * kvh
            keys, values = keys.reshape(batch, -1, hd), values.reshape(batch, -1, hd)
            scores = torch.baddbmm(mask, qg.reshape(batch, g, hd), keys.transpose(1, 2), alpha=hd**-0.5)
            o = torch.bmm(scores.softmax(-1), values)  # [rows * kvh, g, hd]
            return o.view(rows, kvh * g * hd)
        o = sdpa(qg, keys, values, attn_mask=mask)  # [rows, kvh, g*q_len, hd]
        if q_len == 1:
            return o.reshape(rows, kvh * g * hd)
        return o.view(rows, kvh, g, q_len, hd).permute(0, 3, 1, 2, 4).reshape(rows * q_len, kvh * g * hd)

    def forward_train(self, h: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Causal self-attention over h [B, T, hidden] without a cache."""
        batch, seq = h.shape[:2]
        q, k, v = self._qkv(h, cos, sin)  # [B, T, heads, hd], [B, T, kv_heads, hd] ×2
        q = q.transpose(1, 2)
        k = k.transpose(1, 2).repeat_interleave(self.groups, dim=1)
        v = v.transpose(1, 2).repeat_interleave(self.groups, dim=1)
        o = sdpa(q, k, v, is_causal=True)  # [B, heads, T, hd]
        return self.o_proj(o.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up(x)
        # split, not two slices: a slice's backward zero-fills a full-size gradient (1.5 s of a 30 s step).
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down(F.silu(gate) * up)

    def forward_cached(self, x: Tensor) -> Tensor:
        """`forward` for the rollout path: the projections' `.forward` directly (see `Transformer.forward`)."""
        gate, up = self.gate_up.forward(x).split(self.intermediate, dim=-1)
        return self.down.forward(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.post_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        # Activation checkpointing: keep the layer's input only, recompute the rest in backward.
        self.checkpointing = False

    def forward_train(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """The layer over x [B, T, hidden] without a cache (the learner's path). A method of the layer, so
        a sharded learner registers it with FSDP (`register_fsdp_forward_method`: the layer's weights are
        gathered around it); checkpointing runs inside it, so the gather also wraps the recompute."""
        if self.checkpointing and torch.is_grad_enabled():
            return checkpoint(self._train_body, x, cos, sin, use_reentrant=False)
        return self._train_body(x, cos, sin)

    def _train_body(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn.forward_train(self.input_norm(x), cos, sin)
        return x + self.mlp(self.post_norm(x))


class Transformer(nn.Module):
    """Llama/Qwen2 decoder with a fused-projection layout; see the module docstring."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Built on the meta device (load_model, load_head_parts: the weights come from a checkpoint) it is
        # not initialised: nn.Embedding's random init runs there as a Python decomposition that imports
        # torch._dynamo, ~1.5 s of every actor's start-up.
        weight = torch.empty(config.vocab_size, config.hidden_size) if torch.empty(0).is_meta else None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, False)
        )
        self.rotary = Rotary(config)
        self._tied_head_pack: _PackedWeight | None = _PackedWeight()

    @property
    def lm_head_weight(self) -> Tensor:
        """[vocab, hidden] output projection (the embedding matrix when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def keep_packed_only(self) -> int:
        """Inference only: the decoder layers' projections keep just their packed copies (`packed_gemm`).

        Each plain weight becomes a meta placeholder (its shape and dtype, no storage), so a rollout holds
        the projections once instead of twice; anything that reads one, such as a training forward, fails
        loudly. The embedding (also the tied LM head) and an untied LM head stay plain: lookups and the
        draft vocabulary read their rows. Write new values with `write_parameter`, read them back with
        `named_weights`. Returns the bytes freed: 0 where no packed kernel runs these weights (CUDA, a
        dtype the probes refused).
        """
        freed = 0
        for layer in self.layers:
            for module in layer.modules():
                if not isinstance(module, Linear) or module.weight.is_meta:
                    continue
                weight = module.weight
                gemm = packed_gemm(weight.device, weight.dtype, weight.shape[0])
                if gemm is None:
                    return freed
                module._pack.put(weight, gemm, only_copy=True)
                freed += weight.numel() * weight.element_size()
                module.weight = nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)
        return freed

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(name, value) of every parameter, as `named_parameters` but packed-only ones unpacked (an exact
        copy, `_PackedWeight.unpack`), so checks and tests read what decoding uses."""
        for name, _ in self.named_parameters():
            yield name, self.weight(name)

    def weight(self, name: str) -> Tensor:
        """Parameter `name`'s value as decoding uses it: a packed-only projection unpacked (exact), any other
        the parameter itself, detached. AttributeError naming it if there is no such parameter."""
        param = self.get_parameter(name)  # AttributeError for an unknown name
        if not param.is_meta:
            return param.detach()
        module = self.get_submodule(name.rpartition(".")[0])
        assert isinstance(module, Linear) and module._pack.packed is not None
        return module._pack.unpack()

    def write_parameter(self, name: str, value: Tensor) -> None:
        """Copy `value` into parameter `name`; a packed-only projection is repacked straight from it."""
        module_name, _, attr = name.rpartition(".")
        module = self.get_submodule(module_name)
        param = getattr(module, attr)
        if tuple(value.shape) != tuple(param.shape) or value.dtype != param.dtype:
            raise ValueError(
                f"{name}: got {tuple(value.shape)} {value.dtype}, expected {tuple(param.shape)} {param.dtype}"
            )
        if param.is_meta:
            assert isinstance(module, Linear) and attr == "weight" and module._pack.gemm is not None
            module._pack.put(value, module._pack.gemm, only_copy=True)
            return
        with torch.no_grad():
            param.copy_(value)  # bumps the tensor version: a prepacked copy repacks on next use

    def head(self, hidden: Tensor) -> Tensor:
        """Logits [..., vocab] from last-layer hidden states [..., hidden] (final norm, then LM head)."""
        normed = self.final_norm(hidden)
        if self.lm_head is None:
            return _linear(normed, self.embed_tokens.weight, None, self._tied_head_pack)
        return self.lm_head(normed)

    @torch.inference_mode()
    def forward(
        self, input_ids: Tensor, positions: Tensor, layout: BatchLayout, cache: KVCache
    ) -> tuple[Tensor, Tensor]:
        """Append flat tokens to the cache and score them.

        input_ids, positions: [num_tokens] int64, ordered as `layout.cu_seqlens`. Returns
        (logits [layout.num_logits, vocab] for `layout.logit_rows`, hidden [num_tokens, hidden] = the last
        decoder layer's output before the final norm). Runs under inference_mode: this path only serves
        rollout and writes the cache in place.
        """
        if input_ids.shape != (layout.num_tokens,) or positions.shape != (layout.num_tokens,):
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must be "
                f"[{layout.num_tokens}] as the layout says"
            )
        if cache.dtype != self.embed_tokens.weight.dtype:
            raise ValueError(
                f"KV cache dtype {cache.dtype} differs from the model's {self.embed_tokens.weight.dtype}"
            )
        cos_table, sin_table = self.rotary.tables(cache.max_len, input_ids.device, cache.dtype)
        cos, sin = cos_table[positions][:, None], sin_table[positions][:, None]  # [N, 1, hd]
        config = self.config
        masks = [
            _fold_mask(group.mask, config.queries_per_kv, config.num_key_value_heads, cache.dtype)
            for group in layout.groups
        ]
        x = self.embed_tokens(input_ids)  # [N, hidden]
        # `.forward` directly, not `module(...)`: this loop makes ~7 module calls a layer, and nn.Module's
        # call machinery (hook checks) cost ~1 ms of a SmolLM2 decode step on a CPU. Module hooks therefore
        # do not fire on the rollout path; nothing of ours registers any (the learner's path keeps them).
        for layer, k_cache, v_cache in zip(self.layers, cache.keys, cache.values, strict=True):
            attn = layer.attn
            x += attn.forward_cached(layer.input_norm.forward(x), cos, sin, layout, k_cache, v_cache, masks)
            x += layer.mlp.forward_cached(layer.post_norm.forward(x))
        for slot, start, n in zip(layout.slots, layout.starts, layout.num_new, strict=True):
            cache.set_length(slot, start + n)
        if layout.num_logits == 0:  # e.g. a pass of mid-prompt prefill chunks only
            return x.new_empty(0, self.config.vocab_size), x
        selected = x if layout.logit_rows is None else x.index_select(0, layout.logit_rows)
        return self.head(selected), x

    def forward_train(
        self, input_ids: Tensor, positions: Tensor | None = None, *, rows: Tensor | None = None
    ) -> Tensor:
        """Causal forward over input_ids [B, T] without a cache; returns logits [B, T, vocab].

        positions: [T] or [B, T] (default 0..T-1). rows: [N] indices into the flattened [B * T] positions;
        given, only those rows go through the LM head and the result is [N, vocab] (the learner needs
        logits at response positions only: the head is ~a fifth of a small model's forward, and its
        backward over prompt rows would be pure waste). Differentiable; used by the learner for log-probs.
        """
        hidden = self.hidden_train(input_ids, positions, rows=rows)
        if rows is None:
            hidden = hidden.view(*input_ids.shape, -1)
        return self.head(hidden)

    def hidden_train(
        self, input_ids: Tensor, positions: Tensor | None = None, *, rows: Tensor | None = None
    ) -> Tensor:
        """`forward_train` up to the last layer's output (before the final norm) at `rows`: the learner runs
        the head on chunks of these rows (`head`), so [tokens, vocab] logits never exist whole."""
        seq = input_ids.shape[1]
        if positions is None:
            positions, length = torch.arange(seq, device=input_ids.device), seq
        else:
            length = int(positions.max()) + 1
        cos_table, sin_table = self.rotary.tables(length, input_ids.device, self.embed_tokens.weight.dtype)
        cos, sin = cos_table[positions].unsqueeze(-2), sin_table[positions].unsqueeze(-2)  # [.., T, 1, hd]
        x = self.embed_tokens(input_ids)  # [B, T, hidden]
        for layer in self.layers:
            x = layer.forward_train(x, cos, sin)
        x = x.reshape(-1, x.shape[-1])
        return x if rows is None else x.index_select(0, rows)

    def forward_scored(
        self,
        input_ids: Tensor,
        rows: Tensor,
        score: Callable[[Tensor, int, int], Tensor],
        *,
        chunk: int = 0,
    ) -> Tensor:
        """`score(logits, start, end)` -> [end - start] over the logits at `rows` [N], `chunk` rows at a time
        (0: all at once), concatenated: [N]. With gradients on, each chunk's logits are recomputed in
        backward (checkpointed), so at most one chunk's [chunk, vocab] logits and their gradient exist: an
        8k-token sample's fp32 logits (1.6 GB at SmolLM2's vocabulary) never do. Row-wise, so the values do
        not depend on `chunk`. A method of the root, registered with FSDP on a sharded learner."""
        hidden = self.hidden_train(input_ids, rows=rows)
        total = hidden.shape[0]
        if chunk <= 0 or total <= chunk:
            return score(self.head(hidden), 0, total)
        parts = []
        for start in range(0, total, chunk):
            end = min(total, start + chunk)
            part = functools.partial(self._score_chunk, score, start, end)
            if torch.is_grad_enabled():
                parts.append(checkpoint(part, hidden[start:end], use_reentrant=False))
            else:
                parts.append(part(hidden[start:end]))
        return torch.cat(parts)

    def _score_chunk(
        self, score: Callable[[Tensor, int, int], Tensor], start: int, end: int, hidden: Tensor
    ) -> Tensor:
        return score(self.head(hidden), start, end)

    def train_only(self) -> None:
        """For a sharded learner: projections always F.linear, never a packed copy (see `_linear`)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.packable = False
        self._tied_head_pack = None


def _fold_mask(mask: Tensor, groups: int, kv_heads: int, dtype: torch.dtype) -> Tensor:
    """[rows, 1, q_len, kv] → [rows, 1, groups*q_len, kv] matching the GQA-folded queries.

    Single-query groups in fp32/fp64 get an additive float mask instead (0 or -inf), laid out
    [rows * kv_heads, 1, kv] for the batched products of the matmul attention path (one copy per pass,
    shared by every layer); lower precisions keep SDPA, whose softmax accumulates in fp32.
    """
    rows, _, q_len, kv_len = mask.shape
    if q_len == 1:
        if dtype in (torch.float32, torch.float64):
            additive = torch.zeros((rows, kv_heads, 1, kv_len), dtype=dtype, device=mask.device)
            return additive.masked_fill_(~mask, float("-inf")).view(rows * kv_heads, 1, kv_len)
        return mask  # broadcasts over the folded axis
    return mask.unsqueeze(2).expand(rows, 1, groups, q_len, kv_len).reshape(rows, 1, groups * q_len, kv_len)
