"""Throughput of the CUDA kernels against the device's own copy bandwidth.

For a buffer of ``--mb`` MB (default 256) of float32 it times, with CUDA
events, on numba device arrays:

- ``copy``: a device-to-device copy of the buffer (the reference bandwidth,
  counted as bytes read + bytes written);
- ``compress+EF``: each compressor's pack kernel with error feedback in place
  (reads x and the residual, writes the residual and the payload);
- ``decode`` and ``decode+acc``: each decoder writing, or adding onto, a
  float32 output (reads the payload, [reads and] writes the output);
- ``stats`` (terngrad's scale pass: reads x and the residual).

Each row's bandwidth is its minimal memory traffic (the bytes the operation
must move, not what the kernel happens to move) over its median time, and
``of copy`` is that bandwidth as a fraction of the copy's. Target: >= 70%.

Usage::

    python benchmarks/gpu_bench.py [--mb 256] [--reps 20] [--check] [--json FILE]

``--check`` exits 1 when a compress+EF or decode+acc row is below target.
Needs a real GPU (not the simulator) and ``pip install 'mpigc[cuda]'``.
``MPIGC_GPU_SIM=1`` with ``NUMBA_ENABLE_CUDASIM=1`` runs it in Numba's CUDA
simulator (host clock, no events): a test of the script for
``tests/gpu/run.sh``; its figures mean nothing and are marked so.
"""
import argparse
import json
import os
import statistics
import sys

import numpy as np

TARGET = 0.70


SIM = os.environ.get("MPIGC_GPU_SIM") == "1"


def _time(cuda, fn, reps, warmup=2):
    """Median milliseconds of ``fn()`` between two events on the default stream."""
    for _ in range(warmup):
        fn()
    cuda.synchronize()
    times = []
    if SIM:  # the simulator has no event timing
        import time
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    for _ in range(reps):
        start, stop = cuda.event(), cuda.event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cuda.event_elapsed_time(start, stop))
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=256.0, help="buffer size in MB (float32)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--check", action="store_true",
                    help=f"exit 1 if a compress+EF or decode+acc row is below {TARGET:.0%}")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)

    if os.environ.get("NUMBA_ENABLE_CUDASIM") and not SIM:
        sys.exit("gpu_bench: NUMBA_ENABLE_CUDASIM is set; this benchmark needs a real GPU")
    from numba import cuda
    if not cuda.is_available():
        sys.exit("gpu_bench: no CUDA GPU found")
    from mpigc.kernels import cuda as kc

    dev = cuda.get_current_device()
    name = "Numba CUDA simulator" if SIM else dev.name
    name = name.decode() if isinstance(name, bytes) else str(name)
    n = int(args.mb * 1e6) // 4
    nbytes = 4 * n
    rng = np.random.default_rng(0)
    host = rng.standard_normal(n, dtype=np.float32)
    x = cuda.to_device(host)
    e = cuda.to_device((host * np.float32(0.1))[::-1].copy())
    y = cuda.device_array_like(x)
    block = 1024
    nblk = (n + block - 1) // block
    p2 = cuda.device_array((n + 3) // 4, np.uint8)
    p1 = cuda.device_array((n + 7) // 8, np.uint8)
    means = cuda.to_device(rng.standard_normal(2 * nblk).astype(np.float32))
    p16 = cuda.device_array(n, np.uint16)
    amax = float(np.abs(host).max()) * 1.5
    stream_id = kc.ternary_stream(0, 0, 0, 0)

    rows = []

    def row(op, fmt, ms, traffic):
        rows.append({"op": op, "format": fmt, "ms": ms, "GB/s": traffic / ms / 1e6,
                     "traffic_MB": traffic / 1e6})

    copy_ms = _time(cuda, lambda: y.copy_to_device(x), args.reps)
    row("copy", "d2d", copy_ms, 2 * nbytes)

    ef = 3 * nbytes  # read x, read e, write e
    row("compress+EF", "2bit",
        _time(cuda, lambda: kc.pack_2bit(x, e, e, p2, 0.5), args.reps), ef + p2.size)
    row("compress+EF", "1bit",
        _time(cuda, lambda: kc.pack_1bit(x, e, e, p1, means, block), args.reps),
        ef + p1.size + 4 * means.size)
    row("compress+EF", "terngrad",
        _time(cuda, lambda: kc.pack_ternary(x, e, e, p2, amax, np.inf, stream_id, 0),
              args.reps), ef + p2.size)
    row("compress+EF", "fp16",
        _time(cuda, lambda: kc.pack_fp16(x, e, e, p16, 1.0), args.reps), ef + 2 * n)
    row("stats", "terngrad", _time(cuda, lambda: kc.stats(x, e), args.reps), 2 * nbytes)

    for fmt, dec, payload_bytes in [
            ("2bit", lambda acc: kc.unpack_2bit(p2, y, 0.5, acc), p2.size),
            ("1bit", lambda acc: kc.unpack_1bit(p1, means, y, block, acc),
             p1.size + 4 * means.size),
            ("fp16", lambda acc: kc.unpack_fp16(p16, y, acc), 2 * n)]:
        row("decode", fmt, _time(cuda, lambda: dec(False), args.reps),
            nbytes + payload_bytes)
        row("decode+acc", fmt, _time(cuda, lambda: dec(True), args.reps),
            2 * nbytes + payload_bytes)

    copy_bw = rows[0]["GB/s"]
    for r in rows:
        r["of_copy"] = r["GB/s"] / copy_bw
    print(f"device: {name}, "
          f"buffer {nbytes / 1e6:.0f} MB float32 ({n} elements), median of {args.reps}")
    print(f"{'op':<12} {'format':<9} {'ms':>8} {'GB/s':>8} {'of copy':>8}  target")
    misses = []
    for r in rows:
        graded = r["op"] in ("compress+EF", "decode+acc")
        ok = r["of_copy"] >= TARGET
        mark = ("ok" if ok else "MISS") if graded else ""
        if graded and not ok:
            misses.append(r)
        print(f"{r['op']:<12} {r['format']:<9} {r['ms']:8.3f} {r['GB/s']:8.1f} "
              f"{r['of_copy']:8.1%}  {mark}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "simulator": SIM, "n": n, "reps": args.reps,
                       "rows": rows}, f, indent=1)
    if args.check and misses:
        sys.exit(f"{len(misses)} row(s) below {TARGET:.0%} of the copy bandwidth")


if __name__ == "__main__":
    main()
