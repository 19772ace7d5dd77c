"""Residual checkpoints across ranks: run as

    mpirun -n K python -m pytest --with-mpi -q tests/mpi/test_checkpoint_mpi.py

for K in 1..4. Every check agrees on pass/fail across ranks before asserting.
"""
import io
import json
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
from mpigc import _hierarchy, checkpoint as ckpt
from mpigc.checkpoint import CheckpointError

from conftest import on_root, raises_everywhere

# ranks: reshard pairs depend on the count; split_nodes: 4 is 2 nodes of 2
pytestmark = [pytest.mark.mpi, pytest.mark.ranks(1, 2, 3, 4)]

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


def test_a_load_that_one_rank_cannot_install_changes_no_rank(shared_dir):
    """A key in use on one rank only (a pending call's): the load raises
    StateError on every rank, and every rank's store is as it was, count of
    skipped steps too (the install is a transaction, undone where another
    rank could not install)."""
    path = os.path.join(shared_dir, "ck")
    fb = mpigc.ErrorFeedback()
    run_steps(fb, WORLD, range(2), keys=KEYS[:2])
    fb.replace_entries(fb.entries(), skipped_steps=4)
    mpigc.save_checkpoint(path, feedback=fb)
    run_steps(fb, WORLD, range(2, 3), keys=KEYS[:2])
    fb.replace_entries(fb.entries(), skipped_steps=6)
    before = mpigc.ErrorFeedback()
    before.load_state_dict(fb.state_dict())
    held = None
    if RANK == SIZE - 1:  # a call on a key of its own, pending on this rank only
        held = fb.begin("local", 4, np.float32, 1, 0)
    try:
        raises_everywhere(mpigc.StateError, lambda: mpigc.load_checkpoint(path, feedback=fb),
                          WORLD, match="in use")
    finally:
        if held is not None:
            held.end()
    agree(same_state(fb, before) and fb.skipped_steps == 6,
          "a load one rank could not install leaves every store unchanged")
    mpigc.load_checkpoint(path, feedback=fb)  # and then it can
    agree(fb.skipped_steps == 4 and not same_state(fb, before), "the load after it")


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


# flat calls (no emulated nodes), victim rank 0 or the last: 2 and 3 cover it, 4 adds nothing
@pytest.mark.ranks(1, 2, 3)
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


# -- a store of flat, hierarchical and grouped keys (issue 50, item 1) -------------------
# Each key is loaded back in the form it was saved in: before the fix, a load without
# hierarchy= of a checkpoint holding any hierarchical row installed every key as
# hierarchical slices, and the next flat (or grouped) call on a flat key started from
# zero: its residuals were lost.
# (key, n, hierarchy= of its calls); the group's members are reduced in one call
MIXED = [("m/flat", 1001, "flat"), ("m/node", 777, "node"), ("m/auto", 513, "auto")]
GROUP = [("m/g0", 300), ("m/g1", 200)]  # one allreduce([...], hierarchy="auto"): flat


def _auto_hierarchical(size):
    """Whether hierarchy="auto" is hierarchical on ``size`` ranks in nodes of 2."""
    return size > 2


def mixed_keys(size_save, size_load):
    """The single-call keys of the store: without "m/auto" where "auto" is
    hierarchical on one layout and flat on the other (its residuals would have
    to change form, which a load without hierarchy= does not guess)."""
    if _auto_hierarchical(size_save) != _auto_hierarchical(size_load):
        return [k for k in MIXED if k[2] != "auto"]
    return MIXED


