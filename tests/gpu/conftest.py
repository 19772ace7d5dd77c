"""Real-GPU tests: collected only when this folder (or a file in it) is named
on the command line, e.g. ``python -m pytest tests/gpu``.

The default run (``testpaths = tests``) walks into this folder too; the hook
below makes it skip the folder there, so machines without a GPU (developers,
CI) never see these tests. Named explicitly, they run, and FAIL (never skip)
when no CUDA GPU is usable: a GPU job that silently tests nothing would look
green.
"""
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _named_on_command_line(config):
    for arg in config.invocation_params.args:
        if arg.startswith("-"):
            continue
        p = Path(config.invocation_params.dir, arg.split("::")[0]).resolve()
        if p == HERE or HERE in p.parents:
            return True
    return False


def pytest_ignore_collect(collection_path, config):
    if not _named_on_command_line(config):
        return True
    return None
