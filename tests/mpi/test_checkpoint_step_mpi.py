"""load_checkpoint(..., step=): residuals of another save than the model's
(a job killed between its model save and its residual save) raise
MismatchError on every rank before anything is installed; the matching step
loads bit for bit. mpigc.load_checkpoint and the torch classes."""
import copy
import os
import shutil
import sys
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

import mpigc

from conftest import assert_all, on_root, raises_everywhere

pytestmark = [pytest.mark.mpi, pytest.mark.ranks(1, 2, 3)]

try:
    import torch
except ImportError:  # the mpigc-level test runs without torch
    torch = None
else:
    import mpigc.torch as mt
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from support import torch_dist
    gloo = torch_dist.gloo  # its module-scoped fixture: torch.distributed over gloo

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


@pytest.fixture
def shared_dir():
    d = on_root(lambda: tempfile.mkdtemp(prefix="mpigc-ckstep-"), WORLD)
    yield d
    WORLD.Barrier()
    if RANK == 0:
        shutil.rmtree(d, ignore_errors=True)


def _run(fb, steps, salt=0):
    for s in steps:
        for key, n in (("a", 1001), ("b", 65)):
            g = np.random.default_rng([RANK, s, n, salt]).standard_normal(n).astype(np.float32)
            mpigc.allreduce(g, "2bit", key=key, feedback=fb, comm=WORLD)


def _bytes(state):
    """A per-key state as comparable bytes (None stays None)."""
    return {k: tuple(None if v[f] is None else np.asarray(v[f]).tobytes()
                     for f in ("worker", "owner")) + (v.get("calls"),)
            for k, v in state.items()}


def test_step_is_checked_before_anything_is_installed(shared_dir):
    ck, nostep = os.path.join(shared_dir, "ck"), os.path.join(shared_dir, "nostep")
    fb = mpigc.ErrorFeedback()
    _run(fb, range(3))
    mpigc.save_checkpoint(ck, feedback=fb, step=3)
    mpigc.save_checkpoint(nostep, feedback=fb)
    saved = _bytes(fb.state_dict())

    live = mpigc.ErrorFeedback()  # a store with other residuals: must stay as it is
    _run(live, range(2), salt=7)
    before = _bytes(live.state_dict())
    raises_everywhere(mpigc.MismatchError, lambda: mpigc.load_checkpoint(
        ck, feedback=live, step=4), WORLD, match="saved at step 3, step=4 expected")
    assert_all(_bytes(live.state_dict()) == before, "a wrong step leaves the store unchanged")
    raises_everywhere(mpigc.MismatchError, lambda: mpigc.load_checkpoint(
        nostep, feedback=live, step=3), WORLD, match="records no step")
    assert_all(_bytes(live.state_dict()) == before, "no recorded step: store unchanged")
    # one rank expecting another step is enough: every rank raises
    raises_everywhere(mpigc.MismatchError, lambda: mpigc.load_checkpoint(
        ck, feedback=live, step=3 if RANK else 2), WORLD)
    raises_everywhere(mpigc.ConfigError, lambda: mpigc.load_checkpoint(
        ck, feedback=live, step="3"), WORLD, match="step")
    assert_all(_bytes(live.state_dict()) == before, "store unchanged after every refusal")

    info = mpigc.load_checkpoint(ck, feedback=live, step=3)
    assert_all(info["step"] == 3 and _bytes(live.state_dict()) == saved,
               "the matching step loads bit for bit")
    mpigc.load_checkpoint(nostep, feedback=live)  # step=None: no check, as before
    mpigc.load_checkpoint(ck, feedback=live, step=np.int64(3))


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3))


def _backward(model, step):
    g = torch.Generator().manual_seed(1000 * step + RANK)
    x, y = torch.randn(16, 12, generator=g), torch.randn(16, 3, generator=g)
    ((model(x) - y) ** 2).mean().backward()


