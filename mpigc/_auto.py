"""``op="auto"``: per call, a plain sum (``"none"``) or the compressor the
user names (``auto_op=``, default ``"2bit"``, the relative mode), whichever
an online cost model of the communicator predicts faster.

Resolved at the public entry points (:mod:`mpigc.allreduce`,
:mod:`mpigc.reduce_scatter`) before the router: the engine below sees a
concrete op.

The model and the decision: :mod:`mpigc._auto_model`.

Error feedback across switches: a call run as ``"none"`` adds each key's
residuals into the values it sums (the worker residual over the whole
array, the owner residual over this rank's shard, with ``average=True``
times the size: the engine keeps it in units of the average), on a copy
of the array(s) that hold residuals, and clears them once the sum went ahead on
every rank (a failed call leaves them and the buffer as they were; a
skipped one, ``nonfinite="skip"``, leaves them, its buffer NaN as any
skipped call's). So the sum delivered plus the residuals left equals the sum of the
inputs at every step. Keys without residuals cost no copy.

Agreement: an op="auto" call passes its mark (``auto_pin``, ``auto_op``'s
config) to the engine (:data:`mpigc._settings.AUTO_MARK`), which puts it in
the call's settings, compared by every rank's agreement row: op="auto"
meeting a plain op, or other op="auto" settings, is a MismatchError on every
rank at that call, whatever ops the decisions name; the mark also says
whether the call is a model step (the first call, after which the model
joins its own communicator, or an agreement step, after which it posts its
sums), so no rank joins or posts where another does not, and its index in
the model (modulo a few), so that a call numbered differently on some ranks
(started while a call of those ranks only was in flight) fails everywhere.
A step completes in :func:`start` (waited for by the caller's wait where it
gives one: :func:`waiting_with`). A call that failed is undone in the model
(:meth:`Model.close`): the models stay alike on the ranks that made it as
op="auto" and on those that did not, once no call of the rank is in flight.

Errors: bad ``op="auto"`` settings (``auto_op``, ``auto_pin``, a device
array, a hierarchical call) are found on the rank before anything
communicates and carried into the call's agreement (the call runs with a
compressor that fails its check with the message), so they raise
:class:`ConfigError` on every rank, as a bad op does.
"""
import contextlib
import os
import threading
import time
import weakref

import numpy as np
from mpi4py import MPI

from . import _dispatch
from . import _route
from . import _timeline
from ._auto_model import INDEX_MOD, WINDOW, Model, probe_every
from ._errors import ConfigError, MpigcError
from ._sched import Request
from ._settings import AUTO_MARK, min_compress_bytes
from .compressors import Compressor, get_compressor
from .feedback import ErrorFeedback, get_default_feedback, hold_for_plain, plain_done
from .feedback import shard_bounds

__all__ = ["PINS", "AutoRequest", "start", "model_of", "last_decision", "use_clock",
           "default_pin", "waiting_with"]

PINS = ("model", "none", "compressed")

_clock = time.perf_counter
_last = threading.local()
# model -> (the AutoRequest of its step whose wait ended by the caller's
# timeout, whether it is the first call): taken up at the next call's start
_steps = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def waiting_with(wait):
    """Inside, this thread's ``op="auto"`` calls wait in :func:`start` (a
    model step's call, the sums posted at the step before) by ``wait(req)``,
    which polls ``req.test()`` and may raise (the torch layer's wait: its
    lines on stderr, its StateError at its timeout) instead of blocking in
    ``req.wait()``. A step whose wait raised stays in flight and is taken up
    by the communicator's next ``op="auto"`` call. ``wait=None``: no change."""
    old = getattr(_last, "wait", None)
    _last.wait = wait if wait is not None else old
    try:
        yield
    finally:
        _last.wait = old


def _wait_for(req):
    """``req``'s result, waited for by the thread's :func:`waiting_with`
    wait first (which may raise, ``req`` still in flight), if any."""
    wait = getattr(_last, "wait", None)
    if wait is not None:
        wait(req)
    return req.wait()


def _take_up(model, cm):
    """Complete the model's step left in flight by a wait that raised
    (:func:`waiting_with`), then join or post as the step would have:
    raises again if its wait does (the step stays), or the step's own error
    (undone in the model by its request)."""
    req, first = _steps[model]
    try:
        _wait_for(req)
    except BaseException:
        if req._post.over:  # it failed: undone in the model (AutoRequest)
            del _steps[model]
        raise
    del _steps[model]
    if first:
        model.join(cm)
    else:
        model.post()


