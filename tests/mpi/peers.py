"""Helpers shared by MPI test modules (not a test module itself)."""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from support import scenarios  # noqa: E402 (tests/support/scenarios.py)

state_bytes = scenarios.state_bytes  # residuals as comparable values


def await_word(comm, source, tag, seconds=60):
    """Wait, sleeping, at most ``seconds`` for a word that ``source`` sends
    with ``tag``: ``(request, arrived)``. When it has not arrived, make what
    the word waited for before ``request.wait()`` (the sender may be stuck
    until then)."""
    token = comm.irecv(source=source, tag=tag)
    deadline = time.monotonic() + seconds
    got, _ = token.test()
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
        got, _ = token.test()
    return token, got
