"""Same-host bulk lane: large tensors travel through reused shared memory, only a descriptor on the wire.

Why: a large frame over ipc:// makes libzmq allocate and page-fault a fresh receive buffer per message,
far below memcpy speed (docs/benchmarks.md). Here the sender copies the bytes once into a slot of a
pre-faulted /dev/shm segment it keeps reusing, and the body carries a `ShmRef` (segment, offset, nbytes,
slot, generation); the receiver maps the segment once and gets a tensor that *aliases* the slot.

The non-obvious choice: release needs no message. Each segment starts with a header page holding, per
slot, `state`, `generation` and the claiming `pid`; the receiver flips `state` back to FREE when the
last tensor (or view) over the slot is freed, and the sender simply sees it. That is the credit. The slot
state machine, its locking and ordering rules: the comment above the header layout below.

`ShmArena` (sender) grows in power-of-two size classes up to a capacity, then `put` blocks until a slot
frees (`ShmFullError` after its timeout): that is the backpressure. `ShmReader` is the receiving side.
Segments are named `slipstream-{run_tag}-{pid}-{n}`, mode 0600; `close()` unlinks a sender's segments
and `cleanup(run_tag)` removes what a crashed process left behind.
"""

from __future__ import annotations

import fcntl
import itertools
import math
import mmap
import os
import re
import stat
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import msgspec
import numpy as np
import torch

from slipstream.runtime.process import pid_alive

SHM_DIR = Path("/dev/shm")
PREFIX = "slipstream-"
_NAME_RE = re.compile(r"slipstream-[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*-\d+-\d+")
_TAG_RE = re.compile(r"[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*")
_PAGE = 4096
_ALIGN = 64  # receivers view the bytes as any dtype: keep every tensor cache-line aligned

