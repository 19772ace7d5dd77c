"""Real-Slurm tests (``test_real_slurm.py``): collected only when this folder
or that file is named on the command line, as ``tests/slurm/run.sh`` does
after bringing up a local Slurm. Named without a reachable Slurm they FAIL
(never skip): a CI step that silently tests nothing would look green.

The other files here (the helpers of ``mpigc.slurm``) need no Slurm and run
in the plain test run.
"""
from pathlib import Path

HERE = Path(__file__).resolve().parent
REAL = HERE / "test_real_slurm.py"


def _named_on_command_line(config):
    for arg in config.invocation_params.args:
        if arg.startswith("-"):
            continue
        p = Path(config.invocation_params.dir, arg.split("::")[0]).resolve()
        if p in (HERE, REAL):
            return True
    return False


def pytest_ignore_collect(collection_path, config):
    if Path(collection_path).resolve() == REAL and not _named_on_command_line(config):
        return True
    return None
