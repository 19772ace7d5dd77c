"""Residual checkpoints on one rank (no mpirun needed): format, checksums,
errors, the inspector. Multi-rank behaviour is in tests/mpi/test_checkpoint_mpi.py."""
import io
import json
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
from mpi4py import MPI

import mpigc
from mpigc import checkpoint as ckpt
from mpigc.checkpoint import CheckpointError


@pytest.fixture(autouse=True)
def _always_compress(monkeypatch):
    """These tests use small buffers; keep them on the compressed path (below
    MPIGC_MIN_COMPRESS_BYTES a call would use no residual at all)."""
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "0")

SELF = MPI.COMM_SELF


def make_store(steps=3):
    fb = mpigc.ErrorFeedback()
    rng = np.random.default_rng(1)
    for _ in range(steps):
        mpigc.allreduce(rng.standard_normal(1001).astype(np.float32), "2bit", key="a/b",
                        feedback=fb, comm=SELF)
        mpigc.allreduce(rng.standard_normal(70000).astype(np.float64), "1bit", key="big",
                        feedback=fb, comm=SELF, block_size=256)
        mpigc.allreduce(rng.standard_normal(33).astype(np.float32), "terngrad", key="t",
                        feedback=fb, comm=SELF, seed=4)
    return fb


def same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    if sorted(sa) != sorted(sb):
        return False
    for k in sa:
        for f in sa[k]:
            x, y = sa[k][f], sb[k][f]
            if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
                if x is None or y is None or x.dtype != y.dtype or x.tobytes() != y.tobytes():
                    return False
            elif x != y:
                return False
    return True


def rank_file(path, r=0):
    return os.path.join(ckpt._read_manifest(path)["datadir"], f"rank-{r:05d}.h5")


