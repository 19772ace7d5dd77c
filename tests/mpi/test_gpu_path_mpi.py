"""The GPU path of the collectives, across ranks.

This file has two uses.

1. Collected by the MPI test session (``mpirun -n K python -m pytest --with-mpi
   tests/mpi``), which never runs Numba's CUDA simulator: the checks below that
   need no device array (how :func:`mpigc.cuda_aware_mpi` decides and reports
   its source, the environment variables, that host calls import no CUDA).

2. Run as a script, ``NUMBA_ENABLE_CUDASIM=1 mpirun -n K python
   tests/mpi/test_gpu_path_mpi.py GROUP``: device arrays (the simulator's) go
   through allreduce / reduce_scatter and must give results and residuals
   bit-identical to the same calls with host arrays. ``tests/test_gpu_path_sim.py``
   launches these runs for K = 1..4 from the plain test session, so neither
   pytest session ever imports the simulator (``NUMBA_ENABLE_CUDASIM`` is read
   once per process and replaces ``numba.cuda`` for good). Groups:

   ``staged``  ``MPIGC_CUDA_AWARE=0``: payloads staged through host buffers.
   ``aware``   ``MPIGC_CUDA_AWARE=1``: device buffers handed to MPI (flat
               calls, then the inter-node steps of hierarchical ones). In the
               simulator a device array is a numpy array in a wrapper, which
               MPI cannot take: ``mpigc._cuda.mpi_buffer`` gives MPI the wrapped
               array there (the documented test seam; on a GPU, the device
               array itself).
   ``detect``  no ``MPIGC_CUDA_AWARE``: the library is probed (this Open MPI
               says no), the staging warning comes once; host and device
               arrays mixed in a call raise on every rank; state dicts.
   ``hier``    ``MPIGC_CUDA_AWARE=0``, ``MPIGC_NODE_SPLIT=2`` (emulated nodes
               of two ranks: one node of 1 at 1 rank, 2+1 at 3 ranks):
               hierarchical calls (``hierarchy="node"``) on device arrays give
               the results and residuals of the same calls on host arrays,
               blocking and nonblocking, ``out=``, a failed call changes
               nothing, a saved state continues exactly.
   ``devices`` ``MPIGC_CUDA_AWARE=0``, two simulated devices (the simulator
               has one: :func:`_two_simulated_devices`): the progress thread
               makes each nonblocking call's GPU current before it advances
               the call, for every kind of call (flat, grouped,
               hierarchical, ``op="none"``): every copy and launch that an
               engine thread makes for a call started on device 1 (0) runs
               with device 1 (0) current there. A key's residuals live on
               one GPU: each device has its keys, and a key of device 1
               used by a call on device 0 (on one rank) fails on every rank
               with StateError, nothing changed.

   Ranks agree on pass/fail before the script exits; rank 0 prints
   ``ok GROUP`` or every rank's failures.
"""
import os
import sys
import warnings

import numpy as np
import pytest
from mpi4py import MPI

import mpigc
from mpigc import _cuda

# ranks: host-only checks here; tests/test_gpu_path_sim.py runs the device groups at 1-4
pytestmark = [pytest.mark.mpi, pytest.mark.ranks(1, 2)]


# ============================================================================
# 1. in the MPI test session (no simulator, no GPU)
# ============================================================================
def _fresh(comm):
    """A new communicator, so that mpigc decides again on it."""
    return comm.Dup()


def test_cuda_aware_env_wins(comm, monkeypatch):
    from conftest import assert_all  # not at the top: this file also runs as a script
    for value, aware in (("1", True), ("0", False)):
        monkeypatch.setenv("MPIGC_CUDA_AWARE", value)
        c = _fresh(comm)
        got = mpigc.cuda_aware_mpi(c)
        c.Free()
        assert_all(isinstance(got, mpigc.CudaAwareness)
                   and got == (aware, f"MPIGC_CUDA_AWARE={value}"), f"got {got!r}", comm)


def test_cuda_aware_probe_reports_source(comm, monkeypatch):
    from conftest import assert_all  # not at the top: this file also runs as a script
    monkeypatch.delenv("MPIGC_CUDA_AWARE", raising=False)
    c = _fresh(comm)
    got = mpigc.cuda_aware_mpi(c)
    once = mpigc.cuda_aware_mpi(c) is got
    c.Free()
    ok = (once and isinstance(got.aware, bool) and bool(got.source)
          and any(s in got.source for s in ("mpi_memory_alloc_kinds", "MPIX_Query_cuda_support",
                                            "not detected")))
    if "Open MPI" in MPI.Get_library_version() and MPI.Get_version() < (4, 1):
        # Open MPI exports MPIX_Query_cuda_support: the probe must find it
        ok = ok and ("MPIX_Query_cuda_support" in got.source or "alloc_kinds" in got.source)
    assert_all(ok, f"decided once: {once}, got {got!r}", comm)
    srcs = comm.allgather(got)
    assert all(s == srcs[0] for s in srcs), srcs


