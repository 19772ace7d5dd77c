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
