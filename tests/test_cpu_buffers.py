"""CPU arrays that are not numpy arrays in the core API (issue 45 item 3):
torch CPU tensors, the buffer protocol (``memoryview``, ``array.array``),
objects with only ``__array_interface__`` and objects with only DLPack
(``tests/support/foreign_arrays.py``) are reduced in place, as numpy arrays are, to
the same bits and the same residuals; the call returns the caller's object.
Read-only, non-contiguous and unsupported ones get what numpy arrays get;
what numpy cannot view gets a clear error. Device arrays still take the
device path. One process (a world of one rank); the ranks' agreement is in
``tests/mpi/test_cpu_buffers_mpi.py``."""
import array

import numpy as np
import pytest

import mpigc
from mpigc import _dispatch
from mpigc import _backend
from support.foreign_arrays import CPU_KINDS as KINDS
from support.foreign_arrays import DLPackOnly, InterfaceOnly, OtherDevice, TorchLikeTensor

try:
    import torch
except ImportError:  # pragma: no cover - torch is installed in the venv
    torch = None

OPS = [("none", {}), ("2bit", {"threshold": 0.5}), ("2bit", {"rel_threshold": 1.5}),
       ("1bit", {}), ("fp16", {})]
OP_IDS = ["none", "2bit-abs", "2bit-rel", "1bit", "fp16"]


@pytest.fixture(autouse=True)
def always_compress(monkeypatch):
    # small buffers are compressed too, so that the compressed path is compared
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "0")




def _grad(n, dtype, seed):
    return (np.random.default_rng(seed).standard_normal(n) * 2).astype(dtype)


def _same_bits(got, want, what):
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), what


def _same_state(fa, fb):
    sa, sb = fa.state_dict(), fb.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        for part in ("worker", "owner"):
            a, b = sa[k][part], sb[k][part]
            assert (a is None) == (b is None), (k, part)
            if a is not None:
                _same_bits(b, a, f"{k} {part}")
        assert sa[k]["calls"] == sb[k]["calls"]


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("op,params", OPS, ids=OP_IDS)
def test_allreduce_in_place_as_numpy(kind, op, params):
    """allreduce and iallreduce of a foreign CPU array: the numpy path's
    bits, in the object's own memory, the object returned, the residuals
    under key= the same."""
    fn, ff = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
    for step, dtype in enumerate([np.float32, np.float32, np.float64, np.float16]):
        g = _grad(1000, dtype, step)
        if kind == "array" and dtype == np.float16:
            continue
        x, values = KINDS[kind](g)
        h = g.copy()
        blocking = step % 2 == 0
        key = f"k{np.dtype(dtype).name}"
        average = step == 1
        if blocking:
            r = mpigc.allreduce(x, op=op, key=key, feedback=ff, average=average, **params)
        else:
            r = mpigc.iallreduce(x, op=op, key=key, feedback=ff, average=average,
                                 **params).wait()
        mpigc.allreduce(h, op=op, key=key, feedback=fn, average=average, **params)
        assert r is x
        _same_bits(values(), h, f"{kind} {op} step {step}")
        if op != "none" and not (op == "fp16" and dtype == np.float16):
            # lossy on one rank: the object's memory changed
            assert values().tobytes() != g.tobytes()
    _same_state(fn, ff)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("op,params", OPS, ids=OP_IDS)
def test_reduce_scatter_as_numpy(kind, op, params):
    """reduce_scatter and ireduce_scatter of a foreign CPU array (left
    unchanged), and into a foreign ``out=`` (returned)."""
    fn, ff = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
    g = _grad(777, np.float32, 5)
    x, values = KINDS[kind](g)
    got = mpigc.reduce_scatter(x, op=op, key="s", feedback=ff, **params)
    want = mpigc.reduce_scatter(g.copy(), op=op, key="s", feedback=fn, **params)
    _same_bits(got, want, "reduce_scatter")
    _same_bits(values(), g, "the input changed")
    out, out_values = KINDS[kind](np.zeros(777, np.float32))
    got = mpigc.ireduce_scatter(x, op=op, key="s", feedback=ff, out=out, **params).wait()
    want = mpigc.reduce_scatter(g.copy(), op=op, key="s", feedback=fn, **params)
    assert got is out
    _same_bits(out_values(), want, "ireduce_scatter out=")
    _same_state(fn, ff)


@pytest.mark.parametrize("op,params", OPS, ids=OP_IDS)
def test_grouped_calls_of_mixed_kinds(op, params):
    """A group of foreign CPU arrays of every kind (and a numpy one): the
    grouped numpy call's bits and residuals, every member in place."""
    if torch is None:
        pytest.skip("torch is not installed")
    fn, ff = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
    sizes = [3, 500, 1, 130, 77, 64]
    for step in range(2):
        gs = [_grad(m, np.float32, 10 * step + i) for i, m in enumerate(sizes)]
        made = [KINDS[k](g) for k, g in zip(sorted(KINDS), gs)]
        xs = [m[0] for m in made] + [gs[-1].copy()]
        hs = [g.copy() for g in gs]
        r = mpigc.allreduce(xs, op=op, key="g", feedback=ff, **params)
        mpigc.allreduce(hs, op=op, key="g", feedback=fn, **params)
        assert r is xs
        for i, (m, h) in enumerate(zip(made, hs)):
            _same_bits(m[1](), h, f"member {i}")
        _same_bits(xs[-1], hs[-1], "numpy member")
        sf = mpigc.reduce_scatter([KINDS[k](g)[0] for k, g in zip(sorted(KINDS), gs)],
                                  op=op, key="gs", feedback=ff, **params)
        sn = mpigc.reduce_scatter(gs[:-1], op=op, key="gs", feedback=fn, **params)
        for a, b in zip(sf, sn):
            _same_bits(a, b, "grouped shard")
    _same_state(fn, ff)


