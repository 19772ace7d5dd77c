"""Residual checkpoints across ranks: run as

    mpirun -n K python -m pytest --with-mpi -q tests/mpi/test_checkpoint_mpi.py

for K in 1..4. Every check agrees on pass/fail across ranks before asserting.
"""
import io
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest
from mpi4py import MPI

import mpigc
from mpigc import checkpoint as ckpt
from mpigc.checkpoint import CheckpointError

from conftest import on_root, raises_everywhere

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()

# key, op, n, dtype, gather  (n = 3 leaves empty shards at 4 ranks)
KEYS = [
    ("w/2bit", {"type": "2bit", "threshold": 0.5}, 1001, np.float32, "compressed"),
    ("w/1bit", {"type": "1bit", "block_size": 64}, 777, np.float32, "compressed"),
    ("w/tern-ef", {"type": "terngrad", "seed": 3, "error_feedback": True}, 513, np.float32,
     "compressed"),
    ("w/tern", {"type": "terngrad", "seed": 5}, 65, np.float64, "exact"),
    ("w/fp16", {"type": "fp16", "error_feedback": True}, 300, np.float16, "compressed"),
    ("w/bf16", {"type": "bf16", "error_feedback": True}, 300, np.float32, "compressed"),
    ("w/exact64", {"type": "2bit", "threshold": 0.25}, 130, np.float64, "exact"),
    ("w/tiny", {"type": "2bit", "threshold": 0.5}, 3, np.float32, "compressed"),
]
# keys whose outputs are exact enough for the conservation check (float32/64 buffers)
CONS_KEYS = [k for k in KEYS if k[0] in ("w/2bit", "w/1bit", "w/tern-ef", "w/exact64")]


def agree(ok, what="check"):
    """Assert on every rank that ``ok`` holds on every rank."""
    oks = WORLD.allgather(bool(ok))
    assert all(oks), f"{what} failed on rank(s) {[r for r, o in enumerate(oks) if not o]}"


def grad(rank, step, n, dtype, salt):
    rng = np.random.default_rng([rank, step, n, salt])
    return (rng.standard_normal(n) * 0.7).astype(dtype)


def run_steps(fb, comm, steps, keys=KEYS, salt=0):
    """Outputs (bytes) of allreduce over ``steps`` for every key, plus one
    reduce_scatter per step."""
    r = comm.Get_rank()
    outs = []
    for s in steps:
        for i, (key, op, n, dtype, gather) in enumerate(keys):
            g = grad(r, s, n, dtype, salt + i)
            mpigc.allreduce(g, op, key=key, gather=gather, feedback=fb, comm=comm)
            outs.append(g.tobytes())
        g = grad(r, s, 999, np.float32, salt + 99)
        outs.append(mpigc.reduce_scatter(g, "2bit", key="rs", feedback=fb, comm=comm)
                    .tobytes())
    return outs


def same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    if sorted(sa) != sorted(sb):
        return False
    for k in sa:
        for f in ("worker", "owner"):
            x, y = sa[k][f], sb[k][f]
            if (x is None) != (y is None):
                return False
            if x is not None and (x.dtype != y.dtype or x.tobytes() != y.tobytes()):
                return False
        for f in ("config", "calls", "n", "dtype", "world_size", "rank"):
            if sa[k][f] != sb[k][f]:
                return False
    return True


@pytest.fixture
def shared_dir():
    d = on_root(lambda: tempfile.mkdtemp(prefix="mpigc-ckpt-"), WORLD)
    yield d
    WORLD.Barrier()
    if RANK == 0:
        shutil.rmtree(d, ignore_errors=True)


