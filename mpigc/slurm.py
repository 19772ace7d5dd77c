"""Slurm helpers: the job's environment, a preemption signal, consistent resumable saves.

A long training under Slurm runs into its time limit or is preempted. With
``#SBATCH --signal=B:USR1@300`` Slurm warns the batch script 300 s before;
the templates in ``slurm/`` forward that signal to the ranks, and the
training loop does::

    from mpigc import slurm
    slurm.expect_world_size()                  # no silent singletons
    flag = slurm.install_signal_handler()      # SIGUSR1 and SIGTERM set a flag
    fb = mpigc.ErrorFeedback()
    resumed = slurm.load_training_state(ckpt_dir, feedback=fb)
    start = 0 if resumed is None else resumed.step
    params = init() if resumed is None else resumed.arrays
    for step in range(start, nsteps):
        ...                                    # forward, backward, mpigc.allreduce(...)
        if slurm.checkpoint_due(flag):         # one tiny allreduce: same answer everywhere
            slurm.save_training_state(ckpt_dir, params, step=step + 1, feedback=fb)
            raise SystemExit(slurm.RESUME_EXIT_CODE)   # the job script requeues

A signal lands on the ranks at different moments (or on one rank only);
:func:`checkpoint_due` takes the maximum over the ranks once per step, so
every rank decides at the same step boundary and saves the same step.

:func:`save_training_state` writes the residuals (:func:`mpigc.save_checkpoint`),
the model/optimizer arrays and a ``latest`` pointer that is replaced
atomically last, so a job killed during a save resumes from the previous
complete save, never from a mix of two steps. A training whose collectives
are hierarchical passes their ``hierarchy=`` to :func:`save_training_state`
too: it is recorded with the residuals, and :func:`load_training_state`
installs the hierarchical ones for that mode; every key keeps the form it was
saved in (the keys the collectives will use).

Nothing here calls MPI at import; the functions that talk are collective over
``comm`` (default ``COMM_WORLD``, on a private duplicate).

Environment
-----------
``MPIGC_EXPECT_WORLD_SIZE``
    The world size :func:`expect_world_size` asserts (the templates set it to
    the number of tasks they launch). Without it, ``SLURM_STEP_NUM_TASKS`` of
    an ``srun`` step is used.
"""
import dataclasses
import os
import shutil
import signal as _signal
import warnings
from typing import Dict, Mapping, Optional, Sequence, Union

import numpy as np
from mpi4py import MPI

from . import _comm
from ._errors import ConfigError, MpigcError, StateError

__all__ = [
    "SlurmEnv", "slurm_env", "expect_world_size",
    "SignalFlag", "install_signal_handler", "checkpoint_due",
    "TrainingState", "save_training_state", "load_training_state",
    "RESUME_EXIT_CODE", "SlurmError",
]

#: Exit code of a training that saved its state and stopped before the end:
#: the job templates requeue (or resubmit) on it, and end on 0.
RESUME_EXIT_CODE = 85

LATEST = "latest"
STATE_FILE = "state.npz"
RESIDUALS = "residuals"


# -- environment ---------------------------------------------------------------------
def _int(env, name, default=None):
    v = env.get(name)
    if v is None or v == "":
        return default
    try:
        # SLURM_TASKS_PER_NODE-style "4(x2)" and SLURM_GPUS_ON_NODE are plain ints;
        # take the leading integer of anything else rather than fail
        return int(v.split("(")[0].split(",")[0])
    except ValueError:
        return default


@dataclasses.dataclass(frozen=True)
class SlurmEnv:
    """What a process learns about its Slurm job from the environment.

    Every field is ``None`` outside Slurm (``in_slurm`` is False). Inside a
    batch script but outside ``srun`` (e.g. ranks started by ``mpirun``),
    the task fields describe the batch step, not the MPI ranks: use the
    communicator for ranks.
    """

    job_id: Optional[int] = None
    job_name: Optional[str] = None
    restart_count: int = 0            #: ``SLURM_RESTART_COUNT``: times the job was requeued
    num_nodes: Optional[int] = None
    ntasks: Optional[int] = None      #: tasks of the job (``SLURM_NTASKS``)
    step_id: Optional[str] = None     #: set inside an ``srun`` step
    step_num_tasks: Optional[int] = None
    procid: Optional[int] = None      #: global task id of an ``srun`` task
    localid: Optional[int] = None     #: task id on its node
    nodeid: Optional[int] = None
    cpus_per_task: Optional[int] = None
    gpus_on_node: Optional[int] = None
    submit_dir: Optional[str] = None
    array_task_id: Optional[int] = None

    @property
    def in_slurm(self) -> bool:
        return self.job_id is not None

    @property
    def in_step(self) -> bool:
        """Launched by ``srun`` (not by the batch script itself or ``mpirun``)."""
        return self.step_id is not None and self.step_id != "batch"


