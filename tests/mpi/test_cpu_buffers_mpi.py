"""CPU arrays that are not numpy arrays, across ranks (issue 45 item 3): torch
CPU tensors, ``memoryview``, ``array.array``, objects with only
``__array_interface__`` or only DLPack (``tests/support/foreign_arrays.py``) give the
numpy path's bits and residuals, in place, the caller's object returned;
ranks may hold different kinds (numpy on one, a tensor on another); a
read-only one on one rank fails on every rank with the error a read-only
numpy array gives. The single-process cases are in
``tests/test_cpu_buffers.py``."""
import os
import sys

import numpy as np
import pytest
from mpi4py import MPI

import mpigc
from conftest import assert_all, grads, raises_everywhere

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from support.foreign_arrays import CPU_KINDS as KINDS  # noqa: E402
from support.foreign_arrays import DLPackOnly, InterfaceOnly  # noqa: E402

try:
    import torch
except ImportError:  # pragma: no cover - torch is installed in the venv
    torch = None

# ranks: 2 for pairs, 3 for uneven shards (every rank owner and peer); the
# intake is per rank, so 4 (nodes of 2) adds nothing
pytestmark = [pytest.mark.mpi, pytest.mark.ranks(2, 3)]

OPS = [("none", {}), ("2bit", {"threshold": 0.5}), ("2bit", {"rel_threshold": 1.5}),
       ("1bit", {}), ("fp16", {})]
OP_IDS = ["none", "2bit-abs", "2bit-rel", "1bit", "fp16"]
WORLD = MPI.COMM_WORLD




@pytest.fixture(params=sorted(KINDS))
def kind(request):
    if request.param == "torch" and torch is None:
        pytest.skip("torch is not installed")
    return request.param


def _same(a, b):
    return a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _same_state(fa, fb):
    sa, sb = fa.state_dict(), fb.state_dict()
    if sorted(sa) != sorted(sb):
        return False
    for k in sa:
        for part in ("worker", "owner"):
            a, b = sa[k][part], sb[k][part]
            if (a is None) != (b is None) or (a is not None and not _same(a, b)):
                return False
        if sa[k]["calls"] != sb[k]["calls"]:
            return False
    return True


@pytest.mark.parametrize("op,params", OPS, ids=OP_IDS)
def test_allreduce_as_numpy(comm, kind, op, params):
    """allreduce and iallreduce: numpy's bits in the object's memory, the
    object returned, the residuals under key= the same; float64 too."""
    fn, ff = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
    ok, ret, changed = True, True, True
    for step, dtype in enumerate([np.float32, np.float32, np.float64]):
        g = grads(comm.rank, 1001, dtype, seed=step)
        x, values = KINDS[kind](g)
        h = g.copy()
        key, average = f"k{np.dtype(dtype).name}", step == 1
        if step == 1:
            r = mpigc.iallreduce(x, op=op, key=key, feedback=ff, average=average,
                                 **params).wait()
        else:
            r = mpigc.allreduce(x, op=op, key=key, feedback=ff, average=average, **params)
        mpigc.allreduce(h, op=op, key=key, feedback=fn, average=average, **params)
        ok = ok and _same(values(), h)
        ret = ret and r is x
        changed = changed and values().tobytes() != g.tobytes()
    assert_all(ok, f"{kind} {op}: not the numpy path's bits")
    assert_all(ret, f"{kind} {op}: the object was not returned")
    assert_all(changed, f"{kind} {op}: the object's memory did not change")
    assert_all(_same_state(fn, ff), f"{kind} {op}: residuals differ")


@pytest.mark.parametrize("op,params", OPS, ids=OP_IDS)
def test_reduce_scatter_as_numpy(comm, kind, op, params):
    """reduce_scatter (input unchanged) and ireduce_scatter into a foreign
    ``out=`` (returned), at uneven shards."""
    fn, ff = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
    g = grads(comm.rank, 1001, np.float32, seed=7)
    x, values = KINDS[kind](g)
    got = mpigc.reduce_scatter(x, op=op, key="s", feedback=ff, **params)
    want = mpigc.reduce_scatter(g.copy(), op=op, key="s", feedback=fn, **params)
    ok = _same(got, want) and _same(values(), g)
    lo, hi = mpigc.shard_bounds(1001, comm.size)[comm.rank]
    out, out_values = KINDS[kind](np.zeros(hi - lo, np.float32))
    got = mpigc.ireduce_scatter(x, op=op, key="s", feedback=ff, out=out, **params).wait()
    want = mpigc.reduce_scatter(g.copy(), op=op, key="s", feedback=fn, **params)
    assert_all(ok, f"{kind} {op}: reduce_scatter differs or changed its input")
    assert_all(got is out and _same(out_values(), want), f"{kind} {op}: out= differs")
    assert_all(_same_state(fn, ff), f"{kind} {op}: residuals differ")


