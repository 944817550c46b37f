#!/usr/bin/env python
"""How fast a checkpoint's files are checksummed: CRC-32 as checkpoints use it, against SHA-256.

    python scripts/bench_checksum.py [--gib 2] [--dir /tmp]   (--gib takes a fraction: --gib 0.01 is 10 MiB)

Writes a file of random bytes, reads it once so it sits in the page cache (as a checkpoint just written does),
then times ``launcher.training.checkpoint.crc32_file`` and a SHA-256 over the same chunks, the fastest of three
passes each, and prints GiB/s and what a 16 GiB checkpoint would take. The file is removed at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launcher.training.checkpoint import _CHUNK, crc32_file  # noqa: E402


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fastest(fn, path: str, passes: int = 3) -> float:
    times = []
    for _ in range(passes):
        t = time.perf_counter()
        fn(path)
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2, help="size of the file checksummed (GiB; a fraction for a quick check)")
    ap.add_argument("--dir", default="/tmp", help="where the file is written")
    args = ap.parse_args()
    path = os.path.join(args.dir, f"vramfit-checksum-bench-{os.getpid()}.bin")
    try:
        left = int(args.gib * 2**30)
        with open(path, "wb") as fh:
            while left > 0:
                fh.write(os.urandom(min(left, 2**26)))
                left -= 2**26
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs")
        for name, fn in (("CRC-32 (crc32_file)", crc32_file), ("SHA-256", sha256_file)):
            fn(path)  # into the page cache
            s = fastest(fn, path)
            print(f"{name}: {args.gib:g} GiB in {s:.2f} s = {args.gib / s:.2f} GiB/s (fastest of 3); "
                  f"a 16 GiB checkpoint: {16 * s / args.gib:.1f} s")
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        if os.path.exists(path):
            os.remove(path)


if __name__ == "__main__":
    main()