def slurm_env(environ: Optional[Mapping[str, str]] = None) -> SlurmEnv:
    """The :class:`SlurmEnv` of ``environ`` (default ``os.environ``).

    >>> slurm_env({"SLURM_JOB_ID": "42", "SLURM_NTASKS": "8"}).ntasks
    8
    """
    e = os.environ if environ is None else environ
    return SlurmEnv(
        job_id=_int(e, "SLURM_JOB_ID", _int(e, "SLURM_JOBID")),
        job_name=e.get("SLURM_JOB_NAME"),
        restart_count=_int(e, "SLURM_RESTART_COUNT", 0),
        num_nodes=_int(e, "SLURM_JOB_NUM_NODES", _int(e, "SLURM_NNODES")),
        ntasks=_int(e, "SLURM_NTASKS", _int(e, "SLURM_NPROCS")),
        step_id=e.get("SLURM_STEP_ID") or None,
        step_num_tasks=_int(e, "SLURM_STEP_NUM_TASKS"),
        procid=_int(e, "SLURM_PROCID"),
        localid=_int(e, "SLURM_LOCALID"),
        nodeid=_int(e, "SLURM_NODEID"),
        cpus_per_task=_int(e, "SLURM_CPUS_PER_TASK"),
        gpus_on_node=_int(e, "SLURM_GPUS_ON_NODE"),
        submit_dir=e.get("SLURM_SUBMIT_DIR"),
        array_task_id=_int(e, "SLURM_ARRAY_TASK_ID"),
    )


class SlurmError(MpigcError, RuntimeError):
    """The job was not launched as expected (e.g. ranks started as singletons)."""


def expect_world_size(comm: Optional[MPI.Comm] = None, expected: Optional[int] = None,
                      environ: Optional[Mapping[str, str]] = None) -> int:
    """Raise :class:`SlurmError` unless ``comm`` has the expected number of ranks.

    ``expected`` defaults to ``$MPIGC_EXPECT_WORLD_SIZE``, else to
    ``$SLURM_STEP_NUM_TASKS`` inside an ``srun`` step; with neither, nothing
    is checked. ``srun --mpi=pmi2`` with Open MPI 5, or ``srun`` without
    ``--mpi`` on a cluster whose default does not match the MPI library,
    starts every task as its own world of size 1, which trains N independent
    models without any error: call this first. Local check, no communication
    (each rank sees its own size, so every rank decides the same).

    Returns the world size.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    env = os.environ if environ is None else environ
    source = "expected="
    if expected is None:
        expected = _int(env, "MPIGC_EXPECT_WORLD_SIZE")
        source = "MPIGC_EXPECT_WORLD_SIZE="
    if expected is None:
        s = slurm_env(env)
        if s.in_step:
            expected, source = s.step_num_tasks, "SLURM_STEP_NUM_TASKS="
    size = comm.Get_size()
    if expected is not None and size != expected:
        hint = ("the ranks started as singletons: with Open MPI use srun --mpi=pmix "
                "(or mpirun), with MPICH srun --mpi=pmi2; check srun --mpi=list"
                if size == 1 else "check the launcher's -n / --ntasks")
        raise SlurmError(f"world size {size}, expected {expected} ({source}{expected}): "
                         f"{hint}")
    return size


# -- signals -----------------------------------------------------------------------
class SignalFlag:
    """Set by the signals it was installed for; read by :func:`checkpoint_due`.

    ``received`` is the number of the last signal caught (0: none). The
    handler only records the signal: saving happens at the next step
    boundary, outside the handler, where every rank agrees on it.
    """

    def __init__(self):
        self.received = 0
        self._previous = {}

    def _handler(self, signum, frame):  # noqa: ARG002 - signal API
        self.received = signum

    def set(self, signum: int = int(_signal.SIGUSR1)) -> None:
        """Act as if ``signum`` arrived (tests, or a time budget of your own)."""
        self.received = int(signum)

    def clear(self) -> None:
        self.received = 0

    def ignore(self) -> None:
        """Ignore these signals from now on: call it once the state is saved or
        the training is done, so that a late warning cannot kill a process that
        is exiting (Python restores the default action, termination, at exit)."""
        for sig in list(self._previous):
            _signal.signal(sig, _signal.SIG_IGN)

    def restore(self) -> None:
        """Reinstall the handlers that were in place before."""
        for sig, old in self._previous.items():
            _signal.signal(sig, old)
        self._previous.clear()

    def __bool__(self):
        return bool(self.received)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()

    def __repr__(self):
        return f"SignalFlag(received={self.received})"


_SIGNALS = ("SIGUSR1", "SIGTERM")
_default_flag = None


def _signum(s):
    if isinstance(s, str):
        name = s.upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if not hasattr(_signal, name):
            raise ConfigError(f"signals: expected signal names or numbers, got {s!r}")
        return getattr(_signal, name)
    return _signal.Signals(int(s))


def install_signal_handler(signals: Sequence[Union[str, int]] = _SIGNALS) -> SignalFlag:
    """Catch ``signals`` (default SIGUSR1 and SIGTERM) into a :class:`SignalFlag`.

    SIGUSR1 is the warning that ``#SBATCH --signal=B:USR1@SECONDS`` sends
    (the templates forward it from the batch shell to the ranks); SIGTERM is
    what Slurm sends at preemption and at the time limit, ``KillWait``
    seconds (default 30) before SIGKILL. Call it from the main thread, early:
    a SIGUSR1 that arrives before the handler is installed kills the process.
    The flag becomes the default of :func:`checkpoint_due`.
    """
    global _default_flag
    flag = SignalFlag()
    for s in signals:
        num = _signum(s)
        flag._previous[num] = _signal.signal(num, flag._handler)
    _default_flag = flag
    return flag


# -- agreement -----------------------------------------------------------------------
def _private(comm):
    """mpigc's private duplicate of ``comm`` (collective on first use)."""
    return _comm.resolve(comm).comm


