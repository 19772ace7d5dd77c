"""tests/README.md's table of rank counts says what the files of tests/mpi/
declare: one row per file, with the counts of its ``pytest.mark.ranks``
(read from the source: importing an MPI test file needs MPI)."""
import ast
import glob
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))


def _declared():
    """file name -> the rank counts its module-level pytestmark declares."""
    out = {}
    for path in sorted(glob.glob(os.path.join(HERE, "mpi", "test_*.py"))):
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in tree.body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and getattr(node.targets[0], "id", None) == "pytestmark"):
                for call in ast.walk(node.value):
                    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                            and call.func.attr == "ranks"):
                        out[os.path.basename(path)] = tuple(a.value for a in call.args)
    return out


def _table():
    """file name -> the rank counts of its row in tests/README.md."""
    with open(os.path.join(HERE, "README.md")) as f:
        text = f.read()
    section = text.split("### Rank counts of the MPI files", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `(test_\w+\.py)` \| ([\d,]+) \|", section, re.M)
    return {name: tuple(int(k) for k in counts.split(",")) for name, counts in rows}


def test_the_rank_table_matches_the_markers():
    declared, table = _declared(), _table()
    assert declared, "no pytest.mark.ranks found in tests/mpi"
    missing = sorted(set(declared) - set(table))
    gone = sorted(set(table) - set(declared))
    differ = sorted(f"{k}: README {table[k]}, file {declared[k]}"
                    for k in set(declared) & set(table) if declared[k] != table[k])
    assert not (missing or gone or differ), (
        f"tests/README.md's 'Rank counts of the MPI files' is out of date: rows missing "
        f"for {missing}, rows for files without a marker {gone}, counts that differ {differ}")
