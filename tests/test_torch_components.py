"""The torch layer's components, each with a contract of its own (issue 46
item 5): the one bucketing (mpigc/torch/_buckets.py) and the residual state
(mpigc/torch/_residuals.py). Single process; the collective parts of the
residual state are covered by tests/mpi/test_torch_mpi.py and
test_torch_hook_mpi.py."""
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpigc.torch import _buckets  # noqa: E402


# -- the one bucketing ---------------------------------------------------------------
# The two bucketings the layer had before it had one, as they were written:
# GradientSync._make_buckets (float16/bfloat16 in float32 buckets, bytes of the
# bucket dtype) and CommHookState._make_groups over _state.bucket_assignment
# (groups in the parameters' dtype, bytes of that dtype).
_BUCKET_DTYPES = {torch.float16: np.float32, torch.bfloat16: np.float32,
                  torch.float32: np.float32, torch.float64: np.float64}


def _sync_buckets_before(named, bucket_mb):
    cap = bucket_mb * (1 << 20)
    open_, nbytes, done = {}, {}, []
    for i in reversed(range(len(named))):
        name, p = named[i]
        dt = _BUCKET_DTYPES[p.dtype]
        cur = open_.setdefault(dt, [])
        cur.append((name, i, p))
        nbytes[dt] = nbytes.get(dt, 0) + p.numel() * np.dtype(dt).itemsize
        if nbytes[dt] >= cap:
            done.append((cur[0][1], dt, cur))
            open_[dt], nbytes[dt] = [], 0
    done += [(cur[0][1], dt, cur) for dt, cur in open_.items() if cur]
    done.sort(key=lambda t: -t[0])
    return [([i for _, i, _ in cur], np.dtype(dt)) for _, dt, cur in done]


def _hook_groups_before(named, bucket_mb):
    sizes = [(p.numel() * p.element_size(), p.dtype) for _, p in named]
    cap = bucket_mb * (1 << 20)
    groups, filling, held = [], {}, {}
    for i in range(len(sizes) - 1, -1, -1):
        nbytes, dt = sizes[i]
        filling.setdefault(dt, []).append(i)
        held[dt] = held.get(dt, 0) + nbytes
        if held[dt] >= cap:
            groups.append(filling.pop(dt))
            held[dt] = 0
    groups.extend(g for g in filling.values() if g)
    return [(g, named[g[0]][1].dtype) for g in sorted(groups, key=lambda g: -g[0])]


def _named(dtypes_numels):
    return [(f"p{i}", torch.nn.Parameter(torch.zeros(m, dtype=dt)))
            for i, (dt, m) in enumerate(dtypes_numels)]


MIXES = {
    "fp32": [torch.float32] * 6,
    "fp16+fp32": [torch.float16, torch.float32, torch.float16, torch.float32, torch.float32,
                  torch.float16],
    "bf16+fp32": [torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16,
                  torch.float32],
    "fp16+bf16+fp32+fp64": [torch.float16, torch.bfloat16, torch.float32, torch.float64,
                            torch.float16, torch.float64, torch.bfloat16, torch.float32],
}


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("seed", range(5))
def test_one_bucketing_gives_each_caller_its_buckets_of_before(mix, seed):
    """plan_buckets with GradientSync's dtype rule gives GradientSync's
    buckets of before, with the hook's rule the hook's groups of before, for
    fp32/fp16/bf16/fp64 mixes of random sizes and caps."""
    rng = random.Random(seed)
    dts = list(MIXES[mix])
    rng.shuffle(dts)
    named = _named([(dt, rng.randint(0, 300)) for dt in dts])
    for bucket_mb in (1e-9, 200 / 2**20, 700 / 2**20, 2000 / 2**20, 25.0):
        sync = [(m, np.dtype(np.float64 if dt == torch.float64 else np.float32))
                for m, dt in _buckets.plan_buckets(named, bucket_mb,
                                                   _buckets.accumulating_dtype)]
        assert sync == _sync_buckets_before(named, bucket_mb), (mix, bucket_mb)
        assert (_buckets.plan_buckets(named, bucket_mb, _buckets.own_dtype)
                == _hook_groups_before(named, bucket_mb)), (mix, bucket_mb)


def test_the_two_dtype_rules_differ_for_half_parameters_only():
    """GradientSync's float32 buckets take float16 and bfloat16 parameters
    with the float32 ones, counted at 4 bytes an element; the hook's groups
    keep each dtype apart, counted at its own size. float32/float64 models
    get the same buckets from both."""
    named = _named([(torch.float32, 100), (torch.float16, 100), (torch.bfloat16, 100),
                    (torch.float32, 100)])
    cap = 1000 / 2**20
    assert _buckets.plan_buckets(named, cap, _buckets.accumulating_dtype) == [
        ([3, 2, 1], torch.float32), ([0], torch.float32)]  # 1200 bytes, then 400
    assert _buckets.plan_buckets(named, cap, _buckets.own_dtype) == [
        ([3, 0], torch.float32), ([2], torch.bfloat16), ([1], torch.float16)]
    plain = _named([(torch.float32, 50), (torch.float64, 70), (torch.float32, 300),
                    (torch.float64, 10)])
    for mb in (1e-9, 300 / 2**20, 25.0):
        assert (_buckets.plan_buckets(plain, mb, _buckets.accumulating_dtype)
                == _buckets.plan_buckets(plain, mb, _buckets.own_dtype))


