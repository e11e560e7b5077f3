"""Host bytes on disk: one file per store, aligned extents, direct I/O where the file system allows it.

The disk tier (issue 42) sits under the host tier: bytes the host cannot hold go to a file
and come back. This is the store only; nothing in the plan uses it yet.

- One file, not a file per tensor: a step moves thousands of tensors, and creating,
  opening and unlinking a file each would cost more than the bytes. The file is made by
  ``tempfile.mkstemp`` in the given directory and unlinked on ``close()``, when the store
  is collected, or at interpreter exit (``weakref.finalize``), so a crash-free run never
  leaves one behind.
- Extents are aligned to ``ALIGN`` (offset and reserved length) and carved first fit from a
  free list whose adjacent ranges merge, so freed room is reused and a repeating step's
  sizes keep the file at its high-water mark instead of growing it. Room past the end of
  the file is reserved with ``posix_fallocate`` before any byte is written, so a full disk
  fails at once with ``DiskFullError`` and the store stays usable.
- ``O_DIRECT`` keeps these bytes out of the page cache (they are the bytes the host had no
  room for). It needs aligned addresses, offsets and lengths: page-aligned bytes move in
  place, others through one aligned staging buffer of ``STAGING_BYTES`` (made at the first
  such transfer), reused chunk by chunk: tensors of any length are padded to ``ALIGN`` in the
  staging buffer, never in the caller's memory.
  ``direct=None`` tries it with one aligned write at open; a file system that refuses it
  (``EINVAL``: older tmpfs, some overlay and network file systems) gets buffered I/O and
  one warning per process saying which directory and why.
- One lock guards the free list and the live extents, held only while they change; a
  transfer holds none (``pwrite``/``pread`` of distinct extents are safe side by side), except
  the staging buffer's own lock when it goes through that one buffer. So the compute thread
  freeing an extent never waits for the I/O thread's transfer.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
import threading
import weakref
from bisect import bisect_left
from dataclasses import dataclass
from types import TracebackType

import torch

from hyperpar.offload.runtime.huge_pages import huge_page_bytes

logger = logging.getLogger(__name__)

ALIGN = 4096  # covers the logical block size O_DIRECT asks of offsets, lengths and addresses
STAGING_BYTES = 8 << 20  # bytes per transfer chunk; a multiple of ALIGN
FILE_PREFIX = "hyperpar-activations-"
FILE_SUFFIX = ".bin"

O_DIRECT: int | None = getattr(os, "O_DIRECT", None)  # None: this platform has none
posix_fallocate = getattr(os, "posix_fallocate", None)  # None: the file is extended, not reserved

_warn_lock = threading.Lock()
_fallback_warned = False


class DiskFullError(OSError):
    """The file system had no room for the bytes asked; the store's earlier extents are intact."""


@dataclass(frozen=True)
class Extent:
    """Where ``write`` put ``nbytes`` bytes: ``offset`` in the store's file (a multiple of ``ALIGN``)."""

    offset: int
    nbytes: int


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to ``ALIGN``."""
    return -(-nbytes // ALIGN) * ALIGN


def aligned_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` uninitialized CPU bytes starting at an ``ALIGN`` boundary (what ``O_DIRECT``
    moves in place; torch's own allocations are 64-byte aligned), on huge pages where the OS
    gives them (``runtime.huge_pages``)."""
    return huge_page_bytes(nbytes, ALIGN)


def _open_direct(path: str, block: memoryview) -> int:
    """A second descriptor on ``path`` with ``O_DIRECT``, tried with one aligned write of ``block``
    (some file systems accept the flag at open and refuse the I/O); ``OSError`` where refused."""
    assert O_DIRECT is not None
    fd = os.open(path, os.O_RDWR | O_DIRECT)
    try:
        if os.pwrite(fd, block, 0) != len(block):
            raise OSError(errno.EIO, f"short O_DIRECT probe write to {path}")
        os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _warn_fallback_once(directory: str, why: str) -> None:
    global _fallback_warned
    with _warn_lock:
        if _fallback_warned:
            return
        _fallback_warned = True
    logger.warning("hyperpar disk store: no O_DIRECT in %s (%s); using buffered I/O, so the page cache "
                   "holds a copy of the bytes written there too", directory, why)


