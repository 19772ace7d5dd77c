"""A function of ``mpigc.kernels.cuda`` asks for the current GPU at most once
(issue 49): the id keys its pools and caches (layouts, counters, scratch, the
grid cap), and on a GPU each ask is a driver call (``cuCtxGetDevice``) that
a GPU profile counted about 18 times per allreduce. The function asks once
and passes it to its helpers; nothing keeps it past the function's return
(the caller may make another GPU current between two calls).

Counted in Numba's CUDA simulator (a subprocess: ``NUMBA_ENABLE_CUDASIM`` is
read when ``numba.cuda`` is first imported), where ``kernels.cuda._device_id``
is wrapped; on a GPU the same function is the one that calls the driver."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("numba")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _asks():
    """``{kernel function: times it asked for the GPU}`` of one call each."""
    import numpy as np
    from numba import cuda

    from mpigc.kernels import cuda as kc
    assert kc.SIMULATOR, "NUMBA_ENABLE_CUDASIM=1 was not in effect"
    asked = []
    device_id = kc._device_id

    def counted():
        asked.append(1)
        return device_id()
    kc._device_id = counted
    n, m = 256, 2  # two shards
    x = cuda.to_device(np.linspace(-1, 1, n).astype(np.float32))
    e_in = cuda.to_device(np.full(n, 0.01, np.float32))
    e_out = cuda.device_array(n, np.float32)
    out = cuda.device_array(n, np.float32)
    starts, offs = (0, n // 2, n), (0, 256)
    payload = cuda.to_device(np.zeros(512, np.uint8))
    half = cuda.device_array(n, np.uint16)
    calls = {
        "pack_2bit_shards": lambda: kc.pack_2bit_shards(x, e_in, e_out, payload, starts,
                                                        offs, 0.5),
        "unpack_2bit_shards": lambda: kc.unpack_2bit_shards(payload, 0, 1, starts, offs,
                                                            out, 0.5, False),
        "pack_1bit_shards": lambda: kc.pack_1bit_shards(x, e_in, e_out, payload, starts,
                                                        offs, 64),
        "unpack_1bit_shards": lambda: kc.unpack_1bit_shards(payload, 0, 1, starts, offs,
                                                            out, 64, False),
        "pack_2bit_rel_shards": lambda: kc.pack_2bit_rel_shards(
            x, e_in, e_out, payload, starts, offs, 1.5, 16),
        "unpack_2bit_rel_shards": lambda: kc.unpack_2bit_rel_shards(
            payload, 0, 1, starts, offs, out, 16, True),
        "pack_ternary_shards": lambda: kc.pack_ternary_shards(
            x, e_in, e_out, payload, starts, offs, 1.0, 2.5, 7, 0),
        "unpack_ternary_shards": lambda: kc.unpack_ternary_shards(payload, 0, 1, starts,
                                                                  offs, out, False),
        "stats": lambda: kc.stats(x, e_in),
        "count_nonfinite": lambda: kc.count_nonfinite(x),
        "pack_fp16": lambda: kc.pack_fp16(x, e_in, e_out, half, 2.0),
        "convert": lambda: kc.convert(x, out),
        "divide": lambda: kc.divide(out, 2.0),
        "group_copy": lambda: kc.group_copy(out, [x[:100], x[100:]], (0, 50, 100, 178),
                                            m, True),
    }
    got = {}
    for name, call in calls.items():
        call()  # the first call of a signature (compiles; fills the caches)
        del asked[:]
        call()
        got[name] = len(asked)
    return got


def _call_asks():
    """``{what: asks}`` of ``mpigc._cuda.current_device_id``: per 2bit device
    allreduce (one rank, both gathers, after the first call of each), those
    of them from the residual store's spares and entries, and those of one
    call's transaction through the store's API given the call's GPU."""
    import traceback
    import warnings

    import numpy as np
    from numba import cuda

    import mpigc
    from mpigc import _cuda
    from mpigc.compressors import get_compressor
    assert _cuda.simulator(), "NUMBA_ENABLE_CUDASIM=1 was not in effect"
    os.environ["MPIGC_MIN_COMPRESS_BYTES"] = "0"
    warnings.simplefilter("ignore")  # the staging warning, the simulator's
    asked = []
    device_id = _cuda.current_device_id

    def counted():
        asked.append(traceback.extract_stack(limit=2)[0].filename)  # the asker
        return device_id()
    _cuda.current_device_id = counted
    fb = mpigc.ErrorFeedback()
    g = np.linspace(-1, 1, 256).astype(np.float32)
    got = {}
    for gather in ("compressed", "exact"):
        for _ in range(2):  # the second: the spares are there, nothing new
            del asked[:]
            mpigc.allreduce(cuda.to_device(g), "2bit", key=gather, feedback=fb,
                            gather=gather)
        got[gather] = len(asked)
        got[gather + " store"] = sum(os.path.basename(f) in (
            "_residual_entry.py", "_residual_txn.py") for f in asked)
    del asked[:]
    t = fb.begin("api", 8, np.float32, 2, 0, device=True, device_id=0)
    t.take_scratch()
    t.commit(get_compressor("2bit").get_config())
    t.set_owner(t.take_owner_scratch(4, np.float32))
    t.take_owner_scratch(4, np.float32)
    t.end()
    t = fb.begin("api", 8, np.float32, 2, 0, device=True, device_id=0)
    t.take_scratch()
    t.commit(get_compressor("2bit").get_config())
    t.end()
    got["api"] = len(asked)
    return got


def test_a_device_call_asks_for_the_gpu_once_not_at_each_spare():
    """The residual store's device spares are keyed by the call's GPU: the
    id the call's backend took when it adopted the buffer goes down to the
    store's transaction (``begin(..., device_id=)``), which hands it to
    every take and give; before, each take and give asked the driver (4 asks
    per 2bit call on a GPU: worker and owner scratch taken, the replaced ones
    given back; 5 in all per call, 3 with gather="exact"). Now: the adopt's
    ask alone (the engine passes the backend's id; :meth:`ErrorFeedback.acquire`
    would ask once if its caller gave none), none from the store."""
    got = _run("calls")
    assert got["api"] == 0, got
    assert got["compressed store"] == 0 and got["exact store"] == 0, got
    assert got["compressed"] == 1 and got["exact"] == 1, got


def _run(what=""):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, os.path.abspath(__file__)] + ([what] if what else []),
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_kernel_function_asks_for_the_gpu_at_most_once():
    got = _run()
    assert len(got) == 14, got
    more = {k: v for k, v in got.items() if v > 1}
    assert not more, f"asked the GPU more than once per call: {more}"


if __name__ == "__main__":
    print(json.dumps(_call_asks() if sys.argv[1:] == ["calls"] else _asks()))