_CLASSES = {c.__name__: c for c in (ConfigError, StateError, MpigcError)}


def _agree(comm, exc, what):
    """Raise on every rank if any rank failed (see _comm.agree)."""
    _comm.agree(comm, exc, what, classes=_CLASSES)


def checkpoint_due(flag: Optional[Union[SignalFlag, bool, int]] = None, *,
                   comm: Optional[MPI.Intracomm] = None) -> int:
    """Whether any rank wants to stop: the same answer on every rank.

    Collective: one allreduce (MAX) of one integer, so call it once per step,
    at the same place on every rank. ``flag`` is a :class:`SignalFlag`, a
    bool or an int (e.g. "my time budget ran out"); default the flag of the
    last :func:`install_signal_handler` (no flag: this rank says no).

    Returns the largest signal number (or int) any rank reported; 0 if none.
    """
    if flag is None:
        flag = _default_flag
    local = 0 if flag is None else int(flag.received if isinstance(flag, SignalFlag)
                                       else flag)
    buf = np.array([local], np.int64)
    _private(comm).Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    return int(buf[0])


# -- consistent saves ----------------------------------------------------------------
@dataclasses.dataclass
class TrainingState:
    """What :func:`load_training_state` found."""

    step: int
    arrays: Dict[str, np.ndarray]
    rank_arrays: Optional[Dict[str, np.ndarray]]
    world_size: int
    path: str
    checkpoint_info: dict


def _step_dir(step):
    return f"step-{int(step):09d}"


def _atomic_savez(fname, arrays, fsync):
    tmp = f"{fname}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        np.savez(f, **{k: np.asarray(v) for k, v in arrays.items()})
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, fname)


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_arrays(arrays, what):
    if not isinstance(arrays, Mapping):
        raise ConfigError(f"{what}: expected a mapping of names to arrays, got "
                          f"{type(arrays).__name__}")
    for k in arrays:
        if not isinstance(k, str) or not k or "/" in k:
            raise ConfigError(f"{what}: names must be non-empty strings without '/', "
                              f"got {k!r}")


