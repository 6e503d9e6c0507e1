"""Weight deltas: a tensor as the compressed bitwise XOR against the version the receiver already holds.

`xor_delta(prev, new)` views both as same-width integers, XORs them, and compresses the result with zstd;
`apply_xor_delta(prev, blob)` undoes it bit for bit (NaN payloads, -0.0 and subnormals come back as sent).
The learner sends these to rollouts on other hosts, where the network, not memory, is the bottleneck.

Non-obvious choices:
- XOR, not subtraction: exact for every dtype with no float rounding, and an unchanged element is an
  all-zero word, which zstd removes almost for free.
- Byte planes: the XOR's bytes are regrouped by significance before compressing (every element's byte 0,
  then every byte 1, ...: Blosc's "shuffle"). A small update flips low mantissa bits only, so the
  sign/exponent planes become runs of zeros: a better ratio than the interleaved bytes, and in fp32 in
  less time too (benchmarks/sync.py measures both ways). numpy does the transpose, several times faster than
  torch's strided uint8 copy.
- zstd level 1, one thread unless asked (`threads`), and its 4-byte content checksum per frame, so a
  corrupt blob fails here, naming itself, rather than as a bucket checksum mismatch after decoding.

    blob = xor_delta(old, new)          # bytes; `blob_tensor(blob)` is what a WeightUpdate carries
    new_again = apply_xor_delta(old, blob)
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
import zstandard
from torch import Tensor

__all__ = ["LEVEL", "apply_xor_delta", "blob_tensor", "xor_delta"]

LEVEL = 1  # zstd level of `xor_delta`

# Same-width integer views: XOR is defined on these, and a view costs no copy.
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _int_view(t: Tensor, what: str) -> Tensor:
    """`t`'s raw bits as a flat integer tensor of its element width (a view when `t` is contiguous)."""
    width = t.element_size()
    if width not in _INT_OF_WIDTH:
        raise ValueError(f"{what}: {t.dtype} elements are {width} bytes; deltas cover 1, 2, 4 or 8")
    return t.detach().contiguous().reshape(-1).view(_INT_OF_WIDTH[width])


def xor_delta(prev: Tensor, new: Tensor, *, level: int = LEVEL, threads: int = 0) -> bytes:
    """zstd of the byte planes of `prev` XOR `new` (same dtype and shape; CPU tensors): what a receiver
    holding `prev` needs to rebuild `new` exactly. `threads` > 0 compresses on that many threads."""
    if prev.dtype != new.dtype or prev.shape != new.shape:
        raise ValueError(
            f"xor_delta: base is {prev.dtype} {tuple(prev.shape)}, new is {new.dtype} {tuple(new.shape)}"
        )
    width = new.element_size()
    x = torch.bitwise_xor(_int_view(prev, "xor_delta"), _int_view(new, "xor_delta"))
    # [numel, width] bytes -> [width, numel]: plane k holds byte k of every element.
    planes = x.view(torch.uint8).numpy().reshape(-1, width).T.copy()
    return zstandard.ZstdCompressor(level=level, threads=threads, write_checksum=True).compress(planes)


def apply_xor_delta(prev: Tensor, blob: bytes | Tensor) -> Tensor:
    """The tensor `xor_delta(prev, new)` was made from: `new`, bitwise, with `prev`'s dtype, shape and
    device. `blob` may be the bytes or a 1-D uint8 tensor holding them (as it arrives on the wire).
    Raises ValueError naming the problem when the blob is corrupt or does not fit `prev`."""
    width = prev.element_size()
    base = _int_view(prev, "apply_xor_delta")
    if isinstance(blob, Tensor):
        if blob.dtype != torch.uint8 or blob.dim() != 1:
            raise ValueError(
                f"apply_xor_delta: a blob tensor is 1-D uint8, got {blob.dtype} {tuple(blob.shape)}"
            )
        data = blob.detach().cpu().contiguous().numpy()
    else:
        data = blob
    expected = base.numel() * width
    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise ValueError(f"apply_xor_delta: not a zstd frame ({exc})") from None
    if size != expected:
        raise ValueError(
            f"apply_xor_delta: the blob holds {size} bytes, the base {prev.dtype} {tuple(prev.shape)} "
            f"has {expected}"
        )
    planes = np.empty((width, base.numel()), dtype=np.uint8)  # [width, numel]: as compressed
    _decompress_into(data, planes.reshape(-1))
    # Back to [numel, width] bytes, one plane at a time (several times faster than a transposed copy).
    words = np.empty((base.numel(), width), dtype=np.uint8)
    for k in range(width):
        words[:, k] = planes[k]
    x = torch.from_numpy(words).reshape(-1).view(base.dtype).to(base.device)
    return torch.bitwise_xor(base, x, out=x).view(prev.dtype).reshape(prev.shape)


def _decompress_into(data: Any, out: np.ndarray) -> None:
    """Decompresses the one zstd frame `data` into `out` (its exact size), checking the frame's checksum:
    straight into the planes, with no intermediate bytes object."""
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(data)
        view, filled = memoryview(out), 0
        while filled < len(view):
            got = reader.readinto(view[filled:])
            if got == 0:
                break
            filled += got
        # Reading on to the frame's end is what verifies its checksum; anything after it is corrupt too.
        extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise ValueError(f"apply_xor_delta: corrupt blob ({exc})") from None
    if filled != len(view) or extra:
        raise ValueError(
            f"apply_xor_delta: corrupt blob (decoded {filled} bytes, the header said {len(view)})"
        )


def blob_tensor(blob: bytes) -> Tensor:
    """`blob` as a 1-D uint8 tensor sharing its memory (what a WeightUpdate carries), never written to."""
    with warnings.catch_warnings():
        # bytes are immutable: torch warns that the tensor could write to them; nothing here does.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(blob, dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
