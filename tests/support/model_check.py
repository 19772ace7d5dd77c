"""A model checker for hangs: mpigc's engine, N ranks in one process, on a
fake MPI (``tests/support/fakempi.py``) whose every call is a point where a seeded
random scheduler picks which rank runs next.

Each simulated rank has an engine of its own: the modules that hold the
engine's state and call MPI (:data:`ENGINE`: ``_sched``, ``_comm``,
``_collective``, ``_hiercall``, ...) are loaded once more per
rank, as ``mpigc_sim<r>``, with ``from mpi4py import MPI`` bound to the fake;
the rest (kernels, compressors, error feedback, the plan, errors) is
shared, as it holds no MPI and no engine state. The engine code under test
is mpigc's own, unchanged.

A *scenario* (:func:`draw`) is a few calls, drawn from a seed as in
``tests/mpi/test_schedules_mpi.py``: allreduce or reduce_scatter; none,
2bit, 1bit, terngrad, fp16; sizes that take the plain fallback, the data in
the agreement messages, after them, or pipelined; blocking or not; faults
on one rank (another size, a dtype rejected before the size is read, a NaN
under "raise" or "skip"); a quarter of the flat calls grouped (the buffer
cut into 2 or 3 members: ``allreduce([...])``); on three communicators; every fourth scenario
with the agreement rows by allgather (:func:`variant`), every fourth with
small limits (:func:`limits`). Each rank runs the
calls with ``test()`` polls of random pending requests (what the progress
thread does) and its own order of ``wait()``s. :func:`check` runs a
scenario under one interleaving (a seed of the scheduler) and compares every
outcome and residual with the same calls made blocking and in order; a
hang (every rank waiting, or a rank polling forever) or a mismatched
collective is a :class:`fakempi.RunFailed` with every rank's stack.

With ``threads`` (:data:`THREADS`) a run gives ``MPI_THREAD_MULTIPLE``:
the engine's progress and reduction threads run, interleaved like ranks,
and with ``"two"`` each rank makes its calls on communicator ``"a"`` from a
second user thread.

Planted causes (:data:`PLANTS`) put a historical hang's cause back into one
rank's engine copies, to show that the search finds it.
"""
import builtins
import contextlib
import importlib
import importlib.abc
import importlib.util
import itertools
import os
import sys
import types

import numpy as np

import mpigc
import mpigc.kernels  # noqa: F401 - shared by the copies
from mpigc import _plan
from mpigc import MpigcError

from . import fakempi
from .scenarios import call_input, draw_calls, outcome, state_bytes

# the engine's modules with MPI or state of their own: one copy per rank
ENGINE = ("_sched", "_comm", "_reducer", "_wire", "_settings", "_prepared", "_agree",
          "_flatagree",
          "_effects",
          "_shortcall", "_collective", "_twophase", "_plainsum", "_group", "_hierarchy",
          "_hiercall", "_route", "allreduce", "reduce_scatter")

# the plain fallback, payloads in the agreement messages, after them, pipelined
# (with the environment of :func:`environment`)
SIZES = [100, 3001, 12_001, 60_000]
COMMS = ["world", "a", "half"]


@contextlib.contextmanager
def _setenv(settings):
    """``os.environ`` updated with ``settings`` for a block of code."""
    keep = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in keep.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def environment():
    """The settings the scenarios assume: 60_000 float32 is pipelined, 12_001
    sends its payloads after the rows."""
    return _setenv({"MPIGC_CHUNK_BYTES": "65536", "MPIGC_INLINE_PAYLOAD_BYTES": "4096"})


class _Loader(importlib.abc.Loader, importlib.abc.MetaPathFinder):
    """Loads the engine's modules for a copy (``mpigc_simN.<module>``) from
    code compiled once: a copy per rank per run costs a few milliseconds."""
    codes = {}
    builtins = None  # the copy's builtins: its own ``__import__`` (threads=True)

    def find_spec(self, fullname, path=None, target=None):
        head, _, base = fullname.partition(".")
        if head.startswith("mpigc_sim") and base in ENGINE:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        base = module.__name__.partition(".")[2]
        code = self.codes.get(base)
        path = os.path.join(mpigc.__path__[0], base + ".py")
        if code is None:
            with open(path) as f:
                code = self.codes[base] = compile(f.read(), path, "exec")
        module.__file__ = path
        if self.builtins is not None:
            module.__builtins__ = self.builtins
        exec(code, module.__dict__)


