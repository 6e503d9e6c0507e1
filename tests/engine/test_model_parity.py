"""The native model against transformers' Llama/Qwen2, and the loader's and config's error handling.

Parity covers the training-style forward, ragged prefill (whole and chunked) and incremental decode
through the KV cache, for GQA/MHA, tied/untied heads, RoPE scaling, biases and sharded checkpoints.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from slipstream.engine.batch import BatchLayout
from slipstream.engine.config import ModelConfig, dtype_from_name, dtype_name
from slipstream.engine.device import packed_gemm, set_packed_gemm
from slipstream.engine.kv_cache import KVCache
from slipstream.engine.model import Linear, Transformer
from slipstream.engine.tree import tree_attention_mask
from slipstream.engine.weights import hf_state_dict, load_model

ATOL = 1e-4

CASES = {
    "llama-gqa-untied": ("llama", {}),
    "llama-mha-tied": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama-linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama3-rope": (
        "llama",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "llama-biases-headdim": (
        "llama",
        {"attention_bias": True, "mlp_bias": True, "head_dim": 24, "num_key_value_heads": 1},
    ),
    "qwen2-bias-tied": ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "qwen2-untied": ("qwen2", {"num_attention_heads": 8, "num_key_value_heads": 2, "rope_theta": 1e6}),
}


@pytest.fixture
def onednn_off() -> Iterator[None]:
    set_packed_gemm(False)
    yield
    set_packed_gemm(True)


def hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits  # [B, T, vocab]


def cached_logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    """Logits for every position of ids [2, T], produced through the cache in a ragged schedule: row 0
    prefilled in one long pass (its own attention call), row 1 in two chunks alongside row 0's decodes,
    then both decode."""
    total = ids.shape[1]
    cache = KVCache.for_model(model.config, num_slots=3, max_len=total + 8)
    cache.allocate()  # slot 0 stays empty: the batch's slots are not at the start of the cache
    slots = [cache.allocate(), cache.allocate()]
    fed = [0, 0]
    out = torch.full((2, total, model.config.vocab_size), float("nan"))
    schedule = [[70, 11], [1, 9]] + [[1, 1]] * total
    for step in schedule:
        live = [i for i in range(2) if fed[i] < total]
        if not live:
            break
        counts = [min(step[i], total - fed[i]) for i in live]
        layout = BatchLayout.build(cache, [slots[i] for i in live], counts, logit_rows=range(sum(counts)))
        flat = torch.cat([ids[i, fed[i] : fed[i] + n] for i, n in zip(live, counts, strict=True)])
        logits, hidden = model(flat, layout.positions, layout, cache)
        assert hidden.shape == (sum(counts), model.config.hidden_size)
        for i, n, start in zip(live, counts, layout.cu_seqlens, strict=False):
            out[i, fed[i] : fed[i] + n] = logits[start : start + n]
            fed[i] += n
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers(make_checkpoint: Callable[..., Path], case: str) -> None:
    arch, overrides = CASES[case]
    path = make_checkpoint(arch, **overrides)
    ids = torch.randint(0, 160, (2, 80), generator=torch.Generator().manual_seed(1))
    reference = hf_logits(path, ids)
    model = load_model(path)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_train(ids), reference, atol=ATOL, rtol=0)
    torch.testing.assert_close(cached_logits(model, ids), reference, atol=ATOL, rtol=0)


def test_sharded_checkpoint(make_checkpoint: Callable[..., Path]) -> None:
    path = make_checkpoint("qwen2", shards=3)
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    ids = torch.randint(0, 160, (2, 80), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(cached_logits(load_model(path), ids), hf_logits(path, ids), atol=ATOL, rtol=0)


def test_plain_linear_path_matches(make_checkpoint: Callable[..., Path], onednn_off: None) -> None:
    path = make_checkpoint("llama", seed=3)
    ids = torch.randint(0, 160, (2, 80), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(cached_logits(load_model(path), ids), hf_logits(path, ids), atol=ATOL, rtol=0)


def test_weight_update_repacks(make_checkpoint: Callable[..., Path]) -> None:
    """An in-place weight update (what a learner push does) is seen by the cached inference path."""
    path = make_checkpoint("llama")
    model = load_model(path)
    ids = torch.randint(0, 160, (2, 80), generator=torch.Generator().manual_seed(4))
    before = cached_logits(model, ids)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.1)
        expected = model.forward_train(ids)
    after = cached_logits(model, ids)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", ["llama-biases-headdim", "qwen2-untied"])
def test_packed_only_projections(
    make_checkpoint: Callable[..., Path], case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rollout's packed-only model decodes exactly as the plain one, before and after a weight update
    written through `write_parameter`, and a training forward (which needs the plain weights) fails. (Both
    take the same packed kernel, so at every row count.)"""
    arch, overrides = CASES[case]
    path = make_checkpoint(arch, seed=5, **overrides)
    plain, packed = load_model(path), load_model(path)
    freed = packed.keep_packed_only()
    projections = [m.weight for layer in plain.layers for m in layer.modules() if isinstance(m, Linear)]
    if packed_gemm(torch.device("cpu"), torch.float32) is None:
        assert freed == 0  # nothing is packed where no packed kernel runs: the plain weights stay
        return
    assert freed == sum(w.numel() * w.element_size() for w in projections)
    ids = torch.randint(0, 160, (2, 40), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(cached_logits(packed, ids), cached_logits(plain, ids), atol=0, rtol=0)
    update = {name: p.detach() * 1.1 for name, p in plain.named_parameters()}
    for name, value in update.items():
        plain.write_parameter(name, value)
        packed.write_parameter(name, value)
    torch.testing.assert_close(cached_logits(packed, ids), cached_logits(plain, ids), atol=0, rtol=0)
    held = dict(packed.named_weights())  # unpacked: exactly the values written
    assert held.keys() == update.keys() and all(torch.equal(held[n], v) for n, v in update.items())
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.qkv\.weight: got"):
        packed.write_parameter("layers.0.attn.qkv.weight", torch.zeros(3))
    with pytest.raises(RuntimeError, match="keeps only its packed weight"):
        packed.forward_train(ids)


def test_hf_state_dict_round_trip(make_checkpoint: Callable[..., Path]) -> None:
    path = make_checkpoint("qwen2")
    exported = hf_state_dict(load_model(path))
    stored = load_file(path / "model.safetensors")
    assert exported.keys() == stored.keys()
    for name, tensor in stored.items():
        assert torch.equal(exported[name], tensor), name


def test_bfloat16_and_head(make_checkpoint: Callable[..., Path]) -> None:
    path = make_checkpoint("llama", tie_word_embeddings=True)
    ids = torch.randint(0, 160, (1, 16), generator=torch.Generator().manual_seed(5))
    reference = hf_logits(path, ids)
    model = load_model(path, dtype=torch.bfloat16)
    assert model.lm_head_weight.dtype == torch.bfloat16
    with torch.no_grad():
        logits = model.forward_train(ids).float()
    assert (logits - reference).abs().max() < 0.25
    # head() is final norm + LM head, applied to hidden states the cached forward returns.
    cache = KVCache.for_model(model.config, num_slots=1, max_len=16, dtype=torch.bfloat16)
    layout = BatchLayout.build(cache, [cache.allocate()], [16])
    last, hidden = model(ids[0], layout.positions, layout, cache)
    with torch.no_grad():
        assert torch.equal(model.head(hidden[-1:]), last)


# Run in a child process: oneDNN reads ONEDNN_MAX_CPU_ISA once, when it first dispatches.
AVX2_BF16_FORWARD = """
import json, sys, torch
from slipstream.engine import device as native
from slipstream.engine.weights import load_model

model = load_model(sys.argv[1], dtype=torch.bfloat16)
ids = torch.randint(0, 160, (1, 16), generator=torch.Generator().manual_seed(5))
try:
    torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2, dtype=torch.bfloat16), None)
    bf16_reorder = "ok"
except RuntimeError as e:
    bf16_reorder = str(e)
with torch.inference_mode():
    logits = model.forward_train(ids)
    probes = {str(d): native.packed_gemm(torch.device("cpu"), d) is not None for d in (torch.float32, torch.bfloat16)}
    native.set_packed_gemm(False)  # every projection through F.linear
    reference = model.forward_train(ids)
print(json.dumps({"bf16_reorder": bf16_reorder, "probes": probes, "equal": torch.equal(logits, reference)}))
"""


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or not torch.backends.mkldnn.is_available(),
    reason="emulates an x86 CPU without AVX-512 through oneDNN",
)
def test_bfloat16_forward_on_an_avx2_only_cpu_falls_back_to_f_linear(
    make_checkpoint: Callable[..., Path],
) -> None:
    """ONEDNN_MAX_CPU_ISA=AVX2 makes oneDNN behave as on a CPU without AVX-512: its packed bf16 linear
    raises. The per-dtype probe keeps float32 on oneDNN and sends bf16 through F.linear."""
    path = make_checkpoint("llama", tie_word_embeddings=True)
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", AVX2_BF16_FORWARD, str(path)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "bf16 path needs the cpu support" in result["bf16_reorder"]  # the emulation took hold
    assert result["probes"] == {"torch.float32": True, "torch.bfloat16": False}
    assert result["equal"]


