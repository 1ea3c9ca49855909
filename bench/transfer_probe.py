"""Where a GPU session save/restore's time goes, part by part (a diagnostic for bench/cache.py on CUDA).

    python bench/transfer_probe.py [--mib 256]

Times, on the default device: host->MLX copies (`mx.array(numpy)`, one big array and in 8 MiB
pieces, fresh and into reused buffers), MLX->host (`np.asarray`), a writable numpy view of an MLX
array's memory and writing through it, xxh3-128 over the bytes, Load-primitive uploads (engine/model/device_upload.py, mx.load of a safetensors file), a file write to a new name and over
an existing file by rename, fsync, and reading the file back into a numpy buffer; then what threads
change: writes (pwrite of disjoint ranges) and MLX->host copies from 1-8 threads, a write with the
hash running beside it, and one big array's slices moved to the device. Medians of 5.
"""
from __future__ import annotations

import argparse
import os
from concurrent.futures import ThreadPoolExecutor
import statistics
import sys
import tempfile
import time

import mlx.core as mx
import numpy as np
import xxhash

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.harness import Run, add_args  # noqa: E402
from engine.model.device_upload import to_device  # noqa: E402


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
    add_args(ap)
    a = ap.parse_args()
    rec = Run(out=a.out)
    nbytes = a.mib << 20
    host = np.random.default_rng(0).integers(0, 1 << 15, nbytes // 2, dtype=np.uint16).view(np.float16)
    pieces = np.split(host, a.mib // 8)
    gb = nbytes / 1e9
    print(f"mlx {mx.__version__} on {mx.default_device()}, {a.mib} MiB")

    def report(name, r):
        rec.record(name, r[0], "ms", spread={"min": r[1], "median": r[0], "max": r[2]}, gb_s=gb / (r[0] / 1e3),
                   mib=a.mib, line=f"{name}: median {r[0]:.1f} ms [{r[1]:.1f}-{r[2]:.1f}], {gb / (r[0] / 1e3):.2f} GB/s")

    report("mx.array(numpy), one array, + eval", timed(lambda: mx.eval(mx.array(host))))
    report("mx.array(numpy), 8 MiB pieces, + eval", timed(lambda: mx.eval([mx.array(p) for p in pieces])))
    report("same, then a device op on each (x + 0)", timed(lambda: mx.eval([mx.array(p) + 0 for p in pieces])))
    # MLX's Load primitive: device memory filled by one cudaMemcpyAsync (engine/model/device_upload.py), from a
    # Python file object serving our buffer, and from MLX's own reader of a safetensors file.
    report("to_device (Load from a buffer), 8 MiB pieces, + device op",
           timed(lambda: mx.eval([to_device(p) + 0 for p in pieces])))
    report("to_device, one array, + device op", timed(lambda: mx.eval(to_device(host) + 0)))
    quarters = np.split(host, 4)
    report("to_device, 64 MiB pieces, + device op", timed(lambda: mx.eval([to_device(p) + 0 for p in quarters])))
    st_dir = tempfile.mkdtemp(dir=os.environ.get("PROBE_DIR"))
    st_path = os.path.join(st_dir, "pieces.safetensors")
    mx.save_safetensors(st_path, {f"p{i}": mx.array(p) for i, p in enumerate(pieces)})
    report("mx.load(safetensors path), 8 MiB tensors, + device op",
           timed(lambda: mx.eval([t + 0 for t in mx.load(st_path).values()])))
    st_fd = os.open(st_path, os.O_RDONLY)
    report("mx.load(/proc/self/fd/N, format=safetensors), + device op",
           timed(lambda: mx.eval([t + 0 for t in mx.load(f"/proc/self/fd/{st_fd}", format="safetensors").values()])))
    os.close(st_fd)
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

    # Threads: does the page cache take writes faster from several writers (disjoint ranges)?
    def pwrite_threads(k: int, hashed: bool = False):
        def run():
            n[0] += 1
            old = os.path.join(d, f"par{n[0] - 1}.bin")
            if os.path.exists(old):
                os.unlink(old)      # dirty pages dropped, not written: the rounds do not pile up dirty data
            fd = os.open(os.path.join(d, f"par{n[0]}.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(fd, nbytes)
            share = len(pieces) // k

            def part(j):
                for i in range(j * share, len(pieces) if j == k - 1 else (j + 1) * share):
                    os.pwrite(fd, memoryview(pieces[i]).cast("B"), i * (8 << 20))
            with ThreadPoolExecutor(k + 1) as pool:
                hashing = pool.submit(lambda: xxhash.xxh3_128(memoryview(host).cast("B")).digest()) if hashed else None
                list(pool.map(part, range(k)))
                if hashing:
                    hashing.result()
            os.close(fd)
        return run
    for k in (1, 2, 4, 8):
        report(f"pwrite to a new file from {k} thread(s)", timed(pwrite_threads(k)))
    report("pwrite from 4 threads + xxh3 of it beside them", timed(pwrite_threads(4, True)))

    # MLX -> host from several threads: the views are taken on this thread (MLX calls stay here), the
    # threads only copy from them, touching the device arrays' pages.
    devs = [mx.array(p) + 0 for p in pieces]
    mx.eval(devs)
    out = np.empty_like(host)
    outs = np.split(out, len(pieces))
    for k in (1, 4, 8):
        def d2h(k=k):
            views = [np.asarray(a) for a in devs]
            with ThreadPoolExecutor(k) as pool:
                list(pool.map(lambda i: np.copyto(outs[i], views[i]), range(len(views))))
        report(f"MLX device arrays -> host from {k} thread(s)", timed(d2h))
    del devs

    # One big array, then its 8 MiB slices used on the device (as a restored cache's layers would be).
    rows = host.reshape(len(pieces), -1)
    report("one mx.array of it, then a device op on each row slice",
           timed(lambda: mx.eval([r + 0 for r in mx.array(rows)])))
    report("one mx.array of it, then one device op on the whole", timed(lambda: mx.eval(mx.array(rows) + 0)))

    def slice_update():
        big = mx.array(rows)
        mx.eval(big)
        layers = [big[i] for i in range(len(pieces))]
        del big
        for i, a in enumerate(layers):
            a[:8] = mx.zeros((8,), a.dtype)
        mx.eval(layers)
    report("one mx.array, row views, an 8-cell slice update on each", timed(slice_update))


if __name__ == "__main__":
    main()