def save_training_state(path: Union[str, os.PathLike], arrays: Mapping[str, np.ndarray], *,
                        step: int, feedback=None, comm: Optional[MPI.Intracomm] = None,
                        rank_arrays: Optional[Mapping[str, np.ndarray]] = None,
                        keep: int = 1, fsync: Optional[bool] = None,
                        hierarchy: Optional[str] = None) -> str:
    """Save model/optimizer arrays and the residuals at ``step`` (collective).

    Layout of ``path``::

        latest                     the name of the newest complete save
        step-000000120/
            residuals/             mpigc.save_checkpoint(..., step=120)
            state.npz              ``arrays`` (rank 0's: data-parallel replicas)
            rank-00003.npz         ``rank_arrays`` of rank 3, if given

    ``latest`` is replaced atomically after every rank's part is on disk, so a
    save killed at any point leaves the previous one in effect. ``keep``
    complete saves are kept (older ones are removed after the commit).
    ``arrays`` must be the same on every rank (they are taken from rank 0);
    per-rank state (e.g. a data-loader position) goes to ``rank_arrays``.
    ``path`` must be on a file system all ranks share. An error on any rank
    is raised on every rank.

    ``hierarchy`` is the ``hierarchy=`` (``"flat"``, ``"auto"`` or
    ``"node"``) the training's collectives are called with: it is recorded
    with the residuals (``mpigc.save_checkpoint(..., hierarchy=)``), so that
    :func:`load_training_state` installs the hierarchical ones for the same
    mode by default (each key keeps the form it was saved in; the mode
    decides where the layout changes what it does). Pass it whenever the
    collectives are not flat.

    Returns the directory of this save.
    """
    from .checkpoint import _default_fsync, check_hierarchy_mode, save_checkpoint
    c = _private(comm)
    rank, size = c.Get_rank(), c.Get_size()
    fsync = _default_fsync() if fsync is None else bool(fsync)
    path = os.fspath(path)
    name = _step_dir(step)
    sdir = os.path.join(path, name)
    exc = None
    try:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ConfigError(f"step: expected an int >= 0, got {step!r}")
        if int(keep) < 1:
            raise ConfigError(f"keep: expected an int >= 1, got {keep!r}")
        _check_arrays(arrays, "arrays")
        if rank_arrays is not None:
            _check_arrays(rank_arrays, "rank_arrays")
        check_hierarchy_mode(hierarchy)
        if rank == 0:
            os.makedirs(path, exist_ok=True)
            if os.path.exists(sdir):  # an earlier, unfinished (or repeated) save of this step
                if _read_latest(path) == name:
                    raise StateError(f"{sdir} is the committed save; step {step} was "
                                     "already saved")
                shutil.rmtree(sdir)
            os.mkdir(sdir)
    except Exception as e:  # noqa: BLE001 - raised collectively
        exc = e
    _agree(c, exc, "save_training_state")
    save_checkpoint(os.path.join(sdir, RESIDUALS), feedback=feedback, comm=c,
                    step=int(step), fsync=fsync, hierarchy=hierarchy)
    exc = None
    try:
        if rank == 0:
            _atomic_savez(os.path.join(sdir, STATE_FILE), arrays, fsync)
        if rank_arrays is not None:
            _atomic_savez(os.path.join(sdir, f"rank-{rank:05d}.npz"), rank_arrays, fsync)
    except Exception as e:  # noqa: BLE001
        exc = e
    _agree(c, exc, "save_training_state")
    exc = None
    if rank == 0:
        try:
            if fsync:
                _fsync_dir(sdir)
            tmp = os.path.join(path, f"{LATEST}.tmp-{os.getpid()}")
            with open(tmp, "w") as f:
                f.write(f"{name}\n{size}\n")
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, os.path.join(path, LATEST))
            if fsync:
                _fsync_dir(path)
            saves = sorted(d for d in os.listdir(path) if d.startswith("step-"))
            for old in saves:
                if old < name and old not in saves[-int(keep):]:
                    shutil.rmtree(os.path.join(path, old), ignore_errors=True)
        except Exception as e:  # noqa: BLE001
            exc = e
    _agree(c, exc, "save_training_state")
    return sdir


def _read_latest(path):
    try:
        with open(os.path.join(path, LATEST)) as f:
            return f.readline().strip() or None
    except FileNotFoundError:
        return None


