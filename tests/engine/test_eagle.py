"""EAGLE head and drafter: shapes and frozen shared parts, packed forward, the drafter's cache against a
teacher-forced reference (chains and trees), request bookkeeping, hot swap, export → load round trips, the
exported layout run by an independent (transformers) implementation, the target's head parts loaded alone,
drafting on the target's device, and lossless use in the Generator.

Float64 targets make the reference comparisons exact up to rounding.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from slipstream.engine.config import ModelConfig
from slipstream.engine.draft_vocab import draft_logits
from slipstream.engine.drafters.base import DraftState
from slipstream.engine.drafters.eagle import EagleDrafter
from slipstream.engine.drafters.ngram import NGramDrafter
from slipstream.engine.eagle import EagleHead, head_config, target_features
from slipstream.engine.eagle_export import export, load
from slipstream.engine.generator import Completion, Generator, Request
from slipstream.engine.model import Transformer
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.speculator import SpecConfig
from slipstream.engine.tree import path_to
from slipstream.engine.weights import HEAD_PARTS, load_head_parts, load_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
HEAD_PARAMS = {
    "fc.weight",
    "layer.attn.qkv.weight",
    "layer.attn.o_proj.weight",
    "layer.post_norm.weight",
    "layer.mlp.gate_up.weight",
    "layer.mlp.down.weight",
}


@pytest.fixture(scope="module")
def target(make_checkpoint: Callable[..., Path]) -> Transformer:
    return load_model(make_checkpoint("llama", seed=3), dtype=torch.float64)


@pytest.fixture(scope="module")
def completions(target: Transformer) -> list[Completion]:
    gen = torch.Generator().manual_seed(0)
    requests = [
        Request(
            request_id=f"r{i}",
            prompt_ids=torch.randint(0, 160, (5 + i,), generator=gen).tolist(),
            params=GREEDY,
        )
        for i in range(3)
    ]
    return Generator(target, num_slots=4, max_len=128, token_budget=64, return_hidden=True).generate(requests)


def make_head(target: Transformer, seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    return EagleHead.for_target(target.config).to(torch.float64)


def state(c: Completion, j: int, hidden: Tensor | None, rid: str | None = None) -> DraftState:
    """The request after response token j was committed (it is the pending token)."""
    return DraftState(
        request_id=rid or c.request_id,
        group_id=0,
        tokens=[*c.prompt_ids, *c.token_ids[: j + 1]],
        prompt_len=len(c.prompt_ids),
        params=GREEDY,
        hidden=hidden,
    )


@torch.no_grad()
def reference_outputs(
    head: EagleHead, target: Transformer, c: Completion, j: int, path: Sequence[int]
) -> Tensor:
    """Head outputs [j + 1 + len(path), d] by the packed causal forward: the committed pairs of the window
    (last prompt token … response token j) with true features, then draft pairs chaining the head's own
    outputs through the tokens `path` — exactly what drafting along that path must compute."""
    tokens = torch.tensor([c.prompt_ids[-1], *c.token_ids[: j + 1]])
    features = target_features(target, c.hidden[: j + 1])
    embed = target.embed_tokens
    outs = head(embed(tokens[1:]), features, torch.arange(j + 1), [0, j + 1])
    for token in path:
        tokens = torch.cat([tokens, torch.tensor([token])])
        features = torch.cat([features, outs[-1:]])
        outs = head(embed(tokens[1:]), features, torch.arange(len(features)), [0, len(features)])
    return outs


# -------------------------------------------------------------------------------------------------------
# The head


def test_head_holds_only_its_own_weights(target: Transformer) -> None:
    head = make_head(target)
    params = dict(head.named_parameters())
    assert set(params) == HEAD_PARAMS and set(head.state_dict()) == HEAD_PARAMS
    d = target.config.hidden_size
    assert params["fc.weight"].shape == (d, 2 * d)
    assert isinstance(head.layer.input_norm, nn.Identity)
    # ~1/L of the target: one layer (+ fc), none of the embedding / LM head.
    target_layer = sum(p.numel() for p in target.layers[0].parameters())
    assert sum(p.numel() for p in head.parameters()) < target_layer + 2 * d * d + d
    shared = {id(p) for p in target.parameters()}
    assert not shared & {id(p) for p in head.parameters()}
    qwen = ModelConfig(
        model_type="qwen2",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        qkv_bias=True,
    )
    plain = head_config(qwen)
    assert (plain.model_type, plain.num_hidden_layers, plain.qkv_bias) == ("llama", 1, False)
    with pytest.raises(ValueError, match="one layer"):
        EagleHead(qwen)


def test_packed_forward_equals_per_sequence(target: Transformer) -> None:
    head = make_head(target)
    torch.manual_seed(1)
    lengths = [5, 1, 9]
    d = target.config.hidden_size
    embeds, features = (
        torch.randn(sum(lengths), d, dtype=torch.float64),
        torch.randn(sum(lengths), d, dtype=torch.float64),
    )
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu = [0, 5, 6, 15]
    with torch.no_grad():
        packed = head(embeds, features, positions, cu)
        alone = [
            head(embeds[a:b], features[a:b], torch.arange(b - a), [0, b - a])
            for a, b in itertools.pairwise(cu)
        ]
    assert packed.shape == (15, d)
    torch.testing.assert_close(packed, torch.cat(alone), rtol=0, atol=1e-12)
    # Causal: a row never depends on later rows.
    with torch.no_grad():
        prefix = head(embeds[:3], features[:3], torch.arange(3), [0, 3])
    torch.testing.assert_close(prefix, packed[:3], rtol=0, atol=1e-12)


# -------------------------------------------------------------------------------------------------------
# The drafter against the reference


def test_chain_drafts_follow_the_reference(target: Transformer, completions: list[Completion]) -> None:
    head = make_head(target)
    drafter = EagleDrafter(head, target, num_slots=2, max_len=64)
    c = completions[1]
    for j in range(12):
        # The Generator's protocol: observe each commit with its states, then propose with none new.
        drafter.observe(state(c, j, c.hidden[j : j + 1]))
        chain = drafter.propose([state(c, j, c.hidden[:0])], depth=4, topk=1, verify=4)[0]
        expected: list[int] = []
        for _ in range(4):
            outs = reference_outputs(head, target, c, j, expected)
            expected.append(int(draft_logits(target, outs[-1]).argmax()))
        assert chain.is_chain and chain.tokens.tolist() == expected
        assert chain.draft_probs is None


def test_states_in_one_chunk_equal_states_one_by_one(
    target: Transformer, completions: list[Completion]
) -> None:
    head = make_head(target)
    c = completions[2]
    stepwise = EagleDrafter(head, target, num_slots=2, max_len=64)
    chunked = EagleDrafter(head, target, num_slots=2, max_len=64)
    for j in range(10):
        a = stepwise.propose([state(c, j, c.hidden[j : j + 1])], 3, 1, 3)[0]
        if j in (3, 9):  # committed tokens arrive in runs, as after accepted drafts
            b = chunked.propose([state(c, j, c.hidden[: j + 1] if j == 3 else c.hidden[4:10])], 3, 1, 3)[0]
            assert a.tokens.tolist() == b.tokens.tolist()


def test_a_long_catch_up_drafts_as_one_kept_current(target: Transformer) -> None:
    """A request that drafted nothing for a while (the tuner ran plain decoding) catches up on more pairs
    than one pass takes (passes of EXTEND_PAIRS; the attention's tree bits hold 63): its draft equals the
    one a drafter kept current commit by commit drafts."""
    prompt = list(range(30, 40))
    params = SamplingParams(temperature=0.0, max_tokens=90)
    gen = Generator(target, num_slots=1, max_len=128, eos_token_ids=(), return_hidden=True)
    c = gen.generate([Request(request_id="long", prompt_ids=prompt, params=params)])[0]
    head = make_head(target)
    current = EagleDrafter(head, target, num_slots=1, max_len=128)
    for j in range(80):  # a draft after every commit: its cache never falls behind
        ahead = current.propose([state(c, j, c.hidden[j : j + 1])], 4, 1, 4)[0]
    late = EagleDrafter(head, target, num_slots=1, max_len=128)
    late.observe(state(c, 79, c.hidden[:80]))
    caught_up = late.propose([state(c, 79, c.hidden[:0])], 4, 1, 4)[0]
    assert len(ahead) == 4 and caught_up.tokens.tolist() == ahead.tokens.tolist()


def test_tree_nodes_are_top_k_of_their_path(target: Transformer, completions: list[Completion]) -> None:
    head = make_head(target)
    drafter = EagleDrafter(head, target, num_slots=2, max_len=64)
    c = completions[0]
    j, depth, topk, verify = 6, 3, 3, 8
    tree = drafter.propose([state(c, j, c.hidden[: j + 1])], depth, topk, verify)[0]
    assert 0 < len(tree) <= verify and not tree.is_chain and tree.draft_probs is None
    assert all(-1 <= p < i for i, p in enumerate(tree.parents.tolist()))
    tokens = tree.tokens.tolist()
    for node in range(len(tree)):
        path = path_to(tree.parents, node)
        assert len(path) <= depth
        # Siblings are invisible to each other: a node's token is a top-k child of its own path only.
        outs = reference_outputs(head, target, c, j, [tokens[n] for n in path[:-1]])
        top = draft_logits(target, outs[-1]).topk(topk).indices.tolist()
        assert tokens[node] in top
    # The same request drafted as a chain starts with the best root child.
    chain = drafter.propose([state(c, j, c.hidden[:0])], depth, 1, depth)[0]
    assert chain.tokens[0] == tree.tokens[0]


def test_batched_requests_draft_as_alone(target: Transformer, completions: list[Completion]) -> None:
    head = make_head(target)
    together = EagleDrafter(head, target, num_slots=4, max_len=64)
    js = [3, 8, 5]
    batch = together.propose(
        [state(c, j, c.hidden[: j + 1]) for c, j in zip(completions, js, strict=True)], 4, 1, 4
    )
    for c, j, draft in zip(completions, js, batch, strict=True):
        alone = EagleDrafter(head, target, num_slots=1, max_len=64).propose(
            [state(c, j, c.hidden[: j + 1])], 4, 1, 4
        )
        assert draft.tokens.tolist() == alone[0].tokens.tolist()


def test_bookkeeping(target: Transformer, completions: list[Completion]) -> None:
    head = make_head(target)
    drafter = EagleDrafter(head, target, num_slots=1, max_len=64)
    c, other = completions[0], completions[1]
    # No states: an empty draft, never a guess.
    assert len(drafter.propose([state(c, 0, None)], 3, 1, 3)[0]) == 0
    assert len(drafter.propose([state(c, 2, c.hidden[:3])], 3, 1, 3)[0]) == 3
    # Tokens committed without their states: no draft from a stale cache.
    assert len(drafter.propose([state(c, 4, c.hidden[:0])], 3, 1, 3)[0]) == 0
    # The only slot is taken: the other request gets nothing until the first is reset.
    assert len(drafter.propose([state(other, 2, other.hidden[:3])], 3, 1, 3)[0]) == 0
    drafter.reset(c.request_id)
    drafter.reset(other.request_id)
    assert drafter.cache.num_free_slots == 1
    assert len(drafter.propose([state(other, 2, other.hidden[:3])], 3, 1, 3)[0]) == 3
    # A gap in the states restarts the window after it: drafts resume at once.
    assert len(drafter.propose([state(other, 9, other.hidden[7:10])], 3, 1, 3)[0]) == 3
    # Too little room for the draft in the cache: empty instead of an overflow.
    small = EagleDrafter(head, target, num_slots=1, max_len=6)
    assert len(small.propose([state(c, 4, c.hidden[:5])], 3, 1, 3)[0]) == 0
    with pytest.raises(ValueError, match="hidden must be"):
        drafter.propose([state(c, 1, c.hidden[:2, :10])], 3, 1, 3)


def test_load_state_hot_swaps_weights(target: Transformer, completions: list[Completion]) -> None:
    head = make_head(target, seed=0)
    drafter = EagleDrafter(head, target, num_slots=2, max_len=64)
    c = completions[2]
    before = drafter.propose([state(c, 8, c.hidden[:9])], 5, 1, 5)[0].tokens.tolist()
    new = make_head(target, seed=1)
    drafter.load_state(new.state_dict(), version=1)
    assert drafter.version == 1
    # Mid-request: the cache is rebuilt from the kept features, so it drafts as a fresh drafter would.
    after = drafter.propose([state(c, 10, c.hidden[9:11])], 5, 1, 5)[0].tokens.tolist()
    fresh = EagleDrafter(new, target, num_slots=1, max_len=64).propose(
        [state(c, 10, c.hidden[:11])], 5, 1, 5
    )[0]
    assert after == fresh.tokens.tolist()
    again = EagleDrafter(head, target, num_slots=1, max_len=64)
    assert before != again.propose([state(c, 8, c.hidden[:9])], 5, 1, 5)[0].tokens.tolist()
    # rebuild=False keeps the cached pairs: only the pairs committed after the swap run the new weights.
    kept = EagleDrafter(make_head(target, seed=0), target, num_slots=1, max_len=64)
    kept.propose([state(c, 8, c.hidden[:9])], 5, 1, 5)
    cached = kept._requests[c.request_id].cached
    kept.load_state(new.state_dict(), version=1, rebuild=False)
    assert kept._requests[c.request_id].cached == cached
    assert len(kept.propose([state(c, 10, c.hidden[9:11])], 5, 1, 5)[0]) == 5
    assert kept._requests[c.request_id].cached == cached + 2
    with pytest.raises(ValueError, match="not newer"):
        drafter.load_state(new.state_dict(), version=1)
    with pytest.raises(ValueError, match="missing"):
        drafter.load_state({"fc.weight": new.fc.weight}, version=2)


# -------------------------------------------------------------------------------------------------------
# Export


@pytest.mark.parametrize("server", ["vllm", "sglang"])
def test_export_round_trip(
    target: Transformer, completions: list[Completion], tmp_path: Path, server: str
) -> None:
    head = make_head(target, seed=4)
    out = export(head, target.config, tmp_path / server, server=server, version=7)  # type: ignore[arg-type]
    tensors = load_file(str(out / "model.safetensors"))
    names = {
        "fc.weight",
        *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
        "layers.0.post_attention_layernorm.weight",
        *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    }
    assert set(tensors) == (names | {"fc.bias"} if server == "sglang" else names)
    cfg = target.config
    hd, d = cfg.head_dim, cfg.hidden_size
    assert tensors["layers.0.self_attn.k_proj.weight"].shape == (cfg.num_key_value_heads * hd, d)
    assert tensors["layers.0.mlp.up_proj.weight"].shape == (cfg.intermediate_size, d)
    qkv = torch.cat([tensors[f"layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv, head.layer.attn.qkv.weight.detach())
    config = json.loads((out / "config.json").read_text())
    arch = {"vllm": ["LlamaForCausalLM"], "sglang": ["LlamaForCausalLMEagle"]}[server]
    expected = {
        "architectures": arch,
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": d,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": hd,
        "hidden_act": "silu",
        "vocab_size": cfg.vocab_size,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "attention_bias": False,
        "mlp_bias": False,
        "bias": server == "sglang",
        "torch_dtype": "float64",
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }
    assert {k: config[k] for k in expected} == expected
    assert config["slipstream"]["drafter_version"] == 7

    loaded = load(out, target, num_slots=2, max_len=64)
    original = EagleDrafter(head, target, num_slots=2, max_len=64)
    assert loaded.version == 7
    for topk, verify in ((1, 4), (2, 6)):
        for c in completions:
            j = len(c.token_ids) // 2
            states = [state(c, j, c.hidden[: j + 1], rid=f"{c.request_id}-{topk}")]
            a, b = original.propose(states, 4, topk, verify)[0], loaded.propose(states, 4, topk, verify)[0]
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


def test_exported_head_runs_in_an_independent_llama_layer(target: Transformer, tmp_path: Path) -> None:
    """vLLM's EagleLlamaForCausalLM, restated with transformers' LlamaDecoderLayer on the exported files:
    fc(cat(embed, feature)) → layer without input norm → LM head. It must equal our head."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    head = make_head(target, seed=5)
    out = export(head, target.config, tmp_path / "hf")
    tensors = load_file(str(out / "model.safetensors"))
    config = LlamaConfig.from_pretrained(out)
    config._attn_implementation = "eager"
    assert config.num_hidden_layers == 1 and config.architectures == ["LlamaForCausalLM"]
    layer = LlamaDecoderLayer(config, layer_idx=0).to(torch.float64)
    layer.input_layernorm = nn.Identity()
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in tensors.items() if k != "fc.weight"})
    torch.manual_seed(2)
    length, d = 7, target.config.hidden_size
    tokens = torch.randint(0, target.config.vocab_size, (length,))
    features = target_features(target, torch.randn(length, d, dtype=torch.float64)).detach()
    with torch.no_grad():
        embeds = target.embed_tokens(tokens)
        x = (torch.cat([embeds, features], -1) @ tensors["fc.weight"].T)[None]
        positions = torch.arange(length)[None]
        causal = torch.full((length, length), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        result = layer(
            x,
            attention_mask=causal,
            position_ids=positions,
            position_embeddings=LlamaRotaryEmbedding(config)(x, positions),
        )
        hf = (result[0] if isinstance(result, tuple) else result)[0]
        ours = head(embeds, features, torch.arange(length), [0, length])
    # transformers' RMSNorm and RoPE run in float32 even for float64 inputs; a wrong mapping is off by O(1).
    torch.testing.assert_close(hf, ours, rtol=1e-6, atol=1e-6)


def test_exported_token_counts_prime_the_draft_vocabulary(target: Transformer, tmp_path: Path) -> None:
    counts = {5: 40, 17: 3, 9: 40, 100: 1}
    out = export(make_head(target), target.config, tmp_path / "head", token_counts=counts)
    assert json.loads((out / "token_counts.json").read_text()) == {
        "ids": [5, 9, 17, 100],
        "counts": [40, 40, 3, 1],
    }
    drafter = load(out, target, num_slots=2, max_len=64, draft_vocab=3)
    assert [drafter.vocab.counts[t] for t in (5, 9, 17, 100, 6)] == [40, 40, 3, 1, 0]
    # Before observing anything, the draft vocabulary is the three most frequent training tokens.
    _, ids = drafter.vocab.logits(
        torch.zeros(1, target.config.hidden_size, dtype=target.lm_head_weight.dtype)
    )
    assert ids is not None and ids.tolist() == [5, 9, 17]
    (out / "token_counts.json").write_text('{"ids": [1, 2], "counts": [3]}')
    with pytest.raises(ValueError, match=r"token_counts\.json"):
        load(out, target)
    (out / "token_counts.json").write_text(json.dumps({"ids": [10**9], "counts": [1]}))
    with pytest.raises(ValueError, match="out of range"):
        load(out, target)


def test_load_is_strict(target: Transformer, tmp_path: Path) -> None:
    out = export(make_head(target), target.config, tmp_path / "strict", server="sglang")
    tensors = load_file(str(out / "model.safetensors"))
    save_file({**tensors, "fc.bias": torch.ones_like(tensors["fc.bias"])}, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="non-zero"):
        load(out, target)
    save_file(
        {**tensors, "layers.0.input_layernorm.weight": torch.ones_like(tensors["fc.bias"])},
        str(out / "model.safetensors"),
    )
    with pytest.raises(ValueError, match="unknown tensors"):
        load(out, target)


# -------------------------------------------------------------------------------------------------------
# The target's parts, and the device


@pytest.mark.parametrize("tied", [False, True])
def test_head_parts_are_the_targets_without_reading_its_layers(
    make_checkpoint: Callable[..., Path], device: torch.device, tied: bool
) -> None:
    path = make_checkpoint("llama", tie_word_embeddings=tied)
    full = load_model(path)
    # Without the layers' tensors in the file it still loads: it never reads them.
    tensors = load_file(str(path / "model.safetensors"))
    save_file(
        {k: v for k, v in tensors.items() if not k.startswith("model.layers.")},
        str(path / "model.safetensors"),
    )
    with pytest.raises(ValueError, match="missing tensor"):
        load_model(path)
    parts = load_head_parts(path, device=device)
    names = {name for name, _ in parts.named_parameters()}
    assert names == set(HEAD_PARTS) - ({"lm_head.weight"} if tied else set())
    assert len(parts.layers) == 0 and parts.config == full.config
    for name, param in parts.named_parameters():
        assert param.device == device and torch.equal(param.cpu(), full.get_parameter(name)), name
    with pytest.raises(RuntimeError, match="no decoder layers"):
        parts.forward_train(torch.zeros(1, 2, dtype=torch.int64))


def test_drafter_drafts_on_the_targets_device(
    make_checkpoint: Callable[..., Path], completions: list[Completion], device: torch.device, tmp_path: Path
) -> None:
    """An exported head loaded for a target on `device` drafts there (keyed chains and trees over a draft
    vocabulary) what it drafts on the host, from states the generator hands over on the host."""
    host = load_model(make_checkpoint("llama", seed=3), dtype=torch.float64)
    out = export(make_head(host), host.config, tmp_path / "head")
    on_device = load_model(make_checkpoint("llama", seed=3), dtype=torch.float64, device=device)
    with pytest.raises(ValueError, match="one device"):
        EagleDrafter(make_head(host).to("meta"), host)
    params = SamplingParams(temperature=0.9, seed=4, max_tokens=24)
    c = completions[2]
    drafts: list[list[list[int]]] = []
    for model in (host, on_device):
        drafter = load(out, model, num_slots=2, max_len=64, draft_vocab=12)
        assert drafter.head.fc.weight.device == model.lm_head_weight.device
        got = []
        for j in range(8):
            tokens = [*c.prompt_ids, *c.token_ids[: j + 1]]
            s = DraftState(
                request_id="r", group_id=0, tokens=tokens, prompt_len=len(c.prompt_ids), params=params,
                hidden=c.hidden[j : j + 1], keyed=True,
            )  # fmt: skip
            drafter.observe(s)
            s = dataclasses.replace(s, hidden=c.hidden[:0])
            for topk in (1, 2):
                got.append(drafter.propose([s], depth=3, topk=topk, verify=4)[0].tokens.tolist())
        assert drafter.vocab.ids is not None and drafter.vocab.ids.device == model.lm_head_weight.device
        drafts.append(got)
    assert all(drafts[0]) and drafts[0] == drafts[1]


# -------------------------------------------------------------------------------------------------------
# In the Generator


@pytest.mark.parametrize(
    "spec", [SpecConfig(method="eagle", depth=4), SpecConfig(method="eagle", depth=3, topk=2, verify=5)]
)
@pytest.mark.parametrize(
    ("dtype", "draft_vocab"),
    # A 12-token draft vocabulary, in float64 and in float32 (the prepacked CPU path of its head rows).
    [(torch.float64, 0), (torch.float64, 12), (torch.float32, 12)],
)
def test_generator_with_eagle_drafter_is_lossless(
    make_checkpoint: Callable[..., Path], spec: SpecConfig, dtype: torch.dtype, draft_vocab: int
) -> None:
    target = load_model(make_checkpoint("llama", seed=3), dtype=dtype)
    gen = torch.Generator().manual_seed(9)
    requests = [
        Request(
            request_id=f"q{i}", prompt_ids=torch.randint(0, 160, (6,), generator=gen).tolist(), params=GREEDY
        )
        for i in range(5)
    ]
    plain = Generator(target, num_slots=3, max_len=96, token_budget=48).generate(requests)
    drafter = EagleDrafter(make_head(target), target, num_slots=3, max_len=96, draft_vocab=draft_vocab)
    speculative = Generator(
        target, num_slots=3, max_len=96, token_budget=48, spec=spec, drafters={"eagle": drafter}
    )
    assert [c.token_ids for c in speculative.generate(requests)] == [c.token_ids for c in plain]
    assert drafter.cache.num_free_slots == 3  # every finished request was reset
    if draft_vocab:
        assert drafter.vocab.ids is not None and drafter.vocab.ids.numel() == draft_vocab


@pytest.mark.parametrize("topk", [1, 2])
def test_keyed_sampled_drafts_are_token_identical_to_plain(
    make_checkpoint: Callable[..., Path], topk: int
) -> None:
    """Reproducible mode at T = 0.9: the drafter draws chains (and ranks tree children) with the sampler's
    own noise, and the output is still exactly plain decoding's."""
    target = load_model(make_checkpoint("llama", seed=3), dtype=torch.float32)
    gen = torch.Generator().manual_seed(9)
    requests = [
        Request(
            request_id=f"q{i}",
            prompt_ids=torch.randint(0, 160, (6,), generator=gen).tolist(),
            params=SamplingParams(temperature=0.9, seed=i, max_tokens=40),
        )
        for i in range(5)
    ]
    plain = Generator(target, num_slots=3, max_len=96, token_budget=48).generate(requests)
    drafter = EagleDrafter(make_head(target), target, num_slots=3, max_len=96, draft_vocab=12)
    spec = SpecConfig(method="eagle", depth=3, topk=topk, verify=3 * topk, mode="reproducible")
    speculative = Generator(
        target, num_slots=3, max_len=96, token_budget=48, spec=spec, drafters={"eagle": drafter}
    )
    assert [c.token_ids for c in speculative.generate(requests)] == [c.token_ids for c in plain]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_hybrid_drafting_is_token_identical_to_plain(
    make_checkpoint: Callable[..., Path], temperature: float
) -> None:
    """Method "hybrid" (n-gram where the group's tables match, else the head), in reproducible mode over GRPO
    groups of 3 siblings: the output is exactly plain decoding's, and both drafters were asked."""
    target = load_model(make_checkpoint("llama", seed=3), dtype=torch.float32)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 160, (6,), generator=gen).tolist() for _ in range(2)]
    requests = [
        Request(
            request_id=f"g{g}s{i}",
            prompt_ids=prompts[g],
            params=SamplingParams(temperature=temperature, seed=10 * g + i, max_tokens=40),
            group_id=f"g{g}",
        )
        for g in range(2)
        for i in range(3)
    ]
    plain = Generator(target, num_slots=4, max_len=96, token_budget=64).generate(requests)
    drafter = EagleDrafter(make_head(target), target, num_slots=4, max_len=96, draft_vocab=12)
    spec = SpecConfig(method="hybrid", depth=3, mode="reproducible")
    hybrid = Generator(
        target, num_slots=4, max_len=96, token_budget=64, spec=spec,
        drafters={"ngram": NGramDrafter(), "eagle": drafter},
    )  # fmt: skip
    drafted = Counter[str]()  # non-empty drafts per drafter

    def counting(name: str, drafter: Any) -> None:
        propose = drafter.propose

        def wrapped(states, depth, topk, verify):  # type: ignore[no-untyped-def]
            drafts = propose(states, depth, topk, verify)
            drafted[name] += sum(len(d) > 0 for d in drafts)
            return drafts

        drafter.propose = wrapped

    counting("ngram", hybrid.speculator.drafters["ngram"])
    counting("eagle", drafter)
    out = hybrid.generate(requests)
    assert [c.token_ids for c in out] == [c.token_ids for c in plain]
    assert drafted["ngram"] > 0 and drafted["eagle"] > 0, drafted


