"""torch.distributed in the MPI tests (``mpirun ... pytest --with-mpi``): the
gloo process group on the MPI ranks, and the FSDP2 setup that the FSDP tests
share (``mpi/test_fsdp_mpi.py``, ``mpi/test_fsdp_dcp_mpi.py``,
``mpi/test_lightning_fsdp_mpi.py``).

A test module takes the fixture by name (``from support.torch_dist import
gloo``); it is module-scoped: each module starts and ends its own group.
Import this module after ``pytest.importorskip("torch")``.
"""
import contextlib
import os
import shutil
import socket
import tempfile

import pytest
import torch
from mpi4py import MPI

#: the FSDP hooks' ops that the FSDP tests run, by name
OPS = {"2bit-abs": {"op": "2bit", "threshold": 0.5},
       "2bit-rel": {"op": "2bit", "rel_threshold": 1.5},
       "1bit": {"op": "1bit"},
       "terngrad": {"op": "terngrad", "error_feedback": True}}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gloo():
    """torch.distributed over gloo on the ranks of ``MPI.COMM_WORLD`` (rank
    0's free port, broadcast over MPI), destroyed after the module."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    comm = MPI.COMM_WORLD
    port = comm.bcast(_free_port() if comm.rank == 0 else None)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=comm.rank, world_size=comm.size)
    yield dist
    dist.destroy_process_group()


@contextlib.contextmanager
def shared_dir(comm, prefix):
    """A temporary directory made on rank 0, its path on every rank of
    ``comm``; removed once every rank is done with it."""
    path = comm.bcast(tempfile.mkdtemp(prefix=prefix) if comm.rank == 0 else None)
    try:
        yield path
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(path, ignore_errors=True)


def fully_shard_layers(root, layers, **kw):
    """``fully_shard`` each of ``layers``, then ``root`` (FSDP2's usual
    wrapping: one parameter group per layer and one for the rest)."""
    from torch.distributed.fsdp import fully_shard
    for layer in layers:
        fully_shard(layer, **kw)
    fully_shard(root, **kw)
    return root


def model(reduce_dtype=torch.float32, reshard=True, extra=0, mesh=None):
    """Two linear blocks and the root, each fully_shard'ed: the 7-row layer
    is padded and sharded unevenly at 2, 3 and 4 ranks; ``extra`` output
    rows make another model."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    torch.manual_seed(0)
    layers = [torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3 + extra)]
    return fully_shard_layers(torch.nn.Sequential(*layers), layers[::2],
                              mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype),
                              reshard_after_forward=reshard, mesh=mesh)


def backward(m, rank, step):
    """The backward pass of ``rank``'s batch of ``step`` (its own data)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 5, generator=g)
    m(x).pow(2).sum().backward()


def local_params(m):
    """This rank's shards of ``m``'s parameters, by name (copies)."""
    return {n: p.to_local().detach().clone() for n, p in m.named_parameters()}


def train(m, steps, rank, first=0, accumulate=False, opt=None):
    """Steps ``first`` to ``first + steps - 1`` of SGD (``opt``, default a
    new plain SGD at lr 0.05); ``accumulate``: each step first accumulates
    another batch without gradient synchronisation. Returns
    :func:`local_params`."""
    if opt is None:
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
    for step in range(first, first + steps):
        opt.zero_grad()
        if accumulate:
            m.set_requires_gradient_sync(False)
            backward(m, rank, 500 + step)
            m.set_requires_gradient_sync(True)
        backward(m, rank, step)
        opt.step()
    return local_params(m)


def same(a, b):
    """Two :func:`local_params` bit for bit (the same names)."""
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


def compare(a, b, exact, rtol):
    """Bit for bit when ``exact`` (:func:`same`), else within ``rtol`` of the
    model's largest parameter value."""
    if exact:
        return same(a, b)
    atol = rtol * max(float(t.float().abs().max()) for t in a.values() if t.numel())
    return all(torch.allclose(a[n].float(), b[n].float(), rtol=0, atol=atol) for n in a)


def hooked_modules(m, keys):
    """``[(key, module)]``: the FSDP modules of ``m`` whose hook key
    (``"fsdp:<fqn>"``) is in ``keys``, in ``m.named_modules()`` order."""
    from torch.distributed.fsdp import FSDPModule
    return [(f"fsdp:{fqn}", mod) for fqn, mod in m.named_modules()
            if isinstance(mod, FSDPModule) and f"fsdp:{fqn}" in keys]


class Experts(torch.nn.Module):
    """One FSDP group holding two experts of one shape; ``forward(x, k)``
    runs expert ``k`` only (top-1 routing): the flat inputs of two steps that
    run other experts have one size and other parameters."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(5, 6)
        self.experts = torch.nn.ModuleList([torch.nn.Linear(6, 3) for _ in range(2)])

    def forward(self, x, k):
        return self.experts[k](torch.tanh(self.inp(x)))


def experts(mesh=None):
    """:class:`Experts` built alike on every rank, ``fully_shard``ed (one
    FSDP group) over ``mesh`` (default: every rank)."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    return fully_shard(Experts(), mesh=mesh)


def expert_step(m, rank, step):
    """The backward pass of ``rank``'s batch of ``step`` through expert
    ``step % 2``."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    m(torch.randn(4, 5, generator=g), step % 2).pow(2).sum().backward()


def mesh_2x2(comm):
    """HSDP's 2 x 2 mesh (``"replicate"``, ``"shard"``); skips unless 4 ranks."""
    if comm.size != 4:
        pytest.skip("HSDP 2 x 2 runs at 4 ranks")
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