def mixed_steps(fb, comm, steps, keys, salt=70):
    """Every key of ``keys`` and the group over ``steps`` on ``comm`` (None:
    not a member). Returns (this rank's outputs as bytes, {key: (world total of
    the inputs, the delivered sums)})."""
    names = [k for k, _, _ in keys] + [k for k, _ in GROUP]
    sizes = dict((k, n) for k, n, _ in keys) | dict(GROUP)
    inp = {k: np.zeros(sizes[k]) for k in names}
    out = {k: np.zeros(sizes[k]) for k in names}
    outs = []
    if comm is not None:
        r = comm.Get_rank()
        for s in steps:
            for i, (key, n, mode) in enumerate(keys):
                g = grad(r, s, n, np.float32, salt + i)
                inp[key] += g
                mpigc.allreduce(g, "2bit", key=key, feedback=fb, comm=comm, hierarchy=mode)
                outs.append(g.tobytes())
                if r == 0:
                    out[key] += g
            gs = [grad(r, s, n, np.float32, salt + 10 + j) for j, (_, n) in enumerate(GROUP)]
            for (key, _), g in zip(GROUP, gs):
                inp[key] += g
            mpigc.allreduce(gs, "2bit", key=[k for k, _ in GROUP], feedback=fb, comm=comm,
                            hierarchy="auto")
            for (key, _), g in zip(GROUP, gs):
                outs.append(g.tobytes())
                if r == 0:
                    out[key] += g
    for k in names:
        WORLD.Allreduce(MPI.IN_PLACE, inp[k])
        WORLD.Allreduce(MPI.IN_PLACE, out[k])
    return outs, {k: (inp[k], out[k]) for k in names}


def mixed_forms(fb, comm, keys):
    """{key: "flat" / "hierarchical" / "both" / "none"} over the ranks of
    ``comm`` (the same on every rank of WORLD; None: not a member)."""
    mine = {}
    if comm is not None:
        for k in fb.keys():
            sk = _hierarchy.parse_slice_key(k)
            base, form = (k, "flat") if sk is None else (sk[0], "hierarchical")
            mine.setdefault(base, set()).add(form)
    got = {}
    for theirs in WORLD.allgather(mine):
        for b, fs in theirs.items():
            got.setdefault(b, set()).update(fs)
    names = [k for k, _, _ in keys] + [k for k, _ in GROUP]
    return {k: ("none" if k not in got else "both" if len(got[k]) > 1 else
                next(iter(got[k]))) for k in names}


def mixed_totals(fb, comm, keys, forms):
    """{key: the sum over the ranks of ``comm`` of its residuals in the form
    ``forms[key]`` (those its calls read), worker and owner, at their global
    positions} (float64, on every rank of WORLD)."""
    sizes = dict((k, n) for k, n, _ in keys) | dict(GROUP)
    tot = {k: np.zeros(n) for k, n in sizes.items()}
    if comm is not None:
        r, size = comm.Get_rank(), comm.Get_size()
        lay = None
        for k, s in fb.state_dict().items():
            sk = _hierarchy.parse_slice_key(k)
            if sk is None:
                if forms.get(k) != "flat":
                    continue
                t = tot[k]
                if s["worker"] is not None:
                    t += s["worker"]
                if s["owner"] is not None:
                    lo, hi = mpigc.shard_bounds(t.size, size)[r]
                    t[lo:hi] += s["owner"]
                continue
            base, sl, L, n = sk
            if forms.get(base) != "hierarchical":
                continue
            lay = lay or _hierarchy.layout(comm)
            t = tot[base]
            lo, hi = mpigc.shard_bounds(n, L)[sl]
            if s["worker"] is not None:
                t[lo:hi] += s["worker"]
            if s["owner"] is not None:
                (a, b), = [(a, b) for q, a, b in lay.owned_ranges(r, n) if q == sl]
                t[a:b] += s["owner"]
    for t in tot.values():
        WORLD.Allreduce(MPI.IN_PLACE, t)
    return tot


def split_world(n):
    """The first ``n`` ranks of WORLD (None on the others)."""
    c = WORLD.Split(0 if RANK < n else MPI.UNDEFINED, RANK)
    return None if c == MPI.COMM_NULL else c


def mixed_pairs():
    return [(SIZE, SIZE)] + ([(SIZE, SIZE - 1)] if SIZE > 1 else [])


