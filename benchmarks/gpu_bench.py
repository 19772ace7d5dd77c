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

Two timings per row. ``call``: one call of the library function between a
pair of events, as a user calls it (for the pack kernels and ``stats`` that
includes zeroing the count, Numba's launch and the read of the count, which
waits for the device). ``alone``: the same kernels launched back to back,
``--burst`` times (default 20) between ONE pair of events, divided by the
burst: the launches of one call are recorded once (by wrapping
``mpigc.kernels.cuda._launch``, through which every launch goes) and
replayed, so no count is zeroed or read in between and the launches queue
behind each other: the kernels' own time. Copies and the DeepSpeed-style
row repeat their whole operation back to back. ``call - alone`` (us) is the
fixed cost of a call beyond its kernels.

Each row's bandwidth is its minimal memory traffic (the bytes the operation
must move, not what the kernel happens to move) over its median time;
``of copy`` is that bandwidth over the best copy's (``alone``: over the best
copy's back to back), ``vs DS`` the DeepSpeed-style compress's call time
over the row's (> 1: faster). Targets (issues 12 and 49), graded on the
kernels alone: compress+EF and decode+acc of 2bit and 1bit >= 80% of the
copy, terngrad and fp16 >= 70%, 1bit compress >= 3x faster than
DeepSpeed-style at 64 MiB.

Fixed-cost table: the median wall time per call, a device synchronisation
included, of ``mpigc.allreduce`` on device arrays (``none``, ``2bit``,
``1bit``) and of a host ``comm.Allreduce``, for 4 KiB to 16 MiB buffers
(``--fixed-kib``), on ``MPI.COMM_WORLD``: run it under ``mpirun -n 2`` for
two ranks sharing a GPU (``--fixed-only`` skips the kernel table, which only
rank 0 runs). Beside each device column, ``ret``: the median host time
until the call returned, before the synchronisation (the same calls).

Usage::

    python benchmarks/gpu_bench.py [--mb 256] [--reps 20] [--burst 20] [--check]
                                   [--json FILE]
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
    ap.add_argument("--burst", type=int, default=None,
                    help="kernel launches back to back between one pair of events in "
                         "the 'alone' timing (default 20; 2 in the simulator)")
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
    if args.burst is None:
        args.burst = 2 if SIM else 20
    if args.burst < 1:
        ap.error(f"--burst must be >= 1, got {args.burst}")
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


def _time_burst(cuda, fn, reps, burst, stream=0):
    """Median milliseconds of one ``fn()`` when ``burst`` of them run back to
    back between ONE pair of events recorded on ``stream`` (the stream the
    launches go to): nothing waits between them."""
    fn()
    cuda.synchronize()
    times = []
    for _ in range(reps):
        if SIM:  # no event timing: the host clock, then a synchronisation
            t = time.perf_counter()
            for _ in range(burst):
                fn()
            cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3 / burst)
            continue
        start, stop = cuda.event(), cuda.event()
        start.record(stream=stream)
        for _ in range(burst):
            fn()
        stop.record(stream=stream)
        stop.synchronize()
        times.append(cuda.event_elapsed_time(start, stop) / burst)
    return statistics.median(times)


