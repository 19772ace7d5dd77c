"""The host side of mpigc's GPU support, with mocks, no GPU and no simulator:
how CUDA-aware MPI is detected (``mpigc._cuda._probe``) and how the engine
orders its stream after the stream that produced a foreign device array
(``mpigc._cuda.wait_for_producer``)."""
import sys
import types

import numpy as np
import pytest

import mpigc
from mpigc import _cuda


# ----------------------------------------------------------------------------
# CUDA-aware MPI: mpi_memory_alloc_kinds, then MPIX_Query_cuda_support
# ----------------------------------------------------------------------------
class _Info:
    def __init__(self, kinds):
        self.kinds = kinds
        self.freed = False

    def Get(self, key):
        return self.kinds if key == "mpi_memory_alloc_kinds" else None

    def Free(self):
        self.freed = True


def _probe(monkeypatch, comm_kinds, env_kinds, mpix):
    """``_probe`` of a communicator whose info has ``comm_kinds``, with
    ``MPI_INFO_ENV`` holding ``env_kinds`` (None: no key) and
    ``MPIX_Query_cuda_support()`` answering ``mpix`` (None: not there)."""
    info = _Info(comm_kinds)
    fake_mpi = types.SimpleNamespace(INFO_NULL=object(), INFO_ENV=_Info(env_kinds))
    comm = types.SimpleNamespace(Get_info=lambda: info)
    monkeypatch.delenv("MPIGC_CUDA_AWARE", raising=False)
    monkeypatch.setattr(_cuda, "_MPI", lambda: fake_mpi)
    monkeypatch.setattr(_cuda, "_query_ompi_cuda_support", lambda: mpix)
    got = _cuda._probe(comm)
    assert info.freed
    return got


def test_alloc_kinds_without_cuda_asks_mpix(monkeypatch):
    """An MPI 4.1 library reports the kinds that were requested: ``mpi,system``
    says nothing about CUDA, so ``MPIX_Query_cuda_support`` decides (before
    issue 29 the probe stopped at the key and said "not aware")."""
    got = _probe(monkeypatch, "mpi,system", None, 1)
    assert got.aware is True
    assert got.source == ("mpi_memory_alloc_kinds='mpi,system' (communicator info) without "
                          "cuda; MPIX_Query_cuda_support()=1")
    got = _probe(monkeypatch, "mpi,system", None, 0)
    assert got.aware is False and got.source.endswith("MPIX_Query_cuda_support()=0")
    got = _probe(monkeypatch, "mpi,system", "mpi,system", None)
    assert got == (False, "mpi_memory_alloc_kinds='mpi,system' (communicator info) without "
                          "cuda; mpi_memory_alloc_kinds='mpi,system' (MPI_INFO_ENV) without "
                          "cuda; no MPIX_Query_cuda_support")


def test_alloc_kinds_with_cuda_decide(monkeypatch):
    """A key that lists CUDA memory answers yes, from the communicator or
    from ``MPI_INFO_ENV``, whatever MPIX says."""
    for comm_kinds, env_kinds, where in (("mpi,system,cuda:device", None, "communicator info"),
                                         (None, "mpi,cuda", "MPI_INFO_ENV"),
                                         ("mpi,system", "system,cuda", "MPI_INFO_ENV")):
        got = _probe(monkeypatch, comm_kinds, env_kinds, 0)
        assert got.aware is True and got.source.endswith(f"({where})"), got
    got = _probe(monkeypatch, "mpi,cuda:host", None, None)  # host memory only
    assert got.aware is False, got


def test_no_key_asks_mpix(monkeypatch):
    assert _probe(monkeypatch, None, None, 1) == (True, "MPIX_Query_cuda_support()=1")
    assert _probe(monkeypatch, None, None, None).source.startswith("not detected")


def test_environment_wins(monkeypatch):
    got = _probe(monkeypatch, "mpi,system", None, 1)
    assert got.aware
    monkeypatch.setenv("MPIGC_CUDA_AWARE", "0")
    assert _cuda._probe(types.SimpleNamespace()) == (False, "MPIGC_CUDA_AWARE=0")


