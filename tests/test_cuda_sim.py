"""CUDA kernels (``mpigc.kernels.cuda``) against the CPU kernels, bit for bit,
in Numba's CUDA simulator, every launch under the launch contract of
``tests/support/launch_contract.py`` (only what a real launch accepts); plus checks
that need no GPU either: importing the CUDA module touches no driver, the
contract fails on planted defects, every kernel compiles to PTX for sm_90
with the argument types it is launched with, and ptxas makes of that PTX
what the bit-identity needs (no contraction, no spills, at most 64
registers); the CUDA kernels are cached on disk; the summation order of the
device statistics follows a numpy model (``tests/support/device_order.py``).

GPU semantics in the simulator
------------------------------
The simulator runs the kernels as Python, so a float ``min``/``max`` keeps a
NaN as the CPU does, where a GPU's (``fmin``/``fmax``) returns the other
operand. The group ``gpu_semantics`` gives the kernels the GPU's float
``min``/``max`` (``simulator_fix.gpu_float_minmax``) and compares every
compressor with NaN and infinite input, under every ``nonfinite`` policy,
with the CPU; ``MPIGC_SIM_GPU_SEMANTICS=1 python tests/test_cuda_sim.py
GROUP`` runs any group so.

Why subprocesses
----------------
``NUMBA_ENABLE_CUDASIM`` is read once, when ``numba.cuda`` is first imported,
and then replaces ``numba.cuda`` for the whole process. Setting it inside the
pytest process would depend on import order and would leak the simulator into
every later test of the session (a real-GPU test included). So each test here
runs this very file as a script in a fresh interpreter (``python
tests/test_cuda_sim.py GROUP``) with the variable set; the pytest session
never imports ``numba.cuda`` and needs no conftest. A failing check prints its
traceback, which the test shows.

The simulator runs every CUDA thread as a Python thread, so sizes are small
(at most a few thousand elements) and the module uses a tiny grid there
(``THREADS`` = 64, at most 3 blocks), which makes every grid-stride loop run
several rounds and the 1bit kernel put two warps in a CUDA block. A launch
costs its 64 thread starts per block whatever the size below 64 (20-40 ms of
CPU), so the time of a group is its number of launches; the launching thread
yields while it waits for a block's threads (:func:`yield_while_polling`).
Every subprocess run of the module starts in the background when its first
test runs, two at a time, the longest first (tests/support/background.py).
"""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from support import background
from support.simulator_fix import yield_while_polling  # noqa: F401 (test_relative_2bit uses it)

HERE = os.path.abspath(__file__)

SIM_GROUPS = ["fp16_conversion", "bf16_conversion", "2bit", "2bit_rel", "1bit", "terngrad",
              "fp16", "bf16", "stats", "count_nonfinite", "group_copy", "guards", "shards",
              "warp",
              "gpu_semantics", "stats_order"]

_SKIP = 77  # exit code of a script that cannot run here (e.g. no NVVM)


def _have_numba_cuda():
    try:
        return importlib.util.find_spec("numba.cuda") is not None
    except (ImportError, ValueError):
        return False


def _env(sim):
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    if sim:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    return env


def _finish(args, r, timeout):
    """The output of the script run ``r`` (``python tests/test_cuda_sim.py
    ARGS``), after its checks: a skip, a time-out or a failure fails the test."""
    if isinstance(r, subprocess.TimeoutExpired):
        pytest.fail(f"{' '.join(args)} timed out after {timeout} s:\n{r.stdout}")
    if r.returncode == _SKIP:
        pytest.skip(r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "skipped")
    assert r.returncode == 0, f"{' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def _have_numba_cuda_ptx():
    from importlib import metadata
    try:
        metadata.version("numba-cuda")
    except metadata.PackageNotFoundError:
        return False
    return True


# every subprocess run of the selected tests, the longest first (CPU seconds on the
# 2-core VM, with yield_while_polling: signatures 34 and then the PTX compile 31,
# gpu_semantics 45, 2bit_rel 15, 1bit 12, shards 11, terngrad 10, stats_order 9, the
# others 1-6 each, before the block threads were reused, which took 30-55% off the
# simulator groups; a simulator run is one Python process, one thread at a time)
_SLOWEST = ["signatures", "gpu_semantics", "2bit_rel", "1bit", "shards", "terngrad",
            "stats_order", "fp16", "bf16", "2bit", "planted_ptx", "stats"]
_TIMEOUT = 1500
# the runs of the tests that are not a simulator group: test -> (key, arguments,
# simulator on, time limit)
_OTHER_RUNS = {
    "test_import_creates_no_cuda_context": ("import", ["import"], False, 300),
    "test_launch_contract_catches_planted_defects": ("contract", ["contract"], True, _TIMEOUT),
    "test_kernel_code_checks_catch_planted_defects": ("planted_ptx", ["planted_ptx"], False,
                                                      600),
}


def _argv(args):
    return [sys.executable, HERE, *args]


@pytest.fixture(scope="module", autouse=True)
def runs(request, tmp_path_factory):
    """Every subprocess run of the selected tests of this module, started side
    by side in the background (tests/support/background.py) when the module's first
    test runs: the simulator groups, the import and contract checks, the
    planted PTX, and the signature recording of the PTX test with the PTX
    compile after it in the same slot. The tests that work in this process
    (or start their own processes) come first in the module, so they run
    while the background runs do; each other test waits for its own run."""
    sigs = str(tmp_path_factory.mktemp("ptx") / "signatures.json")
    jobs, then = {}, {}
    for g in background.selected(request, "test_cuda_simulator", "group"):
        jobs[g] = ([g], True, _TIMEOUT)
    for name, (key, args, sim, timeout) in _OTHER_RUNS.items():
        if background.chosen(request, name) and (key != "planted_ptx" or _have_numba_cuda_ptx()):
            jobs[key] = (args, sim, timeout)
    if background.chosen(request, "test_kernels_compile_to_ptx") and _have_numba_cuda_ptx():
        jobs["signatures"] = (["signatures", sigs], True, _TIMEOUT)
        then["signatures"] = [("ptx", _argv(["ptx", sigs]), _env(False), _TIMEOUT)]
    pool = background.Runs()
    if _have_numba_cuda():
        order = sorted(jobs, key=lambda k: _SLOWEST.index(k) if k in _SLOWEST else 99)
        pool.start({k: (_argv(jobs[k][0]), _env(jobs[k][1]), jobs[k][2]) for k in order},
                   then)
    pool.signatures = sigs
    return pool


def _result(runs, key, args, sim, timeout=_TIMEOUT):
    """The output of run ``key`` (``python tests/test_cuda_sim.py ARGS``, with
    the simulator or not), after the checks of :func:`_finish`; started now
    if it was not queued."""
    if not _have_numba_cuda():
        pytest.skip("numba.cuda is not installed (pip install 'mpigc[cuda]')")
    return _finish(args, runs.result(key, _argv(args), _env(sim), timeout), timeout)


def _other_result(runs, name):
    key, args, sim, timeout = _OTHER_RUNS[name]
    return _result(runs, key, args, sim, timeout)


# -- checks in this process, or in processes of their own -----------------------------------
def _warp_source():
    with open(os.path.join(os.path.dirname(os.path.dirname(HERE)), "kernels", "cuda.py")) as f:
        return f.read()


def test_no_early_return_in_warp_kernels():
    """No kernel of ``kernels/cuda.py`` that calls a warp intrinsic or a
    barrier (directly or through its device functions) returns early (an
    AST check, ``launch_contract.early_returns``); the check finds one
    planted into the 1bit pack kernel and into the 1bit kernel's device
    function chain (``_warp_sum_i``)."""
    from support import launch_contract
    src = _warp_source()
    assert launch_contract.early_returns(src) == []
    head = "    ob = offs[j]\n    to = ob + (n + 7) // 8 if inline else ob"
    planted = src.replace(head, "    ob = offs[j]\n    if n == 0:\n        return\n"
                          + head[len("    ob = offs[j]\n"):], 1)
    assert planted != src
    found = launch_contract.early_returns(planted)
    assert len(found) == 1 and "kernel _pack_1bit_kernel returns early" in found[0], found
    tree = "    s = LANES // 2\n    while s > 0:\n        c += _shfl_down(c, s)"
    planted = src.replace(tree, "    s = LANES // 2\n    if c == 0:\n        return c\n"
                          + tree[len("    s = LANES // 2\n"):], 1)
    assert planted != src
    found = launch_contract.early_returns(planted)
    assert len(found) == 1 and "device _warp_sum_i returns early" in found[0], found


_CACHE_SIGS = {  # kernels of three kinds: launch_bounds (2bit), a libdevice closure, plain
    "_pack_2bit_kernel": [[["array", "float32", 1, "C"], ["array", "float32", 1, "C"],
                           ["scalar", "boolean"], ["array", "float32", 1, "C"],
                           ["scalar", "boolean"], ["array", "uint8", 1, "C"],
                           ["array", "int64", 1, "C"], ["array", "int64", 1, "C"],
                           ["scalar", "float32"], ["array", "int64", 1, "C"]]],
    "_pack_fp16_kernel_f32": [[["array", "float32", 1, "C"], ["array", "float32", 1, "C"],
                               ["scalar", "boolean"], ["array", "float32", 1, "C"],
                               ["scalar", "boolean"], ["array", "uint16", 1, "C"],
                               ["scalar", "float32"], ["array", "int64", 1, "C"]]],
    "_count_nonfinite_kernel": [[["array", "float64", 1, "C"], ["array", "int64", 1, "C"]]],
}


