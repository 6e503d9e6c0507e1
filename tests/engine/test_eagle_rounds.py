"""The EAGLE drafter's fixed-shape rounds (engine/drafters/eagle_rounds.py): a static drafter drafts exactly
what the dynamic one does (greedy and keyed, full and restricted vocabulary, padding rows, catch-up passes
of several widths, through the Generator), its passes read nothing back and keep their shapes whatever the
data, and a replay follows the LM head's in-place updates (a planted stale copy of the draft vocabulary's
rows fails)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from slipstream.engine.drafters.base import DraftState
from slipstream.engine.drafters.eagle import EagleDrafter
from slipstream.engine.drafters.eagle_rounds import EagleRounds
from slipstream.engine.eagle import EagleHead
from slipstream.engine.generator import Completion, Generator, Request
from slipstream.engine.model import Transformer
from slipstream.engine.sampling import SamplingParams
from slipstream.engine.speculator import SpecConfig
from slipstream.engine.weights import load_model
from tests.engine.test_static_step import FORBIDDEN, OpTrace


@pytest.fixture(scope="module")
def target(make_checkpoint: Callable[..., Path]) -> Transformer:
    return load_model(make_checkpoint("llama", seed=3), dtype=torch.float32)


def sampled(i: int, temperature: float) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=i, max_tokens=40)


@pytest.fixture(scope="module")
def completions(target: Transformer) -> list[Completion]:
    gen = torch.Generator().manual_seed(0)
    requests = [
        Request(
            request_id=f"r{i}",
            prompt_ids=torch.randint(0, 160, (5 + i,), generator=gen).tolist(),
            params=sampled(i, [0.0, 0.9, 0.7][i]),
        )
        for i in range(3)
    ]
    return Generator(target, num_slots=4, max_len=128, token_budget=64, return_hidden=True).generate(requests)


def head_for(target: Transformer) -> EagleHead:
    torch.manual_seed(0)
    weight = target.lm_head_weight  # the head where the target is (the gpu test's target is on CUDA)
    return EagleHead.for_target(target.config).to(device=weight.device, dtype=weight.dtype)


def state(c: Completion, j: int, lo: int, *, keyed: bool) -> DraftState:
    """The request after response token j was committed, with the states of tokens lo … j."""
    params = sampled(int(c.request_id[1:]), [0.0, 0.9, 0.7][int(c.request_id[1:])])
    return DraftState(
        request_id=c.request_id,
        group_id=0,
        tokens=[*c.prompt_ids, *c.token_ids[: j + 1]],
        prompt_len=len(c.prompt_ids),
        params=params,
        hidden=c.hidden[lo : j + 1],
        keyed=keyed,
    )


def drafter_pair(target: Transformer, draft_vocab: int) -> tuple[EagleDrafter, EagleDrafter]:
    head = head_for(target)
    dynamic = EagleDrafter(head, target, num_slots=4, max_len=96, draft_vocab=draft_vocab, static=False)
    static = EagleDrafter(head, target, num_slots=4, max_len=96, draft_vocab=draft_vocab, static=True)
    assert dynamic.rounds is None and static.rounds is not None
    return dynamic, static


def drive(drafter: EagleDrafter, completions: list[Completion], *, keyed: bool) -> list[list[list[int]]]:
    """The requests drafted together (three: a bucket of 4 with one padding row), committed tokens arriving
    in runs of 1, 3 and 7 (extend widths 1 … 8); every round's chains."""
    rounds = []
    seen = [0] * len(completions)
    for r in range(12):
        states = []
        for i, c in enumerate(completions):
            upto = min(r * [1, 3, 7][i] + 1, len(c.token_ids) - 1)
            states.append(state(c, upto, seen[i], keyed=keyed))
            seen[i] = upto + 1
        drafts = drafter.propose(states, depth=5, topk=1, verify=5)
        rounds.append([d.tokens.tolist() for d in drafts])
    return rounds


