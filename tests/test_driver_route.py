"""The driver's launch route (``mpigc.kernels._driver``, issue 49): what can
be checked without a GPU. The route itself runs only on a GPU
(``tests/gpu``, ``benchmarks/gpu_launch.py``); every recorded kernel
signature's parameter block is checked against its PTX by
``tests/test_cuda_sim.py::test_kernels_compile_to_ptx``."""
import struct

import numpy as np
import pytest

numba = pytest.importorskip("numba")
from numba.core import types  # noqa: E402

from mpigc.kernels import _driver  # noqa: E402

F32 = types.Array(types.float32, 1, "C")
F64_2D = types.Array(types.float64, 2, "C")

# the head of a PTX entry as NVVM writes it (names shortened)
PTX = """
.visible .entry _Z1kPf(
	.param .u64 _Z1kPf_param_0,
	.param .u64 _Z1kPf_param_1,
	.param .u64 _Z1kPf_param_2,
	.param .u64 _Z1kPf_param_3,
	.param .u64 _Z1kPf_param_4,
	.param .u64 _Z1kPf_param_5,
	.param .u64 _Z1kPf_param_6,
	.param .u8 _Z1kPf_param_7,
	.param .f32 _Z1kPf_param_8
)
{
	.param .u64 other;
}
"""


def test_codes_follow_numbas_kernel_abi():
    # an array: meminfo, parent, nitems, itemsize, data, shape, strides
    assert _driver.param_codes((F32, types.boolean, types.float32)) == \
        ["Q", "Q", "q", "q", "Q", "q", "q", "B", "f"]
    assert len(_driver.param_codes((F64_2D,))) == 5 + 2 * 2
    # what the route does not pack stays on Numba's route
    assert _driver.param_codes((types.Array(types.float32, 1, "A"),)) is None
    assert _driver.param_codes((types.complex64,)) is None


def test_ptx_params_read_only_the_entry_head():
    assert _driver.ptx_params(PTX, "_Z1kPf") == ["u64"] * 7 + ["u8", "f32"]
    codes = _driver.param_codes((F32, types.boolean, types.float32))
    assert _driver.layout_matches(codes, _driver.ptx_params(PTX, "_Z1kPf"))
    # one field short, or a width that differs: no match
    assert not _driver.layout_matches(codes[:-1], _driver.ptx_params(PTX, "_Z1kPf"))
    assert not _driver.layout_matches(codes[:-1] + ["d"], _driver.ptx_params(PTX, "_Z1kPf"))
    assert _driver.ptx_params(PTX, "_Z1nope") is None


def test_parameters_at_their_natural_alignment():
    fmt, offs, size = _driver._format(["Q", "B", "f", "B", "q"])
    assert offs == [0, 8, 12, 16, 24] and size == 32
    buf = bytearray(size)
    struct.pack_into(fmt, buf, 0, 7, 1, 0.5, 0, -3)
    assert struct.unpack_from("<q", buf, 24)[0] == -3
    assert struct.unpack_from("<f", buf, 12)[0] == 0.5


def _real_gpu():
    """A GPU the driver could reach: not the simulator, and CUDA available."""
    from numba import cuda
    try:  # numba-cuda
        from numba.cuda.core import config
    except ImportError:  # numba's bundled CUDA target
        from numba.core import config
    return not getattr(config, "ENABLE_CUDASIM", 0) and cuda.is_available()


@pytest.mark.skipif(_real_gpu(), reason="a GPU is here: the route may be on "
                    "(tests/gpu checks it there)")
def test_no_route_without_a_gpu():
    """Here (no GPU, or the simulator) every launch and copy is Numba's."""
    assert not _driver.enabled() and _driver.ON is False  # callers skip the route
    assert _driver.launch(None, 1, 32, None, ()) is False
    assert _driver.memset0(np.zeros(1), None) is False


# -- the route's logic against a recording stand-in for the CUDA driver ---------
# (the driver itself runs only on a GPU: tests/gpu, benchmarks/gpu_launch.py)

class _Result:
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_CONTEXT = 201


