"""allreduce / reduce_scatter against a full single-process simulation.

Every rank rebuilds every rank's gradients (they are seeded by rank) and
simulates the whole two-phase algorithm with the public compressor API: the
payloads of each shard, the owner's sum in rank order, the owner's second
compression with its residual. The collective must reproduce it bit for bit,
results and residuals, over several steps.
"""
import zlib

import numpy as np
import pytest

import mpigc
from mpigc.compressors import work_dtype
from mpigc.kernels.cpu import ternary_stream

from conftest import assert_all, grads

# ranks: flat; the simulation is generic in N: 2 even shards, 3 uneven/empty ones; 4 adds nothing
pytestmark = pytest.mark.ranks(1, 2, 3)

OPS = ["none", "fp16", "bf16", "2bit", "1bit", "terngrad",
       {"type": "2bit", "threshold": 0.25}, {"type": "1bit", "block_size": 16},
       {"type": "2bit", "rel_threshold": 1.5},
       {"type": "2bit", "rel_threshold": 1.0, "block_size": 12},
       {"type": "terngrad", "error_feedback": True, "seed": 7},
       {"type": "fp16", "error_feedback": True}, {"type": "bf16", "error_feedback": True}]


def _id(op):
    return op if isinstance(op, str) else "-".join(f"{v}" for v in op.values())


class Simulation:
    """The reference: the algorithm of ALGORITHMS.md for all ranks at once."""

    def __init__(self, comp, n, N, dtype, average, gather):
        self.comp, self.n, self.N = comp, n, N
        self.dtype, self.wd = np.dtype(dtype), work_dtype(dtype)
        self.acc_dtype = np.float64 if self.dtype == np.float64 else np.float32
        self.average, self.gather = average, gather
        self.bounds = mpigc.shard_bounds(n, N)
        ef = comp.uses_feedback
        self.E = [np.zeros(n, self.wd) for _ in range(N)] if ef else None
        self.O = [np.zeros(hi - lo, self.wd) for lo, hi in self.bounds] if ef else None
        self.calls = 0
        # terngrad's streams hash the seed with the key (here "k"), the rank,
        # the call count and the stage
        self.seed = getattr(comp, "seed", 0) ^ (zlib.crc32(b"k") << 32)

    def step(self, xs):
        comp, N = self.comp, self.N
        xs = [x.astype(self.wd) for x in xs]
        if comp.codec_id == "none":
            tot = xs[0].astype(self.acc_dtype)
            for x in xs[1:]:
                tot = tot + x
            if self.average:
                tot = tot / N
            return tot.astype(self.dtype)
        kw = [{} for _ in range(N)]
        if comp.needs_global_scale:
            scales = [comp.local_scale(xs[r], None if self.E is None else self.E[r])
                      for r in range(N)]
            scale = max(s[0] for s in scales)
            for r in range(N):
                kw[r] = {"scale": scale, "clip_bound": scales[r][1],
                         "stream": ternary_stream(self.seed, r, self.calls, 0)}
        elif comp.prescales_average and self.average:
            kw = [{"divisor": float(N)} for _ in range(N)]
        result = np.empty(self.n, self.dtype)
        for j, (lo, hi) in enumerate(self.bounds):
            if hi == lo:
                continue
            acc = None
            for r in range(N):
                e = None if self.E is None else self.E[r][lo:hi]
                p = comp.compress(xs[r][lo:hi], e, offset=lo, **kw[r])
                d = comp.decompress(p, hi - lo, dtype=self.acc_dtype)
                acc = d if acc is None else acc + d
            if self.average and not comp.prescales_average:
                acc = acc / N
            if self.gather == "exact":
                result[lo:hi] = acc
                continue
            o = None if self.O is None else self.O[j]
            kw2 = {}
            if comp.needs_global_scale:
                amax, bound, _ = comp.local_scale(acc, o)
                kw2 = {"scale": amax, "clip_bound": bound,
                       "stream": ternary_stream(self.seed, j, self.calls, 1)}
            p2 = comp.compress(acc.astype(self.wd), o, offset=lo, **kw2)
            result[lo:hi] = comp.decompress(p2, hi - lo, dtype=self.acc_dtype)
        self.calls += 1
        return result


