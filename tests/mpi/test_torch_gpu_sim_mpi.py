"""mpigc.torch's device buckets, across ranks, in Numba's CUDA simulator.

This file has two uses (as ``tests/mpi/test_gpu_path_mpi.py``).

1. Collected by the MPI test session (``mpirun -n K python -m pytest --with-mpi
   tests/mpi``), which never runs the simulator: the test seam refuses to run
   without it, on every rank.

2. Run as a script, ``NUMBA_ENABLE_CUDASIM=1 MPIGC_CUDA_AWARE=0 mpirun -n K
   python tests/mpi/test_torch_gpu_sim_mpi.py GROUP [GROUP ...]``: the same training with
   host buckets (CPU kernels) and with device buckets (the private seam
   ``mpigc.torch._sim_device_buckets``: each bucket's engine array is a
   simulated device array over the bucket tensor, so bucket allocation, the
   gradient copy, the launch through the engine's device path, the copy-back,
   the ``nonfinite="skip"`` snapshots and rollback and the residual state run
   as they do on a GPU) must give bit-identical gradients, parameters and
   residuals. ``tests/test_torch.py`` launches it at 2 and 3 ranks, every group
   in one job per count (a rank's start, torch and the simulator imported, is
   about 6 CPU s on the 2-core VM). Groups, run in the order given (``hier`` last: it sets
   ``MPIGC_NODE_SPLIT``), each checked on its own:

   ``ops``    3 SGD steps with 2bit, 1bit, none, fp16 (several buckets); 2bit
              also with ``gradient_as_bucket_view`` and a layer used at step 0
              only, under ``find_unused_parameters`` (its residuals' delivery
              folded back on the device); 1bit through ``DistributedOptimizer``. Every step runs
              the device backend only (never a host backend), the residuals
              are device arrays, and only packed bytes are staged to the host
              (each staging buffer about half the biggest bucket's bytes for
              fp16, a quarter for 2bit and 1bit, at most).
   ``skip``   a NaN gradient on the last rank at step 1 (the ``nonfinite="skip"``
              default, 3 buckets): NaN in the affected bucket on every rank,
              every residual as before the step (the finite buckets rolled
              back from their device snapshots), identical on both paths, and
              training continues identically.
   ``state``  ``state_dict`` of device buckets equals the host one; loaded
              into a new device-bucket GradientSync (residuals move to the
              device at its next step), the next step equals the host's.
   ``hook``   ``comm_hook`` with stand-ins for DDP's buckets: device (seam) and
              host give the same buckets, residuals and NaN rollback.
   ``hier``   ``hierarchy="node"`` with ``MPIGC_NODE_SPLIT=2``: ``ops``'s 2bit
              training with an unused layer, then ``skip`` and ``hook``, device
              against host buckets (the intra-node steps staged through the
              host window).

Ranks agree on pass/fail after each group; rank 0 prints ``ok GROUP`` for a
group that passed, else its ``FAIL GROUP rank R: ...`` lines.
"""
import os
import sys
import warnings

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
import mpigc  # noqa: E402
import mpigc.torch as mt  # noqa: E402

# ranks: only the seam's refusal here; tests/test_torch.py runs the groups at 2 and 3
pytestmark = [pytest.mark.mpi, pytest.mark.ranks(1, 2)]


# ============================================================================
# 1. in the MPI test session (no simulator)
# ============================================================================
def test_seam_needs_the_simulator(comm):
    from conftest import raises_everywhere  # not at the top: this file also runs as a script
    assert not os.environ.get("NUMBA_ENABLE_CUDASIM")
    model = make_model()
    mt._sim_device_buckets = True
    try:
        raises_everywhere(mpigc.ConfigError, lambda: mt.GradientSync(model, op="2bit"), comm,
                          match="NUMBA_ENABLE_CUDASIM")
    finally:
        mt._sim_device_buckets = False


# ============================================================================
# 2. the script (under mpirun, NUMBA_ENABLE_CUDASIM=1, MPIGC_CUDA_AWARE=0)
# ============================================================================
BUCKET_MB = 32 * 4 / 2**20  # 32 float32 values: 3 buckets (4 with the unused layer)


class _WithUnused(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net
        self.spare = torch.nn.Linear(4, 3)  # in the forward pass only while use_spare
        self.use_spare = True

    def forward(self, x):
        out = self.net(x)
        return out + self.spare(x[:, :4]) if self.use_spare else out


def make_model(seed=0, unused=False):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(),
                                torch.nn.Linear(10, 10), torch.nn.Tanh(),
                                torch.nn.Linear(10, 3))
    return _WithUnused(model) if unused else model


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def loss_of(model, rank, step):
    x, y = batch(rank, step)
    return ((model(x) - y) ** 2).mean()


