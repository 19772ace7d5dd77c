"""A fake MPI in one process, for the model checker (tests/test_model_check.py).

N simulated ranks run as threads, one at a time: every call of this MPI is a
point where the :class:`World` hands the turn to a thread it picks (with a
seeded random generator, so a seed is an interleaving and replays exactly).
A thread that waits (``Wait``, ``Mprobe``, a blocking collective) is picked
only once what it waits for is there. A *deadlock* is a turn with nothing to
pick while some thread is unfinished; a *livelock* is a run past its step
budget (a rank that polls forever for a peer blocked elsewhere). Either ends
the run with every thread's stack.

What it models, as strictly as MPI allows:

- point to point: a send completes only once a receive has taken it (no
  buffering: a program that relies on eager sends is caught); messages of
  one sender, communicator and tag are received in send order; the data is
  copied when the receive matches, so a sender that reuses its buffer too
  early delivers what it wrote meanwhile; matched probes (``Mprobe``,
  ``Improbe``) with the message's size;
- collectives: the k-th collective of each rank on a communicator match
  each other; one that differs in kind is reported as a mismatch (in MPI,
  undefined: a hang or wrong data); nonblocking ones complete once every
  rank has started them, blocking ones wait for that; sums add in rank
  order;
- communicators: ``Dup``, ``Split`` (``UNDEFINED``: ``COMM_NULL``),
  ``Split_type`` (every rank on one node), attributes;
- threads: ``Query_thread`` gives the run's level (``THREAD_SERIALIZED``
  by default: the engine then starts no thread, and the checker's programs
  call ``test()`` instead). At ``THREAD_MULTIPLE``, an engine copy made with
  :func:`threading_module` (and :func:`time_module`) has locks, conditions,
  events, sleeps and threads whose every blocking step is a point of the
  schedule: its progress and reduction threads, and a rank's second user
  thread (:meth:`World.spawn`), are interleaved like ranks;
- what hierarchical calls add: pickled ``allgather``, ``allreduce``,
  ``bcast``, ``alltoall``; ``Alltoallv`` and ``Ialltoallv`` (counts in
  elements of the buffer's dtype, or of a given datatype); shared-memory
  windows (``Win.Allocate_shared`` and ``Win.Free`` collective and blocking,
  ``Shared_query`` the segments every rank of the node sees at once,
  ``Sync`` and the locks points of the schedule).

Only what mpigc's engine uses is here; anything else raises.
"""
import sys
import threading
import traceback
import types

import numpy as np

UNDEFINED = -32766
THREAD_SINGLE, THREAD_FUNNELED, THREAD_SERIALIZED, THREAD_MULTIPLE = 0, 1, 2, 3
COMM_TYPE_SHARED = 1
MODE_NOCHECK = 1024
COMM_NULL = None  # what Split gives a rank of color UNDEFINED


class Unwind(BaseException):
    """Raised in every simulated thread once a run has failed (a deadlock,
    a livelock, an abort): its stack unwinds. Not an Exception, so that
    ``except Exception`` in the code under test lets it through."""


class RunFailed(Exception):
    """A run ended in a deadlock, a livelock, a mismatched collective or an
    abort; ``kind`` says which, ``detail`` the stacks and the schedule."""

    def __init__(self, kind, detail):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


class _Thread:
    __slots__ = ("name", "ready", "done", "ident", "error", "rank", "daemon", "cond")

    def __init__(self, name, rank, cond, daemon=False):
        self.name = name
        self.cond = cond  # on the World's lock: notified when the turn is its own
        self.ready = None  # None: runnable; else a predicate
        self.done = False
        self.ident = None
        self.error = None
        self.rank = rank
        self.daemon = daemon  # the run ends without it (it unwinds)


_current = threading.local()  # the World of the running simulated thread


def world():
    w = getattr(_current, "world", None)
    if w is None:
        raise RuntimeError("fake MPI called outside a simulated rank")
    return w


