"""Same-host bulk lane: large tensors travel through reused shared memory, only a descriptor on the wire.

Why: a large frame over ipc:// makes libzmq allocate and page-fault a fresh receive buffer per message,
far below memcpy speed (docs/benchmarks.md). Here the sender copies the bytes once into a slot of a
pre-faulted /dev/shm segment it keeps reusing, and the body carries a `ShmRef` (segment, offset, nbytes,
slot, generation); the receiver maps the segment once and gets a tensor that *aliases* the slot.

The non-obvious choice: release needs no message. A segment's header page holds per slot its
`generation`, the claims still `pending` and one pid cell per reader; a receiver clears its cell when the
last tensor (or view) over the slot is freed, and the sender simply sees it. A slot may be written once
for several receivers (`put(readers=n)`). The protocol, its locking and ordering: the comment above the
header layout. `ShmArena` (sender) grows in power-of-two size classes up to a capacity, then `put` blocks
until a slot frees (`ShmFullError` after its timeout): the backpressure. `ShmReader` receives. Segments
are `slipstream-{run_tag}-{pid}-{n}`, mode 0600; `cleanup(run_tag)` removes what a crash left.
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

# Slot protocol. A slot is written once for `readers` receivers (1 to MAX_READERS: a broadcast, such as a
# weight bucket every rollout on the host applies, is one copy however many read it), and each of them
# claims it once and releases it once:
#
#     free ──put(readers=n) (sender)──▶ pending = n ──get (a receiver)──▶ pending - 1, its cell = its pid
#       ▲                                                                  │
#       └── pending = 0 and every cell 0 ◀──last view freed (that receiver): its cell = 0
#                                          ◀──claimer pid dead (sender, reclaim): its cell = 0
#                                          ◀──reclaim(older_than_s): descriptors lost (sender): pending = 0
#
# - A slot is free when no descriptor is pending and no receiver holds it: `pending` == 0 and every reader
#   cell is 0. Only the sender reuses a slot, and it decides that from the header alone; no message says so.
# - Only the sender writes a new content: data, then `generation` + 1, then `readers` and `pending`, then
#   the descriptor goes out (a syscall). A descriptor whose generation is not the slot's is stale and `get`
#   refuses it, so a late or replayed descriptor can never read a reused slot; one taken by all of its
#   readers already is refused too.
# - A claim (receiver) and a lost-descriptor reclaim (sender) race on `pending`, so both hold an fcntl lock
#   on the slot's header bytes. A receiver writes its cell before it decrements `pending`; the sender reads
#   `pending` before the cells. Each cell has one writer at a time (its receiver; the sender only once
#   that receiver is dead), so a release takes no lock.
# - Ordering: plain stores in program order, read in the opposite order, as above. x86-64 (TSO) keeps
#   that; a weakly ordered CPU would need fences that Python cannot express.
# - The receiver's tensor is torch.frombuffer over a numpy array over the mapping; torch holds that array
#   until the storage dies (views included), and `weakref.finalize` on the array clears the cell.
# - A receiver that dies holding slots: the sender clears cells whose pid is gone (`pid_alive`: a zombie
#   counts as gone), automatically whenever `put` finds no free slot (and on `reclaim()`). Pids must share
#   a namespace (same host, no separate pid namespaces). A descriptor that never arrived (message dropped)
#   keeps its slot pending until the owner calls `reclaim(older_than_s)` with a bound well above delivery
#   latency.
# - Slots come in power-of-two size classes; a class's segment grows by doubling its slot count. The
#   arena grows to `capacity_bytes` of slot memory (plus a 4 KiB header page per segment), evicts wholly
#   free segments of other classes when a new class needs room, and then `put` blocks, polling the
#   header, until a slot frees or `timeout_s` passes (`ShmFullError`).
# - Segments are reserved with posix_fallocate (no SIGBUS on a full tmpfs later) and mapped with
#   MAP_POPULATE (no page faults later).
#
# The header page, as uint64 words: segment fields, then one row of slot fields per slot.
_MAGIC = int.from_bytes(b"SLIPSHM2", "little")
_HEADER_BYTES = _PAGE
_META_WORDS = 8
_M_MAGIC, _M_RETIRED, _M_SLOT_BYTES, _M_NSLOTS = 0, 1, 2, 3
MAX_READERS = 8
"""Receivers one slot can be written for (a host's rollouts: one per GPU on an 8-GPU node)."""
_S_GEN, _S_READERS, _S_PENDING, _S_CELLS = 0, 1, 2, 3  # cells: MAX_READERS words, a claimer's pid each
_SLOT_WORDS = _S_CELLS + MAX_READERS + 1  # and one spare, for an even row
MAX_SLOTS = (_HEADER_BYTES // 8 - _META_WORDS) // _SLOT_WORDS  # 42

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
        self.slots = rows.reshape(MAX_SLOTS, _SLOT_WORDS)  # [slot, (generation, readers, pending, cells…)]
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

    def free_mask(self) -> np.ndarray:
        """[nslots] bool: slots no descriptor is pending for and no receiver holds (read in that order)."""
        rows = self.slots[: self.nslots]
        pending = rows[:, _S_PENDING] == 0
        return pending & (rows[:, _S_CELLS : _S_CELLS + MAX_READERS] == 0).all(axis=1)

    def all_free(self) -> bool:
        return bool(self.free_mask().all())

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
        """Slots not free: written and in flight, or held by a receiver."""
        return sum(int((~s.free_mask()).sum()) for s in self._segments())

    def put(self, raw: torch.Tensor, *, readers: int = 1, timeout_s: float | None = None) -> ShmRef | None:
        """Copies `raw` (uint8, 1-D, contiguous, any device) into a free slot and describes it, for
        `readers` receivers (send the one descriptor to each): the slot frees once each has claimed and
        released it.

        None when `raw` is empty or larger than `slot_bytes_max` (send it as a frame instead). Blocks
        while every slot is busy and the arena is at capacity; raises ShmFullError after `timeout_s`.
        """
        if raw.dtype != torch.uint8 or raw.dim() != 1 or not raw.is_contiguous():
            raise TypeError(f"put needs a contiguous 1-D uint8 tensor, got {raw.dtype} {tuple(raw.shape)}")
        if type(readers) is not int or not 1 <= readers <= MAX_READERS:
            raise ValueError(f"readers={readers!r}: a slot is written for 1 to {MAX_READERS} receivers")
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
        seg.slots[slot, _S_READERS] = readers
        seg.slots[slot, _S_PENDING] = readers  # last: a pending claim implies the new generation
        seg.stamps[slot] = time.monotonic()
        return ShmRef(seg.name, offset, nbytes, slot, generation)

    def reclaim(self, older_than_s: float | None = None) -> int:
        """Releases the claims of receivers that died and, given `older_than_s`, the pending claims of
        descriptors never taken that long after `put` (their message was lost). Returns how many slots
        that made free."""
        freed = 0
        now = time.monotonic()
        for seg in self._segments():
            before = seg.free_mask()
            for slot in np.flatnonzero(~before):
                cells = seg.slots[slot, _S_CELLS : _S_CELLS + MAX_READERS]
                for k in np.flatnonzero(cells):
                    if not pid_alive(int(cells[k])):
                        cells[k] = 0  # its receiver is gone: nobody else writes this cell now
                if (
                    older_than_s is not None
                    and seg.slots[slot, _S_PENDING]
                    and now - seg.stamps[slot] > older_than_s
                ):
                    with seg.locked(slot):  # a receiver may be claiming it right now
                        seg.slots[slot, _S_PENDING] = 0
            now_free = np.flatnonzero(seg.free_mask() & ~before)
            # A late descriptor of a slot freed here must not claim it: it is stale from now on. Releases
            # check their cell, not the generation, so readers still holding a slot are not affected.
            seg.slots[now_free, _S_GEN] += np.uint64(1)
            freed += now_free.size
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
            free = np.flatnonzero(seg.free_mask())
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


def _release(slots: np.ndarray, slot: int, cell: int, pid: int) -> None:
    # The last view of this receiver's claim died: clear its cell. Only while the cell is still ours (the
    # sender clears it only once we are dead, and reuses the slot only once it is clear).
    if int(slots[slot, _S_CELLS + cell]) == pid:
        slots[slot, _S_CELLS + cell] = 0


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
        with seg.locked(ref.slot):  # against other readers' claims and the sender's lost-descriptor reclaim
            if seg.meta[_M_RETIRED]:
                raise ValueError(f"shm segment {ref.name} was retired by its sender")
            generation = int(seg.slots[ref.slot, _S_GEN])
            if generation != ref.generation:
                raise ValueError(
                    f"stale shm descriptor: generation {ref.generation}, but slot {ref.slot} of "
                    f"{ref.name} is at generation {generation} (reused or reclaimed)"
                )
            readers, pending = int(seg.slots[ref.slot, _S_READERS]), int(seg.slots[ref.slot, _S_PENDING])
            if pending == 0 or pending > readers or readers > MAX_READERS:
                held = bool(seg.slots[ref.slot, _S_CELLS : _S_CELLS + MAX_READERS].any())
                what = (
                    f"already claimed (by all {readers} of its reader(s): a descriptor is single-use per reader)"
                    if held
                    else "free, not written"
                )
                raise ValueError(f"shm slot {ref.slot} of {ref.name} is {what}")
            cell, pid = readers - pending, os.getpid()
            seg.slots[ref.slot, _S_CELLS + cell] = pid  # before pending: the sender reads them the other way
            seg.slots[ref.slot, _S_PENDING] = pending - 1
        buf = np.frombuffer(seg.mm, dtype=np.uint8, count=nbytes, offset=ref.offset)  # [nbytes]
        # torch keeps `buf` alive for as long as any view of the storage lives; its death is the release.
        weakref.finalize(buf, _release, seg.slots, ref.slot, cell, pid)
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
