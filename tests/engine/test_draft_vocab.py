"""The draft vocabulary's held LM-head rows follow the target's head when a weight update changes it in
place (as a rollout applies one), and live on the target's device."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from slipstream.engine.draft_vocab import DraftVocabulary
from slipstream.engine.weights import load_model


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("size", [0, 12])
def test_draft_logits_follow_an_in_place_head_update(
    make_checkpoint: Callable[..., Path], device: torch.device, tied: bool, size: int
) -> None:
    # float32: the dtype whose CPU path runs on prepacked (cached) copies of the rows.
    target = load_model(make_checkpoint("llama", tie_word_embeddings=tied), device=device)
    vocab = DraftVocabulary(target, size)
    vocab.count(torch.randint(0, target.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0)))
    outs = torch.randn(3, target.config.hidden_size, device=device)  # [3, d] head outputs

    def expected(ids: torch.Tensor | None) -> torch.Tensor:
        weight = target.lm_head_weight.detach()
        return outs @ (weight if ids is None else weight[ids]).T

    with torch.inference_mode():  # as the drafter drafts
        before, ids = vocab.logits(outs)
    torch.testing.assert_close(before, expected(ids))
    if size:
        assert ids is not None and ids.device == device and ids.numel() == size

    with torch.no_grad():  # as the rollout applies a weight update: in place
        target.lm_head_weight.copy_(torch.randn_like(target.lm_head_weight))
    with torch.inference_mode():
        after, same_ids = vocab.logits(outs)
    assert (ids is None and same_ids is None) or torch.equal(ids, same_ids)
    torch.testing.assert_close(after, expected(ids))
    assert not torch.allclose(after, before)