class _Driver:
    """Records each driver call; what a launch's parameter block holds is
    read back from the pointers it is given."""
    CUresult = _Result

    class CUstream(int):
        pass

    class CUevent_flags:
        CU_EVENT_DISABLE_TIMING = 2

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name,) + args)
            if name == "cuLaunchKernel":
                self.params = self._read(args[9])
            if name in ("cuCtxGetCurrent", "cuEventCreate"):
                return 0, 7
            if name == "cuCtxGetDevice":
                return 0, 3
            return (0,)
        return call

    def _read(self, addr):
        import ctypes
        ptrs = (ctypes.c_void_p * len(self.codes)).from_address(addr)
        return [struct.unpack(c, ctypes.string_at(p, struct.calcsize(c)))[0]
                for c, p in zip(self.codes, ptrs)]


class _Array:
    """What the route reads of a Numba device array."""

    class _Mem:
        def __init__(self, ptr):
            import ctypes
            self.device_ctypes_pointer = ctypes.c_void_p(ptr)

    def __init__(self, n, dtype, ptr):
        self.shape, self.dtype = (n,), np.dtype(dtype)
        self.size, self.ndim = n, 1
        self.strides = (self.dtype.itemsize,)
        self.nbytes = n * self.dtype.itemsize
        self.gpu_data = self._Mem(ptr)


class _Dispatcher:
    def __init__(self, ptx):
        self.ptx = ptx

    def typeof_pyval(self, a):
        return {bool: types.boolean, np.float32: types.float32}.get(type(a), F32)

    def inspect_asm(self, sig):
        return self.ptx


class _Core:
    class Device:
        def __init__(self, dev):
            self.dev = dev

        def set_current(self):
            pass

    class ObjectCode:
        @staticmethod
        def from_ptx(ptx):
            code = _Core.ObjectCode()
            code.ptx = ptx
            return code

        def get_kernel(self, name):
            k = _Core.ObjectCode()
            k.handle = ("kernel", name)
            return k


class _Stream:
    handle = None


@pytest.fixture
def driver(monkeypatch):
    drv = _Driver()
    drv.codes = _driver.param_codes((F32, types.boolean, types.float32))
    monkeypatch.setattr(_driver, "_state", {"on": True, "drv": drv, "cc": _Core})
    monkeypatch.setattr(_driver, "ON", True)
    for name in ("_fns", "_numba_launches", "_streams", "_events"):
        monkeypatch.setattr(_driver, name, {})
    s = _Stream()
    s.handle = _Driver.CUstream(5)
    return drv, s


def test_a_kernel_goes_to_the_driver_from_its_second_launch(driver):
    drv, stream = driver
    k = _Dispatcher(PTX)
    x = _Array(1000, np.float32, 0x7000)
    args = (x, True, np.float32(0.25))
    assert _driver.launch(k, 4, 256, stream, args) is False  # Numba compiles it
    assert _driver.launch(k, (4, 2), 256, stream, args) is True
    name, *a = drv.calls[-1]
    assert name == "cuLaunchKernel"
    assert a[0] == ("kernel", "_Z1kPf") and a[1:7] == [4, 2, 1, 256, 1, 1]
    assert a[8] == 5  # the stream's handle
    # Numba's kernel ABI: meminfo, parent, nitems, itemsize, data, shape, strides
    assert drv.params == [0, 0, 1000, 4, 0x7000, 1000, 4, 1, 0.25]
    # a view elsewhere, same types: the same kernel, the new values
    assert _driver.launch(k, 1, 256, stream, (_Array(3, np.float32, 0x9000), False,
                                              np.float32(2))) is True
    assert drv.params == [0, 0, 3, 4, 0x9000, 3, 4, 0, 2.0]
    # another dtype is another signature: Numba first
    assert _driver.launch(k, 1, 256, stream, (_Array(3, np.float64, 0x9000), False,
                                              np.float32(2))) is False


def test_a_signature_whose_block_differs_from_the_ptx_stays_with_numba(driver):
    drv, stream = driver
    k = _Dispatcher(PTX.replace("\t.param .f32 _Z1kPf_param_8\n", ""))
    args = (_Array(8, np.float32, 0x7000), True, np.float32(1))
    assert not _driver.launch(k, 1, 256, stream, args)
    assert not _driver.launch(k, 1, 256, stream, args)  # refused for good
    assert _driver.stats()["refused"] >= 1
    assert not any(c[0] == "cuLaunchKernel" for c in drv.calls)


