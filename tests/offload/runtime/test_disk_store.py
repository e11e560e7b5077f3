"""DiskStore: bytes round-trip through one file with real I/O, freed room is reused, the O_DIRECT
fallback is said once, the file never outlives the store, and bad input fails naming what was given."""

from __future__ import annotations

import errno
import fcntl
import gc
import itertools
import logging
import os
import random
import re
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import hyperpar.offload.runtime.disk_store as disk_store
from hyperpar.offload.runtime.disk_store import (
    ALIGN,
    STAGING_BYTES,
    DiskFullError,
    DiskStore,
    Extent,
    aligned_bytes,
)
from tests.subprocess_harness import run_python

LOGGER = disk_store.__name__
SIZES = [0, 1, 4095, 4096, 4097, (3 << 20) + 7, 2 * STAGING_BYTES + 5]


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def read_back(store: DiskStore, extent: Extent) -> torch.Tensor:
    out = torch.empty(extent.nbytes, dtype=torch.uint8)
    store.read(extent, out)
    return out


def store_files(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"{disk_store.FILE_PREFIX}*{disk_store.FILE_SUFFIX}"))


@pytest.fixture
def refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The file system refuses O_DIRECT the way tmpfs does (EINVAL), and no warning was said yet."""

    def refuse(path: str, block: memoryview) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(disk_store, "_open_direct", refuse)
    monkeypatch.setattr(disk_store, "_fallback_warned", False)


@pytest.fixture(params=[None, False, True], ids=["auto", "buffered", "direct"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DiskStore]:
    direct = request.param
    try:
        made = DiskStore(tmp_path, direct=direct)
    except OSError as exc:
        if direct is not True or exc.errno != errno.EINVAL:
            raise
        pytest.skip(f"{tmp_path} refuses O_DIRECT: {exc}")
    assert made.direct is (direct if direct is not None else made.direct)
    with made:
        yield made


def test_every_size_round_trips_bitwise(store: DiskStore) -> None:
    extents = []
    for seed, n in enumerate(SIZES):
        extent = store.write(random_bytes(n, seed))
        assert extent.nbytes == n and extent.offset % ALIGN == 0
        extents.append(extent)
    for seed, (n, extent) in enumerate(zip(SIZES, extents, strict=True)):
        assert torch.equal(read_back(store, extent), random_bytes(n, seed)), n
    assert store.bytes_written == store.bytes_read == sum(SIZES)
    assert store.file_bytes == os.path.getsize(store.path) == sum(-(-n // ALIGN) * ALIGN for n in SIZES)


def test_interleaved_writes_frees_and_reads_keep_every_live_extent(store: DiskStore) -> None:
    rng = random.Random(0)
    live: dict[Extent, int] = {}
    for step in range(200):
        if live and rng.random() < 0.4:
            extent = rng.choice(list(live))
            assert torch.equal(read_back(store, extent), random_bytes(extent.nbytes, live.pop(extent)))
            store.free(extent)
        else:
            n = rng.choice([1, 100, 4095, 4096, 4097, 9000, 70_000, 300_001])
            live[store.write(random_bytes(n, step))] = step
    for extent, seed in live.items():
        assert torch.equal(read_back(store, extent), random_bytes(extent.nbytes, seed))
    spans = sorted((e.offset, e.offset + e.nbytes) for e in live)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))


def test_freed_extents_are_reused_so_the_file_stays_at_its_high_water_mark(store: DiskStore) -> None:
    sizes = [5000, 123, 70_000, 4096]
    for round_ in range(30):
        extents = [store.write(random_bytes(n, round_)) for n in sizes]
        for extent in extents:
            store.free(extent)
    assert store.file_bytes == os.path.getsize(store.path) == 8192 + 4096 + 73_728 + 4096


def test_first_fit_takes_a_freed_hole_and_adjacent_holes_merge(store: DiskStore) -> None:
    a, b, c = (store.write(random_bytes(n, n)) for n in (4096, 8192, 4096))
    assert (a.offset, b.offset, c.offset) == (0, 4096, 12_288)
    store.free(b)
    assert store.write(random_bytes(100, 1)).offset == 4096  # the first hole that fits
    store.free(a)  # holes 0..4096 and 8192..12288, kept apart by the 100 bytes at 4096
    assert store.write(random_bytes(8192, 2)).offset == 16_384  # neither hole fits: the end
    assert store.write(random_bytes(4096, 3)).offset == 0  # the lowest hole that fits
    assert store.write(random_bytes(4096, 4)).offset == 8192
    assert torch.equal(read_back(store, c), random_bytes(4096, 4096))


def test_free_ranges_that_touch_merge_into_one(store: DiskStore) -> None:
    a, b, c = (store.write(random_bytes(4096, i)) for i in range(3))
    store.free(c)
    store.free(a)
    store.free(b)  # touches both: one range 0..12288
    assert store.write(random_bytes(3 * 4096, 9)).offset == 0
    assert store.file_bytes == 3 * 4096


def test_growth_extends_the_free_range_at_the_end_instead_of_skipping_it(store: DiskStore) -> None:
    a, b = store.write(random_bytes(4096, 0)), store.write(random_bytes(4096, 1))
    store.free(b)
    bigger = store.write(random_bytes(3 * 4096, 2))
    assert bigger.offset == b.offset and store.file_bytes == 4 * 4096
    assert torch.equal(read_back(store, a), random_bytes(4096, 0))


def test_direct_is_used_where_the_file_system_accepts_it(tmp_path: Path) -> None:
    if disk_store.O_DIRECT is None:
        pytest.skip("this platform has no O_DIRECT")
    try:
        with DiskStore(tmp_path, direct=True) as store:
            assert store.direct
            flags = fcntl.fcntl(store._file.fd, fcntl.F_GETFL)
            assert flags & disk_store.O_DIRECT
    except OSError as exc:
        assert exc.errno == errno.EINVAL and str(tmp_path) in str(exc)
        pytest.skip(f"{tmp_path} refuses O_DIRECT: {exc}")
    with DiskStore(tmp_path) as auto:
        assert auto.direct  # None chooses it too where it works


@pytest.mark.usefixtures("refused")
def test_a_refused_o_direct_falls_back_to_buffered_and_warns_once_per_process(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first, second = DiskStore(tmp_path), DiskStore(tmp_path / ".." / tmp_path.name)
    warnings = [r for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert str(tmp_path) in warnings[0].getMessage() and "Invalid argument" in warnings[0].getMessage()
    for store in (first, second):
        with store:
            assert not store.direct
            assert torch.equal(read_back(store, store.write(random_bytes(5000, 3))), random_bytes(5000, 3))


@pytest.mark.usefixtures("refused")
def test_direct_true_refuses_where_o_direct_is_refused_and_leaves_no_file(tmp_path: Path) -> None:
    with pytest.raises(OSError, match=r"direct=True.*Invalid argument") as info:
        DiskStore(tmp_path, direct=True)
    assert info.value.errno == errno.EINVAL and str(tmp_path) in str(info.value)
    assert store_files(tmp_path) == []


def test_a_platform_without_o_direct_falls_back_with_the_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(disk_store, "O_DIRECT", None)
    monkeypatch.setattr(disk_store, "_fallback_warned", False)
    with caplog.at_level(logging.WARNING, logger=LOGGER), DiskStore(tmp_path) as store:
        assert not store.direct
    assert "this platform has no O_DIRECT" in caplog.text
    with pytest.raises(OSError, match="no O_DIRECT"):
        DiskStore(tmp_path, direct=True)


def test_buffered_store_says_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(disk_store, "_fallback_warned", False)
    with caplog.at_level(logging.WARNING, logger=LOGGER), DiskStore(tmp_path, direct=False) as store:
        assert not store.direct
    assert caplog.records == []


def test_close_unlinks_the_file_is_idempotent_and_later_use_raises(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    extent = store.write(random_bytes(10, 0))
    path = Path(store.path)
    assert path.parent == tmp_path and path.exists() and store_files(tmp_path) == [path]
    store.close()
    store.close()
    assert not path.exists() and store.closed
    for use in (lambda: store.write(random_bytes(10, 0)), lambda: read_back(store, extent),
                lambda: store.free(extent)):
        with pytest.raises(RuntimeError, match="is closed"):
            use()


def test_the_context_manager_closes(tmp_path: Path) -> None:
    with DiskStore(tmp_path) as store:
        store.write(random_bytes(10, 0))
    assert store.closed and store_files(tmp_path) == []


def test_a_store_dropped_without_close_removes_its_file(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    store.write(random_bytes(5000, 0))
    path = Path(store.path)
    assert path.exists()
    del store
    gc.collect()
    assert not path.exists()


def test_interpreter_exit_without_close_removes_the_file(tmp_path: Path) -> None:
    code = ("import torch\n"
            "from hyperpar.offload.runtime.disk_store import DiskStore\n"
            f"store = DiskStore({str(tmp_path)!r})\n"
            "store.write(torch.ones(10_000, dtype=torch.uint8))\n"
            "print(store.path, flush=True)\n")
    done = run_python(code, timeout=120)
    assert done.code == 0, done.describe()
    path = Path(done.stdout.strip())
    assert path.parent == tmp_path and path.name.startswith(disk_store.FILE_PREFIX)
    assert not path.exists() and store_files(tmp_path) == []


def test_a_missing_directory_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        DiskStore(missing)
    assert str(missing) in str(info.value)


def test_a_file_instead_of_a_directory_is_named(tmp_path: Path) -> None:
    a_file = tmp_path / "plain.txt"
    a_file.write_text("x")
    with pytest.raises(NotADirectoryError, match="is not a directory") as info:
        DiskStore(a_file)
    assert str(a_file) in str(info.value)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root writes into a read-only directory, so chmod cannot make one here")
def test_a_read_only_directory_is_named(tmp_path: Path) -> None:
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(PermissionError, match="is not writable") as info:
            DiskStore(read_only)
        assert str(read_only) in str(info.value)
    finally:
        read_only.chmod(stat.S_IRWXU)


def test_a_full_disk_fails_early_and_leaves_the_store_usable(store: DiskStore,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    before = [store.write(random_bytes(n, n)) for n in (4097, 100)]
    real = disk_store.posix_fallocate
    assert real is not None
    calls: list[tuple[int, int]] = []

    def full_once(fd: int, offset: int, length: int) -> None:
        calls.append((offset, length))
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(disk_store, "posix_fallocate", full_once)
    size_before, written_before = store.file_bytes, store.bytes_written
    with pytest.raises(DiskFullError) as info:
        store.write(random_bytes(20_000, 7))
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    assert str(store.directory) in str(info.value) and "20480 more bytes" in str(info.value)
    assert calls == [(size_before, 20_480)]
    assert store.file_bytes == os.path.getsize(store.path) == size_before
    assert store.bytes_written == written_before
    for n, extent in zip((4097, 100), before, strict=True):
        assert torch.equal(read_back(store, extent), random_bytes(n, n))
    after = store.write(random_bytes(20_000, 7))  # the next reservation succeeds
    assert torch.equal(read_back(store, after), random_bytes(20_000, 7))
    assert after.offset == size_before and len(calls) == 2


@pytest.mark.parametrize(("tensor", "error", "message"), [
    (torch.zeros(8, dtype=torch.float32), TypeError, "dtype torch.uint8, got torch.float32"),
    (torch.zeros(8, 2, dtype=torch.uint8)[:, 0], ValueError,
     r"contiguous, got shape \(8,\) with strides \(2,\)"),
    (torch.zeros(2, 4, dtype=torch.uint8), ValueError, r"1-D, got shape \(2, 4\)"),
    (torch.zeros(8, dtype=torch.uint8, device="meta"), ValueError, "on the CPU, got device meta"),
    (bytearray(8), TypeError, "torch.Tensor, got bytearray"),
])
def test_bad_tensors_are_rejected_naming_what_was_given(tmp_path: Path, tensor: object, error: type,
                                                        message: str) -> None:
    with DiskStore(tmp_path) as store:
        with pytest.raises(error, match=f"src must .*{message}"):
            store.write(tensor)  # type: ignore[arg-type]
        assert store.file_bytes == 0 and store.bytes_written == 0


def test_reads_of_the_wrong_size_or_a_freed_extent_and_double_frees_are_rejected(store: DiskStore) -> None:
    extent = store.write(random_bytes(5000, 0))
    with pytest.raises(ValueError, match=r"dst must have 5000 elements .* got 4999"):
        store.read(extent, torch.empty(4999, dtype=torch.uint8))
    with pytest.raises(TypeError, match=r"dst must have dtype torch\.uint8, got torch\.int32"):
        store.read(extent, torch.empty(1250, dtype=torch.int32))
    out = torch.empty(50, 100, dtype=torch.uint8)  # any contiguous shape of the right size
    store.read(extent, out)
    assert torch.equal(out.reshape(-1), random_bytes(5000, 0))
    store.free(extent)
    with pytest.raises(ValueError, match="not a live extent"):
        store.read(extent, torch.empty(5000, dtype=torch.uint8))
    with pytest.raises(ValueError, match="not a live extent"):
        store.free(extent)
    with pytest.raises(ValueError, match="not a live extent"):
        store.free(Extent(1 << 30, 10))


def test_threads_sharing_a_store_each_read_back_their_own_bytes(store: DiskStore) -> None:
    failures: list[str] = []

    def work(worker: int) -> None:
        for i in range(25):
            data = random_bytes(1000 + 4096 * (i % 5) + worker, 100 * worker + i)
            extent = store.write(data)
            if not torch.equal(read_back(store, extent), data):
                failures.append(f"worker {worker} round {i}")
            store.free(extent)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert store.bytes_written == store.bytes_read == sum(
        1000 + 4096 * (i % 5) + w for w in range(4) for i in range(25))


def test_a_write_that_fails_midway_gives_its_room_back(store: DiskStore,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system that reserves lazily says ENOSPC at the write: same error, no extent leaked."""
    kept = store.write(random_bytes(4096, 0))
    real = os.pwrite
    fail = [True]

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        # past two chunks' worth (staged: the third chunk, after two were written; a buffered
        # store or aligned bytes move in place, in one transfer)
        if fail[0] and offset + len(data) > 2 * STAGING_BYTES + kept.nbytes:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(DiskFullError, match=f"{re.escape(store.directory)}.* for \\d+ more bytes"):
        store.write(random_bytes(2 * STAGING_BYTES + 5, 1))
    size = store.file_bytes
    fail[0] = False
    again = store.write(random_bytes(2 * STAGING_BYTES + 5, 1))
    assert again.offset == kept.offset + ALIGN and store.file_bytes == size
    assert torch.equal(read_back(store, again), random_bytes(2 * STAGING_BYTES + 5, 1))
    assert torch.equal(read_back(store, kept), random_bytes(4096, 0))


