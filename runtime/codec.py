"""The wire codec: a message becomes frames `[kind][MessagePack body][tensor buffer 0][buffer 1]…`.

A tensor field is encoded in the body as `[dtype, shape, ref]`, `ref` being the raw bytes (at most
`inline_bytes`) or the index of the frame that holds them: the sender hands zmq a view of the tensor's
memory and the receiver gets a tensor that *aliases* the received frame (clone what you keep). Every
dtype, bf16 included, travels as raw bytes; nothing is ever pickled. Same host, a tensor of at least
`shm_min_bytes` can take the shared-memory lane (runtime/shm.py) instead: the body carries a `ShmRef`,
the sender pays one memcpy and the receiver's tensor aliases the shared slot, released when the tensor
is freed (ZeroMQ alone moves large frames far below memcpy speed: docs/benchmarks.md, Transport).

Decoding is a trust boundary: anything malformed (unknown kind, truncated or extra frames, a body of the
wrong shape, a tensor header that disagrees with its frame or exceeds the limit) raises `ProtocolError`
naming the problem, which the receiver logs and drops. A `Codec` keeps per-call scratch state, so it
belongs to one thread (as its sockets do).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any

import msgspec
import torch

from slipstream.protocols import Message, control, drafter, environment, learner, node, reward, rollout
from slipstream.runtime.shm import ShmArena, ShmReader, ShmRef

CHANNELS: tuple[ModuleType, ...] = (control, rollout, reward, learner, drafter, node, environment)

# Names are the wire format for dtypes: append only.
DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "uint16": torch.uint16,
    "uint32": torch.uint32,
    "uint64": torch.uint64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

MAX_DIMS = 16


class ProtocolError(ValueError):
    """A received message is malformed; the text names what was wrong."""


def registry(channels: Iterable[ModuleType] = CHANNELS) -> dict[str, type[Message]]:
    """kind string → message type, over the channel modules."""
    out: dict[str, type[Message]] = {}
    for module in channels:
        for cls in module.MESSAGES:
            if cls.kind in out:
                raise RuntimeError(f"duplicate message kind {cls.kind!r}")
            out[str(cls.kind)] = cls
    return out


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU uint8 view of a tensor's raw bytes (copies only if it must)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def checksum(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> str:
    """sha256 over each name and its tensor's raw bytes, in order: what weight and drafter updates carry
    and the receiver recomputes before applying anything."""
    if len(names) != len(tensors):
        raise ValueError(f"checksum: {len(names)} names for {len(tensors)} tensors")
    h = hashlib.sha256()
    for name, t in zip(names, tensors, strict=True):
        h.update(name.encode())
        h.update(memoryview(tensor_bytes(t).numpy()))  # no tobytes(): no copy (docs/benchmarks.md)
    return h.hexdigest()


class Codec:
    """Encodes and decodes messages of the registered channels. One per thread."""

    def __init__(
        self,
        *,
        inline_bytes: int = 1024,
        max_frame_bytes: int = 2 << 30,
        max_message_bytes: int = 4 << 30,
        channels: Iterable[ModuleType] = CHANNELS,
        shm: ShmArena | None = None,
        shm_reader: ShmReader | None = None,
        shm_min_bytes: int = 1 << 20,
    ) -> None:
        self.inline_bytes = inline_bytes
        self.shm, self.shm_reader, self.shm_min_bytes = shm, shm_reader, shm_min_bytes
        self.max_frame_bytes = max_frame_bytes
        self.max_message_bytes = max_message_bytes
        self.types = registry(channels)
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoders = {
            kind.encode(): msgspec.msgpack.Decoder(cls, dec_hook=self._dec_hook)
            for kind, cls in self.types.items()
        }
        self._out: list[Any] = []
        self._readers = 1
        self._in: Sequence[memoryview] = ()
        self._used: set[int] = set()

    # -- encode ---------------------------------------------------------------------------------------

    def encode(self, msg: Message, *, readers: int = 1) -> list[Any]:
        """Frames for `msg`: kind, body, then one buffer per large tensor (zero-copy views). `readers`: how
        many receivers the same frames go to, each claiming a shared-memory slot once (one copy for all)."""
        kind = getattr(msg, "kind", "")
        if not kind or self.types.get(kind) is not type(msg):
            raise TypeError(f"{type(msg).__name__} is not a registered message type")
        self._out = []
        self._readers = readers
        try:
            body = self._encoder.encode(msg)
            return [kind.encode(), body, *self._out]
        finally:
            self._out = []
            self._readers = 1

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            name = DTYPE_NAMES.get(obj.dtype)
            if name is None:
                raise TypeError(f"tensor dtype {obj.dtype} has no wire encoding")
            raw = tensor_bytes(obj)
            shape = list(obj.shape)
            if raw.numel() <= self.inline_bytes:
                return [name, shape, raw.numpy().tobytes()]
            if self.shm is not None and raw.numel() >= self.shm_min_bytes:
                ref = self.shm.put(raw, readers=self._readers)  # blocks while the lane is full: backpressure
                if ref is not None:
                    return [name, shape, ref]
            self._out.append(raw.numpy())  # buffer protocol: zmq sends it without a copy
            return [name, shape, len(self._out) - 1]
        raise TypeError(f"cannot encode {type(obj).__name__} on the wire")

    # -- decode ---------------------------------------------------------------------------------------

    def decode(self, frames: Sequence[Any]) -> Message:
        """The message in `frames` (bytes, memoryviews or zmq Frames). Raises ProtocolError."""
        if len(frames) < 2:
            raise ProtocolError(f"truncated message: {len(frames)} frame(s), need at least kind and body")
        views = [_view(f) for f in frames]
        total = 0
        for i, v in enumerate(views):
            if v.nbytes > self.max_frame_bytes:
                raise ProtocolError(
                    f"frame {i} is {v.nbytes} bytes, over the limit of {self.max_frame_bytes}"
                )
            total += v.nbytes
        if total > self.max_message_bytes:
            raise ProtocolError(f"message is {total} bytes, over the limit of {self.max_message_bytes}")
        kind = bytes(views[0])
        decoder = self._decoders.get(kind)
        if decoder is None:
            raise ProtocolError(f"unknown message kind {kind[:64]!r}")
        self._in, self._used = views[2:], set()
        try:
            msg = decoder.decode(views[1])
        except ProtocolError as e:
            raise ProtocolError(f"{kind.decode()}: {e}") from None
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ProtocolError(f"{kind.decode()}: malformed body: {e}") from None
        except Exception as e:  # a trust boundary: nothing a peer sends may crash the receiver
            raise ProtocolError(f"{kind.decode()}: undecodable body: {type(e).__name__}: {e}") from None
        finally:
            self._in = ()
        unused = set(range(len(views) - 2)) - self._used
        if unused:
            raise ProtocolError(f"{kind.decode()}: {len(unused)} tensor frame(s) not referenced by the body")
        return msg

    def _dec_hook(self, tp: type, obj: Any) -> Any:
        if tp is not torch.Tensor:
            raise TypeError(f"unsupported type {tp}")
        if not (isinstance(obj, list | tuple) and len(obj) == 3):
            raise ProtocolError(f"tensor header must be [dtype, shape, data], got {type(obj).__name__}")
        name, shape, ref = obj
        dtype = DTYPES.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise ProtocolError(f"unknown tensor dtype {name!r}")
        if not (
            isinstance(shape, list | tuple)
            and len(shape) <= MAX_DIMS
            and all(type(d) is int and d >= 0 for d in shape)
        ):
            raise ProtocolError(f"bad tensor shape {shape!r}")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes > self.max_frame_bytes:
            raise ProtocolError(
                f"oversized tensor header: {shape} {name} is {nbytes} bytes, limit {self.max_frame_bytes}"
            )
        if isinstance(ref, bytes):
            data: memoryview | bytearray = bytearray(ref)  # small and immutable: copy into a writable buffer
        elif type(ref) is int:
            if not 0 <= ref < len(self._in):
                raise ProtocolError(
                    f"tensor references frame {ref}, but the message has {len(self._in)} tensor frame(s)"
                )
            if ref in self._used:
                raise ProtocolError(f"tensor frame {ref} referenced twice")
            self._used.add(ref)
            data = self._in[ref]
        elif isinstance(ref, list | tuple):
            if self.shm_reader is None:
                raise ProtocolError(
                    "shared-memory tensor reference on a codec without a shared-memory reader"
                )
            try:
                return self.shm_reader.get(msgspec.convert(ref, ShmRef), dtype, shape)
            except (ValueError, msgspec.ValidationError) as e:
                raise ProtocolError(f"bad shared-memory tensor reference: {e}") from None
        else:
            raise ProtocolError(
                f"tensor data must be bytes, a frame index or a shared-memory reference, got {type(ref).__name__}"
            )
        if len(data) != nbytes:
            raise ProtocolError(f"tensor {shape} {name} needs {nbytes} bytes, got {len(data)}")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)


def _view(frame: Any) -> memoryview:
    if isinstance(frame, bytes):
        frame = bytearray(frame)  # tensors alias their frame, and must be writable
    try:
        view = memoryview(frame)  # zmq.Frame, bytearray, numpy arrays: anything with the buffer protocol
    except TypeError:
        raise ProtocolError(f"frame of type {type(frame).__name__} is not a buffer") from None
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")
