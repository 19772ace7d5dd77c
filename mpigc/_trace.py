"""What a call records of how it ran (:class:`CallTrace`, shown by
``Request.trace`` and :func:`mpigc.diagnostics.last_trace`), and its spans
in the timeline while one is recorded (:mod:`mpigc._timeline`)."""
from . import _timeline

__all__ = ["CallTrace"]


class CallTrace:
    """How one call ran, as far as it has got (:attr:`Request.trace`,
    :func:`mpigc.diagnostics.last_trace`). Read-only; the engine fills it in as the call
    advances.

    - ``agreement_done``: this rank has every rank's agreement row and has
      acted on it (the call went ahead, was skipped, or is failing);
    - ``path``: None until the call went ahead; then ``"plain"`` (op="none"
      or the small-buffer fallback: a plain sum), ``"two-phase"`` (a
      compressed reduce-scatter, then for allreduce the gather), or
      ``"hierarchical"`` (a ``hierarchy="node"`` call, at once; its
      inter-node calls are engine calls of their own, which leave the other
      fields at their defaults here);
    - ``inline``: the data travelled in the agreement messages (plain: the
      values, on 2 ranks; two-phase: phase 1's payloads);
    - ``chunks``: the number of chunks of a pipelined call, 0 when not
      pipelined;
    - ``sum_pieces``: the number of MPI reductions a plain call's sum was
      split into (1, or more beyond ``$MPIGC_MAX_COUNT`` elements); 0 when
      MPI did not sum (the values came inline, or the call is compressed).
    """

    __slots__ = ("_agreement_done", "_path", "_inline", "_chunks", "_sum_pieces", "_cid",
                 "_t0")

    def __init__(self, path=None):
        self._agreement_done = False
        self._path = path
        self._inline = False
        self._chunks = 0
        self._sum_pieces = 0
        self._cid = 0  # the call's span in the timeline (0: none recorded)
        if _timeline.ON:
            self._cid, self._t0 = _timeline.call_begin()

    agreement_done = property(lambda self: self._agreement_done)
    path = property(lambda self: self._path)
    inline = property(lambda self: self._inline)
    chunks = property(lambda self: self._chunks)
    sum_pieces = property(lambda self: self._sum_pieces)

    # for the engine, as the call advances (positional: a small call's hot path)
    def agreed(self):
        self._agreement_done = True
        if self._cid and _timeline.ON:
            _timeline.nested(self._cid, "agreement", self._t0)

    def went(self, path, inline):
        self._path, self._inline = path, inline

    def pipelined(self, chunks):
        self._chunks = chunks

    def summed(self, pieces):
        self._sum_pieces = pieces

    # the timeline's, while one is recorded
    def waited(self, what, t0):
        """The call waited for ``what`` from ``t0`` (:func:`mpigc._timeline.now`)
        until now; recorded from 10 µs on."""
        if self._cid and _timeline.ON and _timeline.now() - t0 >= 10:
            _timeline.nested(self._cid, what, t0)

    def ended(self, name, args):
        """The call is over: its span, ``args`` and how it ran."""
        if self._cid and _timeline.ON:
            _timeline.nested(self._cid, name, self._t0, dict(
                args, path=self._path, inline=self._inline, chunks=self._chunks,
                sum_pieces=self._sum_pieces))

    def __repr__(self):
        return (f"CallTrace(agreement_done={self._agreement_done}, path={self._path!r}, "
                f"inline={self._inline}, chunks={self._chunks}, "
                f"sum_pieces={self._sum_pieces})")
