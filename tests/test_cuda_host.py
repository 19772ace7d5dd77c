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


@pytest.fixture
def fake_cuda(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(_cuda, "_numba_cuda", lambda: rec)
    monkeypatch.setattr(_cuda, "simulator", lambda: False)
    monkeypatch.setattr(_cuda, "engine_stream", lambda: "engine stream")
    return rec


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