def test_cuda_kernels_cached_on_disk(tmp_path):
    """The CUDA kernels are cached on disk in mpigc's kernel cache folder
    (``MPIGC_CACHE_DIR``), through numba-cuda's own compile path
    (``CUDADispatcher.compile``: cache look-up, NVVM, link, save) with only
    what needs a GPU replaced (its compute capability, 9.0, and the loading
    of the cubin): a first process compiles and saves each signature, a
    second loads them all (no NVVM, no ptxas); two processes started
    together compile each signature once between them (the lock of
    ``mpigc/_jitcache.py``), the other loads it."""
    if not _have_numba_cuda_ptx():
        pytest.skip("numba-cuda is not installed: pip install 'numba-cuda[cu12]'")
    import json
    sigs = str(tmp_path / "sigs.json")
    with open(sigs, "w") as f:
        json.dump(_CACHE_SIGS, f)
    nsig = sum(map(len, _CACHE_SIGS.values()))

    def run(cache, n=1):
        env = dict(_env(False), MPIGC_CACHE_DIR=str(cache))
        procs = [subprocess.Popen([sys.executable, HERE, "cache", sigs], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(n)]
        outs = []
        for p in procs:
            o, e = p.communicate(timeout=600)
            if p.returncode == _SKIP:
                pytest.skip(o.strip().splitlines()[-1])
            assert p.returncode == 0, o + e
            outs.append(json.loads(next(ln for ln in o.splitlines() if ln.startswith("{"))))
        return outs

    first, = run(tmp_path / "c1")
    assert first["misses"] == nsig and first["hits"] == 0, first
    second, = run(tmp_path / "c1")
    assert second["misses"] == 0 and second["hits"] == nsig, second
    files = [f for _, _, fs in os.walk(tmp_path / "c1") for f in fs]
    assert any(f.endswith(".nbc") for f in files), files
    both = run(tmp_path / "c2", n=2)
    assert sum(o["misses"] for o in both) == nsig, both
    assert sum(o["hits"] for o in both) == nsig, both
    print(f"compile {first['seconds']:.2f} s, load {second['seconds']:.2f} s")


def test_device_stats_order_depends_on_sm_count():
    """The numpy model of the device's summation order
    (``tests/support/device_order.py``; bit for bit the simulator's, group
    ``stats_order``): for the same 2**20 float64 values, the sum on 132 SMs
    (H100 SXM, H200) and on 114 (H100 PCIe) differ in their last bits, and
    both differ from the CPU's; the maximum and the non-finite count are the
    same everywhere. So terngrad with ``clip`` may differ by GPU model in
    rare last-bit cases, as docs/gpu.md says."""
    import numpy as np

    from support import device_order
    x = np.random.default_rng(0).standard_normal((1 << 20) + 3)
    sxm = device_order.stats_model(x, max_blocks=132 * device_order.BLOCKS_PER_SM)
    pcie = device_order.stats_model(x, max_blocks=114 * device_order.BLOCKS_PER_SM)
    assert sxm[2:] == pcie[2:] == (float(np.abs(x).max()), 0)
    assert sxm[0] != pcie[0], (sxm, pcie)
    again = device_order.stats_model(x.copy(), max_blocks=132 * device_order.BLOCKS_PER_SM)
    assert again == sxm  # deterministic for a given device


# -- checks in the background runs --------------------------------------------------------
def test_import_creates_no_cuda_context(runs):
    """Importing the CUDA kernels needs no GPU and touches no driver: this
    machine has none, so any driver call at import would fail."""
    _other_result(runs, "test_import_creates_no_cuda_context")


def test_launch_contract_catches_planted_defects(runs):
    """The launch contract that every simulator test runs under (see
    ``tests/support/launch_contract.py``) fails on defects planted into real launches
    of the module: a ``None`` residual, a host array, a uint16 view at an odd
    address, more than 65535 shards in one launch, a block of 48 threads, a
    launch on Numba's stream 0."""
    out = _other_result(runs, "test_launch_contract_catches_planted_defects")
    assert "ok contract" in out


def test_kernel_code_checks_catch_planted_defects(runs):
    """Each check that ``test_kernels_compile_to_ptx`` makes of the PTX and of
    ptxas's output (``kernel_code_problems``) fails on a small kernel with
    the defect planted, compiled the same way: a plain ``*`` feeding a ``-``
    (no fma in the PTX, an FFMA after ptxas: the cubin differs from
    ``--fmad=false``), a product and sum that NVVM fuses (``fma.``), a float
    ``max``, a fastmath division (``.approx``, ``.ftz``), libdevice's fast
    division (``.approx``), a product in a kernel that must have none, a
    local array indexed at run time (a stack frame), 48 live float64 values
    (70 registers); and ``div.full`` on a line of PTX. A clean kernel
    passes."""
    if not _have_numba_cuda_ptx():
        pytest.skip("numba-cuda is not installed: pip install 'numba-cuda[cu12]'")
    out = _other_result(runs, "test_kernel_code_checks_catch_planted_defects")
    assert "ok planted_ptx" in out


def test_kernels_compile_to_ptx(runs):
    """Every kernel compiles to PTX for sm_90 with exactly the argument types
    it is launched with: a simulator run of the engine (allreduce and
    reduce_scatter at one rank, every compressor, float16/32/64, with and
    without residuals, both gathers, averaging) and of every public kernel
    function records the types of each launch; a second process, without the
    simulator, compiles each recorded signature with ``numba.cuda.compile_ptx``
    (no GPU needed, numba-cuda's NVVM) and checks that no kernel of the module
    went unlaunched, with no flush-to-zero, no approximate division, no
    float min/max and no fma contraction of the products whose rounding
    must match the CPU; then ptxas (``nvidia-cuda-nvcc-cu12``, which
    ``numba-cuda[cu12]`` installs) assembles each for sm_90 and sm_90a (what
    numba-cuda builds on an H100): the cubin must equal the one of ``ptxas
    --fmad=false`` (ptxas fuses a plain product and sum into an FFMA by
    itself), and ``ptxas -v`` must report no stack frame, no spills and at
    most 64 registers. The parameter block the driver's route packs for each
    signature (``mpigc.kernels._driver.param_codes``) must have the PTX's
    ``.param`` count and widths: no launch is left on Numba's route."""
    if not _have_numba_cuda_ptx():
        pytest.skip("numba-cuda is not installed (only Numba's built-in CUDA target): "
                    "pip install 'numba-cuda[cu12]' (the test extra does) to compile to PTX")
    sigs = runs.signatures
    _result(runs, "signatures", ["signatures", sigs], sim=True)
    out = _result(runs, "ptx", ["ptx", sigs], sim=False)
    assert "compiled" in out


@pytest.mark.parametrize("group", SIM_GROUPS)
def test_cuda_simulator(group, runs):
    out = _result(runs, group, [group], sim=True)
    assert f"ok {group}" in out


# ============================================================================
# what runs in the subprocess
# ============================================================================
# the sizes of the element-wise checks, each a case of its own at THREADS = 64 and
# 3 blocks: 1, a single value (2bit: a byte of 1 code and 3 pads; 1bit: 1 bit);
# 3, under a byte of 2bit codes, with 3 of 4 codes; 7, over a byte (residue 3 in
# its second byte; 1bit: 7 of 8 bits); 13, residue 1 over 4 bytes (1bit: 5 bits of
# the second byte) and the first size with special values planted (n > 10); 100,
# two blocks, the second partial (2bit: whole bytes only); 1027, the whole grid (192
# threads) in 6 grid-stride rounds, a partial last round and byte. Sizes under 64
# cost one launch of one block per check: 3 and 7 together take 0.7-1.3 CPU
# seconds of each of the groups 2bit, fp16, bf16 and terngrad (100 and 1027: 3-8).
SIZES = [1, 3, 7, 13, 100, 1027]
DTYPES = ["float32", "float64"]
# (e_in given, e_out mode): mode None = no residual out, "new" = another
# buffer, "inplace" = e_out is e_in
MODES = [(False, None), (True, None), (True, "new"), (True, "inplace"), (False, "new")]
# the 1bit kernel synchronises its threads, which the simulator makes slow:
# fewer modes (residual read / written / both / in place all still covered)
MODES_1BIT = [(True, None), (False, "new"), (True, "inplace")]


def _ctx():
    import warnings

    import numpy as np
    from numba import cuda

    from mpigc.kernels import cpu
    from mpigc.kernels import cuda as kc
    # numpy scalar arithmetic warns on the intended uint64 wrap-around of the
    # splitmix64 hash and on float16 overflow to inf; the results are right
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    assert kc.SIMULATOR, "NUMBA_ENABLE_CUDASIM=1 was not in effect"
    return np, cuda, cpu, kc


def _bits(np, a):
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize])


