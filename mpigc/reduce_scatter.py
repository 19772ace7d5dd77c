"""Compressed reduce-scatter (phase 1 and 2 of the allreduce alone)."""
from ._collective import Request, start

__all__ = ["reduce_scatter", "ireduce_scatter"]


def reduce_scatter(buf, op="2bit", *, recvcounts=None, out=None, comm=None, key=None,
                   average=False, feedback=None, nonfinite=None, **params):
    """Reduce ``buf`` over all ranks and return this rank's shard of the sum.

    Each rank compresses its ``buf`` once (with error feedback under ``key``),
    sends shard j to rank j, and rank j returns the sum of the decoded
    contributions: exactly ``sum_r D(Q(x_r))`` over its shard.

    Parameters
    ----------
    buf : numpy.ndarray
        The input, left unchanged (it may be read-only).
    recvcounts : sequence of int, optional
        Shard sizes per rank; default as ``numpy.array_split``.
    out : numpy.ndarray, optional
        Where to write this rank's shard (dtype of ``buf``).
    Other parameters as in :func:`mpigc.allreduce`.

    Returns
    -------
    numpy.ndarray
        This rank's reduced shard, dtype of ``buf``.
    """
    req = start("reduce_scatter", buf, op, params, comm=comm, key=key, average=average,
                gather="compressed", feedback=feedback, nonfinite=nonfinite,
                recvcounts=recvcounts, out=out, blocking=True)
    return Request(req).wait()


def ireduce_scatter(buf, op="2bit", *, recvcounts=None, out=None, comm=None, key=None,
                    average=False, feedback=None, nonfinite=None, **params):
    """Nonblocking :func:`reduce_scatter`; ``request.wait()`` returns the shard."""
    return Request(start("reduce_scatter", buf, op, params, comm=comm, key=key,
                         average=average, gather="compressed", feedback=feedback,
                         nonfinite=nonfinite, recvcounts=recvcounts, out=out,
                         blocking=False))
