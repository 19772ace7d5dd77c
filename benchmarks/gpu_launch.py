"""What a kernel launch and a device call cost on the host, by route (issue 49).

On a GPU, for the 2bit pack kernel of ``mpigc.kernels.cuda`` on a 4 KiB buffer:

- ``numba``: Numba's launch, ``kernel[grid, block, stream](*arrays)``: the
  route of a kernel's first launch with a set of argument types, and of every
  launch with ``MPIGC_DRIVER_LAUNCH=0``;
- ``driver``: ``cuLaunchKernel`` (``cuda.bindings.driver``) on the function
  Numba compiled, loaded from its PTX (``inspect_asm``, public) with
  ``cuda.core.ObjectCode.from_ptx(...).get_kernel(name)``, the parameter block
  (Numba's kernel ABI: an array is meminfo, parent, nitems, itemsize, data,
  shape, strides) packed once by ``mpigc.kernels._driver`` (``_load``,
  ``_args``: the route's own loading and packing) and reused;
- ``cuda.core``: ``cuda.core.launch`` with the same 52 arguments as Python
  scalars;

host microseconds per launch (median of ``--reps`` batches of 100 launches,
no wait inside a batch), and whether the driver launch wrote the bytes
Numba's did. ``mpigc.kernels._driver`` is this ``driver`` route, used by
every launch of mpigc unless ``MPIGC_DRIVER_LAUNCH=0``. Then, for the
engine's own primitives: ``cuEventRecord``,
``cuEventQuery``, ``cuStreamWaitEvent``, ``cuMemcpyDtoHAsync`` of 8 bytes to
pinned memory, against Numba's ``copy_to_host`` of 8 bytes (pageable) and
``stream.synchronize``. Last, a cProfile of ``--calls`` warm 4 KiB ``2bit``
device allreduces on ``MPI.COMM_WORLD`` (one rank, or ``mpirun -n 2`` for
two ranks sharing the GPU, staged with ``MPIGC_CUDA_AWARE=0``; rank 0
prints): the functions that take the time, and how
many of the calls are Numba's driver wrappers, and the launches and copies
of each route (``mpigc.kernels._driver.stats()``).

Usage (one GPU, one process)::

    python benchmarks/gpu_launch.py [--reps 20] [--calls 200] [--json FILE]
    MPIGC_CUDA_AWARE=0 mpirun -n 2 python benchmarks/gpu_launch.py

Exits 0 with a message where there is no GPU.
"""
import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import numpy as np


