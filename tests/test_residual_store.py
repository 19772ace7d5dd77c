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
# a state whose residuals are foreign device arrays (CuPy, a CUDA torch
# tensor: only __cuda_array_interface__), read through the interface
import sys, os
sys.path.insert(0, os.environ["MPIGC_TESTS_DIR"])
from support.foreign_arrays import TorchLikeTensor as Foreign

fb.load_state_dict({"w": dict(st, worker=Foreign(_cuda.to_device(np.arange(n, dtype=f32))),
                              owner=Foreign(_cuda.to_device(np.full(4, 5, f32))))})
assert fb.state_dict()["w"]["worker"].tolist() == list(range(n))
assert fb.state_dict()["w"]["owner"].tolist() == [5] * 4
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

# two simulated GPUs in one process (the simulator has one): which is current
# is what tells them apart (as tests/mpi/test_gpu_path_mpi.py's devices group)
TWO_DEVICES = r'''
import numpy as np
from numba import cuda
from numba.cuda.simulator.cudadrv import devices as simulated
from mpigc import _cuda
from mpigc.compressors import get_compressor
from mpigc.feedback import ErrorFeedback

contexts = (simulated.FakeCUDAContext(0), simulated.FakeCUDAContext(1))
now = [0]
cuda.current_context = lambda devnum=None: contexts[now[0] if devnum is None else devnum]


def select_device(dev):
    assert dev in (0, 1), dev
    now[0] = dev
    return contexts[dev].device


cuda.select_device = select_device
cfg = get_compressor("2bit").get_config()
fb = ErrorFeedback()


def call(key, dev):
    now[0] = dev
    assert _cuda.current_device_id() == dev
    t = fb.begin(key, 8, np.float32, 1, 0, device=True)
    s = t.take_scratch()
    t.commit(cfg)
    t.end()
    return s


first = call("on1", 1)
call("on1", 1)  # the first call's worker is a spare now, of GPU 1
assert call("on0", 0) is not first, "GPU 1's spare served a call on GPU 0"
assert call("again1", 1) is first  # a call on its own GPU takes it
print("ok spares per GPU")
'''

# a key's device residuals are refused to a call on another GPU
OTHER_GPU = TWO_DEVICES.replace('print("ok spares per GPU")', r'''
from mpigc import StateError, _group
import pytest
with pytest.raises(StateError, match="holds residuals on GPU 1; this call's buffer is on GPU 0"):
    call("on1", 0)
assert fb.entry("on1").gpu == 1 and fb.state_dict()["on1"]["calls"] == 0
call("on1", 1)  # not left in use; its own GPU's calls go on
with pytest.raises(StateError, match="on GPU 0"):  # the backend's id, given
    fb.begin("on1", 8, np.float32, 1, 0, device=True, device_id=0)
now[0] = 0
sizes = (3, 8)
lay = _group._layout(sizes, 1, False)
with pytest.raises(StateError, match="GPU 1"):  # a group with a member of GPU 1
    fb.begin_group(["g0", "on1"], sizes, lay.place, lay.owner[0], lay.counts[0],
                   np.float32, 1, 0, device=True)
fb.begin("g0", 3, np.float32, 1, 0, device=True).end()  # the group's keys released
# moved through a state: placed on the next call's GPU
st = fb.state_dict()
fb.load_state_dict(st)
s = call("on1", 0)
assert fb.entry("on1").gpu == 0
with pytest.raises(StateError, match="on GPU 0; this call's buffer is on GPU 1"):
    call("on1", 1)
# a key that holds nothing (reset residuals) may change GPUs
fb.reset("on1")
call("on1", 1)
print("ok one GPU per key")''')