def test_training_forward_is_differentiable(make_checkpoint: Callable[..., Path]) -> None:
    model = load_model(make_checkpoint("qwen2"))
    ids = torch.randint(0, 160, (2, 8))
    logprobs = model.forward_train(ids).log_softmax(-1)
    logprobs[:, :-1].gather(-1, ids[:, 1:, None]).sum().backward()
    assert model.layers[0].attn.qkv.weight.grad is not None
    assert model.embed_tokens.weight.grad.abs().sum() > 0


def test_ragged_pass_matches_separate_passes(make_checkpoint: Callable[..., Path]) -> None:
    """One pass mixing every attention mode (slot view with dummy rows, slot gather, a long chunk alone,
    tree masks) gives each sequence the logits it gets when run by itself."""
    model = load_model(make_checkpoint("llama", seed=5), dtype=torch.float64)
    rng = torch.Generator().manual_seed(6)
    # (slot, cached prefix length, new tokens, tree parents or None)
    plan = [
        (0, 5, 1, None),
        (2, 9, 1, None),
        (11, 3, 1, None),
        (4, 0, 70, None),
        (7, 12, 3, None),
        (9, 6, 4, [-1, 0, 0, 1]),
    ]
    batch = KVCache.for_model(model.config, num_slots=12, max_len=96, dtype=torch.float64)
    single = KVCache.for_model(model.config, num_slots=1, max_len=96, dtype=torch.float64)
    for _ in range(12):
        batch.allocate()
    single_slot = single.allocate()
    prefixes = {slot: torch.randint(0, 160, (cached,), generator=rng) for slot, cached, _, _ in plan}
    news = {slot: torch.randint(0, 160, (n,), generator=rng) for slot, _, n, _ in plan}
    for slot, cached, _, _ in plan:
        if cached:
            layout = BatchLayout.build(batch, [slot], [cached])
            model(prefixes[slot], layout.positions, layout, batch)
    masks = [None if parents is None else tree_attention_mask(torch.tensor(parents)) for *_, parents in plan]
    layout = BatchLayout.build(
        batch, [p[0] for p in plan], [p[2] for p in plan], tree_masks=masks, logit_rows=range(80)
    )
    # gather (slots 0, 2, 11 are too spread), a long chunk alone, a view of slots 7..9 with a dummy row 8.
    modes = {(g.slot_index is not None, g.rows, g.q_len) for g in layout.groups}
    assert modes == {(True, 3, 1), (False, 1, 70), (False, 3, 4)}
    logits, _ = model(torch.cat([news[p[0]] for p in plan]), layout.positions, layout, batch)
    for (slot, cached, n, _), mask, start in zip(plan, masks, layout.cu_seqlens, strict=False):
        single.rollback(single_slot, 0)
        if cached:
            alone = BatchLayout.build(single, [single_slot], [cached])
            model(prefixes[slot], alone.positions, alone, single)
        alone = BatchLayout.build(single, [single_slot], [n], tree_masks=[mask], logit_rows=range(n))
        expected, _ = model(news[slot], alone.positions, alone, single)
        torch.testing.assert_close(logits[start : start + n], expected, atol=1e-10, rtol=0)