class Checks:
    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.rank
        self.failures = []

    def check(self, cond, msg):
        if not cond:
            self.failures.append(msg)

    def same(self, what, got, want):
        got = got.detach().cpu().numpy() if torch.is_tensor(got) else np.asarray(got)
        want = want.detach().cpu().numpy() if torch.is_tensor(want) else np.asarray(want)
        if got.dtype != want.dtype or got.shape != want.shape:
            self.failures.append(f"{what}: {got.dtype}{got.shape} vs {want.dtype}{want.shape}")
        elif got.tobytes() != want.tobytes():
            i = int(np.flatnonzero(got.reshape(-1).view(np.uint8)
                                   != want.reshape(-1).view(np.uint8))[0])
            self.failures.append(f"{what}: differ (first byte {i})")

    def same_state(self, what, a, b):
        self.check(sorted(a) == sorted(b), f"{what}: names {sorted(a)} vs {sorted(b)}")
        for n in a:
            if n not in b:
                continue
            for part in ("worker", "owner"):
                x, y = a[n][part], b[n][part]
                self.check((x is None) == (y is None), f"{what} {n} {part}: None on one side")
                if x is not None and y is not None:
                    self.same(f"{what} {n} {part}", x, y)
            self.check(a[n]["calls"] == b[n]["calls"], f"{what} {n}: calls differ")

    def same_model(self, what, a, b, grads=True):
        for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
            self.same(f"{what} {n}", p, q)
            if grads:
                self.check((p.grad is None) == (q.grad is None), f"{what} {n}.grad None")
                if p.grad is not None and q.grad is not None:
                    self.same(f"{what} {n}.grad", p.grad, q.grad)

    def finish(self, group):
        allf = self.comm.allgather(self.failures)
        if self.rank == 0:
            bad = [(r, f) for r, fs in enumerate(allf) for f in fs]
            for r, f in bad:
                print(f"FAIL {group} rank {r}: {f}")
            if not bad:
                print(f"ok {group}")
        sys.stdout.flush()
        return 0 if not any(allf) else 1


class Spy:
    """What the device path did: the backends the engine chose (via the one
    dispatch layer) and the bytes of every staging buffer taken."""

    def __init__(self):
        from mpigc import _cuda, _dispatch
        self.sides, self.staged = [], []
        self._dispatch, self._pool = _dispatch, _cuda.staging_pool
        self._backend, self._take = _dispatch.backend, _cuda.staging_pool.take

    def __enter__(self):
        def backend(a):
            be = self._backend(a)
            self.sides.append(be.device)
            return be

        def take(nbytes):
            self.staged.append(int(nbytes))
            return self._take(nbytes)
        self._dispatch.backend = backend
        self._pool.take = take
        return self

    def __exit__(self, *exc):
        self._dispatch.backend = self._backend
        self._pool.take = self._take


def _device_sync(*args, **kw):
    mt._sim_device_buckets = True
    try:
        return mt.GradientSync(*args, **kw)
    finally:
        mt._sim_device_buckets = False


def _check_device(c, what, sync):
    from mpigc._dispatch import is_device_array
    c.check(all(b.on_device and is_device_array(b.flat) for b in sync.buckets),
            f"{what}: not every bucket is a device bucket")
    for k in sync.feedback.keys():
        e = sync.feedback.entry(k)
        for part in ("worker", "owner"):
            a = getattr(e, part)
            c.check(a is None or is_device_array(a), f"{what} {k}: {part} residual on host")


def _train(c, op, steps, device, opt_cls=None, **kw):
    """``steps`` SGD steps; returns (model, sync, spy)."""
    model = make_model(unused=kw.get("find_unused_parameters", False))
    make = _device_sync if device else mt.GradientSync
    params = {"threshold": 0.05} if op == "2bit" else {}
    spy = Spy()
    if opt_cls is not None:
        mt._sim_device_buckets = device
        try:
            opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                          op=op, bucket_mb=BUCKET_MB, **params, **kw)
        finally:
            mt._sim_device_buckets = False
        sync = opt.sync
    else:
        sync = make(model, op=op, bucket_mb=BUCKET_MB, **params, **kw)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    c.check(len(sync.buckets) >= 3, f"{op}: {len(sync.buckets)} buckets, expected >= 3")
    with spy:
        for step in range(steps):
            opt.zero_grad(set_to_none=not kw.get("gradient_as_bucket_view", False))
            if isinstance(model, _WithUnused):  # used at step 0, then on no rank: its
                model.use_spare = step == 0     # residuals' delivery is folded back
            loss_of(model, c.rank, step).backward()
            sync.wait()
            opt.step()
    return model, sync, spy