class World:
    """One run: ``run(programs)`` runs ``programs[r]()`` as rank r's thread,
    interleaved at every MPI call by ``rng``; returns their results or raises
    :class:`RunFailed`."""

    SPIN = 50  # a systematic run's running thread that polls this long yields

    def __init__(self, size, seed, max_steps=200_000, idle_steps=20_000, choices=None,
                 thread_level=THREAD_SERIALIZED):
        self.size = size
        # what Query_thread gives: THREAD_MULTIPLE lets the engine start its
        # threads (engine copies made with threads=True: :func:`threading_module`)
        self.thread_level = thread_level
        self.over = False  # every rank's program has returned: daemons unwind
        # choices: the decisions of a systematic run (see _pick); None: random
        self.choices = choices
        self.decisions = []
        self.idle_steps = idle_steps
        self.last_change = 0
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.max_steps = max_steps
        # the World's lock; cv wakes the thread that starts a run or a thread (their
        # ident), each simulated thread's own condition its turn (_Thread.cond): a
        # hand-over wakes the one thread whose turn it is, not every thread (a run of
        # 4 ranks: 5-10 context switches a step before, with notify_all)
        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)
        self.threads = []
        self._joined = {}  # spawned thread: its OS thread
        self.turn = None
        self.failed = None
        self.steps = 0
        self._next_ctx = 0
        self.world_ctx = None  # the first communicator made: MPI.COMM_WORLD

    # -- the turns -----------------------------------------------------------
    def _me(self):
        me = getattr(_current, "thread", None)
        if me is None:
            raise RuntimeError("not a simulated thread")
        return me

    def _pick(self, me=None):
        """Under cv: hand the turn to a runnable thread, or fail the run.

        Random runs pick any runnable thread. Systematic runs (``choices``)
        go on with the running thread ``me`` while it can (and has not polled
        for ``SPIN`` points without anything happening), and otherwise with
        the next runnable thread; the k-th point with more than one option
        takes option ``choices[k]`` instead (0 when there is none), where
        option 0 is the default and, with ``me`` runnable, any other option
        is a preemption. ``decisions`` records ``(options, preemption)`` of
        every such point, for :func:`model_check.explore`."""
        self.steps += 1
        if self.steps > self.max_steps:
            self._fail("livelock", f"no end after {self.max_steps} steps")
            return
        if self.steps - self.last_change > self.idle_steps:
            self._fail("livelock", f"{self.idle_steps} steps without a message sent or "
                       "received, a collective started or a request completed: the "
                       "ranks that run only poll")
            return
        live = [t for t in self.threads if not t.done]
        if not any(not t.daemon for t in live):
            self.over = self.over or bool(live)  # the engine's daemon threads unwind
            self.turn = None
            self._wake_all()
            return
        ok = [t for t in live if t.ready is None or t.ready()]
        if not ok:
            self._fail("deadlock", "every unfinished thread waits: " +
                       ", ".join(t.name for t in live))
            return
        if self.choices is None:
            self.turn = ok[int(self.rng.integers(len(ok)))]
        else:
            preempt = me in ok
            if preempt and self.steps - self.last_change > self.SPIN:
                # me only polls: the next runnable thread after it goes on (an
                # operating system's scheduler is fair too), not a preemption
                i = self.threads.index(me)
                ok = sorted(ok, key=lambda t: (self.threads.index(t) - i - 1)
                            % len(self.threads))
                preempt = False
            elif preempt:
                ok = [me] + [t for t in ok if t is not me]
            c = 0
            if len(ok) > 1:
                k = len(self.decisions)
                c = self.choices[k] if k < len(self.choices) else 0
                self.decisions.append((len(ok), preempt))
            self.turn = ok[c]
        if self.turn is not me:
            self.turn.cond.notify()

    def _wake_all(self):
        """Under cv: wake every thread (the run failed or is over)."""
        self.cv.notify_all()
        for t in self.threads:
            t.cond.notify()

    def _fail(self, kind, why):
        if self.failed is None and not self.over:  # (over: a daemon's unwinding)
            frames = sys._current_frames()
            stacks = []
            for t in self.threads:
                if t.done or t.ident not in frames:
                    continue
                st = traceback.format_stack(frames[t.ident])
                stacks.append(f"--- {t.name}\n" + "".join(
                    s for s in st if "fakempi.py" not in s)[-3000:])
            self.failed = (kind, f"{why} (seed {self.seed}, step {self.steps})\n"
                           + "\n".join(stacks))
        self.turn = None
        self._wake_all()

    def point(self, ready=None):
        """A scheduling point of the running thread: it may go on once
        ``ready()`` (None: at once) and the turn is its own again."""
        me = self._me()
        with self.cv:
            if self.failed:
                raise Unwind()
            me.ready = ready
            self._pick(me)
            while self.turn is not me and not self.failed and not self.over:
                me.cond.wait()
            if self.failed or self.over:
                raise Unwind()
            me.ready = None

    def fail(self, kind, why):
        with self.cv:
            self._fail(kind, why)
        raise Unwind()

    def run(self, programs, timeout=120):
        """Run one program per rank; return their results in rank order. Rank
        r's program runs in the same thread in every run (:func:`_worker`),
        as a rank's user thread would: the engine notes which threads call it."""
        results = [None] * len(programs)
        self.threads = [self._thread(f"rank {r}", r) for r in range(len(programs))]
        finished = threading.Semaphore(0)

        def main(r, t, fn):
            def program():
                results[r] = fn()
            self._body(t, program)
            finished.release()

        for r, (t, fn) in enumerate(zip(self.threads, programs)):
            _worker(r).put((main, (r, t, fn)))
        with self.cv:
            while any(t.ident is None for t in self.threads):
                self.cv.wait(0.01)
            self._pick()
        for _ in programs:
            if not finished.acquire(timeout=timeout):
                with self.cv:
                    self._fail("stuck", "a simulated thread blocked outside the fake MPI")
                raise RunFailed(*self.failed)
        for t in self.threads[len(programs):]:  # the engine's threads: unwound
            self._joined[t].join(timeout)
        if self.failed:
            raise RunFailed(*self.failed)
        for t in self.threads:
            if t.error is not None:
                raise t.error
        return results

    def _body(self, t, fn):
        """Run ``fn`` as the simulated thread ``t`` (in the calling OS thread)."""
        _current.world, _current.thread, _current.rank = self, t, t.rank
        with self.cv:
            t.ident = threading.get_ident()
            self.cv.notify_all()
            while self.turn is not t and not self.failed and not self.over:
                t.cond.wait()
        try:
            if not self.failed and not self.over:
                fn()
        except Unwind:
            pass
        except BaseException as e:  # noqa: BLE001 - the run's error
            t.error = e
        finally:
            _current.world = _current.thread = None
            with self.cv:
                t.done = True
                if self.turn is t or self.turn is None:
                    self._pick()

    def spawn(self, fn, name, daemon=False):
        """Start ``fn`` as a new simulated thread of the running rank (an
        OS thread of its own, run one at a time like every other); returns
        its :class:`_Thread`. A daemon does not keep the run going: once
        every non-daemon thread has ended, it unwinds at its next point."""
        me = self._me()
        t = self._thread(f"{me.name.split('/')[0]}/{name}", me.rank, daemon)
        with self.cv:
            self.threads.append(t)
        os_thread = threading.Thread(target=self._body, args=(t, fn), daemon=True,
                                     name=f"sim-{t.name}")
        self._joined[t] = os_thread
        os_thread.start()
        with self.cv:
            while t.ident is None:
                self.cv.wait(0.01)
        self.point()  # the new thread may run first
        return t

    def _thread(self, name, rank, daemon=False):
        return _Thread(name, rank, threading.Condition(self.lock), daemon)

    def join(self, t):
        """The running thread waits until the simulated thread ``t`` ends."""
        self.point(lambda: t.done)

    def new_ctx(self, ranks):
        self._next_ctx += 1
        ctx = _Ctx(self._next_ctx, ranks)
        if self.world_ctx is None:
            self.world_ctx = ctx
        return ctx