# ---- loader and config errors -------------------------------------------------------------------------


def rewrite(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def test_missing_tensor_is_named(make_checkpoint: Callable[..., Path]) -> None:
    path = make_checkpoint("llama")
    rewrite(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.weight'"):
        load_model(path)


def test_unexpected_tensor_is_named(make_checkpoint: Callable[..., Path]) -> None:
    path = make_checkpoint("llama")
    rewrite(path, lambda t: t.update({"model.layers.0.mystery.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.mystery\.weight'"):
        load_model(path)


def test_shape_mismatch_is_named(make_checkpoint: Callable[..., Path]) -> None:
    path = make_checkpoint("llama")
    rewrite(path, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(3,\), expected \(64,\)"):
        load_model(path)


def test_no_weights_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", **{k: v for k, v in BASE_CONFIG.items() if k != "model_type"}})
    )
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        load_model(tmp_path)


BASE_CONFIG = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "mixtral"}, "model_type 'mixtral' is not supported"),
        ({"hidden_size": None}, "missing field 'hidden_size'"),
        ({"vocab_size": "many"}, "'vocab_size' must be an integer"),
        ({"num_key_value_heads": 3}, "'num_key_value_heads' \\(3\\) must divide"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "'rope_scaling.rope_type' 'yarn'"),
        ({"rope_scaling": {"rope_type": "linear"}}, "'rope_scaling.factor' is required"),
        ({"hidden_act": "gelu"}, "'hidden_act' must be 'silu'"),
        ({"torch_dtype": "int8"}, "'torch_dtype' 'int8'"),
        ({"use_sliding_window": True}, "'use_sliding_window'"),
    ],
)
def test_config_errors_name_the_field(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**BASE_CONFIG, **change})