@pytest.mark.parametrize("keyed", [False, True], ids=["argmax", "keyed"])
@pytest.mark.parametrize("draft_vocab", [0, 12, 40])
def test_static_rounds_draft_what_the_dynamic_passes_draft(
    target: Transformer, completions: list[Completion], keyed: bool, draft_vocab: int
) -> None:
    dynamic, static = drafter_pair(target, draft_vocab)
    expected = drive(dynamic, completions, keyed=keyed)
    assert drive(static, completions, keyed=keyed) == expected
    assert sum(len(chain) for r in expected for chain in r) > 100  # real chains were compared
    assert static.rounds is not None and static.rounds.rounds >= 2 * len(expected)
    assert not static.rounds.runner.enabled  # eager on the CPU


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_generator_with_a_static_drafter_is_lossless_and_drafts_alike(
    make_checkpoint: Callable[..., Path], temperature: float
) -> None:
    """The fixed-shape Generator with a static drafter: plain decoding's tokens, and the same drafts (so the
    same accepted counts) as with a dynamic drafter."""
    target = load_model(make_checkpoint("llama", seed=3), dtype=torch.float32)
    gen = torch.Generator().manual_seed(9)
    requests = [
        Request(
            request_id=f"q{i}",
            prompt_ids=torch.randint(0, 160, (6,), generator=gen).tolist(),
            params=SamplingParams(temperature=temperature, seed=i, max_tokens=30),
        )
        for i in range(5)
    ]
    spec = SpecConfig(method="eagle", depth=4, topk=1, verify=4, mode="reproducible")
    plain = Generator(target, num_slots=3, max_len=96, token_budget=48, static=True).generate(requests)
    stats = []
    for static in (False, True):
        drafter = EagleDrafter(
            head_for(target), target, num_slots=3, max_len=96, draft_vocab=12, static=static
        )
        spec_gen = Generator(
            target,
            num_slots=3,
            max_len=96,
            token_budget=48,
            spec=spec,
            drafters={"eagle": drafter},
            static=True,
        )
        assert [c.token_ids for c in spec_gen.generate(requests)] == [c.token_ids for c in plain]
        stats.append((spec_gen.stats["drafted"], spec_gen.stats["accepted"], spec_gen.position_stats))
    assert stats[0] == stats[1] and stats[0][0] > 50


# ---- capture safety --------------------------------------------------------------------------------------


def prepared(target: Transformer, completions: list[Completion], seed: int) -> EagleDrafter:
    """A static drafter holding the three requests' features, cut at a seed-dependent point."""
    drafter = EagleDrafter(head_for(target), target, num_slots=4, max_len=96, draft_vocab=12, static=True)
    for i, c in enumerate(completions):
        drafter.observe(state(c, 4 + 3 * seed + i, 0, keyed=True))
    return drafter


def round_keys(drafter: EagleDrafter, completions: list[Completion], seed: int) -> None:
    """Pack an extend pass and a chain round into the drafter's block (what `_run` then reads)."""
    rounds = drafter.rounds
    assert rounds is not None
    requests = [drafter._requests[c.request_id] for c in completions]
    for request in requests:
        request.cached = 1 + seed
    rounds._padding(4)
    rounds._staged[:3, 0] = [r.slot for r in requests]
    rounds._staged[:3, 1] = [r.cached for r in requests]
    rounds._staged[:3, 2] = [3, 1, 2]  # new pairs (extend) / ignored (chain)
    rounds._staged[:3, 3] = [seed, 5, 7]  # seeds
    rounds._staged[:3, 4] = [10 + seed, 11, 12]  # positions
    rounds._staged[:3, 6:10] = 17 + seed
    rounds.inp.copy_(rounds.staging)
    assert drafter.vocab.refresh()


def trace_rounds(target: Transformer, completions: list[Completion], seed: int) -> list[tuple[str, tuple]]:
    drafter = prepared(target, completions, seed)
    round_keys(drafter, completions, seed)
    rounds = drafter.rounds
    assert rounds is not None
    with torch.inference_mode(), OpTrace() as trace:
        rounds._run(("extend", 4, 4))
        rounds._run(("chain", 4, 5, True, True))
    return trace.calls


def test_rounds_read_nothing_back_and_their_shapes_do_not_follow_the_data(
    target: Transformer, completions: list[Completion]
) -> None:
    a, b = trace_rounds(target, completions, 0), trace_rounds(target, completions, 1)
    assert a == b
    assert not FORBIDDEN & {name for name, _ in a}
    assert len(a) > 100