def flip_byte(fname, offset):
    with open(fname, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


# -- round trip -----------------------------------------------------------------------
def test_round_trip_is_bit_identical(tmp_path):
    fb = make_store()
    path = tmp_path / "ck"
    assert mpigc.save_checkpoint(path, feedback=fb, comm=SELF, step=12) == str(path)
    fb2 = mpigc.ErrorFeedback()
    info = mpigc.load_checkpoint(path, feedback=fb2, comm=SELF)
    assert info["step"] == 12 and info["world_size"] == 1
    assert info["keys"] == ["a/b", "big", "t"] and info["reinitialised"] == []
    assert info["format_version"] == ckpt.FORMAT_VERSION
    assert same_state(fb, fb2)
    assert fb2.state_dict()["t"]["calls"] == 3  # terngrad's stream position
    # and the next steps agree bit for bit
    g = np.random.default_rng(9).standard_normal(1001).astype(np.float32)
    a = mpigc.allreduce(g.copy(), "2bit", key="a/b", feedback=fb, comm=SELF)
    b = mpigc.allreduce(g.copy(), "2bit", key="a/b", feedback=fb2, comm=SELF)
    assert a.tobytes() == b.tobytes()


def test_empty_store_and_no_step(tmp_path):
    path = tmp_path / "ck"
    mpigc.save_checkpoint(path, feedback=mpigc.ErrorFeedback(), comm=SELF, fsync=False)
    fb = make_store(1)
    info = mpigc.load_checkpoint(path, feedback=fb, comm=SELF)
    assert info["step"] is None and info["keys"] == [] and len(fb) == 0


def test_second_save_replaces_first_and_cleans_up(tmp_path):
    path = tmp_path / "ck"
    fb = make_store()
    mpigc.save_checkpoint(path, feedback=fb, comm=SELF, step=1)
    first = ckpt._read_manifest(path)["datadir"]
    (path / "data-deadbeef").mkdir()  # what a killed save leaves behind
    (path / "manifest.h5.tmp-deadbeef").write_bytes(b"x")
    mpigc.save_checkpoint(path, feedback=fb, comm=SELF, step=2)
    assert sorted(os.listdir(path)) == ["data-" + ckpt._read_manifest(path)["attrs"]["token"],
                                        "manifest.h5"]
    assert not os.path.exists(first)
    assert mpigc.load_checkpoint(path, feedback=mpigc.ErrorFeedback(), comm=SELF)["step"] == 2


def test_default_store_and_lazy_exports(tmp_path):
    assert mpigc.save_checkpoint is ckpt.save_checkpoint
    assert "load_checkpoint" in mpigc.__all__
    fb = mpigc.get_default_feedback()
    fb.reset()
    mpigc.allreduce(np.ones(10, np.float32), "2bit", key="d", comm=SELF)
    mpigc.save_checkpoint(tmp_path / "ck", comm=SELF)
    fb.reset()
    mpigc.load_checkpoint(tmp_path / "ck", comm=SELF)
    assert fb.keys() == ["d"]
    fb.reset()


# -- flat, hierarchical and grouped keys in one store (issue 50, item 1) ----------------
def _mixed_step(fb, step, keys=("f", "h", "g")):
    """One step: "f" flat, "h" hierarchical (hierarchy="node": one emulated
    node of this rank), "g/0" and "g/1" one grouped call (hierarchy="auto":
    flat). Returns the outputs as bytes."""
    rng = np.random.default_rng(step)
    outs = []
    if "f" in keys:
        outs.append(mpigc.allreduce(rng.standard_normal(1001).astype(np.float32), "2bit",
                                    key="f", feedback=fb, comm=SELF).tobytes())
    if "h" in keys:
        outs.append(mpigc.allreduce(rng.standard_normal(777).astype(np.float32), "2bit",
                                    key="h", feedback=fb, comm=SELF,
                                    hierarchy="node").tobytes())
    if "g" in keys:
        gs = [rng.standard_normal(n).astype(np.float32) for n in (300, 200)]
        mpigc.allreduce(gs, "2bit", key="g", feedback=fb, comm=SELF, hierarchy="auto")
        outs += [g.tobytes() for g in gs]
    return outs


def test_mixed_store_loads_each_key_in_its_saved_form(tmp_path, monkeypatch):
    """Without hierarchy=, a load installs every key in the form it was
    saved in: flat and grouped keys flat, hierarchical ones hierarchical, and
    the next step is bit-identical (before the fix every key came back
    hierarchical, and the flat keys' next calls started from zero). With
    hierarchy= given, every key takes the form of a call with it."""
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "1")
    fb = mpigc.ErrorFeedback()
    for step in range(3):
        _mixed_step(fb, step)
    assert sorted(fb.keys()) == ["f", "g/0", "g/1", "h@hier[0/1:777]"]
    path = tmp_path / "ck"
    mpigc.save_checkpoint(path, feedback=fb, comm=SELF, step=3)
    expected = _mixed_step(fb, 3)
    fb2 = mpigc.ErrorFeedback()
    info = mpigc.load_checkpoint(path, feedback=fb2, comm=SELF)
    assert info["forms"] == {"f": "flat", "g/0": "flat", "g/1": "flat",
                             "h@hier": "hierarchical"}
    assert info["hierarchy"] == "node"  # what made "h", on one node
    assert sorted(fb2.keys()) == ["f", "g/0", "g/1", "h@hier[0/1:777]"]
    assert _mixed_step(fb2, 3) == expected
    assert same_state(fb, fb2)
    # given, hierarchy= converts every key: flat everywhere, or hierarchical here
    fb3 = mpigc.ErrorFeedback()
    info = mpigc.load_checkpoint(path, feedback=fb3, comm=SELF, hierarchy="flat")
    assert set(info["forms"].values()) == {"flat"} and sorted(fb3.keys()) == ["f", "g/0",
                                                                              "g/1", "h"]
    fb4 = mpigc.ErrorFeedback()
    info = mpigc.load_checkpoint(path, feedback=fb4, comm=SELF, hierarchy="node")
    assert set(info["forms"].values()) == {"hierarchical"}
    assert sorted(fb4.keys()) == ["f@hier[0/1:1001]", "g/0@hier[0/1:300]",
                                  "g/1@hier[0/1:200]", "h@hier[0/1:777]"]
    # and the inspector says which key is which
    buf = io.StringIO()
    assert ckpt.info(path, file=buf) == 0
    text = buf.getvalue()
    assert "hierarchy    no mode recorded, saved on 1 node(s) of [1] ranks" in text
    assert "'f': shape (1001,) float32" in text and text.count("; flat\n") == 3
    assert "residuals: worker, owner; hierarchical (row 'h@hier')" in text
    doc = ckpt.describe(path)
    assert [(k["key"], k["row"], k["form"]) for k in doc["keys"]] == [
        ("f", "f", "flat"), ("g/0", "g/0", "flat"), ("g/1", "g/1", "flat"),
        ("h", "h@hier", "hierarchical")]
    assert doc["node_layout"] == {"nodes": 1, "node_sizes": [1]}
    assert doc["hierarchy_mode"] is None