def rank():
    return _current.rank


def _changed():
    """Something happened that a waiting rank may be waiting for."""
    w = world()
    w.last_change = w.steps


_workers = {}


def _worker(r):
    """The queue of rank r's thread, which runs every run's rank-r program."""
    q = _workers.get(r)
    if q is None:
        import queue
        q = _workers[r] = queue.Queue()

        def loop():
            while True:
                fn, args = q.get()
                fn(*args)
        threading.Thread(target=loop, daemon=True, name=f"sim-rank-{r}").start()
    return q


# -- buffers ---------------------------------------------------------------------
def _bytes(spec):
    """The bytes of a buffer argument (an array, ``[buf, BYTE]`` or ``[buf,
    count, BYTE]``), as a writable uint8 view."""
    count = None
    if isinstance(spec, (list, tuple)):
        if len(spec) == 3:
            count = spec[1] * spec[2].size
        spec = spec[0]
    if isinstance(spec, (bytearray, memoryview, bytes)):
        a = np.frombuffer(spec, np.uint8)
    else:
        a = np.asarray(spec)
        a = a.reshape(a.size).view(np.uint8)
    return a if count is None else a[:count]


def _typed(spec):
    if isinstance(spec, (list, tuple)):
        spec = spec[0]
    a = np.asarray(spec)
    return a.reshape(a.size)


