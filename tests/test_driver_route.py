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


def test_no_route_without_a_gpu():
    """Here (no GPU, or the simulator) every launch and copy is Numba's."""
    assert not _driver.enabled() and _driver.ON is False  # callers skip the route
    assert _driver.launch(None, 1, 32, None, ()) is False
    assert _driver.memset0(np.zeros(1), None) is False
