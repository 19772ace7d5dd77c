"""The torch layer's shared helpers: collective agreement of arguments,
the waits for the other ranks (timed, and said on stderr when they last),
the glue between torch tensors and the engine's arrays, and torch.profiler
ranges."""
import contextlib
import json
import math
import os
import sys
import time
import warnings
import zlib

import numpy as np
import torch
from mpi4py import MPI

from .. import _auto, _comm, _threshold
from .._settings import GATHER_MODES, NONFINITE_POLICIES, min_compress_bytes
from .._errors import (ConfigError, DTypeError, InvalidBufferError, MismatchError,
                       MpigcError, StateError)
from ..compressors import get_compressor
from ..feedback import ErrorFeedback



BUCKET_DTYPES = {torch.float16: np.float32, torch.bfloat16: np.float32,
                  torch.float32: np.float32, torch.float64: np.float64}

_profiling = torch._C._autograd._profiler_enabled
_NO_RANGE = contextlib.nullcontext()


def profiled(name):
    """A context manager: ``torch.profiler.record_function(name)`` while
    torch's profiler records, else nothing (a check of 66 ns here, against
    12 µs for a ``record_function`` outside a profile)."""
    return torch.profiler.record_function(name) if _profiling() else _NO_RANGE


# -- agreement helpers ---------------------------------------------------------
def raise_everywhere(comm, exc, what):
    """Raise on every rank if ``exc`` is not None on some rank (collective)."""
    _comm.agree(comm, exc, what, default=StateError, classes={c.__name__: c for c in (
        ConfigError, DTypeError, InvalidBufferError, MismatchError, MpigcError, StateError,
        TypeError, ValueError)})


def agree_construction(comm, exc, settings, what):
    """The first collective of a constructor (collective over ``comm``).

    Raises on every rank when the arguments were refused on some rank
    (``exc``: a rank that raised alone before its first collective would
    leave the others waiting in it), then :class:`MismatchError` on every
    rank when ``settings`` (a dict of JSON values) differ between ranks,
    naming the settings and the ranks.
    """
    raise_everywhere(comm, exc, what)
    rows = comm.allgather(json.dumps(settings, sort_keys=True, default=repr))
    if all(r == rows[0] for r in rows):
        return
    ref = json.loads(rows[0])
    differ = []
    for r, row in enumerate(rows[1:], 1):
        mine = json.loads(row)
        for k in sorted(set(ref) | set(mine)):
            if ref.get(k) != mine.get(k):
                differ.append(f"{k}={mine.get(k)!r} on rank {r} but {ref.get(k)!r} on rank 0")
    raise MismatchError(f"{what}: the ranks were given different settings: "
                        + "; ".join(differ[:5]) + (" ..." if len(differ) > 5 else "")
                        + " (every rank must pass the same arguments)")


def agreed_comm(comm, exc, settings, what, *, within=None):
    """A constructor's own duplicate of ``comm``, made once its checks ran
    (its first collective, over ``comm``), on which every rank agrees that
    the checks passed everywhere and gave the same ``settings``.

    ``exc`` is what the checks raised on this rank (None: nothing) and
    ``settings`` what they gave (a dict of JSON values). After the duplicate
    is made, :func:`agree_construction` raises on every rank when some rank
    refused its arguments or the settings differ between ranks. A ``comm``
    that is not an ``MPI.Intracomm`` leaves no communicator to tell the
    others on: ``exc`` (the checks' error about it) is raised on this rank.

    ``within``: ``(wait, timeout, warn_s)`` to wait for the duplicate as
    :func:`wait_request` does, so that a constructor called on some ranks
    only ends there with an error instead of waiting forever; by default a
    plain ``Dup``.
    """
    if not isinstance(comm, MPI.Intracomm):
        raise exc if exc is not None else ConfigError(
            f"{what}: comm: expected an mpi4py Intracomm, got {type(comm).__name__}")
    if within is None:
        own = comm.Dup()
    else:
        wait, timeout, warn_s = within
        own, req = comm.Idup()
        wait_request(req.Test, f"{what} (rank {comm.rank} of {comm.size})", wait,
                     timeout=timeout, warn_s=warn_s)
    try:
        agree_construction(own, exc, settings, what)
    except BaseException:
        own.Free()  # raised on every rank: freed on every rank
        raise
    return own


