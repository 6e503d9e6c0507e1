"""Same-GPU weight lane: a bucket stays in the sender's GPU memory; only its CUDA IPC handle travels.

Where the learner and the rollouts and drafters share a GPU (or a node's GPUs), a push needs no host round
trip and no second host copy: the learner exports its cast bucket once (`export`: the storage's IPC
handle, its ref-counter and event handles, the tensor's dtype, shape, stride and offset) in a `CudaIpcRef`
(protocols/learner.py: a plain struct, never a pickle), with the bucket's `device_checksum` computed on
the GPU; the weight receiver checks each ref and maps it (`map_refs`: torch's own `rebuild_cuda_tensor`,
cached per handle by torch), compares the checksum and copies into its weights in place. The host's
shared-memory lane (runtime/shm.py) stays the CPU path; XOR deltas stay the cross-host path.

Non-obvious choices:
- The checksum is a positional sum of the bytes as int32 words (weights from a fixed odd multiplier,
  arithmetic mod 2^64, so any summation order gives the same value on any device), per tensor, hashed with
  the names on the host: 16 bytes a tensor cross to the host, not the tensor. It catches a stale or torn
  bucket; it is not a cryptographic hash (the lane never leaves the node).
- The sender keeps each exported bucket alive until every receiver acknowledged its version: a storage
  freed while a receiver maps it is undefined behaviour in CUDA IPC.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

from slipstream.protocols.learner import CudaIpcRef

__all__ = ["DTYPES", "CudaIpcRef", "check", "device_checksum", "export", "map_refs", "open_ref"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""What a bucket may hold on this lane (weights in the receivers' dtype)."""
_CHUNK_WORDS = 1 << 26  # words per chunk of the checksum's weights (512 MB of int64 at most at once)
_MULTIPLIER = 0x9E3779B1  # odd: every word position gets a distinct weight mod 2^64


def export(name: str, tensor: torch.Tensor) -> CudaIpcRef:
    """The ref of `tensor` (on CUDA, a dtype of `DTYPES`) for receivers on this node. The caller keeps
    `tensor` alive (and unchanged) until every receiver is done with this version."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    if tensor.device.type != "cuda":
        raise ValueError(f"{name}: the CUDA IPC lane carries CUDA tensors, got one on {tensor.device}")
    if dtype not in DTYPES:
        raise ValueError(f"{name}: dtype {dtype} is not one of {', '.join(DTYPES)}")
    from torch.multiprocessing.reductions import StorageWeakRef, shared_cache

    storage = tensor._typed_storage()
    shared = storage._share_cuda_()
    # So that this process maps its own ref to the same storage: CUDA refuses to open an IPC handle in the
    # process that made it ("invalid device context", an H200, 2026-11-28). torch's `rebuild_cuda_tensor`
    # looks its cache up by (handle, storage offset), while its `reduce_tensor` stores by handle alone,
    # so copying that (as this did) never hit.
    shared_cache[(shared[1], shared[3])] = StorageWeakRef(storage)
    return describe(tensor, shared)


def describe(tensor: torch.Tensor, shared: Sequence) -> CudaIpcRef:
    """The ref of `tensor` from its storage's share tuple (`_share_cuda_`'s eight fields)."""
    device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle, event_sync = shared
    return CudaIpcRef(
        device=int(device),
        handle=bytes(handle),
        storage_size_bytes=int(size_bytes),
        storage_offset_bytes=int(offset_bytes),
        ref_counter_handle=bytes(ref_handle),
        ref_counter_offset=int(ref_offset),
        event_handle=bytes(event_handle or b""),
        event_sync_required=bool(event_sync),
        dtype=str(tensor.dtype).removeprefix("torch."),
        shape=list(tensor.shape),
        stride=list(tensor.stride()),
        offset=int(tensor.storage_offset()),
    )


def check(name: str, ref: CudaIpcRef, shape: Sequence[int], dtype: torch.dtype) -> None:
    """ValueError naming what is wrong where `ref` cannot be the new value of a `shape` `dtype` tensor:
    dtype, shape, or a view that reaches past its storage (a malformed or hostile ref must not map foreign
    memory)."""
    if ref.dtype not in DTYPES or DTYPES[ref.dtype] != dtype:
        raise ValueError(f"{name}: dtype {ref.dtype}, expected {str(dtype).removeprefix('torch.')}")
    if ref.shape != list(shape):
        raise ValueError(f"{name}: shape {ref.shape}, expected {list(shape)}")
    if len(ref.stride) != len(ref.shape) or any(s < 0 for s in ref.stride) or ref.offset < 0:
        raise ValueError(f"{name}: bad layout (stride {ref.stride}, offset {ref.offset})")
    itemsize = torch.empty((), dtype=dtype).element_size()
    last = (
        ref.offset + sum((n - 1) * s for n, s in zip(ref.shape, ref.stride, strict=True))
        if all(ref.shape)
        else -1
    )
    if (last + 1) * itemsize > ref.storage_size_bytes:
        raise ValueError(
            f"{name}: the view reaches byte {(last + 1) * itemsize} of a {ref.storage_size_bytes}-byte storage"
        )
    if not ref.handle or not ref.ref_counter_handle or ref.device < 0:
        raise ValueError(f"{name}: empty IPC handle or bad device {ref.device}")


def map_refs(
    names: Sequence[str],
    refs: Sequence[CudaIpcRef],
    expected: Mapping[str, tuple[Sequence[int], torch.dtype]],
) -> list[torch.Tensor]:
    """A bucket's refs checked against `expected` (name → shape, dtype) and mapped: what the weight
    receiver calls (its `map_refs`). ValueError naming a ref that cannot be mapped."""
    if len(refs) != len(names):
        raise ValueError(f"{len(names)} names, {len(refs)} IPC refs")
    for name, ref in zip(names, refs, strict=True):
        if name not in expected:
            raise ValueError(f"{name}: not a weight of this model")
        check(name, ref, *expected[name])
    return [open_ref(ref) for ref in refs]


def open_ref(ref: CudaIpcRef) -> torch.Tensor:
    """Map `ref` (checked first with `check`) in this process: a tensor aliasing the sender's memory."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(ref.shape), tuple(ref.stride), ref.offset, torch.storage.TypedStorage,
        DTYPES[ref.dtype], ref.device, ref.handle, ref.storage_size_bytes, ref.storage_offset_bytes, False,
        ref.ref_counter_handle, ref.ref_counter_offset, ref.event_handle or None, ref.event_sync_required,
    )  # fmt: skip


def device_checksum(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> str:
    """A checksum of each name and its tensor's bytes, computed where the tensors are (see the module
    notes): equal on every device for equal bytes."""
    if len(names) != len(tensors):
        raise ValueError(f"checksum: {len(names)} names for {len(tensors)} tensors")
    h = hashlib.sha256()
    for name, tensor in zip(names, tensors, strict=True):
        h.update(name.encode())
        h.update(_word_sum(tensor).to(torch.int64).cpu().numpy().tobytes())
    return h.hexdigest()[:32]


def _word_sum(tensor: torch.Tensor) -> torch.Tensor:
    """[2] int64: the byte count and Σ word_i · (i · M + 1) over the tensor's bytes as int32 words, mod 2^64."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = -data.numel() % 4
    if pad:
        data = torch.cat([data, data.new_zeros(pad)])
    words = data.view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        chunk = words[start : start + _CHUNK_WORDS].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=data.device)
        total += (chunk * (weights * _MULTIPLIER + 1)).sum()
    return torch.stack([torch.tensor(tensor.numel() * tensor.element_size(), device=data.device), total])
