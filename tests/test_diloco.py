"""mpigc.torch.DiLoCo in one process (one replica): the schedule of outer
synchronisations, the outer step (Nesterov or not) against numpy, the state
round trip, and the arguments it refuses. The MPI behaviour is in
tests/mpi/test_diloco_mpi.py."""
import numpy as np
import pytest

import mpigc

torch = pytest.importorskip("torch")
import mpigc.torch as mt  # noqa: E402


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 1)).to(dtype)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def inner_step(model, d, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 8, generator=g, dtype=next(model.parameters()).dtype)
    d.zero_grad()
    model(x).pow(2).mean().backward()
    return d.step()


def test_exported():
    assert "DiLoCo" in mt.__all__ and mt.DiLoCo.__module__ == "mpigc.torch._diloco"
    assert issubclass(mt.StreamingDiLoCo, mt.DiLoCo) and "StreamingDiLoCo" in mt.__all__


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_outer_step_every_h_inner_steps(nesterov, dtype):
    """One replica: every H-th step applies m = mu m + delta,
    anchor -= lr (delta + mu m) (lr m without Nesterov) in numpy's rounding."""
    model = make_model(dtype)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    d = mt.DiLoCo(model, inner, sync_every=3, outer_lr=0.7, outer_momentum=0.9,
                  nesterov=nesterov)
    anchor = flat(model).numpy().copy()
    m = np.zeros_like(anchor)
    mu, lr = anchor.dtype.type(0.9), anchor.dtype.type(0.7)
    for s in range(9):
        before = flat(model).numpy().copy()
        inner_step(model, d, s)
        if (s + 1) % 3:
            assert d.window == (s + 1) % 3 and not d.in_sync
            assert not np.array_equal(flat(model).numpy(), before)
            continue
        # the last inner step is not observable from here: the delta applied
        # is the outer gradient, which with op="none" on one rank is exact
        g = d.outer_gradient.numpy()
        m = m * mu + g
        anchor = anchor - ((g + m * mu) if nesterov else m) * lr
        assert d.in_sync and d.syncs == (s + 1) // 3
        assert np.array_equal(flat(model).numpy(), anchor)
        assert np.array_equal(d.anchor.numpy(), anchor)


def test_one_replica_h1_lr1_mu0_is_the_inner_optimizer():
    """One replica, H=1, outer lr 1, momentum 0: anchor - (anchor - x) is x
    up to one rounding, and exactly x for inner SGD on a dyadic grid."""
    model = make_model(torch.float64)
    ref = make_model(torch.float64)
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            p.copy_(torch.round(p * 64) / 64)
            q.copy_(p)
    d = mt.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.5), sync_every=1,
                  outer_lr=1.0, outer_momentum=0.0)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.5)
    for s in range(3):
        for mod, step in ((model, d.step), (ref, sgd.step)):
            for p in mod.parameters():
                p.grad = torch.round(torch.randn(p.shape, generator=torch.Generator()
                                                 .manual_seed(s), dtype=p.dtype) * 8) / 8
            step()
        assert torch.equal(flat(model), flat(ref))


def test_state_round_trip_in_a_window(monkeypatch):
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "0")  # compress a model this small
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    d = mt.DiLoCo(model, inner, sync_every=2, op="2bit")
    for s in range(5):
        inner_step(model, d, s)
    st = d.state_dict()
    assert st["window"] == 1 and st["syncs"] == 2 and st["world_size"] == 1
    assert set(st["residuals"]) == {"diloco"}
    model2 = make_model()
    d2 = mt.DiLoCo(model2, torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9),
                   sync_every=2, op="2bit")
    d2.load_state_dict(st)
    assert torch.equal(d2.anchor, d.anchor) and d2.window == 1 and d2.syncs == 2
    np.testing.assert_array_equal(d2.feedback.state_dict()["diloco"]["worker"],
                                  st["residuals"]["diloco"]["worker"])
    d3 = mt.DiLoCo(model2, torch.optim.SGD(model2.parameters(), lr=0.1), sync_every=1)
    with pytest.raises(mpigc.ConfigError, match="same world size and sync_every"):
        d3.load_state_dict(st)   # a window of 1 step cannot go on with H=1
    small = mt.DiLoCo(torch.nn.Linear(2, 1), torch.optim.SGD(
        torch.nn.Linear(2, 1).parameters(), lr=0.1))
    with pytest.raises(mpigc.InvalidBufferError, match="values"):
        small.load_state_dict(st)


def test_nonfinite_drops_the_window():
    model = make_model()
    d = mt.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)
    anchor = flat(model)
    inner_step(model, d, 0)
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    with pytest.raises(mpigc.NonFiniteError, match=r"rank\(s\) \[0\]"):
        inner_step(model, d, 1)
    assert torch.equal(flat(model), anchor) and d.window == 0 and d.skipped_syncs == 1


def test_warns_when_nothing_is_compressed():
    model = make_model()   # 193 values: under the cutoff, the exact sum
    with pytest.warns(UserWarning, match="DiLoCo: none of its 1 bucket"):
        mt.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), op="2bit")


@pytest.mark.parametrize("kw,err,match", [
    ({"sync_every": 0}, mpigc.ConfigError, "sync_every"),
    ({"sync_every": 2.0}, mpigc.ConfigError, "sync_every"),
    ({"outer_lr": 0}, mpigc.ConfigError, "outer_lr"),
    ({"outer_momentum": 1.0}, mpigc.ConfigError, "outer_momentum"),
    ({"nonfinite": "ignore"}, mpigc.ConfigError, "nonfinite"),
    ({"gather": "all"}, mpigc.ConfigError, "gather"),
    ({"op": "2bit", "compression": "fp16"}, mpigc.ConfigError, "Horovod"),
])
def test_bad_arguments(kw, err, match):
    model = make_model()
    with pytest.raises(err, match=match):
        mt.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), **kw)


def test_bad_parameters():
    model = make_model()
    model[0].to(torch.float64)
    with pytest.raises(mpigc.InvalidBufferError, match="float32 or all float64"):
        mt.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1))
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(mpigc.ConfigError, match="no parameters"):
        mt.DiLoCo(frozen, torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(mpigc.ConfigError, match="inner_optimizer"):
        mt.DiLoCo(model[2], object())
    assert "DiLoCo(sync_every=100" in repr(mt.DiLoCo(model[2], torch.optim.SGD(
        model[2].parameters(), lr=0.1)))