# ----------------------------------------------------------------------------
# streams: the engine's stream after the producer's
# ----------------------------------------------------------------------------
class _Recorder:
    """A fake ``numba.cuda`` that records the stream operations."""

    def __init__(self):
        self.log = []
        outer = self

        class _Event:
            def record(self, stream):
                outer.log.append(("record", stream))

            def wait(self, stream):
                outer.log.append(("wait", stream))

        self._event = _Event

    def event(self, timing=True):
        assert timing is False
        return self._event()

    def external_stream(self, ptr):
        return f"stream {ptr:#x}"

    def legacy_default_stream(self):
        return "legacy stream"

    def per_thread_default_stream(self):
        return "per-thread stream"

    def as_cuda_array(self, a, sync=True):
        self.log.append(("as_cuda_array", sync))
        return a


class _Foreign:
    """A device array of another library: interface version 3 with a stream."""

    def __init__(self, stream):
        self.__cuda_array_interface__ = {"shape": (4,), "typestr": "<f4",
                                         "data": (0x1000, False), "version": 3,
                                         "strides": None}
        if stream is not ...:
            self.__cuda_array_interface__["stream"] = stream


def _fake(monkeypatch, mode):
    rec = _Recorder()
    monkeypatch.setattr(_cuda, "_numba_cuda", lambda: rec)
    monkeypatch.setattr(_cuda, "simulator", lambda: False)
    monkeypatch.setattr(_cuda, "engine_stream", lambda: "engine stream")
    monkeypatch.setattr(_cuda, "_events", __import__("threading").local())  # the fake's events
    monkeypatch.setattr(_cuda, "_stream_mode", [])
    monkeypatch.setenv("MPIGC_CUDA_STREAM", mode)
    return rec


@pytest.fixture
def fake_cuda(monkeypatch):
    """The legacy default stream (``MPIGC_CUDA_STREAM=0``)."""
    return _fake(monkeypatch, "0")


@pytest.fixture(params=["1", "nonblocking"])
def own_stream(request, monkeypatch):
    """A stream of mpigc's own, blocking (``MPIGC_CUDA_STREAM=1``) or not."""
    return _fake(monkeypatch, request.param), request.param


def test_producer_stream_is_waited_for_on_the_engine_stream(fake_cuda):
    """A stream named by the interface: an event recorded there and waited
    for on the engine's stream, before the array is taken (no host wait;
    whatever NUMBA_CUDA_ARRAY_INTERFACE_SYNC says: the array is taken with
    ``sync=False``)."""
    a = _Foreign(0xABC0)
    assert _cuda.as_device(a) is a
    assert fake_cuda.log == [("record", "stream 0xabc0"), ("wait", "engine stream"),
                             ("as_cuda_array", False)]


@pytest.mark.parametrize("stream", [None, 1, 2, ...])
def test_nothing_to_wait_for(fake_cuda, stream):
    """No stream (None, or a version 2 interface), the legacy stream (the
    engine's own) and a per-thread default stream (a blocking stream, which
    the legacy stream waits for by CUDA's rules): no event."""
    _cuda.as_device(_Foreign(stream))
    assert fake_cuda.log == [("as_cuda_array", False)]


@pytest.mark.parametrize("stream", [0, True, 1.5, "1"])
def test_invalid_interface_stream(fake_cuda, stream):
    with pytest.raises(mpigc.DTypeError, match="expected a stream of None, 1, 2"):
        _cuda.as_device(_Foreign(stream))


def _fake_torch(monkeypatch, current):
    """A fake ``torch`` module whose current stream has handle ``current``."""
    torch = types.ModuleType("torch")
    asked = []

    class Tensor:
        device = "cuda:1"

        def __init__(self):
            self.__cuda_array_interface__ = {"shape": (4,), "typestr": "<f4",
                                             "data": (0x2000, False), "version": 2,
                                             "strides": None}

    def current_stream(device):
        asked.append(device)
        return types.SimpleNamespace(cuda_stream=current)

    torch.Tensor = Tensor
    torch.cuda = types.SimpleNamespace(current_stream=current_stream)
    monkeypatch.setitem(sys.modules, "torch", torch)
    return Tensor, asked


def test_torch_tensor_made_on_a_side_stream(fake_cuda, monkeypatch):
    """torch's interface (version 2) has no stream: a torch tensor is ordered
    after torch's current stream on its device (torch's rule), here a side
    stream; before issue 29 nothing waited for it."""
    Tensor, asked = _fake_torch(monkeypatch, 0x7F00)
    t = Tensor()
    _cuda.as_device(t)
    assert asked == ["cuda:1"]
    assert fake_cuda.log == [("record", "stream 0x7f00"), ("wait", "engine stream"),
                             ("as_cuda_array", False)]