def test_cuda_aware_bad_env(comm, monkeypatch):
    from conftest import raises_everywhere  # not at the top: this file also runs as a script
    monkeypatch.setenv("MPIGC_CUDA_AWARE", "maybe")
    c = _fresh(comm)
    try:
        raises_everywhere(mpigc.ConfigError, lambda: mpigc.cuda_aware_mpi(c), comm,
                          match="MPIGC_CUDA_AWARE")
    finally:
        c.Free()


def test_alloc_kinds_parsing():
    ak = _cuda._alloc_kinds_aware
    assert ak("mpi,system,cuda") and ak("mpi,cuda:device") and ak("cuda:host,cuda:device")
    assert not ak("mpi,system") and not ak("mpi,cuda:host") and not ak("rocm:device")


def test_local_rank(comm):
    from mpigc import _comm
    cs = _comm.resolve(comm)
    assert 0 <= cs.local_rank < cs.local_size


def test_host_calls_touch_no_cuda(comm, fb):
    g = np.ones(1000, np.float32)
    mpigc.allreduce(g, "2bit", key="nocuda", feedback=fb)
    mpigc.cuda_aware_mpi(comm)
    assert "numba.cuda" not in sys.modules


# ============================================================================
# 2. the script (under mpirun, NUMBA_ENABLE_CUDASIM=1)
# ============================================================================
OPS = [{"type": "2bit", "threshold": 0.5},
       {"type": "1bit", "block_size": 8},
       {"type": "fp16", "error_feedback": True},
       {"type": "bf16", "error_feedback": True},
       {"type": "terngrad", "error_feedback": True, "seed": 3},
       "none",
       {"type": "2bit", "rel_threshold": 1.5, "block_size": 8}]
DTYPES = [np.float32, np.float64, np.float16]


class Checks:
    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.rank
        self.failures = []

    def check(self, cond, msg):
        if not cond:
            self.failures.append(msg)

    def same(self, what, got, want):
        got, want = np.asarray(got), np.asarray(want)
        ok = got.dtype == want.dtype and got.shape == want.shape \
            and got.tobytes() == want.tobytes()
        if not ok:
            bad = "shape/dtype" if got.shape != want.shape or got.dtype != want.dtype else \
                int(np.flatnonzero(got.view(np.uint8) != want.view(np.uint8))[0])
            self.failures.append(f"{what}: differ (first byte {bad})")

    def finish(self, group):
        allf = self.comm.allgather(self.failures)
        if self.rank == 0:
            bad = [(r, f) for r, fs in enumerate(allf) for f in fs]
            for r, f in bad:
                print(f"FAIL rank {r}: {f}")
            if not bad:
                print(f"ok {group}")
        sys.stdout.flush()
        return 0 if not any(allf) else 1


def _grad(rank, n, dtype, seed):
    rng = np.random.default_rng([seed, rank])
    return (rng.standard_normal(n) * 0.7).astype(dtype)


def _same_state(c, what, fbh, fbd):
    sh, sd = fbh.state_dict(), fbd.state_dict()
    c.check(sorted(sh) == sorted(sd), f"{what}: keys {sorted(sh)} vs {sorted(sd)}")
    for k in sh:
        for part in ("worker", "owner"):
            a, b = sh[k][part], sd[k].get(part)
            c.check((a is None) == (b is None), f"{what} {k} {part}: None on one side")
            if a is not None and b is not None:
                c.check(isinstance(b, np.ndarray), f"{what}: state_dict gave {type(b)}")
                c.same(f"{what} {k} {part}", b, a)
        c.check(sh[k]["calls"] == sd[k]["calls"], f"{what} {k}: calls differ")


def _compare(c, cuda, kind, op, gather, dtype, n, steps, average=False, hierarchy="flat",
             nonblocking=False, seed=0):
    """The same calls with host and device arrays; results and residuals
    bit for bit. ``nonblocking``: the device and host calls in flight together."""
    what = f"{kind} {op} {gather} {np.dtype(dtype).name} n={n} {hierarchy}"
    fbh, fbd = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
    for step in range(steps):
        g = _grad(c.rank, n, dtype, seed + step)
        kw = dict(op=op, key="k", average=average, hierarchy=hierarchy)
        if kind == "allreduce":
            h, d = g.copy(), cuda.to_device(g)
            if nonblocking:
                rd = mpigc.iallreduce(d, feedback=fbd, gather=gather, **kw)
                rh = mpigc.iallreduce(h, feedback=fbh, gather=gather, **kw)
                rh, rd = rh.wait(), rd.wait()
            else:
                rh = mpigc.allreduce(h, feedback=fbh, gather=gather, **kw)
                rd = mpigc.allreduce(d, feedback=fbd, gather=gather, **kw)
            c.check(rh is h and rd is d, f"{what}: allreduce must return buf")
            c.same(f"{what} step {step}", d.copy_to_host(), h)
        else:
            rh = mpigc.reduce_scatter(g, feedback=fbh, **kw)
            rd = mpigc.reduce_scatter(cuda.to_device(g), feedback=fbd, **kw)
            c.check(mpigc._dispatch.is_device_array(rd), f"{what}: result not on device")
            c.same(f"{what} step {step}", rd.copy_to_host(), rh)
            if step == 0:  # with a device out=
                lo, hi = mpigc.shard_bounds(n, c.comm.size)[c.rank]
                out = cuda.to_device(np.zeros(hi - lo, dtype))
                # fresh stores: terngrad's streams follow the key's call count
                got = mpigc.reduce_scatter(cuda.to_device(g), op=op, out=out, key="o",
                                           feedback=mpigc.ErrorFeedback(),
                                           hierarchy=hierarchy)
                want = mpigc.reduce_scatter(g, op=op, key="o", feedback=mpigc.ErrorFeedback(),
                                            hierarchy=hierarchy)
                c.check(got is out, f"{what}: out= not returned")
                c.same(f"{what} out=", out.copy_to_host(), want)
    _same_state(c, what, fbh, fbd)
    return fbh, fbd


