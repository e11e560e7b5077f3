"""The disk store's bandwidth against the raw bandwidth of the same disk (issue 42, item 2).

Raw: one file written then read sequentially with ``os.pwrite``/``os.pread`` of one aligned 8
MiB buffer, ``O_DIRECT`` where the file system allows it (as ``dd oflag=direct bs=8M`` does),
no store in between, from a buffer on huge pages (``runtime.huge_pages``: what the store's
buffers and the disk tier's slabs are on) and, for comparison, from one on 4 KiB pages (what
``dd`` uses; ``plain_pages_over_huge``). Store: ``DiskStore`` in the same directory, the same
bytes as tensors of each ``--sizes`` (MiB), written one by one and read back one by one, each
checked bitwise once (torch's own allocations, 64-byte aligned: the store's staging path, as
for the host pool's plain slabs; page-aligned bytes move in place). The two alternate per
repeat in one process; GB/s are medians of the repeats (wall time: the disk, not the CPU, is
measured). Neither calls ``fsync``: with ``O_DIRECT`` the bytes reach the device, without it (a
refused file system) both sides go through the page cache alike.

    .venv/bin/python benchmarks/disk_store.py --out benchmarks/results/disk_store.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from hyperpar.bench import headlines
from hyperpar.bench.result_file import provenance
from hyperpar.offload.runtime.disk_store import ALIGN, O_DIRECT, STAGING_BYTES, DiskStore, aligned_bytes

MIB = 1 << 20


def raw_gbps(directory: str, total: int, huge: bool = True) -> tuple[float, float, bool]:
    """(write GB/s, read GB/s, direct) of ``total`` bytes in 8 MiB aligned transfers from one
    buffer on huge pages where the OS gives them (``huge``; else on 4 KiB pages, as ``dd``'s)."""
    if huge:
        data = aligned_bytes(STAGING_BYTES)
    else:
        plain = torch.empty(STAGING_BYTES + ALIGN, dtype=torch.uint8)
        data = plain[-plain.data_ptr() % ALIGN:][:STAGING_BYTES]
    data.random_(0, 256, generator=torch.Generator().manual_seed(0))
    buf = memoryview(data.numpy())
    fd_tmp, path = tempfile.mkstemp(prefix="hyperpar-raw-", dir=directory)
    os.close(fd_tmp)
    direct = O_DIRECT is not None
    try:
        try:
            fd = os.open(path, os.O_RDWR | (O_DIRECT or 0))
            os.pwrite(fd, buf[:ALIGN], 0)
        except OSError:
            direct = False
            fd = os.open(path, os.O_RDWR)
        try:
            t0 = time.perf_counter()
            for off in range(0, total, STAGING_BYTES):
                os.pwrite(fd, buf, off)
            write_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for off in range(0, total, STAGING_BYTES):
                os.preadv(fd, [buf], off)
            read_s = time.perf_counter() - t0
        finally:
            os.close(fd)
    finally:
        os.unlink(path)
    return total / write_s / 1e9, total / read_s / 1e9, direct


def store_gbps(directory: str, total: int, size: int) -> tuple[float, float, bool, bool]:
    """(write GB/s, read GB/s, direct, bitwise) of ``total`` bytes as tensors of ``size`` bytes."""
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    dst = torch.empty(size, dtype=torch.uint8)
    count = max(total // size, 1)
    with DiskStore(directory) as store:
        t0 = time.perf_counter()
        extents = [store.write(src) for _ in range(count)]
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for extent in extents:
            store.read(extent, dst)
        read_s = time.perf_counter() - t0
        bitwise = torch.equal(src, dst)
        direct = store.direct
    return count * size / write_s / 1e9, count * size / read_s / 1e9, direct, bitwise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="directory on the disk to measure (default: here)")
    parser.add_argument("--mib", type=int, default=1024, help="bytes per run, MiB")
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 8, 64], help="tensor sizes, MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/disk_store.json")
    args = parser.parse_args(argv)
    if args.mib < 8:
        parser.error(f"--mib must be at least 8, got {args.mib}")
    if args.repeats < 1 or any(s <= 0 for s in args.sizes):
        parser.error(f"--repeats must be >= 1 and --sizes > 0, got {args.repeats} and {args.sizes}")
    given = argv if argv is not None else sys.argv[1:]
    started = provenance(["python", "benchmarks/disk_store.py", *given])
    directory = tempfile.mkdtemp(prefix="hyperpar-disk-bench-", dir=args.dir or os.getcwd())
    total = args.mib * MIB
    sizes = [int(s * MIB) for s in args.sizes]
    runs: dict[str, list[tuple[float, float]]] = {"raw": [], "raw, 4 KiB pages": [],
                                                  **{f"{s / MIB:g} MiB": [] for s in sizes}}
    direct = {}
    bitwise = True
    try:
        with tqdm(total=args.repeats * (2 + len(sizes)), desc="runs", file=sys.stderr) as bar:
            for _ in range(args.repeats):
                w, r, direct["raw"] = raw_gbps(directory, total)
                runs["raw"].append((w, r))
                bar.update()
                w, r, _ = raw_gbps(directory, total, huge=False)
                runs["raw, 4 KiB pages"].append((w, r))
                bar.update()
                for s in sizes:
                    w, r, d, ok = store_gbps(directory, total, s)
                    runs[f"{s / MIB:g} MiB"].append((w, r))
                    direct["store"] = d
                    bitwise = bitwise and ok
                    bar.update()
    finally:
        os.rmdir(directory)
    med = {k: {"write_gbps": statistics.median(w for w, _ in v),
               "read_gbps": statistics.median(r for _, r in v), "runs": v} for k, v in runs.items()}
    raw = med["raw"]
    doc: dict[str, Any] = {
        "benchmark": "disk_store", "bytes_per_run": total, "repeats": args.repeats, "direct": direct,
        "bitwise": bitwise, "gbps": med,
        "store_over_raw": {k: {"write": v["write_gbps"] / raw["write_gbps"],
                               "read": v["read_gbps"] / raw["read_gbps"]}
                           for k, v in med.items() if not k.startswith("raw")},
        "plain_pages_over_huge": {"write": med["raw, 4 KiB pages"]["write_gbps"] / raw["write_gbps"],
                                  "read": med["raw, 4 KiB pages"]["read_gbps"] / raw["read_gbps"]},
    }
    headlines.write("disk_store", Path(args.out), doc, started)
    print(f"raw ({'O_DIRECT' if direct['raw'] else 'buffered'}): write {raw['write_gbps']:.2f} GB/s, "
          f"read {raw['read_gbps']:.2f} GB/s")
    for k, v in doc["store_over_raw"].items():
        print(f"store, {k} tensors: write {med[k]['write_gbps']:.2f} GB/s ({v['write']:.2f}x raw), "
              f"read {med[k]['read_gbps']:.2f} GB/s ({v['read']:.2f}x raw)"
              f"{'' if bitwise else ' NOT BITWISE'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