def test_draft_vocabulary_restricts_proposals_to_frequent_observed_tokens(
    target: Transformer, completions: list[Completion]
) -> None:
    """With a draft vocabulary the chain is the argmax over (frequent) observed tokens only."""
    head = make_head(target)
    drafter = EagleDrafter(head, target, num_slots=2, max_len=64, draft_vocab=8)
    c = completions[1]
    counts: Counter[int] = Counter(c.prompt_ids)
    for j in range(12):
        drafter.observe(state(c, j, c.hidden[j : j + 1]))
        counts.update([c.token_ids[j]])
        chain = drafter.propose([state(c, j, c.hidden[:0])], depth=3, topk=1, verify=3)[0]
        assert set(chain.tokens.tolist()) <= set(drafter.vocab.ids.tolist())
        assert drafter.vocab.ids.numel() == min(8, len(counts))
    assert all(counts[t] for t in drafter.vocab.ids.tolist())  # only tokens it has seen


def test_the_feature_ring_wraps_and_a_backlog_past_it_starts_a_fresh_window(
    target: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Features live in a ring of FEATURE_RING positions a slot: drafting after every commit wraps it many
    times and drafts what an unbounded buffer does; a backlog longer than the ring (speculation off for a
    while) restarts the window at the newest states, drafting what a drafter that saw only those does."""
    from slipstream.engine.drafters import eagle as eagle_module

    prompt = list(range(30, 40))
    params = SamplingParams(temperature=0.0, max_tokens=90)
    gen = Generator(target, num_slots=1, max_len=128, eos_token_ids=(), return_hidden=True)
    c = gen.generate([Request(request_id="long", prompt_ids=prompt, params=params)])[0]
    head = make_head(target)
    wide = EagleDrafter(head, target, num_slots=1, max_len=128)
    monkeypatch.setattr(eagle_module, "FEATURE_RING", 16)
    ring = EagleDrafter(head, target, num_slots=1, max_len=128)
    assert ring.ring == 16 and wide.ring == 128
    for j in range(80):
        a = wide.propose([state(c, j, c.hidden[j : j + 1])], 4, 1, 4)[0]
        b = ring.propose([state(c, j, c.hidden[j : j + 1])], 4, 1, 4)[0]
        assert a.tokens.tolist() == b.tokens.tolist()
    late = EagleDrafter(head, target, num_slots=1, max_len=128)
    late.observe(state(c, 79, c.hidden[:80]))  # 80 states at once: more than the ring
    caught_up = late.propose([state(c, 79, c.hidden[:0])], 4, 1, 4)[0]
    newest = EagleDrafter(head, target, num_slots=1, max_len=128)
    newest.observe(state(c, 79, c.hidden[80 - 16 : 80]))  # only the ring's worth (a gap before it)
    fresh = newest.propose([state(c, 79, c.hidden[:0])], 4, 1, 4)[0]
    assert len(caught_up) == 4 and caught_up.tokens.tolist() == fresh.tokens.tolist()
    assert late._requests["long"].start == newest._requests["long"].start > len(prompt)