# full=True on more than one rank: float32 for every op, and float64 or float16
# for these ops (indexes into OPS: both codecs of 2bit, 1bit, none's plain sum),
# so that each dtype still meets uneven shards through a compressed and the
# plain path; every dtype of every op runs at one rank (the conversions are
# per value, the same at any rank count)
_UNEVEN_DTYPES = {0: np.float64, 1: np.float16, 5: np.float64, 6: np.float16}


def _dtypes(c, i, full):
    if not full:
        return [np.float32]
    if c.comm.size == 1:
        return DTYPES
    return [np.float32] + ([_UNEVEN_DTYPES[i]] if i in _UNEVEN_DTYPES else [])


def _matrix(c, cuda, full):
    N = c.comm.size
    for i, op in enumerate(OPS):
        name = op if isinstance(op, str) else op["type"]
        for dtype in _dtypes(c, i, full):
            _compare(c, cuda, "allreduce", op, "compressed", dtype, 101, 2,
                     average=dtype == np.float32)
        if name != "none":
            for dtype in ([np.float32, np.float16] if name == "2bit" else [np.float32]):
                _compare(c, cuda, "allreduce", op, "exact", dtype, 101, 2)
        for dtype in ([np.float32, np.float16, np.float64] if name == "2bit" and full
                      else [np.float32]):
            _compare(c, cuda, "reduce_scatter", op, "compressed", dtype, 77, 2 if full else 1)
    # fewer elements than ranks: empty shards
    _compare(c, cuda, "allreduce", OPS[0], "compressed", np.float32, max(1, N - 1), 2)


def _compare_foreign(c, cuda, op, dtype, n):
    """Arrays that behave like CUDA torch tensors (``tests/support/foreign_arrays.py``:
    a torch ``.dtype``, the numpy type only in ``__cuda_array_interface__``)
    give what host arrays give, in place, as ``out=`` too; a read-only one is
    refused on every rank."""
    from support.foreign_arrays import TorchLikeTensor
    name = op if isinstance(op, str) else op["type"]
    what = f"foreign {name} {np.dtype(dtype).name} n={n}"
    fbh, fbd = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
    for step in range(2):
        g = _grad(c.rank, n, dtype, 10 + step)
        h, d = g.copy(), cuda.to_device(g)
        t = TorchLikeTensor(d)
        r = mpigc.allreduce(t, op=op, key="f", feedback=fbd, average=True)
        mpigc.allreduce(h, op=op, key="f", feedback=fbh, average=True)
        c.check(r is t, f"{what}: allreduce must return the tensor")
        c.same(f"{what} step {step}", d.copy_to_host(), h)
    _same_state(c, what, fbh, fbd)
    g = _grad(c.rank, n, dtype, 20)
    lo, hi = mpigc.shard_bounds(n, c.comm.size)[c.rank]
    out = cuda.to_device(np.zeros(hi - lo, dtype))
    tout = TorchLikeTensor(out)
    got = mpigc.reduce_scatter(TorchLikeTensor(cuda.to_device(g)), op=op, out=tout, key="o",
                               feedback=mpigc.ErrorFeedback())
    want = mpigc.reduce_scatter(g, op=op, key="o", feedback=mpigc.ErrorFeedback())
    c.check(got is tout, f"{what}: out= not returned")
    c.same(f"{what} reduce_scatter out=", out.copy_to_host(), want)
    ro = TorchLikeTensor(cuda.to_device(g), readonly=True)
    _raises_everywhere(c, f"{what} read-only", mpigc.InvalidBufferError,
                       lambda: mpigc.allreduce(ro, op=op, key="r", feedback=False))