def _run(comm, fb, op, n, dtype, average, gather, steps=3, kind="allreduce"):
    N, r = comm.size, comm.rank
    comp = mpigc.get_compressor(op)
    sim = Simulation(comp, n, N, dtype, average, gather)
    ok, why = True, ""
    for s in range(steps):
        xs = [grads(q, n, dtype, seed=s) for q in range(N)]
        ref = sim.step(xs)
        if kind == "allreduce":
            got = mpigc.allreduce(xs[r].copy(), op=op, key="k", feedback=fb,
                                  average=average, gather=gather)
            want = ref
        else:
            got = mpigc.reduce_scatter(xs[r], op=op, key="k", feedback=fb, average=average)
            lo, hi = sim.bounds[r]
            want = ref[lo:hi]
        if comp.codec_id == "none":  # MPI's summation order is its own
            tol = 1e-2 if dtype == np.float16 else 1e-5
            same = np.allclose(got, want, rtol=tol, atol=tol)
        else:
            same = got.tobytes() == want.tobytes()
        if got.dtype != np.dtype(dtype) or not same:
            ok = False
            why = f"step {s}: max diff {np.max(np.abs(got.astype(float) - want))}"
            break
    if ok and sim.E is not None and comp.codec_id != "none":
        st = fb.state_dict()["k"]
        if st["worker"].tobytes() != sim.E[r].tobytes():
            ok, why = False, "worker residual differs"
        elif kind == "allreduce" and gather == "compressed":
            lo, hi = sim.bounds[r]
            own = st["owner"] if st["owner"] is not None else np.zeros(0, sim.wd)
            if hi > lo and own.tobytes() != sim.O[r].tobytes():
                ok, why = False, "owner residual differs"
    assert_all(ok, why, comm)


@pytest.mark.mpi
@pytest.mark.parametrize("op", OPS, ids=_id)
@pytest.mark.parametrize("gather", ["compressed", "exact"])
def test_allreduce_matches_simulation(comm, fb, op, gather):
    _run(comm, fb, op, 1027, np.float32, False, gather)


@pytest.mark.mpi
@pytest.mark.parametrize("op", OPS, ids=_id)
def test_allreduce_average_matches_simulation(comm, fb, op):
    _run(comm, fb, op, 999, np.float32, True, "compressed")


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2, 3, 5, 13])
@pytest.mark.parametrize("op", ["2bit", "1bit", "terngrad", "fp16", "bf16"])
def test_tiny_and_uneven_sizes(comm, fb, op, n):
    """n smaller than the world size leaves some shards empty."""
    _run(comm, fb, op, n, np.float32, False, "compressed")
    _run(comm, mpigc.ErrorFeedback(), op, n, np.float32, True, "exact")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.float16, np.float64])
@pytest.mark.parametrize("op", ["none", "fp16", "bf16", "2bit", "1bit", "terngrad"])
def test_other_dtypes(comm, fb, op, dtype):
    _run(comm, fb, op, 501, dtype, True, "compressed")


@pytest.mark.mpi
def test_large_uneven_2bit(comm, fb):
    """n = 1211*1211 does not split evenly over 3 ranks nor into whole bytes."""
    _run(comm, fb, "2bit", 1211 * 1211, np.float32, True, "compressed", steps=2)


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["none", "fp16", "bf16", "2bit", "1bit", "terngrad"])
def test_reduce_scatter_matches_simulation(comm, fb, op):
    _run(comm, fb, op, 1027, np.float32, False, "exact", kind="reduce_scatter")
    _run(comm, mpigc.ErrorFeedback(), op, 1027, np.float64, True, "exact",
         kind="reduce_scatter")


@pytest.mark.mpi
def test_reduce_scatter_recvcounts_and_out(comm, fb):
    N, r = comm.size, comm.rank
    n = 10 * N + 3
    counts = [n - 2 * (N - 1)] + [2] * (N - 1)
    x = grads(r, n)
    out = np.full(counts[r], -1.0, np.float32)
    res = mpigc.reduce_scatter(x, op="2bit", recvcounts=counts, out=out, key="rc",
                               feedback=fb)
    comp = mpigc.get_compressor("2bit")
    lo = sum(counts[:r])
    hi = lo + counts[r]
    want = np.zeros(hi - lo, np.float32)
    for q in range(N):
        if hi > lo:
            want += comp.decompress(comp.compress(grads(q, n)[lo:hi]), hi - lo)
    assert_all(res is out and out.tobytes() == want.tobytes(), f"{out} != {want}")