class _Replay:
    """The kernel launches of one call of ``fn`` (recorded by wrapping
    ``kc._launch(kernel, blocks, stream, *args)``, through which the module
    launches every kernel), to be launched again without the rest of the
    call: no count zeroed, none read. ``problem`` says why there is nothing
    to replay (no launch went through ``_launch``, or launches on several
    streams, which one pair of events cannot time), else it is None."""

    def __init__(self, kc, fn):
        self.launches = []
        self.launch = launch = kc._launch

        def recording(*a, **kw):
            self.launches.append((a, kw))
            return launch(*a, **kw)

        kc._launch = recording
        try:
            fn()
        finally:
            kc._launch = launch
        given = [a[2] if len(a) > 2 else kw.get("stream", 0) for a, kw in self.launches]
        streams = {id(st) if st else 0 for st in given}
        self.problem = None
        if not self.launches:
            self.problem = "no launch through mpigc.kernels.cuda._launch"
        elif len(streams) > 1:
            self.problem = f"launches on {len(streams)} streams"
        st = given[0] if given else 0
        #: the stream of the launches (0: kc's default stream), for the events
        self.stream = st if st else kc.default_stream()

    def __call__(self):
        for a, kw in self.launches:
            self.launch(*a, **kw)


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

    def row(op, fmt, fn, traffic, library=True):
        """Time ``fn`` as a call, then its kernels alone (``library``: the
        launches of one call replayed; else ``fn`` itself back to back)."""
        ms = _time(cuda, fn, args.reps)
        r = {"op": op, "format": fmt, "ms": ms, "GB/s": traffic / ms / 1e6,
             "traffic_MB": traffic / 1e6, "launches": None, "alone_ms": None,
             "alone_GB/s": None, "call_minus_alone_us": None, "alone_problem": None}
        rows.append(r)
        if library:
            replay = _Replay(kc, fn)
            r["launches"] = len(replay.launches)
            if replay.problem is not None:  # said in the table; the other rows go on
                r["alone_problem"] = replay.problem
                return
            alone, stream = replay, replay.stream
        else:
            alone, stream = fn, 0
        alone_ms = _time_burst(cuda, alone, args.reps, args.burst, stream)
        r.update({"alone_ms": alone_ms, "alone_GB/s": traffic / alone_ms / 1e6,
                  "call_minus_alone_us": (ms - alone_ms) * 1e3})

    row("copy", "numba", lambda: y.copy_to_device(x), 2 * nbytes, library=False)
    cupy = None if SIM else _optional("cupy")
    if cupy is not None:
        cx, cy = cupy.asarray(x), cupy.asarray(y)

        def cupy_copy():
            cy[...] = cx
        row("copy", "cupy", cupy_copy, 2 * nbytes, library=False)
    torch = None if SIM else _optional("torch")
    if torch is not None and torch.cuda.is_available():
        tx, ty = torch.as_tensor(x, device="cuda"), torch.as_tensor(y, device="cuda")
        row("copy", "torch", lambda: ty.copy_(tx), 2 * nbytes, library=False)

    ef = 3 * nbytes  # read x, read e, write e
    row("compress+EF", "2bit", lambda: kc.pack_2bit(x, e, e, p2, 0.5), ef + p2.size)
    row("compress+EF", "1bit", lambda: kc.pack_1bit(x, e, e, p1, means, block),
        ef + p1.size + 4 * means.size)
    row("compress+EF", "terngrad",
        lambda: kc.pack_ternary(x, e, e, p2, amax, np.inf, stream_id, 0), ef + p2.size)
    row("compress+EF", "fp16", lambda: kc.pack_fp16(x, e, e, p16, 1.0), ef + 2 * n)
    row("compress+EF", "bf16", lambda: kc.pack_bf16(x, e, e, p16, 1.0), ef + 2 * n)
    if cupy is not None:
        cx, ce = cupy.asarray(x), cupy.asarray(e)
        row("compress+EF", "DeepSpeed-style 1bit",
            lambda: _deepspeed_style_1bit(cupy, cx, ce, n), ef + p1.size, library=False)
    row("stats", "terngrad", lambda: kc.stats(x, e), 2 * nbytes)

    for fmt, dec, payload_bytes in [
            ("2bit", lambda acc: kc.unpack_2bit(p2, y, 0.5, acc), p2.size),
            ("1bit", lambda acc: kc.unpack_1bit(p1, means, y, block, acc),
             p1.size + 4 * means.size),
            ("fp16", lambda acc: kc.unpack_fp16(p16, y, acc), 2 * n)]:
        row("decode", fmt, lambda: dec(False), nbytes + payload_bytes)
        row("decode+acc", fmt, lambda: dec(True), 2 * nbytes + payload_bytes)

    copies = [r for r in rows if r["op"] == "copy"]
    best = max(copies, key=lambda r: r["GB/s"])
    best_alone = max(copies, key=lambda r: r["alone_GB/s"])  # copies always time alone
    ds = next((r for r in rows if r["format"] == "DeepSpeed-style 1bit"), None)
    for r in rows:
        r["of_copy"] = r["GB/s"] / best["GB/s"]
        r["alone_of_copy"] = (None if r["alone_GB/s"] is None
                              else r["alone_GB/s"] / best_alone["alone_GB/s"])
        r["vs_DS"] = None if ds is None else ds["ms"] / r["ms"]
    return n, best, best_alone


