"""Run a benchmark on the installed mpigc ("new") or on an old tree ("old"):

    python benchmarks/ab.py {old|new} bench [mpigc-bench arguments]
    python benchmarks/ab.py {old|new} path/to/script.py [its arguments]

"old" imports the mpigc package in ``$MPIGC_OLD_TREE`` (a directory holding an
``mpigc/`` package with its ``kernels/`` copied in as ``mpigc/kernels``)
instead of the installed one: the editable install's import hook is dropped,
as in ``benchmarks/percall.py``. Rank 0 prints which package it runs first.
"""
import os
import runpy
import sys

which, what = sys.argv[1], sys.argv[2]
if which not in ("old", "new"):
    sys.exit(__doc__)
if which == "old":
    sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, os.environ["MPIGC_OLD_TREE"])
sys.argv = sys.argv[2:]

import mpigc  # noqa: E402
from mpi4py import MPI  # noqa: E402

if MPI.COMM_WORLD.rank == 0:
    print(which, mpigc.__file__, flush=True)
if what == "bench":
    from mpigc.bench import main  # noqa: E402
    sys.argv[0] = "mpigc-bench"
    sys.exit(main())
runpy.run_path(what, run_name="__main__")