@pytest.mark.mpi
def test_none_is_mpi_allreduce(comm):
    from mpi4py import MPI
    x = grads(comm.rank, 4099, np.float64)
    want = np.empty_like(x)
    comm.Allreduce(x, want, op=MPI.SUM)
    got = mpigc.allreduce(x.copy(), op="none")
    assert_all(got.tobytes() == want.tobytes())


@pytest.mark.mpi
def test_results_identical_on_all_ranks_and_deterministic(comm):
    outs = []
    for _ in range(2):
        fb = mpigc.ErrorFeedback()
        x = grads(comm.rank, 5000)
        for s in range(3):
            y = mpigc.allreduce(x.copy(), op="1bit", key="d", feedback=fb, average=True)
        outs.append(y.tobytes())
    every = comm.allgather(outs[0])
    assert_all(outs[0] == outs[1] and all(b == every[0] for b in every))


@pytest.mark.mpi
def test_multidimensional_buffer_in_place(comm, fb):
    x = grads(comm.rank, 6 * 7).reshape(6, 7)
    y = mpigc.allreduce(x, op="2bit", key="m", feedback=fb)
    assert_all(y is x and x.shape == (6, 7))


@pytest.mark.mpi
def test_subcommunicator(comm):
    sub = comm.Split(comm.rank % 2, comm.rank)
    fb = mpigc.ErrorFeedback()
    x = np.full(64, 1.0, np.float32)
    y = mpigc.allreduce(x, op="2bit", comm=sub, key="s", feedback=fb, threshold=0.5)
    assert_all(np.all(y == 0.5), f"{y[:4]}")  # each of sub.size ranks sends +0.5;
    # the owner's sum (0.5 * size) is requantized to +0.5 with gather="compressed"
    sub.Free()


@pytest.mark.mpi
def test_small_buffers_fall_back_to_plain_mpi(comm, fb, monkeypatch):
    """Below MPIGC_MIN_COMPRESS_BYTES a compressed op is a plain MPI sum and
    touches no residual; ranks that disagree on the cutoff get a mismatch."""
    from mpi4py import MPI
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "4096")
    x = grads(comm.rank, 1000)  # 4000 bytes
    want = np.empty_like(x)
    comm.Allreduce(x, want, op=MPI.SUM)
    got = mpigc.allreduce(x.copy(), op="2bit", key="small", feedback=fb)
    assert_all(np.allclose(got, want, rtol=1e-5, atol=1e-5) and "small" not in fb)
    big = mpigc.allreduce(grads(comm.rank, 1024), op="2bit", key="big", feedback=fb,
                          threshold=0.5)  # MXNet's absolute mode: results are 0, +-0.5
    assert_all("big" in fb and set(np.unique(big)) <= {-0.5, 0.0, 0.5})
    if comm.size > 1:
        monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "0" if comm.rank == 0 else "4096")
        try:
            mpigc.allreduce(x.copy(), op="2bit", key="small", feedback=fb)
            err = None
        except mpigc.MismatchError as e:
            err = e
        assert_all(err is not None)


@pytest.mark.mpi
def test_relative_2bit_average_is_dividing_after(comm):
    """op="2bit" (the relative mode since issue 45) is scale-free: with
    average=True the owner's second stage selects from the mean what it
    selects from the sum, so the result is the sum divided by N, to rounding
    (docs/user-guide.md, "Averaging"); over steps, with its residuals."""
    fa, fs = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
    ok, worst = True, 0.0
    for step in range(5):
        x = grads(comm.rank + 100 * step, 5000)
        a = mpigc.allreduce(x.copy(), op="2bit", key="w", average=True, feedback=fa)
        s = mpigc.allreduce(x.copy(), op="2bit", key="w", feedback=fs) / comm.size
        far = ~np.isclose(a, s, rtol=1e-4, atol=1e-6)
        worst = max(worst, far.mean())
        ok &= far.mean() <= 1e-3  # a value at a block's threshold may round either way
    assert_all(ok, f"fraction of results that differ: {worst}")