@pytest.mark.parametrize("record", [None, "node"], ids=["not-recorded", "recorded-node"])
@pytest.mark.parametrize("via", ["checkpoint", "slurm"])
@pytest.mark.parametrize("pair", mixed_pairs(), ids=lambda p: f"{p[0]}to{p[1]}")
def test_mixed_store_loads_each_key_in_its_saved_form(shared_dir, split_nodes, pair, via,
                                                      record):
    """Flat, hierarchical ("node"; "auto" on 2 nodes) and grouped keys saved
    together (save_checkpoint, or slurm.save_training_state) and loaded with
    default arguments, on the same ranks or one rank fewer (at 4 ranks: 2+2
    nodes, then 2+1): every key is installed in the form it was saved in, one
    more call on every key conserves what the residuals carried, and on the
    same ranks that call is bit-identical to an uninterrupted run."""
    from mpigc import slurm
    n_save, n_load = pair
    if (record is None and _auto_hierarchical(n_save) and not _auto_hierarchical(n_load)):
        pytest.skip("'auto' and 'node' differ on the loading layout and no mode is recorded: "
                    "ConfigError (test_hierarchical_checkpoint_that_cannot_say_its_mode_raises)")
    keys = mixed_keys(n_save, n_load)
    path = os.path.join(shared_dir, "ck")
    fb = mpigc.ErrorFeedback()
    _, a = mixed_steps(fb, WORLD, range(3), keys)
    saved = mixed_forms(fb, WORLD, keys)
    agree(saved["m/flat"] == "flat" and saved["m/node"] == "hierarchical"
          and saved["m/g0"] == saved["m/g1"] == "flat", f"forms before the save: {saved}")
    before = mixed_totals(fb, WORLD, keys, saved)
    mode = {} if record is None else {"hierarchy": record}
    if via == "slurm":
        slurm.save_training_state(path, {"w": np.zeros(3)}, step=3, feedback=fb,
                                  comm=WORLD, fsync=False, **mode)
    else:
        mpigc.save_checkpoint(path, fb, step=3, fsync=False, **mode)
    expected, _ = mixed_steps(fb, WORLD, range(3, 4), keys)  # uninterrupted

    load_comm = split_world(n_load)
    fb2 = mpigc.ErrorFeedback()
    info = None
    if load_comm is not None:
        if via == "slurm":
            info = slurm.load_training_state(path, feedback=fb2, comm=load_comm).checkpoint_info
        else:
            info = mpigc.load_checkpoint(path, fb2, comm=load_comm)
    loaded = mixed_forms(fb2, load_comm, keys)
    agree(loaded == saved, f"forms: saved {saved}, loaded {loaded}")
    agree(info is None or info["forms"] == {
        k + (ckpt.HIER_SUFFIX if saved[k] == "hierarchical" else ""):
        saved[k] for k in saved}, f"info['forms'] {info and info['forms']}")
    got, b = mixed_steps(fb2, load_comm, range(3, 4), keys)
    if n_load == n_save:
        agree(got == expected, "the next step is bit-identical to an uninterrupted run")
        agree(same_state(fb, fb2), "final states are identical")
    final = mixed_totals(fb2, load_comm, keys, saved)
    for key in saved:
        inp, delivered = a[key][0] + b[key][0], a[key][1] + b[key][1]
        err = np.abs(inp - (delivered + final[key])).max()
        lost = np.abs(before[key]).max()
        # dropping the saved residuals breaks conservation by `lost`
        agree(err < 1e-4 and lost > 100 * max(err, 1e-6),
              f"{key}: conservation (err {err:.3g}, residuals at save {lost:.3g})")
    if load_comm is not None:
        load_comm.Free()


