"""op="auto"'s model and decision without mpirun (issue 48, mpigc/_auto.py):
the fit, the decision from agreed sums only, the first calls, pins, probes,
hysteresis. The MPI side (every rank alike, conservation, errors on every
rank): tests/mpi/test_auto_mpi.py."""
import math

import numpy as np
import pytest

from mpigc import _auto, _auto_model
from mpigc._errors import ConfigError

NONE = ("allreduce", "none")
COMP = ("allreduce", "compressed", "cfg")
SERIES = ("allreduce", "compressed", "cfg")


def _merge(m, label, samples, also=()):
    """One agreement step of one rank whose calls of ``label`` took
    ``samples`` [(bytes, seconds)] (and ``also``: more (label, samples))."""
    r = _auto_model.Model()
    r.warm.update(range(_auto_model.NSLOTS))  # no warm-up call to leave out
    for lab, smp in ((label, samples),) + tuple(also):
        for b, t in smp:
            r.record(r.slot(lab), b, t)
    m.merge(_auto_model.post_table(r.local))


def test_fit_recovers_latency_and_bandwidth():
    # T = 100 µs + bytes / 1 GB/s
    m = _auto_model.Model()
    _merge(m, NONE, [(b, 100e-6 + b / 1e9) for b in (1 << 20, 4 << 20, 16 << 20)])
    f = m.fit(NONE)
    assert f.count == 3
    assert f.latency == pytest.approx(100e-6, rel=0.05)
    assert f.bandwidth == pytest.approx(1e9, rel=0.05)
    assert f.predict(8 << 20) == pytest.approx(100e-6 + (8 << 20) / 1e9, rel=0.01)


def test_a_point_is_the_fastest_time_seen_there():
    """A call slowed by other load does not move the model: per size, the
    fastest of the window (each step: the ranks' fastest, averaged)."""
    m = _auto_model.Model()
    _merge(m, NONE, [(1 << 20, 2e-3), (1 << 20, 9e-3), (1 << 20, 2.5e-3)])
    _merge(m, NONE, [(1 << 20, 40e-3)])
    f = m.fit(NONE)
    assert f.count == 4 and f.predict(1 << 20) == pytest.approx(2e-3)


def test_fit_of_one_size_goes_through_the_origin_and_none_without_samples():
    f = _auto_model.fit_points([(1024.0, 2000.0)], 4)
    assert f.latency == 0 and f.predict(1 << 20) == pytest.approx(2e-3)
    assert _auto_model.fit_points([], 0) is None
    assert _auto_model.Model().fit(NONE) is None
    # a falling time with size: no negative slope
    f = _auto_model.fit_points([(1024.0, 3000.0), (4096.0, 1000.0)], 2)
    assert f.bandwidth == math.inf and f.latency == pytest.approx(2e-3)


def _model(none=None, comp=None):
    m = _auto_model.Model()
    _merge(m, NONE, none or [], also=[(COMP, comp or [])])
    return m


def _decide(m, nbytes=1 << 20, pin="model", small=False, size=1):
    return m.decide(SERIES, NONE, COMP, nbytes, pin, small, "2bit", size)


def test_the_first_calls_alternate_compressor_first_until_both_have_samples():
    m = _auto_model.Model()
    got = [_decide(m) for _ in range(6)]
    assert [(d.op, d.reason) for d in got] == [("2bit", "measuring"), ("none", "measuring")] * 3
    assert all(d.predicted_none is None and d.predicted_compressed is None for d in got)
    # one op with enough samples is not enough; per rank: 2 samples x 3 ranks
    m = _model(none=[(1 << 20, 1e-3)] * 6, comp=[(1 << 20, 5e-3)] * 5)
    assert (m.fit(NONE).count, m.fit(COMP).count) == (6, 5)
    assert _decide(m, size=3).reason == "measuring"
    assert _decide(m, size=2).reason == "model"


def test_the_model_takes_the_faster_op_at_the_calls_size():
    # plain: 50 µs + 1 GB/s; 2bit: 2 ms + 4 GB/s; crossover near 2.6 MB
    none = [(b, 50e-6 + b / 1e9) for b in (1 << 20, 8 << 20)] * 2
    comp = [(b, 2e-3 + b / 4e9) for b in (1 << 20, 8 << 20)] * 2
    small = _decide(_model(none, comp), nbytes=1 << 20)
    big = _decide(_model(none, comp), nbytes=32 << 20)
    assert (small.op, small.reason) == ("none", "model")
    assert (big.op, big.reason) == ("2bit", "model")
    assert big.predicted_compressed < big.predicted_none


def test_local_samples_reach_no_decision_before_they_are_agreed():
    m = _model(none=[(1 << 20, 1e-3)] * 4, comp=[(1 << 20, 5e-3)] * 4)
    before = _decide(m)
    for _ in range(50):  # this rank alone finds the compressor 100x faster
        m.record(m.slot(COMP), 1 << 20, 1e-5)
    assert m.local.any()
    after = _decide(m)
    assert (before.op, after.op) == ("none", "none")
    assert after.predicted_compressed == before.predicted_compressed