def test_layout_keys_and_offsets():
    lay = _buckets.Layout(3, ["a", "b", "c"], [2, 0, 5], np.float32)
    assert (lay.offsets, lay.n, lay.dtype) == ([0, 2, 2], 7, np.dtype(np.float32))
    assert lay.key.startswith("torch/a..c/") and len(lay.key.split("/")[-1]) == 12
    assert lay.key != _buckets.Layout(3, ["a", "b", "c"], [2, 1, 4], np.float32).key


# -- the residual state -------------------------------------------------------------
def _store(entries):
    """An ErrorFeedback holding ``{key: worker}`` (float32, one rank)."""
    from mpigc import feedback
    fb = feedback.ErrorFeedback()
    fb.replace_entries({k: feedback.new_entry(w.size, np.float32, 1, 0, {"type": "2bit"}, 2,
                                              np.array(w, np.float32), None)
                        for k, w in entries.items()})
    return fb


def _residuals(fb, lay=None):
    from mpi4py import MPI
    from mpigc.torch._residuals import Residuals
    return Residuals(fb, MPI.COMM_SELF, MPI.COMM_SELF, "compressed", lay, lay is not None,
                     "flat" if lay is None else "node")


@pytest.mark.parametrize("average", [True, False])
def test_fold_back_gives_what_unused_elements_delivered_to_the_worker(average):
    lay = _buckets.Layout(0, ["a", "b", "c"], [2, 3, 1], np.float32)
    fb = _store({lay.key: np.arange(6)})
    buf = torch.tensor([10., 20., 30., 40., 50., 60.])
    _residuals(fb).fold_back(lay, buf, [(0, 2), (5, 1)], average, 4)
    d = buf.numpy() if average else buf.numpy() / 4
    want = np.arange(6, dtype=np.float32) + np.where([1, 1, 0, 0, 0, 1], d, 0)
    assert fb.state_dict()[lay.key]["worker"].tolist() == want.tolist()


def test_fold_back_of_hierarchical_slices_gives_each_handler_its_share():
    """A slice's M handlers each take 1/M of what its elements delivered."""
    from types import SimpleNamespace
    from mpigc import _hierarchy
    L, M = 2, 2
    hl = SimpleNamespace(L=L, M=M, rank=0, slices_of=lambda r: [0, 1])
    lay = _buckets.Layout(0, ["a", "b"], [3, 3], np.float32)  # slices [0, 3), [3, 6)
    keys = [_hierarchy.slice_key(lay.key, s, L, lay.n) for s in range(L)]
    fb = _store({keys[0]: np.zeros(3), keys[1]: np.zeros(3)})
    buf = torch.arange(1., 7.)
    _residuals(fb, hl).fold_back(lay, buf, [(2, 3)], True, 4)  # elements 2, 3, 4
    s = fb.state_dict()
    assert s[keys[0]]["worker"].tolist() == [0, 0, 3 * 4 / M]
    assert s[keys[1]]["worker"].tolist() == [4 * 4 / M, 5 * 4 / M, 0]


def test_a_step_snapshot_puts_back_and_reuses_its_arrays():
    lay = _buckets.Layout(0, ["a"], [3], np.float32)
    fb = _store({lay.key: np.arange(3)})
    res = _residuals(fb)
    snaps = res.snapshot(lay)
    fb.add_to_worker(lay.key, 0, 3, lambda v: v.__iadd__(1))
    res.restore(snaps)
    assert fb.state_dict()[lay.key]["worker"].tolist() == [0, 1, 2]
    res.recycle(lay.key, snaps)
    again = res.snapshot(lay)
    assert again[lay.key][0] is snaps[lay.key][0]  # the spare's arrays, written over
    new = _buckets.Layout(1, ["z"], [2], np.float32)  # a key without residuals
    gone = res.snapshot(new)
    assert gone == {new.key: None}
    fb.replace_entries({**fb.entries(), **_store({new.key: np.ones(2)}).entries()})
    res.restore(gone)  # put back as it was: no entry
    assert new.key not in fb and lay.key in fb


def test_state_of_is_the_state_of_the_layouts():
    """state_of (keys of other calls may be busy) reads what state does."""
    import mpigc
    lay = _buckets.Layout(0, ["a", "b"], [2, 3], np.float32)
    fb = _store({lay.key: np.arange(5), "other": np.zeros(4)})
    res = _residuals(fb)
    got = res.state_of([lay])
    want = res.state([lay], lambda: None, "test")
    assert sorted(got) == sorted(want) == ["a", "b"]
    for n in got:
        assert got[n]["worker"].tolist() == want[n]["worker"].tolist()
        assert {k: v for k, v in got[n].items() if k not in ("worker", "owner")} == \
            {k: v for k, v in want[n].items() if k not in ("worker", "owner")}
    txn = fb.begin("other", 4, np.float32, 1, 0)  # another key in use
    try:
        assert res.state_of([lay])["b"]["worker"].tolist() == [2, 3, 4]
        with pytest.raises(mpigc.StateError):
            fb.state_dict()
    finally:
        txn.end()