def _compare_grouped(c, cuda, op, dtype=np.float32, sizes=(3, 50, 1, 77)):
    """Grouped calls (``allreduce([...])``) on device arrays give the bits of
    the same grouped calls on host arrays, results and each member's
    residuals, reduce_scatter's shards on the device; a group mixing host
    and device arrays fails on every rank."""
    name = op if isinstance(op, str) else op["type"]
    what = f"grouped {name} {np.dtype(dtype).name}"
    fbh, fbd = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
    for step in range(2):
        gs = [_grad(c.rank, m, dtype, 30 + 10 * step + i) for i, m in enumerate(sizes)]
        h, d = [g.copy() for g in gs], [cuda.to_device(g) for g in gs]
        rh = mpigc.allreduce(h, op=op, key="g", feedback=fbh, average=step == 1)
        rd = mpigc.allreduce(d, op=op, key="g", feedback=fbd, average=step == 1)
        c.check(rh is h and rd is d, f"{what}: allreduce must return the list")
        for i, (x, y) in enumerate(zip(d, h)):
            c.same(f"{what} step {step} member {i}", x.copy_to_host(), y)
        sh = mpigc.reduce_scatter(gs, op=op, key="s", feedback=fbh)
        sd = mpigc.reduce_scatter([cuda.to_device(g) for g in gs], op=op, key="s",
                                  feedback=fbd)
        for i, (x, y) in enumerate(zip(sd, sh)):
            c.check(mpigc._dispatch.is_device_array(x), f"{what}: shard {i} not on device")
            c.same(f"{what} step {step} shard {i}", x.copy_to_host(), y)
    _same_state(c, what, fbh, fbd)
    _raises_everywhere(c, f"{what} host and device", mpigc.InvalidBufferError,
                       lambda: mpigc.allreduce([cuda.to_device(gs[0]), gs[1].copy()], op=op,
                                               feedback=False))


def _staging_spans(fn):
    """``fn()`` under a timeline recording: this rank's staging spans, a
    list of ``(name, bytes)``."""
    import json
    import tempfile
    path = os.path.join(tempfile.mkdtemp(), "t.json")
    mpigc.timeline.start(path)
    try:
        fn()
    finally:
        mine = mpigc.timeline.stop()
    with open(mine) as f:
        events = json.load(f)["traceEvents"]
    return [(e["name"], e["args"]["bytes"]) for e in events
            if e["ph"] == "X" and e["name"].startswith("staging")]


def _check_staging_spans(c, cuda, staged):
    """A timeline shows a device call's staging copies, with their bytes,
    exactly when it stages (``staged``): a 2bit call (payloads out, received
    payloads back) and an op="none" call of 1000 float32 values."""
    g = _grad(c.rank, 1000, np.float32, 7)
    got = _staging_spans(lambda: (
        mpigc.allreduce(cuda.to_device(g), "2bit", key="spans"),
        mpigc.allreduce(cuda.to_device(g), "none")))
    names = {n for n, _ in got}
    if not staged:
        c.check(not got, f"staging spans without staging: {got}")
        return
    c.check(names == {"staging to host", "staging to device"}, f"staging spans: {names}")
    c.check(all(b > 0 for _, b in got), f"staging spans of no bytes: {got}")
    # op="none": all of this rank's values go out, every result comes back
    c.check(sum(b for n, b in got if n == "staging to host") >= 4000,
            f"staged to host: {got}")


def group_staged(c, cuda):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _matrix(c, cuda, full=True)
    c.check(not [x for x in w if "pinned host memory" in str(x.message)],
            "staging warning with MPIGC_CUDA_AWARE=0")
    c.check(mpigc.cuda_aware_mpi() == (False, "MPIGC_CUDA_AWARE=0"),
            f"cuda_aware_mpi: {mpigc.cuda_aware_mpi()}")
    c.check(_cuda.staging_pool.allocated > 0 or c.comm.size == 1,
            "no staging buffer was used")
    for op in OPS:
        _compare_foreign(c, cuda, op, np.float32, 45)
    _compare_foreign(c, cuda, OPS[0], np.float16, 45)
    _compare_foreign(c, cuda, OPS[2], np.float64, 45)
    for op in OPS:
        _compare_grouped(c, cuda, op)
    _compare_grouped(c, cuda, OPS[0], np.float16)
    _check_staging_spans(c, cuda, staged=True)
    # the small-buffer fallback (plain MPI sum) on device arrays, staged
    os.environ["MPIGC_MIN_COMPRESS_BYTES"] = "8192"
    try:
        _compare(c, cuda, "allreduce", OPS[0], "compressed", np.float16, 33, 1, average=True)
        _compare(c, cuda, "reduce_scatter", OPS[1], "compressed", np.float32, 33, 1)
    finally:
        os.environ["MPIGC_MIN_COMPRESS_BYTES"] = "0"


def group_aware(c, cuda):
    c.check(mpigc.cuda_aware_mpi() == (True, "MPIGC_CUDA_AWARE=1"),
            f"cuda_aware_mpi: {mpigc.cuda_aware_mpi()}")
    _matrix(c, cuda, full=False)
    _compare(c, cuda, "allreduce", OPS[0], "compressed", np.float16, 101, 2)
    _compare(c, cuda, "allreduce", "none", "compressed", np.float16, 101, 1, average=True)
    _compare_foreign(c, cuda, OPS[1], np.float32, 45)
    _compare_foreign(c, cuda, "none", np.float16, 45)
    _compare_grouped(c, cuda, OPS[0])
    _check_staging_spans(c, cuda, staged=False)
    c.check(_cuda.staging_pool.allocated == 0,
            f"{_cuda.staging_pool.allocated} staging buffer(s) with CUDA-aware MPI")
    # hierarchical calls: the inter-node engine calls hand device buffers to
    # MPI (the intra-node steps are staged through the host window regardless)
    os.environ["MPIGC_NODE_SPLIT"] = "2"
    _compare_hier(c, cuda, "allreduce", OPS[0], np.float32, 101, 2)
    _compare_hier(c, cuda, "reduce_scatter", OPS[1], np.float32, 77, 1)