def fixed_cost_table(cuda, args, comm):
    """Median microseconds per call at each size: synchronised (``NAME``) and,
    for device calls, until the call returned (``NAME returned``)."""
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

            def dev(d=d, op=op, fb=fb):  # synchronised by the caller
                mpigc.allreduce(d, op=op, key="fixed", comm=comm, feedback=fb)
            calls.append((f"device {op}", dev))
        for name, fn in calls:
            sync = None if name == "host Allreduce" else cuda.synchronize
            for _ in range(2):
                fn()
                if sync is not None:
                    sync()
            ts, ret = [], []
            for _ in range(reps):
                comm.Barrier()
                t = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                if sync is not None:
                    sync()
                ts.append((time.perf_counter() - t) * 1e6)
                ret.append((t1 - t) * 1e6)
            res[name] = statistics.median(ts)
            if sync is not None:  # the host's time until the call returned
                res[f"{name} returned"] = statistics.median(ret)
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
        n, best, best_alone = kernel_table(cuda, kc, args, rows)
        result.update(n=n, rows=rows, best_copy=best["format"],
                      best_copy_alone=best_alone["format"], burst=args.burst)
        print(f"device: {name}{' (figures meaningless)' if SIM else ''}, buffer "
              f"{4 * n / 1e6:.0f} MB float32 ({n} elements), median of {args.reps}; "
              f"reference: the {best['format']} copy, {best['GB/s']:.0f} GB/s "
              f"({best_alone['format']} back to back: {best_alone['alone_GB/s']:.0f} GB/s)")
        print(f"call: one library call between two events (zeroing, launch, count read); "
              f"alone: its launches, {args.burst} back to back between two events, / "
              f"{args.burst}; targets graded on alone")
        print(f"{'':<34} {'---------- call ----------':>26}   "
              f"{'---------- alone ---------':>26}")
        print(f"{'op':<12} {'format':<21} {'ms':>8} {'GB/s':>8} {'of copy':>8}   "
              f"{'ms':>8} {'GB/s':>8} {'of copy':>8} {'call-alone us':>13} {'launch':>6} "
              f"{'vs DS':>6}  target")
        for r in rows:
            target = TARGETS.get((r["op"], r["format"]))
            graded = r["alone_of_copy"] if r["alone_of_copy"] is not None else r["of_copy"]
            mark = ""
            if target is not None:
                ok = graded >= target
                mark = f"{'ok' if ok else 'MISS'} (>= {target:.0%})"
                if r["alone_of_copy"] is None:
                    mark += " (graded on the call: no kernels-alone figure)"
                if not ok:
                    misses.append(f"{r['op']} {r['format']}")
            if r["op"] == "compress+EF" and r["format"] == "1bit" and r["vs_DS"] is not None:
                ok = r["vs_DS"] >= DS_SPEEDUP_TARGET
                mark += f" {'ok' if ok else 'MISS'} (>= {DS_SPEEDUP_TARGET:.0f}x DS)"
                if not ok:
                    misses.append("1bit vs DeepSpeed-style")
            vs = "" if r["vs_DS"] is None else f"{r['vs_DS']:.2f}"
            launches = "" if r["launches"] is None else str(r["launches"])
            if r["alone_ms"] is None:
                alone = f"{'n/a: ' + r['alone_problem']:<57}"
            else:
                alone = (f"{r['alone_ms']:8.3f} {r['alone_GB/s']:8.1f} "
                         f"{r['alone_of_copy']:8.1%} {r['call_minus_alone_us']:13.1f} "
                         f"{launches:>6}")
            print(f"{r['op']:<12} {r['format']:<21} {r['ms']:8.3f} {r['GB/s']:8.1f} "
                  f"{r['of_copy']:8.1%}   {alone} {vs:>6}  {mark}")
        sys.stdout.flush()
    if args.fixed:
        fixed = fixed_cost_table(cuda, args, comm)
        result["fixed_cost_us"] = fixed
        if comm.rank == 0:
            cols = ["host Allreduce", "device none", "device 2bit", "device 1bit"]
            rets = [f"{c} returned" for c in cols[1:]]
            print(f"\nfixed cost per call, {comm.size} rank(s), median us (device calls "
                  "synchronised; ret: until the call returned, not synchronised)")
            print(f"{'size':>10} " + " ".join(f"{c:>15}" for c in cols)
                  + f" {'2bit/none':>10} {'none/host':>10} "
                  + " ".join(f"{'ret ' + c.split()[1]:>9}" for c in cols[1:]))
            for r in fixed:
                print(f"{r['bytes']:>10} " + " ".join(f"{r[c]:15.0f}" for c in cols)
                      + f" {r['device 2bit'] / r['device none']:10.2f}"
                      + f" {r['device none'] / r['host Allreduce']:10.2f} "
                      + " ".join(f"{r[c]:9.0f}" for c in rets))
    if args.json and comm.rank == 0:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.check and misses:
        sys.exit(f"gpu_bench: {len(misses)} target(s) missed: {', '.join(misses)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