# Slot protocol. Each slot moves through
#
#     FREE ──put (sender)──▶ WRITTEN ──get (receiver)──▶ CLAIMED ──last view freed (receiver)──▶ FREE
#                              │                            └──claimer pid dead (sender, reclaim)──▶ FREE
#                              └──reclaim(older_than_s): descriptor lost (sender)──────────────────▶ FREE
#
# - Only the sender writes FREE→WRITTEN, and it bumps `generation` on every put and every reclaim; a
#   descriptor whose generation is not the slot's is stale and `get` refuses it, so a late or replayed
#   descriptor can never read a reused slot. A descriptor is single-use: a second `get` finds CLAIMED.
# - WRITTEN→CLAIMED (receiver) and WRITTEN→FREE (sender reclaim) race, so both hold an fcntl lock on
#   the slot's header bytes. The other transitions have one writer each and take no lock.
# - Ordering: the sender stores data, then generation, then state, then sends the descriptor (a syscall);
#   the receiver's reads of the data precede its FREE store. x86-64 (TSO) keeps both orders for plain
#   stores; a weakly ordered CPU would need fences that Python cannot express.
# - The receiver's tensor is torch.frombuffer over a numpy array over the mapping; torch holds that array
#   until the storage dies (views included), and `weakref.finalize` on the array does the FREE store.
# - A receiver that dies holding slots: the sender frees CLAIMED slots whose pid is gone (`pid_alive`:
#   a zombie counts as gone), automatically whenever `put` finds no free slot (and on `reclaim()`). Pids
#   must share a namespace (same host, no separate pid namespaces). A descriptor that never arrived
#   (message dropped) leaves its slot WRITTEN until the owner calls `reclaim(older_than_s)` with a bound
#   well above delivery latency.
# - Slots come in power-of-two size classes; a class's segment grows by doubling its slot count. The
#   arena grows to `capacity_bytes` of slot memory (plus a 4 KiB header page per segment), evicts wholly
#   free segments of other classes when a new class needs room, and then `put` blocks, polling the
#   header, until a slot frees or `timeout_s` passes (`ShmFullError`).
# - Segments are reserved with posix_fallocate (no SIGBUS on a full tmpfs later) and mapped with
#   MAP_POPULATE (no page faults later).
#
# The header page, as uint64 words: segment fields, then one row of slot fields per slot.
_MAGIC = int.from_bytes(b"SLIPSHM1", "little")
_HEADER_BYTES = _PAGE
_META_WORDS = 8
_M_MAGIC, _M_RETIRED, _M_SLOT_BYTES, _M_NSLOTS = 0, 1, 2, 3
_SLOT_WORDS = 4
_S_STATE, _S_GEN, _S_PID = 0, 1, 2
MAX_SLOTS = (_HEADER_BYTES // 8 - _META_WORDS) // _SLOT_WORDS  # 126
FREE, WRITTEN, CLAIMED = 0, 1, 2

_GROW_BYTES = 256 << 20  # cap on one growth step for small classes: pre-faulting is not free
_DEAD_CHECK_S = 0.05
_names = itertools.count()  # unique segment numbers within this process


class ShmRef(msgspec.Struct, frozen=True, array_like=True):
    """A tensor's bytes in a shared-memory slot; travels in the MessagePack body."""

    name: str  # segment file under /dev/shm
    offset: int  # byte offset of the tensor in the segment
    nbytes: int
    slot: int
    generation: int  # the slot's generation at put time; any other value means stale


class ShmFullError(TimeoutError):
    """`put` found no free slot within its timeout: the receivers hold every slot."""


def _check_tag(run_tag: str) -> str:
    if not isinstance(run_tag, str) or not _TAG_RE.fullmatch(run_tag) or len(run_tag) > 64:
        raise ValueError(f"run_tag {run_tag!r} must be 1–64 characters of [A-Za-z0-9_.-], no edge dashes")
    return run_tag


class _Segment:
    """One mapped segment file: a header page, then `nslots` slots of `slot_bytes` each."""

    def __init__(self, name: str, fd: int, mm: mmap.mmap) -> None:
        self.name, self.fd, self.mm = name, fd, mm
        words = np.frombuffer(mm, dtype=np.uint64, count=_HEADER_BYTES // 8)
        self.meta = words[:_META_WORDS]
        rows = words[_META_WORDS : _META_WORDS + MAX_SLOTS * _SLOT_WORDS]
        self.slots = rows.reshape(MAX_SLOTS, _SLOT_WORDS)  # [slot, (state, generation, pid, spare)]
        self.slot_bytes = int(self.meta[_M_SLOT_BYTES])
        self.nslots = int(self.meta[_M_NSLOTS])
        self.stamps: list[float] = []  # sender only: monotonic time of the last put per slot

    def offset(self, slot: int) -> int:
        return _HEADER_BYTES + slot * self.slot_bytes

    @contextmanager
    def locked(self, slot: int) -> Iterator[None]:
        start = (_META_WORDS + slot * _SLOT_WORDS) * 8
        fcntl.lockf(self.fd, fcntl.LOCK_EX, _SLOT_WORDS * 8, start, os.SEEK_SET)
        try:
            yield
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN, _SLOT_WORDS * 8, start, os.SEEK_SET)

    def all_free(self) -> bool:
        return bool((self.slots[: self.nslots, _S_STATE] == FREE).all())

    def close(self) -> None:
        self.meta = self.slots = None  # type: ignore[assignment]
        with suppress(BufferError):  # tensors still alias it: the mapping goes when they do
            self.mm.close()
        os.close(self.fd)


class ShmArena:
    """Sender side: shared-memory slots, reused; `put` copies a tensor's bytes in. One per thread."""

    def __init__(
        self,
        run_tag: str,
        *,
        slot_bytes_max: int,
        capacity_bytes: int,
        slot_bytes_min: int = 1 << 20,
        timeout_s: float = 30.0,
    ) -> None:
        self.run_tag = _check_tag(run_tag)
        if slot_bytes_min < _PAGE or slot_bytes_min & (slot_bytes_min - 1):
            raise ValueError(f"slot_bytes_min={slot_bytes_min} must be a power of two ≥ {_PAGE}")
        if slot_bytes_max < 1:
            raise ValueError(f"slot_bytes_max={slot_bytes_max} must be positive")
        if capacity_bytes < slot_bytes_max:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be ≥ slot_bytes_max={slot_bytes_max}")
        self.slot_bytes_max = slot_bytes_max
        self.slot_bytes_min = slot_bytes_min
        self.capacity_bytes = capacity_bytes
        self.timeout_s = timeout_s
        self._top_class = -(-slot_bytes_max // _PAGE) * _PAGE
        self._classes: dict[int, list[_Segment]] = {}  # slot size → segments, oldest first
        self._paths: set[Path] = set()
        self._used = 0  # slot bytes across all segments
        self._dead_checked = 0.0
        # A sender that forgets close() (or exits normally) still unlinks; only a crash needs cleanup().
        self._finalizer = weakref.finalize(self, _unlink_all, self._paths)

    @property
    def used_bytes(self) -> int:
        """Slot bytes currently mapped (what counts against `capacity_bytes`)."""
        return self._used

    @property
    def segment_names(self) -> list[str]:
        return [s.name for segs in self._classes.values() for s in segs]

    def busy_slots(self) -> int:
        """Slots not FREE: written and in flight, or held by a receiver."""
        return sum(int((s.slots[: s.nslots, _S_STATE] != FREE).sum()) for s in self._segments())

    def put(self, raw: torch.Tensor, *, timeout_s: float | None = None) -> ShmRef | None:
        """Copies `raw` (uint8, 1-D, contiguous, any device) into a free slot and describes it.

        None when `raw` is empty or larger than `slot_bytes_max` (send it as a frame instead). Blocks
        while every slot is busy and the arena is at capacity; raises ShmFullError after `timeout_s`.
        """
        if raw.dtype != torch.uint8 or raw.dim() != 1 or not raw.is_contiguous():
            raise TypeError(f"put needs a contiguous 1-D uint8 tensor, got {raw.dtype} {tuple(raw.shape)}")
        if not self._finalizer.alive:
            raise RuntimeError("ShmArena is closed")
        nbytes = raw.numel()
        if nbytes == 0 or nbytes > self.slot_bytes_max:
            return None
        size = min(max(self.slot_bytes_min, 1 << (nbytes - 1).bit_length()), self._top_class)
        seg, slot = self._acquire(size, nbytes, self.timeout_s if timeout_s is None else timeout_s)
        offset = seg.offset(slot)
        # One copy into memory that is already faulted in; torch releases the GIL while it runs.
        torch.frombuffer(seg.mm, dtype=torch.uint8, count=nbytes, offset=offset).copy_(raw)
        generation = int(seg.slots[slot, _S_GEN]) + 1
        seg.slots[slot, _S_GEN] = generation
        seg.slots[slot, _S_STATE] = WRITTEN  # after the generation: WRITTEN implies the new generation
        seg.stamps[slot] = time.monotonic()
        return ShmRef(seg.name, offset, nbytes, slot, generation)

    def reclaim(self, older_than_s: float | None = None) -> int:
        """Frees slots whose claiming receiver died and, given `older_than_s`, slots whose descriptor
        was never taken that long after `put` (its message was lost). Returns how many were freed."""
        freed = 0
        now = time.monotonic()
        for seg in self._segments():
            for slot in range(seg.nslots):
                state = int(seg.slots[slot, _S_STATE])
                if state == CLAIMED and not pid_alive(int(seg.slots[slot, _S_PID])):
                    seg.slots[slot, _S_GEN] += np.uint64(1)
                    seg.slots[slot, _S_STATE] = FREE
                    freed += 1
                elif state == WRITTEN and older_than_s is not None and now - seg.stamps[slot] > older_than_s:
                    with seg.locked(slot):  # a receiver may be claiming it right now
                        if int(seg.slots[slot, _S_STATE]) == WRITTEN:
                            seg.slots[slot, _S_GEN] += np.uint64(1)
                            seg.slots[slot, _S_STATE] = FREE
                            freed += 1
        return freed

    def close(self) -> None:
        """Unlinks every segment. Receivers' existing tensors stay valid (their mappings remain)."""
        for seg in list(self._segments()):
            self._retire(seg)
        self._finalizer()

    def __enter__(self) -> ShmArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------------

    def _segments(self) -> Iterator[_Segment]:
        for segs in self._classes.values():
            yield from segs

    def _acquire(self, size: int, nbytes: int, timeout_s: float) -> tuple[_Segment, int]:
        deadline = time.monotonic() + timeout_s
        delay = 20e-6
        while True:
            bigger = [s for c, segs in sorted(self._classes.items()) if c > size for s in segs]
            # Exact size, then new room, then a bigger idle slot, and only then evict idle segments of
            # other sizes: evicting first would thrash (re-fault) when sizes alternate at capacity.
            found = (
                self._free_slot(self._classes.get(size, []))
                or (self._grow(size, evict=False) and self._free_slot(self._classes[size]))
                or self._free_slot(bigger)
                or (self._grow(size, evict=True) and self._free_slot(self._classes[size]))
            )
            if found:
                return found
            now = time.monotonic()
            if now - self._dead_checked > _DEAD_CHECK_S:
                self._dead_checked = now
                if self.reclaim():
                    continue
            if now >= deadline:
                raise ShmFullError(
                    f"shared-memory lane full: no slot for {nbytes} bytes freed within {timeout_s:g} s "
                    f"({self.busy_slots()} slot(s) busy, {self._used} of {self.capacity_bytes} bytes "
                    f"mapped); receivers must drop (or clone) the tensors they got"
                )
            time.sleep(delay)  # no message tells us a slot freed: poll the headers, backing off
            delay = min(delay * 2, 1e-3)

    @staticmethod
    def _free_slot(segments: list[_Segment]) -> tuple[_Segment, int] | None:
        for seg in segments:
            free = np.flatnonzero(seg.slots[: seg.nslots, _S_STATE] == FREE)
            if free.size:
                return seg, int(free[0])
        return None

    def _grow(self, size: int, *, evict: bool) -> bool:
        """Adds a segment of `size`-byte slots; with `evict`, unlinks wholly idle segments of other
        sizes (largest first) to make room."""
        if self.capacity_bytes - self._used < size:
            if not evict:
                return False
            idle = [s for c, segs in self._classes.items() if c != size for s in segs if s.all_free()]
            for seg in sorted(idle, key=lambda s: s.slot_bytes * s.nslots, reverse=True):
                self._retire(seg)
                if self.capacity_bytes - self._used >= size:
                    break
            else:
                return False
        # Double a size's slot count each time it runs out, so the steady state settles near the
        # number of tensors in flight without pre-faulting memory nobody uses.
        have = sum(s.nslots for s in self._classes.get(size, []))
        room = (self.capacity_bytes - self._used) // size
        nslots = max(1, min(have or 1, MAX_SLOTS, room, _GROW_BYTES // size))
        self._classes.setdefault(size, []).append(self._create(size, nslots))
        self._used += size * nslots
        return True

    def _create(self, slot_bytes: int, nslots: int) -> _Segment:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        while True:
            name = f"{PREFIX}{self.run_tag}-{os.getpid()}-{next(_names)}"
            path = SHM_DIR / name
            try:
                fd = os.open(path, flags, 0o600)
                break
            except FileExistsError:  # a crashed process with a recycled pid left it: skip the number
                continue
        self._paths.add(path)
        size = _HEADER_BYTES + slot_bytes * nslots
        try:
            try:
                os.posix_fallocate(fd, 0, size)  # tmpfs pages now: ENOSPC here, never SIGBUS mid-copy
            except OSError as e:
                raise OSError(e.errno, f"cannot reserve {size} bytes in {SHM_DIR} for {name}: {e}") from e
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            self._paths.discard(path)
            raise
        meta = np.frombuffer(mm, dtype=np.uint64, count=_META_WORDS)
        meta[_M_SLOT_BYTES], meta[_M_NSLOTS] = slot_bytes, nslots
        meta[_M_MAGIC] = _MAGIC  # last: a header with the magic is complete
        del meta
        seg = _Segment(name, fd, mm)
        seg.stamps = [0.0] * nslots
        return seg

    def _retire(self, seg: _Segment) -> None:
        seg.meta[_M_RETIRED] = 1  # tells receivers to drop their cached mapping
        self._classes[seg.slot_bytes].remove(seg)
        if not self._classes[seg.slot_bytes]:
            del self._classes[seg.slot_bytes]
        self._used -= seg.slot_bytes * seg.nslots
        path = SHM_DIR / seg.name
        path.unlink(missing_ok=True)
        self._paths.discard(path)
        seg.close()


def _unlink_all(paths: set[Path]) -> None:
    for path in list(paths):
        path.unlink(missing_ok=True)
    paths.clear()


def _release(slots: np.ndarray, slot: int, generation: int) -> None:
    # The last tensor over the slot died. Only free what is still ours: after our own death-reclaim
    # (impossible while we live) or a bug, the generation would have moved on.
    if int(slots[slot, _S_GEN]) == generation and int(slots[slot, _S_STATE]) == CLAIMED:
        slots[slot, _S_STATE] = FREE


class ShmReader:
    """Receiver side: maps segments named by descriptors (cached) and returns aliasing tensors."""

    def __init__(self, *, max_segments: int = 256) -> None:
        self.max_segments = max_segments
        self._maps: dict[str, _Segment] = {}

    def get(self, ref: ShmRef, dtype: torch.dtype, shape: list[int] | tuple[int, ...]) -> torch.Tensor:
        """A tensor aliasing the slot `ref` names; the slot frees when it and all its views are gone.

        `ref` comes from the wire: anything inconsistent raises ValueError naming the problem."""
        if not isinstance(ref, ShmRef):
            raise TypeError(f"get needs a ShmRef, got {type(ref).__name__}")
        for field in ("offset", "nbytes", "slot", "generation"):
            value = getattr(ref, field)
            if type(value) is not int or value < 0:
                raise ValueError(f"shm descriptor {field}={value!r} is not a non-negative int")
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes != ref.nbytes:
            raise ValueError(
                f"shm descriptor holds {ref.nbytes} bytes but {list(shape)} {dtype} needs {nbytes}"
            )
        if nbytes == 0:
            raise ValueError("shm descriptor for an empty tensor (empty tensors are sent inline)")
        seg = self._segment(ref.name)
        if ref.slot >= seg.nslots:
            raise ValueError(f"shm slot {ref.slot} out of range: {ref.name} has {seg.nslots} slot(s)")
        start = seg.offset(ref.slot)
        if not (start <= ref.offset and ref.offset + ref.nbytes <= start + seg.slot_bytes):
            raise ValueError(
                f"shm descriptor out of bounds: bytes [{ref.offset}, {ref.offset + ref.nbytes}) are not "
                f"inside slot {ref.slot} [{start}, {start + seg.slot_bytes}) of {ref.name}"
            )
        if ref.offset % _ALIGN:
            raise ValueError(f"shm descriptor offset {ref.offset} is not {_ALIGN}-byte aligned")
        with seg.locked(ref.slot):  # against the sender reclaiming this WRITTEN slot
            if seg.meta[_M_RETIRED]:
                raise ValueError(f"shm segment {ref.name} was retired by its sender")
            generation = int(seg.slots[ref.slot, _S_GEN])
            if generation != ref.generation:
                raise ValueError(
                    f"stale shm descriptor: generation {ref.generation}, but slot {ref.slot} of "
                    f"{ref.name} is at generation {generation} (reused or reclaimed)"
                )
            state = int(seg.slots[ref.slot, _S_STATE])
            if state != WRITTEN:
                what = "already claimed (descriptors are single-use)" if state == CLAIMED else "free"
                raise ValueError(f"shm slot {ref.slot} of {ref.name} is {what}, not written")
            seg.slots[ref.slot, _S_PID] = os.getpid()
            seg.slots[ref.slot, _S_STATE] = CLAIMED
        buf = np.frombuffer(seg.mm, dtype=np.uint8, count=nbytes, offset=ref.offset)  # [nbytes]
        # torch keeps `buf` alive for as long as any view of the storage lives; its death is the release.
        weakref.finalize(buf, _release, seg.slots, ref.slot, ref.generation)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)

    def close(self) -> None:
        """Drops cached mappings; tensors handed out stay valid."""
        for seg in self._maps.values():
            seg.close()
        self._maps.clear()

    def _segment(self, name: str) -> _Segment:
        seg = self._maps.get(name)
        if seg is not None:
            return seg
        if not isinstance(name, str) or len(name) > 200 or not _NAME_RE.fullmatch(name):
            raise ValueError(f"bad shm segment name {name!r}: not slipstream-<run>-<pid>-<n>")
        for old in [n for n, s in self._maps.items() if s.meta[_M_RETIRED]]:
            self._maps.pop(old).close()
        while len(self._maps) >= self.max_segments:
            self._maps.pop(next(iter(self._maps))).close()
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ValueError(f"shm segment {name} does not exist (sender closed or cleaned up)") from None
        except OSError as e:
            raise ValueError(f"cannot open shm segment {name}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise ValueError(f"shm segment {name} is not a private (0600, ours) regular file")
            # Check the header before mapping: the size decides how much MAP_POPULATE faults in.
            meta = np.frombuffer(os.pread(fd, _META_WORDS * 8, 0).ljust(_META_WORDS * 8, b"\0"), np.uint64)
            slot_bytes, nslots = int(meta[_M_SLOT_BYTES]), int(meta[_M_NSLOTS])
            if (
                int(meta[_M_MAGIC]) != _MAGIC
                or not 1 <= nslots <= MAX_SLOTS
                or not slot_bytes
                or slot_bytes % _PAGE
            ):
                raise ValueError(f"shm segment {name} has no valid slipstream header")
            if st.st_size != _HEADER_BYTES + nslots * slot_bytes:
                raise ValueError(
                    f"shm segment {name} size {st.st_size} disagrees with its header "
                    f"({nslots} slot(s) of {slot_bytes} bytes)"
                )
            # MAP_POPULATE: fault the whole segment in now, once, not page by page per message.
            seg = _Segment(name, fd, mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE))
        except BaseException:
            os.close(fd)
            raise
        self._maps[name] = seg
        return seg


def cleanup(run_tag: str) -> list[str]:
    """Unlinks every segment of run `run_tag` (any pid) and returns their names. Call at shutdown."""
    pattern = re.compile(rf"{re.escape(PREFIX + _check_tag(run_tag))}-\d+-\d+")
    removed = []
    for path in SHM_DIR.glob(f"{PREFIX}{run_tag}-*"):
        if pattern.fullmatch(path.name):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return sorted(removed)
