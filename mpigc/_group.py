"""Grouped calls: many arrays in one exchange (``allreduce([g1, g2, ...])``).

A group is fused into one buffer and reduced by one engine call
(:mod:`mpigc._collective`): one agreement, one plan, one exchange, where
single calls would pay each of them per array.

The fused buffer is laid out owner-major: rank j's shard of it is every
member's shard j (each member cut as ``numpy.array_split`` cuts it alone), in
member order. So each member's residuals, under its own key, have the shapes
a single call on that member gives them (the worker residual one value per
element, the owner residual this rank's shard of the member): grouped and
single calls may take turns on a key, and checkpoints hold one entry per
member (:class:`mpigc._residual_txn.GroupTransaction` gathers them; they stay fused
between grouped calls, :class:`mpigc._residual_entry.Fused`).
A reduce-scatter returns each member's shard, as single calls would. A
plain allreduce (``op="none"``, or a group below the compression threshold)
uses no residual: its members are simply concatenated.

Every member must be on the same side (host or device) with the same
dtype; each passes the checks of a single call. A group that fails any check
on any rank fails on every rank, with no member and no residual changed (the
error travels in the call's agreement, as a single call's does).
"""
import zlib

import numpy as np

from . import _settings
from . import _timeline
from ._backend import part
from ._errors import ConfigError, DTypeError, InvalidBufferError
from .feedback import shard_bounds

__all__ = ["Group", "is_group"]


def is_group(buf):
    """A grouped call is one given a list or tuple of arrays."""
    return isinstance(buf, (list, tuple))


class _Layout:
    """Where each member's elements go in the fused buffer of ``sizes`` on
    ``world`` ranks, as a placement ``(pieces, ats, nshards)``: ``pieces``,
    ``(member, lo, hi, at)``, member elements ``[lo, hi)`` at fused offset
    ``at`` (the host copies them piece by piece); ``ats[i * nshards + j]``,
    the fused offset of member i's shard j, the member cut into ``nshards``
    shards as ``numpy.array_split`` cuts it (a device copies a whole member
    in one launch: ``kernels.cuda.group_copy``).

    - owner-major: ``place`` (``nshards`` = ``world``); ``counts``, the
      fused shard sizes; ``owner[r]``, the placement of the members' pieces
      of rank r's fused shard, offsets from the shard's start, one shard
      per member (a member's owner residual is its shard r, whole; a
      member without a piece there has none, and offset 0);
    - concatenated (a plain allreduce, which cuts the fused buffer as one
      array): ``place`` with one shard per member; ``counts`` and
      ``owner`` None."""

    __slots__ = ("place", "counts", "owner", "n")

    def __init__(self, sizes, world, concat):
        self.n = sum(sizes)
        if concat:
            at = np.concatenate([[0], np.cumsum(sizes)]).tolist()
            self.place = ([(i, 0, m, at[i]) for i, m in enumerate(sizes)],
                          tuple(at[:-1]), 1)
            self.counts = self.owner = None
            return
        bounds = [shard_bounds(m, world) for m in sizes]
        pieces, ats = [], [0] * (len(sizes) * world)
        self.counts, self.owner = [], []
        at = 0
        for j in range(world):
            start, own, own_ats = at, [], [0] * len(sizes)
            for i, b in enumerate(bounds):
                lo, hi = b[j]
                ats[i * world + j] = at
                if hi > lo:
                    pieces.append((i, lo, hi, at))
                    own.append((i, 0, hi - lo, at - start))
                    own_ats[i] = at - start
                    at += hi - lo
            self.counts.append(at - start)
            self.owner.append((own, tuple(own_ats), 1))
        self.place = (pieces, tuple(ats), world)


_layouts = {}
_LAYOUTS_MAX = 256
# a group's member keys and its name, per key argument, sizes and dtype (64
# members: 0.5 ms of string formatting per call otherwise)
_keys_cache = {}
_KEYS_CACHE_MAX = 256


def _layout(sizes, world, concat):
    k = (sizes, world, concat)
    lay = _layouts.get(k)
    if lay is None:
        if len(_layouts) >= _LAYOUTS_MAX:
            _layouts.clear()
        lay = _layouts[k] = _Layout(sizes, world, concat)
    return lay


