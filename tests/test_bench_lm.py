"""benchmarks/bench_lm.py's --ops entries: what each one passes to
examples/train_lm.py (``OP:compressed-adamw``, ``OP:diloco=H``,
``OP:diloco=H:streaming=P:overlap=TAU``), and the clear error for a bad one
before any run. The runs go to a stand-in for mpirun that prints the JSON line
train_lm.py would, so no MPI and no training."""
import importlib.util
import json
import os
import stat
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks",
                     "bench_lm.py")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_lm", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("entry, expected", [
    ("none", ("none", [])),
    ("1bit:compressed-adamw", ("1bit", ["--optimizer", "compressed-adamw"])),
    ("bf16:diloco=50", ("bf16", ["--diloco", "50"])),
    ("bf16:diloco=50:streaming=5", ("bf16", ["--diloco", "50", "--streaming", "5"])),
    ("2bit:diloco=50:streaming=5:overlap=2",
     ("2bit", ["--diloco", "50", "--streaming", "5", "--overlap", "2"])),
])
def test_an_entry_is_the_op_and_its_train_lm_arguments(entry, expected):
    assert _bench().entry_args(entry) == expected


@pytest.mark.parametrize("entry, says", [
    ("bf16:streaming=5", "need diloco=H"),
    ("bf16:diloco=50:overlap=2", "overlap= needs streaming=P"),
    ("bf16:diloco=fifty", "got 'diloco=fifty'"),
    ("bf16:diloco=50:diloco=10", "got 'diloco=10'"),
    ("bf16:stream=5", "got 'stream=5'"),
    ("1bit:compressed-adamw:diloco=50", "drop the optimizer"),
    (":diloco=50", "expected an op"),
])
def test_a_bad_entry_is_refused_before_any_run(entry, says, tmp_path):
    with pytest.raises(ValueError, match=says):
        _bench().entry_args(entry)
    never = tmp_path / "never-run"
    p = subprocess.run([sys.executable, BENCH, "--ops", f"none,{entry}", "--seeds", "0",
                        "--mpirun", str(never)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and says in p.stderr, p.stderr
    assert "$" not in p.stdout   # nothing started


FAKE = """#!{python}
import json, sys
a = sys.argv[sys.argv.index("--op"):]
def last(flag, default=0):
    return int(a[len(a) - 1 - a[::-1].index(flag) + 1]) if flag in a else default
params = {{"diloco": last("--diloco"), "fragments": last("--streaming"),
          "overlap": last("--overlap")}}
print(json.dumps({{"op": a[1], "argv": a, "params": params, "seed": last("--seed"),
                  "val_loss": 2.0 + last("--diloco") / 1000, "seconds": 0.0,
                  "bytes_sent_per_rank": 1024 * 1024 // max(1, last("--diloco")),
                  "val_curve": [[0, 3.0], [4, 2.0]]}}))
"""


def test_streaming_rows_run_train_lm_with_streaming(tmp_path):
    """A table of exact AdamW, DiLoCo and its streaming variant: each row's run
    got the entry's arguments after those given after --."""
    fake = tmp_path / "mpirun"
    fake.write_text(FAKE.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "rows.json"
    ops = "none,bf16:diloco=50,bf16:diloco=50:streaming=5:overlap=2"
    p = subprocess.run([sys.executable, BENCH, "--ops", ops, "--seeds", "0,1", "--steps",
                        "7", "--mpirun", str(fake), "--json", str(out), "--",
                        "--n-layer", "1", "--overlap", "9"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    with open(out) as f:
        rows = json.load(f)["rows"]
    assert [(r["variant"], r["seed"]) for r in rows] == [
        (v, s) for v in ops.split(",") for s in (0, 1)]
    stream = [r for r in rows if "streaming" in r["variant"]]
    assert all(r["params"] == {"diloco": 50, "fragments": 5, "overlap": 2} for r in stream)
    assert stream[0]["argv"][-6:] == ["--diloco", "50", "--streaming", "5",
                                      "--overlap", "2"]
    assert [r["params"]["fragments"] for r in rows if r["variant"] == "bf16:diloco=50"] \
        == [0, 0]
    table = p.stdout.splitlines()[-4:]
    assert table[0].startswith("op ") and table[1].startswith("none ")
    assert table[3].startswith("bf16:diloco=50:streaming=5:overlap=2 ")
    assert "50.0x" in table[3]
