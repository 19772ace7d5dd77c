"""The torch layer's components, each with a contract of its own (issue 46
item 5): the one bucketing (mpigc/torch/_buckets.py) and the residual state
(mpigc/torch/_residuals.py). Single process; the collective parts of the
residual state are covered by tests/mpi/test_torch_mpi.py and
test_torch_hook_mpi.py."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpigc.torch import _buckets  # noqa: E402


# -- the one bucketing ---------------------------------------------------------------
# Golden bucketings, written out by hand from the rule (mpigc/torch/_buckets.py's
# docstring, docs/torch.md "Buckets"): filled in the reverse of registration order,
# one buffer dtype per bucket, a bucket closed once it holds the cap's bytes or more
# (so its last parameter may take it over the cap), the open buckets closed at the
# end, the buckets ordered by their first member's index, descending. A change of
# the bucketing changes which residual keys a checkpoint holds: it must show here.
def _named(dtypes_numels):
    return [(f"p{i}", torch.nn.Parameter(torch.zeros(m, dtype=dt)))
            for i, (dt, m) in enumerate(dtypes_numels)]


def _spec(spec):
    return [(n, torch.nn.Parameter(torch.zeros(m, dtype=dt))) for n, dt, m in spec]


def _mlp():
    """A 16-32-32-10 MLP: float32 parameters of 2048, 128, 4096, 128, 1280 and
    40 bytes."""
    return list(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 10)).named_parameters())


F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
MODELS = {
    "mlp": _mlp,
    # every dtype, interleaved (bytes in their own dtype / in the float32 buckets):
    # emb 200/400, ln 16/32, proj 800, head 400, norm 60/120, out 240, scale 8,
    # gate 80/160
    "mixed": lambda: _spec([("emb", F16, 100), ("ln", BF16, 8), ("proj", F32, 200),
                            ("head", F64, 50), ("norm", F16, 30), ("out", F32, 60),
                            ("scale", F64, 1), ("gate", BF16, 40)]),
    # an empty parameter, one over the cap, one of exactly the cap (1000 bytes)
    "edges": lambda: _spec([("a", F32, 10), ("empty", F32, 0), ("big", F32, 1000),
                            ("b", F32, 5), ("c", F32, 250)]),
}

# (model, cap in bytes) -> {dtype rule: [(members, bucket dtype, bucket bytes)]};
# "same": the hook's rule (own_dtype) gives GradientSync's (accumulating_dtype)
GOLDEN = {
    # each parameter alone
    ("mlp", 1): {"same": [(["4.bias"], "float32", 40), (["4.weight"], "float32", 1280),
                          (["2.bias"], "float32", 128), (["2.weight"], "float32", 4096),
                          (["0.bias"], "float32", 128), (["0.weight"], "float32", 2048)]},
    # 40 + 1280 = 1320 closes at the cap itself
    ("mlp", 1320): {"same": [(["4.bias", "4.weight"], "float32", 1320),
                             (["2.bias", "2.weight"], "float32", 4224),
                             (["0.bias", "0.weight"], "float32", 2176)]},
    # 1448 < 2048, then 2.weight takes it to 5544; 0.bias and 0.weight close at 2176
    ("mlp", 2048): {"same": [(["4.bias", "4.weight", "2.bias", "2.weight"], "float32", 5544),
                             (["0.bias", "0.weight"], "float32", 2176)]},
    ("mlp", 25 << 20): {"same": [(["4.bias", "4.weight", "2.bias", "2.weight", "0.bias",
                                   "0.weight"], "float32", 7720)]},
    ("mixed", 1): {
        "accumulating": [(["gate"], "float32", 160), (["scale"], "float64", 8),
                         (["out"], "float32", 240), (["norm"], "float32", 120),
                         (["head"], "float64", 400), (["proj"], "float32", 800),
                         (["ln"], "float32", 32), (["emb"], "float32", 400)],
        "own": [(["gate"], "bfloat16", 80), (["scale"], "float64", 8),
                (["out"], "float32", 240), (["norm"], "float16", 60),
                (["head"], "float64", 400), (["proj"], "float32", 800),
                (["ln"], "bfloat16", 16), (["emb"], "float16", 200)]},
    # float32 buckets: gate + out = 400 closes at the cap; float64: scale + head
    ("mixed", 400): {
        "accumulating": [(["gate", "out"], "float32", 400), (["scale", "head"], "float64", 408),
                         (["norm", "proj"], "float32", 920), (["ln", "emb"], "float32", 432)],
        "own": [(["gate", "ln"], "bfloat16", 96), (["scale", "head"], "float64", 408),
                (["out", "proj"], "float32", 1040), (["norm", "emb"], "float16", 260)]},
    ("mixed", 1000): {
        "accumulating": [(["gate", "out", "norm", "proj"], "float32", 1320),
                         (["scale", "head"], "float64", 408), (["ln", "emb"], "float32", 432)],
        "own": [(["gate", "ln"], "bfloat16", 96), (["scale", "head"], "float64", 408),
                (["out", "proj"], "float32", 1040), (["norm", "emb"], "float16", 260)]},
    ("mixed", 25 << 20): {
        "accumulating": [(["gate", "out", "norm", "proj", "ln", "emb"], "float32", 1752),
                         (["scale", "head"], "float64", 408)],
        "own": [(["gate", "ln"], "bfloat16", 96), (["scale", "head"], "float64", 408),
                (["out", "proj"], "float32", 1040), (["norm", "emb"], "float16", 260)]},
    # an empty parameter closes nothing (0 bytes < 1): it goes with the next one
    ("edges", 1): {"same": [(["c"], "float32", 1000), (["b"], "float32", 20),
                            (["big"], "float32", 4000), (["empty", "a"], "float32", 40)]},
    # c alone is the cap; the parameter over the cap closes b's bucket
    ("edges", 1000): {"same": [(["c"], "float32", 1000), (["b", "big"], "float32", 4020),
                               (["empty", "a"], "float32", 40)]},
    ("edges", 1020): {"same": [(["c", "b"], "float32", 1020), (["big"], "float32", 4000),
                               (["empty", "a"], "float32", 40)]},
    ("edges", 25 << 20): {"same": [(["c", "b", "big", "empty", "a"], "float32", 5060)]},
}

RULES = {"accumulating": _buckets.accumulating_dtype, "own": _buckets.own_dtype}


def _bucketing(named, cap, rule):
    """plan_buckets of ``named`` with a cap of ``cap`` bytes, by name."""
    return [([named[i][0] for i in members], str(dt).replace("torch.", ""),
             sum(named[i][1].numel() for i in members) * dt.itemsize)
            for members, dt in _buckets.plan_buckets(named, cap / 2**20, RULES[rule])]


@pytest.mark.parametrize("model, cap", sorted(GOLDEN))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_bucketing_is_the_golden_one(model, cap, rule):
    """plan_buckets with GradientSync's dtype rule (accumulating) and the DDP
    hook's (own): the members of each bucket in bucket order, its dtype and
    its bytes, for an MLP, an interleaving of every dtype and the edge cases
    (an empty parameter, one larger than the cap, buckets of exactly the cap),
    from one bucket per parameter to one for all."""
    want = GOLDEN[model, cap]
    assert _bucketing(MODELS[model](), cap, rule) == want.get(rule, want.get("same"))


def test_gradient_sync_buckets_are_the_golden_ones():
    """make_buckets (GradientSync's buckets) of the MLP at 2048 bytes: the
    plan's members, each parameter's place in the flat buffer, and the
    residual keys (sha1 of the names and sizes) that checkpoints hold."""
    got = [(b.index, b.names, b.numels, b.offsets, b.n, str(b.dtype), b.key)
           for b in _buckets.make_buckets(_mlp(), 2048 / 2**20, True)]
    assert got == [
        (0, ["4.bias", "4.weight", "2.bias", "2.weight"], [10, 320, 32, 1024],
         [0, 10, 330, 362], 1386, "float32", "torch/4.bias..2.weight/8fa136f686d5"),
        (1, ["0.bias", "0.weight"], [32, 512], [0, 32], 544, "float32",
         "torch/0.bias..0.weight/b32f05fd9cd3")]


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


def test_states_and_put_of_keys_of_their_own():
    """FSDP's keys (one flat call each): states reads those of the keys that
    have residuals; put installs entries for the keys, forgets those left
    out and keeps other keys."""
    import mpigc
    fb = _store({"fsdp:a": np.arange(3), "fsdp:b": np.ones(2), "other": np.zeros(4)})
    res = _residuals(fb)
    got = res.states(["fsdp:a", "fsdp:b", "fsdp:c"])
    assert sorted(got) == ["fsdp:a", "fsdp:b"]
    assert got["fsdp:a"]["worker"].tolist() == [0, 1, 2]
    new = _store({"fsdp:c": np.full(2, 5)}).entries()
    res.put(["fsdp:a", "fsdp:b", "fsdp:c"], {"fsdp:b": _store({"x": np.zeros(2)}).entry("x"),
                                             **new})
    assert sorted(fb.state_dict()) == ["fsdp:b", "fsdp:c", "other"]
    assert fb.state_dict()["fsdp:b"]["worker"].tolist() == [0, 0]
    assert fb.state_dict()["fsdp:c"]["worker"].tolist() == [5, 5]
    txn = fb.begin("other", 4, np.float32, 1, 0)  # a call pending: no state
    try:
        with pytest.raises(mpigc.StateError):
            res.states(["fsdp:b"])
    finally:
        txn.end()


def test_load_keys_changes_all_keys_or_none():
    """load_keys: a build that fails raises, the store unchanged; one that
    succeeds installs its entries as put does."""
    import mpigc
    fb = _store({"fsdp:a": np.arange(3), "fsdp:b": np.ones(2)})
    res = _residuals(fb)

    def bad():
        raise mpigc.StateError("test: a bad record")
    with pytest.raises(mpigc.StateError, match="a bad record"):
        res.load_keys(["fsdp:a", "fsdp:b"], bad, "test")
    assert sorted(fb.state_dict()) == ["fsdp:a", "fsdp:b"]
    new = _store({"fsdp:a": np.full(3, 7)}).entries()
    assert res.load_keys(["fsdp:a", "fsdp:b"], lambda: new, "test") == new
    assert sorted(fb.state_dict()) == ["fsdp:a"]
    assert fb.state_dict()["fsdp:a"]["worker"].tolist() == [7, 7, 7]
