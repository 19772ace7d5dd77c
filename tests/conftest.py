"""A plain test whose ``mpirun`` never started runs once more.

Plain tests start jobs under ``mpirun``; once in a while Open MPI's launcher
fails before it launches any rank (``tests/support/launcher.py`` says how it is
recognised). Such a test checked nothing, so it runs again, once, with a
warning in the summary; its second outcome is its outcome. A run ``--with-mpi``
(the tests of ``tests/mpi`` in the ranks of a job) never runs a test again: the
ranks run the same tests in step, and one rank repeating a test would leave the
others waiting.
"""
import pytest
from _pytest.runner import runtestprotocol

from support import launcher


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if item.config.getoption("with_mpi", default=False):
        return None
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    reports = runtestprotocol(item, nextitem=nextitem, log=False)
    if any(r.failed and launcher.did_not_start(r.longreprtext) for r in reports):
        item.warn(pytest.PytestWarning(
            "mpirun did not start (Open MPI's launcher failed before any rank ran: "
            f"{launcher.DID_NOT_START[0]!r}); the test ran once more"))
        item._initrequest()
        reports = runtestprotocol(item, nextitem=nextitem, log=False)
    for r in reports:
        item.ihook.pytest_runtest_logreport(report=r)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True