def test_dtype_names_have_one_lookup() -> None:
    assert dtype_from_name("bfloat16") is torch.bfloat16 and dtype_from_name("float32") is torch.float32
    assert dtype_from_name("torch.float16") is dtype_from_name("half") is torch.float16
    assert dtype_name(torch.bfloat16) == "bfloat16" and dtype_name(torch.float64) == "float64"
    for bad in ("int8", 16, None):
        with pytest.raises(ValueError, match=rf"hidden_dtype {bad!r} is not one of"):
            dtype_from_name(bad, field="hidden_dtype")  # type: ignore[arg-type]


def test_config_reads_both_rope_formats() -> None:
    old = ModelConfig.from_dict(
        {
            **BASE_CONFIG,
            "rope_theta": 5e5,
            "rope_scaling": {"type": "linear", "factor": 4},
            "torch_dtype": "bfloat16",
        }
    )
    new = ModelConfig.from_dict(
        {
            **BASE_CONFIG,
            "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5},
            "dtype": "bfloat16",
        }
    )
    assert old == new
    assert old.rope_scaling is not None and old.rope_scaling.factor == 4.0
    assert old.dtype == torch.bfloat16 and old.head_dim == 8
    qwen = ModelConfig.from_dict({**BASE_CONFIG, "model_type": "qwen2", "eos_token_id": [5, 7]})
    assert qwen.qkv_bias and not qwen.o_bias and qwen.eos_token_ids == (5, 7)