# -- requests ----------------------------------------------------------------------
class Request:
    """A request: ``complete`` once its operation is over; null once a test
    or wait has seen it complete (falsy, as mpi4py's ``REQUEST_NULL``)."""

    def __init__(self, complete=False):
        self.complete = complete
        self.null = False

    def __bool__(self):
        return not self.null

    def _over(self):
        return self.null or self.complete

    def Test(self):
        world().point()
        if self._over():
            self.null = True
            _changed()
            return True
        return False

    def Wait(self, status=None):
        world().point(self._over)
        self.null = True

    def Free(self):
        self.null = True

    @staticmethod
    def Testall(reqs, statuses=None):
        world().point()
        if all(r._over() for r in reqs):
            for r in reqs:
                r.null = True
            _changed()
            return True
        return False

    @staticmethod
    def Waitall(reqs, statuses=None):
        world().point(lambda: all(r._over() for r in reqs))
        for r in reqs:
            r.null = True
        return True

    @staticmethod
    def _one(reqs):
        active = [i for i, r in enumerate(reqs) if not r.null]
        done = [i for i in active if reqs[i].complete]
        return active, done

    @staticmethod
    def Testany(reqs, status=None):
        w = world()
        w.point()
        active, done = Request._one(reqs)
        if not active:
            return UNDEFINED, True
        if not done:
            return UNDEFINED, False
        i = done[int(w.rng.integers(len(done)))]
        reqs[i].null = True
        _changed()
        return i, True

    @staticmethod
    def Waitany(reqs, status=None):
        w = world()
        if not Request._one(reqs)[0]:
            w.point()
            return UNDEFINED
        w.point(lambda: bool(Request._one(reqs)[1]))
        done = Request._one(reqs)[1]
        i = done[int(w.rng.integers(len(done)))]
        reqs[i].null = True
        return i

    @staticmethod
    def Testsome(reqs, statuses=None):
        world().point()
        active, done = Request._one(reqs)
        if not active:
            return None
        for i in done:
            reqs[i].null = True
        if done:
            _changed()
        return done

    @staticmethod
    def Waitsome(reqs, statuses=None):
        w = world()
        if not Request._one(reqs)[0]:
            w.point()
            return None
        w.point(lambda: bool(Request._one(reqs)[1]))
        done = Request._one(reqs)[1]
        for i in done:
            reqs[i].null = True
        return done


class Status:
    def __init__(self):
        self.count = 0
        self.source = self.tag = None

    def Get_count(self, datatype=None):
        return self.count


class Message:
    """A message taken by a matched probe: ``Irecv`` or ``Recv`` receives it."""

    def __init__(self, ctx, send):
        self.ctx, self.send = ctx, send

    def Irecv(self, buf):
        w = world()
        w.point()
        self.ctx.deliver(self.send, _bytes(buf))
        return Request(complete=True)

    def Recv(self, buf, status=None):
        self.Irecv(buf).Wait()


# -- communicators ---------------------------------------------------------------------
class _Send:
    __slots__ = ("src", "dst", "tag", "data", "req", "taken")

    def __init__(self, src, dst, tag, data, req):
        self.src, self.dst, self.tag, self.data, self.req = src, dst, tag, data, req
        self.taken = False


class _Coll:
    __slots__ = ("kind", "args", "done", "result", "first")

    def __init__(self, kind, first):
        self.kind, self.first = kind, first
        self.args = {}
        self.done = False
        self.result = None