def test_key_saved_flat_and_hierarchical_keeps_both(tmp_path, monkeypatch):
    """A key used both flat and hierarchically holds two residuals (they do
    not share); a load without hierarchy= keeps both (it refused the
    checkpoint before); one that would install both in one form refuses it
    on every rank, the store unchanged."""
    monkeypatch.setenv("MPIGC_NODE_SPLIT", "1")
    fb = mpigc.ErrorFeedback()
    rng = np.random.default_rng(0)
    for mode in ("flat", "node", "flat"):
        mpigc.allreduce(rng.standard_normal(501).astype(np.float32), "2bit", key="k",
                        feedback=fb, comm=SELF, hierarchy=mode)
    assert sorted(fb.keys()) == ["k", "k@hier[0/1:501]"]
    path = tmp_path / "ck"
    mpigc.save_checkpoint(path, feedback=fb, comm=SELF, hierarchy="node")
    fb2 = mpigc.ErrorFeedback()
    info = mpigc.load_checkpoint(path, feedback=fb2, comm=SELF)
    assert info["forms"] == {"k": "flat", "k@hier": "hierarchical"}
    assert same_state(fb, fb2)
    for mode in ("flat", "node"):
        with pytest.raises(CheckpointError, match="both flat and hierarchical"):
            mpigc.load_checkpoint(path, feedback=fb2, comm=SELF, hierarchy=mode)
    assert same_state(fb, fb2)


# -- checksums ------------------------------------------------------------------------
def fletcher_reference(arr, block_words):
    w = np.ascontiguousarray(arr).view(np.uint32).astype(object)
    out = []
    for lo in range(0, len(w), block_words):
        s1 = s2 = 0
        for x in w[lo:lo + block_words]:
            s1 = (s1 + int(x)) % 2**64
            s2 = (s2 + s1) % 2**64
        out.append((s1, s2))
    return np.array(out, np.uint64).reshape(-1, 2)