_loader = _Loader()
_copies = itertools.count()


def _threaded_builtins():
    """Builtins whose ``import`` gives the fake MPI's ``threading``, ``time``
    and ``atexit`` (:func:`fakempi.threading_module`): the engine's locks,
    conditions, sleeps and threads become points of the run's schedule."""
    fakes = {"threading": fakempi.threading_module(), "time": fakempi.time_module(),
             "atexit": fakempi.atexit_module()}
    real = builtins.__import__

    def imp(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name in fakes:
            return fakes[name]
        return real(name, globals, locals, fromlist, level)
    return dict(builtins.__dict__, __import__=imp)


def engine(r, plants=(), threads=False):
    """A fresh engine for rank r: a namespace of its ``allreduce``,
    ``iallreduce``, ``reduce_scatter``, ``ireduce_scatter`` and modules.
    ``plants``: names of :data:`PLANTS` entries, applied to this copy.
    ``threads``: its locks, conditions and threads those of the fake MPI, so
    that a run with ``THREAD_MULTIPLE`` interleaves its progress and
    reduction threads and several user threads (without: real ones, and the
    run gives ``THREAD_SERIALIZED``, so the engine starts no thread).
    Every run gets fresh copies, so that a seed or a list of choices replays
    the same run whatever ran before; :func:`forget` drops them."""
    name = f"mpigc_sim{next(_copies)}"
    pkg = types.ModuleType(name)
    pkg.__path__ = list(mpigc.__path__)
    pkg.__package__ = name
    added = {name: pkg}
    for full, mod in list(sys.modules.items()):
        if full.startswith("mpigc.") and full.split(".")[1] not in ENGINE:
            added[name + full[len("mpigc"):]] = mod
    fake = fakempi.module()
    fake_pkg = types.ModuleType("mpi4py")
    fake_pkg.MPI = fake
    saved = {k: sys.modules.get(k) for k in ("mpi4py", "mpi4py.MPI")}
    sys.modules.update(added)
    sys.modules["mpi4py"], sys.modules["mpi4py.MPI"] = fake_pkg, fake
    sys.meta_path.insert(0, _loader)
    _loader.builtins = _threaded_builtins() if threads else None
    try:
        mods = {m: importlib.import_module(f"{name}.{m}") for m in ENGINE}
    finally:
        _loader.builtins = None
        sys.meta_path.remove(_loader)
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    eng = types.SimpleNamespace(
        allreduce=mods["allreduce"].allreduce, iallreduce=mods["allreduce"].iallreduce,
        reduce_scatter=mods["reduce_scatter"].reduce_scatter,
        ireduce_scatter=mods["reduce_scatter"].ireduce_scatter, mods=mods, name=name)
    # the check that a second thread's first call is not kept waiting (a
    # timer on the wall clock) has no place in a run whose clock is its steps
    mods["_sched"]._watch_first_call = lambda: None
    for p in plants:
        PLANTS[p](mods)
    return eng


def forget(eng):
    """Drop an engine copy's modules from ``sys.modules``."""
    for k in [k for k in sys.modules if k == eng.name or k.startswith(eng.name + ".")]:
        del sys.modules[k]


# -- scenarios ---------------------------------------------------------------------
def draw(seed, size, hier=False):
    """The scenario of ``seed``: a list of call specs, the same on every rank;
    with ``hier``, about half of them hierarchical (``hierarchy="node"`` on
    emulated nodes of 2 ranks: :func:`hierarchical`), drawn apart so that
    the flat scenarios of a seed stay what they were."""
    calls = draw_calls(np.random.default_rng([seed, 7]), size, SIZES, comms=COMMS)
    if hier:
        pick = np.random.default_rng([seed, 13])
        for c in calls:
            c["hier"] = bool(pick.random() < 0.5)
    # grouped calls (flat only), drawn apart too
    pick = np.random.default_rng([seed, 17])
    for c in calls:
        g = int(pick.integers(2, 4)) if pick.random() < 0.25 else 0
        if g and not c.get("hier"):
            c["group"] = g
    return calls


def hierarchical():
    """The environment of hierarchical scenarios: nodes of 2 ranks
    (``$MPIGC_NODE_SPLIT``), so 3 ranks make nodes of 2 and 1, 4 ranks two of
    2, and a call on a communicator of 2 ranks has one node."""
    return _setenv({"MPIGC_NODE_SPLIT": "2"})


def _program(eng, calls, world_ctx, rng, blocking_only, early=None, second=None,
             early_blocking=False, main_first=False):
    """Rank ``fakempi.rank()``'s user program: its communicators, then the
    calls; returns the outcomes and the residuals. ``early``: a generator
    that draws, before each call, which pending requests this rank waits for
    first (each rank its own: ranks may complete requests in different
    orders); None: every wait after the last call. ``second``: the
    generators ``(rng, early)`` of a second user thread, which makes the
    calls on communicator ``"a"`` (made by the first thread, as
    docs/engine.md asks) while the first makes the others. ``early_blocking``:
    the early waits are drawn before blocking calls too. ``main_first``
    (with ``second``): the first thread makes the process's first mpigc
    calls, one on each communicator (no state: ``feedback=False``), before
    the second starts, as the user guide asks; the second thread's first call
    may then come while the first blocks in MPI (the one-thread mode's
    window, docs/engine.md rule 3)."""
    def run():
        r = fakempi.rank()
        world = fakempi.world_comm(world_ctx)
        comms = {"world": world, "a": world.Dup(), "half": world.Split(r % 2, r)}
        fb = mpigc.ErrorFeedback()
        outs = [None] * len(calls)

        def start(c, x, blocking):
            f = getattr(eng, ("" if blocking else "i") + c["kind"])
            return f(x, c["op"], key=f"c{c['i']}", feedback=fb, comm=comms[c["comm"]],
                     nonfinite="skip" if c["fault"] == "nan-skip" else "raise",
                     hierarchy="node" if c.get("hier") else "flat")

        def drive(mine, rng, early):
            pending = {}

            def polls():
                for i in list(pending):
                    if rng.random() < 0.3:
                        try:
                            pending[i].test()
                        except MpigcError:
                            pass  # raised again by wait() below

            def waits_first():
                for i in [i for i in sorted(pending)
                          if early is not None and early.random() < 0.25]:
                    outs[i] = outcome(pending.pop(i).wait)

            for c in mine:
                x = call_input(c, r)
                if blocking_only or c["blocking"]:
                    if early_blocking and not blocking_only:
                        waits_first()
                    outs[c["i"]] = outcome(lambda c=c, x=x: start(c, x, True))
                    continue
                polls()
                waits_first()
                try:
                    pending[c["i"]] = start(c, x, False)
                except MpigcError as e:  # raised at the start: on every rank
                    outs[c["i"]] = ("error", type(e).__name__)
            for i in rng.permutation(sorted(pending)):
                polls()
                outs[int(i)] = outcome(pending.pop(int(i)).wait)

        if second is None:
            drive(calls, rng, early)
        else:
            if main_first:
                for name in ("world", "a", "half"):
                    eng.allreduce(np.zeros(3, np.float32), "none", comm=comms[name],
                                  feedback=False)
            w = fakempi.world()
            other = w.spawn(lambda: drive([c for c in calls if c["comm"] == "a"], *second),
                            "user thread 2")
            drive([c for c in calls if c["comm"] != "a"], rng, early)
            w.join(other)
            if other.error is not None:
                raise other.error
        return outs, state_bytes(fb)
    return run


# how a run's ranks use threads: None (MPI gives THREAD_SERIALIZED: no thread
# but the user's), "progress" (THREAD_MULTIPLE: the engine's progress and
# reduction threads run, interleaved like ranks), "two" (that, and each rank
# makes its calls from two user threads)
THREADS = (None, "progress", "two")


def run(calls, size, seed, blocking_only=False, plants=(), max_steps=200_000,
        choices=None, world=None, threads=None, early_waits=False):
    """Run ``calls`` on ``size`` simulated ranks under the interleaving of
    ``seed`` (every rank's engine with ``plants``; ``choices``: a systematic
    run, see :class:`fakempi.World`; ``threads``: one of :data:`THREADS`);
    the ranks' ``(outcomes, residuals)``, or RunFailed. ``world``: a list
    that receives the World. ``early_waits``: each rank draws waits for its
    pending requests before any call, blocking ones included (as hierarchical
    scenarios do before nonblocking ones)."""
    assert threads in THREADS
    w = fakempi.World(size, seed, max_steps=max_steps, choices=choices,
                      thread_level=fakempi.THREAD_SERIALIZED if threads is None
                      else fakempi.THREAD_MULTIPLE)
    if world is not None:
        world.append(w)
    ctx = w.new_ctx(list(range(size)))
    engines = [engine(r, plants, threads=threads is not None) for r in range(size)]
    hier = any(c.get("hier") for c in calls)  # hierarchical scenarios wait early too
    programs = [_program(engines[r], calls, ctx, np.random.default_rng([seed, r, 3]),
                         blocking_only,
                         np.random.default_rng([seed, r, 5]) if hier or early_waits
                         else None,
                         (np.random.default_rng([seed, r, 9]),
                          np.random.default_rng([seed, r, 11]) if hier else None)
                         if threads == "two" and not blocking_only else None,
                         early_waits,
                         main_first=np.random.default_rng([*np.atleast_1d(seed), 13]).random()
                         < 0.5)
                for r in range(size)]
    try:
        return w.run(programs, timeout=30)
    except fakempi.RunFailed as e:
        e.detail += "\n" + "\n".join(f"rank {r} pending: {queue(engines[r])}"
                                     for r in range(size))
        raise
    finally:
        for eng in engines:
            SHORT_CALLS[0] += eng.mods["_wire"].counters()["short_calls"]
            forget(eng)


# the calls that took the short path of small calls (mpigc._shortcall) in every
# run so far: the searches must reach it
SHORT_CALLS = [0]


def queue(eng):
    """Rank's pending calls, oldest first: what each is and waits for."""
    out = []
    for call in eng.mods["_sched"].pending():
        w = call.waiting
        out.append(f"{type(call).__name__}({getattr(call, 'kind', '?')}, "
                   f"{getattr(call, 'state', '?')}, comm of {call.cs.size}, "
                   f"waits for {type(w).__name__ if w is not None else 'nothing'})")
    return "; ".join(out) or "none"


def variant(seed):
    """The engine settings of scenario ``seed``: every fourth one sends its
    agreement rows with one allgather, as beyond 16 ranks."""
    return ("allgather-rows",) if seed % 4 == 3 else ()


# every fourth scenario (seed % 4 == 1): small limits, so that small calls
# take the paths of large ones: messages beyond $MPIGC_MAX_COUNT bytes as one
# element of a derived datatype, op="none" summed in pieces, many chunks, no
# values in the agreement messages
SMALL_LIMITS = {"MPIGC_CHUNK_BYTES": "16384", "MPIGC_MAX_COUNT": "1500",
                "MPIGC_INLINE_PLAIN_BYTES": "2048"}


def limits(seed):
    """The environment of scenario ``seed`` (:data:`SMALL_LIMITS` or none)."""
    return _setenv(SMALL_LIMITS if seed % 4 == 1 else {})


def check(seed, size, schedules=1, plant=None, scenario=None, hier=False, threads=None,
          early_waits=False):
    """Scenario ``seed`` on ``size`` ranks: the reference (blocking, in
    order), then ``schedules`` interleavings of the calls as drawn, with
    ``plant`` (a :data:`PLANTS` name) in every rank's engine; returns a list
    of differences (empty when every run ended as the reference). Raises
    RunFailed on a hang or a mismatched collective. ``hier``: the scenario
    of :func:`draw` with hierarchical calls; ``early_waits``: see :func:`run`."""
    calls = draw(seed, size, hier) if scenario is None else scenario
    v = variant(seed)
    with limits(seed), (hierarchical() if hier else contextlib.nullcontext()):
        ref = run(calls, size, seed=[seed, 0], blocking_only=True, plants=v)
        runs = [run(calls, size, seed=[seed, 1 + k],
                    plants=v + (() if plant is None else (plant,)), threads=threads,
                    early_waits=early_waits)
                for k in range(schedules)]
    diffs = []
    for k, got in enumerate(runs):
        for r in range(size):
            if got[r] != ref[r]:
                bad = [c for c, a, b in zip(calls, got[r][0], ref[r][0]) if a != b]
                diffs.append(f"seed {seed} schedule {k} rank {r}: "
                             f"{bad or 'residuals differ'}")
    return diffs


def explore(calls, size, plant=None, max_runs=3000, seed=0):
    """Every interleaving of ``calls`` with at most one preemption (a rank
    stopped at an MPI call while it could go on): the run without any, then
    one run per place and choice of the preemption (Musuvathi and Qadeer's
    preemption bounding). Returns the number of runs and the differences
    from the blocking calls in order; raises RunFailed on a hang, with the
    ``choices`` that replay it in ``detail``. At most ``max_runs`` runs;
    ``seed``: the programs' own (their ``test()`` polls and order of waits)."""
    plants = () if plant is None else (plant,)
    ref = run(calls, size, seed=seed, blocking_only=True)
    first = []
    got = run(calls, size, seed=seed, plants=plants, choices=[], world=first)
    diffs = [] if got == ref else ["no preemption: differs"]
    runs = 1
    for i, (n, preempt) in enumerate(first[0].decisions):
        if not preempt:
            continue
        for j in range(1, n):
            if runs >= max_runs:
                return runs, diffs
            choices = [0] * i + [j]
            try:
                got = run(calls, size, seed=seed, plants=plants, choices=choices)
            except fakempi.RunFailed as e:
                e.detail = f"choices {choices}: " + e.detail
                raise
            runs += 1
            if got != ref:
                diffs.append(f"choices {choices}: differs")
    return runs, diffs


# -- planted causes of historical hangs -----------------------------------------------
def _plant_blocking_report(mods):
    """3195820: a failed agreement's error report as a blocking allgather, in
    whatever step reaches it (a progress step included)."""
    r = mods["_agree"].Report
    orig = r.__init__

    def init(self, comm, size, text, make_error):
        orig(self, comm, size, text, make_error)
        self.req.Wait()
    r.__init__ = init


def _plant_no_row_on_early_error(mods):
    """e7f033e: a rank whose input is rejected before its size is read
    leaves the agreement (sends no row)."""
    agree = mods["_agree"]
    orig = agree.Rows.__init__

    def init(self, comm, rank, size, tag, row, inline, expected, sendreqs):
        if not row[_plan.CODE] or size > agree.P2P_MAX_RANKS:
            orig(self, comm, rank, size, tag, row, inline, expected, sendreqs)
            return
        self.table = _plan.new_table(size)
        self.table[rank] = row
        self.req = self.buf = None
        self.data, self.held, self.size = {}, [], _plan.ROW_BYTES
        self.sources = []  # sends nothing, receives nothing
    agree.Rows.__init__ = init


def _plant_sends_waited_in_a_step(mods):
    """1a1cb97: reduce_scatter's last sends waited for in MPI by whatever
    step reaches them (a progress step included)."""
    t = mods["_twophase"].TwoPhase
    orig = t._decode_phase1

    def decode_phase1(self):
        moved = orig(self)
        if self.kind == "reduce_scatter" and self.c1 == len(self.cuts):
            for q in self.sendreqs:
                q.Wait()
        return moved
    t._decode_phase1 = decode_phase1


def _plant_agreements_out_of_order(mods):
    """1a1cb97: calls act on their agreements as soon as their rows are in,
    not in the order they began (their reports and sums then start in
    different orders on different ranks)."""
    c = mods["_collective"]
    c._Op._my_turn = lambda self: True


def _plant_sum_in_a_step(mods):
    """1a1cb97: a blocking op="none" call sums (blocking, in MPI) in any
    step that reaches it, not only in a wait on it, first in the queue."""
    s = mods["_sched"]
    s.Alone.ready = lambda self, call, block: (True, True)


def _plant_rows_awaited_alone(mods):
    """cb392f2: a hierarchical call that grows the node window waits for its
    agreement rows in a blocking wait on its own request, advancing no other
    pending call (a flat call a peer must finish first never advances)."""
    mods["_hiercall"]._HierCall._await_rows = lambda self: self.agree_req.Wait()


def _plant_waits_block_with_two_threads(mods):
    """0d1380e: waits block in MPI, holding the engine lock, whatever the
    number of user threads (the rank's other thread cannot start the call a
    peer waits for). Only two-thread runs can find it."""
    mods["_sched"].note_caller = lambda: None


def _plant_sum_handed_over_in_process_order(mods):
    """59f8eb8: with several user threads, a blocking op="none" call hands
    its sum to the reduction thread once it is first in the process's queue,
    whose order across communicators is the threads' timing (not once no
    earlier call of its communicator is pending). Only two-thread runs can
    find it."""
    p = mods["_plainsum"].PlainSum
    sched, reducer = mods["_sched"], mods["_reducer"]
    p.may_hand_over = lambda self: (not sched.may_block() and reducer.Reducer.available()
                                    and sched.at(0) is self.call)


def _plant_short_path_not_alone(mods):
    """Not historical (the short path is new): a blocking small call runs
    straight through while earlier calls are pending, blocking in MPI under
    the lock, so none of them advances while it waits (mpigc._shortcall
    requires _sched.alone()). Only 2-rank runs take the short path."""
    s = mods["_sched"]
    s.alone = lambda: not s.several_threads()


def _plant_first_call_of_a_thread_unnoticed(mods):
    """Not historical: a second user thread's first call leaves the process
    in the one-thread mode (the thread is noted from its second call on), so
    that call may block in MPI holding the lock while the first thread waits
    for the lock to start a call a peer waits for. Only two-thread runs whose
    first thread made the first calls (``main_first``) can find it: in the
    others, the second thread's first call on a communicator makes mpigc's
    state of it, a collective that pairs the threads up first."""
    s = mods["_sched"]
    orig, seen = s.note_caller, set()

    def note_caller():
        me = s.threading.get_ident()
        if me in seen or s._first_caller is None:
            orig()
        seen.add(me)
    s.note_caller = note_caller


def _allgather_rows(mods):
    """Not a fault: the agreement rows travel by one allgather, as they do
    beyond 16 ranks (``P2P_MAX_RANKS``)."""
    mods["_agree"].P2P_MAX_RANKS = 1


PLANTS = {
    "allgather-rows": _allgather_rows,
    "rows-awaited-alone": _plant_rows_awaited_alone,
    "blocking-report": _plant_blocking_report,
    "no-row-on-early-error": _plant_no_row_on_early_error,
    "sends-waited-in-a-step": _plant_sends_waited_in_a_step,
    "agreements-out-of-order": _plant_agreements_out_of_order,
    "sum-in-a-step": _plant_sum_in_a_step,
    "waits-block-with-two-threads": _plant_waits_block_with_two_threads,
    "sum-handed-over-in-process-order": _plant_sum_handed_over_in_process_order,
    "short-path-not-alone": _plant_short_path_not_alone,
    "first-call-of-a-thread-unnoticed": _plant_first_call_of_a_thread_unnoticed,
}