class _Ctx:
    """What the ranks of one communicator share: messages in flight, posted
    receives and the collectives started so far."""

    def __init__(self, cid, ranks):
        self.cid = cid
        self.ranks = ranks  # world ranks, in this communicator's order
        self.sends = []  # not yet taken, in send order
        self.recvs = []  # posted, not yet matched: (dst, src, tag, buf, req)
        self.colls = []
        self.nth = [0] * len(ranks)  # each rank's collectives so far

    def deliver(self, send, buf):
        _changed()
        n = len(send.data)
        if n > len(buf):
            raise RuntimeError(f"message of {n} bytes truncated to {len(buf)} (MPI_ERR_TRUNCATE)")
        buf[:n] = send.data
        send.taken = True
        send.req.complete = True
        if send in self.sends:
            self.sends.remove(send)

    def match(self):
        for rv in list(self.recvs):
            dst, src, tag, buf, req = rv
            for s in self.sends:
                if s.dst == dst and s.src == src and s.tag == tag:
                    self.deliver(s, buf)
                    req.complete = True
                    self.recvs.remove(rv)
                    break

    def first_message(self, dst, src, tag):
        for s in self.sends:
            if s.dst == dst and s.src == src and s.tag == tag:
                # a receive posted before it would take it first
                if any(r[0] == dst and r[1] == src and r[2] == tag for r in self.recvs):
                    return None
                return s
        return None

    def collective(self, me, kind, args, finish):
        """Rank ``me`` starts its next collective; ``finish(args)`` runs once
        every rank has (with every rank's ``args``). Returns the record."""
        _changed()
        k = self.nth[me]
        self.nth[me] += 1
        if k == len(self.colls):
            self.colls.append(_Coll(kind, me))
        c = self.colls[k]
        if c.kind != kind:
            world().fail("mismatch", f"collective {k} on communicator {self.cid}: rank "
                         f"{c.first} started {c.kind}, rank {me} {kind}")
        c.args[me] = args
        if len(c.args) == len(self.ranks):
            c.result = finish(c.args)
            c.done = True
        return c


IN_PLACE = object()


class _Op:
    def __init__(self, name):
        self.name = name


SUM = _Op("sum")


class _Datatype:
    """A datatype of ``size`` contiguous bytes (what the engine builds for
    messages beyond ``$MPIGC_MAX_COUNT`` bytes is contiguous)."""

    def __init__(self, name, size=1):
        self.name, self.size = name, size

    def Create_contiguous(self, count):
        return _Datatype(f"{count} x {self.name}", count * self.size)

    def Commit(self):
        return self

    def Free(self):
        pass


BYTE = _Datatype("byte")