# -- same world size -----------------------------------------------------------------
def test_resume_is_bit_identical(shared_dir):
    path = os.path.join(shared_dir, "ck")
    fb = mpigc.ErrorFeedback()
    run_steps(fb, WORLD, range(3))
    mpigc.save_checkpoint(path, feedback=fb, step=3)
    expected = run_steps(fb, WORLD, range(3, 6))

    fb2 = mpigc.ErrorFeedback()
    info = mpigc.load_checkpoint(path, feedback=fb2)
    agree(info["step"] == 3 and info["world_size"] == SIZE, "info")
    got = run_steps(fb2, WORLD, range(3, 6))
    agree(got == expected, "outputs after load are bit-identical")
    agree(same_state(fb, fb2), "final states are identical")
    # not vacuous: without the residuals the outputs differ
    fb3 = mpigc.ErrorFeedback()
    agree(run_steps(fb3, WORLD, range(3, 6)) != expected, "a fresh store differs")


def test_inspector_reads_every_rank_file(shared_dir):
    path = os.path.join(shared_dir, "ck")
    fb = mpigc.ErrorFeedback()
    run_steps(fb, WORLD, range(2))
    mpigc.save_checkpoint(path, feedback=fb, step=7)

    def inspect():
        buf = io.StringIO()
        rc = ckpt.info(path, file=buf)
        text = buf.getvalue()
        return (rc == 0 and f"world size   {SIZE}" in text and "step         7" in text
                and "'w/1bit': shape (777,) float32" in text and "checksums    OK" in text)
    agree(on_root(inspect, WORLD), "inspector")


