"""What a selective disk tier can gain on this machine's disk (issue 9's disk target): sequential reads of
a file against random 4 KiB reads of a share of its pages, with the file's pages dropped from the page cache
before each pass (fsync, then POSIX_FADV_DONTNEED: no root needed, no other file touched). A token-level
selection touches most pages of a pool file, and a block-level one reads its share of them at the random-read
rate measured here: one positioned read at a time from each thread, and all of them announced first
(POSIX_FADV_WILLNEED, as the block layout of the disk tier does) then read by one thread.

    python benchmarks/disk_random_reads.py --dir /tmp --size 1G --share 0.125
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

PAGE = 4096


def drop_caches(fd: int) -> None:
    """The file's pages out of the page cache (written back first, so none is dirty and kept)."""
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the test file goes (removed after)")
    ap.add_argument("--size", default="1G", help="test file size (K/M/G)")
    ap.add_argument("--share", type=float, default=0.125, help="share of the pages read at random")
    ap.add_argument("--threads", default="1,8,32")
    args = ap.parse_args(argv)
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        size = (int(float(args.size[:-1]) * units[args.size[-1].upper()]) if args.size[-1].upper() in units
                else int(args.size))
        threads = [int(t) for t in args.threads.split(",")]
    except (ValueError, IndexError):
        print(f"disk_random_reads: bad --size or --threads: {args.size!r}, {args.threads!r}", file=sys.stderr)
        return 2
    if not 0 < args.share <= 1 or size < 1 << 20 or min(threads) < 1:
        print("disk_random_reads: --share must be in (0, 1], --size at least 1M, --threads >= 1", file=sys.stderr)
        return 2
    fd_w, path = tempfile.mkstemp(prefix="infinigen-io-", dir=args.dir)
    try:
        with os.fdopen(fd_w, "wb") as f:
            for _ in range(size >> 24 or 1):
                f.write(os.urandom(min(size, 1 << 24)))
        size = os.path.getsize(path)
        fd = os.open(path, os.O_RDWR)
        drop_caches(fd)
        t = time.perf_counter()
        for off in range(0, size, 1 << 22):
            os.pread(fd, 1 << 22, off)
        seq = time.perf_counter() - t
        print(f"sequential 4 MiB reads of {size >> 20} MiB: {seq:.2f} s, {size / seq / 1e9:.2f} GB/s")
        pages = sorted(random.Random(0).sample(range(size // PAGE), int(args.share * (size // PAGE))))
        for n in threads:
            drop_caches(fd)
            parts = [pages[i::n] for i in range(n)]
            t = time.perf_counter()
            with ThreadPoolExecutor(n) as ex:
                list(ex.map(lambda part: [os.pread(fd, PAGE, p * PAGE) for p in part], parts))
            dt = time.perf_counter() - t
            print(f"random 4 KiB reads of {100 * args.share:g}% of the pages, {n} thread(s): {dt:.2f} s, "
                  f"{len(pages) * PAGE / dt / 1e9:.2f} GB/s, {dt / seq:.2f}x the time of reading everything")
        drop_caches(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        t = time.perf_counter()
        for p in pages:
            os.posix_fadvise(fd, p * PAGE, PAGE, os.POSIX_FADV_WILLNEED)
        for p in pages:
            os.pread(fd, PAGE, p * PAGE)
        dt = time.perf_counter() - t
        print(f"random 4 KiB reads of {100 * args.share:g}% of the pages, all announced first (WILLNEED), 1 thread: "
              f"{dt:.2f} s, {len(pages) * PAGE / dt / 1e9:.2f} GB/s, {dt / seq:.2f}x the time of reading everything")
        os.close(fd)
    except KeyboardInterrupt:
        return 130
    finally:
        os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