def load_training_state(path: Union[str, os.PathLike], *, feedback=None,
                        comm: Optional[MPI.Intracomm] = None, strict: bool = True,
                        configs=None,
                        hierarchy: Optional[str] = None) -> Optional[TrainingState]:
    """Load the newest complete save of ``path`` (collective), or return None.

    ``None`` (on every rank) when ``path`` holds no committed save yet: a
    fresh start. Otherwise the residuals go into ``feedback`` (see
    :func:`mpigc.load_checkpoint`; on another world size they are re-sharded
    and their totals kept) and every rank gets the arrays. ``rank_arrays`` is
    None unless the save had them and the world size is unchanged.

    Default (``hierarchy`` None): every key is installed in the form it was
    saved in, as :func:`mpigc.load_checkpoint` does by default: flat keys
    (grouped calls' members included) flat, hierarchical ones as
    hierarchical residuals of this communicator's node layout, for the mode
    recorded by :func:`save_training_state` where the layout changes what it
    does (without one, the mode that made them where that is certain, else
    :class:`mpigc.ConfigError` on every rank asks for ``hierarchy=``).
    Given, ``hierarchy`` is the ``hierarchy=`` the collectives will be
    called with from now on, and every key is installed in the form a call
    with it takes here (a change of mode or of layout keeps the totals).
    ``checkpoint_info["forms"]`` gives each key's form,
    ``checkpoint_info["hierarchy"]`` the mode used.
    """
    from .checkpoint import load_checkpoint
    c = _private(comm)
    rank, size = c.Get_rank(), c.Get_size()
    path = os.fspath(path)
    name = _comm.on_root(c, lambda: _read_latest(path), "load_training_state",
                         classes=_CLASSES)
    if name is None:
        return None
    sdir = os.path.join(path, name)
    info = load_checkpoint(os.path.join(sdir, RESIDUALS), feedback=feedback, comm=c,
                           strict=strict, configs=configs, hierarchy=hierarchy)
    exc, arrays, mine = None, None, None
    try:
        with np.load(os.path.join(sdir, STATE_FILE)) as z:
            arrays = {k: z[k] for k in z.files}
        rfile = os.path.join(sdir, f"rank-{rank:05d}.npz")
        if info["world_size"] == size and os.path.exists(rfile):
            with np.load(rfile) as z:
                mine = {k: z[k] for k in z.files}
    except Exception as e:  # noqa: BLE001
        exc = e
    _agree(c, exc, "load_training_state")
    if info["world_size"] != size and rank == 0 and any(
            f.startswith("rank-") and f.endswith(".npz") for f in os.listdir(sdir)):
        warnings.warn(f"{sdir} was saved on {info['world_size']} ranks, this run has "
                      f"{size}: per-rank arrays are not loaded", stacklevel=2)
    return TrainingState(step=int(info["step"]), arrays=arrays, rank_arrays=mine,
                         world_size=int(info["world_size"]), path=sdir,
                         checkpoint_info=info)


# -- command line ----------------------------------------------------------------------
def main(argv=None) -> int:
    """``python -m mpigc.slurm``: check a launch before training.

    Run it exactly as the training would be (``srun --mpi=pmix python -m
    mpigc.slurm``); every rank reports its host, rank, Slurm task ids and the
    GPUs it sees, and the world size is checked against
    ``MPIGC_EXPECT_WORLD_SIZE`` / ``SLURM_STEP_NUM_TASKS``. Exit 1 on a mismatch.
    """
    import argparse
    import socket
    ap = argparse.ArgumentParser(prog="python -m mpigc.slurm", description=main.__doc__
                                 .split("\n")[0])
    ap.add_argument("--expect", type=int, help="world size to expect (default: from "
                                               "the environment)")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    env = slurm_env()
    row = (comm.Get_rank(), socket.gethostname().split(".")[0], env.procid, env.localid,
           os.environ.get("CUDA_VISIBLE_DEVICES", "-"))
    rows = comm.gather(row, root=0)
    try:
        size = expect_world_size(comm, args.expect)
        err = None
    except SlurmError as exc:
        size, err = comm.Get_size(), str(exc)
    if comm.Get_rank() == 0:
        lib = MPI.Get_library_version().split(",")[0].strip()
        print(f"mpigc.slurm: world size {size}, {lib}, job {env.job_id}, step {env.step_id}, restart {env.restart_count}")
        for r in rows:
            print("  rank {} host {} SLURM_PROCID {} SLURM_LOCALID {} "
                  "CUDA_VISIBLE_DEVICES {}".format(*r))
    if err:
        print(f"mpigc.slurm: error: {err}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main())