def test_torch_tensor_on_the_default_stream(fake_cuda, monkeypatch):
    """torch's default stream (handle 0) is the legacy stream, the engine's
    own: stream order suffices."""
    Tensor, _ = _fake_torch(monkeypatch, 0)
    _cuda.as_device(Tensor())
    assert fake_cuda.log == [("as_cuda_array", False)]


def test_numpy_is_not_a_producer(monkeypatch):
    """Only foreign device arrays are asked for a stream (torch absent)."""
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert _cuda.producer_stream(_Foreign(...)) is None
    assert _cuda.producer_stream(_Foreign(0x10)) == 0x10
    assert not hasattr(np.zeros(1), "__cuda_array_interface__")


# ----------------------------------------------------------------------------
# a stream of mpigc's own (MPIGC_CUDA_STREAM): the same order, no host wait
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [1, 2])
def test_own_stream_waits_for_the_default_streams(own_stream, stream):
    """A blocking stream of mpigc's own is ordered with the legacy and the
    per-thread default streams by CUDA's rules; a non-blocking one waits for
    them by an event."""
    fake, mode = own_stream
    _cuda.as_device(_Foreign(stream))
    name = {1: "legacy stream", 2: "per-thread stream"}[stream]
    want = [] if mode == "1" else [("record", name), ("wait", "engine stream")]
    assert fake.log == want + [("as_cuda_array", False)]


def test_own_stream_orders_the_producers_after_the_call(own_stream):
    """The streams the call's arrays came from are remembered at adoption and
    wait, at the call's end (``finish``), for an event of mpigc's stream; a
    non-blocking stream makes the legacy stream wait too. No host wait."""
    fake, mode = own_stream
    producers = []
    _cuda.as_device(_Foreign(0xABC0), producers)
    _cuda.as_device(_Foreign(0xABC0), producers)  # (once)
    _cuda.as_device(_Foreign(None), producers)
    assert producers == [0xABC0]
    del fake.log[:]
    _cuda.finish(producers)
    want = [("record", "engine stream"), ("wait", "stream 0xabc0")]
    if mode == "nonblocking":
        want.append(("wait", "legacy stream"))
    assert fake.log == want


def test_own_stream_numba_array_is_not_synchronised(own_stream):
    """A Numba array's own stream: an event, not ``synchronize()`` (the
    legacy default stream synchronises it, a host wait)."""
    fake, _ = own_stream

    class Stream:
        def synchronize(self):
            fake.log.append("synchronize")

        def __bool__(self):
            return True

    class Arr:
        __cuda_ndarray__ = True

    a = Arr()
    a.stream = Stream()
    producers = []
    assert _cuda.as_device(a, producers) is a
    assert fake.log == [("record", a.stream), ("wait", "engine stream")]
    assert producers == [a.stream]


def test_stream_mode_is_checked(monkeypatch):
    monkeypatch.setattr(_cuda, "_stream_mode", [])
    monkeypatch.setenv("MPIGC_CUDA_STREAM", "yes please")
    with pytest.raises(mpigc.ConfigError, match="MPIGC_CUDA_STREAM: expected 0, 1 or"):
        _cuda.own_stream()


def test_idle_wait_skipped_only_when_nothing_was_queued():
    """``host_wait(stream, idle_ok=True)`` (before MPI reads device memory,
    with a stream of mpigc's own) waits unless the calling thread waited on
    that stream since the last launch or copy mpigc queued (by any thread);
    a launch in another thread counts. In a subprocess with the simulator
    (this session imports no numba.cuda); the simulator's event counts its
    synchronisations."""
    import os
    import subprocess
    code = """
import threading
import numpy as np
from numba import cuda
from mpigc.kernels import cuda as kc
waits = []
cuda.event.synchronize = lambda self: waits.append(1)
s = cuda.stream()
x = cuda.to_device(np.ones(8, np.float32))
kc.host_wait(s, idle_ok=True)          # never waited here: waits
kc.host_wait(s, idle_ok=True)          # nothing queued since: no wait
kc.divide(x, 2.0, cuda_stream=s)       # a launch
kc.host_wait(s, idle_ok=True)          # waits
t = threading.Thread(target=lambda: kc.divide(x, 2.0, cuda_stream=s))
t.start(); t.join()                     # a launch in another thread
kc.host_wait(s, idle_ok=True)          # waits
kc.host_wait(s)                        # not idle_ok: waits
print(len(waits))
"""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["4"], r.stdout