def _raises_everywhere(c, what, exc_type, fn):
    try:
        fn()
        got = None
    except Exception as e:  # noqa: BLE001
        got = e
    c.check(isinstance(got, exc_type),
            f"{what}: expected {exc_type.__name__}, got {type(got).__name__}: {got}")
    return got


def group_detect(c, cuda):
    comm, r = c.comm, c.rank
    dec = mpigc.cuda_aware_mpi()
    c.check(not dec.source.startswith("MPIGC_CUDA_AWARE"), f"source {dec.source}")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            mpigc.allreduce(cuda.to_device(_grad(r, 64, np.float32, 0)), "2bit", key="w",
                            feedback=False)
    msgs = [x for x in w if "pinned host memory" in str(x.message)]
    if not dec.aware:
        c.check(len(msgs) == 1, f"staging warning {len(msgs)} times, expected once")
        c.check(msgs and "MPIGC_CUDA_AWARE=0" in str(msgs[0].message)
                and dec.source in str(msgs[0].message), "warning text")
        c.check(msgs and msgs[0].filename == __file__,
                f"warning points to {msgs and msgs[0].filename}, not the caller")
    n = 50
    g = _grad(r, n, np.float32, 1)
    lo, hi = mpigc.shard_bounds(n, comm.size)[r]
    # out= on the host for a device buffer (rank 0 only): an error everywhere
    out = np.zeros(hi - lo, np.float32) if r == 0 else cuda.to_device(np.zeros(hi - lo,
                                                                              np.float32))
    e = _raises_everywhere(c, "host out", mpigc.InvalidBufferError, lambda: mpigc.reduce_scatter(
        cuda.to_device(g), "2bit", out=out, key="x", feedback=False))
    c.check(e is None or "rank 0" in str(e) and "mixed" in str(e), f"message: {e}")
    # the reverse: a device out= for a host buffer
    out = cuda.to_device(np.zeros(hi - lo, np.float32)) if r == 0 else np.zeros(hi - lo,
                                                                               np.float32)
    _raises_everywhere(c, "device out", mpigc.InvalidBufferError, lambda: mpigc.reduce_scatter(
        g, "2bit", out=out, key="x", feedback=False))
    # a key whose residuals live on the host, used with a device buffer (rank 0)
    fb = mpigc.ErrorFeedback()
    mpigc.allreduce(g.copy(), "2bit", key="m", feedback=fb)
    before = fb.state_dict()
    buf = cuda.to_device(g) if r == 0 else g.copy()
    e = _raises_everywhere(c, "host residuals, device buffer", mpigc.StateError,
                           lambda: mpigc.allreduce(buf, "2bit", key="m", feedback=fb))
    c.check(e is None or "host memory" in str(e), f"message: {e}")
    after = fb.state_dict()
    c.same("residual unchanged after the error", after["m"]["worker"], before["m"]["worker"])
    c.check(after["m"]["calls"] == before["m"]["calls"], "calls changed by a failed call")
    # and the reverse: device residuals, host buffer (rank 0)
    fbd = mpigc.ErrorFeedback()
    mpigc.allreduce(cuda.to_device(g), "2bit", key="m", feedback=fbd)
    buf = g.copy() if r == 0 else cuda.to_device(g)
    _raises_everywhere(c, "device residuals, host buffer", mpigc.StateError,
                       lambda: mpigc.allreduce(buf, "2bit", key="m", feedback=fbd))
    # residuals live on the device, state_dict gives host copies; a loaded
    # state goes to the device on the next device call, and continues exactly
    fbh = mpigc.ErrorFeedback()
    mpigc.allreduce(g.copy(), "2bit", key="m", feedback=fbh)
    entry = fbd.entry("m")
    c.check(mpigc._dispatch.is_device_array(entry.worker), "worker residual not on device")
    c.check(mpigc._dispatch.is_device_array(entry.owner), "owner residual not on device")
    sd = fbd.state_dict()
    c.check(isinstance(sd["m"]["worker"], np.ndarray), "state_dict: not a host array")
    fb2 = mpigc.ErrorFeedback()
    fb2.load_state_dict(sd)
    g2 = _grad(r, n, np.float32, 2)
    d = cuda.to_device(g2)
    h = g2.copy()
    mpigc.allreduce(d, "2bit", key="m", feedback=fb2)
    mpigc.allreduce(h, "2bit", key="m", feedback=fbh)
    c.same("after load_state_dict", d.copy_to_host(), h)
    c.check(mpigc._dispatch.is_device_array(fb2.entry("m").worker), "not placed on device")
    _same_state(c, "after load_state_dict", fbh, fb2)
    # a non-finite gradient on one rank: skipped everywhere, NaN on the device
    x = _grad(r, n, np.float32, 3)
    if r == comm.size - 1:
        x[7] = np.inf
    d = cuda.to_device(x)
    mpigc.allreduce(d, "2bit", key="m", feedback=fb2, nonfinite="skip")
    c.check(np.isnan(d.copy_to_host()).all(), "skip: result not NaN")
    _same_state(c, "skip leaves residuals", fbh, fb2)
    # nonblocking: two device buffers outstanding, waited in reverse order
    a, b = _grad(r, 40, np.float32, 4), _grad(r, 60, np.float64, 5)
    da, db = cuda.to_device(a), cuda.to_device(b)
    fbn = mpigc.ErrorFeedback()
    ra = mpigc.iallreduce(da, "1bit", key="a", feedback=fbn, block_size=8)
    rb = mpigc.iallreduce(db, "fp16", key="b", feedback=fbn, gather="exact")
    rb.wait()
    ra.wait()
    mpigc.allreduce(a, "1bit", key="a", feedback=fbh, block_size=8)
    mpigc.allreduce(b, "fp16", key="b", feedback=fbh, gather="exact")
    c.same("iallreduce a", da.copy_to_host(), a)
    c.same("iallreduce b", db.copy_to_host(), b)
    # select_device: one GPU per node-local rank (the simulator has one)
    c.check(mpigc.select_device() == 0, "select_device in the simulator")
    c.check(mpigc.select_device(device=0) == 0, "select_device(device=0)")
    _raises_everywhere(c, "select_device(-1)", mpigc.ConfigError,
                       lambda: mpigc.select_device(device=-1))