def test_a_decided_series_does_not_measure_again_when_the_other_op_ages_out():
    m = _model(none=[(1 << 20, 1e-3)] * 4, comp=[(1 << 20, 5e-3)] * 4)
    assert _decide(m).reason == "model"
    for _ in range(_auto_model.WINDOW):  # only none runs: 2bit's figures leave the window
        _merge(m, NONE, [(1 << 20, 1e-3)])
    assert m.fit(COMP) is None
    d = _decide(m)
    assert (d.op, d.reason, d.predicted_compressed) == ("none", "model", None)


def test_hysteresis_keeps_the_last_decision_when_the_other_is_barely_faster():
    m = _model(none=[(1 << 20, 1.00e-3)] * 4, comp=[(1 << 20, 1.02e-3)] * 4)
    assert _decide(m).op == "none"
    _merge(m, COMP, [(1 << 20, 0.98e-3)])  # 2% faster now
    assert _decide(m).op == "none"
    _merge(m, COMP, [(1 << 20, 0.5e-3)])
    assert _decide(m).op == "2bit"


def test_pins_small_calls_and_probes(monkeypatch):
    m = _model(none=[(1 << 20, 1e-3)] * 4, comp=[(1 << 20, 5e-3)] * 4)
    assert (_decide(m, pin="compressed").op, _decide(m, pin="compressed").reason) == (
        "2bit", "pinned")
    assert _decide(m, pin="none").op == "none"
    assert (_decide(m, small=True).op, _decide(m, small=True).reason) == ("none", "small")
    monkeypatch.setenv("MPIGC_AUTO_PROBE", "4")
    m = _model(none=[(1 << 20, 1e-3)] * 4, comp=[(1 << 20, 5e-3)] * 4)
    got = [(d.op, d.reason) for d in (_decide(m) for _ in range(8))]
    assert got == [("none", "model")] * 3 + [("2bit", "probe")] + [("none", "model")] * 3 + [
        ("2bit", "probe")]
    monkeypatch.setenv("MPIGC_AUTO_PROBE", "0")
    assert all(_decide(m).reason == "model" for _ in range(10))


def _call(m, label=SERIES):
    """One op="auto" call's bookkeeping as mpigc._auto makes it: its entry
    and decision."""
    e = m.enter()
    try:
        d = m.decide(label, NONE, (label[0], label[1], label[2]), 1 << 20, "model", False,
                     "2bit", 1)
        m.slot(NONE if d.op == "none" else label)
    finally:
        m.decided()
    return e, d


def test_model_steps_are_the_first_call_and_the_agreement_steps():
    m = _auto_model.Model()
    steps = [i for i in range(100) if _call(m)[0].step]
    assert steps == [0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64, 80, 96]


def test_a_failed_call_is_undone_in_the_model():
    """Its index, its series' count and the slots it gave: the next call is
    the one it would have been (as on a rank that did not make it)."""
    m, ref = _auto_model.Model(), _auto_model.Model()
    for _ in range(3):
        m.close(_call(m)[0], True)
        ref.close(_call(ref)[0], True)
    e, _ = _call(m, ("reduce_scatter", "", "other"))  # a new series and label
    m.close(e, False)
    assert (m.calls, m.series, m.slots, m.log) == (ref.calls, ref.series, ref.slots, [])
    got, want = _call(m), _call(ref)
    assert (got[0].index, got[0].step, got[1]) == (want[0].index, want[0].step, want[1])


def test_only_a_failed_suffix_of_calls_in_flight_is_undone():
    m = _auto_model.Model()
    a, _ = _call(m)
    b, _ = _call(m)
    m.close(b, False)            # a still in flight: b undone
    assert m.calls == 1 and m.series[SERIES][0] == 1
    c, _ = _call(m)
    assert c.index == 1
    m.close(a, False)            # c in flight: a stays counted
    assert m.calls == 2
    m.close(c, False)            # now a and c, the failed suffix
    assert m.calls == 0 and SERIES not in m.series and m.log == []
    a, _ = _call(m)
    b, _ = _call(m)
    m.close(a, False)
    m.close(b, True)             # b went through: a can no longer be undone
    assert m.calls == 2 and m.log == []
    m.close(a, False)
    assert m.calls == 2