def _same(np, what, got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{what}: expected {want.dtype}{want.shape}, got {got.dtype}{got.shape}"
    bad = np.flatnonzero(_bits(np, got) != _bits(np, want))
    assert bad.size == 0, (f"{what}: {bad.size} differ, first at {bad[0]}: "
                           f"got {got[bad[0]]!r}, want {want[bad[0]]!r}")


def _data(np, n, dtype, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * scale).astype(dtype)
    e = (rng.standard_normal(n) * 0.3 * scale).astype(dtype)
    return x, e


def _run_pack(np, cuda, cpu_fn, cuda_fn, x, e, mode, outs, args):
    """Run a pack kernel on host and device with the same residual mode.
    ``outs`` are the output arrays (zeros); returns (host outs, device outs,
    host e_out, device e_out, host nbad, device nbad)."""
    e_given, e_mode = mode
    he_in = e.copy() if e_given else None
    he_out = None if e_mode is None else (he_in if e_mode == "inplace" else np.zeros_like(x))
    h_outs = [o.copy() for o in outs]
    h_nbad = cpu_fn(x, he_in, he_out, *h_outs, *args)
    dx = cuda.to_device(x)
    de_in = cuda.to_device(e) if e_given else None
    de_out = None if e_mode is None else (
        de_in if e_mode == "inplace" else cuda.to_device(np.zeros_like(x)))
    d_outs = [cuda.to_device(o) for o in outs]
    d_nbad = cuda_fn(dx, de_in, de_out, *d_outs, *args)
    return (h_outs, [o.copy_to_host() for o in d_outs],
            he_out, None if de_out is None else de_out.copy_to_host(), h_nbad, d_nbad)


def _check_pack(np, cuda, tag, cpu_fn, cuda_fn, x, e, outs, args, modes=MODES):
    for mode in modes:
        h, d, he, de, hn, dn = _run_pack(np, cuda, cpu_fn, cuda_fn, x, e, mode, outs, args)
        what = f"{tag} mode={mode}"
        assert isinstance(dn, int), f"{what}: count is {type(dn).__name__}, not int"
        assert hn == dn, f"{what}: non-finite count {dn}, want {hn}"
        for k, (a, b) in enumerate(zip(d, h)):
            _same(np, f"{what} out{k}", a, b)
        if he is not None:
            _same(np, f"{what} e_out", de, he)


def _check_decode(np, cuda, tag, cpu_fn, cuda_fn, payloads, n, dtype, args):
    rng = np.random.default_rng(n)
    for accumulate in (False, True):
        base = rng.standard_normal(n).astype(dtype)
        h = base.copy()
        cpu_fn(*payloads, h, *args, accumulate)
        d = cuda.to_device(base)
        cuda_fn(*[cuda.to_device(p) for p in payloads], d, *args, accumulate)
        _same(np, f"{tag} decode accumulate={accumulate}", d.copy_to_host(), h)


def check_fp16_conversion():
    """The device float32 -> half conversion against numpy's astype(float16)
    (round to nearest even, subnormals, overflow, signed zeros) and the
    decoder on all 65536 half bit patterns."""
    np, cuda, cpu, kc = _ctx()
    rng = np.random.default_rng(1)
    special = np.array([0.0, -0.0, 1.0, -1.0, 65504.0, -65504.0, 65519.996, 65520.0,
                        65536.0, 1e9, -1e9, np.inf, -np.inf, 6.1035156e-05, 6.097555e-05,
                        5.9604645e-08, 2.9802322e-08, 2.9802326e-08, 8.940697e-08,
                        1e-45, -1e-45, 1.1754942e-38, 1.0009765625, 1.00048828125,
                        1.00146484375, 2049.0, 2051.0, 0.1, -0.1], np.float32)
    # random bit patterns over the whole float32 range, and many near the
    # half range (normal and subnormal), including the exact halfway points
    u = rng.integers(0, 2**32, 3000, dtype=np.uint64).astype(np.uint32)
    near = rng.uniform(-70000, 70000, 1500).astype(np.float32)
    tiny = (rng.uniform(-1, 1, 1500) * 2.0**-14).astype(np.float32)
    halves = np.arange(-2048, 2048, dtype=np.float32) * np.float32(2.0**-24) + np.float32(
        2.0**-25)
    v = np.concatenate([special, u.view(np.float32), near, tiny, halves])
    v = v[np.isfinite(v) | np.isinf(v)]  # NaN payloads: checked against the CPU below
    dout = cuda.to_device(np.zeros(v.size, np.uint16))
    kc.pack_fp16(cuda.to_device(v), None, None, dout, 1.0)
    got = dout.copy_to_host()
    _same(np, "fp16 pack vs numpy astype(float16)", got, v.astype(np.float16).view(np.uint16))
    nans = np.array([np.nan, -np.nan], np.float32)
    nans = np.concatenate([nans, (np.uint32(0x7F800001) + np.arange(5, dtype=np.uint32)
                                  * np.uint32(0x12345)).view(np.float32)])
    hout = np.zeros(nans.size, np.uint16)
    cpu.pack_fp16(nans, None, None, hout, 1.0)
    dout = cuda.to_device(np.zeros(nans.size, np.uint16))
    n = kc.pack_fp16(cuda.to_device(nans), None, None, dout, 1.0)
    _same(np, "fp16 pack of NaNs vs CPU", dout.copy_to_host(), hout)
    assert n == nans.size, f"non-finite count {n}, want {nans.size}"
    allh = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    dd = cuda.to_device(np.zeros(65536, np.float32))
    kc.unpack_fp16(cuda.to_device(allh), dd, False)
    want = allh.view(np.float16).astype(np.float32)
    got = dd.copy_to_host()
    fin = ~np.isnan(want)
    _same(np, "fp16 decode of all halves vs numpy", got[fin], want[fin])
    assert np.isnan(got[~fin]).all(), "fp16 decode: a NaN half decoded to a number"
    hh = np.zeros(65536, np.float32)
    cpu.unpack_fp16(allh, hh, False)
    _same(np, "fp16 decode of all halves vs CPU", got, hh)


def _bf16_rne_reference(np, v):
    """numpy reference: the upper 16 bits of float32 ``v`` after rounding to
    nearest even; a NaN becomes 0x7FC0 with its sign."""
    u = v.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r[nan] = ((u[nan] >> 16) & 0x8000).astype(np.uint16) | np.uint16(0x7FC0)
    return r


def check_bf16_conversion():
    """The device float32 -> bfloat16 conversion against a numpy reference
    (round to nearest even, ties both ways, overflow to inf, NaN with payload
    and sign, subnormals, signed zeros) and against the CPU kernel, and the
    decoder on all 65536 bfloat16 bit patterns."""
    np, cuda, cpu, kc = _ctx()
    rng = np.random.default_rng(2)
    hi = rng.integers(0, 2**16, 1000, dtype=np.uint64).astype(np.uint32) << np.uint32(16)
    low = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    edges = (hi[:, None] | low[None, :]).ravel()  # exact ties and their neighbours
    special = np.array([0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x7F800000, 0xFF800000,
                        0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000,
                        0x00000001, 0x80008000, 0x00018000, 0x3F808000, 0x3F818000],
                       np.uint32)
    u = np.concatenate([special, edges,
                        rng.integers(0, 2**32, 3000, dtype=np.uint64).astype(np.uint32)])
    v = u.view(np.float32)
    dout = cuda.to_device(np.zeros(v.size, np.uint16))
    n = kc.pack_bf16(cuda.to_device(v), None, None, dout, 1.0)
    got = dout.copy_to_host()
    want = _bf16_rne_reference(np, v)
    _same(np, "bf16 pack vs numpy reference", got, want)
    hout = np.zeros(v.size, np.uint16)
    nh = cpu.pack_bf16(v, None, None, hout, 1.0)
    _same(np, "bf16 pack vs CPU", got, hout)
    nw = int(((want & 0x7F80) == 0x7F80).sum())
    assert n == nh == nw, f"non-finite count: cuda {n}, cpu {nh}, want {nw}"
    allb = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    dd = cuda.to_device(np.zeros(65536, np.float32))
    kc.unpack_bf16(cuda.to_device(allb), dd, False)
    got = dd.copy_to_host()
    _same(np, "bf16 decode of all patterns vs bit shift", got,
          (allb.astype(np.uint32) << np.uint32(16)).view(np.float32))
    hh = np.zeros(65536, np.float32)
    cpu.unpack_bf16(allb, hh, False)
    _same(np, "bf16 decode of all patterns vs CPU", got, hh)


def check_2bit():
    np, cuda, cpu, kc = _ctx()
    for dtype in DTYPES:
        for n in SIZES:
            x, e = _data(np, n, dtype, n)
            x[:: 5] = 0.5   # exactly at +t and -t
            x[1:: 7] = -0.5
            tag = f"2bit {dtype} n={n}"
            out = np.zeros((n + 3) // 4, np.uint8)
            _check_pack(np, cuda, tag, cpu.pack_2bit, kc.pack_2bit, x, e, [out], (0.5,))
            payload = np.random.default_rng(n).integers(0, 256, out.size, dtype=np.uint8)
            _check_decode(np, cuda, tag, cpu.unpack_2bit, kc.unpack_2bit, [payload], n,
                          dtype, (0.5,))
    # non-finite values are counted; the finite ones still quantize the same
    x, e = _data(np, 101, "float32", 7)
    x[[0, 13, 100]] = [np.nan, np.inf, -np.inf]
    out = np.zeros(26, np.uint8)
    _check_pack(np, cuda, "2bit non-finite", cpu.pack_2bit, kc.pack_2bit, x, e, [out],
                (0.5,))
    # the MXNet example of ALGORITHMS.md
    x = np.array([0.5, 3.1, -1.0, -2.0, 2.0, 0.1, 1.9, -7.0], np.float32)
    d = cuda.to_device(np.zeros(2, np.uint8))
    kc.pack_2bit(cuda.to_device(x), None, None, d, 2.0)
    assert d.copy_to_host().tolist() == [0x32, 0xC2], d.copy_to_host()
    _check_byte_layouts(np, cuda, cpu, kc, "2bit", "pack_2bit_shards", (0.5,),
                        "unpack_2bit_shards", (0.5,))


# shards for the kernels where a thread handles whole payload bytes, two a
# round, bytes k and k + the grid's threads (2bit, terngrad): shard starts that
# are not multiples of 4, shards that end inside a byte (3 and 1 values in
# it), an empty shard, tails of 1 and 2 values, and shards longer than one
# round of a CUDA block (the 5 shards get one block each: 64 threads, 128
# bytes a round): 701 values take 2 rounds, the second partial; 258 puts a
# half byte (2 values) at thread 0's second byte
LAYOUT_SHARDS = [3, 701, 0, 1, 2, 258]
# a whole grid (3 blocks, 384 bytes a round) in 3 rounds, 1 value in its last byte
LAYOUT_N = 3333


def _check_byte_layouts(np, cuda, cpu, kc, tag, pack, pargs, unpack, uargs, scale=False):
    """``pack`` / ``unpack`` (``*_shards`` functions of 2bit codes; with
    ``scale``, a float32 after each shard's codes, as terngrad's) against
    the CPU on :data:`LAYOUT_SHARDS`, with payload offsets that leave gaps
    (odd offsets; the gaps keep their bytes), residuals absent, another buffer
    and in place, and decoding of 1, 2 and 3 senders written and accumulated;
    then one shard of :data:`LAYOUT_N` values (several grid-stride rounds)."""
    extra = 4 if scale else 0
    nb = [(m + 3) // 4 + extra for m in LAYOUT_SHARDS]
    starts = tuple(np.concatenate([[0], np.cumsum(LAYOUT_SHARDS)]).astype(int).tolist())
    offs = tuple(int(sum(nb[:j])) + 2 * j + 1 for j in range(len(nb)))
    nbytes = offs[-1] + nb[-1] + 3
    cases = [(starts, offs, nbytes, MODES_1BIT, (1, 2, 3)),
             ((0, LAYOUT_N), (0,), (LAYOUT_N + 3) // 4 + extra, [(True, "inplace")], (2,))]
    cpu_fn, kc_fn = getattr(cpu, pack), getattr(kc, pack)
    for starts, offs, nbytes, modes, senders in cases:
        n = starts[-1]
        what = f"{tag} layout {len(starts) - 1} shards of {n}"
        x, e = _data(np, n, "float32", 31)
        x[:: 5] = 0.5
        x[[4, 705, 709]] = [np.nan, np.inf, -np.inf]  # shards 1 and 5 (of 6)
        gap = np.arange(nbytes, dtype=np.uint8) | np.uint8(1)  # never a pack's zero

        def cpu_pack(x, e_in, e_out, payload, *a):
            return cpu_fn(x, e_in, e_out, payload, starts, offs, *a)

        def kc_pack(x, e_in, e_out, payload, *a):
            return kc_fn(x, e_in, e_out, payload, starts, offs, *a)

        _check_pack(np, cuda, what, cpu_pack, kc_pack, x, e, [gap], pargs, modes)
        stride = nbytes + 5
        rng = np.random.default_rng(n)
        payloads = rng.integers(0, 256, 3 * stride, dtype=np.uint8)
        for s_ in range(3 if scale else 0):  # finite scales
            for j, m in enumerate(np.diff(starts)):
                at = s_ * stride + offs[j] + (m + 3) // 4
                payloads[at:at + 4] = rng.uniform(-2, 2, 1).astype("<f4").view(np.uint8)
        for nsrc in senders:
            def cpu_dec(p, out, *a):
                getattr(cpu, unpack)(p, stride, nsrc, starts, offs, out, *a)

            def kc_dec(p, out, *a):
                getattr(kc, unpack)(p, stride, nsrc, starts, offs, out, *a)

            _check_decode(np, cuda, f"{what} nsrc={nsrc}", cpu_dec, kc_dec, [payloads], n,
                          "float32", uargs)


def check_2bit_rel():
    """The relative 2bit kernels (one warp per block, as 1bit): codes,
    thresholds and residuals bit for bit, with zero blocks, huge and tiny
    values, non-finite values and shards that are not multiples of 4."""
    np, cuda, cpu, kc = _ctx()
    # (block 4 at n = 1027 is 257 warp rounds: slow in the simulator, left out)
    # (block 16 at n = 1027, 65 warps, left out too: the group ran 10.5 minutes with
    # it; n = 100 with block 16 already spans several warps and a partial block)
    cases = [(n, 4) for n in SIZES if n < 1000] + [(n, 16) for n in SIZES if n < 1000]
    # (1224: a last block of 200 values, inside a lane's second round of 4 rows;
    # see check_1bit)
    cases += [(n, 1024) for n in (13, 2051, 1224)]
    for dtype in DTYPES:
        for n, block in cases:
            x, e = _data(np, n, dtype, 7 * n + block)
            if n > 40:
                x[:16] = 0  # zero blocks: threshold 0, all 00
                e[:16] = 0
                x[16:20] = np.array([3e38, -3e38, 1e30, -1e30], dtype)  # huge
                x[20:24] = np.array([1e-40, -1e-40, 1e-30, 0], dtype)  # tiny
                e[20:24] = 0
                x[30] = -0.0
            if n == 1224:  # the value a lane's third row clamps to weighs (selected)
                x[-1] = 8.0
            nblk = (n + block - 1) // block
            tag = f"2bit_rel {dtype} n={n} block={block}"
            out = np.zeros((n + 3) // 4, np.uint8)
            scales = np.zeros(nblk, np.float32)
            # (the simulator is slow: the modes at one rel_threshold)
            _check_pack(np, cuda, f"{tag} rel=1.5", cpu.pack_2bit_rel, kc.pack_2bit_rel, x,
                        e, [out, scales], (1.5, block), MODES_1BIT)
            _check_pack(np, cuda, f"{tag} rel=0.7", cpu.pack_2bit_rel, kc.pack_2bit_rel, x,
                        e, [out, scales], (0.7, block), [(True, "new")])
            rng = np.random.default_rng(n)
            payload = rng.integers(0, 256, out.size, dtype=np.uint8)
            pscales = np.abs(rng.standard_normal(nblk)).astype(np.float32)
            _check_decode(np, cuda, tag, cpu.unpack_2bit_rel, kc.unpack_2bit_rel,
                          [payload, pscales], n, dtype, (block,))
    x, e = _data(np, 100, "float32", 3)
    x[[5, 50, 51]] = [np.inf, np.nan, -np.inf]
    out = np.zeros(25, np.uint8)
    scales = np.zeros(7, np.float32)
    _check_pack(np, cuda, "2bit_rel non-finite", cpu.pack_2bit_rel, kc.pack_2bit_rel, x, e,
                [out, scales], (1.5, 16), MODES_1BIT)


def check_1bit():
    np, cuda, cpu, kc = _ctx()
    # (blocks of 8 and 16 at n = 1027, 129 and 65 warps, are left out: the group
    # ran past 15 minutes in the simulator with them; n = 100 spans 13 and 7 warps)
    cases = [(n, b) for b in (8, 16) for n in SIZES if n < 1000]
    # (1224: a last block of 200 values, which a lane's second round of 4 rows
    # (values v, v + 32, v + 64, v + 96) ends inside: lane 8's third row is
    # value 200, the first past the block)
    cases += [(n, 1024) for n in (1, 13, 2051, 1224)]
    for dtype in DTYPES:
        for n, block in cases:
            x, e = _data(np, n, dtype, n + block)
            if n > 40:
                x[:16] = np.abs(x[:16]) + 1  # a block with no bit-0 element
                e[:16] = 0
                x[16:24] = -np.abs(x[16:24]) - 1  # and one with no bit-1 element
                e[16:24] = 0
                x[30] = -0.0
            nblk = (n + block - 1) // block
            tag = f"1bit {dtype} n={n} block={block}"
            bits = np.zeros((n + 7) // 8, np.uint8)
            means = np.zeros(2 * nblk, np.float32)
            _check_pack(np, cuda, tag, cpu.pack_1bit, kc.pack_1bit, x, e, [bits, means],
                        (block,), MODES_1BIT)
            rng = np.random.default_rng(n)
            pbits = rng.integers(0, 256, bits.size, dtype=np.uint8)
            pmeans = rng.standard_normal(means.size).astype(np.float32)
            _check_decode(np, cuda, tag, cpu.unpack_1bit, kc.unpack_1bit, [pbits, pmeans],
                          n, dtype, (block,))
    x, e = _data(np, 100, "float64", 3)
    x[[5, 50]] = [np.inf, np.nan]
    bits = np.zeros(13, np.uint8)
    means = np.zeros(2 * 7, np.float32)
    _check_pack(np, cuda, "1bit non-finite", cpu.pack_1bit, kc.pack_1bit, x, e,
                [bits, means], (16,), MODES_1BIT)
    # finite float64 values whose means are beyond float32 (block 0: both
    # classes; block 1: a float64 sum that overflows; block 2 also holds a
    # NaN, counted as such): the same means, residuals and count
    x[[5, 50]] = 0.0
    x[0:4], x[4:8] = 1e39, -1e39
    x[16:32] = 1e308
    x[40] = np.nan
    e[0:32] = 0.0
    _check_pack(np, cuda, "1bit beyond float32", cpu.pack_1bit, kc.pack_1bit, x, e,
                [bits, means], (16,), MODES_1BIT)


def check_terngrad():
    np, cuda, cpu, kc = _ctx()
    for args in [(0, 0, 0, 0), (1, 3, 17, 1), (2**64 - 1, 2**31, 2**40, 0)]:
        assert kc.ternary_stream(*args) == cpu.ternary_stream(*args), args
    for dtype in DTYPES:
        for n in SIZES:
            x, e = _data(np, n, dtype, 3 * n)
            stream = cpu.ternary_stream(42, 1, n, 0)
            v = x.astype(np.float64) + e
            amax = float(np.abs(v).max())
            for scale, clip, offset in [(amax, np.inf, 0), (amax * 0.7, amax * 0.6, 12345),
                                        (0.0, np.inf, 5)]:
                tag = f"terngrad {dtype} n={n} scale={scale:.3g} clip={clip:.3g}"
                out = np.zeros((n + 3) // 4, np.uint8)
                _check_pack(np, cuda, tag, cpu.pack_ternary, kc.pack_ternary, x, e, [out],
                            (np.float32(scale), clip, stream, offset))
    _check_byte_layouts(np, cuda, cpu, kc, "terngrad", "pack_ternary_shards",
                        (np.float32(2.0), 1.5, cpu.ternary_stream(3, 1, 2, 0), 11),
                        "unpack_ternary_shards", (), scale=True)


def check_fp16():
    np, cuda, cpu, kc = _ctx()
    for dtype in DTYPES:
        for n in SIZES:
            x, e = _data(np, n, dtype, 5 * n, scale=1000.0)
            if n > 10:
                x[:4] = [1e5, -1e6, 3e-7, -6e-8]  # overflow and subnormal halves
            for divisor in (1.0, 3.0):
                tag = f"fp16 {dtype} n={n} divisor={divisor}"
                out = np.zeros(n, np.uint16)
                _check_pack(np, cuda, tag, cpu.pack_fp16, kc.pack_fp16, x, e, [out],
                            (divisor,))
            payload = np.random.default_rng(n).integers(0, 2**16, n, dtype=np.uint64)
            payload = payload.astype(np.uint16)
            payload[(payload & 0x7C00) == 0x7C00] &= 0xBFFF  # keep the sums finite
            _check_decode(np, cuda, f"fp16 {dtype} n={n}", cpu.unpack_fp16,
                          kc.unpack_fp16, [payload], n, dtype, ())


def check_bf16():
    np, cuda, cpu, kc = _ctx()
    for dtype in DTYPES:
        for n in SIZES:
            x, e = _data(np, n, dtype, 7 * n, scale=1000.0)
            if n > 10:  # beyond float32 (float64 only), near the top, subnormal
                x[:5] = [3.4e38, -3.3e38, 1e-39, -3e-45, 1.00390625]
                if np.dtype(dtype) == np.float64:
                    x[5] = 1e39
            for divisor in (1.0, 3.0):
                tag = f"bf16 {dtype} n={n} divisor={divisor}"
                out = np.zeros(n, np.uint16)
                _check_pack(np, cuda, tag, cpu.pack_bf16, kc.pack_bf16, x, e, [out],
                            (divisor,))
            payload = np.random.default_rng(n).integers(0, 2**16, n, dtype=np.uint64)
            payload = payload.astype(np.uint16)
            payload &= 0xBFFF  # exponents below 0x80: sums stay finite
            _check_decode(np, cuda, f"bf16 {dtype} n={n}", cpu.unpack_bf16,
                          kc.unpack_bf16, [payload], n, dtype, ())


def check_stats():
    np, cuda, cpu, kc = _ctx()
    for dtype in DTYPES:
        for n in SIZES + [3000]:
            x, e = _data(np, n, dtype, 11 * n)
            for e_in in (None, e):
                hs = cpu.stats(x, e_in)
                ds = kc.stats(cuda.to_device(x), None if e_in is None else cuda.to_device(e))
                assert [type(a) for a in ds] == [float, float, float, int], ds
                assert ds[2] == hs[2] and ds[3] == hs[3], (n, ds, hs)  # exact
                for a, b in zip(ds[:2], hs[:2]):
                    assert abs(a - b) <= 1e-12 * max(1.0, abs(b)), (n, ds, hs)
    x = np.array([1.0, np.nan, -3.0, np.inf, 2.0], np.float32)
    ds = kc.stats(cuda.to_device(x), None)
    hs = cpu.stats(x, None)
    assert ds[2:] == hs[2:] == (float("inf"), 2), (ds, hs)
    assert kc.stats(cuda.to_device(np.zeros(0, np.float32)), None) == (0.0, 0.0, 0.0, 0)


def check_count_nonfinite():
    np, cuda, cpu, kc = _ctx()
    for dtype in DTYPES:
        for n in SIZES + [0]:
            x, _ = _data(np, n, dtype, n)
            got = kc.count_nonfinite(cuda.to_device(x))
            assert got == 0 and isinstance(got, int), (n, got)
            if n:
                idx = np.arange(0, n, 3)
                x[idx] = np.where(idx % 2, np.inf, np.nan)
                x[-1] = -np.inf
                want = cpu.count_nonfinite(x)
                got = kc.count_nonfinite(cuda.to_device(x))
                assert got == want, (dtype, n, got, want)


def check_group_copy():
    """kc.group_copy places each member of a group where numpy.array_split
    puts its shards (owner-major, as mpigc._group lays a fused buffer out),
    and back, bit for bit (NaN payloads and float16 included); None and
    empty members are skipped."""
    np, cuda, cpu, kc = _ctx()
    rng = np.random.default_rng(5)
    for dt in ("float16", "float32", "float64"):
        for world in (1, 2, 3, 5):
            sizes = [int(s) for s in rng.integers(1, 40, 4)] + [2, 1]
            mem = [rng.standard_normal(m).astype(dt) for m in sizes]
            # a NaN with a payload and its sign bit set
            bits = mem[0].view({"float16": "u2", "float32": "u4", "float64": "u8"}[dt])
            bits[0] = {"float16": 0xFE01, "float32": 0xFFC00123,
                       "float64": 0xFFF8000000000123}[dt]
            ats, want, at = [0] * (len(sizes) * world), [], 0
            for j in range(world):
                for i, m in enumerate(mem):
                    piece = np.array_split(m, world)[j]
                    ats[i * world + j] = at
                    want.append(piece)
                    at += piece.size
            want = np.concatenate(want)
            fused = cuda.to_device(np.zeros(at, dt))
            dmem = [cuda.to_device(m) for m in mem] + [None]
            kc.group_copy(fused, dmem, tuple(ats) + (0,) * world, world, True)
            got = fused.copy_to_host()
            assert got.tobytes() == want.tobytes(), (dt, world)
            back = [cuda.to_device(np.zeros(m, dt)) for m in sizes] + [None]
            kc.group_copy(fused, back, tuple(ats) + (0,) * world, world, False)
            for m, b in zip(mem, back):
                assert b.copy_to_host().tobytes() == m.tobytes(), (dt, world)
    try:
        kc.group_copy(cuda.to_device(np.zeros(4, "f4")), [cuda.to_device(np.zeros(4, "f8"))],
                      (0,), 1, True)
    except TypeError as e:
        assert "one dtype" in str(e) or "members" in str(e)
    else:
        raise AssertionError("group_copy took members of another dtype")


def check_guards():
    np, cuda, cpu, kc = _ctx()
    try:
        kc.count_nonfinite(np.zeros(4, np.float32))
    except TypeError as exc:
        assert "expected a CUDA device array" in str(exc), exc
    else:
        raise AssertionError("a host array was accepted")
    public = [f for f in cpu.__all__ if f != "PARALLEL_MIN_ELEMENTS"]
    import inspect
    for name in public:
        hp = list(inspect.signature(getattr(cpu, name)).parameters)
        dp = [p.name for p in inspect.signature(getattr(kc, name)).parameters.values()
              if p.kind is not p.KEYWORD_ONLY]
        assert hp == dp, f"{name}: cuda takes {dp}, cpu takes {hp}"
    assert set(cpu.__all__) == set(kc.__all__)
    # empty inputs launch nothing and count nothing
    z = cuda.to_device(np.zeros(0, np.float32))
    assert kc.pack_2bit(z, None, None, cuda.to_device(np.zeros(0, np.uint8)), 0.5) == 0
    assert kc.pack_1bit(z, None, None, cuda.to_device(np.zeros(0, np.uint8)),
                        cuda.to_device(np.zeros(0, np.float32)), 8) == 0
    assert kc.pack_2bit_rel(z, None, None, cuda.to_device(np.zeros(0, np.uint8)),
                            cuda.to_device(np.zeros(0, np.float32)), 1.5, 1024) == 0
    kc.unpack_2bit_rel(cuda.to_device(np.zeros(0, np.uint8)),
                       cuda.to_device(np.zeros(0, np.float32)), z, 1024, True)
    kc.unpack_fp16(cuda.to_device(np.zeros(0, np.uint16)), z, True)
    assert kc.pack_bf16(z, None, None, cuda.to_device(np.zeros(0, np.uint16)), 1.0) == 0
    kc.unpack_bf16(cuda.to_device(np.zeros(0, np.uint16)), z, True)
    _check_block_sizes(np, cuda, cpu, kc)


def _check_block_sizes(np, cuda, cpu, kc):
    """A 1bit block that is not a positive multiple of 8, or a relative 2bit
    block not one of 4, is a ConfigError on both sides, raised before any
    launch (on a GPU two warps would write one byte: timing-dependent bits)."""
    from support import launch_contract

    import mpigc
    n = 40
    x = np.linspace(-1, 1, n).astype(np.float32)
    dx = cuda.to_device(x)
    calls = [
        ("pack_1bit", 12, lambda m, a, b: m.pack_1bit(a, None, None, b(np.zeros(5, np.uint8)),
                                                    b(np.zeros(8, np.float32)), 12)),
        ("pack_1bit", 0, lambda m, a, b: m.pack_1bit(a, None, None, b(np.zeros(5, np.uint8)),
                                                   b(np.zeros(8, np.float32)), 0)),
        ("pack_1bit_shards", 4, lambda m, a, b: m.pack_1bit_shards(
            a, None, None, b(np.zeros(64, np.uint8)), (0, 20, 40), (0, 32), 4)),
        ("pack_2bit_rel", 6, lambda m, a, b: m.pack_2bit_rel(
            a, None, None, b(np.zeros(10, np.uint8)), b(np.zeros(7, np.float32)), 1.5, 6)),
        ("pack_2bit_rel_shards", 2, lambda m, a, b: m.pack_2bit_rel_shards(
            a, None, None, b(np.zeros(64, np.uint8)), (0, 20, 40), (0, 32), 1.5, 2)),
        ("pack_2bit_rel", 8.0, lambda m, a, b: m.pack_2bit_rel(
            a, None, None, b(np.zeros(10, np.uint8)), b(np.zeros(5, np.float32)), 1.5, 8.0)),
    ]
    for name, block, call in calls:
        for side, m, a, b in (("cpu", cpu, x, lambda h: h), ("cuda", kc, dx, cuda.to_device)):
            before = launch_contract.counts()
            try:
                call(m, a, b)
            except mpigc.ConfigError as exc:
                assert isinstance(exc, ValueError) and "multiple of" in str(exc) and \
                    name in str(exc), exc
            else:
                raise AssertionError(f"{side} {name} took block_size {block!r}")
            launched = {k: v for k, v in launch_contract.counts().items()
                        if k.startswith("launch") and before.get(k) != v}
            assert not launched, f"{side} {name}: launched {launched} before refusing"
    # the 1bit and relative 2bit decodes too (a device thread decodes a byte
    # with one block's numbers; a CPU decode with such a block misread the
    # bits silently before it checked)
    for side, m_, b in (("cuda", kc, cuda.to_device), ("cpu", cpu, lambda h: h)):
        dbits, dmeans, dout = (b(np.zeros(5, np.uint8)), b(np.zeros(8, np.float32)),
                               b(np.zeros(n, np.float32)))
        dpay = b(np.zeros(64, np.uint8))
        for name, m, call in [
                ("unpack_1bit", 8, lambda: m_.unpack_1bit(dbits, dmeans, dout, 12, False)),
                ("unpack_1bit_shards", 8, lambda: m_.unpack_1bit_shards(
                    dpay, 0, 1, (0, 20, 40), (0, 32), dout, 4, True)),
                ("unpack_2bit_rel", 4, lambda: m_.unpack_2bit_rel(dbits, dmeans, dout, 6,
                                                                  False)),
                ("unpack_2bit_rel_shards", 4, lambda: m_.unpack_2bit_rel_shards(
                    dpay, 0, 1, (0, 20, 40), (0, 32), dout, 2, True))]:
            before = launch_contract.counts()
            try:
                call()
            except mpigc.ConfigError as exc:
                assert f"multiple of {m}" in str(exc) and name in str(exc), exc
            else:
                raise AssertionError(f"{side} {name} took a block_size that is not a "
                                     f"multiple of {m}")
            assert launch_contract.counts() == before, f"{side} {name} launched before refusing"


# shards of odd sizes, an empty one, one longer than a CUDA block and than
# the simulator's grid (grid-stride rounds, partial warps and blocks)
SHARDS = [37, 0, 5, 150, 1]


def _shard_case(np, codec, n_shards, dtype):
    """(starts, offs, payload size) for shards of ``n_shards`` sizes."""
    starts = np.concatenate([[0], np.cumsum(n_shards)]).astype(int).tolist()
    sizes = [codec.payload_nbytes(m, np.dtype(dtype)) for m in n_shards]
    offs = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()
    return tuple(starts), tuple(offs[:-1]), offs[-1]


def check_shards():
    """The one-launch-per-stage functions (``*_shards``: every shard of a call
    packed, or every sender's payload decoded, by one kernel) against the
    CPU's loops, bit for bit: payload bytes (codes and the float32 tails),
    residuals (absent, another buffer, in place), counts, and decoding of 3
    senders written and accumulated; float32 and float64."""
    np, cuda, cpu, kc = _ctx()
    import mpigc
    cases = [
        ("2bit", mpigc.TwoBit(threshold=0.5), "pack_2bit_shards", (0.5,),
         "unpack_2bit_shards", (0.5,)),
        ("2bit_rel", mpigc.TwoBit(rel_threshold=1.2, block_size=16), "pack_2bit_rel_shards",
         (1.2, 16), "unpack_2bit_rel_shards", (16,)),
        ("1bit", mpigc.OneBit(block_size=16), "pack_1bit_shards", (16,),
         "unpack_1bit_shards", (16,)),
        ("terngrad", mpigc.TernGrad(), "pack_ternary_shards",
         (np.float32(2.5), 2.0, cpu.ternary_stream(3, 1, 2, 0), 11), "unpack_ternary_shards",
         ()),
        ("fp16", mpigc.FP16(), None, (), "unpack_fp16_shards", ()),
        ("bf16", mpigc.BF16(), None, (), "unpack_bf16_shards", ()),
    ]
    n = sum(SHARDS)
    for dtype in DTYPES:
        for tag, codec, pack, pargs, unpack, uargs in cases:
            starts, offs, nbytes = _shard_case(np, codec, SHARDS, dtype)
            what = f"shards {tag} {dtype}"
            if pack is not None:
                x, e = _data(np, n, dtype, 17)
                x[40] = np.nan  # in shard 2: counted
                cpu_fn = getattr(cpu, pack)
                kc_fn = getattr(kc, pack)

                def cpu_pack(x, e_in, e_out, payload, *a):
                    return cpu_fn(x, e_in, e_out, payload, starts, offs, *a)

                def kc_pack(x, e_in, e_out, payload, *a):
                    return kc_fn(x, e_in, e_out, payload, starts, offs, *a)

                _check_pack(np, cuda, what, cpu_pack, kc_pack, x, e,
                            [np.zeros(nbytes, np.uint8)], pargs, MODES_1BIT)
            # 3 senders, their payloads ``stride`` bytes apart (random bytes;
            # finite tails)
            rng = np.random.default_rng(5)
            stride = nbytes + 6
            payloads = rng.integers(0, 256, 3 * stride, dtype=np.uint8)
            if tag in ("fp16", "bf16"):
                stride = nbytes + 2
                h = rng.integers(0, 2**16, 3 * stride // 2, dtype=np.uint64).astype(np.uint16)
                payloads = (h & np.uint16(0xBBFF)).view(np.uint8)  # finite values
            else:  # the float32 tails: finite magnitudes
                for s_ in range(3):
                    for j, m in enumerate(SHARDS):
                        if not m:
                            continue
                        ncode = (m + 7) // 8 if tag == "1bit" else (m + 3) // 4
                        tail = s_ * stride + offs[j] + ncode
                        size = codec.payload_nbytes(m) - ncode
                        vals = rng.uniform(-2, 2, size // 4).astype("<f4")
                        payloads[tail:tail + size] = vals.view(np.uint8)
            for nsrc in (1, 3):
                def cpu_dec(p, out, *a):
                    getattr(cpu, unpack)(p, stride, nsrc, starts, offs, out, *a)

                def kc_dec(p, out, *a):
                    getattr(kc, unpack)(p, stride, nsrc, starts, offs, out, *a)

                _check_decode(np, cuda, f"{what} nsrc={nsrc}", cpu_dec, kc_dec, [payloads],
                              n, dtype, uargs)
    _check_shard_chunks(np, cuda, cpu, kc, cases)


def _check_shard_chunks(np, cuda, cpu, kc, cases):
    """More shards than one launch's ``gridDim.y`` takes (65535 on a GPU;
    ``MAX_GRID_Y`` lowered to 2 here, so the 5 shards of SHARDS take 3
    launches): the same bytes as the CPU, one launch per 2 shards."""
    from support import launch_contract
    old = kc.MAX_GRID_Y
    kc.MAX_GRID_Y = 2
    try:
        n = sum(SHARDS)
        for tag, codec, pack, pargs, unpack, uargs in cases:
            if pack is None or tag == "2bit_rel":  # (2bit_rel: as 1bit, slow here)
                continue
            starts, offs, nbytes = _shard_case(np, codec, SHARDS, "float32")
            x, e = _data(np, n, "float32", 29)
            cpu_fn, kc_fn = getattr(cpu, pack), getattr(kc, pack)
            want = np.zeros(nbytes, np.uint8)
            cpu_fn(x, e.copy(), None, want, starts, offs, *pargs)
            got = cuda.to_device(np.zeros(nbytes, np.uint8))
            before = launch_contract.counts().get(f"launch _{pack[:-7]}_kernel", 0)
            kc_fn(cuda.to_device(x), cuda.to_device(e), None, got, starts, offs, *pargs)
            launches = launch_contract.counts().get(f"launch _{pack[:-7]}_kernel", 0) - before
            # shards [37, 0], [5, 150], [1]: 3 launches
            assert launches == 3, f"chunks {tag}: {launches} launches, want 3"
            _same(np, f"chunks {tag} payload", got.copy_to_host(), want)
            stride = nbytes + 2
            pay = np.concatenate([want, np.zeros(2, np.uint8)] * 2)
            h = np.zeros(n, np.float32)
            getattr(cpu, unpack)(pay, stride, 2, starts, offs, h, *uargs, False)
            d = cuda.to_device(np.zeros(n, np.float32))
            getattr(kc, unpack)(cuda.to_device(pay), stride, 2, starts, offs, d, *uargs, False)
            _same(np, f"chunks {tag} decode", d.copy_to_host(), h)
    finally:
        kc.MAX_GRID_Y = old


def check_warp():
    """The simulator's warp intrinsics (Python, see kernels/cuda.py) behave as
    the hardware's for a full warp, and a lane that skips a full-warp
    operation is an error, not a hang."""
    np, cu, cpu, kc = _ctx()
    # the simulator gives a kernel its fake ``cuda`` through the kernel's
    # globals: the kernels below must find ``cuda`` there, not in a closure
    globals()["cuda"] = cu

    @cu.jit
    def k(out):
        lane = cuda.threadIdx.x % 32
        v = np.int64(lane * 10)
        out[cuda.threadIdx.x, 0] = kc._shfl_xor(v, 1)
        out[cuda.threadIdx.x, 1] = kc._shfl_down(v, 4)
        out[cuda.threadIdx.x, 2] = kc._shfl_idx(v, 3)
        out[cuda.threadIdx.x, 3] = kc._ballot(lane % 3 == 0)
        out[cuda.threadIdx.x, 4] = kc._brev(np.uint32(lane))

    out = cu.to_device(np.zeros((64, 5), np.int64))
    k[1, 64](out)
    got = out.copy_to_host()
    lane = np.arange(64) % 32
    assert (got[:, 0] == (lane ^ 1) * 10).all(), got[:, 0]
    assert (got[:, 1] == np.where(lane + 4 < 32, lane + 4, lane) * 10).all(), got[:, 1]
    assert (got[:, 2] == 30).all(), got[:, 2]
    assert (got[:, 3] == sum(1 << i for i in range(0, 32, 3))).all(), got[:, 3]
    rev = [int(f"{v:032b}"[::-1], 2) for v in lane]
    assert (got[:, 4] == rev).all(), got[:, 4]

    @cu.jit
    def divergent(out):
        if cuda.threadIdx.x % 32 != 5:
            out[cuda.threadIdx.x] = kc._shfl_xor(1, 1)

    old = kc._WARP_TIMEOUT
    try:
        # a shorter wait: the barrier is built per warp on first use
        kc._WARP_TIMEOUT = 2.0
        divergent[1, 32](cu.to_device(np.zeros(32, np.int64)))
    except Exception as exc:  # noqa: BLE001
        assert "not all 32 lanes" in str(exc), exc
    else:
        raise AssertionError("a divergent full-warp shuffle passed")
    finally:
        kc._WARP_TIMEOUT = old


def check_import():
    """Without the simulator: importing the module must not call cuInit (on a
    machine without a driver the import would then fail; on one with a GPU,
    the driver records the pid of a successful cuInit)."""
    assert not os.environ.get("NUMBA_ENABLE_CUDASIM")
    from mpigc.kernels import cuda as kc
    assert not kc.SIMULATOR
    from numba.cuda.cudadrv.driver import driver
    assert driver.pid is None, "cuInit was called at import"


def check_contract():
    """The launch contract fails on defects planted into real launches: the
    old absent residual (``None`` as the kernel argument) and a host array."""
    np, cuda, cpu, kc = _ctx()
    from support.launch_contract import LaunchContractError
    x = cuda.to_device(np.ones(16, np.float32))
    out = cuda.to_device(np.zeros(4, np.uint8))
    assert kc.pack_2bit(x, None, None, out, 0.5) == 0  # the real path passes
    opt = kc._opt
    kc._opt = lambda a, like: (a, a is not None)  # planted: None reaches the launch
    try:
        kc.pack_2bit(x, None, None, out, 0.5)
    except LaunchContractError as exc:
        print(f"planted None: {exc}")
        assert "_pack_2bit_kernel: argument 1: None" in str(exc), exc
    else:
        raise AssertionError("a None kernel argument passed the launch contract")
    finally:
        kc._opt = opt
    try:  # planted: a host array as the counter
        kc._launch(kc._count_nonfinite_kernel, 1, 0, x, np.zeros(1, np.int64))
    except LaunchContractError as exc:
        print(f"planted host array: {exc}")
        assert "argument 1: a host numpy array" in str(exc), exc
    else:
        raise AssertionError("a host array kernel argument passed the launch contract")

    def planted(what, expect, call):
        try:
            call()
        except LaunchContractError as exc:
            print(f"planted {what}: {exc}")
            assert expect in str(exc), exc
        else:
            raise AssertionError(f"{what} passed the launch contract")

    # a uint16 view at an odd byte of a payload
    pay = cuda.to_device(np.zeros(34, np.uint8))
    out16 = cuda.to_device(np.zeros(16, np.float32))
    kc.unpack_fp16(pay[2:34].view(np.uint16), out16, False)  # aligned: passes
    planted("misaligned array", "_unpack_fp16_kernel: argument 0: a uint16 array at address",
            lambda: kc.unpack_fp16(pay[1:33].view(np.uint16), out16, False))
    # 65536 one-value shards in one launch (gridDim.y > 65535): refused before it runs
    m = 65536
    big = cuda.to_device(np.ones(m, np.float32))
    bpay = cuda.to_device(np.zeros(m, np.uint8))
    old = kc.MAX_GRID_Y
    kc.MAX_GRID_Y = 10**9  # planted: no chunking
    try:
        planted("gridDim.y", "_pack_2bit_kernel: gridDim (1, 65536, 1)",
                lambda: kc.pack_2bit_shards(big, None, None, bpay, range(m + 1), range(m),
                                            0.5))
    finally:
        kc.MAX_GRID_Y = old
    # a block that is not whole warps
    threads = kc.THREADS
    kc.THREADS = 48
    try:
        planted("blockDim", "_pack_2bit_kernel: blockDim (48, 1, 1)",
                lambda: kc.pack_2bit(x, None, None, out, 0.5))
    finally:
        kc.THREADS = threads
    # Numba's stream 0 instead of the named legacy stream
    stream = kc._stream
    kc._stream = lambda s: s
    try:
        planted("stream 0", "_pack_2bit_kernel: stream 0", lambda: kc.pack_2bit(x, None, None,
                                                                             out, 0.5))
    finally:
        kc._stream = stream
    assert kc._stream(0) is kc.default_stream() is kc.default_stream()
    s = cuda.stream()
    assert kc._stream(s) is s
    assert kc.pack_2bit(x, None, None, out, 0.5, cuda_stream=s) == 0  # a caller's stream


def _engine_launches(np, cuda):
    """The engine's launches at one rank: every compressor and option the
    collectives take, float16/32/64 (recorded by the launch contract)."""
    import mpigc
    os.environ["MPIGC_MIN_COMPRESS_BYTES"] = "0"
    os.environ["MPIGC_CUDA_AWARE"] = "0"
    ops = [{"type": "2bit", "threshold": 0.5}, {"type": "2bit", "rel_threshold": 1.5,
                                                  "block_size": 8},
           {"type": "1bit", "block_size": 8}, {"type": "fp16", "error_feedback": True},
           {"type": "fp16"}, {"type": "bf16", "error_feedback": True}, {"type": "bf16"},
           {"type": "terngrad", "error_feedback": True},
           {"type": "terngrad", "clip": 2.0}, "none"]
    rng = np.random.default_rng(0)
    for op in ops:
        for dtype in (np.float16, np.float32, np.float64):
            for feedback in (None, False):
                def kw():
                    return dict(op=op, key="sig", average=True, feedback=mpigc.ErrorFeedback()
                                if feedback is None else False)
                for gather in ("compressed", "exact"):
                    g = rng.standard_normal(37).astype(dtype)
                    mpigc.allreduce(cuda.to_device(g), gather=gather, **kw())
                # reduce_scatter takes no gather: once (it ran once per gather before
                # 2026-11-29, the same 38 signatures recorded; 20.6 -> 16.8 CPU s)
                mpigc.reduce_scatter(cuda.to_device(g), **kw())
            g = rng.standard_normal(37).astype(dtype)
            g[3] = np.nan
            mpigc.allreduce(cuda.to_device(g), op=op, nonfinite="skip", feedback=False)


def _kernel_launches(np, cuda, kc):
    """Every public function of the kernel module, float32 and float64, with
    and without residuals; convert between every pair; divide."""
    n = 13
    for dt in (np.float32, np.float64):
        x = cuda.to_device(np.linspace(-1, 1, n).astype(dt))
        u8 = cuda.to_device(np.zeros(n, np.uint8))
        f4 = cuda.to_device(np.zeros(2 * n, np.float32))
        for e_in, e_out in ((None, None), (x, None), (None, x), (x, x)):
            kc.pack_2bit(x, e_in, e_out, u8[:4], 0.5)
            kc.pack_1bit(x, e_in, e_out, u8[:2], f4[:4], 8)
            kc.pack_2bit_rel(x, e_in, e_out, u8[:4], f4[:2], 1.5, 8)
            kc.pack_ternary(x, e_in, e_out, u8[:4], 1.0, 2.0, 7, 0)
            kc.pack_fp16(x, e_in, e_out, cuda.to_device(np.zeros(n, np.uint16)), 2.0)
            kc.pack_bf16(x, e_in, e_out, cuda.to_device(np.zeros(n, np.uint16)), 2.0)
            kc.stats(x, e_in)
        for acc in (False, True):
            kc.unpack_2bit(u8[:4], x, 0.5, acc)
            kc.unpack_1bit(u8[:2], f4[:4], x, 8, acc)
            kc.unpack_2bit_rel(u8[:4], f4[:2], x, 8, acc)
            kc.unpack_fp16(cuda.to_device(np.zeros(n, np.uint16)), x, acc)
            kc.unpack_bf16(cuda.to_device(np.zeros(n, np.uint16)), x, acc)
        kc.count_nonfinite(x)
        kc.divide(x, 3)
        # the one-launch functions of a call's shards (two shards)
        # (shards of 6 and 7 values, payloads 16 bytes apart, 2 senders 32 apart)
        starts, offs, pay = (0, 6, n), (0, 16), cuda.to_device(np.zeros(64, np.uint8))
        for e_in, e_out in ((None, None), (x, x)):
            kc.pack_2bit_shards(x, e_in, e_out, pay, starts, offs, 0.5)
            kc.pack_1bit_shards(x, e_in, e_out, pay, starts, offs, 8)
            kc.pack_2bit_rel_shards(x, e_in, e_out, pay, starts, offs, 1.5, 8)
            kc.pack_ternary_shards(x, e_in, e_out, pay, starts, offs, 1.0, 2.0, 7, 0)
        for acc in (False, True):
            kc.unpack_2bit_shards(pay, 32, 2, starts, offs, x, 0.5, acc)
            kc.unpack_1bit_shards(pay, 32, 2, starts, offs, x, 8, acc)
            kc.unpack_2bit_rel_shards(pay, 32, 2, starts, offs, x, 8, acc)
            kc.unpack_ternary_shards(pay, 32, 2, starts, offs, x, acc)
            h16 = cuda.to_device(np.zeros(2 * n + 4, np.uint8))
            kc.unpack_fp16_shards(h16, 2, 1, (0, n), (0,), x, acc)
            kc.unpack_bf16_shards(h16, 2, 1, (0, n), (0,), x, acc)
    # a grouped call's members to and from the fused buffer (2 members in 2
    # shards: 3 and 1 values), every dtype
    for dt in (np.float16, np.float32, np.float64):
        f = cuda.to_device(np.zeros(4, dt))
        mem = [cuda.to_device(np.ones(3, dt)), None, cuda.to_device(np.ones(1, dt))]
        for to_fused in (True, False):
            kc.group_copy(f, mem, (0, 3, 0, 0, 2, 4), 2, to_fused)
    for src in (np.float16, np.float32, np.float64):
        for dst in (np.float16, np.float32, np.float64):
            if (src == np.float16 and dst == np.float64) or (
                    dst == np.float16 and src == np.float64):
                continue  # not conversions the module offers
            kc.convert(cuda.to_device(np.ones(n, src)), cuda.to_device(np.zeros(n, dst)))


def check_signatures(path):
    """Record the argument types of every launch (engine and kernel module,
    under the launch contract) into ``path`` for :func:`check_ptx`."""
    np, cuda, cpu, kc = _ctx()
    from support import launch_contract
    _engine_launches(np, cuda)
    _kernel_launches(np, cuda, kc)
    launch_contract.dump(path)
    rec = launch_contract.recorded()
    print(f"recorded {sum(map(len, rec.values()))} signatures of {len(rec)} kernels")


def _module_kernels(kc):
    """Names of the kernels (not device functions) of the real CUDA module."""
    from numba.cuda.dispatcher import CUDADispatcher
    return {name for name, obj in vars(kc).items()
            if isinstance(obj, CUDADispatcher) and not obj.targetoptions.get("device")}


# ----------------------------------------------------------------------------
# non-finite input with the GPU's float min/max (group gpu_semantics)
# ----------------------------------------------------------------------------
# (tag, indices, values) planted into the input
_NAN, _INF = float("nan"), float("inf")
NONFINITE_CASES = [("nan", [3, 20], [_NAN, _NAN]), ("inf", [5, 30], [_INF, -_INF]),
                   ("mixed", [3, 5, 30], [_NAN, _INF, -_INF])]
NONFINITE_OPS = ["2bit", {"type": "2bit", "rel_threshold": 1.5, "block_size": 8},
                 {"type": "1bit", "block_size": 8}, "terngrad",
                 {"type": "terngrad", "clip": 2.5},
                 {"type": "terngrad", "error_feedback": True},
                 "fp16", {"type": "fp16", "error_feedback": True}, "bf16", "none"]
# (policy, gather, dtype): every policy; the values only where they are used
NONFINITE_RUNS = [("raise", "compressed", "float32"), ("skip", "compressed", "float32"),
                  ("ignore", "compressed", "float32"), ("ignore", "exact", "float32"),
                  ("ignore", "compressed", "float64")]


def check_gpu_semantics():
    """With the GPU's float ``min``/``max`` (a NaN operand gives the other
    one: ``simulator_fix.gpu_float_minmax``), every pack kernel on NaN and
    infinite input, and one allreduce per compressor, input and
    ``nonfinite`` policy (raise, skip, ignore; both gathers; float32 and
    float64) after a finite warm-up step, against the same on host arrays:
    the same error, the same result bits, the same residuals. Fails on a
    kernel that clips with ``min(max(v, -c), c)`` (terngrad before issue 29:
    a NaN became -c, then code 10, -scale, where the CPU gives 00)."""
    np, cuda, cpu, kc = _ctx()
    from support.simulator_fix import gpu_float_minmax
    restore = gpu_float_minmax(kc)
    try:
        _nonfinite_kernels(np, cuda, cpu, kc)
        _nonfinite_engine(np, cuda)
    finally:
        restore()


def _nonfinite_kernels(np, cuda, cpu, kc):
    n = 37
    one = [(True, "new")]
    for dtype in DTYPES:
        for tag, idx, vals in NONFINITE_CASES:
            x, e = _data(np, n, dtype, 41)
            x[idx] = vals
            what = f"gpu semantics {tag} {dtype}"
            v = (x + e).astype(np.float64)
            amax = float(np.abs(v[np.isfinite(v)]).max())
            z = lambda m, t: np.zeros(m, t)  # noqa: E731
            _check_pack(np, cuda, f"{what} 2bit", cpu.pack_2bit, kc.pack_2bit, x, e,
                        [z(10, np.uint8)], (0.5,), one)
            _check_pack(np, cuda, f"{what} 2bit_rel", cpu.pack_2bit_rel, kc.pack_2bit_rel, x,
                        e, [z(10, np.uint8), z(5, np.float32)], (1.5, 8), one)
            _check_pack(np, cuda, f"{what} 1bit", cpu.pack_1bit, kc.pack_1bit, x, e,
                        [z(5, np.uint8), z(10, np.float32)], (8,), one)
            stream = cpu.ternary_stream(7, 0, 1, 0)
            for clip in (np.inf, 0.5 * amax):
                _check_pack(np, cuda, f"{what} terngrad clip={clip:.3g}", cpu.pack_ternary,
                            kc.pack_ternary, x, e, [z(10, np.uint8)],
                            (np.float32(amax), clip, stream, 3), one)
            _check_pack(np, cuda, f"{what} fp16", cpu.pack_fp16, kc.pack_fp16, x, e,
                        [z(n, np.uint16)], (1.0,), one)
            _check_pack(np, cuda, f"{what} bf16", cpu.pack_bf16, kc.pack_bf16, x, e,
                        [z(n, np.uint16)], (1.0,), one)
            hs = cpu.stats(x, e)
            ds = kc.stats(cuda.to_device(x), cuda.to_device(e))
            assert ds[2:] == hs[2:], f"{what} stats: {ds}, want {hs}"
            assert kc.count_nonfinite(cuda.to_device(x)) == cpu.count_nonfinite(x), what


def _same_state(np, what, got, want):
    """Two ``ErrorFeedback.state_dict()`` values, arrays bit for bit."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), \
            f"{what}: keys {sorted(got)}, want {sorted(want)}"
        for k in want:
            _same_state(np, f"{what}[{k!r}]", got[k], want[k])
    elif isinstance(want, np.ndarray):
        _same(np, what, got, want)
    else:
        assert got == want, f"{what}: {got!r}, want {want!r}"


def _nonfinite_engine(np, cuda):
    import warnings

    import mpigc
    os.environ["MPIGC_MIN_COMPRESS_BYTES"] = "0"
    os.environ["MPIGC_CUDA_AWARE"] = "0"
    n = 37
    for op in NONFINITE_OPS:
        for tag, idx, vals in NONFINITE_CASES:
            for policy, gather, dtype in NONFINITE_RUNS:
                g, _ = _data(np, n, dtype, 43)
                g[idx] = vals
                what = f"allreduce {op} {tag} nonfinite={policy} gather={gather} {dtype}"
                got = {}
                for side, put, get in (("host", np.copy, np.asarray),
                                       ("device", cuda.to_device, lambda b: b.copy_to_host())):
                    fb = mpigc.ErrorFeedback()
                    kw = dict(op=op, key="k", feedback=fb, nonfinite=policy, gather=gather)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        mpigc.allreduce(put(np.linspace(-1.5, 1.5, n).astype(dtype)), **kw)
                        buf = put(g)
                        try:
                            mpigc.allreduce(buf, **kw)
                            err = None
                        except mpigc.MpigcError as exc:
                            err = type(exc).__name__
                    got[side] = (err, get(buf), fb.state_dict())
                (he, hr, hs), (de, dr, ds) = got["host"], got["device"]
                assert he == de, f"{what}: the host call raised {he}, the device call {de}"
                _same(np, f"{what} result", dr, hr)
                _same_state(np, f"{what} state", ds, hs)


# ----------------------------------------------------------------------------
# the device statistics' summation order (group stats_order)
# ----------------------------------------------------------------------------
def check_stats_order():
    """``kernels.cuda.stats`` in the simulator, at grid caps of 1, 2, 3 and 5
    blocks (what the SM count sets on a GPU) and 64 threads, equals the
    numpy model of ``tests/support/device_order.py`` bit for bit: sum and sum of
    squares (whose order depends on the cap), maximum and non-finite count."""
    np, cuda, cpu, kc = _ctx()
    from support import device_order
    cap = kc._max_blocks
    try:
        for blocks in (1, 2, 3, 5):
            kc._max_blocks = lambda: blocks
            for dtype in DTYPES:
                for n in (1, 100, 1027, 3000):
                    x, e = _data(np, n, dtype, 13 * n + blocks, scale=1e3)
                    if n == 100:
                        x[7] = np.nan
                    for e_in in (None, e):
                        want = device_order.stats_model(x, e_in, max_blocks=blocks,
                                                        threads=kc.THREADS)
                        got = kc.stats(cuda.to_device(x),
                                       None if e_in is None else cuda.to_device(e_in))
                        what = f"stats blocks={blocks} {dtype} n={n} e_in={e_in is not None}"
                        assert got[2:] == want[2:], f"{what}: {got}, model {want}"
                        _same(np, what, np.array(got[:2]), np.array(want[:2]))
    finally:
        kc._max_blocks = cap


# ----------------------------------------------------------------------------
# what NVVM and ptxas make of the kernels (no GPU needed)
# ----------------------------------------------------------------------------
#: PTX that breaks the bit-identity with the CPU kernels, and why
BANNED_PTX = [
    (r"\bfma\.", "a fused multiply-add (the CPU rounds the product and the sum)"),
    (r"\.ftz\b", "flush-to-zero"),
    (r"\.approx\b", "approximate arithmetic"),
    (r"\bdiv\.full\b", "approximate division (div.full)"),
    (r"\b(?:max|min)(?:\.[a-z0-9]+)*\.(?:f16|f16x2|bf16|bf16x2|f32|f64)\b",
     "a float min/max (fmin/fmax return the non-NaN operand; the CPU keeps NaN)"),
]
MAX_REGISTERS = 64
REGISTERS = {}  # kernel signature (arch) -> registers, as ptxas -v reported them
#: kernels whose products must all be explicit mul.rn (no plain mul.f32/f64)
EXACT_KERNELS = {"_pack_fp16_kernel_f32", "_pack_fp16_kernel_f64", "_pack_bf16_kernel_f32",
                 "_pack_bf16_kernel_f64", "_stats_kernel", "_stats_combine_kernel",
                 "_pack_2bit_rel_kernel"}


def ptxas_path():
    """ptxas of the ``nvidia-cuda-nvcc-cu12`` wheel (``numba-cuda[cu12]``
    installs it), else the one on PATH, else None."""
    import shutil
    for base in sys.path:
        for sub in (("nvidia", "cuda_nvcc", "bin"), ("nvidia", "cu13", "bin")):
            p = os.path.join(base or ".", *sub, "ptxas")
            if os.path.isfile(p) and os.access(p, os.X_OK):
                return p
    return shutil.which("ptxas")


def kernel_code_problems(what, ptx, ptxas=None, workdir=None, exact=False,
                         archs=("sm_90",)):
    """The problems (strings) of one compiled kernel: banned PTX
    (:data:`BANNED_PTX`; with ``exact``, any plain ``mul.f32``/``mul.f64``);
    with ``ptxas``, for each of ``archs`` (the PTX's ``.target`` set to it:
    numba-cuda builds ``sm_90a`` on an H100): a cubin that differs from
    ``ptxas --fmad=false``'s (ptxas contracted a product and a sum into an
    FFMA), a stack frame, spills, or more than :data:`MAX_REGISTERS`
    registers (``ptxas -v``)."""
    import hashlib
    import re
    problems = []
    lines = ptx.splitlines()
    for pat, why in BANNED_PTX + ([(r"\bmul\.f(?:32|64)\b", "a plain product, which "
                                     "ptxas may contract (use _fmul_rn / _dmul_rn)")]
                                  if exact else []):
        hit = next((ln.strip() for ln in lines if re.search(pat, ln)), None)
        if hit is not None:
            problems.append(f"{what}: {why}: `{hit}`")
    if ptxas is None:
        return problems
    for arch in archs:
        tag = hashlib.sha1(f"{what}\n{arch}\n{ptx}".encode()).hexdigest()[:16]
        src = os.path.join(workdir, f"{tag}.ptx")
        with open(src, "w") as f:
            f.write(re.sub(r"^\.target sm_\w+", f".target {arch}", ptx, count=1,
                           flags=re.M))

        def assemble(*flags):
            out = os.path.join(workdir, f"{tag}{'-'.join(('',) + flags)}.cubin")
            r = subprocess.run([ptxas, f"-arch={arch}", *flags, "-o", out, src],
                               capture_output=True, text=True)
            if r.returncode:
                raise AssertionError(f"{what}: ptxas {arch} {' '.join(flags)} failed:\n"
                                     f"{r.stderr}")
            with open(out, "rb") as f:
                return f.read(), r.stdout + r.stderr

        fused, log = assemble("-v")
        unfused, _ = assemble("--fmad=false")
        at = f"{what} ({arch})"
        if fused != unfused:
            problems.append(f"{at}: ptxas contracts a product and a sum into an FFMA (the "
                            "cubin differs from --fmad=false's): write the product with "
                            "_fmul_rn / _dmul_rn")
        frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) "
                            r"bytes spill loads", log)
        regs = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
        if not frames or not regs:
            problems.append(f"{at}: no resource usage in ptxas -v:\n{log}")
        for stack, stores, loads in frames:
            if int(stack) or int(stores) or int(loads):
                problems.append(f"{at}: {stack} bytes stack frame, {stores} bytes spill "
                                f"stores, {loads} bytes spill loads (expected none)")
        if regs:
            REGISTERS[at] = max(regs)
        if regs and max(regs) > MAX_REGISTERS:
            problems.append(f"{at}: {max(regs)} registers (at most {MAX_REGISTERS})")
    return problems


def _numba_cuda_version():
    from importlib import metadata
    try:  # the kernels target the numba-cuda package, not Numba's older built-in target
        return metadata.version("numba-cuda")
    except metadata.PackageNotFoundError:
        print("numba-cuda is not installed (only Numba's built-in CUDA target): "
              "pip install 'numba-cuda[cu12]' (the test extra does) to run this check")
        sys.exit(_SKIP)


def _device_cc_90():
    """Device functions ask the current device for its compute capability:
    9.0 here, without a GPU."""
    import numba.cuda.dispatcher as dispatcher

    class _Device:
        compute_capability = (9, 0)

    dispatcher.get_current_device = lambda: _Device()


def check_ptx(path):
    import concurrent.futures
    import tempfile
    import re
    import time
    version = _numba_cuda_version()
    _device_cc_90()
    from numba import cuda

    from support import launch_contract
    from mpigc.kernels import cuda as kc
    sigs = launch_contract.load(path)
    missing = _module_kernels(kc) - set(sigs)
    assert not missing, f"kernels never launched in the signature run: {sorted(missing)}"
    unknown = set(sigs) - _module_kernels(kc)
    assert not unknown, f"launched objects that are not kernels: {sorted(unknown)}"
    ptxas = ptxas_path()
    if ptxas is None:
        print("no ptxas (pip install 'numba-cuda[cu12]' brings nvidia-cuda-nvcc-cu12): "
              "the ptxas checks do not run")
    t0 = time.perf_counter()
    nvvm = 0.0
    from mpigc.kernels import _driver
    problems_early = []
    with tempfile.TemporaryDirectory() as work, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        jobs = []
        for name in sorted(sigs):
            fn = getattr(kc, name)
            for sig in sigs[name]:
                what = f"{name}{sig}"
                t = time.perf_counter()
                try:
                    # with the kernel's launch_bounds (.maxntid), as it is launched
                    ptx, _ = cuda.compile_ptx(
                        fn.py_func, sig, cc=(9, 0),
                        launch_bounds=fn.targetoptions.get("launch_bounds"))
                except Exception as exc:
                    raise AssertionError(f"{what} does not compile for sm_90 with numba-cuda "
                                         f"{version}: {type(exc).__name__}: {exc}") from exc
                nvvm += time.perf_counter() - t
                # the driver's route (mpigc.kernels._driver) packs this
                # signature's parameters: the block must be the PTX's
                entry = re.search(r"\.entry\s+(\S+)\s*\(", ptx).group(1)
                codes = _driver.param_codes(sig)
                if not _driver.layout_matches(codes, _driver.ptx_params(ptx, entry)):
                    problems_early.append(
                        f"{what}: the driver's parameter block {codes} does not match the "
                        f"PTX's .param list {_driver.ptx_params(ptx, entry)}")
                # ptxas runs beside the next NVVM compile
                jobs.append(pool.submit(kernel_code_problems, what, ptx, ptxas, work,
                                        name in EXACT_KERNELS, ("sm_90", "sm_90a")))
        problems = problems_early + [p for j in jobs for p in j.result()]
    for at in sorted(REGISTERS):  # Array(float32, 1, 'C', False, aligned=True) as f32[:]
        short = re.sub(r"Array\((\w)\w*?(\d+), 1, 'C', False, aligned=True\)", r"\1\2[:]", at)
        print(f"{REGISTERS[at]:3d} registers  {short}")
    assert not problems, "\n".join(problems)
    print(f"compiled {len(jobs)} signatures of {len(sigs)} kernels to PTX for sm_90 "
          f"(numba-cuda {version}; NVVM {nvvm:.1f} s, all {time.perf_counter() - t0:.1f} s)"
          + (f", assembled by {ptxas} for sm_90 and sm_90a: cubins as with --fmad=false, "
             f"no stack, no spills, at most {MAX_REGISTERS} registers" if ptxas else ""))


# kernels with one defect each, for check_planted_ptx: (name, argument types,
# compile options, the problem expected); PRESSURE holds 48 float64 values
# live at once (sums, no products: only the register count is wrong)
_PRESSURE = 48
PLANTED_SOURCE = "\n".join(
    ["def pressure(x, out):", "    i = cuda.grid(1)", f"    if i + {_PRESSURE} <= x.size:"]
    + [f"        a{k} = x[i + {k}]" for k in range(_PRESSURE)]
    + ["        out[i] = " + " + ".join(f"(a{k} - a{(7 * k + 3) % _PRESSURE})"
                                        for k in range(_PRESSURE))]) + '''

def plain_product(x, y, out):  # a plain * feeding a -: FFMA after ptxas
    i = cuda.grid(1)
    if i < x.size:
        out[i] = x[i] - y[i] * out[i]

def multiply_add(x, y, out):  # NVVM contracts this one itself: fma.rn.f32
    i = cuda.grid(1)
    if i < x.size:
        out[i] = x[i] * y[i] + out[i]

def fast_divide(x, y, out):  # libdevice's fast division: div.approx.f32
    i = cuda.grid(1)
    if i < x.size:
        out[i] = libdevice.fast_fdividef(x[i], y[i])

def float_max(x, y, out):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = max(x[i], y[i])

def fast_division(x, y, out):  # compiled with fastmath
    i = cuda.grid(1)
    if i < x.size:
        out[i] = x[i] / y[i]

def product(x, y, out):  # checked as a kernel that must have no plain product
    i = cuda.grid(1)
    if i < x.size:
        out[i] = x[i] * y[i]

def stack(x, out):  # a local array indexed at run time lives in local memory
    i = cuda.grid(1)
    a = cuda.local.array(64, np.float64)
    for k in range(64):
        a[k] = x[(i + k) % x.size]
    if i < out.size:
        out[i] = a[i % 64]

def clean(x, y, out):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = x[i] + y[i]
'''


def check_planted_ptx():
    """Each check of :func:`kernel_code_problems` on a kernel with that defect
    planted, compiled as :func:`check_ptx` compiles the module's kernels."""
    _numba_cuda_version()
    _device_cc_90()
    import tempfile

    import numpy as np
    from numba import cuda, types
    from numba.cuda import libdevice
    ptxas = ptxas_path()
    if ptxas is None:
        print("no ptxas (pip install 'numba-cuda[cu12]' brings nvidia-cuda-nvcc-cu12)")
        sys.exit(_SKIP)
    ns = {"cuda": cuda, "np": np, "libdevice": libdevice}
    exec(compile(PLANTED_SOURCE, "<planted kernels>", "exec"), ns)
    f32, f64 = types.float32[::1], types.float64[::1]
    cases = [
        ("plain_product", (f32, f32, f32), {}, False, "into an FFMA"),
        ("multiply_add", (f32, f32, f32), {}, False, "a fused multiply-add"),
        ("fast_divide", (f32, f32, f32), {}, False, "approximate arithmetic"),
        ("float_max", (f32, f32, f32), {}, False, "a float min/max"),
        ("fast_division", (f32, f32, f32), {"fastmath": True}, False, "approximate"),
        ("fast_division", (f32, f32, f32), {"fastmath": True}, False, "flush-to-zero"),
        ("product", (f32, f32, f32), {}, True, "a plain product"),
        ("stack", (f64, f64), {}, False, "bytes stack frame"),
        ("pressure", (f64, f64), {}, False, "registers (at most 64)"),
        ("clean", (f32, f32, f32), {}, False, None),
    ]
    with tempfile.TemporaryDirectory() as work:
        for name, sig, opts, exact, expect in cases:
            ptx, _ = cuda.compile_ptx(ns[name], sig, cc=(9, 0), **opts)
            problems = kernel_code_problems(name, ptx, ptxas, work, exact)
            print(f"planted {name}: {problems}")
            if expect is None:
                assert not problems, problems
            else:
                assert any(expect in p for p in problems), (name, expect, problems)
                if name in ("plain_product", "multiply_add", "fast_divide", "stack",
                            "pressure"):  # that defect alone
                    assert len(problems) == 1, problems
    # (no kernel of Numba's gives div.full; the pattern, on a line of PTX)
    problems = kernel_code_problems("div_full", "\tdiv.full.f32 \t%f3, %f2, %f1;")
    assert len(problems) == 1 and "approximate division" in problems[0], problems


def _no_gpu_compile():
    """numba-cuda's own compile path (``CUDADispatcher.compile``: disk cache,
    NVVM, link by nvJitLink, save) without a GPU: what asks the device is
    answered with compute capability 9.0 (``sm_90a``, as on an H100), and
    binding the kernel to a context stops at its cubin (there is no context
    to load it into)."""
    from numba.cuda import codegen, dispatcher
    from numba.cuda.cudadrv import runtime
    _device_cc_90()
    codegen.JITCUDACodegen.magic_tuple = lambda self: (runtime.runtime.get_version(), (9, 0))
    codegen.CUDACodeLibrary._ensure_cc = lambda self, cc: (9, 0, "a") if cc is None else cc
    dispatcher._Kernel.bind = lambda self: self._codelibrary.get_cubin()


def check_cache(path):
    """Compile the signatures of ``path`` (a :func:`launch_contract.dump`
    file) through the disk cache (:func:`_no_gpu_compile`); print, as the
    last JSON line, the cache hits, misses and the seconds it took."""
    import json
    import time
    _numba_cuda_version()
    _no_gpu_compile()
    from support import launch_contract
    from mpigc.kernels import cuda as kc
    assert kc._CACHE, "the CUDA kernels are not cached (MPIGC_CACHE_DIR=off?)"
    sigs = launch_contract.load(path)
    t = time.perf_counter()
    for name in sorted(sigs):
        for sig in sigs[name]:
            getattr(kc, name).compile(sig)
    seconds = time.perf_counter() - t
    hits = sum(sum(getattr(kc, k)._cache_hits.values()) for k in sigs)
    misses = sum(sum(getattr(kc, k)._cache_misses.values()) for k in sigs)
    print(json.dumps({"hits": hits, "misses": misses, "seconds": seconds}))


_NO_SIMULATOR = ("import", "ptx", "planted_ptx", "cache")

def _main(group, *args):
    if group not in _NO_SIMULATOR:
        from support.simulator_fix import fix_simulator_shared_arrays, gpu_float_minmax
        if not fix_simulator_shared_arrays():  # and the launching thread yields
            print("note: numba-cuda's simulator BlockManager.run is not the one "
                  "yield_while_polling copies: left as it is (slower, the same checks)")
        from support import launch_contract
        from mpigc.kernels import cuda as kc
        launch_contract.install(kc)  # every simulated launch is checked
        if os.environ.get("MPIGC_SIM_GPU_SEMANTICS", "0").strip() not in ("", "0"):
            gpu_float_minmax(kc)
    {"import": check_import, "ptx": check_ptx, "contract": check_contract,
     "signatures": check_signatures, "planted_ptx": check_planted_ptx, "cache": check_cache,
     **{g: globals()["check_" + g] for g in SIM_GROUPS}}[group](*args)
    print(f"ok {group}")


if __name__ == "__main__":
    _main(*sys.argv[1:])