# -- different world size ------------------------------------------------------------
def reshard_pairs():
    if SIZE == 1:
        return [(1, 1)]
    return [(SIZE, SIZE - 1), ((SIZE + 1) // 2, SIZE)]  # at 4 ranks: 4 -> 3 and 2 -> 4


def residual_totals(fb, comm, keys):
    """Per key: (sum over ranks of the worker residuals, the owner residuals
    laid out over the whole buffer), float64, on every rank of WORLD."""
    out = {}
    for key, op, n, dtype, gather in keys:
        w = np.zeros(n)
        o = np.zeros(n)
        if comm is not None and key in fb:
            s = fb.state_dict()[key]
            if s["worker"] is not None:
                w += s["worker"]
            if s["owner"] is not None:
                lo, hi = mpigc.shard_bounds(n, comm.Get_size())[comm.Get_rank()]
                o[lo:hi] = s["owner"]
        WORLD.Allreduce(MPI.IN_PLACE, w)
        WORLD.Allreduce(MPI.IN_PLACE, o)
        out[key] = (w, o)
    return out


def phase(fb, comm, steps, salt):
    """Allreduce CONS_KEYS for ``steps`` on ``comm`` (None: not a member).
    Returns per key the world totals of the inputs and of the delivered sums."""
    res = {}
    for i, (key, op, n, dtype, gather) in enumerate(CONS_KEYS):
        inp = np.zeros(n)
        out = np.zeros(n)
        if comm is not None:
            r = comm.Get_rank()
            for s in steps:
                g = grad(r, s, n, dtype, salt + i)
                inp += g
                mpigc.allreduce(g, op, key=key, gather=gather, feedback=fb, comm=comm)
                if r == 0:
                    out += g
        WORLD.Allreduce(MPI.IN_PLACE, inp)
        WORLD.Allreduce(MPI.IN_PLACE, out)
        res[key] = (inp, out)
    return res


@pytest.mark.parametrize("pair", reshard_pairs(), ids=lambda p: f"{p[0]}to{p[1]}")
def test_reshard_conserves_residuals(shared_dir, pair):
    n_save, n_load = pair
    path = os.path.join(shared_dir, "ck")
    save_comm = WORLD.Split(0 if RANK < n_save else MPI.UNDEFINED, RANK)
    load_comm = WORLD.Split(0 if RANK < n_load else MPI.UNDEFINED, RANK)
    save_comm = None if save_comm == MPI.COMM_NULL else save_comm
    load_comm = None if load_comm == MPI.COMM_NULL else load_comm

    fb = mpigc.ErrorFeedback()
    a = phase(fb, save_comm, range(4), salt=10)
    before = residual_totals(fb, save_comm, CONS_KEYS)
    if save_comm is not None:
        mpigc.save_checkpoint(path, feedback=fb, comm=save_comm, step=4)
    WORLD.Barrier()

    fb2 = mpigc.ErrorFeedback()
    info = None
    if load_comm is not None:
        info = mpigc.load_checkpoint(path, feedback=fb2, comm=load_comm)
        agree_local = all(fb2.state_dict()[k]["world_size"] == n_load for k in fb2.keys())
    else:
        agree_local = True
    agree(agree_local and (info is None or (info["world_size"] == n_save
                                            and info["step"] == 4)), "load info")
    after = residual_totals(fb2, load_comm, CONS_KEYS)
    for key, *_ in CONS_KEYS:
        (w0, o0), (w1, o1) = before[key], after[key]
        # owner residuals are re-sharded exactly; the worker total is kept (one
        # float32 addition per merged rank)
        agree(np.array_equal(o0, o1), f"{key}: owner residuals re-sharded")
        agree(np.allclose(w0, w1, rtol=1e-6, atol=1e-6), f"{key}: worker total kept")
        if n_save <= n_load:
            agree(np.array_equal(w0, w1), f"{key}: worker total kept exactly")
        # not vacuous: there is something to keep
        agree(np.abs(w0).max() > 1e-2, f"{key}: worker residuals are non-trivial")

    b = phase(fb2, load_comm, range(4, 8), salt=10)
    final = residual_totals(fb2, load_comm, CONS_KEYS)
    for key, *_ in CONS_KEYS:
        inp = a[key][0] + b[key][0]
        delivered = a[key][1] + b[key][1]
        w, o = final[key]
        err = np.abs(inp - (delivered + w + o)).max()
        lost = np.abs(before[key][0] + before[key][1]).max()
        # invariant 1 across the resize; dropping the saved residuals would
        # break it by `lost`
        agree(err < 1e-4 and lost > 100 * max(err, 1e-6),
              f"{key}: conservation (err {err:.3g}, residuals at save {lost:.3g})")


# -- errors raised on every rank ---------------------------------------------------------
def test_config_mismatch_strict_and_not(shared_dir):
    path = os.path.join(shared_dir, "ck")
    fb = mpigc.ErrorFeedback()
    keys = KEYS[:2]
    run_steps(fb, WORLD, range(2), keys=keys)
    mpigc.save_checkpoint(path, feedback=fb, step=2)

    live = mpigc.ErrorFeedback()
    other = [("w/2bit", {"type": "2bit", "threshold": 1.0}, 1001, np.float32, "compressed")]
    run_steps(live, WORLD, range(1), keys=other)
    snapshot = mpigc.ErrorFeedback()
    snapshot.load_state_dict(live.state_dict())
    raises_everywhere(mpigc.MismatchError, lambda: mpigc.load_checkpoint(path, feedback=live),
                      WORLD, match="w/2bit")
    agree(same_state(live, snapshot), "strict failure leaves the store unchanged")

    with pytest.warns(UserWarning, match="re-initialising 1 key"):
        info = mpigc.load_checkpoint(path, feedback=live, strict=False)
    agree(info["reinitialised"] == ["w/2bit"] and "w/2bit" not in live
          and "w/1bit" in live, "non-strict re-initialises the mismatched key only")
    want = fb.state_dict()["w/1bit"]["worker"].tobytes()
    agree(live.state_dict()["w/1bit"]["worker"].tobytes() == want, "other keys loaded")

    raises_everywhere(mpigc.MismatchError, lambda: mpigc.load_checkpoint(
        path, feedback=mpigc.ErrorFeedback(),
        configs={"w/1bit": {"type": "1bit", "block_size": 128}}), WORLD, match="configs=")
    fresh = mpigc.ErrorFeedback()
    mpigc.load_checkpoint(path, feedback=fresh,
                          configs={"w/1bit": mpigc.OneBit(block_size=64)})
    agree(same_state(fresh, fb), "matching configs= loads everything")


def _flip_byte(fname, offset):
    with open(fname, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def test_corruption_raises_on_every_rank(shared_dir):
    import h5py
    path = os.path.join(shared_dir, "ck")
    fb = mpigc.ErrorFeedback()
    run_steps(fb, WORLD, range(2), keys=KEYS[:2])
    mpigc.save_checkpoint(path, feedback=fb)
    target = SIZE - 1

    def flip():
        meta = ckpt._read_manifest(path)
        fname = os.path.join(meta["datadir"], f"rank-{target:05d}.h5")
        with h5py.File(fname, "r") as f:
            off = f["k000001/worker"].id.get_offset()
        _flip_byte(fname, off + 4 * 500 + 1)
    on_root(flip, WORLD)
    live = mpigc.ErrorFeedback()
    run_steps(live, WORLD, range(1), keys=KEYS[:1])
    snapshot = mpigc.ErrorFeedback()
    snapshot.load_state_dict(live.state_dict())
    raises_everywhere(CheckpointError, lambda: mpigc.load_checkpoint(path, feedback=live),
                      WORLD, match=rf"rank {target}.*checksum mismatch")
    agree(same_state(live, snapshot), "a failed load leaves the store unchanged")

    # truncated file, seen by every rank

    def truncate():
        fname = os.path.join(ckpt._read_manifest(path)["datadir"], f"rank-{target:05d}.h5")
        with open(fname, "r+b") as f:
            f.truncate(os.path.getsize(fname) // 2)
    on_root(truncate, WORLD)
    raises_everywhere(CheckpointError, lambda: mpigc.load_checkpoint(path, feedback=live),
                      WORLD, match="truncated")

    # foreign: a plain file where a checkpoint should be
    foreign = os.path.join(shared_dir, "foreign")

    def write_foreign():
        with open(foreign, "w") as f:
            f.write("not a checkpoint\n")
    on_root(write_foreign, WORLD)
    raises_everywhere(CheckpointError, lambda: mpigc.load_checkpoint(foreign, feedback=live),
                      WORLD, match="not an mpigc checkpoint")


# -- a save killed part-way ----------------------------------------------------------------
CHILD = textwrap.dedent("""
    import os, sys
    import numpy as np
    from mpi4py import MPI
    import mpigc
    path, kill = sys.argv[1], sys.argv[2]
    comm = MPI.COMM_WORLD
    r = comm.Get_rank()
    fb = mpigc.ErrorFeedback()
    def steps(ss):
        for s in ss:
            for i, n in enumerate((1001, 70)):
                g = np.random.default_rng([r, s, i]).standard_normal(n).astype(np.float32)
                mpigc.allreduce(g, "2bit", key=f"k{i}", feedback=fb)
    steps(range(2))
    mpigc.save_checkpoint(path, feedback=fb, step=1)
    st = fb.state_dict()
    np.savez(os.path.join(os.path.dirname(path), f"state-{r}.npz"),
             **{f"{k}|{f}": st[k][f] for k in st for f in ("worker", "owner")
                if st[k][f] is not None})
    print("first save done", flush=True)
    steps(range(2, 3))
    os.environ["MPIGC_CHECKPOINT_TEST_KILL"] = kill
    mpigc.save_checkpoint(path, feedback=fb, step=2)
    print("save survived", flush=True)
""")


def _clean_env():
    keep = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")
    return {k: v for k, v in os.environ.items()
            if k in keep or not k.split("_")[0] in ("OMPI", "PMIX", "PRTE", "OPAL")}


@pytest.mark.parametrize("point", ["data", "manifest", "cleanup"])
def test_killed_save_keeps_previous_checkpoint(shared_dir, point):
    path = os.path.join(shared_dir, "ck")
    victim = SIZE - 1 if point == "data" else 0

    def run_child():
        script = os.path.join(shared_dir, "child.py")
        with open(script, "w") as f:
            f.write(CHILD)
        mpirun = shutil.which("mpirun") or os.path.join(os.path.dirname(sys.executable),
                                                        "mpirun")
        p = subprocess.run(
            ["timeout", "240", mpirun, "--oversubscribe", "-n", str(SIZE), sys.executable,
             script, path, f"{point}:{victim}"],
            env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return p.returncode, p.stdout[-3000:]
    rc, log = on_root(run_child, WORLD)  # the others sleep meanwhile: the child needs the cores
    # killed where it was told to be: after the first save (its marker printed),
    # not by anything else (an import error, a timeout)
    agree(rc != 0 and rc != 124 and "first save done" in log and "save survived" not in log,
          f"child was killed at {point}: exit {rc}: {log}")

    datadirs = on_root(lambda: sorted(n for n in os.listdir(path) if n.startswith("data-")),
                       WORLD)
    fb = mpigc.ErrorFeedback()
    info = mpigc.load_checkpoint(path, feedback=fb)
    if point == "cleanup":
        # killed after the commit point: the new checkpoint is complete
        agree(info["step"] == 2 and len(datadirs) == 2, "new checkpoint after the rename")
    else:
        agree(info["step"] == 1 and len(datadirs) == 2, "previous checkpoint kept")
        saved = np.load(os.path.join(shared_dir, f"state-{RANK}.npz"))
        st = fb.state_dict()
        ok = sorted(saved.files) == sorted(f"{k}|{f}" for k in st for f in ("worker", "owner")
                                           if st[k][f] is not None)
        ok = ok and all(saved[name].tobytes() == st[name.split("|")[0]][name.split("|")[1]]
                        .tobytes() for name in saved.files)
        agree(ok, "the previous checkpoint loads bit for bit")
    # the next save succeeds and removes what the killed one left
    mpigc.save_checkpoint(path, feedback=fb, step=9)
    left = on_root(lambda: sorted(os.listdir(path)), WORLD)
    agree(len(left) == 2 and "manifest.h5" in left, f"stale files removed: {left}")
    agree(mpigc.load_checkpoint(path, feedback=mpigc.ErrorFeedback())["step"] == 9, "reload")


# -- hierarchical jobs resumed through mpigc.slurm (issue 32) ---------------------------
# Nodes emulated with MPIGC_NODE_SPLIT=2: 1 and 2 ranks are one node (not
# hierarchical under "auto"), 3 ranks are 2 + 1 and 4 ranks 2 + 2 (hierarchical).
HIER_KEYS = [("h/2bit", "2bit", 1001), ("h/1bit", "1bit", 77)]


def hier_steps(fb, comm, steps, mode):
    """Outputs (bytes) of allreduce(hierarchy=mode) over ``steps``."""
    outs = []
    for s in steps:
        for i, (key, op, n) in enumerate(HIER_KEYS):
            g = grad(comm.Get_rank(), s, n, np.float32, 50 + i)
            mpigc.allreduce(g, op, key=key, feedback=fb, comm=comm, hierarchy=mode)
            outs.append(g.tobytes())
    return outs


@pytest.fixture
def split_nodes(monkeypatch):
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "2")


def hier_store(steps, mode):
    """A store after ``steps`` steps of :func:`hier_steps`."""
    fb = mpigc.ErrorFeedback()
    hier_steps(fb, WORLD, steps, mode)
    return fb


@pytest.mark.parametrize("mode", ["node", "auto"])
@pytest.mark.parametrize("record", [True, False], ids=["recorded", "not-recorded"])
def test_slurm_resume_of_a_hierarchical_job_is_bit_identical(shared_dir, split_nodes, mode,
                                                            record):
    """A job whose collectives use hierarchy=mode saves with
    slurm.save_training_state (hierarchy= passed or not) and resumes with
    slurm.load_training_state without hierarchy=: its residuals are installed
    as the keys its collectives use, so it continues bit for bit (before
    issue 32 they came back as flat keys the collectives never read)."""
    from mpigc import slurm
    path = os.path.join(shared_dir, "train")
    fb = hier_store(range(3), mode)
    slurm.save_training_state(path, {"w": np.zeros(3)}, step=3, feedback=fb, comm=WORLD,
                              fsync=False, **({"hierarchy": mode} if record else {}))
    expected = hier_steps(fb, WORLD, range(3, 5), mode)
    fb2 = mpigc.ErrorFeedback()
    st = slurm.load_training_state(path, feedback=fb2, comm=WORLD)
    keys = WORLD.allgather(sorted(fb2.keys()))
    agree(st.step == 3, "step")
    got = hier_steps(fb2, WORLD, range(3, 5), mode)
    agree(got == expected, f"continuation bit-identical (mode {mode}, loaded as "
                           f"{st.checkpoint_info.get('hierarchy')}, keys {keys})")
    agree(same_state(fb, fb2), "final states identical")


def test_hierarchical_checkpoint_that_cannot_say_its_mode_raises(shared_dir, split_nodes):
    """Saved on a layout where "auto" is hierarchical (2 nodes), without the
    mode; loaded on one node of 2 ranks, where "auto" would install the
    residuals flat and "node" hierarchical: ConfigError on every rank (the
    store unchanged) rather than a guess; with hierarchy= given, or the mode
    recorded at the save, it loads, totals kept."""
    if SIZE < 3:
        pytest.skip("needs 2 emulated nodes (3 ranks or more)")
    from mpigc import slurm
    path = os.path.join(shared_dir, "train")
    fb = hier_store(range(2), "auto")
    agree(all("@hier[" in k for k in fb.keys()), "hierarchical on 2 nodes")
    slurm.save_training_state(path, {"w": np.zeros(3)}, step=2, feedback=fb, comm=WORLD,
                              fsync=False)
    sub = WORLD.Split(0 if RANK < 2 else MPI.UNDEFINED, key=RANK)
    why = None
    if sub != MPI.COMM_NULL:
        live = mpigc.ErrorFeedback()
        mpigc.allreduce(np.ones(5, np.float32), "2bit", key="x", feedback=live, comm=sub)
        try:
            slurm.load_training_state(path, feedback=live, comm=sub)
            why = "loaded without hierarchy= where 'auto' and 'node' differ"
        except mpigc.ConfigError as exc:
            if "hierarchy=" not in str(exc) or live.keys() != ["x"]:
                why = f"{exc}; keys {live.keys()}"
        if not sub.allreduce(why is not None, op=MPI.LOR):  # all of sub may go on
            st = slurm.load_training_state(path, feedback=live, comm=sub, hierarchy="auto")
            if (st.checkpoint_info["hierarchy"] != "auto"
                    or sorted(live.keys()) != sorted(k for k, _, _ in HIER_KEYS)):
                why = f"hierarchy='auto' on one node: keys {sorted(live.keys())}"
        sub.Free()
    agree(why is None, why)
    # recorded at the save: loads with that mode, nothing to guess
    slurm.save_training_state(path, {"w": np.zeros(3)}, step=4, feedback=fb, comm=WORLD,
                              fsync=False, hierarchy="node")
    sub = WORLD.Split(0 if RANK < 2 else MPI.UNDEFINED, key=RANK)
    if sub != MPI.COMM_NULL:
        live = mpigc.ErrorFeedback()
        st = slurm.load_training_state(path, feedback=live, comm=sub)
        if st.checkpoint_info["hierarchy"] != "node" or not all(
                "@hier[" in k for k in live.keys()):
            why = f"recorded 'node': loaded as {st.checkpoint_info['hierarchy']}, keys " \
                  f"{sorted(live.keys())}"
        sub.Free()
    agree(why is None, why)


def test_ranks_must_agree_on_the_hierarchy_of_a_checkpoint(shared_dir, split_nodes):
    """hierarchy= decides collective work: ranks that pass different values
    get MismatchError on every rank (save and load), not a hang."""
    if SIZE < 2:
        pytest.skip("needs 2 ranks")
    path = os.path.join(shared_dir, "ck")
    fb = hier_store(range(1), "node")
    mine = "node" if RANK else "auto"
    raises_everywhere(mpigc.MismatchError, lambda: mpigc.save_checkpoint(
        path, fb, hierarchy=mine), WORLD, match="different hierarchy")
    mpigc.save_checkpoint(path, fb, hierarchy="node")
    raises_everywhere(mpigc.MismatchError, lambda: mpigc.load_checkpoint(
        path, mpigc.ErrorFeedback(), hierarchy=mine), WORLD, match="different hierarchy")
    raises_everywhere(mpigc.ConfigError, lambda: mpigc.load_checkpoint(
        path, mpigc.ErrorFeedback(), hierarchy="nodes"), WORLD, match="hierarchy must be")
