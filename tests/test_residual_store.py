"""The residual store with device residuals, in Numba's CUDA simulator, in a
subprocess (``NUMBA_ENABLE_CUDASIM=1``; this pytest session never imports
the simulator), without MPI: a key's device residuals through the store's
API as a call leaves them (a transaction's scratch, commit, owner), then
everything that copies them to the host or on the device (state_dict, a
checkpoint save's hold_all, a record by copy and its restore, one by
reference, a load placed by the next device call, a device group's fused
residuals read back per member). 9fa6c9b's ``copy_tohost`` typo (every host
copy of a device residual raised AttributeError) went through the plain
suite; this file fails on it. A few seconds."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("numba")

SCRIPT = r'''
import numpy as np
from mpigc import _cuda, _dispatch, _group
from mpigc.compressors import get_compressor
from mpigc.feedback import ErrorFeedback

cfg = get_compressor("2bit").get_config()
fb = ErrorFeedback()
n, f32 = 8, np.float32


def call(key, worker, owner=None, **kw):
    t = fb.begin(key, n, f32, 2, 0, device=True)
    s = t.take_scratch()
    assert _dispatch.is_device_array(s)
    _cuda.copy(s, np.asarray(worker, f32))
    t.commit(cfg, **kw)
    if owner is not None:
        o = t.take_owner_scratch(4, f32)
        _cuda.copy(o, np.asarray(owner, f32))
        t.set_owner(o)
    t.count_call()
    t.end()


call("w", np.arange(n), owner=[5] * 4)
st = fb.state_dict()["w"]
assert type(st["worker"]) is np.ndarray and type(st["owner"]) is np.ndarray
assert st["worker"].tolist() == list(range(n)) and st["owner"].tolist() == [5] * 4, st
assert st["calls"] == 1
txn = fb.transaction()  # a checkpoint's save
held = txn.hold_all()
assert type(held["w"].worker) is np.ndarray and held["w"].worker.tolist() == list(range(n))
txn.end()
# by copy, on the device; a call; restored into the entry's device arrays
rec = fb.transaction()
rec.copy("w")
assert _dispatch.is_device_array(rec.saved["w"].worker)
call("w", np.full(n, 9), owner=[7] * 4)
assert fb.state_dict()["w"]["worker"].tolist() == [9] * n
rec.restore()
st = fb.state_dict()["w"]
assert st["worker"].tolist() == list(range(n)) and st["owner"].tolist() == [5] * 4, st
assert _dispatch.is_device_array(fb.entry("w").worker)
# by reference (a hierarchical call's sub-calls keep what they replace)
ref = fb.transaction()
ref.keep("w")
call("w", np.full(n, 3), keep_replaced=True)
ref.restore()
assert fb.state_dict()["w"]["worker"].tolist() == list(range(n))
# loaded: host arrays, moved to the device by the key's next device call
fb.load_state_dict({"w": st})
t = fb.begin("w", n, f32, 2, 0, device=True)
assert _dispatch.is_device_array(t.worker())
assert t.worker().copy_to_host().tolist() == list(range(n))
t.end()
# a device group's fused residuals, each member's read back
sizes = (3, 5)
lay = _group._layout(sizes, 2, False)
g = fb.begin_group(["a", "b"], sizes, lay.place, lay.owner[0], lay.counts[0], f32, 2, 0,
                   device=True)
_cuda.copy(g.take_scratch(), np.arange(8, dtype=f32))
g.commit(cfg)
g.count_call()
g.end()
st = fb.state_dict()
exp = {"a": [0.0] * 3, "b": [0.0] * 5}
for i, lo, hi, at in lay.place[0]:
    exp["ab"[i]][lo:hi] = list(range(at, at + hi - lo))
assert {k: st[k]["worker"].tolist() for k in "ab"} == exp, (st, exp)
print("ok residual store on the device")
'''


def test_device_residuals_copy_to_the_host_and_back():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    env.pop("MPIGC_DEVICE", None)
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "ok residual store on the device" in r.stdout, \
        f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
