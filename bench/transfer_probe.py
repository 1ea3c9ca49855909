"""Where a GPU session save/restore's time goes, part by part (a diagnostic for bench/cache.py on CUDA).

    python bench/transfer_probe.py [--mib 256]

Times, on the default device: host->MLX copies (`mx.array(numpy)`, one big array and in 8 MiB
pieces, fresh and into reused buffers), MLX->host (`np.asarray`), a writable numpy view of an MLX
array's memory and writing through it, xxh3-128 over the bytes, a file write to a new name and over
an existing file by rename, fsync, and reading the file back into a numpy buffer. Medians of 5.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import mlx.core as mx
import numpy as np
import xxhash


def timed(fn, n=5):
    xs = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        xs.append((time.perf_counter() - t) * 1e3)
    return statistics.median(xs), min(xs), max(xs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    a = ap.parse_args()
    nbytes = a.mib << 20
    host = np.random.default_rng(0).integers(0, 1 << 15, nbytes // 2, dtype=np.uint16).view(np.float16)
    pieces = np.split(host, a.mib // 8)
    gb = nbytes / 1e9
    print(f"mlx {mx.__version__} on {mx.default_device()}, {a.mib} MiB")

    def report(name, r):
        print(f"{name}: median {r[0]:.1f} ms [{r[1]:.1f}-{r[2]:.1f}], {gb / (r[0] / 1e3):.2f} GB/s")

    report("mx.array(numpy), one array, + eval", timed(lambda: mx.eval(mx.array(host))))
    report("mx.array(numpy), 8 MiB pieces, + eval", timed(lambda: mx.eval([mx.array(p) for p in pieces])))
    report("same, then a device op on each (x + 0)", timed(lambda: mx.eval([mx.array(p) + 0 for p in pieces])))
    dev = mx.array(host) + 0
    mx.eval(dev)
    report("np.array(device result) (MLX -> host copy)", timed(lambda: np.array(dev)))
    try:
        z = mx.zeros(host.shape, mx.float16)
        mx.eval(z)
        v = np.array(z, copy=False)
        print(f"writable view of an MLX array: writeable={v.flags.writeable} owndata={v.flags.owndata}")

        def through_view():
            zz = mx.zeros(host.shape, mx.float16)
            mx.eval(zz)
            np.copyto(np.array(zz, copy=False), host)
            mx.eval(zz + 0)
        report("fresh mx.zeros, copy through its numpy view, device op", timed(through_view))
    except Exception as e:  # noqa: BLE001 - a diagnostic: say what this build does
        print(f"writable view: not available ({type(e).__name__}: {e})")
    report("xxh3-128 over the bytes", timed(lambda: xxhash.xxh3_128(memoryview(host).cast("B")).digest()))
    d = tempfile.mkdtemp(dir=os.environ.get("PROBE_DIR"))
    final = os.path.join(d, "s.bin")

    def write(path, sync=False):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for p in pieces:
            os.write(fd, memoryview(p).cast("B"))
        if sync:
            os.fsync(fd)
        os.close(fd)
    n = [0]

    def new_name():
        n[0] += 1
        write(os.path.join(d, f"new{n[0]}.bin"))
    report("write to a new file (no sync)", timed(new_name))
    write(final)

    def replace():
        write(final + ".part")
        t = time.perf_counter()
        os.replace(final + ".part", final)
        rename_ms.append((time.perf_counter() - t) * 1e3)
    rename_ms: list = []
    report("write .part + rename over the existing file", timed(replace))
    print(f"  of which the rename: median {statistics.median(rename_ms):.1f} ms")
    report("write + fsync (new file)", timed(lambda: write(os.path.join(d, "sync.bin"), True)))
    buf = np.empty_like(host)

    def read_back():
        fd = os.open(final, os.O_RDONLY)
        mv, off = memoryview(buf).cast("B"), 0
        while off < nbytes:
            off += os.readv(fd, [mv[off:off + (64 << 20)]])
        os.close(fd)
    report("read the file into a numpy buffer (page cache)", timed(read_back))


if __name__ == "__main__":
    main()
