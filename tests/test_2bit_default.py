"""One meaning of "2bit" in the core API (issue 45 item 1): ``op="2bit"``
without a threshold is the relative mode (``rel_threshold=1.5``), an explicit
``threshold=`` is MXNet's absolute mode with MXNet's bytes, and an absolute
threshold that lets almost nothing through warns once per rank per key, with
the same watch as the torch layer's (``mpigc._threshold``). One process (a
world of one rank); averaging over ranks is in ``tests/mpi/test_allreduce_mpi.py``."""
import warnings

import numpy as np
import pytest

import mpigc
from mpigc import _threshold


@pytest.fixture(autouse=True)
def quick_watch(monkeypatch):
    monkeypatch.setattr(_threshold.ThresholdWatch, "SETTLE", 1)
    monkeypatch.setattr(_threshold.ThresholdWatch, "STEPS", 3)
    monkeypatch.setattr(_threshold, "_WATCHES", {})


def _grad(step, n=4096):
    # a gradient far below MXNet's threshold 0.5 (16 KiB: above the cutoff)
    return (np.random.default_rng(step).standard_normal(n) * 1e-3).astype(np.float32)


def _steps(nsteps=6, **kw):
    fb = mpigc.ErrorFeedback()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for step in range(nsteps):
            g = _grad(step)
            mpigc.allreduce(g, feedback=fb, **kw)
    return [m for m in w if "absolute threshold" in str(m.message)], g, fb


def test_op_2bit_is_the_relative_mode():
    _, g, fb = _steps(1, op="2bit", key="w")
    rel = {"id": "2bit", "rel_threshold": 1.5, "block_size": 1024, "error_feedback": True}
    assert fb.state_dict()["w"]["config"] == rel
    assert np.count_nonzero(g) > 0  # something was sent at the first step
    _, g, fb = _steps(1, op={"type": "2bit"}, key="w")
    assert fb.state_dict()["w"]["config"] == rel


def test_explicit_threshold_is_mxnet_absolute_mode_bit_for_bit():
    """threshold=0.5 gives MXNet's bytes (the README's example, golden)."""
    c = mpigc.get_compressor("2bit", threshold=2.0)
    x = np.array([0.5, 3.1, -1.0, -2.0, 2.0, 0.1, 1.9, -7.0], np.float32)
    assert c.compress(x).tolist() == [0x32, 0xC2]
    _, g, fb = _steps(1, op="2bit", key="w", threshold=0.5)
    assert fb.state_dict()["w"]["config"] == {"id": "2bit", "threshold": 0.5,
                                              "error_feedback": True}
    assert not g.any()  # 1e-3 gradients never reach 0.5 in one step


def test_absolute_threshold_that_sends_nothing_warns_once_per_key():
    got, _, _ = _steps(8, op="2bit", key="w", threshold=0.5)
    assert len(got) == 1, [str(m.message) for m in got]
    m = got[0]
    assert m.category is UserWarning and m.filename == __file__
    text = str(m.message)
    assert "mpigc.allreduce (key 'w')" in text and "0.5" in text and "rel_threshold" in text
    # the dict form, another key: its own warning
    got, _, _ = _steps(8, op={"type": "2bit", "threshold": 0.5}, key="v")
    assert len(got) == 1 and "key 'v'" in str(got[0].message)


@pytest.mark.parametrize("kw", [{"op": "2bit"}, {"op": "2bit", "threshold": 1e-4},
                                {"op": "1bit"}, {"op": "none"}],
                         ids=["relative", "absolute-of-the-scale", "1bit", "none"])
def test_no_warning_when_values_get_through(kw):
    got, _, _ = _steps(8, key="w", **kw)
    assert not got, [str(m.message) for m in got]


def test_torch_layer_uses_the_core_watch():
    torch_common = pytest.importorskip("mpigc.torch._common")
    assert issubclass(torch_common.ThresholdWatch, _threshold.ThresholdWatch)
    assert not hasattr(torch_common, "TORCH_2BIT_DEFAULT")
    assert torch_common.torch_compressor("2bit", {}) == mpigc.get_compressor("2bit")


def test_config_change_hint_names_the_old_default_and_the_fix():
    """Residuals saved under the old meaning of "2bit" (MXNet's 0.5), used
    with the new one: the words that checks comparing configs give."""
    from mpigc.compressors import config_change_hint
    old = {"id": "2bit", "threshold": 0.5, "error_feedback": True}
    hint = config_change_hint(old, mpigc.get_compressor("2bit").get_config())
    assert "threshold=0.5" in hint and "rel_threshold=1.5" in hint, hint
    assert config_change_hint(old, old) == ""
    assert config_change_hint({"id": "1bit"}, mpigc.get_compressor("2bit").get_config()) == ""
    assert config_change_hint({"id": "nope"}, old) == ""


def test_the_watch_counts_other_cpu_arrays():
    """A torch CPU tensor (or any CPU array the call takes) is watched as a
    numpy array is."""
    torch = pytest.importorskip("torch")
    fb = mpigc.ErrorFeedback()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for step in range(8):
            t = torch.from_numpy(_grad(step))
            assert mpigc.allreduce(t, op="2bit", threshold=0.5, key="t", feedback=fb) is t
            m = memoryview(bytearray(_grad(step).tobytes())).cast("f")
            mpigc.allreduce(m, op="2bit", threshold=0.5, key="m", feedback=fb)
    got = [str(m.message) for m in w if "absolute threshold" in str(m.message)]
    assert len(got) == 2 and "key 't'" in got[0] and "key 'm'" in got[1], got
