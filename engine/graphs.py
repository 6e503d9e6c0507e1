"""CUDA graphs for fixed-shape steps: capture once per key, replay after, one memory pool for all.

A `GraphRunner` wraps a step function `fn(key)` that reads and writes only persistent buffers (no host
reads, no shapes that depend on data: engine/static_step.py). On CUDA the first call for a key warms
the step up on a side stream (Triton compiles, cuBLAS picks its kernels, the caching allocator settles),
then captures it into a `torch.cuda.CUDAGraph` from the runner's one pool; every later call replays it —
one launch for the ~600 kernels of a decode step. Elsewhere (the CPU, or `enabled=False`) it calls the
function eagerly: the same arithmetic, so the CPU suite tests what a GPU replays.

Non-obvious choices:
- Manual capture, as nano-vllm, SGLang and mini-sglang do, not `torch.compile(mode="reduce-overhead")`:
  no recompiles per shape, capture in milliseconds, and nothing a CPU cannot run eagerly.
- `capture(keys)` takes the keys largest first, so the smaller graphs reuse the largest one's pool blocks
  (graphs of one pool never run at once here: one stream, one step at a time). Callers capture every key
  a run can meet before the run (the rollout's warm-up): a capture on first use cost the first iteration
  of each new shape 0.1-0.7 s on an H200 (docs/gpu.md, 2026-11-28), in the middle of a rollout's tail.
- Graphs bind addresses: everything a step reads (weights, the KV cache, rotary tables) must be updated in
  place between replays, never reallocated; `Transformer.write_parameter` copies in place.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Hashable, Iterable, Iterator

import torch

__all__ = ["GraphRunner"]


class GraphRunner:
    """Replays one CUDA graph per key of `fn`; eager where graphs are off (see the module docstring)."""

    def __init__(self, fn: Callable[[Hashable], None], device: torch.device, *, enabled: bool = True) -> None:
        self.fn = fn
        self.device = device
        self.enabled = enabled and device.type == "cuda"
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self.capture_s = 0.0
        """Seconds spent warming up and capturing so far (a bench reports it)."""
        self.seen: set[Hashable] = set()
        """Every key run so far, eagerly or replayed (what a run met: tests hold captures to it)."""

    @property
    def keys(self) -> list[Hashable]:
        """The keys captured so far."""
        return list(self._graphs)

    def __call__(self, key: Hashable) -> None:
        """Run the step for `key`: replay its graph (captured on first use) or call it eagerly."""
        self.seen.add(key)
        if not self.enabled:
            self.fn(key)
            return
        graph = self._graphs.get(key)
        if graph is None:
            with _no_collection():
                graph = self._capture(key)
        graph.replay()

    def capture(self, keys: Iterable[Hashable], size: Callable[[Hashable], int] | None = None) -> int:
        """Capture `keys` now, largest first by `size` (default: as given), so smaller graphs share the
        largest one's memory; returns how many were new. One garbage collection for all of them."""
        if not self.enabled:
            return 0
        ordered = sorted(keys, key=size, reverse=True) if size is not None else list(keys)
        new = [key for key in dict.fromkeys(ordered) if key not in self._graphs]
        if new:
            with _no_collection():
                for key in new:
                    self._capture(key)
        return len(new)

    def _capture(self, key: Hashable) -> torch.cuda.CUDAGraph:
        """Warm `key` up on a side stream, then capture it (callers hold `_no_collection`)."""
        started = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # Triton's JIT, cuBLAS heuristics and the allocator settle before capture
                self.fn(key)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self.fn(key)
        torch.cuda.synchronize(self.device)
        self._graphs[key] = graph
        self.capture_s += time.perf_counter() - started
        return graph

    def reset(self) -> None:
        """Drop every graph (their pool memory returns once nothing else holds it)."""
        self._graphs.clear()


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """No garbage collection inside a capture: collecting another runner's graph there frees its memory,
    which CUDA forbids while a stream captures ("operation not permitted when stream is capturing", the
    capture invalidated: a bench building one generator after another hit it on an H200). One collection
    before, then none until the captures are done: a batch of captures pays one full collection, not one
    each."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