def check_same(comm, items, what):
    """Raise :class:`MismatchError` on every rank unless ``items`` (a list of
    ``(name, shape, dtype)``) is the same on every rank."""
    blob = json.dumps(items).encode()
    fps = comm.allgather(zlib.crc32(blob))
    if all(f == fps[0] for f in fps):
        return
    lists = comm.allgather(items)
    ref = {n: (s, d) for n, s, d in lists[0]}
    details = []
    for r in range(1, comm.size):
        if lists[r] == lists[0]:
            continue
        mine = {n: (s, d) for n, s, d in lists[r]}
        missing = [n for n in ref if n not in mine]
        extra = [n for n in mine if n not in ref]
        differ = [f"{n} {list(ref[n][0])} {ref[n][1]} vs {list(mine[n][0])} {mine[n][1]}"
                  for n in ref if n in mine and mine[n] != ref[n]]
        parts = []
        if missing:
            parts.append(f"lacks {missing[:5]}" + (" ..." if len(missing) > 5 else ""))
        if extra:
            parts.append(f"has extra {extra[:5]}" + (" ..." if len(extra) > 5 else ""))
        if differ:
            parts.append("differs in " + "; ".join(differ[:5]))
        if not parts:
            parts.append("has them in another order")
        details.append(f"rank {r} " + ", ".join(parts))
    raise MismatchError(f"{what}: ranks have different parameters (compared with rank 0: "
                        + "; ".join(details) + "); every rank must build the same model "
                        "and freeze the same parameters")


def describe(named):
    return [(n, list(p.shape), str(p.dtype).replace("torch.", "")) for n, p in named]


def resolve_comm(comm):
    if comm is None:
        comm = MPI.COMM_WORLD
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm: expected an mpi4py Intracomm, got {type(comm).__name__}")
    return comm


def torch_nonfinite(nonfinite):
    """The torch layer's default policy for NaN/Inf gradients: ``"skip"``
    (``$MPIGC_NONFINITE`` overrides it), so that a loss scaler sees them."""
    policy = nonfinite if nonfinite is not None else os.environ.get("MPIGC_NONFINITE", "skip")
    if policy not in NONFINITE_POLICIES:
        raise ConfigError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {policy!r}"
                          + ("" if nonfinite is not None else " (from $MPIGC_NONFINITE)"))
    return policy


def resolve_timeout(timeout):
    """Seconds a rank waits for the others to reach a step's synchronisation
    (``$MPIGC_TORCH_TIMEOUT``, default 1800 as torch.distributed's); None or
    0: forever."""
    if timeout is None:
        env = os.environ.get("MPIGC_TORCH_TIMEOUT", "1800")
        try:
            timeout = float(env)
        except ValueError:
            raise ConfigError(f"MPIGC_TORCH_TIMEOUT: expected seconds, got {env!r}") from None
    timeout = float(timeout)
    if timeout < 0:
        raise ConfigError(f"timeout: expected seconds >= 0, got {timeout!r}")
    return timeout or None


def _horovod_compression(value):
    """The mpigc op for Horovod's ``compression=`` value (``hvd.Compression.fp16``
    is a class ``FP16Compressor``), or None."""
    name = getattr(value, "__name__", type(value).__name__).lower()
    return {"fp16compressor": "fp16", "nonecompressor": "none"}.get(name)


#: Keywords of Horovod's ``hvd.DistributedOptimizer`` that mpigc does not take,
#: and the mpigc way (see docs/torch.md, "Migrating from Horovod")
HOROVOD_KEYWORDS = {
    "named_parameters": "pass the model instead: DistributedOptimizer(opt, model, op=...) "
                        "(GradientSync(model) or GradientSync(model.named_parameters()))",
    "compression": "in mpigc the compressor is op=: hvd.Compression.fp16 is op='fp16', "
                   "hvd.Compression.none is op='none' (the exact sum); '2bit' and '1bit' "
                   "compress further, with error feedback",
    "backward_passes_per_step": "accumulate gradients explicitly: run the first N-1 "
                                "backward passes inside `with opt.sync.no_sync():` "
                                "(`with sync.no_sync():` for a GradientSync), the last "
                                "one outside it, then opt.step()",
    "gradient_predivide_factor": "leave it out: average=True (the default) divides the "
                                 "sum by the world size, and fp16/bf16 divide each "
                                 "rank's gradient by it before the cast, which is what "
                                 "the factor is for in Horovod",
    "process_set": "pass comm= (an mpi4py communicator, e.g. "
                   "MPI.COMM_WORLD.Split(color))",
    "num_groups": "bucket_mb= sets the size of the fused buckets",
    "groups": "bucket_mb= sets the size of the fused buckets",
    "sparse_as_dense": "leave it out: gradients are synchronised as dense tensors",
}


