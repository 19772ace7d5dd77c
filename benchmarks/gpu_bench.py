"""Throughput of the CUDA kernels against the device's best copy, and the
fixed cost of a device collective call.

Kernel table (one process, one GPU), ``--mb`` MB of float32 (default 256),
median of ``--reps`` CUDA-event timings on the default stream:

- ``copy``: a device-to-device copy of the buffer by every means at hand in
  the same run: Numba (``y.copy_to_device(x)``), CuPy (``y[...] = x``) and
  torch (``y.copy_(x)``) when installed. The fastest is the reference
  bandwidth (bytes read + bytes written);
- ``compress+EF``: each compressor's pack kernel with error feedback in place
  (reads x and the residual, writes the residual and the payload);
- ``decode`` and ``decode+acc``: each decoder writing, or adding onto, a
  float32 output (reads the payload, [reads and] writes the output);
- ``stats`` (terngrad's scale pass: reads x and the residual);
- ``DeepSpeed-style 1bit`` (with CuPy only): a 1-bit compress with error
  feedback written as DeepSpeed's CuPy backend does it, as a peer (not in the
  library): ``v = x + e``, the scale ``||v|| / sqrt(n)``, the signs
  (``v >= 0``), the residual ``v - scale * (2 sign - 1)``, ``cupy.packbits``
  of the signs: five passes over the data.

Each row's bandwidth is its minimal memory traffic (the bytes the operation
must move, not what the kernel happens to move) over its median time;
``of copy`` is that bandwidth over the best copy's, ``vs DS`` the DeepSpeed-
style compress's time over the row's (> 1: faster). Targets (issue 12):
compress+EF and decode+acc of 2bit and 1bit >= 80% of the copy, terngrad and
fp16 >= 70%, 1bit compress >= 3x faster than DeepSpeed-style at 64 MiB.

Fixed-cost table: the median wall time per call, a device synchronisation
included, of ``mpigc.allreduce`` on device arrays (``none``, ``2bit``,
``1bit``) and of a host ``comm.Allreduce``, for 4 KiB to 16 MiB buffers
(``--fixed-kib``), on ``MPI.COMM_WORLD``: run it under ``mpirun -n 2`` for
two ranks sharing a GPU (``--fixed-only`` skips the kernel table, which only
rank 0 runs).

Usage::

    python benchmarks/gpu_bench.py [--mb 256] [--reps 20] [--check] [--json FILE]
    mpirun -n 2 python benchmarks/gpu_bench.py --fixed-only [--json FILE]

``--check`` exits 1 when a graded row misses its target. Needs a real GPU
and ``pip install 'mpigc[cuda]'``; without one it says it cannot measure,
writes ``"measured": false`` to ``--json`` and exits 0. ``MPIGC_GPU_SIM=1``
with ``NUMBA_ENABLE_CUDASIM=1`` runs it in Numba's CUDA simulator (host clock,
no events, tiny sizes): a test of the script for ``tests/gpu/run.sh``; its
figures mean nothing and are marked so.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np

SIM = os.environ.get("MPIGC_GPU_SIM") == "1"

# (op, format) -> target fraction of the best copy
TARGETS = {("compress+EF", "2bit"): 0.80, ("compress+EF", "1bit"): 0.80,
           ("decode+acc", "2bit"): 0.80, ("decode+acc", "1bit"): 0.80,
           ("compress+EF", "terngrad"): 0.70, ("compress+EF", "fp16"): 0.70,
           ("decode+acc", "fp16"): 0.70}
DS_SPEEDUP_TARGET = 3.0  # 1bit compress+EF vs the DeepSpeed-style one


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=256.0, help="buffer size in MB (float32)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if a graded row misses its target")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--fixed-kib", default=None,
                    help="buffer sizes of the fixed-cost table, KiB, comma-separated "
                         "(default 4,64,1024,16384; 4 in the simulator; 'none' skips it)")
    ap.add_argument("--fixed-only", action="store_true",
                    help="only the fixed-cost table (for mpirun -n K)")
    args = ap.parse_args(argv)
    if args.mb <= 0 or args.reps < 1:
        ap.error(f"--mb must be > 0 and --reps >= 1, got {args.mb} and {args.reps}")
    spec = args.fixed_kib or ("4" if SIM else "4,64,1024,16384")
    try:
        args.fixed = [] if spec == "none" else [int(float(k) * 1024) for k in spec.split(",")]
    except ValueError:
        ap.error(f"--fixed-kib: expected sizes in KiB like 4,64,1024, got {spec!r}")
    return args


def _time(cuda, fn, reps, warmup=2):
    """Median milliseconds of ``fn()`` between two events on the default stream."""
    for _ in range(warmup):
        fn()
    cuda.synchronize()
    times = []
    if SIM:  # the simulator has no event timing
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


def _optional(name):
    try:
        return __import__(name)
    except Exception:  # noqa: BLE001 - absent, or broken without a GPU
        return None


def _deepspeed_style_1bit(cupy, x, e, n):
    """The peer: 1-bit compress with error feedback the way DeepSpeed's CuPy
    backend does it (see the module docstring); returns the packed signs."""
    v = x + e
    scale = cupy.linalg.norm(v) / math.sqrt(n)
    s = v >= 0
    e[...] = v - scale * (s.astype(cupy.float32) * 2 - 1)
    return cupy.packbits(s), scale


def kernel_table(cuda, kc, args, rows):
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

    def row(op, fmt, ms, traffic):
        rows.append({"op": op, "format": fmt, "ms": ms, "GB/s": traffic / ms / 1e6,
                     "traffic_MB": traffic / 1e6})

    row("copy", "numba", _time(cuda, lambda: y.copy_to_device(x), args.reps), 2 * nbytes)
    cupy = None if SIM else _optional("cupy")
    if cupy is not None:
        cx, cy = cupy.asarray(x), cupy.asarray(y)

        def cupy_copy():
            cy[...] = cx
        row("copy", "cupy", _time(cuda, cupy_copy, args.reps), 2 * nbytes)
    torch = None if SIM else _optional("torch")
    if torch is not None and torch.cuda.is_available():
        tx, ty = torch.as_tensor(x, device="cuda"), torch.as_tensor(y, device="cuda")
        row("copy", "torch", _time(cuda, lambda: ty.copy_(tx), args.reps), 2 * nbytes)

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
    row("compress+EF", "bf16",
        _time(cuda, lambda: kc.pack_bf16(x, e, e, p16, 1.0), args.reps), ef + 2 * n)
    if cupy is not None:
        cx, ce = cupy.asarray(x), cupy.asarray(e)
        row("compress+EF", "DeepSpeed-style 1bit",
            _time(cuda, lambda: _deepspeed_style_1bit(cupy, cx, ce, n), args.reps),
            ef + p1.size)
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

    best = max((r for r in rows if r["op"] == "copy"), key=lambda r: r["GB/s"])
    ds = next((r for r in rows if r["format"] == "DeepSpeed-style 1bit"), None)
    for r in rows:
        r["of_copy"] = r["GB/s"] / best["GB/s"]
        r["vs_DS"] = None if ds is None else ds["ms"] / r["ms"]
    return n, best


def fixed_cost_table(cuda, args, comm):
    """Median microseconds per call (synchronised) at each size."""
    import mpigc
    from mpi4py import MPI
    os.environ.setdefault("MPIGC_MIN_COMPRESS_BYTES", "0")
    reps = max(3, args.reps)
    out = []
    for nbytes in args.fixed:
        n = max(1, nbytes // 4)
        g = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
        res = {"bytes": n * 4}
        h = g.copy()

        def host():
            comm.Allreduce(MPI.IN_PLACE, h, op=MPI.SUM)
        calls = [("host Allreduce", host)]
        for op in ("none", "2bit", "1bit"):
            d = cuda.to_device(g)
            fb = mpigc.ErrorFeedback()

            def dev(d=d, op=op, fb=fb):
                mpigc.allreduce(d, op=op, key="fixed", comm=comm, feedback=fb)
                cuda.synchronize()
            calls.append((f"device {op}", dev))
        for name, fn in calls:
            for _ in range(2):
                fn()
            ts = []
            for _ in range(reps):
                comm.Barrier()
                t = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t) * 1e6)
            res[name] = statistics.median(ts)
        out.append(res)
    return out


def main(argv=None):
    args = parse_args(argv)
    if os.environ.get("NUMBA_ENABLE_CUDASIM") and not SIM:
        sys.exit("gpu_bench: NUMBA_ENABLE_CUDASIM is set; this benchmark needs a real GPU "
                 "(MPIGC_GPU_SIM=1 runs it in the simulator as a test of the script)")
    try:
        from numba import cuda
        available = cuda.is_available()
    except Exception as exc:  # noqa: BLE001 - no numba.cuda, no driver
        available, cuda = False, None
        reason = f"numba.cuda unusable ({exc})"
    else:
        reason = "no CUDA GPU found"
    if not available:
        print(f"gpu_bench: {reason}: cannot measure; nothing was timed")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"measured": False, "reason": reason}, f, indent=1)
        return 0
    from mpi4py import MPI

    from mpigc.kernels import cuda as kc
    comm = MPI.COMM_WORLD
    name = "Numba CUDA simulator" if SIM else cuda.get_current_device().name
    name = name.decode() if isinstance(name, bytes) else str(name)
    result = {"measured": True, "device": name, "simulator": SIM, "reps": args.reps,
              "ranks": comm.size}
    misses = []
    if not args.fixed_only and comm.rank == 0:
        rows = []
        n, best = kernel_table(cuda, kc, args, rows)
        result.update(n=n, rows=rows, best_copy=best["format"])
        print(f"device: {name}{' (figures meaningless)' if SIM else ''}, buffer "
              f"{4 * n / 1e6:.0f} MB float32 ({n} elements), median of {args.reps}; "
              f"reference: the {best['format']} copy, {best['GB/s']:.0f} GB/s")
        print(f"{'op':<12} {'format':<21} {'ms':>8} {'GB/s':>8} {'of copy':>8} "
              f"{'vs DS':>6}  target")
        for r in rows:
            target = TARGETS.get((r["op"], r["format"]))
            mark = ""
            if target is not None:
                ok = r["of_copy"] >= target
                mark = f"{'ok' if ok else 'MISS'} (>= {target:.0%})"
                if not ok:
                    misses.append(f"{r['op']} {r['format']}")
            if r["op"] == "compress+EF" and r["format"] == "1bit" and r["vs_DS"] is not None:
                ok = r["vs_DS"] >= DS_SPEEDUP_TARGET
                mark += f" {'ok' if ok else 'MISS'} (>= {DS_SPEEDUP_TARGET:.0f}x DS)"
                if not ok:
                    misses.append("1bit vs DeepSpeed-style")
            vs = "" if r["vs_DS"] is None else f"{r['vs_DS']:.2f}"
            print(f"{r['op']:<12} {r['format']:<21} {r['ms']:8.3f} {r['GB/s']:8.1f} "
                  f"{r['of_copy']:8.1%} {vs:>6}  {mark}")
        sys.stdout.flush()
    if args.fixed:
        fixed = fixed_cost_table(cuda, args, comm)
        result["fixed_cost_us"] = fixed
        if comm.rank == 0:
            cols = ["host Allreduce", "device none", "device 2bit", "device 1bit"]
            print(f"\nfixed cost per call, {comm.size} rank(s), median us (device calls "
                  "synchronised)")
            print(f"{'size':>10} " + " ".join(f"{c:>15}" for c in cols)
                  + f" {'2bit/none':>10} {'none/host':>10}")
            for r in fixed:
                print(f"{r['bytes']:>10} " + " ".join(f"{r[c]:15.0f}" for c in cols)
                      + f" {r['device 2bit'] / r['device none']:10.2f}"
                      + f" {r['device none'] / r['host Allreduce']:10.2f}")
    if args.json and comm.rank == 0:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.check and misses:
        sys.exit(f"gpu_bench: {len(misses)} target(s) missed: {', '.join(misses)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
