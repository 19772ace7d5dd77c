"""Smoke tests of the benchmark tooling at tiny sizes (plain, or MPI when available).

The tool is run in this process with one rank (MPI.COMM_WORLD of a plain
``pytest`` run), and, when ``mpirun`` is on PATH, as ``mpirun -n 2 mpigc-bench``
under a timeout. Also the small-message fallback of the engine
(``MPIGC_MIN_COMPRESS_BYTES``) at one rank.
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import mpigc
from mpigc import bench


def test_parse_and_format_size():
    assert bench.parse_size("4K") == 4096
    assert bench.parse_size("256MiB") == 256 << 20
    assert bench.parse_size("17") == 17
    assert bench.format_size(4096) == "4K" and bench.format_size(3 << 30) == "3G"
    with pytest.raises(Exception):
        bench.parse_size("4 parsecs")


def test_bench_in_process(tmp_path, capsys):
    out = tmp_path / "rows.json"
    png = tmp_path / "plot.png"
    args = ["--sizes", "4K,16K", "--iters", "2", "--min-iters", "1", "--warmup", "1",
            "--no-progress", "--json", str(out)]
    try:
        import matplotlib  # noqa: F401
        args += ["--plot", str(png)]
    except ImportError:
        pass
    assert bench.main(args) == 0
    text = capsys.readouterr().out
    assert "# allreduce, op=2bit" in text and "# reduce_scatter, op=1bit" in text
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    ops = {r["op"] for r in rows}
    assert ops == set(bench.DEFAULT_OPS)
    assert len(rows) == 2 * 2 * len(bench.DEFAULT_OPS)
    for r in rows:
        assert r["median_s"] > 0 and r["min_s"] <= r["median_s"] <= r["max_s"]
        assert r["speedup_vs_none"] > 0
        if r["op"] == "none":
            assert r["speedup_vs_none"] == 1.0 and r["compression_ratio"] == 1.0
    # one rank: nothing is sent and every op but terngrad/2bit is nearly exact
    none = [r for r in rows if r["op"] in ("none", "mpi")]
    assert all(r["max_rel_err"] < 1e-6 for r in none)
    if "--plot" in args:
        assert png.stat().st_size > 1000


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun on PATH")
def test_bench_under_mpirun(tmp_path):
    out = tmp_path / "rows.json"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = ["timeout", "240", "mpirun", "--oversubscribe", "-n", "2", sys.executable, "-m",
           "mpigc.bench", "--sizes", "4K,64K", "--ops", "none,2bit,1bit,bf16",
           "--collectives", "allreduce", "--iters", "2", "--min-iters", "1",
           "--no-progress", "--json", str(out)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["ranks"] for r in rows} == {2}
    by = {(r["op"], r["size_bytes"]): r for r in rows}
    # wire bytes: none sends 2(N-1)/N = 1 buffer per rank; 2bit a sixteenth of it
    assert by[("none", 65536)]["wire_bytes"] == 65536
    assert by[("2bit", 65536)]["compression_ratio"] == pytest.approx(16.0)
    assert by[("1bit", 65536)]["compression_ratio"] > 25
    assert by[("bf16", 65536)]["compression_ratio"] == pytest.approx(2.0)
    assert "speedup against none" in p.stdout


def test_small_message_fallback(monkeypatch):
    """Below MPIGC_MIN_COMPRESS_BYTES a compressed op is the exact MPI sum and
    uses no residual; at or above it, it compresses as before."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(256).astype(np.float32)  # 1 KiB
    fb = mpigc.ErrorFeedback()
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "4096")
    y = mpigc.allreduce(x.copy(), op="2bit", key="small", feedback=fb)
    np.testing.assert_array_equal(y, x)  # one rank: the exact sum is x
    assert "small" not in fb.state_dict()
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "1024")
    y = mpigc.allreduce(x.copy(), op="2bit", key="small", feedback=fb)
    assert not np.array_equal(y, x)  # compressed: values are 0 or +-threshold
    assert set(np.unique(np.abs(y)).tolist()) <= {0.0, 0.5}
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "lots")
    with pytest.raises(mpigc.ConfigError):
        mpigc.allreduce(x.copy(), op="2bit", key="small2", feedback=fb)