@pytest.mark.skipif(torch is None, reason="needs torch")
@pytest.mark.parametrize("kind", ["sync", "hook"])
def test_torch_classes_check_the_step(shared_dir, kind, request):
    torch.set_num_threads(1)
    path = os.path.join(shared_dir, "res")

    def make(model):
        if kind == "sync":
            return model, mt.GradientSync(model, op="2bit", bucket_mb=0.002)
        request.getfixturevalue("gloo")
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.002)
        state = mt.CommHookState(ddp, op="2bit", threshold=2.0 ** -6)
        ddp.register_comm_hook(state, mt.comm_hook)
        return ddp, state

    def steps(m, holder, rng):
        for s in rng:
            m.zero_grad()
            _backward(m, s)
            if kind == "sync":
                holder.wait()

    model = _model()
    m, holder = make(copy.deepcopy(model))
    steps(m, holder, range(2))
    holder.save_checkpoint(path, step=2)
    saved = _bytes(holder.state_dict())

    m2, other = make(copy.deepcopy(model))
    steps(m2, other, range(5, 8))
    before = _bytes(other.state_dict())
    raises_everywhere(mpigc.MismatchError, lambda: other.load_checkpoint(path, step=3),
                      WORLD, match="saved at step 2, step=3 expected")
    assert_all(_bytes(other.state_dict()) == before, f"{kind}: store unchanged")
    other.load_checkpoint(path, step=2)
    assert_all(_bytes(other.state_dict()) == saved, f"{kind}: matching step, bit for bit")



@pytest.mark.skipif(torch is None, reason="needs torch")
@pytest.mark.parametrize("kill", ["before", "after"])
def test_example_save_resumes_the_last_whole_pair(shared_dir, kill):
    """examples/train_torch.py's save(): killed just before or just after the
    residuals of epoch 1 were written, it resumes from epoch 0, with epoch 0's
    residuals bit for bit (the old order, model file first, left epoch 1's
    model with epoch 0's residuals when killed before, which resume() loaded
    silently); and a model file naming residuals of another epoch raises on
    every rank."""
    import argparse
    import importlib.util
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("train_torch_example", os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "train_torch.py"))
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    args = argparse.Namespace(checkpoint=shared_dir, op="2bit")

    def build():
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, opt, mt.GradientSync(model, op="2bit", bucket_mb=0.002)

    def epoch(model, opt, sync, e):
        for s in range(2):
            opt.zero_grad()
            _backward(model, 10 * e + s)
            sync.wait()
            opt.step()

    model, opt, sync = build()
    epoch(model, opt, sync, 0)
    ex.save(args, WORLD, 0, model, opt, None, sync)
    saved0 = _bytes(sync.state_dict())
    epoch(model, opt, sync, 1)
    save_residuals = sync.save_checkpoint

    def killed(path, step=None):  # the job dies in epoch 1's save, at the residuals
        if kill == "after":
            save_residuals(path, step)
        raise KeyboardInterrupt("killed")
    sync.save_checkpoint = killed
    with pytest.raises(KeyboardInterrupt):
        ex.save(args, WORLD, 1, model, opt, None, sync)
    WORLD.Barrier()
    m2, o2, s2 = build()
    start = ex.resume(args, WORLD, m2, o2, None, s2)
    assert_all(start == 1 and _bytes(s2.state_dict()) == saved0,
               "resumed from epoch 0's model and residuals")
    if RANK == 0:  # a model file of epoch 1 naming epoch 0's residuals
        ck = torch.load(os.path.join(shared_dir, "train.pt"), weights_only=True)
        ck["epoch"] = 1
        torch.save(ck, os.path.join(shared_dir, "train.pt"))
    WORLD.Barrier()
    before = _bytes(s2.state_dict())
    raises_everywhere(mpigc.MismatchError, lambda: ex.resume(args, WORLD, m2, o2, None, s2),
                      WORLD, match="saved at step 0, step=1 expected")
    assert_all(_bytes(s2.state_dict()) == before, "nothing loaded")


@pytest.mark.skipif(torch is None, reason="needs torch")
@pytest.mark.parametrize("kind", ["adamw", "diloco"])
def test_adamw_and_diloco_pass_the_step_on(shared_dir, kind):
    """CompressedAdamW's and DiLoCo's load_checkpoint(step=) check as
    mpigc.load_checkpoint does (their residuals are the store's)."""
    torch.set_num_threads(1)
    path = os.path.join(shared_dir, "res")

    def make():
        model = _model()
        if kind == "adamw":
            return model, mt.CompressedAdamW(model.parameters(), lr=1e-3, freeze_steps=1)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, mt.DiLoCo(model, inner, sync_every=1, op="2bit")

    model, obj = make()
    for s in range(3):  # CompressedAdamW's step and DiLoCo's (inner step, then sync)
        model.zero_grad()
        _backward(model, s)
        obj.step()
    obj.save_checkpoint(path, step=3)
    saved = _bytes(obj.feedback.state_dict())
    model2, other = make()
    raises_everywhere(mpigc.MismatchError, lambda: other.load_checkpoint(path, step=2),
                      WORLD, match="saved at step 3, step=2 expected")
    other.load_checkpoint(path, step=3)
    assert_all(_bytes(other.feedback.state_dict()) == saved and saved,
               f"{kind}: matching step, bit for bit")
