"""The torch layer's one bucketing: which parameters share a flat buffer (a
bucket of :class:`GradientSync`, a fixed group of the DDP hook) and where
each sits in it (:class:`Layout`).

The rule is one: filled in the reverse of registration order (roughly the
order in which backward produces the gradients, as DDP fills its buckets),
one buffer dtype per bucket, a bucket closed once it holds ``cap`` bytes of
that dtype or more, the buckets in backward order. What differs between the
callers is the buffer dtype a parameter's gradient travels in, which each
passes as ``bucket_dtype``:

- :class:`GradientSync` accumulates float16 and bfloat16 gradients in float32
  buckets (:func:`accumulating_dtype`): a model of float16/bfloat16 and
  float32 parameters has float32 buckets that hold all of them, its float16
  parameters counted at 4 bytes an element;
- the DDP hook's groups hold what DDP hands over, the gradients in their
  parameters' dtype (:func:`own_dtype`; DDP's buckets are per dtype): a
  float16 parameter goes in a float16 group, counted at 2 bytes an element.

For float32 and float64 parameters the two are the same buckets.
"""
import hashlib
import json

import numpy as np
import torch

from ._common import engine_array, simulating


class Layout:
    """Where parameters sit in one flat buffer (a bucket of GradientSync or
    of DDP): ``index``, ``key``, ``names``, ``offsets``, ``numels``, ``n``,
    ``dtype`` (numpy)."""

    def __init__(self, index, names, numels, dtype):
        self.index = index
        self.names = list(names)
        self.numels = [int(m) for m in numels]
        self.offsets = np.concatenate([[0], np.cumsum(self.numels)])[:-1].astype(int).tolist()
        self.n = int(sum(self.numels))
        self.dtype = np.dtype(dtype)
        desc = json.dumps([[n, m] for n, m in zip(self.names, self.numels)]).encode()
        digest = hashlib.sha1(desc).hexdigest()[:12]
        self.key = f"torch/{self.names[0]}..{self.names[-1]}/{digest}"


def bucket_assignment(sizes, cap):
    """The bucketing of parameters, by index: ``sizes`` holds ``(nbytes,
    dtype)`` per parameter in registration order (its bytes in the bucket's
    dtype, and that dtype). Filled in the reverse of that order (roughly
    backward's), one dtype per bucket, a bucket closed once it holds ``cap``
    bytes or more; the buckets come in backward order (by their first index,
    descending). Depends on the sizes and ``cap`` alone, so it is the same on
    every rank and in every run."""
    groups, filling, held = [], {}, {}
    for i in range(len(sizes) - 1, -1, -1):
        nbytes, dt = sizes[i]
        filling.setdefault(dt, []).append(i)
        held[dt] = held.get(dt, 0) + nbytes
        if held[dt] >= cap:
            groups.append(filling.pop(dt))
            held[dt] = 0
    groups.extend(g for g in filling.values() if g)
    return sorted(groups, key=lambda g: -g[0])


def accumulating_dtype(p):
    """GradientSync's bucket dtype for parameter ``p``: float64 for float64,
    else float32 (float16 and bfloat16 gradients accumulate in float32)."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def own_dtype(p):
    """The DDP hook's group dtype for parameter ``p``: its own (DDP hands
    over its buckets in the parameters' dtype)."""
    return p.dtype


def plan_buckets(named, bucket_mb, bucket_dtype):
    """The buckets of ``named`` (``(name, parameter)`` pairs in registration
    order) of ``bucket_mb`` MiB: ``[(members, dtype)]``, ``members`` the
    indices into ``named`` in bucket order and ``dtype`` the bucket's torch
    dtype, ``bucket_dtype(p)`` of each of them (see the module docstring)."""
    dtypes = [bucket_dtype(p) for _, p in named]
    sizes = [(p.numel() * dt.itemsize, dt) for (_, p), dt in zip(named, dtypes)]
    return [(members, dtypes[members[0]])
            for members in bucket_assignment(sizes, bucket_mb * (1 << 20))]


class Bucket(Layout):
    """One fused gradient buffer (read-only view for users and tests).

    Attributes
    ----------
    index : int
        Position in the launch order (the same on every rank).
    key : str
        The residual key in :attr:`GradientSync.feedback`, derived from the
        ordered parameter names and sizes (``"torch/<first>..<last>/<hash>"``).
    names : list of str
        The parameters, in bucket order.
    offsets, numels : list of int
        Where each parameter's gradient sits in the flat buffer.
    tensor : torch.Tensor
        The buffer: float32 (float64 for float64 parameters), 1-D; a CUDA
        tensor on the parameters' GPU for a device bucket, else in host
        memory (pinned when its parameters are on a GPU).
    on_device : bool
        A device bucket: every parameter of the bucket is on one GPU (and
        ``device_buckets`` was not turned off); the engine compresses and
        decodes it on that GPU.
    flat : numpy.ndarray or torch.Tensor
        What the engine reduces: the numpy view of :attr:`tensor` (host
        bucket), or :attr:`tensor` itself (device bucket).
    started_at : float or None
        ``time.perf_counter()`` when this step's allreduce started, or None.
    decision : mpigc.auto Decision or None
        With ``op="auto"``: what the last completed step's call ran and why
        (``op``, ``reason``, the predicted times; :attr:`mpigc.AutoRequest.decision`);
        else None.
    """

    def __init__(self, index, entries, np_dtype, device, pin):
        super().__init__(index, [n for n, _, _ in entries],
                         [p.numel() for _, _, p in entries], np_dtype)
        self.param_index = [i for _, i, _ in entries]
        tdtype = torch.float64 if self.dtype == np.float64 else torch.float32
        sim = device is None and simulating()
        self.on_device = device is not None or sim
        if device is not None:  # a device bucket in GPU memory
            self.tensor = torch.zeros(self.n, dtype=tdtype, device=device)
        else:
            self.tensor = torch.zeros(self.n, dtype=tdtype, pin_memory=pin)
        self.flat = engine_array(self.tensor, self.on_device)
        self.pending = len(self.names)
        self.request = None
        self.error = None
        self.started_at = None
        self.decision = None

    def __repr__(self):
        return (f"Bucket(index={self.index}, key={self.key!r}, params={len(self.names)}, "
                f"n={self.n}, on_device={self.on_device})")


def make_buckets(named, bucket_mb, device_buckets):
    """GradientSync's :class:`Bucket` of ``named`` (``(name, parameter)``
    pairs): :func:`plan_buckets` with :func:`accumulating_dtype`. Where each
    bucket lives is this rank's choice (the layout is the same on every rank
    whatever the devices): on the GPU that holds all its parameters (unless
    not ``device_buckets``), else in host memory (pinned when its
    parameters are on a GPU)."""
    buckets = []
    for k, (members, dt) in enumerate(plan_buckets(named, bucket_mb, accumulating_dtype)):
        entries = [(named[i][0], i, named[i][1]) for i in members]
        devices = {p.device for _, _, p in entries}
        dev = next(iter(devices)) if len(devices) == 1 else None
        on_gpu = dev is not None and dev.type == "cuda" and device_buckets
        pin = (not on_gpu and torch.cuda.is_available()
               and any(p.is_cuda for _, _, p in entries))
        buckets.append(Bucket(k, entries, np.float64 if dt == torch.float64 else np.float32,
                              dev if on_gpu else None, pin))
    return buckets