def test_waits_are_events_of_the_stream_not_the_whole_stream(driver):
    """A host wait records an event on the stream and waits for it: it waits
    for what was queued before, not for what other threads queue later."""
    drv, stream = driver
    h = np.zeros(2, np.int64)
    d = _Array(2, np.int64, 0x5000)
    assert _driver.to_host(h, d, stream)
    assert _driver.sync(stream)
    assert _driver.copy(_Array(2, np.int64, 0x6000), d, stream, False)
    assert _driver.memset0(d, stream)
    names = [c[0] for c in drv.calls]
    assert "cuStreamSynchronize" not in names
    assert names.count("cuEventSynchronize") == 2
    assert ("cuMemcpyDtoHAsync", h.ctypes.data, 0x5000, 16, 5) in drv.calls
    assert ("cuMemcpyDtoDAsync", 0x6000, 0x5000, 16, 5) in drv.calls
    assert ("cuMemsetD8Async", 0x5000, 0, 16, 5) in drv.calls
    # what the route does not take: bytes that differ, a strided view
    assert not _driver.copy(_Array(3, np.int64, 0x6000), d, stream, False)
    v = _Array(2, np.int64, 0x5000)
    v.strides = (16,)
    assert not _driver.copy(_Array(2, np.int64, 0x6000), v, stream, False)
    assert _driver.device_id() == 3


def test_a_thread_without_a_context_gets_one_and_the_launch_is_made_once_more(
        driver, monkeypatch):
    """CUDA_ERROR_INVALID_CONTEXT (a thread the driver has no context for):
    Numba makes the context current and the same launch is made again, once;
    a second refusal is an error, not a loop."""
    from numba import cuda
    drv, stream = driver
    made = []
    monkeypatch.setattr(cuda, "current_context", lambda: made.append(1))
    k = _Dispatcher(PTX)
    args = (_Array(8, np.float32, 0x7000), True, np.float32(1))
    assert _driver.launch(k, 1, 256, stream, args) is False  # Numba compiles it
    answers = [_Result.CUDA_ERROR_INVALID_CONTEXT, _Result.CUDA_SUCCESS]
    real = drv.__getattr__("cuLaunchKernel")

    def launch(*a):
        real(*a)
        return (answers.pop(0),)
    monkeypatch.setattr(drv, "cuLaunchKernel", launch, raising=False)
    assert _driver.launch(k, 1, 256, stream, args) is True
    assert made == [1] and not answers
    assert [c[0] for c in drv.calls].count("cuLaunchKernel") == 2
    assert drv.params == [0, 0, 8, 4, 0x7000, 8, 4, 1, 1.0]
    answers[:] = [_Result.CUDA_ERROR_INVALID_CONTEXT] * 2
    with pytest.raises(RuntimeError, match="cuLaunchKernel"):
        _driver.launch(k, 1, 256, stream, args)
    assert made == [1, 1] and not answers


def test_a_scratch_array_the_pool_drops_takes_its_pinned_twin_along(monkeypatch):
    """``kernels.cuda``'s pinned twins (the host side of the driver's reads of
    a pooled counter or scratch array) are keyed by ``id()`` and hold their
    array, so no id is reused while its twin is there; a scratch array the
    full pool drops is let go with its twin (no array kept by its twin)."""
    from mpigc.kernels import cuda as kc
    dt = np.dtype(np.float64)
    kept = [_Array(4, dt, 0x1000 + i) for i in range(4)]
    monkeypatch.setattr(kc, "_scratch", {(0, (4,), dt): list(kept)})
    extra = _Array(4, dt, 0x2000)
    monkeypatch.setattr(kc, "_twins", {id(a): (a, np.empty(4, dt)) for a in kept + [extra]})
    kc._give_scratch(extra, 0)
    assert id(extra) not in kc._twins and kc._scratch[(0, (4,), dt)] == kept
    assert all(kc._twins[id(a)][0] is a for a in kept)