def test_a_failed_agreement_step_gives_back_the_sums_it_took_in():
    """A step that failed (on a rank that counted a call the others did
    not, it paired with their call that is no step) is undone with the sums
    it merged: the window, the fits and the step count as before it, the
    sums waiting for the next step, which takes them in as the ranks that
    did not count the call do."""
    r = _auto_model.Model()
    r.warm.update(range(_auto_model.NSLOTS))
    r.record(r.slot(NONE), 1 << 20, 1e-3)
    sums = _auto_model.post_table(r.local)
    m, ref = _auto_model.Model(), _auto_model.Model()
    for x in (m, ref):
        for _ in range(3):
            x.close(_call(x)[0], True)
        x.pending = sums
    extra, _ = _call(m)              # a call of this rank only: m's next is the step
    step, _ = _call(m)
    assert step.step and m.syncs == 1 and m.pending is None and m.fit(NONE) is not None
    m.close(step, False)
    m.close(extra, False)
    assert (m.calls, m.syncs, m.agreed, m.fits, list(m.window)) == (3, 0, {}, {}, [])
    assert m.pending is sums
    for _ in range(2):               # calls 3, then 4: the step
        got, want = _call(m), _call(ref)
        assert (got[0].index, got[0].step, got[1]) == (want[0].index, want[0].step, want[1])
    assert (m.syncs, m.agreed, m.fit(NONE)) == (1, ref.agreed, ref.fit(NONE))
    assert m.fit(NONE) is not None


def test_the_mark_compares_the_calls_index_modulo_a_few():
    """A call started while a call of some ranks only was in flight has
    another index there: its agreement fails (MismatchError everywhere)
    instead of letting the models part."""
    m = _auto_model.Model()
    marks = [_auto._mark("model", "cfg", _call(m)[0]) for _ in range(20)]
    assert len(set(marks[1:_auto_model.INDEX_MOD + 1])) == _auto_model.INDEX_MOD
    assert "model step" in marks[0] and "model step" in marks[4]
    assert marks[1] == marks[1 + _auto_model.INDEX_MOD] and marks[1] != marks[2]


def test_slots_do_not_depend_on_the_order_of_first_use():
    a, b = _auto_model.Model(), _auto_model.Model()
    labels = [NONE, COMP, ("reduce_scatter", "none"), ("reduce_scatter", "", "x")]
    first = [a.slot(x) for x in labels]
    second = [b.slot(x) for x in reversed(labels)]
    assert first == list(reversed(second))
    assert all(0 <= s < _auto_model.NSLOTS for s in first)


def test_labels_of_one_crc_get_slots_of_their_own():
    """(allreduce, exact, 2bit) and (reduce_scatter, fp16) share a CRC slot."""
    import mpigc
    cfg = {op: repr(sorted(mpigc.get_compressor(op).get_config().items()))
           for op in ("2bit", "1bit", "fp16")}
    a, b = ("allreduce", "exact", cfg["2bit"]), ("reduce_scatter", "", cfg["fp16"])
    m = _auto_model.Model()
    assert m.slot(a) != m.slot(b)
    assert m.slot(a) == m.slot(a)
    labels = [(k, g, c) for k in ("allreduce", "reduce_scatter") for g in ("", "exact")
              for c in cfg.values()] + [a, b, NONE, COMP]
    assert len({m.slot(x) for x in labels}) == len(set(labels))


def test_size_buckets():
    assert [_auto_model.bucket(b) for b in (0, (16 << 10) - 1, 16 << 10, 64 << 10, 1 << 20)] == [
        0, 0, 1, 2, 4]
    assert _auto_model.bucket(1 << 60) == _auto_model.NBUCKETS - 1


def test_the_window_forgets_old_sums():
    m = _auto_model.Model()
    for i in range(_auto_model.WINDOW + 3):
        _merge(m, NONE, [(1 << 20, 1e-3 if i < 3 else 2e-3)])
    assert m.fit(NONE).count == _auto_model.WINDOW
    assert m.fit(NONE).predict(1 << 20) == pytest.approx(2e-3, rel=0.01)


@pytest.mark.parametrize("env,value", [("MPIGC_AUTO_PROBE", "-1"),
                                       ("MPIGC_AUTO_PROBE", "x")])
def test_bad_environment_raises_config_error(monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    with pytest.raises(ConfigError):
        _auto.probe_every()


def test_the_refused_op_raises_its_message_wherever_it_is_read():
    r = _auto._Refused("auto_pin must be one of ...")
    with pytest.raises(ConfigError, match="auto_pin"):
        r.codec_id
    with pytest.raises(ConfigError, match="auto_pin"):
        r.get_config()


def test_the_timeline_says_what_ran_and_why(tmp_path):
    """One rank: each op="auto" call has an 'auto' event with its decision."""
    import json

    import mpigc
    from mpi4py import MPI
    comm = MPI.COMM_WORLD.Dup()
    mpigc.timeline.start(str(tmp_path / "t.json"))
    try:
        for _ in range(3):
            mpigc.allreduce(np.ones(1 << 14, np.float32), op="auto", key="tl", comm=comm,
                            feedback=mpigc.ErrorFeedback())
    finally:
        path = mpigc.timeline.stop()
    events = json.load(open(path))["traceEvents"]
    auto = [e["args"] for e in events if e.get("name") == "auto"]
    assert [(a["op"], a["reason"]) for a in auto] == [
        ("2bit", "measuring"), ("none", "measuring"), ("2bit", "measuring")]
    _auto.model_of(comm).settle()
    comm.Free()