@pytest.mark.parametrize("n,block", [(1, 4), (37, 8), (64, 16), (1000, 1000), (3, 1 << 20)])
def test_fletcher64_matches_reference(n, block):
    a = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    got = ckpt.fletcher64_blocks(a, block)
    assert np.array_equal(got, fletcher_reference(a, block))
    b = a.copy()
    b.view(np.uint8)[len(b.view(np.uint8)) // 2] ^= 4
    assert not np.array_equal(ckpt.fletcher64_blocks(b, block), got)
    c = a[::-1].copy()  # the same words in another order
    if n > 1 and not np.array_equal(c, a):
        assert not np.array_equal(ckpt.fletcher64_blocks(c, n), ckpt.fletcher64_blocks(a, n))


# -- corrupted, truncated, foreign --------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    fb = make_store()
    path = tmp_path / "ck"
    mpigc.save_checkpoint(path, feedback=fb, comm=SELF, step=5)
    return path, fb


def load_fails(path, match):
    live = make_store(1)
    snap = mpigc.ErrorFeedback()
    snap.load_state_dict(live.state_dict())
    with pytest.raises(CheckpointError, match=match):
        mpigc.load_checkpoint(path, feedback=live, comm=SELF)
    assert same_state(live, snap), "a failed load changed the store"


@pytest.mark.parametrize("which", ["k000001/worker", "k000001/owner", "k000000/worker"])
def test_corrupted_residual_is_detected(saved, which):
    path, _ = saved
    fname = rank_file(path)
    with h5py.File(fname, "r") as f:
        ds = f[which]
        off = ds.id.get_offset() + ds.size * ds.dtype.itemsize - 3
    flip_byte(fname, off)
    load_fails(path, rf"checksum mismatch in k00000\d/{which.split('/')[1]}")


def test_corrupted_checksum_table_is_detected(saved):
    path, _ = saved
    fname = rank_file(path)
    with h5py.File(fname, "r") as f:
        off = f["k000000/worker_fletcher64"].id.get_offset()
    flip_byte(fname, off + 2)
    load_fails(path, "checksum mismatch")


def test_truncated_and_missing_rank_file(saved):
    path, _ = saved
    fname = rank_file(path)
    size = os.path.getsize(fname)
    with open(fname, "r+b") as f:
        f.truncate(size - 100)
    load_fails(path, "truncated")
    os.unlink(fname)
    load_fails(path, "missing")


def test_rank_file_from_another_checkpoint_is_foreign(tmp_path, saved):
    path, fb = saved
    other = tmp_path / "other"
    mpigc.save_checkpoint(other, feedback=fb, comm=SELF, step=5)
    os.replace(rank_file(other), rank_file(path))
    load_fails(path, "foreign or mixed-up")


def test_corrupted_manifest(saved):
    path, _ = saved
    mf = path / "manifest.h5"
    with h5py.File(mf, "r+") as f:  # same layout, different content
        f["calls"][0] = 99
    load_fails(path, "manifest checksum mismatch")
    data = mf.read_bytes()
    mf.write_bytes(data[: len(data) // 3])
    load_fails(path, "unreadable manifest")


def test_foreign_paths(tmp_path):
    load_fails(tmp_path / "nothing", "no such checkpoint")
    (tmp_path / "file").write_text("hello")
    load_fails(tmp_path / "file", "not an mpigc checkpoint")
    (tmp_path / "dir").mkdir()
    load_fails(tmp_path / "dir", "manifest.h5 is missing")
    with h5py.File(tmp_path / "dir" / "manifest.h5", "w") as f:
        f.attrs["format"] = "something-else"
    load_fails(tmp_path / "dir", "not an mpigc checkpoint manifest")


def test_newer_format_version(saved):
    path, _ = saved
    with h5py.File(path / "manifest.h5", "r+") as f:
        f.attrs["format_version"] = ckpt.FORMAT_VERSION + 1
    load_fails(path, "format version 2")


# -- config mismatches -------------------------------------------------------------------
def test_strict_and_non_strict(saved):
    path, fb = saved
    live = mpigc.ErrorFeedback()
    mpigc.allreduce(np.ones(1001, np.float32), "2bit", key="a/b", threshold=0.25,
                    feedback=live, comm=SELF)
    mpigc.allreduce(np.ones(8, np.float32), "2bit", key="big", feedback=live, comm=SELF)
    snap = mpigc.ErrorFeedback()
    snap.load_state_dict(live.state_dict())
    with pytest.raises(mpigc.MismatchError) as ei:
        mpigc.load_checkpoint(path, feedback=live, comm=SELF)
    msg = str(ei.value)
    assert "'a/b'" in msg and "threshold" in msg and "70000 values of float64" in msg
    assert same_state(live, snap)
    with pytest.warns(UserWarning, match="re-initialising 2 key"):
        info = mpigc.load_checkpoint(path, feedback=live, comm=SELF, strict=False)
    assert info["reinitialised"] == ["a/b", "big"] and live.keys() == ["t"]
    assert same_state(live, _only(fb, "t"))


def _only(fb, key):
    out = mpigc.ErrorFeedback()
    out.load_state_dict({key: fb.state_dict()[key]})
    return out


def test_configs_mapping(saved):
    path, fb = saved
    with pytest.raises(mpigc.MismatchError, match="configs= gives"):
        mpigc.load_checkpoint(path, feedback=mpigc.ErrorFeedback(), comm=SELF,
                              configs={"t": {"type": "terngrad", "seed": 5}})
    with pytest.raises(mpigc.ConfigError):
        mpigc.load_checkpoint(path, feedback=mpigc.ErrorFeedback(), comm=SELF,
                              configs={"t": "nope"})
    fb2 = mpigc.ErrorFeedback()
    mpigc.load_checkpoint(path, feedback=fb2, comm=SELF,
                          configs={"t": mpigc.TernGrad(seed=4), "a/b": "2bit"})
    assert same_state(fb, fb2)


# -- save errors -------------------------------------------------------------------------
def test_save_refuses_busy_and_foreign_keys(tmp_path):
    fb = make_store(1)
    req = mpigc.iallreduce(np.ones(1001, np.float32), "2bit", key="a/b", feedback=fb,
                           comm=SELF)
    with pytest.raises(mpigc.StateError, match="in use"):
        mpigc.save_checkpoint(tmp_path / "ck", feedback=fb, comm=SELF)
    req.wait()
    assert not (tmp_path / "ck").exists()
    mpigc.save_checkpoint(tmp_path / "ck", feedback=fb, comm=SELF)  # released again
    state = fb.state_dict()
    state["a/b"].update(world_size=2, rank=1, owner=None)
    fb.load_state_dict(state)
    with pytest.raises(mpigc.StateError, match="rank 1 of 2"):
        mpigc.save_checkpoint(tmp_path / "ck", feedback=fb, comm=SELF)
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        mpigc.save_checkpoint(tmp_path / "f", feedback=make_store(1), comm=SELF)
    with pytest.raises(mpigc.ConfigError, match="step"):
        mpigc.save_checkpoint(tmp_path / "ck", feedback=make_store(1), comm=SELF, step="3")


# -- resharding plans ----------------------------------------------------------------------
@pytest.mark.parametrize("old", range(1, 7))
@pytest.mark.parametrize("new", range(1, 7))
def test_reshard_plans_partition(old, new):
    got = sorted(r for j in range(new) for r in ckpt.worker_sources(old, new, j))
    assert got == list(range(old))  # every old worker residual lands exactly once
    for n in (1, 5, 17):
        for j in range(new):
            lo, hi = mpigc.shard_bounds(n, new)[j]
            cover = [x for r, a, z in ckpt.owner_sources(n, old, new, j) for x in range(a, z)]
            assert cover == list(range(lo, hi))


# -- inspector -----------------------------------------------------------------------------
def clean_env():
    keep = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")
    return {k: v for k, v in os.environ.items()
            if k in keep or k.split("_")[0] not in ("OMPI", "PMIX", "PRTE", "OPAL")}


def test_cli_info(saved):
    path, _ = saved
    p = subprocess.run([sys.executable, "-m", "mpigc.checkpoint", "info", str(path)],
                       capture_output=True, text=True, env=clean_env(), timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "world size   1" in out and "step         5" in out
    assert "'big': shape (70000,) float64, calls 3" in out and '"block_size": 256' in out
    assert "checksums    OK" in out and p.stderr == ""
    fname = rank_file(path)
    with h5py.File(fname, "r") as f:
        off = f["k000001/worker"].id.get_offset()
    flip_byte(fname, off + 8 * 69000)
    p = subprocess.run([sys.executable, "-m", "mpigc.checkpoint", "info", str(path)],
                       capture_output=True, text=True, env=clean_env(), timeout=120)
    assert p.returncode == 1 and "checksum mismatch in k000001/worker" in p.stdout


def test_info_function_without_verify(saved):
    path, _ = saved
    buf = io.StringIO()
    assert ckpt.info(path, verify=False, file=buf) == 0
    assert "checksums" not in buf.getvalue() and "'a/b'" in buf.getvalue()
    buf = io.StringIO()
    assert ckpt.info(path / "nope", file=buf) == 1 and "no such checkpoint" in buf.getvalue()


# -- block-wise reads (small blocks, so arrays span many) ---------------------------------
def test_partial_reads_across_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "BLOCK_WORDS", 16)  # 64-byte blocks when saving
    fb = mpigc.ErrorFeedback()
    w = np.random.default_rng(3).standard_normal(1000)  # float64: 8 values per block
    fb.load_state_dict({"k": {"worker": w, "owner": w[::-1] * 2, "config": {"type": "2bit"},
                              "calls": 1, "world_size": 1, "rank": 0, "n": 1000,
                              "dtype": "float64"}})
    path = tmp_path / "ck"
    mpigc.save_checkpoint(path, feedback=fb, comm=SELF)
    monkeypatch.setattr(ckpt, "BLOCK_WORDS", 1 << 20)  # the reader uses the recorded size
    meta = ckpt._read_manifest(path)
    assert meta["attrs"]["checksum_block_words"] == 16
    f = ckpt._RankFile(meta, 0)
    try:
        for lo, hi in [(0, 1000), (3, 5), (7, 9), (8, 16), (5, 999), (992, 1000), (0, 1)]:
            out = np.full(hi - lo, 0.5)
            assert f.read(0, "worker", np.dtype(np.float64), 1000, lo, hi, out, add=False)
            assert out.tobytes() == w[lo:hi].tobytes()
            assert f.read(0, "worker", np.dtype(np.float64), 1000, lo, hi, out, add=True)
            assert np.array_equal(out, w[lo:hi] * 2)
        out = np.empty(77)
        assert f.read(0, "owner", np.dtype(np.float64), 1000, 900, 977, out, add=False)
        assert np.array_equal(out, (w[::-1] * 2)[900:977])
    finally:
        f.close()
    # a flipped byte is found in its block, and only reads of that block fail
    fname = rank_file(path)
    with h5py.File(fname, "r") as h:
        off = h["k000000/worker"].id.get_offset()
    flip_byte(fname, off + 8 * 500)  # value 500: block 62
    f = ckpt._RankFile(meta, 0)
    try:
        out = np.empty(10)
        assert f.read(0, "worker", np.dtype(np.float64), 1000, 480, 490, out, add=False)
        with pytest.raises(CheckpointError, match="block 62 of 64 bytes"):
            f.read(0, "worker", np.dtype(np.float64), 1000, 495, 505, out, add=False)
    finally:
        f.close()


def test_info_names_the_checkpoints_inside_a_parent_folder(saved, tmp_path):
    """``info`` on the folder above a checkpoint says which checkpoint is in it."""
    path, _ = saved
    parent = tmp_path / "runs"
    (parent / "job7").mkdir(parents=True)
    shutil.copytree(path, parent / "job7" / "ck")
    (parent / "empty").mkdir()
    buf = io.StringIO()
    assert ckpt.info(parent, file=buf) == 1
    text = buf.getvalue()
    assert "not an mpigc checkpoint" in text
    assert f"checkpoints inside it: {os.path.join('job7', 'ck')}" in text, text
    buf = io.StringIO()
    assert ckpt.info(parent / "empty", file=buf) == 1
    assert "checkpoints inside" not in buf.getvalue()


def test_cli_info_json(saved, tmp_path):
    path, _ = saved
    p = subprocess.run([sys.executable, "-m", "mpigc.checkpoint", "info", "--json", str(path)],
                       capture_output=True, text=True, env=clean_env(), timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(p.stdout)
    assert doc["valid"] and doc["checksums"] == "OK" and doc["errors"] == []
    assert doc["world_size"] == 1 and doc["step"] == 5
    big = {k["key"]: k for k in doc["keys"]}["big"]
    assert big["n"] == 70000 and big["dtype"] == "float64" and big["calls"] == 3
    assert big["config"]["block_size"] == 256 and "worker" in big["residuals"]
    p = subprocess.run([sys.executable, "-m", "mpigc.checkpoint", "info", "--json",
                        str(tmp_path)], capture_output=True, text=True, env=clean_env(),
                       timeout=120)
    doc = json.loads(p.stdout)
    assert p.returncode == 1 and not doc["valid"] and "not an mpigc checkpoint" in doc["errors"][0]
    assert doc["checkpoints_inside"] == [os.path.relpath(path, tmp_path)]


def test_residuals_of_the_old_2bit_default_name_the_fix(tmp_path):
    """Residuals saved when op="2bit" meant MXNet's threshold 0.5, loaded where
    "2bit" is the relative mode: the mismatch says why and what to pass
    (threshold=0.5), by configs= and against a key in use."""
    old = mpigc.ErrorFeedback()
    mpigc.allreduce(np.ones(64, np.float32) * 0.3, "2bit", key="w", threshold=0.5,
                    feedback=old, comm=SELF)
    mpigc.save_checkpoint(tmp_path / "c", old, comm=SELF)
    with pytest.raises(mpigc.MismatchError, match=r"configs= gives .*threshold=0\.5"):
        mpigc.load_checkpoint(tmp_path / "c", feedback=mpigc.ErrorFeedback(), comm=SELF,
                              configs={"w": "2bit"})
    live = mpigc.ErrorFeedback()
    mpigc.allreduce(np.ones(64, np.float32), "2bit", key="w", feedback=live, comm=SELF)
    with pytest.raises(mpigc.MismatchError, match=r"in use .*pass threshold=0\.5"):
        mpigc.load_checkpoint(tmp_path / "c", feedback=live, comm=SELF)
    # another change of config gets no such hint
    with pytest.raises(mpigc.MismatchError) as ei:
        mpigc.load_checkpoint(tmp_path / "c", feedback=mpigc.ErrorFeedback(), comm=SELF,
                              configs={"w": "1bit"})
    assert "threshold=0.5 to continue" not in str(ei.value)
