"""Helpers shared by MPI test modules (not a test module itself)."""
import time


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


def state_bytes(fb):
    """Residual store ``fb`` as comparable values: ``{key: (calls, worker
    bytes, owner bytes)}``."""
    out = {}
    for key, st in fb.state_dict().items():
        out[key] = (st["calls"],) + tuple(
            None if st[p] is None else st[p].tobytes() for p in ("worker", "owner"))
    return out