def refuse_horovod_keywords(params):
    """:class:`ConfigError` naming the mpigc way for a keyword of Horovod's
    ``DistributedOptimizer`` in ``params`` (a half-migrated call); raised
    inside a constructor's checks, so that it is agreed on by every rank."""
    given = [k for k in HOROVOD_KEYWORDS if k in params]
    if not given:
        return
    parts = []
    for k in given:
        way = HOROVOD_KEYWORDS[k]
        if k == "compression" and _horovod_compression(params[k]) is not None:
            way = (f"in mpigc the compressor is op=: op={_horovod_compression(params[k])!r} "
                   "here (" + HOROVOD_KEYWORDS[k].split(": ", 1)[1] + ")")
        parts.append(f"{k}= is Horovod's: {way}")
    raise ConfigError("; ".join(parts) + " (docs/torch.md, 'Migrating from Horovod')")


def torch_compressor(op, params):
    """:func:`mpigc.get_compressor` for the torch layer (``"2bit"`` without a
    threshold is the relative mode there as everywhere); a keyword of
    Horovod's (:data:`HOROVOD_KEYWORDS`) is refused with the mpigc way."""
    refuse_horovod_keywords(params)
    return get_compressor(op, **params)


def torch_auto(op, auto_op, auto_pin, params):
    """The compressor and the pin of the torch layer's ``op``:
    ``(torch_compressor(op, params), None)``, or for ``op="auto"`` the
    compressor ``auto_op`` names (default ``"2bit"``, the relative mode;
    ``params`` are its) and the pin, ``auto_pin`` or ``$MPIGC_AUTO_PIN``
    (read once, here). Raises ConfigError (``auto_op=``/``auto_pin=``
    without ``op="auto"`` too: they would be ignored)."""
    if not (isinstance(op, str) and op == "auto"):
        if auto_op is not None or auto_pin is not None:
            raise ConfigError(f"auto_op= and auto_pin= apply with op='auto' only, got "
                              f"op={op!r}")
        return torch_compressor(op, params), None
    if isinstance(auto_op, str) and auto_op.lower() in ("auto", "none"):
        raise ConfigError(f"auto_op must name a compressor (e.g. '2bit'), got {auto_op!r}")
    comp = torch_compressor("2bit" if auto_op is None else auto_op, params)
    if comp.codec_id == "none":
        raise ConfigError(f"auto_op must name a compressor (e.g. '2bit'), got {auto_op!r}")
    pin = _auto.default_pin() if auto_pin is None else auto_pin
    if pin not in _auto.PINS:
        raise ConfigError(f"auto_pin (or $MPIGC_AUTO_PIN) must be one of {_auto.PINS}, got "
                          f"{pin!r}")
    return comp, pin


def check_auto_flat(hierarchy, on_device, what):
    """op="auto" in the torch layer: flat calls of host buffers only, as the
    engine's (ConfigError otherwise, before the first collective)."""
    if hierarchy != "flat":
        raise ConfigError(f"{what}: op='auto' runs flat calls only (hierarchy='flat'), "
                          f"got hierarchy={hierarchy!r}")
    if on_device:
        raise ConfigError(f"{what}: op='auto' reduces host buffers only: " + on_device)


def fold_back_needs_worker(feedback, key, buf, spans):
    """Before :meth:`Residuals.fold_back` of a call that ran as ``"none"``
    (``op="auto"``): the plain sum delivered its key's residuals and cleared
    them (``worker`` None), so what the ``spans`` (``[(offset, numel)]``)
    of ``buf`` delivered would have no worker residual to go back into and
    be lost. The store puts a zero worker residual in place
    (:meth:`ErrorFeedback.ensure_worker`) when any of those values is not
    zero; nothing otherwise (a key without an entry had no residuals: every
    rank summed zeros there). Only while no call uses ``key``."""
    if any(bool(torch.any(buf[off:off + m] != 0)) for off, m in spans):
        feedback.ensure_worker(key)


