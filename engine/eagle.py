"""EAGLE-style draft head: `EagleHead`, the features it reads (`target_features`), packed attention.

The head drafts the target's next token from the target's own last-layer state. At sequence position i
it reads the *pair* (f_i, x_{i+1}) — the target's feature at i and the embedding of the token that
followed — and predicts f_{i+1}, which the target's LM head turns into a distribution over x_{i+2}:

    x   = fc(cat(embed(x_{i+1}), f_i))            2d → d, no bias
    h   = x + o_proj(attn(x))                     one decoder layer of the target's architecture,
    out = h + mlp(post_norm(h))                   its own weights, no input norm
    logits = lm_head(out)                         the target's LM head, shared and frozen

Non-obvious choices (why, and what the servers do: docs/engine.md, "EAGLE head and drafter"):
- Features are the target's states *after* its final norm, f = final_norm(h) (EAGLE-1's convention, what
  vLLM and SGLang feed an exported head); the head's output goes straight into the LM head.
- The layer is a plain Llama layer with the target's widths (no biases even for a Qwen2 target) and no
  input norm: the layout `eagle_export` writes.
The drafter that runs the head in the generator is `drafters/eagle.py`; its training, `drafter_train.py`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from slipstream.engine.config import ModelConfig
from slipstream.engine.device import sdpa
from slipstream.engine.model import DecoderLayer, Linear, Rotary, Transformer

__all__ = ["EagleHead", "attend", "head_config", "target_features", "varlen_attention"]


def head_config(target: ModelConfig) -> ModelConfig:
    """The head's layer config: the target's widths, heads and RoPE as one plain Llama layer (no biases)."""
    return dataclasses.replace(
        target, model_type="llama", num_hidden_layers=1, qkv_bias=False, o_bias=False, mlp_bias=False
    )


def target_features(target: Transformer, hidden: Tensor) -> Tensor:
    """EAGLE features [..., d] from the target's pre-norm last-layer states: its (frozen) final norm."""
    return target.final_norm(hidden)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Attention of queries q [..., n, heads, hd] over keys/values [..., kv_heads, m, hd] → [..., n, heads*hd].

    mask: [n, m] bool (True = may attend), or None for causal attention with n == m. GQA folds the query
    heads that share a KV head into the query axis, as the target's attention does (no K/V repeat).
    """
    *lead, n, heads, hd = q.shape
    kv_heads, m = k.shape[-3], k.shape[-2]
    groups = heads // kv_heads
    if mask is None:
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril()
    folded = (
        q.reshape(*lead, n, kv_heads, groups, hd).movedim(-4, -2).reshape(*lead, kv_heads, groups * n, hd)
    )
    out = sdpa(folded, k, v, attn_mask=mask.repeat(groups, 1))  # [.., kvh, g*n, hd]
    return out.reshape(*lead, kv_heads, groups, n, hd).movedim(-2, -4).reshape(*lead, n, heads * hd)


def varlen_attention(
    q: Tensor,
    keys: Sequence[Tensor],
    values: Sequence[Tensor],
    cu_seqlens: Sequence[int],
    mask_fn: Callable[[int], Tensor],
) -> Tensor:
    """Attention within each packed sequence: q [N, heads, hd] → [N, heads * hd].

    keys/values: one or more blocks, each [N, kv_heads, hd] in q's row layout; a sequence's query i sees
    block b's row j where mask_fn(T)[i, b * T + j] (T the sequence's length). Sequences are bucketed by
    length (within 2×) and padded to the bucket's longest, one attention call per bucket instead of one
    per sequence. Padding is safe for masks where a row sees no key beyond itself (causal ones): a real
    row then never sees a padded key, and padded rows (dropped) always see themselves, so none is empty.
    """
    bounds = [int(b) for b in cu_seqlens]
    spans = sorted(itertools.pairwise(bounds), key=lambda span: span[1] - span[0])
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    while spans:
        shortest = spans[0][1] - spans[0][0]
        bucket = [span for span in spans if span[1] - span[0] <= 2 * shortest]
        spans = spans[len(bucket) :]
        length = bucket[-1][1] - bucket[-1][0]
        starts = torch.tensor([a for a, _ in bucket], device=q.device)[:, None]
        lasts = torch.tensor([b - 1 for _, b in bucket], device=q.device)[:, None]
        index = torch.minimum(starts + torch.arange(length, device=q.device), lasts)  # [G, P], pad = last row
        k = torch.cat([block[index] for block in keys], dim=1).transpose(1, 2)  # [G, kvh, blocks * P, hd]
        v = torch.cat([block[index] for block in values], dim=1).transpose(1, 2)
        o = attend(q[index], k, v, mask_fn(length).to(q.device))  # [G, P, heads * hd]
        real = index == starts + torch.arange(length, device=q.device)
        out[index[real]] = o[real]
    return out


def _causal(length: int) -> Tensor:
    return torch.ones(length, length, dtype=torch.bool).tril()


class EagleHead(nn.Module):
    """fc (2d → d) + one decoder layer without input norm; holds only the drafter's trainable weights.

    The target's embedding, final norm and LM head are used, never owned: they are not in this module's
    parameters or state dict, so checkpoints and weight pushes carry the drafter alone.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.num_hidden_layers != 1:
            raise ValueError(f"an EAGLE head has one layer; config says {config.num_hidden_layers}")
        self.config = config
        d = config.hidden_size
        self.fc = Linear(2 * d, d, bias=False)
        self.layer = DecoderLayer(config)
        # EAGLE-1 layer 0 has no input norm (fc's output is the residual stream); vLLM and SGLang make it
        # an identity too, so the exported layout has no place for a weight here.
        self.layer.input_norm = nn.Identity()
        self.rotary = Rotary(config)

    @classmethod
    def for_target(cls, target: ModelConfig) -> EagleHead:
        return cls(head_config(target))

    def fuse(self, embeds: Tensor, features: Tensor) -> Tensor:
        """Layer input [N, d] from token embeddings [N, d] and features [N, d]."""
        return self.fc(torch.cat((embeds, features), dim=-1))

    def qkv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """RoPE'd q [N, heads, hd], k and v [N, kv_heads, hd] of layer inputs x [N, d] at positions [N]."""
        cos_table, sin_table = self.rotary.tables(int(positions.max()) + 1, x.device, x.dtype)
        cos, sin = cos_table[positions][:, None], sin_table[positions][:, None]
        # The target's own projection + RoPE code, so head and target share the arithmetic exactly.
        return self.layer.attn._qkv(x, cos, sin)

    def finish(self, x: Tensor, attn: Tensor) -> Tensor:
        """Head output [N, d] from layer inputs x [N, d] and attention outputs [N, heads * hd]."""
        h = x + self.layer.attn.o_proj(attn)
        return h + self.layer.mlp(self.layer.post_norm(h))

    def forward(
        self, embeds: Tensor, features: Tensor, positions: Tensor, cu_seqlens: Sequence[int]
    ) -> Tensor:
        """Packed causal forward: several sequences' pairs concatenated without padding → outputs [N, d].

        cu_seqlens: [S + 1] offsets; attention is causal within each sequence and never crosses one.
        The projections run once over all N rows; attention runs per bucket of similar lengths.
        """
        x = self.fuse(embeds, features)
        q, k, v = self.qkv(x, positions)
        attn = varlen_attention(q, [k], [v], cu_seqlens, _causal)
        return self.finish(x, attn)
