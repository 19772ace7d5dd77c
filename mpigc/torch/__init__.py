"""PyTorch integration: bucketed, overlapped, compressed gradient synchronisation.

One line makes an existing model's gradient exchange compressed::

    import mpigc.torch
    sync = mpigc.torch.GradientSync(model, op="2bit", rel_threshold=1.5)  # collective
    mpigc.torch.broadcast_parameters(model)               # every rank starts equal
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()    # buckets start their allreduce as they fill
        sync.wait()                        # gradients are now averaged over the ranks
        opt.step()

or, Horovod style, ``opt = mpigc.torch.DistributedOptimizer(opt, model, op="2bit")``,
an optimizer of the wrapped class whose gradients are averaged by the end of
``backward()`` (as with DDP); or, keeping DDP, its communication hook:
``ddp.register_comm_hook(mpigc.torch.CommHookState(ddp, op="2bit"), mpigc.torch.comm_hook)``.
With AdamW, :class:`CompressedAdamW` compresses the momentum instead (under DDP with
:func:`local_gradients_hook`); :class:`DiLoCo` takes H local steps of any optimizer
between compressed outer steps (``docs/lowcomm.md``); Lightning takes the hook through
:class:`mpigc.torch.lightning.MpigcCommHook`; :func:`init_process_group` (or
``python -m mpigc.launch``) sets up a ``torchrun`` script's process group under ``mpirun``.

A thin layer by composition over :func:`mpigc.iallreduce` and
:class:`mpigc.ErrorFeedback`; see ``docs/torch.md`` for the design (bucket order, keys,
residual layout, unused and frozen parameters, CUDA staging, AMP and the
``nonfinite="skip"`` default, uneven inputs and ``join()``) and a migration guide
from DDP and Horovod. Importing this module imports torch; ``import mpigc`` does not.
"""
try:
    import torch  # noqa: F401
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError("mpigc.torch needs PyTorch: pip install 'mpigc[torch]' "
                      f"({_exc})") from _exc

# The package's modules, one concern each: _common (agreement of arguments,
# timed waits, tensors <-> engine arrays), _buckets (the one bucketing),
# _residuals (an object's residuals: rollback, fold-back, state, checkpoints),
# _state (per-parameter conversions of bucket layouts), _sync and _sync_steps
# (GradientSync), _optimizer (DistributedOptimizer), _hook and _hook_steps (the
# DDP communication hook), _adam and _adam_steps (CompressedAdamW), _diloco (DiLoCo: local steps, outer Nesterov step), _fsdp
# (FSDP2 and HSDP hooks), _launch (process group and broadcasts).
from ._adam import CompressedAdamW, local_gradients_hook
from ._diloco import DiLoCo, StreamingDiLoCo
from ._hook import CommHookState, comm_hook
from ._fsdp import FsdpHookState, register_fsdp_hooks
from ._launch import broadcast_optimizer_state, broadcast_parameters, init_process_group
from ._optimizer import DistributedOptimizer
from ._sync import Bucket, GradientSync

__all__ = ["GradientSync", "DistributedOptimizer", "CommHookState", "comm_hook",
           "register_fsdp_hooks", "FsdpHookState",
           "broadcast_parameters", "broadcast_optimizer_state", "Bucket", "CompressedAdamW",
           "init_process_group", "local_gradients_hook", "DiLoCo",
           "StreamingDiLoCo"]

#: Test seam (private). Under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``)
#: only: buckets of CPU parameters become device buckets whose engine array is a
#: simulated device array over the bucket tensor's memory, so the device bucket
#: code (allocation, gradient copy, the engine's device path, copy-back,
#: snapshots and rollback, residual state) runs without a GPU. Read when a
#: GradientSync or a hook call is made; see tests/mpi/test_torch_gpu_sim_mpi.py.
_sim_device_buckets = False
