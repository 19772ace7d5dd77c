"""A call's settings and limits are named, frozen values (issue 51 item 2):
:func:`mpigc._settings.settings_for` returns a :class:`~mpigc._settings.Settings`
record, :func:`mpigc._wire.read_limits` a :class:`~mpigc._wire.Limits` value that
a call reads once and passes down (no module global rewritten), and
:mod:`mpigc._route` routes every call. No MPI."""
import numpy as np
import pytest

from mpigc import _route, _settings, _wire
from mpigc._errors import ConfigError

_LIMIT_VARS = ("MPIGC_INLINE_PLAIN_BYTES", "MPIGC_INLINE_PAYLOAD_BYTES", "MPIGC_MAX_COUNT")


@pytest.fixture
def no_limits(monkeypatch):
    for var in _LIMIT_VARS + ("MPIGC_NONFINITE", "MPIGC_MIN_COMPRESS_BYTES"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_limits_are_a_value_read_from_the_environment(no_limits):
    defaults = _wire.read_limits()
    assert defaults == _wire.Limits(_wire.INLINE_PLAIN_MAX, _wire.INLINE_PAYLOAD_MAX,
                                    _wire.MAX_COUNT)
    no_limits.setenv("MPIGC_MAX_COUNT", "1500")
    no_limits.setenv("MPIGC_INLINE_PLAIN_BYTES", "2048")
    small = _wire.read_limits()
    assert (small.inline_plain, small.inline_payload, small.max_count) == (
        2048, _wire.INLINE_PAYLOAD_MAX, 1500)
    # a value, not the module's state: the defaults stay what they were
    assert (_wire.INLINE_PLAIN_MAX, _wire.MAX_COUNT) == (1 << 20, (1 << 31) - 1)
    assert defaults.max_count == (1 << 31) - 1
    with pytest.raises(AttributeError):
        small.max_count = 7
    no_limits.setenv("MPIGC_MAX_COUNT", "0")
    with pytest.raises(ConfigError, match="MPIGC_MAX_COUNT"):
        _wire.read_limits()
    no_limits.delenv("MPIGC_MAX_COUNT")
    no_limits.delenv("MPIGC_INLINE_PLAIN_BYTES")
    assert _wire.read_limits() == defaults


def test_bytes_msg_takes_the_call_s_count_limit(no_limits):
    buf = np.zeros(100, np.uint8)
    msg, t = _wire.bytes_msg(buf, 100)
    assert t is None and len(msg) == 2
    msg, t = _wire.bytes_msg(buf, 40)
    assert t is not None and msg[1] == 1
    t.Free()


def test_settings_are_a_named_record_that_follows_the_limits_given(no_limits):
    f32 = np.dtype(np.float32)
    st = _settings.settings_for("allreduce", f32, 2, "none", {}, "w", False, "compressed",
                                None, 4000, None, _wire.Limits(1 << 20, 256 << 10, 1500))
    assert isinstance(st, _settings.Settings)
    assert st.plain and st.key == "w" and st.nonfinite == "raise" and not st.average
    assert st.bounds == [(0, 2000), (2000, 4000)]
    assert st.config["sum_pieces"] == 3  # 4000 elements, at most 1500 per MPI sum
    whole = _settings.settings_for("allreduce", f32, 2, "none", {}, "w", False,
                                   "compressed", None, 4000, None)
    assert "sum_pieces" not in whole.config and whole.fp != st.fp
    with pytest.raises(AttributeError):
        st.plain = False


def test_hierarchy_is_checked_by_the_router_before_anything():
    with pytest.raises(ConfigError, match="hierarchy must be one of"):
        _route.start("allreduce", np.zeros(4, np.float32), "none", {}, comm=None, key=None,
                     average=False, gather="compressed", feedback=None, nonfinite=None,
                     hierarchy="nodes", blocking=True)


def _prep(monkeypatch=None, **kw):
    from mpigc import _prepared
    args = dict(kind="allreduce", device=False, device_id=None, dtype=np.dtype(np.float32),
                n=1000, size=2, rank=0, op="none", params={}, key="k", average=False,
                gather="compressed", nonfinite=None, recvcounts=None)
    args.update(kw)
    return _prepared, args


def test_a_repeated_call_s_record_is_found_by_its_arguments(no_limits):
    """A call of the commonest signatures (a str op, no parameters, no
    recvcounts) finds its prepared record by its arguments and the raw
    environment (``_prepared.lookup``), without the full signature
    (``settings_key``: a few microseconds per call); a variable that shapes
    the call, a key of another type or a flag that is not a bool is another
    signature."""
    _prepared, args = _prep()
    no_limits.delenv("MPIGC_PLAN_CACHE", raising=False)
    rec = _prepared.prepare(**args, limits=_wire.read_limits())
    assert _prepared.lookup(**args) is rec
    assert rec.limits == _wire.read_limits()

    def no_key(*a, **k):
        raise AssertionError("the full signature was computed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_settings, "settings_key", no_key)
        assert _prepared.prepare(**args, limits=_wire.read_limits()) is rec
    for var, value in (("MPIGC_NONFINITE", "skip"), ("MPIGC_INLINE_PLAIN_BYTES", "16"),
                       ("MPIGC_MIN_COMPRESS_BYTES", "64"), ("MPIGC_CHUNK_BYTES", "4096"),
                       ("MPIGC_PLAN_CACHE", "1")):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(var, value)
            assert _prepared.lookup(**args) is None, var
    assert _prepared.lookup(**dict(args, key=1)) is None
    assert _prepared.lookup(**dict(args, average=1)) is None
    assert _prepared.lookup(**dict(args, params={"threshold": 0.5})) is None
    assert _prepared.lookup(**args) is rec
    # limits given that are not the environment's (a hierarchical call's
    # read at its start) are not served another call's record
    other = _wire.Limits(16, 16, 1 << 20)
    assert _prepared.prepare(**args, limits=other).limits == other
    assert _prepared.lookup(**args) is rec
    no_limits.setenv("MPIGC_PLAN_CACHE", "0")
    assert _prepared.lookup(**args) is None
    assert _prepared.prepare(**args, limits=_wire.read_limits()) is not rec


def test_a_call_completed_straight_through_is_waited_for_without_the_engine(monkeypatch):
    """A call that the short path completed (never queued) is its result at
    once: Request.wait takes no lock and drives no call."""
    from mpigc import _sched, _shortcall, _trace

    def driven(*a, **k):
        raise AssertionError("the engine drove a completed call")
    monkeypatch.setattr(_sched, "complete", driven)
    monkeypatch.setattr(_sched, "note_caller", driven)
    buf = np.zeros(3)
    assert _sched.Request(_shortcall.Done(buf, _trace.CallTrace())).wait() is buf


def test_a_host_call_s_backend_imports_nothing_per_call(monkeypatch):
    """The host backend's class and kernels are imported once, not at every
    call (an import statement costs about a microsecond of a small call)."""
    import builtins
    from mpigc import _dispatch
    buf = np.zeros(4)
    _dispatch.backend(buf)
    real, seen = builtins.__import__, []

    def imp(name, *a, **k):
        seen.append(name)
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", imp)
    be = _dispatch.backend(buf)
    monkeypatch.undo()
    assert seen == [] and not be.device


def test_the_queue_notifies_only_waits_that_poll(monkeypatch):
    """Queueing and finishing a call notify the waits that poll (with
    several user threads) only when one is waiting: a notification without
    a waiter costs about a microsecond of every call."""
    from mpigc import _sched

    class Changed:
        def notify_all(self):
            raise AssertionError("notified without a waiter")
    monkeypatch.setattr(_sched, "_changed", Changed())

    class Call:
        pass
    call = Call()
    with _sched.lock:
        _sched.enqueue(call)
        _sched.dequeue(call)
    assert _sched.idle()
