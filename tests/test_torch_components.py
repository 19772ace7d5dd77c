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