def use_clock(fn=None):
    """For tests: the clock (seconds, as ``time.perf_counter``) that times
    this process's ``op="auto"`` calls; None: the default. Returns the old."""
    global _clock
    old, _clock = _clock, (fn or time.perf_counter)
    return old


def default_pin():
    """``$MPIGC_AUTO_PIN``: ``"model"`` (default), ``"none"`` or ``"compressed"``."""
    return os.environ.get("MPIGC_AUTO_PIN", "model") or "model"


_keyval = None
_keyval_lock = threading.Lock()


def model_of(comm=None, window=WINDOW):
    """The :class:`Model` of ``comm`` (default ``MPI.COMM_WORLD``), made on
    first use (no MPI call but an attribute's), keeping ``window`` agreed
    sums (None: all, for ``mpigc-bench --model``)."""
    global _keyval
    if comm is None:
        comm = MPI.COMM_WORLD
    if _keyval is None:
        with _keyval_lock:
            if _keyval is None:
                _keyval = MPI.Comm.Create_keyval()
    m = comm.Get_attr(_keyval)
    if m is None:
        with _keyval_lock:  # two threads' first calls on comm: one model
            m = comm.Get_attr(_keyval)
            if m is None:
                m = Model(window)
                comm.Set_attr(_keyval, m)
    return m


def last_decision():
    """The :class:`Decision` of this thread's last ``op="auto"`` call, or None."""
    return getattr(_last, "decision", None)


class _Refused(Compressor):
    """Carries a bad ``op="auto"`` setting into the call's agreement: the
    engine's check of the op raises it there, so every rank raises it."""
    codec_id = "auto"

    def __init__(self, message):  # noqa: super not called: never a real compressor
        self._message = message

    def get_config(self):
        raise ConfigError(self._message)

    def __getattribute__(self, name):
        if name in ("_message", "get_config", "__class__", "__init__"):
            return object.__getattribute__(self, name)
        raise ConfigError(object.__getattribute__(self, "_message"))


def _flat(b):
    """A flat host view of one array of the call (as the engine adopts it)."""
    try:
        a = np.asarray(b)
    except Exception as exc:  # noqa: BLE001 - reported on every rank
        raise ConfigError(f"op='auto': cannot view the buffer as a host array "
                          f"({type(b).__name__}: {exc})") from exc
    return a.reshape(-1) if a.flags.c_contiguous else a


def _member_keys(key, sizes, dtype, group):
    """The residual keys of a call (as the engine names them: mpigc._group
    for a group, mpigc._settings for one array)."""
    if not group:
        return [f"auto/{sizes[0]}/{dtype.name}" if key is None else str(key)]
    if key is None:
        return [f"auto/group/{i}/{m}/{dtype.name}" for i, m in enumerate(sizes)]
    if isinstance(key, (list, tuple)):
        return [str(k) for k in key]
    return [f"{key}/{i}" for i in range(len(sizes))]


class _Fold:
    """A plain call's residuals added into the values it sums (module
    docstring): the keys held, the copies made, and the arrays they replace.
    ``owner_scale``: what the owner residual is multiplied by to be in the
    units of the values summed (with ``average=True`` the engine keeps it in
    units of the average: the size; else 1; the worker residual is in units
    of the sum either way, that of fp16 and bf16 too)."""

    def __init__(self, fb, owner_scale=1):
        self.fb = fb
        self.owner_scale = owner_scale
        self.held = []     # (key, entry)
        self.copies = []   # (the caller's flat array, its copy summed)

    def add(self, key, flat, size, rank):
        """Hold ``key``; returns the array to sum in place of ``flat``."""
        e = hold_for_plain(self.fb, key, flat.size, flat.dtype, size, rank)
        self.held.append((key, e))
        if e is None:
            return flat
        w, o = e.worker, e.owner
        if w is None and o is None:
            return flat
        work = flat.copy()
        if w is not None:
            work += w
        if o is not None:
            lo, hi = shard_bounds(flat.size, size)[rank]
            work[lo:hi] += o if self.owner_scale == 1 else o * self.owner_scale
        self.copies.append((flat, work))
        return work

    def done(self, delivered, write_back):
        """The call is over: ``write_back``, its results (a completed
        allreduce's, skipped or not) into the caller's arrays; ``delivered``
        (it went ahead), the residuals it added are cleared, else kept."""
        for flat, work in self.copies if write_back else ():
            flat[...] = work
        for key, e in self.held:
            plain_done(self.fb, key, e, delivered)
        self.held, self.copies = [], []


