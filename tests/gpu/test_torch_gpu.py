"""mpigc.torch on a real GPU: device buckets (one rank, in process).

A CUDA model's gradients stay on the GPU: its buckets are CUDA tensors, the
engine takes its device path only (never a host backend), no copy from the
device to the host is bigger than the packed payload (2bit: 1/16 of the
bucket's bytes, fp16: half; the non-finite counts are 8 bytes), and the
gradients, parameters and residuals are bit-identical to the host-staged path
(``device_buckets=False``) over a few steps, for 2bit, 1bit, none and fp16, with
a NaN step that ``nonfinite="skip"`` rolls back, and with the backward pass on a
side stream (the engine must wait for torch's current stream).

Runs in ``tests/gpu`` (``python -m pytest tests/gpu``, ``tests/gpu/run.sh``).
Skips, saying why, where torch is not installed or sees no CUDA GPU, and in the
runner's simulator mode (``MPIGC_GPU_SIM=1``; the device bucket code runs in the
simulator through ``tests/test_torch.py``).
"""
import os

import numpy as np
import pytest

SIM = os.environ.get("MPIGC_GPU_SIM") == "1"
OPS = ["2bit", "1bit", "none", "fp16"]


@pytest.fixture(scope="module")
def torch():
    if SIM:
        pytest.skip("simulator mode: device buckets are tested in the simulator by "
                    "tests/test_torch.py (tests/mpi/test_torch_gpu_sim_mpi.py)")
    t = pytest.importorskip("torch")
    if not t.cuda.is_available():
        pytest.skip(f"torch {t.__version__} sees no CUDA GPU")
    os.environ["MPIGC_MIN_COMPRESS_BYTES"] = "0"
    return t


@pytest.fixture(scope="module")
def mt(torch):
    import mpigc.torch
    return mpigc.torch


def make_model(torch, width=256):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, 8)).cuda()


def batch(torch, step, n=32):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 64, generator=g).cuda(), torch.randn(n, 8, generator=g).cuda()


def params_for(op):
    return {"threshold": 0.01} if op == "2bit" else {}


def train(torch, mt, op, device_buckets, steps=3, nan_step=None, stream=None, width=256,
          record=True):
    model = make_model(torch, width)
    sync = mt.GradientSync(model, op=op, bucket_mb=0.05, device_buckets=device_buckets,
                           **params_for(op))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    states = []
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(torch, step)
        if stream is not None:  # the side stream starts after the batch is there
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream) if stream is not None else _nothing():
            h = None
            if step == nan_step:
                h = model[2].bias.register_hook(lambda g: torch.full_like(g, float("nan")))
            ((model(x) - y) ** 2).mean().backward()
            if h is not None:
                h.remove()
            sync.wait()
            if sync.last_step_finite:
                opt.step()
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
        if record:
            torch.cuda.synchronize()
            states.append((sync.state_dict(), sync.last_step_finite))
    torch.cuda.synchronize()
    return model, sync, states


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def assert_same_model(a, b):
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert p.detach().cpu().numpy().tobytes() == q.detach().cpu().numpy().tobytes(), n
        assert p.grad.cpu().numpy().tobytes() == q.grad.cpu().numpy().tobytes(), n + ".grad"


def assert_same_state(a, b):
    assert sorted(a) == sorted(b)
    for n in a:
        for part in ("worker", "owner"):
            x, y = a[n][part], b[n][part]
            assert (x is None) == (y is None), (n, part)
            if x is not None:
                assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), (n, part)
        assert a[n]["calls"] == b[n]["calls"], n


