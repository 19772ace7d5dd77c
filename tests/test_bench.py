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


@pytest.mark.parametrize("argv, message", [
    (["--ops", "3bit"], "argument --ops: expected some of mpi, 1bit"),
    (["--ops", "none,2bit,3bit"], "got 3bit"),
    (["--sizes", "4X"], "argument --sizes: expected a size such as 4K"),
    (["--sizes", "0"], "argument --sizes: expected sizes above 0"),
    (["--collectives", "allgather"], "argument --collectives: expected some of allreduce"),
    (["--threshold", "1", "--rel-threshold", "1.5"], "not allowed with argument"),
])
def test_bad_arguments_are_usage_errors(capsys, argv, message):
    """A wrong option ends in argparse's usage error (exit 2), not a traceback."""
    with pytest.raises(SystemExit) as e:
        bench.main(argv + ["--iters", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: mpigc-bench") and message in err, err


def test_rel_threshold_and_no_progress_bar_off_a_terminal(capsys):
    """--rel-threshold runs 2bit's relative mode (its own wire size: 1/4 byte
    per value plus a float32 per block), --threshold MXNet's absolute mode; the progress bar stays off when
    stderr is not a terminal (here: captured), unless asked for."""
    args = ["--sizes", "64K", "--ops", "2bit", "--collectives", "reduce_scatter",
            "--iters", "1", "--min-iters", "1", "--warmup", "1"]
    rows = bench.run(bench.build_parser().parse_args(args + ["--rel-threshold", "1.5"]))
    plain = bench.run(bench.build_parser().parse_args(args + ["--threshold", "0.5"]))
    err = capsys.readouterr().err
    assert "[#" not in err and "[-" not in err  # no bar: stderr is not a terminal
    rel = {r["op"]: r for r in rows}["2bit"]
    ref = {r["op"]: r for r in plain}["2bit"]
    assert rel["max_rel_err"] != ref["max_rel_err"]  # another quantizer ran
    bench.run(bench.build_parser().parse_args(args + ["--progress"]))
    assert "[#" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun on PATH")
def test_bench_under_mpirun(tmp_path):
    out = tmp_path / "rows.json"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    trace = tmp_path / "trace.json"
    cmd = ["timeout", "240", "mpirun", "--oversubscribe", "-n", "2", sys.executable, "-m",
           "mpigc.bench", "--sizes", "4K,64K", "--ops", "none,2bit,1bit,bf16",
           "--collectives", "allreduce", "--iters", "2", "--min-iters", "1",
           "--no-progress", "--json", str(out), "--trace", str(trace)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["ranks"] for r in rows} == {2}
    by = {(r["op"], r["size_bytes"]): r for r in rows}
    # wire bytes: none sends 2(N-1)/N = 1 buffer per rank; 2bit (the relative mode)
    # a sixteenth of it plus a float32 per block of 1024 values
    assert by[("none", 65536)]["wire_bytes"] == 65536
    assert by[("2bit", 65536)]["compression_ratio"] == pytest.approx(65536 / (4096 + 64))
    assert by[("1bit", 65536)]["compression_ratio"] > 25
    assert by[("bf16", 65536)]["compression_ratio"] == pytest.approx(2.0)
    assert "speedup against none" in p.stdout
    # --trace: each rank's file, merged by rank 0; every timed call of mpigc is in it
    doc = json.loads(trace.read_text())
    assert doc["otherData"]["ranks"] == [0, 1]
    names = {e["name"] for e in doc["traceEvents"] if e["ph"] == "b" and e.get("cat") == "call"
             and "bytes" in e.get("args", {})}
    assert {"allreduce none", "allreduce 2bit", "allreduce 1bit", "allreduce bf16"} <= names
    assert (tmp_path / "trace.rank0.json").exists() and (tmp_path / "trace.rank1.json").exists()


def test_small_message_fallback(monkeypatch):
    """Below MPIGC_MIN_COMPRESS_BYTES a compressed op is the exact MPI sum and
    uses no residual; at or above it, it compresses as before."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(256).astype(np.float32)  # 1 KiB
    fb = mpigc.ErrorFeedback()
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "4096")
    y = mpigc.allreduce(x.copy(), op="2bit", threshold=0.5, key="small", feedback=fb)
    np.testing.assert_array_equal(y, x)  # one rank: the exact sum is x
    assert "small" not in fb.state_dict()
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "1024")
    y = mpigc.allreduce(x.copy(), op="2bit", threshold=0.5, key="small", feedback=fb)
    assert not np.array_equal(y, x)  # compressed (MXNet's mode): values are 0 or +-threshold
    assert set(np.unique(np.abs(y)).tolist()) <= {0.0, 0.5}
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "lots")
    with pytest.raises(mpigc.ConfigError):
        mpigc.allreduce(x.copy(), op="2bit", threshold=0.5, key="small2", feedback=fb)


def test_latency_defaults_and_columns(capsys):
    """--latency: 4 B .. 1 MiB, every op and mpi, allreduce only; the tables
    gain 'vs mpi' and 'wire %' (the sizes here are cut down to stay fast)."""
    args = bench.build_parser().parse_args(["--latency"])
    bench.apply_latency_defaults(args, ["--latency"])
    assert args.sizes[0] == 4 and args.sizes[-1] == 1 << 20 and len(args.sizes) == 10
    assert args.ops[0] == "mpi" and set(mpigc.available_compressors()) <= set(args.ops)
    assert args.collectives == ["allreduce"] and args.iters == 200 and args.min_iters == 50
    argv = ["--latency", "--sizes", "4,64K", "--ops", "none,2bit", "--iters", "3",
            "--min-iters", "1", "--warmup", "1", "--no-progress"]
    assert bench.main(argv) == 0
    text = capsys.readouterr().out
    assert "vs mpi" in text and "wire %" in text and "# allreduce, op=mpi" in text
    assert "reduce_scatter" not in text


def test_wire_fraction():
    """The fraction of the wire ideal: with a link rate, wire time / time;
    without, the speedup over mpi / mpi's wire bytes over the op's."""
    mpi = {"wire_bytes": 16 << 20, "median_s": 0.32}
    op = {"wire_bytes": 1 << 20, "median_s": 0.025}
    # 1 MiB at 1 Gbit/s = 8.39 ms of 25 ms
    assert abs(bench.wire_fraction(op, mpi, 1.0) - (8 * (1 << 20) / 1e9) / 0.025) < 1e-12
    # speedup 12.8x of an ideal 16x: 80%
    assert abs(bench.wire_fraction(op, mpi) - 0.8) < 1e-12
    assert bench.wire_fraction(op, None) is None


def test_model_prints_the_fit_kernels_and_crossover(capsys):
    """--model (issue 48): op='auto''s fitted model of this job, one rank."""
    assert bench.main(["--model", "--sizes", "16K,64K", "--iters", "2"]) == 0
    text = capsys.readouterr().out
    assert "T = latency + bytes / bandwidth" in text
    lines = text.splitlines()
    fitted = {ln.split()[0] for ln in lines if ln.strip().endswith(tuple("0123456789f"))
              and "allreduce" in ln}
    assert {"none", "2bit"} <= fitted, text
    assert any(ln.split()[:2] == ["2bit", "encode"] for ln in lines), text
    assert "# crossover" in text and any(ln.split()[:1] == ["2bit"] and "encode" not in ln
                                         and "allreduce" not in ln for ln in lines), text


def test_crossover_of_two_fits():
    from mpigc import _bench_model
    from mpigc._auto_model import Fit
    none = Fit(4, 50e-6, 1e9)
    assert _bench_model.crossover(none, Fit(4, 2e-3, 4e9)) == pytest.approx(
        (2e-3 - 50e-6) / (1e-9 - 0.25e-9))
    assert _bench_model.crossover(none, Fit(4, 2e-3, 0.5e9)) is None
    assert _bench_model.crossover(none, Fit(4, 10e-6, 0.5e9)) is None
    assert _bench_model.crossover(none, Fit(4, 10e-6, 1e9)) == 0
