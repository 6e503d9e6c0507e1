"""Suite-wide fixtures: the device every component test runs on, the `gpu` marker's skip, and the tiny
chat model the real-process tests train.

`device` parametrises a test over "cpu" and "cuda"; the cuda case carries the `gpu` marker and is skipped,
with the reason, where torch sees no CUDA device. A test that takes `device` runs the same functions on
both: the CPU suite exercises the code path a GPU run uses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA device: torch.cuda.is_available() is False on this host"

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if CUDA:
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template, built once for the suite: the model
    of every real-process `train` test. Runs only read it (they write into their own run directories)."""
    from tests.engine.conftest import build_chat_checkpoint

    return build_chat_checkpoint(
        tmp_path_factory.mktemp("tiny-chat"),
        max_position_embeddings=2048,
        tie_word_embeddings=True,  # as SmolLM2: the head is the embedding, and its packed copy must follow
    )


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """The device a component test runs on (cuda only where one exists; otherwise skipped, with the reason).
    CUDA comes with its index: torch.device("cuda") != a tensor's device("cuda", 0)."""
    if request.param == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(request.param)
