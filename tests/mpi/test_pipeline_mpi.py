"""Pipelined calls ($MPIGC_CHUNK_BYTES, issue 15): a large host buffer is cut
into chunks whose payloads travel while the next chunk is compressed, and
owners recompress a chunk of their shard as soon as it is reduced.

- the results and the residuals are the same bits as the unpipelined call,
  for every compressor that pipelines, both collectives, both gather modes,
  every dtype, averaging, uneven shards, over several steps;
- the non-finite counts travel after the last chunk: a bad value on one rank
  in the last chunk still raises on every rank with nothing changed, or skips
  (NaN everywhere) with the residuals as they were;
- ranks that disagree on the chunk size raise MismatchError everywhere;
- nonblocking pipelined calls complete in any wait order, and while the
  caller computes (the progress thread);
- the pipeline is really taken (``mpigc.diagnostics.counters()``).
"""
import time

import numpy as np
import pytest

import mpigc

from conftest import assert_all, grads, raises_everywhere
from peers import state_bytes

# ranks: flat calls only: 2 pairs, 3 uneven shards and chunks; 4 adds nothing
pytestmark = pytest.mark.ranks(1, 2, 3)

CHUNK = 1024  # bytes: every buffer below is cut into many chunks
OPS = {"2bit": "2bit", "1bit": {"id": "1bit", "block_size": 64},
       "2bit_rel": {"id": "2bit", "rel_threshold": 1.5, "block_size": 64},
       "fp16": "fp16", "bf16": "bf16"}


def _steps(comm, op, kind, dtype, n, gather="compressed", average=False, steps=3):
    fb = mpigc.ErrorFeedback()
    outs = []
    for s in range(steps):
        x = grads(comm.rank, n, dtype, seed=s)
        if kind == "allreduce":
            mpigc.allreduce(x, op, key="k", feedback=fb, gather=gather, average=average)
            outs.append(x.tobytes())
        else:
            outs.append(np.asarray(mpigc.reduce_scatter(x, op, key="k", feedback=fb,
                                                        average=average)).tobytes())
    return outs, state_bytes(fb)


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("kind,gather", [("allreduce", "compressed"),
                                         ("allreduce", "exact"),
                                         ("reduce_scatter", "compressed")])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_same_bits_as_unpipelined(comm, monkeypatch, starts, name, kind, gather, dtype):
    if comm.size < 2:
        pytest.skip("pipelining needs a peer")
    n = 4099  # shards of uneven length, pieces that end in partial blocks
    monkeypatch.setenv("MPIGC_CHUNK_BYTES", "0")
    ref = _steps(comm, OPS[name], kind, dtype, n, gather, average=(dtype == np.float64))
    assert_all(starts[0] == 0, "pipelined with MPIGC_CHUNK_BYTES=0")
    monkeypatch.setenv("MPIGC_CHUNK_BYTES", str(CHUNK))
    got = _steps(comm, OPS[name], kind, dtype, n, gather, average=(dtype == np.float64))
    assert_all(starts[0] == 3, f"{starts[0]} of 3 calls pipelined")
    assert_all(got[0] == ref[0], "results differ from the unpipelined call")
    assert_all(got[1] == ref[1], "residuals differ from the unpipelined call")


@pytest.mark.mpi
def test_terngrad_is_not_pipelined(comm, monkeypatch, starts):
    """terngrad quantizes only once the scale is agreed: never pipelined."""
    monkeypatch.setenv("MPIGC_CHUNK_BYTES", str(CHUNK))
    mpigc.allreduce(grads(comm.rank, 4000), "terngrad", key="t", feedback=mpigc.ErrorFeedback())
    assert_all(starts[0] == 0, "terngrad took the pipeline")