class Intracomm:
    """Rank ``rank`` of a simulated communicator."""

    def __init__(self, ctx, rank):
        self.ctx, self.rank = ctx, rank
        self.attrs = {}
        self.handle = id(self)

    # -- plain queries
    def Get_size(self):
        return len(self.ctx.ranks)

    def Get_rank(self):
        return self.rank

    @property
    def size(self):
        return self.Get_size()

    def Get_attr(self, keyval):
        return self.attrs.get(keyval)

    def Set_attr(self, keyval, value):
        self.attrs[keyval] = value

    def Free(self):
        pass

    def Abort(self, code=1):
        world().fail("abort", f"rank {self.rank} called Abort({code})")

    # -- point to point
    def Isend(self, buf, dest, tag=0):
        w = world()
        w.point()
        req = Request()
        _changed()
        self.ctx.sends.append(_Send(self.rank, dest, tag, _bytes(buf), req))
        self.ctx.match()
        return req

    def Irecv(self, buf, source, tag=0):
        w = world()
        w.point()
        req = Request()
        self.ctx.recvs.append((self.rank, source, tag, _bytes(buf), req))
        self.ctx.match()
        return req

    def Sendrecv(self, sendbuf, dest, sendtag, recvbuf, source, recvtag):
        a = self.Isend(sendbuf, dest, sendtag)
        b = self.Irecv(recvbuf, source, recvtag)
        Request.Waitall([a, b])

    def Improbe(self, source, tag, status=None):
        world().point()
        s = self.ctx.first_message(self.rank, source, tag)
        if s is None:
            return None
        return self._taken(s, status)

    def Mprobe(self, source, tag, status=None):
        world().point(lambda: self.ctx.first_message(self.rank, source, tag) is not None)
        return self._taken(self.ctx.first_message(self.rank, source, tag), status)

    def _taken(self, s, status):
        self.ctx.sends.remove(s)
        if status is not None:
            status.count, status.source, status.tag = len(s.data), s.src, s.tag
        return Message(self.ctx, s)

    # -- collectives
    def _start(self, kind, args, finish):
        world().point()
        return _CollRequest(self.ctx.collective(self.rank, kind, args, finish))

    def _blocking(self, kind, args, finish):
        req = self._start(kind, args, finish)
        req.Wait()
        return req.coll.result

    def _allgather(self, args):
        parts = [args[r][0] for r in range(len(args))]
        for r in range(len(args)):
            out = args[r][1]
            o = 0
            for p in parts:
                out[o:o + len(p)] = p
                o += len(p)

    def Iallgather(self, sendbuf, recvbuf):
        return self._start("allgather", (_bytes(sendbuf).copy(), _bytes(recvbuf)),
                           self._allgather)

    def Allgather(self, sendbuf, recvbuf):
        self._blocking("allgather", (_bytes(sendbuf).copy(), _bytes(recvbuf)),
                       self._allgather)

    @staticmethod
    def _sum(parts):
        acc = parts[0].copy()
        for p in parts[1:]:
            acc += p
        return acc

    def _allreduce_args(self, sendbuf, recvbuf):
        out = _typed(recvbuf)
        x = out.copy() if sendbuf is IN_PLACE else _typed(sendbuf).copy()
        return (x, out)

    def _allreduce(self, args):
        total = self._sum([args[r][0] for r in range(len(args))])
        for r in args:
            args[r][1][...] = total

    def Iallreduce(self, sendbuf, recvbuf, op=SUM):
        return self._start("allreduce", self._allreduce_args(sendbuf, recvbuf), self._allreduce)

    def Allreduce(self, sendbuf, recvbuf, op=SUM):
        self._blocking("allreduce", self._allreduce_args(sendbuf, recvbuf), self._allreduce)

    def _reduce_scatter(self, args):
        counts = args[0][2]
        total = self._sum([args[r][0] for r in range(len(args))])
        o = 0
        for r, c in enumerate(counts):
            args[r][1][...] = total[o:o + c]
            o += c

    def Ireduce_scatter(self, sendbuf, recvbuf, recvcounts, op=SUM):
        return self._start("reduce_scatter", (_typed(sendbuf).copy(), _typed(recvbuf),
                                              list(recvcounts)), self._reduce_scatter)

    def Reduce_scatter(self, sendbuf, recvbuf, recvcounts, op=SUM):
        self._blocking("reduce_scatter", (_typed(sendbuf).copy(), _typed(recvbuf),
                                          list(recvcounts)), self._reduce_scatter)

    def _reduce(self, args):
        root = args[0][2]
        args[root][1][...] = self._sum([args[r][0] for r in range(len(args))])

    def Ireduce(self, sendbuf, recvbuf, op=SUM, root=0):
        rb = None if recvbuf is None else _typed(recvbuf)
        return self._start(f"reduce(root {root})", (_typed(sendbuf).copy(), rb, root),
                           self._reduce)

    def Reduce(self, sendbuf, recvbuf, op=SUM, root=0):
        rb = None if recvbuf is None else _typed(recvbuf)
        self._blocking(f"reduce(root {root})", (_typed(sendbuf).copy(), rb, root),
                       self._reduce)

    def Ibarrier(self):
        return self._start("barrier", None, lambda args: None)

    def Barrier(self):
        self._blocking("barrier", None, lambda args: None)

    # -- pickled collectives (values, not buffers)
    def allgather(self, obj):
        return list(self._blocking("allgather(obj)", obj,
                                   lambda args: [args[r] for r in range(len(args))]))

    def allreduce(self, obj, op=SUM):
        return self._blocking("allreduce(obj)", obj,
                              lambda args: sum(args[r] for r in range(len(args))))

    def bcast(self, obj, root=0):
        return self._blocking(f"bcast(root {root})", obj, lambda args: args[root])

    def alltoall(self, objs):
        res = self._blocking("alltoall(obj)", list(objs),
                             lambda args: [[args[s][r] for s in range(len(args))]
                                           for r in range(len(args))])
        return res[self.rank]

    # -- all to all, by counts and displacements
    @staticmethod
    def _vspec(spec):
        """``[buf, (counts, displs)]`` or ``[buf, (counts, displs), datatype]``:
        the buffer's bytes and each peer's byte range."""
        buf, (counts, displs) = spec[0], spec[1]
        size = spec[2].size if len(spec) == 3 else np.asarray(buf).itemsize
        return _bytes(buf), [(int(d) * size, (int(d) + int(c)) * size)
                             for c, d in zip(counts, displs)]

    def _alltoallv_args(self, sendspec, recvspec):
        sb, sr = self._vspec(sendspec)
        rb, rr = self._vspec(recvspec)
        return ([sb[a:b].copy() for a, b in sr], rb, rr)

    @staticmethod
    def _alltoallv(args):
        for r, (_, rb, rr) in args.items():
            for s in range(len(args)):
                part = args[s][0][r]
                a, b = rr[s]
                if len(part) != b - a:
                    raise RuntimeError(f"alltoallv: rank {s} sends {len(part)} bytes to rank "
                                       f"{r}, which expects {b - a}")
                rb[a:b] = part

    def Ialltoallv(self, sendspec, recvspec):
        return self._start("alltoallv", self._alltoallv_args(sendspec, recvspec),
                           self._alltoallv)

    def Alltoallv(self, sendspec, recvspec):
        self._blocking("alltoallv", self._alltoallv_args(sendspec, recvspec), self._alltoallv)

    # -- communicators
    def _split(self, args):
        w = world()
        groups = {}
        for r in sorted(args):
            color, key = args[r]
            if color is not None and color != UNDEFINED:
                groups.setdefault(color, []).append((key, r))
        out = {}
        for members in groups.values():
            members.sort()
            ctx = w.new_ctx([self.ctx.ranks[r] for _, r in members])
            for i, (_, r) in enumerate(members):
                out[r] = (ctx, i)
        return out

    def Split(self, color=0, key=0):
        res = self._blocking("split", (color, key), self._split)
        if self.rank not in res:
            return COMM_NULL
        ctx, i = res[self.rank]
        return Intracomm(ctx, i)

    def Dup(self):
        return self.Split(0, self.rank)

    def Split_type(self, split_type, key=0, info=None):
        return self.Split(0, key)