class AutoRequest(Request):
    """The :class:`mpigc.Request` of an ``op="auto"`` call; ``decision``
    says which op ran and why."""

    def __init__(self, op, post):
        Request.__init__(self, op)
        self._post = post

    @property
    def decision(self):
        return self._post.decision

    def test(self):
        try:
            done = Request.test(self)
        except BaseException:
            self._post.fail()
            raise
        if done:  # timed when its completion is first seen, by test() or wait()
            self._post.finish(self._op, _clock())
        return done

    def wait(self):
        try:
            Request.wait(self)
        except BaseException:
            self._post.fail()
            raise
        return self._post.finish(self._op, _clock())


class _Post:
    """What an ``op="auto"`` call does once it completed: the folded
    residuals settled, the results copied back, its time recorded, the
    model told whether it went through (a failed call is undone there)."""

    def __init__(self, decision, fold, model, entry, slot, nbytes, t0, result):
        self.decision, self.fold, self.model, self.slot = decision, fold, model, slot
        self.nbytes, self.t0, self.result, self.over = nbytes, t0, result, False
        self.entry = entry

    def fail(self):
        if not self.over:
            self.over = True
            if self.fold is not None:
                self.fold.done(False, False)
            self.model.close(self.entry, False)

    def finish(self, op, t1):
        if not self.over:
            self.over = True
            if self.fold is not None:
                # a skipped call (nonfinite="skip") never went ahead: its path is None
                self.fold.done(op.trace.path is not None, self.result is not None)
            if t1 is not None:
                self.model.record(self.slot, self.nbytes, t1 - self.t0)
            self.model.close(self.entry, True)  # skipped too: on every rank alike
        return op.result if self.result is None else self.result


_comps = {}  # (auto_op, params) -> (compressor, label), for str ops of plain params


def _compressor(auto_op, params):
    """``auto_op``'s compressor and its label (cached for a str op with
    parameters of plain values); raises ConfigError."""
    key = None
    if isinstance(auto_op, str) and all(
            isinstance(v, (str, int, float, bool, type(None))) for v in params.values()):
        key = (auto_op, tuple(sorted(params.items())))
        hit = _comps.get(key)
        if hit is not None:
            return hit
    if isinstance(auto_op, str) and auto_op.lower() in ("auto", "none"):
        raise ConfigError(f"auto_op must name a compressor (e.g. '2bit'), got {auto_op!r}")
    comp = get_compressor(auto_op, **params)
    if comp.codec_id == "none":
        raise ConfigError(f"auto_op must name a compressor (e.g. '2bit'), got {auto_op!r}")
    hit = (comp, repr(sorted(comp.get_config().items())))
    if key is not None:
        if len(_comps) > 256:
            _comps.clear()
        _comps[key] = hit
    return hit


def _check(buf, auto_op, params, auto_pin, hierarchy, feedback):
    """The compressor of an op="auto" call, its label and the pin; raises
    ConfigError."""
    if hierarchy != "flat":
        raise ConfigError(f"op='auto' runs flat calls only (hierarchy='flat'), got "
                          f"hierarchy={hierarchy!r}")
    pin = default_pin() if auto_pin is None else auto_pin
    if pin not in PINS:
        raise ConfigError(f"auto_pin (or $MPIGC_AUTO_PIN) must be one of {PINS}, got "
                          f"{pin!r}")
    comp = _compressor(auto_op, params)
    members = buf if isinstance(buf, (list, tuple)) else [buf]
    if any(_dispatch.is_device_array(b) for b in members):
        raise ConfigError("op='auto' takes host arrays only (device arrays: name the op)")
    if not (feedback is None or feedback is False or isinstance(feedback, ErrorFeedback)):
        raise ConfigError(f"feedback: expected an ErrorFeedback, False or None, got "
                          f"{type(feedback).__name__}")
    probe_every()
    return comp, pin


def _decide(model, kind, flats, comp, cfg, pin, gather, size):
    """The call's decision, its slot and bytes."""
    nbytes = sum(int(f.nbytes) for f in flats)
    none_label = (kind, "none")
    comp_label = (kind, gather if kind == "allreduce" else "", cfg)
    dec = model.decide((kind, gather, cfg), none_label, comp_label, nbytes, pin,
                       nbytes < min_compress_bytes(), comp.codec_id, size)
    return dec, model.slot(none_label if dec.op == "none" else comp_label), nbytes


def _mark(pin, cfg, entry):
    """The mark of an op="auto" call's settings (:data:`mpigc._settings.AUTO_MARK`):
    its agreement fails on every rank where another rank's call is plain,
    has other op="auto" settings, is not a model step where this one is
    (the model joins or posts its sums once it went through), or the
    reverse, or has another index in its model (modulo
    :data:`~mpigc._auto_model.INDEX_MOD`): a call started while a call of
    some ranks only was in flight (it failed later) never goes through
    where the models count it differently (:meth:`Model.close`). The index
    is modulo a few so that a signature has a few settings, not one per
    call."""
    return (f"op='auto', auto_pin={pin!r}, auto_op={cfg}, model call "
            f"{entry.index % INDEX_MOD} mod {INDEX_MOD}" + (", model step" if entry.step else ""))


