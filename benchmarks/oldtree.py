"""Import another checkout's mpigc beside this one, as ``mpigc_old``, for the
interleaved A/B runs of ``percall.py both`` and ``grouped.py``
(``$MPIGC_OLD_TREE``: a worktree with ``kernels/`` copied to
``mpigc/kernels``)."""
import importlib.util
import os
import sys


def load(tree):
    """The ``mpigc`` package of the checkout at ``tree``, as ``mpigc_old``."""
    init = os.path.join(tree, "mpigc", "__init__.py")
    spec = importlib.util.spec_from_file_location(
        "mpigc_old", init, submodule_search_locations=[os.path.dirname(init)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["mpigc_old"] = module
    spec.loader.exec_module(module)
    return module