def _compare_hier(c, cuda, kind, op, dtype, n, steps, average=False, nonblocking=False):
    """:func:`_compare` of hierarchical calls; their residuals on the device."""
    name = op if isinstance(op, str) else op["type"]
    fbh, fbd = _compare(c, cuda, kind, op, "compressed", dtype, n, steps, average=average,
                        hierarchy="node", nonblocking=nonblocking, seed=30)
    what = f"hier {kind} {name} {np.dtype(dtype).name} n={n}"
    for k, e in fbd.entries().items():
        c.check(e.worker is None or mpigc._dispatch.is_device_array(e.worker),
                f"{what}: residual {k} not on the device")
    c.check(any("@hier[" in k for k in fbd.keys()) or name == "none" or n < 2,
            f"{what}: no hierarchical residual ({fbd.keys()})")
    return fbh, fbd


def group_hier(c, cuda):
    N, r = c.comm.size, c.rank
    os.environ["MPIGC_NODE_SPLIT"] = "2"
    lay = mpigc._hierarchy.layout(c.comm)
    c.check(lay.node_sizes == [2] * (N // 2) + [1] * (N % 2),
            f"emulated nodes {lay.node_sizes}")
    for op in OPS:
        _compare_hier(c, cuda, "allreduce", op, np.float32, 101, 2, average=True)
        _compare_hier(c, cuda, "reduce_scatter", op, np.float32, 77, 1)
    _compare_hier(c, cuda, "allreduce", OPS[0], np.float16, 101, 2)
    _compare_hier(c, cuda, "allreduce", OPS[1], np.float64, 64, 2, nonblocking=True)
    _compare_hier(c, cuda, "reduce_scatter", OPS[0], np.float16, 50, 2, average=True)
    # fewer elements than slices and ranks
    _compare_hier(c, cuda, "allreduce", OPS[0], np.float32, 1, 2)
    # the node window is on the host: a device call's values go there and back
    got = _staging_spans(lambda: mpigc.allreduce(
        cuda.to_device(_grad(r, 101, np.float32, 9)), "2bit", key="spans", hierarchy="node"))
    c.check({n for n, _ in got} >= {"staging to host", "staging to device"},
            f"hier staging spans: {got}")
    c.check(("staging to host", 404) in got and ("staging to device", 404) in got,
            f"hier: the whole buffer staged each way: {got}")
    # a torch-like tensor (foreign __cuda_array_interface__), out= on the device
    from support.foreign_arrays import TorchLikeTensor
    n = 45
    g = _grad(r, n, np.float32, 40)
    d = cuda.to_device(g)
    t = TorchLikeTensor(d)
    fbh, fbd = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
    got = mpigc.allreduce(t, "2bit", key="t", feedback=fbd, hierarchy="node")
    h = mpigc.allreduce(g.copy(), "2bit", key="t", feedback=fbh, hierarchy="node")
    c.check(got is t, "hier: allreduce must return the tensor")
    c.same("hier foreign allreduce", d.copy_to_host(), h)
    lo, hi = mpigc.shard_bounds(n, N)[r]
    out = cuda.to_device(np.zeros(hi - lo, np.float32))
    tout = TorchLikeTensor(out)
    got = mpigc.reduce_scatter(cuda.to_device(g), "1bit", out=tout, key="o", feedback=fbd,
                               hierarchy="node", block_size=8)
    want = mpigc.reduce_scatter(g, "1bit", key="o", feedback=fbh, hierarchy="node",
                                block_size=8)
    c.check(got is tout, "hier: out= not returned")
    c.same("hier reduce_scatter out=", out.copy_to_host(), want)
    _same_state(c, "hier foreign", fbh, fbd)
    # a host out= for a device buffer on one rank: refused on every rank
    bad = np.zeros(hi - lo, np.float32) if r == 0 else cuda.to_device(np.zeros(hi - lo,
                                                                              np.float32))
    e = _raises_everywhere(c, "hier host out", mpigc.InvalidBufferError,
                           lambda: mpigc.reduce_scatter(cuda.to_device(g), "2bit", out=bad,
                                                        key="x", feedback=fbd,
                                                        hierarchy="node"))
    c.check(e is None or "rank 0" in str(e), f"message: {e}")
    # a non-finite value on the last rank: skipped (or raised) everywhere, no
    # residual changed, NaN on the device
    fbh, fbd = _compare_hier(c, cuda, "allreduce", OPS[0], np.float32, 64, 1)
    x = _grad(r, 64, np.float32, 50)
    if r == N - 1:
        x[5] = np.nan
    d = cuda.to_device(x)
    mpigc.allreduce(d, "2bit", key="k", feedback=fbd, hierarchy="node", nonfinite="skip")
    c.check(np.isnan(d.copy_to_host()).all(), "hier skip: result not NaN")
    _raises_everywhere(c, "hier raise", mpigc.NonFiniteError, lambda: mpigc.allreduce(
        cuda.to_device(x), "2bit", key="k", feedback=fbd, hierarchy="node"))
    _same_state(c, "hier failed calls change nothing", fbh, fbd)
    # the saved state, loaded into a new store, continues on the device exactly
    fb2 = mpigc.ErrorFeedback()
    fb2.load_state_dict(fbd.state_dict())
    g = _grad(r, 64, np.float32, 51)
    d, h = cuda.to_device(g), g.copy()
    mpigc.allreduce(d, "2bit", key="k", feedback=fb2, hierarchy="node")
    mpigc.allreduce(h, "2bit", key="k", feedback=fbh, hierarchy="node")
    c.same("hier after load_state_dict", d.copy_to_host(), h)
    _same_state(c, "hier after load_state_dict", fbh, fb2)
    # a checkpoint of device residuals: saved from host copies, loaded onto the
    # device at the next call, continues exactly
    import shutil
    import tempfile
    tmp = c.comm.bcast(tempfile.mkdtemp() if r == 0 else None)
    try:
        mpigc.save_checkpoint(os.path.join(tmp, "ck"), fb2, comm=c.comm)
        fb3 = mpigc.ErrorFeedback()
        mpigc.load_checkpoint(os.path.join(tmp, "ck"), fb3, comm=c.comm, hierarchy="node")
    finally:
        c.comm.Barrier()
        if r == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    _same_state(c, "hier checkpoint round trip", fbh, fb3)
    g = _grad(r, 64, np.float32, 52)
    d, h = cuda.to_device(g), g.copy()
    mpigc.allreduce(d, "2bit", key="k", feedback=fb3, hierarchy="node")
    mpigc.allreduce(h, "2bit", key="k", feedback=fbh, hierarchy="node")
    c.same("hier after load_checkpoint", d.copy_to_host(), h)
    c.check(all(e.worker is None or mpigc._dispatch.is_device_array(e.worker)
                for e in fb3.entries().values()), "hier: loaded residuals not on the device")
    c.check(_cuda.staging_pool.allocated > 0, "no staging buffer was used")


def _two_simulated_devices(cuda):
    """Give Numba's simulator, which has one device, a second:
    ``cuda.select_device(d)`` makes device d (0 or 1) current in the calling
    thread, ``cuda.current_context().id`` says which is
    (:func:`mpigc._cuda.current_device_id` reads it), ``len(cuda.gpus)`` is
    2, and a thread starts on device 0, as a thread without a CUDA context
    does on a GPU. Memory is the host's on both: what tells the devices
    apart is which one is current when mpigc copies or launches
    (:func:`_device_log`). Returns ``current()``, the calling thread's."""
    import threading

    from numba.cuda.simulator.cudadrv import devices as simulated
    contexts = (simulated.FakeCUDAContext(0), simulated.FakeCUDAContext(1))
    local = threading.local()

    def current():
        return getattr(local, "device", 0)

    def select_device(dev=0):
        if dev not in (0, 1):
            raise ValueError(f"the simulated devices are 0 and 1, got {dev}")
        local.device = dev
        return contexts[dev].device

    class _Two(simulated.FakeDeviceList):
        def __init__(self):
            super().__init__()
            self.lst = contexts

        @property
        def current(self):
            return contexts[current()]

    cuda.select_device = select_device
    cuda.current_context = lambda devnum=None: contexts[
        current() if devnum is None else devnum]
    cuda.gpus = _Two()
    return current


def _device_log(current):
    """Record ``(thread name, device current there, what)`` at every kernel
    launch (``kernels.cuda._launch``) and every copy, allocation and
    synchronisation of :mod:`mpigc._cuda` from now on; returns the list."""
    import threading

    from mpigc.kernels import cuda as kc
    log = []

    def wrap(module, name):
        f = getattr(module, name)

        def recorded(*args, **kw):
            log.append((threading.current_thread().name, current(), name))
            return f(*args, **kw)
        setattr(module, name, recorded)

    wrap(kc, "_launch")
    for name in ("copy", "to_host", "to_device", "empty", "zeros", "sync"):
        wrap(_cuda, name)
    return log


def group_devices(c, cuda):
    """The progress thread makes each call's GPU current (issue 50, item 4):
    a nonblocking call of each kind is started on device 1, then on device 0,
    and left to the progress thread until it is done; every copy and launch
    an engine thread made for it ran with the call's device current there.
    The short path's calls are blocking, on host arrays, and never queued:
    they say so (``device_id()`` None)."""
    import time
    r, comm = c.rank, c.comm
    if not mpigc.diagnostics.progress_thread_enabled():
        c.check(False, "no progress thread (MPI_THREAD_MULTIPLE, MPIGC_PROGRESS_THREAD)")
        return
    current = _two_simulated_devices(cuda)
    log = _device_log(current)
    os.environ["MPIGC_NODE_SPLIT"] = "2"
    hier = mpigc._hierarchy.layout(comm).hierarchical("node")
    fb = mpigc.ErrorFeedback()
    # a key's residuals live on one GPU (a key used on another raises): a
    # key per device
    kinds = {
        "flat": lambda g, d: mpigc.iallreduce(cuda.to_device(g), "2bit", key=f"f{d}",
                                              feedback=fb),
        "grouped": lambda g, d: mpigc.iallreduce(
            [cuda.to_device(g[:20]), cuda.to_device(g[20:])], "2bit", key=f"g{d}",
            feedback=fb),
        "hierarchical": lambda g, d: mpigc.iallreduce(cuda.to_device(g), "2bit", key=f"h{d}",
                                                      feedback=fb, hierarchy="node"),
        "none": lambda g, d: mpigc.iallreduce(cuda.to_device(g), "none"),
    }
    for kind, start in kinds.items():
        for dev in (1, 0):
            what = f"{kind} on device {dev}"
            cuda.select_device(dev)
            mark = len(log)
            req = start(_grad(r, 64, np.float32, dev), dev)
            call = req._op
            c.check(call.device_id() == dev, f"{what}: the call says device {call.device_id()}")
            if kind == "hierarchical":
                c.check((type(call).__name__ == "_HierCall") == hier, f"{what}: {call}")
            if kind == "grouped":
                c.check(call.group is not None, f"{what}: not a grouped call")
            # the progress thread alone advances it (no test() or wait() here)
            deadline = time.monotonic() + 300
            while not req.done and time.monotonic() < deadline:
                time.sleep(1e-3)
            c.check(req.done, f"{what}: not done by the progress thread in 300 s")
            req.wait()
            ours = [e for e in log[mark:] if e[0] != "MainThread"]
            c.check(ours, f"{what}: no engine thread copied or launched for it")
            wrong = [e for e in ours if e[1] != dev]
            c.check(not wrong, f"{what}: {len(wrong)} of {len(ours)} copies and launches "
                    f"with another device current, first {wrong[:3]}")
    # device 1's key used by a call on device 0 (rank 0; the others on device 1)
    cuda.select_device(0 if r == 0 else 1)
    before = fb.state_dict()["f1"]
    e = _raises_everywhere(c, "a key of another GPU", mpigc.StateError,
                           lambda: mpigc.allreduce(cuda.to_device(_grad(r, 64, np.float32, 2)),
                                                   "2bit", key="f1", feedback=fb))
    c.check(r != 0 or "holds residuals on GPU 1; this call's buffer is on GPU 0" in str(e),
            f"message: {e}")
    after = fb.state_dict()["f1"]
    c.same("another GPU: residual unchanged", after["worker"], before["worker"])
    c.check(after["calls"] == before["calls"], "another GPU: calls changed")
    cuda.select_device(1)
    mpigc.allreduce(cuda.to_device(_grad(r, 64, np.float32, 3)), "2bit", key="f1",
                    feedback=fb)  # on its own GPU again, on every rank
    cuda.select_device(0)
    from mpigc import _shortcall
    c.check(_shortcall.Done(None, None).device_id() is None, "the short path's device")


GROUPS = {"staged": group_staged, "aware": group_aware, "detect": group_detect,
          "hier": group_hier, "devices": group_devices}


def main(group):
    assert _cuda.simulator(), "run with NUMBA_ENABLE_CUDASIM=1"
    os.environ["MPIGC_MIN_COMPRESS_BYTES"] = "0"
    # numpy scalar arithmetic in the simulated kernels: the intended uint64
    # wrap-around of the hash, NaN - NaN of the non-finite count
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"mpigc\.kernels\.cuda")
    from numba import cuda
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from support.simulator_fix import fix_simulator_shared_arrays
    fix_simulator_shared_arrays()
    from support import launch_contract
    from mpigc.kernels import cuda as kc
    launch_contract.install(kc)  # every simulated launch: what a real launch accepts
    comm = MPI.COMM_WORLD
    c = Checks(comm)
    try:
        GROUPS[group](c, cuda)
    except Exception:  # noqa: BLE001 - reported with the others
        import traceback
        c.failures.append(traceback.format_exc())
    return c.finish(group)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