def start(kind, buf, params, *, auto_op, auto_pin, comm, key, average, gather, feedback,
          nonfinite, recvcounts=None, out=None, hierarchy="flat", blocking):
    """Decide and start one ``op="auto"`` call: an :class:`AutoRequest`.

    A call at a model step (:meth:`Model.enter`: a communicator's first
    ``op="auto"`` call, and its agreement steps) completes before it
    returns, holding the model's order: once it went through (on every
    rank: its agreement compares the mark, which says it is a step), the
    model joins (the first, :meth:`Model.join`, collective) or posts its
    sums (:meth:`Model.post`). A call that failed is undone in the model
    (:meth:`Model.close`), as on the ranks that did not make it."""
    group = isinstance(buf, (list, tuple))
    cm = MPI.COMM_WORLD if comm is None else comm
    run = dict(comm=comm, key=key, average=average, gather=gather, nonfinite=nonfinite,
               recvcounts=recvcounts, out=out, hierarchy="flat", blocking=blocking)
    try:
        (comp, cfg), pin = _check(buf, auto_op, params, auto_pin, hierarchy, feedback)
        flats = [_flat(b) for b in (buf if group else [buf])]
    except MpigcError as problem:
        # every rank raises it: it travels in the call's agreement (the
        # model is not entered: the call fails)
        return Request(_route.start(kind, buf, _Refused(str(problem)), {}, feedback=False,
                                    **run))
    model = model_of(cm)
    with model.order:
        if model in _steps:
            _take_up(model, cm)
        entry = model.enter(getattr(_last, "wait", None))
        try:
            dec, slot, nbytes = _decide(model, kind, flats, comp, cfg, pin, gather,
                                        cm.Get_size())
        except BaseException:
            model.close(entry, False)
            raise
        finally:
            model.decided()
        if not entry.step:
            return _launch(kind, buf, params, group, flats, dec, slot, nbytes, auto_op,
                           _mark(pin, cfg, entry), model, entry, cm, feedback, run)
        # a model step: completed here, still in the model's order (a second
        # thread's call waits), then the join or the post
        req = _launch(kind, buf, params, group, flats, dec, slot, nbytes, auto_op,
                      _mark(pin, cfg, entry), model, entry, cm, feedback, run)
        _steps[model] = (req, entry.index == 0)
        _take_up(model, cm)  # a failure is undone in the model (AutoRequest.wait)
        return req


def _launch(kind, buf, params, group, flats, dec, slot, nbytes, auto_op, mark, model, entry,
            cm, feedback, run):
    """Start the op of the decision ``dec``: an :class:`AutoRequest`."""
    key = run["key"]
    dtype = flats[0].dtype
    _last.decision = dec
    if _timeline.ON:
        _timeline.span("auto", _timeline.now(), cat="auto", args=dec._asdict())
    fold = None
    call_buf, result = buf, None
    if dec.op == "none" and feedback is not False:
        size, rank = cm.Get_size(), cm.Get_rank()
        fold = _Fold(get_default_feedback() if feedback is None else feedback,
                     size if run["average"] else 1)
        keys = _member_keys(key, [f.size for f in flats], dtype, group)
        try:
            # what the engine refuses (on every rank) it gets as given
            if len(keys) != len(flats) or not all(
                    f.flags.c_contiguous and (f.flags.writeable or kind != "allreduce")
                    for f in flats):
                raise ConfigError("not folded")
            works = [fold.add(k, f, size, rank) for k, f in zip(keys, flats)]
        except MpigcError:
            fold.done(False, False)
            fold, works = None, flats
        if fold is not None and fold.copies:
            call_buf = works if group else works[0]
            if kind == "allreduce":
                result = buf
    t0 = _clock()
    try:
        if dec.op == "none":
            req = _route.start(kind, call_buf, "none", {AUTO_MARK: mark},
                               feedback=feedback, **run)
        else:
            req = _route.start(kind, buf, auto_op, {**params, AUTO_MARK: mark},
                               feedback=feedback, **run)
    except BaseException:
        if fold is not None:
            fold.done(False, False)
        model.close(entry, False)
        raise
    return AutoRequest(req, _Post(dec, fold, model, entry, slot, nbytes, t0, result))
