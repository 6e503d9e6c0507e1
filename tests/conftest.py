"""Suite-wide fixtures: the device every component test runs on, and the `gpu` marker's skip.

`device` parametrises a test over "cpu" and "cuda"; the cuda case carries the `gpu` marker and is skipped,
with the reason, where torch sees no CUDA device. A test that takes `device` runs the same functions on
both: the CPU suite exercises the code path a GPU run uses.
"""

from __future__ import annotations

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


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """The device a component test runs on (cuda only where one exists; otherwise skipped, with the reason).
    CUDA comes with its index: torch.device("cuda") != a tensor's device("cuda", 0)."""
    if request.param == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(request.param)