class _File:
    """The descriptor and path the finalizer closes and unlinks (it must not reference the store)."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _check_directory(directory: str) -> None:
    if not os.path.exists(directory):
        raise FileNotFoundError(errno.ENOENT, f"DiskStore directory {directory!r} does not exist", directory)
    if not os.path.isdir(directory):
        raise NotADirectoryError(errno.ENOTDIR, f"DiskStore directory {directory!r} is not a directory",
                                 directory)
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, f"DiskStore directory {directory!r} is not writable", directory)


def _as_bytes(tensor: object, name: str) -> memoryview:
    """A flat byte view of a CPU uint8 contiguous tensor, or an error naming what was given."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.uint8:
        raise TypeError(f"{name} must have dtype torch.uint8, got {tensor.dtype}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got device {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got shape {tuple(tensor.shape)} "
                         f"with strides {tensor.stride()}")
    return memoryview(tensor.detach().reshape(-1).numpy())


class DiskStore:
    """Bytes of CPU uint8 tensors in one file of ``directory``: ``write`` -> ``Extent``, ``read``, ``free``.

    ``direct``: ``None`` uses ``O_DIRECT`` where the file system accepts it and buffered I/O
    otherwise (one warning per process); ``True`` raises where it is refused; ``False`` is
    buffered. ``self.direct`` says which one the store uses.
    """

    def __init__(self, directory: str | os.PathLike[str], *, direct: bool | None = None) -> None:
        self.directory = os.fspath(directory)
        _check_directory(self.directory)
        try:
            fd, path = tempfile.mkstemp(prefix=FILE_PREFIX, suffix=FILE_SUFFIX, dir=self.directory)
        except PermissionError as exc:
            raise PermissionError(exc.errno, f"DiskStore directory {self.directory!r} is not writable: "
                                  f"{exc.strerror}", self.directory) from exc
        self._file = _File(fd, path)
        self._finalizer = weakref.finalize(self, self._file.close)
        self.path = path
        self._staging_tensor: torch.Tensor | None = None  # made at the first transfer that needs it
        try:
            self.direct = self._choose_direct(direct)
        except BaseException:
            self._finalizer()
            raise
        self._lock = threading.Lock()  # the free list, the live extents and the counters
        self._staging_lock = threading.Lock()  # the one staging buffer; in-place transfers need no lock
        self._free: list[list[int]] = []  # [offset, length], sorted by offset, none adjacent
        self._live: dict[int, int] = {}  # offset -> nbytes of each extent written and not freed
        self._end = 0
        self.bytes_written = 0
        self.bytes_read = 0

    def _choose_direct(self, direct: bool | None) -> bool:
        if direct is False:
            return False
        if O_DIRECT is None:
            why = "this platform has no O_DIRECT"
        else:
            try:
                fd = _open_direct(self.path, memoryview(aligned_bytes(ALIGN).numpy()))
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                why = f"the file system refuses it: {exc.strerror or exc}"
            else:
                os.close(self._file.fd)
                self._file.fd = fd
                return True
        if direct:
            raise OSError(errno.EINVAL, f"DiskStore(direct=True): no O_DIRECT in {self.directory!r} ({why})")
        _warn_fallback_once(self.directory, why)
        return False

    @property
    def staging_bytes(self) -> int:
        """Host bytes of the staging buffer: 0 until a transfer needs it (bytes not page-aligned
        under direct I/O), then ``STAGING_BYTES`` and a page of alignment."""
        return 0 if self._staging_tensor is None else STAGING_BYTES + ALIGN

    def _staging(self) -> memoryview:
        if self._staging_tensor is None:
            self._staging_tensor = aligned_bytes(STAGING_BYTES)
        return memoryview(self._staging_tensor.numpy())

    @property
    def file_bytes(self) -> int:
        """The file's size: the high-water mark of the extents, not the bytes live now."""
        return self._end

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def write(self, src: torch.Tensor) -> Extent:
        """Copy ``src`` (CPU uint8, contiguous, 1-D, any length) into a new extent of the file."""
        data = _as_bytes(src, "src")
        if src.dim() != 1:
            raise ValueError(f"src must be 1-D, got shape {tuple(src.shape)}")
        nbytes = len(data)
        with self._lock:
            fd = self._open_fd()
            if nbytes == 0:
                return Extent(0, 0)  # occupies nothing: read and free have nothing to do
            offset = self._allocate(aligned(nbytes))
        try:
            if self._in_place(src, nbytes):
                self._transfer(fd, data, nbytes, offset, writing=True)
            else:
                with self._staging_lock:
                    staging = self._staging()
                    for pos in range(0, nbytes, STAGING_BYTES):
                        n = min(STAGING_BYTES, nbytes - pos)
                        staging[:n] = data[pos:pos + n]
                        self._transfer(fd, staging, aligned(n), offset + pos, writing=True)
        except BaseException:
            with self._lock:
                self._release(offset, aligned(nbytes))
            raise
        with self._lock:
            self._live[offset] = nbytes
            self.bytes_written += nbytes
        return Extent(offset, nbytes)

    def read(self, extent: Extent, dst: torch.Tensor) -> None:
        """Fill ``dst`` (CPU uint8, contiguous, ``extent.nbytes`` elements) with the extent's bytes."""
        out = _as_bytes(dst, "dst")
        if len(out) != extent.nbytes:
            raise ValueError(f"dst must have {extent.nbytes} elements for {extent}, got {len(out)} "
                             f"(shape {tuple(dst.shape)})")
        with self._lock:
            fd = self._open_fd()
            if extent.nbytes == 0:
                return
            self._check_live(extent)
        if self._in_place(dst, extent.nbytes):
            self._transfer(fd, out, extent.nbytes, extent.offset, writing=False)
        else:
            with self._staging_lock:
                staging = self._staging()
                for pos in range(0, extent.nbytes, STAGING_BYTES):
                    n = min(STAGING_BYTES, extent.nbytes - pos)
                    self._transfer(fd, staging, aligned(n), extent.offset + pos, writing=False)
                    out[pos:pos + n] = staging[:n]
        with self._lock:
            self.bytes_read += extent.nbytes

    def free(self, extent: Extent) -> None:
        """Give the extent's room back for later writes; its bytes are not read again."""
        with self._lock:
            self._open_fd()
            if extent.nbytes == 0:
                return
            self._check_live(extent)
            del self._live[extent.offset]
            self._release(extent.offset, aligned(extent.nbytes))

    def close(self) -> None:
        """Close the file and unlink it; later calls do nothing."""
        self._finalizer()

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._live)} extents, {self._end} file bytes"
        return f"DiskStore({self.path!r}, direct={self.direct}, {state})"

    def _open_fd(self) -> int:
        if self.closed:
            raise RuntimeError(f"DiskStore {self.path!r} is closed")
        return self._file.fd

    def _check_live(self, extent: Extent) -> None:
        if self._live.get(extent.offset) != extent.nbytes:
            raise ValueError(f"{extent} is not a live extent of DiskStore {self.path!r} "
                             "(freed, or from another store)")

    def _in_place(self, tensor: torch.Tensor, nbytes: int) -> bool:
        """Whether the caller's bytes can move without the staging copy: always with buffered
        I/O; with ``O_DIRECT`` where their address and length are page-aligned (pinned host
        memory is): one copy of every byte less."""
        return not self.direct or (tensor.data_ptr() % ALIGN == 0 and nbytes % ALIGN == 0)

    def _transfer(self, fd: int, buf: memoryview, length: int, offset: int, *, writing: bool) -> None:
        """``length`` bytes of ``buf`` to (``writing``) or from ``offset``, resuming short transfers."""
        done = 0
        while done < length:
            view = buf[done:length]
            try:
                n = os.pwrite(fd, view, offset + done) if writing else os.preadv(fd, [view], offset + done)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # a file system that reserves lazily
                    raise self._full(length - done) from exc
                raise
            if n <= 0:
                raise OSError(errno.EIO, f"DiskStore {self.path!r}: {'write' if writing else 'read'} "
                              f"at offset {offset + done} moved {n} of {length - done} bytes")
            done += n

    def _full(self, nbytes: int) -> DiskFullError:
        return DiskFullError(errno.ENOSPC, f"no room in {self.directory!r} for {nbytes} more bytes "
                             f"(DiskStore file {self.path!r} holds {self._end})")

    def _allocate(self, length: int) -> int:
        """First fit on the free list; else the end of the file, grown by what the last free range lacks."""
        for i, (offset, room) in enumerate(self._free):
            if room >= length:
                if room == length:
                    del self._free[i]
                else:
                    self._free[i] = [offset + length, room - length]
                return offset
        tail = self._free[-1] if self._free and sum(self._free[-1]) == self._end else None
        offset = tail[0] if tail else self._end
        self._grow(offset + length)
        if tail:
            self._free.pop()
        return offset

    def _grow(self, end: int) -> None:
        """Reserve the file up to ``end`` before any byte is written there, so a full disk fails here."""
        fd, old = self._file.fd, self._end
        try:
            if posix_fallocate is not None:
                posix_fallocate(fd, old, end - old)
            else:
                os.ftruncate(fd, end)
        except OSError as exc:
            os.ftruncate(fd, old)  # drop whatever part was reserved
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._full(end - old) from exc
            raise
        self._end = end

    def _release(self, offset: int, length: int) -> None:
        """Insert a free range and merge it with the free ranges it touches."""
        i = bisect_left(self._free, [offset, length])
        if i < len(self._free) and offset + length == self._free[i][0]:
            length += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == offset:
            self._free[i - 1][1] += length
        else:
            self._free.insert(i, [offset, length])