def group_ops(c):
    cases = [("2bit", {}), ("1bit", {}), ("none", {}), ("fp16", {}),
             ("2bit", {"gradient_as_bucket_view": True, "find_unused_parameters": True}),
             ("1bit", {"opt_cls": mt.DistributedOptimizer})]
    for op, kw in cases:
        what = f"{op} {sorted(kw)}"
        mh, sh, _ = _train(c, op, 3, False, **kw)
        md, sd, spy = _train(c, op, 3, True, **kw)
        c.same_model(what, md, mh)
        c.same_state(f"{what} state", sd.state_dict(), sh.state_dict())
        _check_device(c, what, sd)
        c.check(spy.sides and all(spy.sides), f"{what}: the engine took a host backend "
                f"{spy.sides.count(False)} of {len(spy.sides)} times")
        if op != "none":
            c.check(len(sd.feedback) == len(sd.buckets), f"{what}: residual keys")
            # only packed payloads cross to the host (op="none": full values)
            limit = {"fp16": 2, "2bit": 4, "1bit": 4}[op]
            # (plus rounding: N equal shards of the biggest one, a few header bytes)
            n = max(b.n for b in sd.buckets)
            cap = -(-n // c.comm.size) * c.comm.size * 4 // limit + 16 * c.comm.size
            c.check(c.comm.size == 1 or (spy.staged and max(spy.staged) <= cap),
                    f"{what}: staged {max(spy.staged or [0])} bytes at once, more than "
                    f"1/{limit} of the biggest bucket ({n} values; {cap} bytes)")
        if kw.get("gradient_as_bucket_view"):
            views = [p for n, p in md.named_parameters() if p.grad is not None]
            c.check(views and all(any(p.grad.data_ptr() == b.tensor[off:].data_ptr()
                                      for b in sd.buckets for off in b.offsets)
                                  for p in views), f"{what}: grads are not bucket views")
            # the unused layer's .grad is the view, zeroed (as DDP leaves it)
            c.check(not md.spare.weight.grad.any(), f"{what}: unused parameter got a grad")


def group_skip(c, **kw):
    last = c.comm.size - 1
    models, syncs, states = [], [], []
    for device in (False, True):
        model = make_model()
        sync = (_device_sync if device else mt.GradientSync)(model, op="2bit", threshold=0.05,
                                                             bucket_mb=BUCKET_MB, **kw)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        st = []
        for step in range(3):
            opt.zero_grad()
            h = None
            if step == 1 and c.rank == last:  # a NaN in one parameter's gradient
                h = model[2].bias.register_hook(lambda g: torch.full_like(g, float("nan")))
            loss_of(model, c.rank, step).backward()
            if h is not None:
                h.remove()
            sync.wait()
            st.append((sync.state_dict(), sync.last_step_finite,
                       [b.tensor.clone() for b in sync.buckets]))
            if sync.last_step_finite:
                opt.step()
        models.append(model)
        syncs.append(sync)
        states.append(st)
    (mh, md), (sh, sd) = models, syncs
    c.same_model("skip", md, mh)
    for step in range(3):
        c.same_state(f"skip step {step}", states[1][step][0], states[0][step][0])
        c.check(states[1][step][1] == states[0][step][1] == (step != 1),
                f"skip step {step}: last_step_finite {states[1][step][1]}")
        for k, (a, b) in enumerate(zip(states[1][step][2], states[0][step][2])):
            c.same(f"skip step {step} bucket {k}", a, b)
    # the NaN step changed no residual, on either path
    c.same_state("rolled back (device)", states[1][1][0], states[1][0][0])
    c.same_state("rolled back (host)", states[0][1][0], states[0][0][0])
    nan = [bool(torch.isnan(t).all()) for t in states[1][1][2]]
    c.check(any(nan) and not all(nan), f"skip: NaN buckets {nan}")
    c.check(sd.nonfinite_steps == sh.nonfinite_steps == 1, "nonfinite_steps")
    _check_device(c, "skip", sd)


def group_state(c):
    mh, sh, _ = _train(c, "2bit", 2, False)
    md, sd, _ = _train(c, "2bit", 2, True)
    state = sd.state_dict()
    c.same_state("state_dict", state, sh.state_dict())
    c.check(all(isinstance(s["worker"], np.ndarray) for s in state.values()),
            "state_dict: not host arrays")
    # a new device-bucket GradientSync continues from the loaded residuals
    model2 = make_model()
    model2.load_state_dict(md.state_dict())
    s2 = _device_sync(model2, op="2bit", threshold=0.05, bucket_mb=BUCKET_MB)
    s2.load_state_dict(state)
    for m, s in ((model2, s2), (mh, sh)):
        m.zero_grad()
        loss_of(m, c.rank, 2).backward()
        s.wait()
    c.same_model("after load_state_dict", model2, mh)
    c.same_state("after load_state_dict", s2.state_dict(), sh.state_dict())
    _check_device(c, "after load_state_dict", s2)


class _FakeBucket:
    """What DDP hands a comm hook (torch.distributed.GradBucket's methods)."""

    def __init__(self, index, params, last):
        self._index, self._params, self._last = index, params, last
        self._buffer = torch.cat([p.grad.reshape(-1) for p in params])

    def index(self):
        return self._index

    def parameters(self):
        return self._params

    def buffer(self):
        return self._buffer

    def is_last(self):
        return self._last


def group_hook(c, **kw):
    from mpigc._dispatch import is_device_array
    last = c.comm.size - 1
    outs, states, hooks = [], [], []
    for device in (False, True):
        model = make_model()
        state = mt.CommHookState(model, op="1bit", **kw)
        p = list(model.parameters())
        layout = [[p[5], p[4]], [p[3], p[2]], [p[1], p[0]]]
        got = []
        for step in range(3):
            model.zero_grad()
            loss_of(model, c.rank, step).backward()
            if step == 1 and c.rank == last:
                p[2].grad[3] = float("nan")
            buckets = [_FakeBucket(i, ps, i == len(layout) - 1) for i, ps in enumerate(layout)]
            mt._sim_device_buckets = device
            try:
                futures = [mt.comm_hook(state, b) for b in buckets]
            finally:
                mt._sim_device_buckets = False
            got.append([f.wait().clone() for f in futures])
            states.append(state.state_dict())
        outs.append(got)
        hooks.append(state)
    n = len(states) // 2
    for step in range(3):
        for k, (a, b) in enumerate(zip(outs[1][step], outs[0][step])):
            c.same(f"hook step {step} bucket {k}", a, b)
        c.same_state(f"hook state step {step}", states[n + step], states[step])
    c.same_state("hook rolled back", states[n + 1], states[n])
    c.check(hooks[1].nonfinite_steps == hooks[0].nonfinite_steps == 1, "hook nonfinite_steps")
    c.check(all(is_device_array(hooks[1].feedback.entry(k).worker)
                for k in hooks[1].feedback.keys()), "hook residuals not on the device")


def group_hier(c):
    """Hierarchical device buckets (emulated nodes of 2 ranks): the training,
    the unused layer's fold-back and the NaN rollback of ``ops`` and ``skip``,
    and the DDP hook of ``hook``, with ``hierarchy="node"``, against host
    buckets."""
    os.environ["MPIGC_NODE_SPLIT"] = "2"
    kw = {"hierarchy": "node", "find_unused_parameters": True}
    mh, sh, _ = _train(c, "2bit", 3, False, **kw)
    md, sd, spy = _train(c, "2bit", 3, True, **kw)
    c.same_model("hier", md, mh)
    c.same_state("hier state", sd.state_dict(), sh.state_dict())
    _check_device(c, "hier", sd)
    c.check(any("@hier[" in k for k in sd.feedback.keys()), "hier: no slice residual")
    c.check(spy.sides and all(spy.sides), "hier: the engine took a host backend")
    group_skip(c, hierarchy="node")
    group_hook(c, hierarchy="node")


GROUPS = {"ops": group_ops, "skip": group_skip, "state": group_state, "hook": group_hook,
          "hier": group_hier}


def main(groups):
    from mpigc import _cuda
    assert _cuda.simulator(), "run with NUMBA_ENABLE_CUDASIM=1"
    os.environ["MPIGC_MIN_COMPRESS_BYTES"] = "0"  # the compressed path on tiny buckets
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"mpigc\.kernels\.cuda")
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from support.simulator_fix import fix_simulator_shared_arrays
    fix_simulator_shared_arrays()
    from support import launch_contract
    from mpigc.kernels import cuda as kc
    launch_contract.install(kc)  # every simulated launch: what a real launch accepts
    comm = MPI.COMM_WORLD
    status = 0
    for group in groups:
        c = Checks(comm)
        try:
            GROUPS[group](c)
        except Exception:  # noqa: BLE001 - reported with the others
            import traceback
            c.failures.append(traceback.format_exc())
        status |= c.finish(group)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