class Group:
    """One grouped call's members and keys (checked by :meth:`adopt`), its
    fused buffer (:meth:`fuse`) and its results (:meth:`scatter`,
    :meth:`shards`)."""

    def __init__(self, kind, bufs, key, recvcounts, out, flat):
        self.kind = kind
        self.given = bufs
        self.keys = None
        self.key = None  # the group's name in the settings' fingerprint
        self.flats = None  # the members, flat, on their side
        self.layout = None
        self._arg_error = None
        if recvcounts is not None:
            self._arg_error = ConfigError("a grouped reduce_scatter takes no recvcounts: "
                                          "each member is cut as numpy.array_split cuts it")
        elif out is not None:
            self._arg_error = ConfigError("a grouped reduce_scatter takes no out=: it "
                                          "returns a new array per member")
        elif not flat:
            self._arg_error = ConfigError("grouped calls are flat: hierarchy='node' takes "
                                          "one array per call ('auto' reduces a group flat)")
        self._key_arg = key
        self._adopted = None  # adopt()'s answer, once it succeeded

    def adopt(self, cs):
        """Check every member as a single call would, and the keys:
        ``(backend, dtype)``; raises on the first bad one. Once it succeeded
        it answers the same at once (the short path adopts a group first,
        :func:`mpigc._shortcall.run_group`; an engine call made of it does
        not check it again)."""
        if self._adopted is not None:
            return self._adopted
        if self._arg_error is not None:
            raise self._arg_error
        bufs = self.given
        if len(bufs) == 0:
            raise InvalidBufferError(f"{self.kind}: expected at least one array in the group, "
                                     "got an empty list")
        be = dtype = None
        flats = []
        writable = self.kind == "allreduce"
        i = 0
        while i < len(bufs):
            if be is not None:
                # the arrays from i on that pass every check of the first
                # member's without a backend of their own (64 host members:
                # 0.7 ms less per call; the backend says which)
                quick = be.quick_members(bufs, i, dtype, writable)
                flats += quick
                i += len(quick)
                if i == len(bufs):
                    break
            b = bufs[i]
            try:
                mbe, dbuf, mdt = _settings.adopt_input(self.kind, b, cs)
            except (DTypeError, InvalidBufferError) as exc:
                raise type(exc)(f"group member {i}: {exc}") from exc
            if be is None:
                be, dtype = mbe, mdt
            elif mbe.side != be.side:
                raise InvalidBufferError(
                    f"{self.kind}: group member {i} is a {mbe.side} array, member 0 a "
                    f"{be.side} one: a group holds arrays of one side")
            elif mdt != dtype:
                raise DTypeError(f"{self.kind}: group member {i} is {mdt}, member 0 {dtype}: "
                                 "a group holds arrays of one dtype (call once per dtype)")
            else:
                be.take_member(mbe)  # (the streams a device member came from)
            flats.append(dbuf.reshape(dbuf.size))
            i += 1
        self.flats = flats
        sizes = tuple([int(f.size) for f in flats])
        k = self._key_arg
        ck = (tuple(k) if isinstance(k, (list, tuple)) else k, type(k), sizes, dtype)
        try:
            hit = _keys_cache.get(ck)
        except TypeError:  # a key that cannot be hashed: refused below
            ck = hit = None
        if hit is None:
            keys = self._member_keys(sizes, dtype)
            # the fingerprint's key: every member's key and size, so ranks
            # whose groups differ anywhere disagree (a mismatch, everywhere)
            hit = keys, "group/%d/%08x" % (len(sizes),
                                           zlib.crc32(repr((keys, sizes)).encode()))
            if ck is not None:
                if len(_keys_cache) >= _KEYS_CACHE_MAX:
                    _keys_cache.clear()
                _keys_cache[ck] = hit
        self.keys, self.key = hit
        self.sizes = sizes
        self._adopted = be, dtype
        return be, dtype

    def _member_keys(self, sizes, dtype):
        k = self._key_arg
        if k is None:
            return [f"auto/group/{i}/{m}/{dtype.name}" for i, m in enumerate(sizes)]
        if isinstance(k, (str, int)) and not isinstance(k, bool):
            return [f"{k}/{i}" for i in range(len(sizes))]
        if isinstance(k, (list, tuple)):
            if len(k) != len(sizes):
                raise ConfigError(f"key: expected one key per member ({len(sizes)}), got "
                                  f"{len(k)}")
            bad = [x for x in k if isinstance(x, bool) or not isinstance(x, (str, int))]
            if bad:
                raise ConfigError(f"key: expected str or int keys, got {bad[0]!r}")
            keys = [str(x) for x in k]
            if len(set(keys)) != len(keys):
                dup = next(x for x in keys if keys.count(x) > 1)
                raise ConfigError(f"key: the members' keys must be distinct ({dup!r} is "
                                  "given twice)")
            return keys
        raise ConfigError("key: expected a str or int (member i gets key/i) or a list of "
                          f"keys, got {type(k).__name__}")

    def offsets(self):
        """Where each member starts in a buffer of the members one after
        another (a plain allreduce's fused buffer, the short path's
        message)."""
        return _layout(self.sizes, 1, True).place[1]

    def counts(self, world):
        """The fused shard sizes (the settings' recvcounts)."""
        return _layout(self.sizes, world, False).counts

    def fuse(self, be, fused, world, concat):
        """The members copied into ``fused`` (the call's fused buffer, of
        their total size: its prepared record's, :mod:`mpigc._prepared`),
        owner-major, or one after another when ``concat``; returns it."""
        self.layout = lay = _layout(self.sizes, world, concat)
        t0 = _timeline.ON and _timeline.now()
        be.place_members(fused, self.flats, lay.place, True)
        if t0:
            _timeline.span("group: members in", t0)
        return fused

    def scatter(self, be, v):
        """An allreduce's result ``v`` (the fused buffer's values) into the members."""
        t0 = _timeline.ON and _timeline.now()
        be.place_members(v, self.flats, self.layout.place, False)
        if t0:
            _timeline.span("group: results out", t0)

    def shards(self, be, v, rank, convert):
        """A reduce-scatter's result: this rank's fused shard ``v`` cut into
        each member's shard (new arrays, by ``convert(piece)``)."""
        out = [None] * len(self.sizes)
        for i, _, m, at in self.layout.owner[rank][0]:
            out[i] = convert(part(v, at, at + m))
        # a member smaller than the ranks has no element on some
        return [be.empty(0, v.dtype) if o is None else o for o in out]

    def owner_place(self, rank):
        """The placement of rank ``rank``'s fused shard (see :class:`_Layout`)."""
        lay = self.layout
        return None if lay.owner is None else lay.owner[rank]
