"""The backend is complete (issue 51 item 5): host and device backends
(:mod:`mpigc._backend`) have the same methods, a grouped call's members
are placed, non-finite values counted and terngrad's statistics computed
through them, and the engine modules never ask which side an array is on.

Plain tests (one process, host arrays; the device backend's methods run in
the CUDA simulator: tests/test_gpu_path_sim.py)."""
import ast
import os

import numpy as np
import pytest

import mpigc
from mpigc import _backend
from mpigc._group import _layout
from mpigc.kernels import cpu

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

#: the engine modules: what differs between the sides is the backend's
ENGINE = ["_group", "_early", "_twophase", "_collective", "_hiercall", "_plainsum"]


def _methods(cls):
    return {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}


def test_both_sides_have_the_same_methods():
    host, dev = _methods(_backend.HostBackend), _methods(_backend.DeviceBackend)
    assert host == dev, (f"host only: {sorted(host - dev)}, device only: "
                         f"{sorted(dev - host)}")
    for name in ("place_members", "stats", "count_nonfinite", "quick_members"):
        assert name in host


def _reference(members, world, concat):
    """The fused buffer as _group's docstring defines it: one member after
    another, or owner-major (rank j's shard: every member's array_split
    shard j, in member order)."""
    if concat:
        return np.concatenate(members)
    return np.concatenate([s for j in range(world)
                           for s in (np.array_split(m, world)[j] for m in members)])


@pytest.mark.parametrize("sizes,world", [((5,), 1), ((7, 1, 12), 2), ((1, 2, 3, 10, 33), 3),
                                         ((16384,) * 4, 2), ((3, 9, 4), 4)])
@pytest.mark.parametrize("concat", [False, True])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_host_places_members_as_the_layout_says(sizes, world, concat, dtype):
    rng = np.random.default_rng(len(sizes) * 10 + world)
    members = [rng.standard_normal(m).astype(dtype) for m in sizes]
    lay = _layout(tuple(sizes), world, concat)
    be = _backend.HostBackend(cpu)
    fused = np.full(sum(sizes), np.nan, dtype)
    be.place_members(fused, members, lay.place, True)
    np.testing.assert_array_equal(fused, _reference(members, world, concat))
    out = [np.full(m, np.nan, dtype) for m in sizes]
    be.place_members(fused, out, lay.place, False)
    for a, b in zip(out, members):
        np.testing.assert_array_equal(a, b)


def test_stats_and_counts_by_the_backend():
    x = np.random.default_rng(1).standard_normal(10000).astype(np.float32)
    e = np.random.default_rng(2).standard_normal(10000).astype(np.float32)
    x[17] = np.inf
    be = _backend.HostBackend(cpu)
    assert be.stats(x, e) == cpu.stats(x, e)
    assert be.stats(x, None) == cpu.stats(x, None)
    assert be.count_nonfinite(x) == 1


def test_quick_members():
    be = _backend.HostBackend(cpu)
    f32 = np.dtype(np.float32)
    a = np.ones((4, 5), np.float32)
    ro = a.copy()
    ro.flags.writeable = False

    def quick(bufs, start=0, writable=True):
        return [f.shape for f in be.quick_members(bufs, start, f32, writable)]
    assert quick([a, a]) == [(20,), (20,)]
    assert quick([a, ro, a]) == [(20,)]  # up to the first that is not at a glance
    assert quick([a, ro, a], writable=False) == [(20,)] * 3
    assert quick([a, a, ro, a], start=3) == [(20,)]
    for bad in (a.T, a.astype(np.float64), np.ones(0, np.float32), [1.0]):
        assert quick([bad, a]) == []
    assert _backend.DeviceBackend(None).quick_members([a], 0, f32, True) == []


@pytest.fixture
def spy(monkeypatch):
    """The host backend's methods of this item, counted."""
    calls = []
    for name in ("place_members", "stats", "count_nonfinite"):
        orig = getattr(_backend.HostBackend, name)

        def wrap(self, *a, _orig=orig, _name=name, **k):
            calls.append(_name)
            return _orig(self, *a, **k)
        monkeypatch.setattr(_backend.HostBackend, name, wrap)
    return calls


def test_a_group_is_placed_by_the_backend(spy):
    a = [np.ones(1000, np.float32), np.arange(77, dtype=np.float32)]
    mpigc.allreduce(a, op="2bit", key=["bk0", "bk1"])
    assert spy.count("place_members") == 2  # members in, results out


def test_terngrad_statistics_by_the_backend(spy):
    x = np.random.default_rng(3).standard_normal(5000).astype(np.float32)
    mpigc.allreduce(x, op="terngrad", key="bk-tern")
    assert "stats" in spy


def test_non_finite_count_by_the_backend(spy):
    x = np.random.default_rng(4).standard_normal(5000).astype(np.float32)
    x[5] = np.inf
    with pytest.raises(mpigc.NonFiniteError):
        mpigc.allreduce(x, op="2bit", key="bk-2bit")
    assert "stats" in spy  # count_bad: the exact count of non-finite values


def _side_questions(path):
    """Where module ``path`` asks which side an array is on: a test (if,
    while, a conditional expression, and/or) that reads ``.device`` or calls
    ``is_device_array``, and any use of ``_dispatch.kernels`` (the kernels
    picked per array, past the call's backend)."""
    tree = ast.parse(open(path).read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            tests = [node.test]
        elif isinstance(node, ast.BoolOp):
            tests = node.values
        else:
            tests = []
        for t in tests:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and sub.attr == "device":
                    found.append(f"line {sub.lineno}: a test of .device")
        if isinstance(node, ast.Attribute) and node.attr in ("kernels", "is_device_array") \
                and isinstance(node.value, ast.Name) and node.value.id == "_dispatch":
            found.append(f"line {node.lineno}: _dispatch.{node.attr}")
    return found


@pytest.mark.parametrize("module", ENGINE)
def test_the_engine_does_not_ask_the_side(module):
    found = _side_questions(os.path.join(ROOT, "mpigc", module + ".py"))
    assert not found, f"mpigc/{module}.py asks which side an array is on: {found}"


def test_group_adopts_members_that_are_not_quick():
    """A member the backend does not take at a glance (a CPU array that is
    not numpy's, a read-only one in a reduce_scatter) is adopted as the first
    was, the members after it at a glance again; a bad one is named."""
    from mpigc._group import Group
    a, c = np.arange(6, dtype=np.float32), np.arange(3, dtype=np.float32)
    buf = bytearray(np.arange(4, dtype=np.float32).tobytes())
    b = memoryview(buf).cast("f")
    g = Group("allreduce", [a, b, c, a], None, None, None, True)
    g.adopt(None)
    assert g.sizes == (6, 4, 3, 6)
    g.flats[1][0] = 7  # a view of the member's memory
    assert np.frombuffer(buf, np.float32)[0] == 7
    ro = c.copy()
    ro.flags.writeable = False
    g = Group("reduce_scatter", [a, ro, c], None, None, None, True)
    g.adopt(None)
    assert g.sizes == (6, 3, 3)
    g = Group("allreduce", [a, c, ro, a], None, None, None, True)
    with pytest.raises(mpigc.InvalidBufferError, match="group member 2"):
        g.adopt(None)
    g = Group("allreduce", [a, np.ones(4, np.float64)], None, None, None, True)
    with pytest.raises(mpigc.DTypeError, match="group member 1 is float64"):
        g.adopt(None)
