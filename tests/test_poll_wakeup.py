"""The wakeups of the waits that poll (mpigc._sched.poll, with several user
threads): since 9a9c715 the queue notifies them only while one is counted in
``_sched._polling``. No wakeup may be lost: a poller counts itself under the
engine lock before it sleeps, in the same hold of the lock as its check of
its condition, so a queue change made by another thread (which needs the
lock, free only while the poller sleeps) always sees the count and notifies;
and every end of a sleep (notified, timed out, raised) uncounts it. Real
threads; the order is forced by the lock and events, not by time."""
import threading

import pytest

from mpigc import _sched


class _Call:
    """A stand-in queued call (enqueue and dequeue read nothing of it)."""


class _Spy(threading.Condition):
    """``_sched._changed`` with its waits and notifications recorded."""

    def __init__(self, raise_in_wait=None):
        super().__init__(_sched.lock)
        self.sleeping = threading.Event()
        self.counts_in_wait = []
        self.notified = 0
        self.raise_in_wait = raise_in_wait

    def wait(self, timeout=None):
        self.counts_in_wait.append(_sched._polling)
        self.sleeping.set()
        if self.raise_in_wait is not None:
            raise self.raise_in_wait
        return super().wait(timeout)

    def notify_all(self):
        self.notified += 1
        super().notify_all()


@pytest.fixture
def spy(monkeypatch):
    assert _sched.idle() and _sched._polling == 0
    s = _Spy()
    monkeypatch.setattr(_sched, "_changed", s)
    return s


def test_a_queue_change_while_a_wait_polls_notifies_it(spy):
    """The other thread gets the lock only while the poller sleeps in the
    condition (it holds it everywhere else in poll): then the poller is
    counted, and queueing and finishing a call notify it."""
    flag = threading.Event()
    seen = {}
    errors = []

    def poller():
        try:
            with _sched.lock:
                _sched.poll(flag.is_set)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    t = threading.Thread(target=poller, daemon=True)
    t.start()
    assert spy.sleeping.wait(60), "the poller never slept"
    with _sched.lock:
        seen["count"] = _sched._polling
        call = _Call()
        _sched.enqueue(call)
        _sched.dequeue(call)
        flag.set()
    t.join(60)
    assert not t.is_alive(), "the poller did not return"
    assert not errors, errors
    assert seen["count"] == 1, "a poller asleep in the condition is not counted"
    assert spy.notified == 2, "queueing and finishing a call did not notify the poller"
    assert all(c == 1 for c in spy.counts_in_wait), spy.counts_in_wait
    assert _sched._polling == 0


def test_a_wait_that_raises_uncounts_itself(monkeypatch):
    """An exception out of the sleep (an interrupt) leaves no count behind:
    a stale count would only cost notifications, a missing one lose them."""
    s = _Spy(raise_in_wait=KeyboardInterrupt())
    monkeypatch.setattr(_sched, "_changed", s)
    with pytest.raises(KeyboardInterrupt):
        with _sched.lock:
            _sched.poll(lambda: False)
    assert s.counts_in_wait == [1]
    assert _sched._polling == 0


def test_waits_that_time_out_uncount_themselves(spy):
    """Many sleeps that time out (the condition met only after some rounds):
    each counted once while it sleeps, none left counted after."""
    rounds = iter(range(50))

    def done():
        return next(rounds, None) is None

    with _sched.lock:
        _sched.poll(done)
    assert spy.counts_in_wait and all(c == 1 for c in spy.counts_in_wait)
    assert _sched._polling == 0