@pytest.mark.parametrize("shape", [(1, 48), (2, 48), (1, 2, 48), (2, 1, 48)])
def test_small_row_padding_returns_the_unpadded_rows(
    shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Inputs of one or two rows are padded to PAD_ROWS on AVX-512 (engine/device.py `onednn_pad_rows`); the
    # caller must get its own rows back, shaped as it passed them, with the values an unpadded call gives.
    from slipstream.engine import device as engine_device

    layer = Linear(48, 40, bias=True)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    if not engine_device._probe_onednn(torch.float32):
        pytest.skip("this torch build runs no packed oneDNN projections")  # then nothing is padded either
    with torch.inference_mode():
        monkeypatch.setitem(engine_device._gemm, torch.float32, ("onednn", "onednn"))
        monkeypatch.setitem(engine_device._onednn_pad, torch.float32, frozenset())
        plain = layer(x)
        monkeypatch.setitem(engine_device._onednn_pad, torch.float32, frozenset({1, 2}))
        calls: list[tuple[int, ...]] = []
        real = torch.ops.mkldnn._linear_pointwise

        def spy(inp: torch.Tensor, *args: object) -> torch.Tensor:
            calls.append(tuple(inp.shape))
            return real(inp, *args)

        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
        padded = layer(x)
    assert calls == [(engine_device.PAD_ROWS, 48)]  # it did pad
    assert padded.shape == plain.shape == (*shape[:-1], 40)
    torch.testing.assert_close(padded, plain, atol=1e-6, rtol=0)


def test_packed_gemm_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 on Intel takes MKL's packed sgemm where this torch has it, except LM-head widths (oneDNN);
    AMD and bf16 take oneDNN; SLIPSTREAM_CPU_GEMM overrides, and a bad value is refused by name."""
    from slipstream.engine import device as engine_device

    cpu = torch.device("cpu")
    on_intel = any(
        line.startswith("vendor_id") and "GenuineIntel" in line for line in Path("/proc/cpuinfo").open()
    )
    mkl, onednn = engine_device._probe_mkl(), engine_device._probe_onednn(torch.float32)
    engine_device.set_packed_gemm(True)  # empties the choices
    try:
        expected = "mkl" if mkl and on_intel else ("onednn" if onednn else None)
        assert packed_gemm(cpu, torch.float32, 960) == expected
        wide = "onednn" if onednn else expected
        assert packed_gemm(cpu, torch.float32, engine_device.MKL_MAX_WIDTH + 1) == wide
        assert packed_gemm(cpu, torch.bfloat16) in ("onednn", None)
        assert packed_gemm(torch.device("cuda"), torch.float32) is None
        for forced, available in (("onednn", onednn), ("mkl", mkl), ("none", True)):
            engine_device.set_packed_gemm(True)
            monkeypatch.setenv("SLIPSTREAM_CPU_GEMM", forced)
            if available:
                assert packed_gemm(cpu, torch.float32) == (None if forced == "none" else forced)
            else:
                with pytest.raises(ValueError, match=f"SLIPSTREAM_CPU_GEMM={forced}: this torch build"):
                    packed_gemm(cpu, torch.float32)
        engine_device.set_packed_gemm(True)
        monkeypatch.setenv("SLIPSTREAM_CPU_GEMM", "blas")
        with pytest.raises(ValueError, match="SLIPSTREAM_CPU_GEMM='blas': expected one of mkl, onednn, none"):
            packed_gemm(cpu, torch.float32)
    finally:
        monkeypatch.delenv("SLIPSTREAM_CPU_GEMM", raising=False)
        engine_device.set_packed_gemm(True)


@pytest.mark.parametrize("gemm", ["mkl", "onednn"])
def test_packed_kernels_equal_f_linear_and_unpack_exactly(gemm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each packed kernel gives F.linear's values (up to rounding) at 0, 1, 3, 4 and 16 rows, 3-D inputs and
    a bias; its pack reads back bit for bit, negative zeros, subnormals and rows holding inf or NaN too
    (MKL's pack has no inverse: `unpack` multiplies by the identity and restores what that cannot carry)."""
    from slipstream.engine import device as engine_device
    from slipstream.engine.model import _PackedWeight

    if not {"mkl": engine_device._probe_mkl, "onednn": lambda: engine_device._probe_onednn(torch.float32)}[
        gemm
    ]():
        pytest.skip(f"this torch build runs no packed {gemm} projections")
    monkeypatch.setitem(engine_device._gemm, torch.float32, (gemm, gemm))
    layer = Linear(48, 40, bias=True)
    with torch.inference_mode():
        for shape in ((0, 48), (1, 48), (3, 48), (4, 48), (16, 48), (2, 3, 48)):
            x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0]))
            out = layer(x)
            assert out.shape == (*shape[:-1], 40)
            torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias))
        assert layer._pack.gemm == gemm
        weight = torch.randn(40, 48, generator=torch.Generator().manual_seed(2))
        weight[0, 0], weight[1, 1], weight[2, 2] = -0.0, 0.0, -3e-42  # a negative zero, a zero, a subnormal
        weight[3, 4], weight[5, 6] = float("inf"), float("nan")
        lone_zero = torch.randn(40, 48, generator=torch.Generator().manual_seed(3))
        lone_zero[7, 9] = -0.0  # found by the reductions alone: nothing else is off
        backs = []
        for planted in (weight, lone_zero):
            pack = _PackedWeight()
            pack.put(planted, gemm, only_copy=True)
            backs.append(pack.unpack())
    for planted, back in zip((weight, lone_zero), backs, strict=True):
        assert torch.equal(back.view(torch.int32), planted.view(torch.int32))
    if gemm == "mkl":  # a pack beside a plain weight keeps no read-back aids: asking for one is an error
        pack.put(weight, gemm)
        with pytest.raises(RuntimeError, match="no exact read-back"):
            pack.unpack()