class Win:
    """A shared-memory window of a node's communicator: every rank's segment
    is one array of this process, seen by all of them at once."""

    def __init__(self, comm, segs):
        self.comm, self.segs = comm, segs

    @staticmethod
    def Allocate_shared(size, disp_unit=1, info=None, comm=None):
        segs = comm._blocking("win_allocate_shared", int(size),
                              lambda args: [bytearray(args[r]) for r in range(len(args))])
        return Win(comm, segs)

    def Shared_query(self, rank):
        world().point()
        return memoryview(self.segs[rank]), 1

    def Lock_all(self, assertion=0):
        world().point()

    def Unlock_all(self):
        world().point()

    def Sync(self):
        world().point()

    def Free(self):
        self.comm._blocking("win_free", None, lambda args: None)


class _CollRequest(Request):
    def __init__(self, coll):
        super().__init__()
        self.coll = coll

    def _over(self):
        return self.null or self.coll.done


class Comm:
    _keyvals = 0

    @classmethod
    def Create_keyval(cls, *args, **kwargs):
        cls._keyvals += 1
        return cls._keyvals


class Datatype:
    @staticmethod
    def Create_struct(blocklengths, displacements, datatypes):
        size = sum(b * t.size for b, t in zip(blocklengths, datatypes))
        return _Datatype("struct", size)


def Is_initialized():
    return True


def Is_finalized():
    return False


def Query_thread():
    w = getattr(_current, "world", None)
    return THREAD_SERIALIZED if w is None else w.thread_level


def module():
    """This fake as a module named ``mpi4py.MPI`` (what ``from mpi4py import
    MPI`` binds in the engine's copies)."""
    m = types.ModuleType("mpi4py.MPI")
    for name in ("UNDEFINED", "THREAD_SINGLE", "THREAD_FUNNELED", "THREAD_SERIALIZED",
                 "THREAD_MULTIPLE", "COMM_TYPE_SHARED", "MODE_NOCHECK", "COMM_NULL",
                 "IN_PLACE", "SUM", "BYTE", "Request", "Status", "Message", "Intracomm", "Comm",
                 "Datatype", "Win",
                 "Is_initialized", "Is_finalized", "Query_thread"):
        setattr(m, name, globals()[name])
    m.COMM_WORLD = _WorldComm()
    return m


class _WorldComm:
    """``MPI.COMM_WORLD``: the running rank's handle of the run's first
    communicator (the checker passes every communicator explicitly; the
    engine names COMM_WORLD in its error messages)."""

    def __getattr__(self, name):
        w = world()
        return getattr(Intracomm(w.world_ctx, rank()), name)


def world_comm(ctx):
    """The running rank's handle of the communicator ``ctx``."""
    return Intracomm(ctx, rank())