class ThresholdWatch(_threshold.ThresholdWatch):
    """The core's watch (:class:`mpigc._threshold.ThresholdWatch`: a warning,
    once on each rank, when 2bit's absolute threshold lets almost nothing
    through) fed with the torch layer's averaged gradients (one
    ``count_nonzero`` per bucket per watched step)."""

    def observe(self, tensors):
        """One synchronised step's averaged gradients (the results)."""
        if not self.active:
            return
        self.observe_counts(sum(int(torch.count_nonzero(t)) for t in tensors),
                            sum(t.numel() for t in tensors), stacklevel=3)


def warn_if_uncompressed(who, compressor, buffers, larger="make the buckets larger (bucket_mb="):
    """Warn (``UserWarning``, at the first line outside mpigc.torch) when
    every one of ``buffers`` (the 1-D tensors that the calls reduce) is
    under ``$MPIGC_MIN_COMPRESS_BYTES``, so that a compressor other than
    ``none`` compresses nothing: the engine sums such calls exactly with
    plain MPI. ``larger``: how the caller's user makes its calls larger
    (the advice opens the parenthesis). Returns whether it warned."""
    if compressor.codec_id == "none" or not buffers:
        return False
    cutoff = min_compress_bytes()
    sizes = [t.numel() * t.element_size() for t in buffers]
    if max(sizes) >= cutoff:
        return False
    total = sum(sizes)
    how = (f"{larger}; all {len(sizes)} hold {total} bytes "
           "together) or set MPIGC_MIN_COMPRESS_BYTES to a smaller cutoff on every rank"
           if total >= cutoff else
           f"the model's gradients are {total} bytes in all, so set "
           "MPIGC_MIN_COMPRESS_BYTES=0 (or under that) on every rank to compress them "
           "anyway (below the cutoff the fixed cost of compressing exceeds what it saves)")
    frame, level = sys._getframe(0), 1  # stacklevel of the caller outside this package
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(
        f"{who}: none of its {len(sizes)} bucket(s) is compressed: the largest is "
        f"{max(sizes)} bytes, under the {cutoff}-byte cutoff ($MPIGC_MIN_COMPRESS_BYTES) "
        f"below which a call is the exact MPI sum, so op={compressor.codec_id!r} sends "
        f"them uncompressed. To compress, {how}", UserWarning, stacklevel=level)
    return True


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def check_feedback(feedback):
    """``feedback`` as a store: a new one for None."""
    if feedback is None:
        return ErrorFeedback()
    if not isinstance(feedback, ErrorFeedback):
        raise ConfigError(f"feedback: expected an ErrorFeedback, got {type(feedback).__name__}")
    return feedback


def positive(x):
    try:
        return float(x) > 0
    except (TypeError, ValueError):
        return False


def check_gather(gather):
    if gather not in GATHER_MODES:
        raise ConfigError(f"gather must be one of {GATHER_MODES}, got {gather!r}")


# -- waits for the other ranks ---------------------------------------------------
def resolve_warn_s():
    """Seconds a wait of the torch layer for the other ranks lasts before it
    says so on stderr (``$MPIGC_TORCH_WARN_S``, default 60; 0: never); it
    says so again every :data:`WARN_REPEAT` times that. None: never."""
    env = os.environ.get("MPIGC_TORCH_WARN_S", "60")
    try:
        warn_s = float(env)
    except ValueError:
        raise ConfigError(f"MPIGC_TORCH_WARN_S: expected seconds, got {env!r}") from None
    if not warn_s >= 0:
        raise ConfigError(f"MPIGC_TORCH_WARN_S: expected seconds >= 0, got {env!r}")
    return warn_s or None


#: A wait's line on stderr comes again every ``WARN_REPEAT * $MPIGC_TORCH_WARN_S``
#: seconds: 60 s, then every 5 minutes by default.
WARN_REPEAT = 5


class Wait:
    """What a wait of the torch layer waits for: the other ranks to
    ``reach`` something; the likely causes when it lasts, with their fixes
    (``likely``); and what holds after its timeout (``after``). The same
    words go into the lines on stderr and into the timeout's error."""

    __slots__ = ("reach", "likely", "after")

    def __init__(self, reach, likely, after):
        self.reach, self.likely, self.after = reach, likely, after


