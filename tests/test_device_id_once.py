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


def test_a_kernel_function_asks_for_the_gpu_at_most_once():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(got) == 14, got
    more = {k: v for k, v in got.items() if v > 1}
    assert not more, f"asked the GPU more than once per call: {more}"


if __name__ == "__main__":
    print(json.dumps(_asks()))
