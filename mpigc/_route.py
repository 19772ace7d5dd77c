"""The one router of mpigc's collectives (:func:`start`): every call of
:mod:`mpigc.allreduce` and :mod:`mpigc.reduce_scatter` comes here, and goes
to one of four paths: a grouped call (one flat call on the members' fused
buffer, :mod:`mpigc._group`), a hierarchical call (:mod:`mpigc._hiercall`),
or a flat call (:mod:`mpigc._collective`), which a blocking allreduce of one
buffer or of a group may finish on the short path of a repeated small call
(:mod:`mpigc._shortcall`)."""
from . import _collective, _group, _hiercall, _sched
from ._errors import ConfigError
from ._hierarchy import HIERARCHY_MODES, layout

__all__ = ["start"]


def start(kind, buf, op, params, *, comm, key, average, gather, feedback, nonfinite,
          recvcounts=None, out=None, hierarchy="flat", blocking):
    """Route one collective. Returns what :class:`mpigc.Request` wraps (an
    engine call, the short path's completed call, or a hierarchical call in
    the engine's queue)."""
    _sched.note_caller()
    if hierarchy not in HIERARCHY_MODES:
        # decides which collective runs, so it is checked here, on this rank:
        # like the function called, it must be the same on every rank
        raise ConfigError(f"hierarchy must be one of {HIERARCHY_MODES}, got {hierarchy!r}")
    flat = hierarchy == "flat"
    if not flat:
        lay = layout(comm)
        flat = not lay.hierarchical(hierarchy)
    if _group.is_group(buf):
        # one flat call on the members' fused buffer (mpigc._group): "auto"
        # reduces a group flat; "node" across nodes fails in that call, on
        # every rank
        group = _group.Group(kind, buf, key, recvcounts, out, flat or hierarchy == "auto")
        # a blocking grouped allreduce may take the short path too
        return _collective.start(kind, buf, op, params, comm=comm, key=None, average=average,
                                 gather=gather, feedback=feedback, nonfinite=nonfinite,
                                 blocking=blocking, group=group,
                                 short=blocking and kind == "allreduce")
    if flat:
        # a blocking allreduce of one buffer may take the short path
        return _collective.start(kind, buf, op, params, comm=comm, key=key, average=average,
                                 gather=gather, feedback=feedback, nonfinite=nonfinite,
                                 recvcounts=recvcounts, out=out, blocking=blocking,
                                 short=(blocking and kind == "allreduce"
                                        and recvcounts is None and out is None))
    return _hiercall.start(lay, kind, buf, op, params, comm=comm, key=key, average=average,
                           gather=gather, feedback=feedback, nonfinite=nonfinite,
                           recvcounts=recvcounts, out=out, blocking=blocking)