_ONE_RANK = ("state_dict, save_checkpoint, load_state_dict, load_checkpoint) called on "
             "some ranks only, e.g. inside `if rank == 0:`? Call it on every rank")

#: a step of GradientSync (DistributedOptimizer): its agreement
STEP = Wait("reach this step's gradient synchronisation",
            "A rank that ran out of batches (uneven inputs)? Wrap the training loop in "
            "`with sync.join():` (`opt.join()`, DistributedOptimizer) on every rank. Or a "
            "collective method (" + _ONE_RANK,
            "The step stays pending")

#: GradientSync.join: a rank that left its loop, at the others' next step
JOIN = Wait("reach their next step or join()",
            "A rank that left its training loop without `with sync.join():` (every rank "
            "wraps its loop in it)? Or a collective method (" + _ONE_RANK,
            "Its agreement stays posted: call join() again on this rank, which takes it up")

#: a step of the DDP communication hook: the calls of its buckets
HOOK_STEP = Wait("reach this step's gradient synchronisation",
                 "A collective method (CommHookState's " + _ONE_RANK + ". Or a rank that "
                 "ran out of batches (uneven inputs)? DDP's `join()` context manager on "
                 "every rank",
                 "The step's calls stay posted: this rank's next step completes them first")

#: the next step of the hook on a rank whose last step timed out
HOOK_STALE = Wait("reach the gradient synchronisation of the step that timed out here",
                  HOOK_STEP.likely, "Its calls stay posted")

#: a collective method of GradientSync, CommHookState, DiLoCo, the FSDP hooks and
#: CompressedAdamW (their Rendezvous)
RENDEZVOUS = Wait("call it",
                  "It is collective: call it on every rank, not only on the one that "
                  "writes the model's checkpoint (not inside `if rank == 0:` / `if "
                  "master_process:`)",
                  "Its gather stays posted: call it on every rank before any other "
                  "collective use of this object")


def _say(what, wait, elapsed, timeout, warn_s):
    """One line on stderr: ``what`` has waited ``elapsed`` s, for what, why."""
    limit = (f"a StateError after {timeout:g} s" if timeout is not None
             else "no timeout")
    line = (f"mpigc: {what}: still waiting after {elapsed:.0f} s for the other ranks to "
            f"{wait.reach}. {wait.likely}. ({limit}; said again every "
            f"{WARN_REPEAT * warn_s:g} s; "
            "$MPIGC_TORCH_TIMEOUT, $MPIGC_TORCH_WARN_S)\n")
    try:
        sys.stderr.write(line)
        sys.stderr.flush()
    except (OSError, ValueError):  # no stderr left to say it on
        pass


def settled(req):
    """Whether engine request ``req`` is done or failed (its error stays
    with it, for its ``wait()``): the ``test`` of a :func:`wait_request`
    for an engine call."""
    try:
        return req.test()
    except Exception:  # noqa: BLE001 - raised again by its wait()
        return True