def test_rounds_run_on_fake_tensors(make_checkpoint: Callable[..., Path]) -> None:
    """Shapes and dtypes only: any read of a value raises (float64: no oneDNN packs, which fake tensors
    cannot run)."""
    target = load_model(make_checkpoint("llama", seed=3), dtype=torch.float64)
    gen = Generator(target, num_slots=4, max_len=128, token_budget=64, return_hidden=True)
    completions = gen.generate(
        [
            Request(request_id=f"r{i}", prompt_ids=[5 + i, 6, 7, 8, 9], params=sampled(i, 0.9))
            for i in range(3)
        ]
    )
    drafter = prepared(target, completions, 0)
    round_keys(drafter, completions, 0)
    rounds = drafter.rounds
    assert rounds is not None
    with torch.inference_mode(), FakeTensorMode(allow_non_fake_inputs=True):  # any value read raises
        rounds._run(("extend", 4, 4))
        rounds._run(("chain", 4, 5, True, True))


def test_a_planted_host_read_in_a_round_is_caught(
    target: Transformer, completions: list[Completion], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = EagleDrafter._layer

    def reads_back(self, x, slot, ctx, *args, **kwargs):  # type: ignore[no-untyped-def]
        _ = int(ctx.max())  # e.g. sizing the page table from the data
        return real(self, x, slot, ctx, *args, **kwargs)

    monkeypatch.setattr(EagleDrafter, "_layer", reads_back)
    assert FORBIDDEN & {name for name, _ in trace_rounds(target, completions, 0)}


def test_a_replay_follows_the_heads_in_place_updates(
    target: Transformer, completions: list[Completion], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After an in-place update of the LM head (a rollout's weight sync), the static drafter's fixed
    vocabulary rows are re-gathered: it drafts what a dynamic drafter does. Planted: a refresh that skips the
    re-gather leaves the old rows in the buffers, and the drafts differ."""
    original = target.lm_head_weight.detach().clone()
    name = "embed_tokens.weight" if target.lm_head is None else "lm_head.weight"

    def after_update(plant: bool) -> tuple[list, list]:
        dynamic, static = drafter_pair(target, 40)
        assert drive(static, completions[:1], keyed=False) == drive(dynamic, completions[:1], keyed=False)
        if plant:  # the static drafter's vocabulary keeps the rows it gathered before the update
            monkeypatch.setattr(static.vocab, "_gather", lambda ids: None)
        noise = torch.randn(original.shape, generator=torch.Generator().manual_seed(1))
        target.write_parameter(name, original + 0.5 * noise)
        for drafter in (dynamic, static):
            drafter.reset("r0")
        return drive(dynamic, completions[:1], keyed=False), drive(static, completions[:1], keyed=False)

    try:
        expected, got = after_update(plant=False)
        assert got == expected
        target.write_parameter(name, original)
        expected, got = after_update(plant=True)
        assert got != expected
    finally:
        target.write_parameter(name, original)


@pytest.mark.gpu
def test_graph_replays_are_bitwise_the_eager_rounds_and_never_sync(
    make_checkpoint: Callable[..., Path],
) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    target = load_model(make_checkpoint("llama", seed=3), dtype=torch.bfloat16, device=device)
    gen = Generator(target, num_slots=4, max_len=128, token_budget=64, return_hidden=True)
    completions = gen.generate(
        [
            Request(request_id=f"r{i}", prompt_ids=[5 + i, 6, 7, 8, 9], params=sampled(i, 0.9))
            for i in range(3)
        ]
    )
    drafts = []
    for graphs in (True, False):
        drafter = EagleDrafter(head_for(target), target, num_slots=4, max_len=96, draft_vocab=12, static=True)
        drafter.rounds = EagleRounds(drafter, graphs=graphs)
        drafts.append(drive(drafter, completions, keyed=True))
        if graphs:
            assert drafter.rounds.runner.keys  # captured
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for key in drafter.rounds.runner.keys:
                    drafter.rounds.runner(key)  # replays (the last input again)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    assert drafts[0] == drafts[1]