# a key's device residuals copied or moved outside a call (a state, a
# checkpoint's save, a record by copy and its restore, a fused group's
# eviction) from a thread whose current GPU is another: every allocation,
# copy and launch runs on the key's GPU, and the thread's GPU is current again
OUTSIDE = TWO_DEVICES.replace('print("ok spares per GPU")', r'''
from mpigc import _group
from mpigc.kernels import cuda as kc
log = []


def logged(module, name):
    f = getattr(module, name)

    def recorded(*args, **kw):
        log.append((now[0], name))
        return f(*args, **kw)
    setattr(module, name, recorded)


fb = ErrorFeedback()  # its keys on GPU 1 only
logged(kc, "_launch")
for name in ("copy", "to_host", "to_device", "empty", "zeros"):
    logged(_cuda, name)


def on(dev, what, f):
    """f() with device 0 current: its copies and launches ran on ``dev``."""
    now[0] = 0
    del log[:]
    r = f()
    assert log, f"{what}: nothing copied"
    wrong = [x for x in log if x[0] != dev]
    assert not wrong, f"{what}: {len(wrong)} of {len(log)} on another GPU: {log}"
    assert now[0] == 0, f"{what}: device {now[0]} left current"
    return r


sizes = (3, 5)
lay = _group._layout(sizes, 1, False)


def group_call(value):
    now[0] = 1
    g = fb.begin_group(["a", "b"], sizes, lay.place, lay.owner[0], lay.counts[0],
                       np.float32, 1, 0, device=True)
    _cuda.copy(g.take_scratch(), np.full(8, value, np.float32))
    g.commit(cfg)
    g.count_call()
    g.end()


group_call(1)  # kept fused, on GPU 1
st = on(1, "state_dict of fused members", fb.state_dict)  # evicts, copies to the host
assert st["a"]["worker"].tolist() == [1] * 3 and st["b"]["worker"].tolist() == [1] * 5, st
group_call(2)
held = on(1, "a checkpoint's hold_all", lambda: fb.transaction().hold_all())
assert held["b"].worker.tolist() == [2] * 5
for k in "ab":
    fb.release(k)
group_call(3)
rec = fb.transaction()
on(1, "a record by copy", lambda: rec.copy("a"))
group_call(4)
on(1, "its restore", rec.restore)
assert fb.state_dict()["a"]["worker"].tolist() == [3] * 3
# a single call on a fused member (its GPU current): evicted there, with no ask
group_call(5)
asked = []
ask = _cuda.current_device_id
_cuda.current_device_id = lambda: asked.append(1) or ask()
now[0] = 1
fb.begin("a", 3, np.float32, 1, 0, device=True, device_id=1).end()
_cuda.current_device_id = ask
assert not asked, "a call's eviction asked for the current GPU"
assert fb.entry("a").fused is None and fb.entry("a").worker.copy_to_host().tolist() == [5] * 3
# the torch layer's fold-back: its add to a device worker range runs on the
# key's GPU, as do the zeros the store puts in place after op="auto"'s plain
# sum cleared the residuals (ensure_worker)
on(1, "add_to_worker", lambda: fb.add_to_worker(
    "a", 0, 2, lambda v: _cuda.copy(v, np.full(2, 7, np.float32))))
assert fb.entry("a").worker.copy_to_host().tolist() == [7, 7, 5]
from mpigc.feedback import plain_done
now[0] = 1
plain_done(fb, "a", fb.acquire("a", 3, np.float32, 1, 0, True, 1)[0], True)
assert on(1, "ensure_worker", lambda: fb.ensure_worker("a"))
assert fb.entry("a").worker.copy_to_host().tolist() == [0] * 3
# a loaded state's foreign device arrays (a CUDA torch tensor on GPU 1):
# copied to the host with their GPU current
import os, sys
sys.path.insert(0, os.environ["MPIGC_TESTS_DIR"])
from support.foreign_arrays import TorchLikeTensor as Foreign


def on_gpu1(a):
    t = Foreign(_cuda.to_device(a))
    t.device.index = 1
    return t


st = fb.state_dict()["b"]
st = dict(st, worker=on_gpu1(st["worker"]),
          owner=None if st["owner"] is None else on_gpu1(st["owner"]))
on(1, "a load's copies of foreign arrays", lambda: fb.load_state_dict({"b": st}))
assert fb.state_dict()["b"]["worker"].tolist() == [5] * 5
print("ok outside calls on the key's GPU")''')


def _simulated(code, ok):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               MPIGC_TESTS_DIR=os.path.dirname(os.path.abspath(__file__)))
    env.pop("MPIGC_DEVICE", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and ok in r.stdout, \
        f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def test_device_residuals_copy_to_the_host_and_back():
    _simulated(SCRIPT, "ok residual store on the device")


def test_a_spare_serves_calls_on_its_own_gpu_only():
    """A device spare (a replaced worker residual) given back by a call on
    one GPU is never the scratch of a call on another GPU of the process:
    before, the pool was keyed by side only, so a kernel on GPU 0 would have
    written GPU 1's memory."""
    _simulated(TWO_DEVICES, "ok spares per GPU")


def test_a_key_on_one_gpu_is_refused_to_a_call_on_another():
    """A key whose residuals live in one GPU's memory, used by a call on
    another GPU of the process (several GPUs per rank, or the current GPU
    changed between two calls), raises StateError (and the engine reports
    it on every rank, as a key in use): before, the store checked the side
    only, and the call's kernels read and wrote the other GPU's memory (an
    illegal address, or a silent peer access). Moving them is a state's
    round trip, placed on the next call's GPU, as between host and device."""
    _simulated(OTHER_GPU, "ok one GPU per key")


def test_copies_outside_a_call_run_on_the_keys_gpu():
    """A key's device residuals copied or moved outside a call (a state, a
    checkpoint's hold_all, a record by copy and its restore, the eviction
    of a grouped call's fused residuals), from a thread whose current GPU
    is not the key's, are allocated, copied and launched on the key's GPU,
    and the thread's GPU is current again after: before, on the current
    one (a process driving several GPUs got residuals on the wrong one).
    A call's own eviction of a fused member asks the driver nothing."""
    _simulated(OUTSIDE, "ok outside calls on the key's GPU")