def wait_request(test, what, wait, *, timeout, warn_s, progress=None, since=None,
                 watch=None):
    """Poll ``test()`` until it is true, calling ``progress()`` meanwhile: the
    one way the torch layer waits for the other ranks.

    ``what`` (who waits, with the rank) and ``wait`` (a :class:`Wait`) word
    what it says: after ``warn_s`` seconds (None: never) one line on stderr,
    again every ``WARN_REPEAT * warn_s`` seconds; after ``timeout`` seconds
    (None: never) :class:`StateError` on this rank. Both count from ``since``
    (a ``time.monotonic()``; default now), so that several waits of one step
    share one timeout and one schedule of lines; but a wait's first line
    comes at the latest ``warn_s`` after the wait itself began (a step whose
    first wait begins late, after a slow backward, still says why before
    its timeout).

    ``watch``: a callable that a wait which lasts (past its first
    :data:`_QUICK_SPINS` polls or :data:`_QUICK_S` seconds, whichever ends
    first) calls every :data:`_WATCH_EVERY` polls, and which raises to end
    it (:meth:`Rendezvous.watch`: the other ranks in a collective method);
    never called when ``test()`` is true soon. The clock is read at every
    poll: polls made slow by a loaded machine (each ``progress()`` and
    ``test()`` waits for a core) do not delay the lines or the timeout.
    """
    began = time.monotonic()
    start = began if since is None else since
    deadline = None if timeout is None else start + timeout
    warn_at = None
    if warn_s is not None:  # the first point of the schedule not yet passed
        repeat = WARN_REPEAT * warn_s
        warn_at = start + warn_s
        if began > warn_at:
            warn_at = min(warn_at + math.ceil((began - warn_at) / repeat) * repeat,
                          began + warn_s)
    spins = 0
    while not test():
        if progress is not None:
            progress()
        spins += 1
        if spins <= _QUICK_SPINS and time.monotonic() - began < _QUICK_S:
            continue  # a wait that ends soon: no watch, no sleep
        if watch is not None and spins % _WATCH_EVERY == 0:
            watch()
        now = time.monotonic()
        if warn_at is not None and now >= warn_at:
            _say(what, wait, now - start, timeout, warn_s)
            while warn_at <= now:
                warn_at += repeat
        if deadline is not None and now > deadline:
            raise StateError(f"{what}: the other ranks did not {wait.reach} within "
                             f"{timeout:g} s. {wait.likely}. {wait.after} (timeout=, "
                             "$MPIGC_TORCH_TIMEOUT)")
        time.sleep(0.0002)


#: polls of a wait before it sleeps between them and watches (at most
#: :data:`_QUICK_S` seconds of them: under load 27 on 2 cores, 200 polls of
#: GradientSync's agreement took 1.4 s, past a 1 s ``warn_s``)
_QUICK_SPINS = 200
_QUICK_S = 0.005
#: a lasting wait's ``watch`` runs every this many polls (~0.2 ms apart)
_WATCH_EVERY = 32
#: seconds a rank waits in a rendezvous before it tells the others which
#: collective method it is in (:class:`Rendezvous`)
ANNOUNCE_S = 0.2

_COLLECTIVE = "a collective method: call it on every rank, not inside `if rank == 0:`"


