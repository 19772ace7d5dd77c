"""The engine's effects (:mod:`mpigc._effects`) on a real communicator of
one rank (messages to itself): what a step receives, whether it blocks."""
import numpy as np
import pytest

MPI = pytest.importorskip("mpi4py.MPI")

from mpigc import _effects  # noqa: E402


@pytest.mark.parametrize("block", [True, False])
def test_received_takes_the_message_into_the_slot_of_its_size(block):
    comm = MPI.COMM_SELF.Dup()
    try:
        sent = np.arange(37, dtype=np.uint8)
        slots = {}

        def slot(count):
            slots[count] = np.zeros(count, np.uint8)
            return slots[count]

        eff = _effects.Received(comm, 0, 5, slot)
        if not block:  # nothing sent yet: a test, not a wait
            assert eff.ready(None, False) == (False, None) and not slots
        req = comm.Isend([sent, MPI.BYTE], dest=0, tag=5)
        ok, got = eff.ready(None, block)
        while not ok:  # the matched message's receive, tested
            ok, got = eff.ready(None, False)
        req.Wait()
        assert got == 37 and list(slots) == [37]
        assert (slots[37] == sent).all()
    finally:
        comm.Free()
