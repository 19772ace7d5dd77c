"""Compressed allreduce, blocking and nonblocking."""
from typing import Literal, Optional, Sequence, Union

import numpy as np
from mpi4py import MPI

from . import _auto
from ._sched import Request
from ._route import start
from ._threshold import observe_allreduce
from .compressors import Compressor
from .feedback import ErrorFeedback

Op = Union[str, dict, Compressor]
#: one array, or a group of them (a grouped call)
Buf = Union[np.ndarray, Sequence[np.ndarray]]
#: a key, or a group's keys
Key = Union[str, int, Sequence[Union[str, int]], None]

__all__ = ["allreduce", "iallreduce"]


def allreduce(buf: Buf, op: Op = "2bit", *, comm: Optional[MPI.Intracomm] = None,
              key: Key = None, average: bool = False,
              gather: Literal["compressed", "exact"] = "compressed",
              feedback: Union[ErrorFeedback, bool, None] = None,
              nonfinite: Optional[str] = None,
              hierarchy: Literal["auto", "flat", "node"] = "flat", auto_op: Op = "2bit",
              auto_pin: Optional[str] = None, **params) -> np.ndarray:
    """Sum ``buf`` over all ranks, in place, with a compressed exchange.

    Parameters
    ----------
    buf : numpy.ndarray, a CPU array that exposes its memory (torch CPU tensor,
        buffer protocol, ``__array_interface__``, DLPack), a CUDA device array,
        or a list or tuple of them
        float16, float32 or float64, C-contiguous, writable, same size on
        every rank. Overwritten with the (decompressed) result. A list is a
        grouped call: its arrays (one side, one dtype) are reduced in one
        exchange, each under its own key (see ``key``), and the list is
        returned (``docs/user-guide.md``, "Grouped calls").
    op : str, dict or Compressor
        ``"none"``, ``"fp16"``, ``"bf16"``, ``"2bit"``, ``"1bit"``, ``"terngrad"``; an
        MXNet-style dict ``{"type": "2bit", "threshold": 0.5}``; or a
        compressor object. ``"none"`` is exactly ``MPI_Allreduce``.
        ``"auto"``: per call ``"none"`` or ``auto_op``, whichever the
        communicator's cost model, measured while the job runs, predicts
        faster (host arrays, ``hierarchy="flat"``; ``docs/user-guide.md``,
        "op='auto'"); ``**params`` are ``auto_op``'s.
    comm : mpi4py.MPI.Intracomm, optional
        Default ``MPI.COMM_WORLD``. mpigc communicates on a private
        duplicate of it.
    key : str or int, optional
        Names the residuals (error feedback) of this buffer, e.g. a
        parameter name; they persist between calls with the same key.
        Default: ``"auto/{n}/{dtype}"``, i.e. calls without a key share one
        residual per size and dtype, so pass a key whenever you reduce
        several buffers of the same size per step. A grouped call takes a
        list of keys, one per array, or one key ``k`` (array i's is
        ``"k/i"``); default ``"auto/group/{i}/{n}/{dtype}"``.
    average : bool
        Divide the sum by the number of ranks.
    gather : {"compressed", "exact"}
        How the reduced shards travel back (see ``docs/user-guide.md``):
        recompressed with the owner's error feedback (default, 1/16 of the
        traffic for 2bit), or losslessly (MXNet's dist_sync semantics: the
        result is exactly the sum of the decoded payloads).
    feedback : ErrorFeedback or False, optional
        The residual store; default the process-wide one. ``False``: no
        error feedback and no state for this call.
    nonfinite : {"raise", "skip", "ignore"}, optional
        What a NaN or Inf in any rank's input does. ``"raise"`` (default, or
        ``$MPIGC_NONFINITE``): :class:`NonFiniteError` on every rank, nothing
        changed. ``"skip"``: no error, residuals unchanged, ``buf`` filled with
        NaN on every rank (as an uncompressed allreduce would propagate it), so
        a loss scaler skips the step. ``"ignore"``: no check (the residuals
        take the NaN).
    hierarchy : {"flat", "auto", "node"}
        ``"flat"`` (default): every rank exchanges compressed shards with
        every other. ``"node"``: reduce exactly inside each node and
        compress only between nodes (``docs/cluster.md``); ``"auto"``:
        ``"node"`` when the communicator spans several nodes and a node holds
        several ranks, else ``"flat"`` (device arrays too: their intra-node
        steps are staged through host memory). Not the default: on the
        2-core emulated 2-node cluster it was faster than flat only where the
        links were slow (100 Mbit/s), not at 1 Gbit/s. Must be the
        same on every rank. Hierarchical calls keep their own residuals (keys
        ``"{key}@hier[...]"``).
    auto_op : str, dict or Compressor
        With ``op="auto"``: the compressor it may choose (default ``"2bit"``,
        the relative mode). Ignored otherwise.
    auto_pin : {"model", "none", "compressed"}, optional
        With ``op="auto"``: ``"none"`` or ``"compressed"`` pins the decision
        (the model still measures); default ``$MPIGC_AUTO_PIN`` or ``"model"``.
    **params
        Compressor parameters, e.g. ``threshold=0.5``.

    Returns
    -------
    buf

    Raises
    ------
    MpigcError
        On every rank, when any rank's input is bad or ranks disagree;
        no buffer and no residual is changed then.
    """
    if isinstance(op, str) and op == "auto":
        return _auto.start("allreduce", buf, params, auto_op=auto_op, auto_pin=auto_pin,
                           comm=comm, key=key, average=average, gather=gather,
                           feedback=feedback, nonfinite=nonfinite, hierarchy=hierarchy,
                           blocking=True).wait()
    req = start("allreduce", buf, op, params, comm=comm, key=key, average=average,
                gather=gather, feedback=feedback, nonfinite=nonfinite, hierarchy=hierarchy,
                blocking=True)
    out = Request(req).wait()
    # warns once per key when 2bit's absolute threshold sends almost nothing
    observe_allreduce(buf, op, params, key)
    return out