# -- threads -------------------------------------------------------------------------
# What an engine copy made with threads (model_check.engine(threads=True)) has
# for ``threading``, ``time`` and ``atexit``: locks, conditions, events and
# threads whose every blocking step is a point of the run's schedule, so that
# the engine's progress and reduction threads and a rank's second user thread
# are interleaved like ranks. A condition or event waited for with a timeout
# may wake at any point (as if the time had passed); time is the run's step
# count (a run replays whatever the machine's speed); ``sleep`` is a point.
# Outside a run (the copy's import) they do nothing.

def _running():
    return getattr(_current, "world", None)


class _Lock:
    def __init__(self, reentrant=False):
        self.owner = None
        self.count = 0
        self.reentrant = reentrant

    def _free_for(self, me):
        return self.owner is None or (self.reentrant and self.owner is me)

    def acquire(self, blocking=True, timeout=-1):
        w = _running()
        if w is None:
            return True
        me = w._me()
        if not blocking and not self._free_for(me):
            w.point()
            return False
        w.point(lambda: self._free_for(me))
        self.owner = me
        self.count += 1
        return True

    def release(self):
        if _running() is None:
            return
        if self.owner is not _running()._me():
            raise RuntimeError("release of a lock this thread does not hold")
        self.count -= 1
        if self.count == 0:
            self.owner = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


class _Condition:
    def __init__(self, lock=None):
        self.lock = lock if lock is not None else _Lock(True)
        self.waiters = []

    def acquire(self, *args):
        return self.lock.acquire(*args)

    def release(self):
        self.lock.release()

    def __enter__(self):
        self.lock.acquire()
        return self

    def __exit__(self, *exc):
        self.lock.release()

    def wait(self, timeout=None):
        """True when notified; False when it woke as if timed out."""
        w = _running()
        if w is None:
            return False
        me, lk = w._me(), self.lock
        if lk.owner is not me:
            raise RuntimeError("wait on a condition whose lock this thread does not hold")
        count, lk.owner, lk.count = lk.count, None, 0
        token = [False]
        self.waiters.append(token)
        try:
            w.point(lambda: (token[0] or timeout is not None) and lk._free_for(me))
        finally:  # held again (when unwinding too: the caller's ``with`` releases it)
            if token in self.waiters:
                self.waiters.remove(token)
            lk.owner, lk.count = me, count
        return token[0]

    def notify(self, n=1):
        for token in self.waiters[:n]:
            token[0] = True
        del self.waiters[:n]

    def notify_all(self):
        self.notify(len(self.waiters))


class _Event:
    def __init__(self):
        self.flag = False

    def set(self):
        self.flag = True

    def clear(self):
        self.flag = False

    def is_set(self):
        # a point: a thread that polls another's event (without MPI) lets it run
        w = _running()
        if w is not None:
            w.point()
        return self.flag

    def wait(self, timeout=None):
        w = _running()
        if w is not None and not self.flag:
            w.point(lambda: self.flag or timeout is not None)
        return self.flag


class _SimThread:
    def __init__(self, group=None, target=None, name=None, args=(), kwargs=None, *,
                 daemon=None):
        self.target, self.args, self.kwargs = target, args, kwargs or {}
        self.name, self.daemon = name or "thread", bool(daemon)
        self.sim = None

    def start(self):
        self.sim = world().spawn(lambda: self.target(*self.args, **self.kwargs), self.name,
                                 self.daemon)

    def is_alive(self):
        return self.sim is not None and not self.sim.done

    def join(self, timeout=None):
        w = _running()
        if w is not None and self.sim is not None:
            w.join(self.sim)


def _sleep(seconds):
    w = _running()
    if w is not None:
        w.point()


def _clock():
    w = _running()
    return w.steps * 1e-6 if w is not None else 0.0


def threading_module():
    """``threading`` for an engine copy (see above)."""
    m = types.ModuleType("threading")
    m.Lock = _Lock
    m.RLock = lambda: _Lock(True)
    m.Condition, m.Event, m.Thread = _Condition, _Event, _SimThread
    m.local, m.get_ident = threading.local, threading.get_ident
    return m


def time_module():
    """``time`` for an engine copy: the run's steps for its clock."""
    m = types.ModuleType("time")
    m.sleep = _sleep
    m.perf_counter = m.monotonic = m.time = _clock
    return m


def atexit_module():
    """``atexit`` for an engine copy: nothing runs at the interpreter's exit
    (the copies are gone by then)."""
    m = types.ModuleType("atexit")
    m.register = lambda fn, *a, **k: fn
    m.unregister = lambda fn: None
    return m