def _per_launch(fn, reps, batch=100):
    fn()  # warm
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(batch):
            fn()
        out.append((time.perf_counter() - t) / batch * 1e6)
    return statistics.median(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from numba import cuda
    if not cuda.is_available():
        print("no GPU: nothing measured")
        return 0
    from cuda.bindings import driver as drv

    from mpigc.kernels import _driver
    from mpigc.kernels import cuda as kc
    res = {}
    n = 1024
    rng = np.random.default_rng(1)
    x = cuda.to_device(rng.standard_normal(n).astype(np.float32))
    e_in = cuda.to_device(np.zeros(n, np.float32))
    e_out = cuda.device_array(n, np.float32)
    out = cuda.device_array(n // 4, np.uint8)
    starts = cuda.to_device(np.array([0, n], np.int64))
    offs = cuda.to_device(np.array([0], np.int64))
    nbad = cuda.to_device(np.zeros(1, np.int64))
    stream = cuda.stream()
    k = kc._pack_2bit_kernel
    blocks = kc._grid2(n, 1)
    arrays = (x, e_in, True, e_out, True, out, starts, offs, np.float32(0.5), nbad)

    def numba_launch():
        k[blocks, kc.THREADS, stream](*arrays)
    numba_launch()
    stream.synchronize()
    ref = out.copy_to_host(), e_out.copy_to_host()
    res["numba_launch_us"] = _per_launch(numba_launch, args.reps)
    stream.synchronize()

    # the same kernel through the driver, loaded and packed by the library's
    # own route (mpigc.kernels._driver: Numba's kernel ABI, checked against
    # the PTX's parameter list), launched here by hand
    import struct

    import cuda.core as cc
    if not _driver.enabled():
        print("the driver route is off (MPIGC_DRIVER_LAUNCH=0, or no cuda.bindings)")
        return 0
    t = time.perf_counter()
    fn = _driver._load(k, arrays)
    res["load_ptx_ms"] = (time.perf_counter() - t) * 1e3
    if fn is None:
        print("the pack kernel's signature is not one the driver route packs")
        return 1
    _, vals = _driver._args(arrays)
    res["params"] = len(vals)  # the block _load checked against the PTX's entry
    struct.pack_into(fn.fmt, fn.buf, 0, *vals)
    addr = fn.addr
    sh = int(stream.handle.value) if hasattr(stream.handle, "value") else int(stream.handle)
    hstream = drv.CUstream(sh)
    hk = fn.handle
    kern = fn.kernel
    gx, gy = blocks
    # clear the outputs, launch, compare
    out.copy_to_device(np.zeros(n // 4, np.uint8))
    e_out.copy_to_device(np.zeros(n, np.float32))

    def driver_launch():
        err, = drv.cuLaunchKernel(hk, gx, gy, 1, kc.THREADS, 1, 1, 0, hstream, addr, 0)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernel: {err}")
    driver_launch()
    stream.synchronize()
    got = out.copy_to_host(), e_out.copy_to_host()
    res["driver_equal"] = bool(np.array_equal(ref[0], got[0]) and np.array_equal(ref[1], got[1]))
    res["driver_launch_us"] = _per_launch(driver_launch, args.reps)
    stream.synchronize()
    try:
        cfg = cc.LaunchConfig(grid=(gx, gy, 1), block=kc.THREADS)
        cstream = cc.Stream.from_handle(sh)
        # each value as the numpy scalar of its parameter's width
        as_np = {"Q": np.uint64, "q": np.int64, "B": np.uint8, "f": np.float32}
        codes = _driver.param_codes(tuple(k.typeof_pyval(a) for a in arrays))
        typed = [as_np[c](v) for c, v in zip(codes, vals)]

        def core_launch():
            cc.launch(cstream, cfg, kern, *typed)
        res["cuda_core_launch_us"] = _per_launch(core_launch, args.reps)
    except Exception as exc:  # noqa: BLE001 - a route that fails is a finding
        res["cuda_core_launch_error"] = f"{type(exc).__name__}: {exc}"
    stream.synchronize()

    # the primitives of an asynchronous call
    _, ev = drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    res["event_record_us"] = _per_launch(lambda: drv.cuEventRecord(ev, hstream), args.reps)
    stream.synchronize()
    res["event_query_us"] = _per_launch(lambda: drv.cuEventQuery(ev), args.reps)
    _, s2 = drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
    res["stream_wait_event_us"] = _per_launch(lambda: drv.cuStreamWaitEvent(s2, ev, 0), args.reps)
    pinned = cuda.pinned_array(1, np.int64)
    hp = pinned.ctypes.data
    dp = nbad.__cuda_array_interface__["data"][0]
    res["memcpy_dtoh_async_pinned_us"] = _per_launch(
        lambda: drv.cuMemcpyDtoHAsync(hp, dp, 8, hstream), args.reps)
    stream.synchronize()
    res["numba_copy_to_host_8B_us"] = _per_launch(lambda: nbad.copy_to_host(), args.reps, 20)
    res["stream_synchronize_us"] = _per_launch(stream.synchronize, args.reps)

    # a warm device call, profiled: compressed (not the plain sum that small
    # buffers take by default)
    import os
    os.environ.setdefault("MPIGC_MIN_COMPRESS_BYTES", "0")
    import mpigc
    d = cuda.to_device(rng.standard_normal(n).astype(np.float32))
    fb = mpigc.ErrorFeedback()
    from mpi4py import MPI
    # averaged, as gradients are: a sum in place doubles the values at every
    # call at 2 ranks and overflows float32 within the profiled calls
    for _ in range(5):
        mpigc.allreduce(d, op="2bit", key="p", comm=MPI.COMM_WORLD, feedback=fb, average=True)
    cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.calls):
        mpigc.allreduce(d, op="2bit", key="p", comm=MPI.COMM_WORLD, feedback=fb, average=True)
    cuda.synchronize()
    res["call_2bit_4k_us"] = (time.perf_counter() - t) / args.calls * 1e6
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        mpigc.allreduce(d, op="2bit", key="p", comm=MPI.COMM_WORLD, feedback=fb, average=True)
    cuda.synchronize()
    prof.disable()
    res["driver_route"] = _driver.stats()
    res["driver_route_enabled"] = _driver.enabled()
    st = pstats.Stats(prof)
    total_calls = sum(v[1] for v in st.stats.values())
    drv_calls = sum(v[1] for k2, v in st.stats.items() if "cudadrv" in k2[0])
    res["profile_calls_per_call"] = total_calls / args.calls
    res["profile_cudadrv_calls_per_call"] = drv_calls / args.calls
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    res["profile_top"] = s.getvalue()[-6000:]
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(40)
    res["profile_cumulative"] = s.getvalue()[-8000:]
    res["ranks"] = MPI.COMM_WORLD.size
    if MPI.COMM_WORLD.rank:
        return 0
    for key, v in res.items():
        if not key.startswith("profile_"):
            print(f"{key}: {v}")
    print(f"profile: {res['profile_calls_per_call']:.0f} Python calls per call, "
          f"{res['profile_cudadrv_calls_per_call']:.0f} in numba's cudadrv")
    print(res["profile_top"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