def iallreduce(buf: Buf, op: Op = "2bit", *, comm: Optional[MPI.Intracomm] = None,
               key: Key = None, average: bool = False,
               gather: Literal["compressed", "exact"] = "compressed",
               feedback: Union[ErrorFeedback, bool, None] = None,
               nonfinite: Optional[str] = None,
               hierarchy: Literal["auto", "flat", "node"] = "flat", auto_op: Op = "2bit",
               auto_pin: Optional[str] = None, **params) -> Request:
    """Nonblocking :func:`allreduce`: compresses now, returns a :class:`Request`.

    ``buf`` must not be touched until ``request.wait()`` returned. A
    background thread advances the request while the caller computes (when
    MPI grants ``MPI_THREAD_MULTIPLE``; ``MPIGC_PROGRESS_THREAD=0`` turns it
    off), and ``test()`` and ``wait()`` always do. Requests may be outstanding on
    several buffers at once (with distinct keys); every rank must start them
    in the same order. With ``op="auto"`` the request is an
    ``AutoRequest``, whose ``decision`` says which op ran and why. A
    hierarchical call (``hierarchy=``) is nonblocking
    too, except the first of a size larger than any before on its
    communicator, which grows the node's shared window when it starts.
    """
    if isinstance(op, str) and op == "auto":
        return _auto.start("allreduce", buf, params, auto_op=auto_op, auto_pin=auto_pin,
                           comm=comm, key=key, average=average, gather=gather,
                           feedback=feedback, nonfinite=nonfinite, hierarchy=hierarchy,
                           blocking=False)
    return Request(start("allreduce", buf, op, params, comm=comm, key=key, average=average,
                         gather=gather, feedback=feedback, nonfinite=nonfinite,
                         hierarchy=hierarchy, blocking=False))