@pytest.mark.mpi
@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_nonfinite_in_the_last_chunk(comm, monkeypatch, starts, policy):
    """The count travels after the last chunk, once phase 1 is under way: a NaN
    on the last rank's last element still changes nothing anywhere."""
    if comm.size < 2:
        pytest.skip("needs a peer")
    monkeypatch.setenv("MPIGC_CHUNK_BYTES", str(CHUNK))
    fb = mpigc.ErrorFeedback()
    n = 5000
    mpigc.allreduce(grads(comm.rank, n), "2bit", key="k", feedback=fb)
    before = state_bytes(fb)
    x = grads(comm.rank, n, seed=1)
    if comm.rank == comm.size - 1:
        x[-1] = np.nan
    x0 = x.copy()
    if policy == "raise":
        raises_everywhere(mpigc.NonFiniteError,
                          lambda: mpigc.allreduce(x, "2bit", key="k", feedback=fb,
                                                  nonfinite="raise"),
                          match=f"rank {comm.size - 1} \\(1\\)")
        same = np.array_equal(x, x0, equal_nan=True)
        assert_all(same, "the buffer changed")
    else:
        mpigc.allreduce(x, "2bit", key="k", feedback=fb, nonfinite="skip")
        assert_all(np.isnan(x).all(), "a skipped call's result is not NaN")
        assert_all(fb.skipped_steps == 1, f"skipped_steps {fb.skipped_steps}")
    assert_all(state_bytes(fb) == before, "a residual or a call count changed")
    assert_all(starts[0] == 2, f"{starts[0]} of 2 calls pipelined")
    # the next call goes ahead as if the failed one had not happened
    y = grads(comm.rank, n, seed=2)
    mpigc.allreduce(y, "2bit", key="k", feedback=fb)
    assert_all(np.isfinite(y).all(), "the next call's result is not finite")


@pytest.mark.mpi
def test_chunk_size_mismatch_raises_everywhere(comm, monkeypatch):
    if comm.size < 2:
        pytest.skip("needs a peer")
    fb = mpigc.ErrorFeedback()
    monkeypatch.setenv("MPIGC_CHUNK_BYTES", "0" if comm.rank == 0 else str(CHUNK))
    x = grads(comm.rank, 5000)
    x0 = x.copy()
    raises_everywhere(mpigc.MismatchError,
                      lambda: mpigc.allreduce(x, "1bit", key="k", feedback=fb),
                      match="chunking.*MPIGC_CHUNK_BYTES")
    assert_all(np.array_equal(x, x0), "the buffer changed")
    assert_all(fb.state_dict() == {}, "a residual was created")


@pytest.mark.mpi
def test_bad_chunk_size_raises_everywhere(comm, monkeypatch):
    if comm.size < 2:
        pytest.skip("needs a peer")
    monkeypatch.setenv("MPIGC_CHUNK_BYTES", "-5" if comm.rank == 0 else str(CHUNK))
    raises_everywhere(mpigc.ConfigError,
                      lambda: mpigc.allreduce(grads(comm.rank, 5000), "2bit", key="k",
                                              feedback=mpigc.ErrorFeedback()),
                      match="MPIGC_CHUNK_BYTES")


@pytest.mark.mpi
def test_nonblocking_pipelined_calls_any_wait_order(comm, monkeypatch, starts):
    if comm.size < 2:
        pytest.skip("needs a peer")
    n = 6000
    monkeypatch.setenv("MPIGC_CHUNK_BYTES", "0")
    ref = []
    fb = mpigc.ErrorFeedback()
    for i, op in enumerate(["2bit", "1bit", "fp16"]):
        x = grads(comm.rank, n, seed=i)
        mpigc.allreduce(x, op, key=f"k{i}", feedback=fb)
        ref.append(x)
    monkeypatch.setenv("MPIGC_CHUNK_BYTES", str(CHUNK))
    fb = mpigc.ErrorFeedback()
    xs = [grads(comm.rank, n, seed=i) for i in range(3)]
    reqs = [mpigc.iallreduce(x, op, key=f"k{i}", feedback=fb)
            for i, (x, op) in enumerate(zip(xs, ["2bit", "1bit", "fp16"]))]
    for req in reversed(reqs):
        req.wait()
    assert_all(all(np.array_equal(a, b) for a, b in zip(xs, ref)),
               "nonblocking pipelined results differ")
    assert_all(starts[0] == 3, f"{starts[0]} of 3 calls pipelined")


@pytest.mark.mpi
def test_pipelined_call_progresses_while_the_caller_computes(comm, monkeypatch):
    """With the progress thread, a pipelined iallreduce completes while the
    caller is in numpy and makes no MPI call (observed through req.done)."""
    if comm.size < 2:
        pytest.skip("needs a peer")
    if not mpigc.diagnostics.progress_thread_enabled():
        pytest.skip("no progress thread (MPI_THREAD_MULTIPLE not granted or turned off)")
    monkeypatch.setenv("MPIGC_CHUNK_BYTES", str(CHUNK))
    x = grads(comm.rank, 20000)
    req = mpigc.iallreduce(x, "2bit", key="p", feedback=mpigc.ErrorFeedback())
    a = np.random.default_rng(0).standard_normal((200, 200))
    deadline = time.monotonic() + 60
    while not req.done and time.monotonic() < deadline:
        a = np.tanh(a @ a.T / 200.0)  # compute, no MPI call
    done = req.done
    req.wait()
    assert_all(done, "the call did not complete while the caller computed (60 s)")