def test_info_reports_each_keys_form(shared_dir, split_nodes):
    """``python -m mpigc.checkpoint info`` (text and --json) names every key
    with its form: flat, grouped (flat) and hierarchical ones, and the
    recorded mode and node layout."""
    path = os.path.join(shared_dir, "ck")
    keys = MIXED
    fb = mpigc.ErrorFeedback()
    mixed_steps(fb, WORLD, range(2), keys)
    forms = mixed_forms(fb, WORLD, keys)
    mpigc.save_checkpoint(path, fb, step=2, fsync=False, hierarchy="node")

    def run_info():
        res = []
        for extra in ([], ["--json"]):
            p = subprocess.run([sys.executable, "-m", "mpigc.checkpoint", "info", *extra, path],
                               env=_clean_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, timeout=240)
            res.append((p.returncode, p.stdout, p.stderr[-2000:]))
        return res
    (rc, text, err), (rcj, js, errj) = on_root(run_info, WORLD)
    agree(rc == 0 and rcj == 0, f"info exit {rc}/{rcj}: {err} {errj}")
    doc = json.loads(js)
    by_key = {k["key"]: k for k in doc["keys"]}
    ok = sorted(by_key) == sorted(forms) and all(
        by_key[k]["form"] == forms[k] and by_key[k]["row"] == k + (
            ckpt.HIER_SUFFIX if forms[k] == "hierarchical" else "") for k in forms)
    nodes = (SIZE + 1) // 2
    ok = ok and doc["hierarchy_mode"] == "node" and doc["node_layout"] == {
        "nodes": nodes, "node_sizes": [2] * (SIZE // 2) + [1] * (SIZE % 2)}
    agree(ok, f"--json: {doc['keys']}, {doc['hierarchy_mode']}, {doc['node_layout']}")
    lines = {ln.split(":")[0].strip(): ln for ln in text.splitlines() if ln.startswith("  '")}
    ok = all(lines.get(repr(k), "").endswith(
        "; flat" if f == "flat" else f"; hierarchical (row {k + ckpt.HIER_SUFFIX!r})")
        for k, f in forms.items())
    agree(ok and f"hierarchy    mode 'node' recorded, saved on {nodes} node(s)" in text,
          f"text: {text}")


def test_flat_keys_of_auto_saved_on_one_node_stay_flat_and_say_so(shared_dir, split_nodes):
    """Saved on one node with hierarchy="auto" recorded (flat there), loaded
    where "auto" is hierarchical: the flat keys stay flat (a grouped call's
    key would stay flat under "auto", a single call's would not: the
    checkpoint cannot tell them apart), with a UserWarning that names them
    and the fix; hierarchy="auto" given installs them all hierarchical, totals kept."""
    if SIZE < 3:
        pytest.skip("needs 2 emulated nodes (3 ranks or more)")
    path = os.path.join(shared_dir, "ck")
    keys = [k for k in MIXED if k[2] == "auto"]
    sub = split_world(2)
    fb = mpigc.ErrorFeedback()
    mixed_steps(fb, sub, range(2), keys)
    before = mixed_totals(fb, sub, keys, mixed_forms(fb, sub, keys))
    if sub is not None:
        mpigc.save_checkpoint(path, fb, comm=sub, fsync=False, hierarchy="auto")
        sub.Free()
    WORLD.Barrier()
    fb2 = mpigc.ErrorFeedback()
    with pytest.warns(UserWarning, match=r"'m/auto'.*pass hierarchy='auto'"):
        info = mpigc.load_checkpoint(path, fb2)
    forms = mixed_forms(fb2, WORLD, keys)
    agree(set(forms.values()) == {"flat"} and info["forms"]["m/auto"] == "flat",
          f"flat as saved: {forms}")
    fb3 = mpigc.ErrorFeedback()
    info = mpigc.load_checkpoint(path, fb3, hierarchy="auto")
    forms = mixed_forms(fb3, WORLD, keys)
    after = mixed_totals(fb3, WORLD, keys, forms)
    agree(set(forms.values()) == {"hierarchical"} and all(
        np.allclose(before[k], after[k], rtol=1e-6, atol=1e-6) for k in before),
        f"hierarchy='auto' converts them all: {forms}")