@pytest.mark.parametrize("op", OPS)
def test_buckets_on_the_gpu_and_no_host_copy(torch, mt, op, monkeypatch):
    from numba.cuda.cudadrv import devicearray

    from mpigc import _cuda, _dispatch
    sides, d2h = [], []
    backend = _dispatch.backend

    def spy_backend(a):
        be = backend(a)
        sides.append(be.device)
        return be

    to_host = devicearray.DeviceNDArray.copy_to_host

    def spy_to_host(self, *a, **kw):
        d2h.append(self.nbytes)
        return to_host(self, *a, **kw)

    take = _cuda.staging_pool.take

    def spy_take(nbytes):
        d2h.append(int(nbytes))
        return take(nbytes)
    monkeypatch.setattr(_dispatch, "backend", spy_backend)
    monkeypatch.setattr(devicearray.DeviceNDArray, "copy_to_host", spy_to_host)
    monkeypatch.setattr(_cuda.staging_pool, "take", spy_take)
    model, sync, _ = train(torch, mt, op, True, steps=2, record=False)
    assert len(sync.buckets) >= 2
    for b in sync.buckets:
        assert b.on_device and b.tensor.is_cuda and b.flat is b.tensor, b
    assert all(p.grad.is_cuda for p in model.parameters())
    assert sides and all(sides), f"host backend {sides.count(False)} of {len(sides)} times"
    # what crosses to the host: non-finite counts (8 bytes) and, without CUDA-aware
    # MPI, the packed payloads (op="none" stages full-precision values by design)
    if op != "none":
        biggest = max(b.n for b in sync.buckets) * 4
        share = {"2bit": 8, "1bit": 8, "fp16": 2}[op]  # 2bit: 1/16, 1bit: 1/32 + means
        assert max(d2h, default=0) <= biggest // share + 64, (d2h, biggest)
    for k in sync.feedback.keys():
        e = sync.feedback.entry(k)
        assert e.worker is None or _dispatch.is_device_array(e.worker)


@pytest.mark.parametrize("op", OPS)
def test_device_buckets_equal_host_staged(torch, mt, op):
    md, sd, rd = train(torch, mt, op, True)
    mh, sh, rh = train(torch, mt, op, False)
    assert all(b.on_device for b in sd.buckets) and not any(b.on_device for b in sh.buckets)
    assert all(not b.tensor.is_cuda and b.tensor.is_pinned() for b in sh.buckets)
    assert_same_model(md, mh)
    for (a, _), (b, _) in zip(rd, rh):
        assert_same_state(a, b)


def test_nan_step_rolls_back_on_the_gpu(torch, mt):
    md, sd, rd = train(torch, mt, "2bit", True, steps=3, nan_step=1)
    mh, sh, rh = train(torch, mt, "2bit", False, steps=3, nan_step=1)
    assert [f for _, f in rd] == [f for _, f in rh] == [True, False, True]
    assert_same_state(rd[1][0], rd[0][0])  # the NaN step changed no residual
    for (a, _), (b, _) in zip(rd, rh):
        assert_same_state(a, b)
    assert_same_model(md, mh)
    assert sd.nonfinite_steps == sh.nonfinite_steps == 1


@pytest.mark.parametrize("op", ["2bit", "none"])
def test_backward_on_a_side_stream(torch, mt, op):
    """The gradients are copied into the bucket on torch's current stream (a
    side stream here, which does not wait for the default stream): the
    engine, on the default stream, must wait for it. A wide layer makes a
    missing wait show up as different gradients."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    md, sd, rd = train(torch, mt, op, True, stream=s, width=2048)
    mh, sh, rh = train(torch, mt, op, False, width=2048)
    assert_same_model(md, mh)
    for (a, _), (b, _) in zip(rd, rh):
        assert_same_state(a, b)


ADAM_MODES = [dict(op="1bit", freeze_steps=3),
              dict(op="1bit", warmup_op="bf16", freeze_steps=3, var_refresh=2, sync_every=2),
              dict(op="2bit", rel_threshold=1.5, warmup_op="fp16", freeze_steps="auto",
                   freeze_window=2, freeze_threshold=0.05, var_refresh=2)]


@pytest.mark.parametrize("kw", ADAM_MODES, ids=["plain", "bf16-refresh-local", "auto-fp16"])
def test_compressed_adamw_on_the_gpu_follows_the_cpu(torch, mt, kw):
    """CompressedAdamW with CUDA parameters (the engine's device path for the
    warm-up's bf16/fp16 exchange, the compressed momentum, the refreshes and
    the local steps' window buffers) against the same run on the CPU: the
    same freeze step and refreshes, parameters within float32 rounding (the
    two sides' sqrt and division may differ in the last bit)."""
    runs = []
    for device in ("cuda", "cpu"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                                    torch.nn.Linear(256, 8)).to(device)
        opt = mt.CompressedAdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95),
                                 weight_decay=0.1, block_size=256, **kw)
        for step in range(12):
            x, y = batch(torch, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
            opt.step()
        opt.synchronize()
        runs.append((opt.frozen_at, opt.refreshes, opt.skipped_steps,
                     [p.detach().cpu() for p in model.parameters()]))
    (fg, rg, sg, pg), (fc, rc, sc, pc) = runs
    assert (fg, rg, sg) == (fc, rc, sc), runs[0][:3]
    for a, b in zip(pg, pc):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (a - b).abs().max()