def test_views_alias_the_objects_memory():
    """The intake's views are the objects' memory, not copies."""
    g = _grad(16, np.float32, 1)
    for kind in sorted(KINDS):
        if kind == "torch" and torch is None:
            continue
        x, values = KINDS[kind](g)
        v = _backend.host_view(x, "allreduce")
        assert v.flags.writeable
        v[3] = 42.0
        assert values()[3] == 42.0, kind


def _message(buf, **kw):
    with pytest.raises(mpigc.MpigcError) as info:
        mpigc.allreduce(buf, op="none", **kw)
    return type(info.value), str(info.value)


def _numpy_readonly():
    a = np.ones(10, np.float32)
    a.flags.writeable = False
    return a


def test_read_only_refused_as_numpy():
    """What a read-only numpy array gets: a read-only buffer, interface, or
    DLPack export (DLPack 1.0's read-only flag); reduce_scatter takes them."""
    want = _message(_numpy_readonly())
    assert want[0] is mpigc.InvalidBufferError and "read-only" in want[1]
    ro = [memoryview(bytes(np.ones(10, np.float32).tobytes())).cast("f"),
          InterfaceOnly(_numpy_readonly()), DLPackOnly(_numpy_readonly()),
          memoryview(_numpy_readonly())]
    for x in ro:
        assert _message(x) == want, type(x).__name__
        shard = mpigc.reduce_scatter(x, op="none")
        _same_bits(shard, np.ones(10, np.float32), "reduce_scatter of a read-only input")
    with pytest.raises(mpigc.InvalidBufferError, match="writable"):
        mpigc.reduce_scatter(np.ones(10, np.float32), op="none", out=ro[1])


def test_non_contiguous_and_dtypes_as_numpy():
    """Strided views and unsupported dtypes: numpy's errors, word for word."""
    base = np.arange(20, dtype=np.float32)
    want = _message(base[::2])
    assert want[0] is mpigc.InvalidBufferError and "C-contiguous" in want[1]
    strided = [InterfaceOnly(base[::2]), DLPackOnly(base[::2]), memoryview(base)[::2]]
    if torch is not None:
        strided.append(torch.arange(20, dtype=torch.float32)[::2])
        strided.append(torch.ones(4, 5).t())
    for x in strided:
        assert _message(x) == want, type(x).__name__
    for dtype in (np.int32, np.int64, np.uint8, np.complex64):
        want = _message(np.ones(4, dtype))
        assert want[0] is mpigc.DTypeError
        assert _message(InterfaceOnly(np.ones(4, dtype))) == want
        assert _message(DLPackOnly(np.ones(4, dtype))) == want
        if torch is not None:
            assert _message(torch.from_numpy(np.ones(4, dtype))) == want
    assert _message(bytearray(8)) == _message(np.ones(8, np.uint8))
    assert _message(array.array("i", [1, 2])) == _message(np.ones(2, np.int32))
    big = np.ones(4, ">f4")
    assert _message(InterfaceOnly(big)) == _message(big)


@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_torch_tensors_numpy_cannot_view():
    """A tensor that requires grad is refused with torch's reason (pass
    ``t.detach()``, which shares its memory and is reduced in place); a
    bfloat16 tensor gets the dtype error, naming bfloat16."""
    p = torch.ones(8, requires_grad=True)
    kind, msg = _message(p)
    assert kind is mpigc.InvalidBufferError and "detach" in msg, msg
    with pytest.raises(mpigc.InvalidBufferError, match="detach"):
        mpigc.reduce_scatter(p, op="none")
    assert mpigc.allreduce(p.detach(), op="none") is not None
    kind, msg = _message(torch.ones(8, dtype=torch.bfloat16))
    assert kind is mpigc.DTypeError and "got bfloat16" in msg, msg
    # a scalar tensor is an array of one value, reduced in place
    s = torch.tensor(3.0)
    assert mpigc.allreduce(s, op="none") is s and float(s) == 3.0


def test_what_exposes_no_cpu_memory():
    """An object with no memory to view, a numpy scalar, a DLPack array of
    another device: DTypeError saying what is taken."""
    for x in (object(), "abc", 1.5, np.float32(1.5), OtherDevice(np.ones(3))):
        kind, msg = _message(x)
        assert kind is mpigc.DTypeError, (x, msg)
    assert "CPU array that exposes its memory" in _message(object())[1]
    assert "scalar" in _message(np.float32(1.5))[1]
    assert "DLPack device (8, 0)" in _message(OtherDevice(np.ones(3)))[1]
    with pytest.raises(mpigc.InvalidBufferError, match="exposes its memory"):
        mpigc.reduce_scatter(np.ones(4, np.float32), op="none", out=object())


def test_device_arrays_keep_the_device_path():
    """The host intake never sees a device array: ``__cuda_array_interface__``
    decides first, DLPack or not."""
    class CudaWithDLPack(TorchLikeTensor):
        def __dlpack__(self, **kw):
            raise AssertionError("a device array must not be exported to numpy")

        def __dlpack_device__(self):
            return (2, 0)

    a = np.ones(4, np.float32)
    for x in (TorchLikeTensor(a), CudaWithDLPack(a)):
        assert _dispatch.is_device_array(x)
    for x in (InterfaceOnly(a), DLPackOnly(a), memoryview(a)):
        assert not _dispatch.is_device_array(x)
    if torch is not None:
        assert not _dispatch.is_device_array(torch.ones(3))