def test_aligned_bytes_move_in_place_and_unaligned_ones_through_staging(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With O_DIRECT, aligned host bytes (the host pool's slabs are) skip the staging copy;
    others go through it. Either way the bytes come back whole."""
    store = DiskStore(tmp_path)
    if not store.direct:
        store.close()
        pytest.skip("no O_DIRECT on this file system: every transfer is in place")
    buffers: list[int] = []
    real = store._transfer

    def transfer(fd: int, buf: memoryview, length: int, offset: int, *, writing: bool) -> None:
        buffers.append(0 if len(buf) == STAGING_BYTES else 1)  # the staging buffer, or the caller's bytes
        real(fd, buf, length, offset, writing=writing)

    monkeypatch.setattr(store, "_transfer", transfer)
    aligned_src = aligned_bytes(2 * ALIGN).copy_(random_bytes(2 * ALIGN, 3))
    extent = store.write(aligned_src)
    out = aligned_bytes(2 * ALIGN)
    store.read(extent, out)
    assert buffers == [1, 1] and torch.equal(out, aligned_src)
    assert store.staging_bytes == 0, "aligned transfers alone made a staging buffer"
    buffers.clear()
    odd = random_bytes(ALIGN + 1, 4)
    assert torch.equal(read_back(store, store.write(odd)), odd) and buffers == [0, 0]
    assert store.staging_bytes == STAGING_BYTES + ALIGN
    store.close()
