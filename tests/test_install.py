"""An installed mpigc must never gain files at run time (issue 17).

pip removes only the files it installed. Numba's default ``cache=True`` writes
``__pycache__/*.nbi`` / ``*.nbc`` next to the source, that is into
``site-packages/mpigc/``; after ``pip uninstall`` (or the uninstall step of
``pip install -e``) those files keep an empty ``site-packages/mpigc/`` alive,
which then shadows another install as a namespace package. mpigc caches its
kernels in a per-user folder instead (``mpigc._jitcache``).
"""
import os
import shutil
import subprocess
import sys

import pytest

from mpigc import _jitcache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("env, expected", [
    ({"MPIGC_CACHE_DIR": "/x/mine", "NUMBA_CACHE_DIR": "/x/numba"}, "/x/mine"),
    ({"MPIGC_CACHE_DIR": "off", "NUMBA_CACHE_DIR": "/x/numba"}, None),
    ({"MPIGC_CACHE_DIR": "0"}, None),
    ({"NUMBA_CACHE_DIR": "/x/numba", "XDG_CACHE_HOME": "/x/xdg"}, "/x/numba"),
    ({"XDG_CACHE_HOME": "/x/xdg"}, "/x/xdg/mpigc"),
    ({"XDG_CACHE_HOME": "relative/ignored", "HOME": "/x/home"}, "/x/home/.cache/mpigc"),
    ({"HOME": "/x/home"}, "/x/home/.cache/mpigc"),
])
def test_cache_dir_order(monkeypatch, env, expected):
    for k in ("MPIGC_CACHE_DIR", "NUMBA_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert _jitcache.cache_dir() == expected


# Compiles one kernel of each module that caches (kernels/cpu.py, checkpoint.py)
# in a fresh process; prints the locations Numba chose.
CHILD = """
import numpy as np
import mpigc, mpigc.kernels.cpu as k
from mpigc import checkpoint
assert k.count_nonfinite(np.array([1.0, np.nan, np.inf], np.float32)) == 2
checkpoint.fletcher64_blocks(np.arange(64, dtype=np.uint8))
print("cached in", k._count_nonfinite_range._cache._cache_path)
"""


def _files(top):
    return sorted(os.path.relpath(os.path.join(d, f), top)
                  for d, _, fs in os.walk(top) for f in fs)


def _tree(top):
    """Files and folders (an empty ``__pycache__`` left behind counts too)."""
    return sorted(os.path.relpath(os.path.join(d, f), top) + ("/" if f in ds else "")
                  for d, ds, fs in os.walk(top) for f in ds + fs)


def _install_copy(site):
    """What ``pip install .`` puts in site-packages, without pip: the two
    packages' sources (setup.cfg maps kernels/ to mpigc.kernels)."""
    for src, dst in (("mpigc", "mpigc"), ("kernels", os.path.join("mpigc", "kernels"))):
        os.makedirs(os.path.join(site, dst))
        for f in os.listdir(os.path.join(ROOT, src)):
            if f.endswith((".py", ".typed")):
                shutil.copy(os.path.join(ROOT, src, f), os.path.join(site, dst, f))


@pytest.mark.parametrize("setting", ["default", "numba_cache_dir", "off"])
def test_running_writes_nothing_into_the_installed_package(tmp_path, setting):
    site, home = str(tmp_path / "site"), tmp_path / "home"
    _install_copy(site)
    before = _files(site)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MPIGC_CACHE_DIR", "NUMBA_CACHE_DIR", "XDG_CACHE_HOME")}
    env.update(PYTHONPATH=site, HOME=str(home), PYTHONDONTWRITEBYTECODE="1")
    if setting == "numba_cache_dir":
        env["NUMBA_CACHE_DIR"] = str(tmp_path / "numba")
    if setting == "off":
        env["MPIGC_CACHE_DIR"] = "off"
    code = CHILD if setting != "off" else CHILD.replace("print(", "0 and print(")
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(tmp_path),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout
    # nothing new in the installed package: removing what was installed
    # (pip uninstall) leaves no folder behind
    assert _files(site) == before
    cache = {"default": home / ".cache" / "mpigc", "numba_cache_dir": tmp_path / "numba",
             "off": None}[setting]
    if cache is None:
        assert not (home / ".cache").exists()
    else:
        names = _files(str(cache))
        assert any(n.startswith("kernels_") and n.endswith(".nbi") for n in names), names
        assert any(n.startswith("mpigc_") and n.endswith(".nbi") for n in names), names
        assert str(cache) in p.stdout


# A real checkpoint with residuals (its checksums run the Fletcher kernel).
SAVER = """
import numpy as np, mpigc
from mpi4py import MPI
fb = mpigc.ErrorFeedback()
mpigc.allreduce(np.linspace(-1, 1, 50, dtype=np.float32), "2bit", key="w", feedback=fb,
                comm=MPI.COMM_SELF)
mpigc.save_checkpoint("ck", fb, comm=MPI.COMM_SELF, fsync=False)
"""


def test_checkpoint_info_command_writes_nothing_into_the_installed_package(tmp_path):
    """``python -m mpigc.checkpoint info`` runs the module as ``__main__``:
    its checksum kernel must cache in the per-user folder too, not in
    ``site-packages/mpigc/__pycache__`` (issue 32)."""
    site = str(tmp_path / "site")
    _install_copy(site)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MPIGC_CACHE_DIR", "NUMBA_CACHE_DIR", "XDG_CACHE_HOME")}
    env.update(PYTHONPATH=site, PYTHONDONTWRITEBYTECODE="1", MPIGC_MIN_COMPRESS_BYTES="0")

    def run(args, home):
        return subprocess.run([sys.executable, *args], env=dict(env, HOME=str(home)),
                              cwd=str(tmp_path), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=600)

    p = run(["-c", SAVER], tmp_path / "home-save")
    assert p.returncode == 0, p.stdout
    before = _tree(site)
    # another HOME: the command's own compile must land in its per-user folder
    home = tmp_path / "home-info"
    p = run(["-m", "mpigc.checkpoint", "info", "ck"], home)
    assert p.returncode == 0, p.stdout
    assert "'w': shape (50,)" in p.stdout and "checksums    OK" in p.stdout, p.stdout
    assert _tree(site) == before, sorted(set(_tree(site)) ^ set(before))
    names = _files(str(home / ".cache" / "mpigc"))
    assert any(n.startswith("mpigc_") and "_fletcher64_kernel" in n and n.endswith(".nbi")
               for n in names), names


# A module of the package with a kernel of its own, run as ``python -m``.
PROBE = """
import numba
from mpigc import _jitcache


@numba.njit(cache=_jitcache.enabled())
def _twice(x):
    return 2 * x


if __name__ == "__main__":
    print("twice", _twice(21))
"""


def test_a_kernel_of_a_module_run_as_main_caches_in_the_user_folder(tmp_path):
    """The cache locator knows mpigc's code by the name it runs as: a kernel
    defined in ``python -m mpigc.<module>`` (module ``__main__``) is cached in
    the per-user folder, not next to its source."""
    site, home = str(tmp_path / "site"), tmp_path / "home"
    _install_copy(site)
    with open(os.path.join(site, "mpigc", "_probe_main.py"), "w") as f:
        f.write(PROBE)
    before = _tree(site)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MPIGC_CACHE_DIR", "NUMBA_CACHE_DIR", "XDG_CACHE_HOME")}
    env.update(PYTHONPATH=site, HOME=str(home), PYTHONDONTWRITEBYTECODE="1")
    p = subprocess.run([sys.executable, "-m", "mpigc._probe_main"], env=env,
                       cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=600)
    assert p.returncode == 0 and "twice 42" in p.stdout, p.stdout
    assert _tree(site) == before, sorted(set(_tree(site)) ^ set(before))
    names = _files(str(home / ".cache" / "mpigc"))
    assert any("_probe_main._twice" in n and n.endswith(".nbi") for n in names), names


# Several processes that need the same kernel at once (the ranks of a job on a
# cold cache): one compiles, the others wait and load what it saved. Each says it
# is ready (a file in argv[1]) once mpigc is imported, and calls the kernel when
# all argv[2] are (before, each waited for a clock time 8 s ahead).
RACER = """
import os, sys, time, numpy as np
import mpigc
from mpigc.kernels import cpu
ready, n = sys.argv[1], int(sys.argv[2])
open(os.path.join(ready, str(os.getpid())), "w").close()
while len(os.listdir(ready)) < n:
    time.sleep(0.005)
cpu.count_nonfinite(np.ones(10, np.float32))
d = cpu._count_nonfinite_range
print("misses", sum(d._cache_misses.values()), "hits", sum(d._cache_hits.values()))
"""


def test_one_process_compiles_the_others_load(tmp_path):
    env = dict(os.environ, MPIGC_CACHE_DIR=str(tmp_path / "cache"))
    ready = tmp_path / "ready"
    ready.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(ready), "3"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    lines = sorted(o.strip().splitlines()[-1] for o in outs)
    assert lines == ["misses 0 hits 1", "misses 0 hits 1", "misses 1 hits 0"], outs