class Rendezvous:
    """Every rank's arrival at a collective method of this layer (a state
    dict, a checkpoint), within a timeout, and the other ranks told at once
    when some rank calls such a method while they wait in a step.

    Built on every rank by the constructor of the object that owns it
    (collective: it duplicates ``comm``, its own channel). A call of a
    method is an ``Iallgather`` of the method's name (a CRC): ranks in two
    different methods get :class:`MismatchError` on every rank. A rank that
    waits there longer than :data:`ANNOUNCE_S` sends each other rank a small
    announcement (the method, the owner's steps posted so far); a rank that
    waits in a step of the owner (``wait_request(watch=rdv.watch(doing))``)
    reads them as it waits, and when the announcer has not posted the step it
    waits for (the announcer can reach that step only after the method,
    which waits for this rank), it tells every other rank so and raises
    :class:`MismatchError` naming both sides; the ranks in the method that
    have not posted that step raise on it too. A method called on every
    rank, at whatever times, completes: an announcement of a method that the
    reader reaches after its step is read and kept until the reader
    completes the method, and one not read before then is recognised as old
    whenever it is read. Nothing of this runs
    while the ranks keep step (a wait that ends within its first polls reads
    nothing).

    A call that raised (its timeout, a mismatch) leaves its gather posted:
    the next call of the same method on this rank takes it up. After its
    timeout the announcement is withdrawn; after a mismatch it stays, so
    that every rank that waits in a step raises on it, until the method
    completes on every rank.

    ``abandon``: the owner's way to end the others' step instead (None:
    they stay in it). A rank in a method that raises on a mismatch found by
    a rank in a step calls ``abandon(what)`` first (``what``: the method's
    words): the owner posts its side of that step so that the step
    completes on every rank in a way the others recognise as abandoned, and
    they then :meth:`forget` its announcement (:class:`CompressedAdamW`).
    """

    _TAG = 0  # every message on the channel: (kind, ...), in order per sender

    def __init__(self, comm, warn_s, abandon=None):
        self.comm = comm.Dup()  # the channel: gathers and announcements only
        self.warn_s = warn_s
        self.abandon = abandon
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.req = None  # a gather posted by a call that raised
        self._method = None  # (method, text) of the posted gather
        self._out = None  # its buffers
        self.done = 0  # the gathers completed here
        self.posted = 0  # the owner's steps posted here (step_posted)
        self._attempt = 0  # calls here (a withdrawal names the announcement it withdraws)
        self._announced = False
        self._peers = {}  # rank -> its last announcement (done, posted, method, text, attempt)
        self._forgotten = {}  # rank -> its last attempt whose announcement is forgotten
        self._sends = []  # requests of messages sent, tested now and then

    @property
    def attempt(self):
        """Calls of a method here so far (what an announcement names)."""
        return self._attempt

    def forget(self, rank, attempt):
        """Drop ``rank``'s announcement of its call number ``attempt`` (and of
        earlier ones), read or still to come: that call abandoned the step
        this rank waited in (``abandon``), so it blocks no later step."""
        self._forgotten[rank] = max(attempt, self._forgotten.get(rank, 0))
        if rank in self._peers and self._peers[rank][4] <= attempt:
            del self._peers[rank]

    def step_posted(self):
        """The owner posted the collective of one more step (every rank
        posts the same ones in the same order)."""
        self.posted += 1

    def __call__(self, timeout, what, method=None):
        """Wait for every rank to call ``method`` (default ``what``: a name
        the same on every rank); ``what`` words this call in messages."""
        method = what if method is None else method
        if self.req is None:
            crc = np.array([zlib.crc32(method.encode())], np.int64)
            self._out = (crc, np.zeros(self.size, np.int64))
            self._method = (method, what)
            self.req = self.comm.Iallgather(self._out[0], self._out[1])
        self._attempt += 1
        self._announced = False
        self._began = time.monotonic()
        label = f"{what} (rank {self.rank} of {self.size})"
        try:
            wait_request(self.req.Test, label, RENDEZVOUS, timeout=timeout,
                         warn_s=self.warn_s, watch=lambda: self._in_rendezvous(label))
        except MismatchError:  # found by a rank in a step: the others raise on it too
            raise
        except BaseException:
            if self._announced:  # the others forget it (this rank may go on to a step)
                self._send_all(("W", self._attempt))
            raise
        self.req = None
        self.done += 1
        self._peers = {q: a for q, a in self._peers.items() if a[0] >= self.done}
        self._sends = [r for r in self._sends if not r.Test()]
        crcs = self._out[1]
        if (crcs != crcs[0]).any():  # every rank sees it, and is here: all raise
            names = self.comm.allgather(self._method[1])
            raise MismatchError(f"{label}: the ranks called different collective methods "
                                "of this object: " + "; ".join(
                                    f"rank {q} {n}" for q, n in enumerate(names))
                                + " (every rank calls the same ones in the same order)")

    def _send_all(self, msg):
        for q in range(self.size):
            if q != self.rank:
                self._sends.append(self.comm.isend(msg, q, self._TAG))

    def _read(self):
        """The messages arrived so far: announcements kept per rank (the
        last), withdrawals applied; the mismatches found by ranks in a step
        returned, as ``(rank, done, posted, doing)``."""
        found = []
        status = MPI.Status()
        while self.comm.iprobe(MPI.ANY_SOURCE, self._TAG, status):
            q = status.Get_source()
            msg = self.comm.recv(None, q, self._TAG)
            if msg[0] == "A":
                if msg[5] > self._forgotten.get(q, 0):
                    self._peers[q] = msg[1:]
            elif msg[0] == "W":
                if q in self._peers and self._peers[q][4] == msg[1]:
                    del self._peers[q]
            elif msg[0] == "M":
                found.append((q,) + tuple(msg[1:]))
        return found

    def _in_rendezvous(self, label):
        """The watch of this rank's wait in a method: announce it once it
        lasts; raise when a rank found a mismatch with a step that this
        method blocks (this rank has not posted it: old news otherwise)."""
        if not self._announced and time.monotonic() - self._began > ANNOUNCE_S:
            self._announced = True
            self._send_all(("A", self.done, self.posted, self._method[0],
                            self._method[1], self._attempt))
        for q, done, posted, doing in self._read():
            if done != self.done or posted <= self.posted:
                continue
            if self.abandon is not None and posted == self.posted + 1:
                self.abandon(self._method[1])  # the others' step ends, abandoned
            raise MismatchError(
                f"{label}: rank {self.rank} is in {self._method[1]} ({_COLLECTIVE}); "
                f"rank {q} is in {doing}, which it cannot leave until this rank "
                "joins it. Call the method on every rank at the same point of the loop")

    def watch(self, doing, label):
        """The ``watch`` of a wait of the owner in its step number
        :attr:`posted` (``doing``: words for it, where ``{step}`` becomes
        that number; ``label``: who waits):
        raises :class:`MismatchError` when a rank announced a method that
        it called before posting this step."""
        return lambda: self._in_step(doing, label)

    def _in_step(self, doing, label):
        self._read()
        for q, (done, posted, _, text, _) in list(self._peers.items()):
            if done < self.done:
                del self._peers[q]  # a method completed here: old news
            elif done == self.done and posted < self.posted:
                del self._peers[q]
                doing = doing.format(step=self.posted)
                # every rank in a method learns it (not only those it announced)
                self._send_all(("M", self.done, self.posted, doing))
                raise self.mismatch(q, text, doing, label)

    def mismatch(self, rank, text, doing, label):
        """The :class:`MismatchError` of this rank, in ``doing`` (its step's
        words), while ``rank`` is in the method ``text``."""
        return MismatchError(
            f"{label}: rank {rank} is in {text} ({_COLLECTIVE}); rank {self.rank} is in "
            f"{doing}, which rank {rank} reaches only after that method, which waits for "
            "this rank. Call the method on every rank at the same point of the loop")