@pytest.mark.parametrize("op,params", OPS, ids=OP_IDS)
def test_grouped_and_mixed_kinds(comm, op, params):
    """A group of every kind; and each rank holding another kind for the same
    call (rank 0 numpy, rank 1 a torch tensor, ...): numpy's bits."""
    kinds = [k for k in sorted(KINDS) if k != "torch" or torch is not None]
    fn, ff = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
    sizes = [3, 500, 1, 130, 77][:len(kinds)]
    gs = [grads(comm.rank, m, np.float32, seed=20 + i) for i, m in enumerate(sizes)]
    made = [KINDS[k](g) for k, g in zip(kinds, gs)]
    hs = [g.copy() for g in gs]
    r = mpigc.allreduce([m[0] for m in made], op=op, key="g", feedback=ff, **params)
    mpigc.allreduce(hs, op=op, key="g", feedback=fn, **params)
    assert_all(isinstance(r, list) and all(_same(m[1](), h) for m, h in zip(made, hs)),
               f"grouped {op}: not the numpy path's bits")
    assert_all(_same_state(fn, ff), f"grouped {op}: residuals differ")
    # mixed: rank r holds kind r-1 (rank 0 numpy)
    fn, ff = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
    order = ["numpy"] + (["torch"] if torch is not None else []) + [
        k for k in kinds if k != "torch"]
    mine = order[comm.rank % len(order)]
    g = grads(comm.rank, 1001, np.float32, seed=30)
    if mine == "numpy":
        x = g.copy()
        values = lambda: x  # noqa: E731
    else:
        x, values = KINDS[mine](g)
    h = g.copy()
    r = mpigc.allreduce(x, op=op, key="m", feedback=ff, **params)
    mpigc.allreduce(h, op=op, key="m", feedback=fn, **params)
    assert_all(r is x and _same(values(), h), f"mixed {op}: rank holds {mine}")
    assert_all(_same_state(fn, ff), f"mixed {op}: residuals differ")


def _readonly_numpy():
    a = np.ones(10, np.float32)
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("ro", ["memoryview", "interface", "dlpack"])
@pytest.mark.parametrize("op", ["none", "2bit"])
def test_read_only_on_one_rank_fails_everywhere(comm, ro, op):
    """A read-only buffer on the last rank: what a read-only numpy array there
    gives, on every rank, word for word; nothing changed."""
    last = comm.rank == comm.size - 1

    def make(kind):
        if not last:
            return np.ones(10, np.float32)
        if kind == "numpy":
            return _readonly_numpy()
        if kind == "memoryview":
            return memoryview(bytes(np.ones(10, np.float32).tobytes())).cast("f")
        return {"interface": InterfaceOnly, "dlpack": DLPackOnly}[kind](_readonly_numpy())

    want = raises_everywhere(mpigc.InvalidBufferError,
                             lambda: mpigc.allreduce(make("numpy"), op=op, key="r"),
                             match="read-only")
    x = make(ro)
    got = raises_everywhere(mpigc.InvalidBufferError,
                            lambda: mpigc.allreduce(x, op=op, key="r"), match="read-only")
    assert_all(str(got) == str(want), f"{got} != {want}")
    msgs = comm.allgather(str(got))
    assert_all(len(set(msgs)) == 1, f"the ranks' errors differ: {msgs}")
    # and the next call goes through
    y = np.ones(10, np.float32)
    mpigc.allreduce(y, op="none", key="r")
    assert_all(bool((y == comm.size).all()), "after the error")


@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_torch_tensor_that_requires_grad_fails_everywhere(comm):
    """A tensor that requires grad on one rank: InvalidBufferError on every
    rank, naming torch's fix (``t.detach()``, which shares its memory)."""
    p = torch.ones(10, requires_grad=(comm.rank == 0))
    raises_everywhere(mpigc.InvalidBufferError,
                      lambda: mpigc.allreduce(p, op="none", key="p"), match="detach")
    t = p.detach()
    assert_all(mpigc.allreduce(t, op="none", key="p") is t
               and bool((p.detach().numpy() == comm.size).all()), "detach()")
