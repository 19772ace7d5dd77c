"""Where Numba keeps mpigc's compiled kernels on disk.

Numba's default for ``cache=True`` is a ``__pycache__`` folder next to the
source file: for an installed mpigc, inside ``site-packages/mpigc/``. pip does
not know those files, so ``pip uninstall`` (and the uninstall step of an
upgrade or of ``pip install -e``) leaves them behind, and the folder left,
without ``__init__.py``, then shadows another install of mpigc as an empty
namespace package. A read-only or shared site-packages has its own trouble.

mpigc's own jitted functions (those defined in ``mpigc.*``, also when a module
runs as ``python -m mpigc.checkpoint``) therefore cache in a per-user folder,
chosen in this order:

1. ``MPIGC_CACHE_DIR`` (``off``, ``0`` or ``none``: no disk cache at all, every
   process compiles again);
2. ``NUMBA_CACHE_DIR``, when the user set it (Numba's own setting, honoured);
3. ``$XDG_CACHE_HOME/mpigc``, else ``~/.cache/mpigc``.

Inside it, each source folder gets a subfolder named after the folder and a
hash of its absolute path (as Numba's user-wide cache does), so two installs
(two virtualenvs, a checkout and a wheel) never share entries. Numba checks a
hash of the source file and its own version before it uses an entry. The
folder can be removed at any time. If it cannot be created or written, mpigc's
kernels are not cached (a message on the ``mpigc`` logger says so) and nothing
is written anywhere else.

Only mpigc's functions are redirected: Numba's ``NUMBA_CACHE_DIR`` and its
default locations stay as they are for everyone else's code.
"""
import logging
import os
import sys
import tempfile

__all__ = ["cache_dir", "enabled", "enabled_for_cuda"]

_OFF = ("off", "0", "none", "false", "no")
_log = logging.getLogger("mpigc")
_state = {}  # "dir": the folder (None: no disk cache), "installed": locator in place


def cache_dir():
    """The folder mpigc's kernels are cached in, or ``None`` when disk caching
    is off (``MPIGC_CACHE_DIR=off``). Read from the environment on each call."""
    env = os.environ.get("MPIGC_CACHE_DIR", "").strip()
    if env:
        return None if env.lower() in _OFF else os.path.abspath(os.path.expanduser(env))
    numba_dir = os.environ.get("NUMBA_CACHE_DIR", "").strip()
    if numba_dir:
        return os.path.abspath(os.path.expanduser(numba_dir))
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mpigc")


def _writable(path):
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError:
        return False


def enabled():
    """Whether mpigc's jitted functions may use ``cache=True``; call it where
    they are decorated (``@njit(cache=enabled())``). The first call decides
    the folder, checks that it can be written and puts mpigc's cache locator
    in front of Numba's (for functions defined in ``mpigc.*`` only)."""
    if "dir" not in _state:
        path = cache_dir()
        if path is not None and not _writable(path):
            _log.warning("mpigc: cannot write the kernel cache folder %s; kernels are "
                         "compiled in every process (set MPIGC_CACHE_DIR to a writable "
                         "folder, or to 'off' to silence this)", path)
            path = None
        _state["dir"] = path
        if path is not None:
            _install_locator()
    return _state["dir"] is not None


def _module_name(py_func):
    """The name of the module that defined ``py_func``: for a module run with
    ``python -m mpigc.x`` (whose ``__name__`` is ``__main__``), the name it
    was run as (``mpigc.x``, from its ``__spec__``)."""
    name = getattr(py_func, "__module__", None) or ""
    if name == "__main__":
        spec = getattr(py_func, "__globals__", {}).get("__spec__")
        name = getattr(spec, "name", None) or name
    return name


def _is_mpigc(py_func):
    return _module_name(py_func).split(".")[0] == "mpigc"