# -- device buckets ------------------------------------------------------------
def simulating():
    """True when the test seam ``mpigc.torch._sim_device_buckets`` is set
    (under Numba's CUDA simulator only)."""
    from .. import torch as package  # the seam is an attribute of the package
    if not package._sim_device_buckets:
        return False
    from .. import _cuda
    if not _cuda.simulator():
        raise ConfigError("mpigc.torch._sim_device_buckets is a test seam of Numba's CUDA "
                          "simulator: set NUMBA_ENABLE_CUDASIM=1")
    return True


def _sim_device_array(t):
    """The seam: a simulated device array over CPU tensor ``t``'s memory."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    return FakeCUDAArray(t.detach().numpy())


def engine_array(t, device):
    """What the engine reduces for a contiguous 1-D bucket tensor ``t``: a CUDA
    tensor itself (through ``__cuda_array_interface__``: the engine's device
    path), under the test seam a simulated device array over it, else its
    numpy view (the host path)."""
    if t.is_cuda:
        return t
    if device:
        return _sim_device_array(t)
    return t.detach().numpy()


def as_tensor(a, like):
    """A torch view (no copy) of residual array ``a`` (numpy, Numba device or
    simulated device array) for arithmetic next to tensor ``like``."""
    if isinstance(a, np.ndarray):
        return torch.from_numpy(a)
    if like.is_cuda:
        return torch.as_tensor(a, device=like.device)  # __cuda_array_interface__
    return torch.from_numpy(a._ary)  # the simulator's array wraps a numpy array


def engine_after_torch(device):
    """Order the engine's kernels after what torch queued so far on its
    current stream of ``device``. The engine launches on the default stream
    (the legacy one, which is torch's default stream too): when torch's
    current stream is another one, the default stream waits for an event
    recorded on it (no host wait, no device-wide synchronisation)."""
    cur = torch.cuda.current_stream(device)
    engine = torch.cuda.default_stream(device)
    if cur != engine:
        engine.wait_stream(cur)


def torch_after_engine(device):
    """Order what torch queues next on its current stream after the engine's
    kernels (the engine waits for them on the host before a call completes;
    this event keeps the order should it ever return earlier)."""
    cur = torch.cuda.current_stream(device)
    engine = torch.cuda.default_stream(device)
    if cur != engine:
        cur.wait_stream(engine)


def first_is_nan(tensors):
    """``[isnan(t[0])]`` of 1-D tensors (False for empty ones) with one read
    back per device, not one per tensor (a read waits for the stream)."""
    out = [False] * len(tensors)
    by_device = {}
    for i, t in enumerate(tensors):
        if t.numel():
            by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        flags = torch.stack([torch.isnan(tensors[i][0]) for i in idx]).tolist()
        for i, f in zip(idx, flags):
            out[i] = bool(f)
    return out

NP_OF_TORCH = {torch.float16: np.float16, torch.float32: np.float32,
                torch.float64: np.float64}