def _install_locator():
    from numba.core import caching

    class _MpigcCacheLocator(caching._SourceFileBackedLocatorMixin, caching._CacheLocator):
        """Numba cache locator for functions defined in ``mpigc.*``: the per-user
        folder of :func:`cache_dir` (decided once per process)."""

        def __init__(self, py_func, py_file):
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            self._cache_path = os.path.join(_state["dir"],
                                            self.get_suitable_cache_subpath(py_file))

        def get_cache_path(self):
            return self._cache_path

        @classmethod
        def from_function(cls, py_func, py_file):
            if not _is_mpigc(py_func) or _state.get("dir") is None:
                return None  # not ours: Numba's own locators decide
            if not (os.path.exists(py_file) or getattr(sys, "frozen", False)):
                return None
            self = cls(py_func, py_file)
            try:
                self.ensure_cache_path()
            except OSError:
                # never fall through to Numba's in-tree __pycache__ (the
                # site-packages folder) for mpigc: a temporary folder instead
                if "tmp" not in _state:
                    _state["tmp"] = tempfile.mkdtemp(prefix="mpigc-cache-")
                    _log.warning("mpigc: cannot write %s; caching kernels in %s",
                                 _state["dir"], _state["tmp"])
                self._cache_path = _state["tmp"]
            return self

    _state["locator"] = _MpigcCacheLocator
    _add_locator(caching)


def _add_locator(caching):
    """Put mpigc's locator first in a caching module (Numba's, or numba-cuda's
    copy of it), with the one-process-compiles lock."""
    impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl
    if not any(getattr(c, "__name__", "") == "_MpigcCacheLocator"
               for c in impl._locator_classes):
        impl._locator_classes = [_state["locator"]] + list(impl._locator_classes)
        _serialise_compiles(caching.Cache, _state["locator"])


def enabled_for_cuda():
    """:func:`enabled` for numba-cuda's kernels (``@cuda.jit(cache=...)``):
    numba-cuda caches through its own copy of Numba's caching module
    (``numba.cuda.core.caching``), so mpigc's locator and lock go there
    too: the CUDA kernels are cached in the same folder as the CPU ones, and
    the ranks of a node compile each kernel once."""
    if not enabled():
        return False
    try:
        from numba.cuda.core import caching
    except ImportError:  # Numba's built-in CUDA target: Numba's caching module
        return True
    _add_locator(caching)
    return True


def _serialise_compiles(cache_cls, locator_cls):
    """One process compiles, the others load its result (mpigc's functions only).

    The ranks of a job start together and, on a cold cache, would all compile
    the same kernels at once (N times the work on the same cores). A miss in
    the disk cache takes a lock file per function and signature next to the
    cache entry (``fcntl.flock``: released by the kernel if the process dies);
    whoever gets it second finds the entry saved by the first and loads it.
    Locks follow the call graph (a kernel, then the kernels it calls), which
    has no cycles, so they cannot deadlock; a wait longer than
    ``MPIGC_COMPILE_LOCK_TIMEOUT`` seconds (default 600) compiles anyway.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: every process compiles
        return
    import hashlib
    import time

    load, save = cache_cls.load_overload, cache_cls.save_overload

    def ours(cache):
        return isinstance(getattr(getattr(cache, "_impl", None), "locator", None), locator_cls)

    def lock_path(cache, sig):
        tag = hashlib.sha1(str(sig).encode()).hexdigest()[:16]
        return os.path.join(cache._cache_path,
                            f"{cache._impl.filename_base}-{tag}.lock")

    def load_overload(self, sig, target_context):
        data = load(self, sig, target_context)
        if data is not None or not ours(self):
            return data
        if str(sig) in self.__dict__.get("_mpigc_locks", {}):
            return None  # held since a compile that raised: compile again, still ours
        try:
            fd = os.open(lock_path(self, sig), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return None
        deadline = time.monotonic() + float(os.environ.get("MPIGC_COMPILE_LOCK_TIMEOUT",
                                                           "600"))
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    return None
                time.sleep(0.05)
        data = load(self, sig, target_context)  # saved meanwhile by the lock's last holder?
        if data is not None:
            os.close(fd)  # releases the lock
            return data
        self.__dict__.setdefault("_mpigc_locks", {})[str(sig)] = fd
        return None  # this process compiles; save_overload releases the lock

    def save_overload(self, sig, data):
        try:
            save(self, sig, data)
        finally:
            fd = self.__dict__.get("_mpigc_locks", {}).pop(str(sig), None)
            if fd is not None:
                os.close(fd)

    cache_cls.load_overload = load_overload
    cache_cls.save_overload = save_overload
