"""Residual checkpoints: save and load an :class:`ErrorFeedback` store with h5py.

Error feedback only delays what the compressor does not send; dropping the
residuals at a restart loses that part of the gradient for good. A checkpoint
keeps every key's worker and owner residuals, its compressor config, dtype,
size, call count (terngrad's random streams depend on it), the shard layout
and the world size, so that

* a job resumed on the same number of ranks continues bit for bit as if it
  had never stopped, and
* a job resumed on a different number of ranks keeps the total of the
  residuals over the ranks (worker side) and the reduced-shard residuals
  (owner side, re-sharded to the new layout): nothing is lost.

The on-disk format (one directory: a manifest plus one HDF5 file per rank,
committed by an atomic rename of the manifest) is described in
``docs/checkpoint-format.md``. Both functions are collective over the
communicator; an error on any rank is raised on every rank, and a failed
load leaves the store unchanged.

Command line::

    python -m mpigc.checkpoint info PATH      # keys, shapes, configs; verifies checksums

Environment
-----------
``MPIGC_CHECKPOINT_FSYNC``
    ``0`` skips the ``fsync`` calls of a save (faster; a killed process still
    leaves a valid checkpoint, a power loss may not). Default ``1``.
``MPIGC_CHECKPOINT_TEST_KILL``
    For tests only: ``POINT:RANK`` makes ``RANK`` kill itself (SIGKILL) at
    ``POINT`` of a save: ``data`` (after writing the first residual of its
    file), ``manifest`` (rank 0, new manifest written, not yet renamed) or
    ``cleanup`` (rank 0, renamed, old data not yet removed).
"""
import argparse
import datetime
import json
import os
import secrets
import shutil
import signal
import sys
import warnings
import zlib

import numba
import numpy as np
from mpi4py import MPI

from . import _comm, _hierarchy, _jitcache
from ._errors import ConfigError, MismatchError, MpigcError, StateError
from ._version import __version__
from .compressors import config_change_hint, get_compressor
from .feedback import ErrorFeedback, get_default_feedback, new_entry, shard_bounds

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError", "FORMAT_VERSION"]

FORMAT = "mpigc-checkpoint"
RANK_FORMAT = "mpigc-checkpoint-rank"
FORMAT_VERSION = 1
MANIFEST = "manifest.h5"
#: a checkpoint row holding a key's hierarchical residuals (in the flat layout)
HIER_SUFFIX = "@hier"
CHECKSUM = "fletcher64"
BLOCK_WORDS = 1 << 20  # checksum block: 2**20 32-bit words = 4 MiB
_LIBVER = ("v108", "v110")  # superblock v2 / object headers v2: metadata checksums


class CheckpointError(MpigcError, OSError):
    """A checkpoint cannot be written or read: missing, foreign, truncated,
    corrupted (checksum mismatch) or unwritable."""


_CLASSES = {c.__name__: c for c in (CheckpointError, MismatchError, StateError, ConfigError)}


def _h5py():
    try:
        import h5py
    except ImportError as exc:  # pragma: no cover - h5py is a requirement
        raise CheckpointError("checkpoints need h5py: pip install h5py") from exc
    return h5py


# -- checksums -------------------------------------------------------------------
@numba.njit(nogil=True, cache=_jitcache.enabled())
def _fletcher64_kernel(words, block_words, out):  # pragma: no cover - compiled
    # s2 = sum of the running sums = sum (L - i) w_i: written as L*s1 - sum i*w_i,
    # two independent reductions that vectorise (integer arithmetic mod 2**64 is
    # associative, so this is exact, not fastmath). One thread: memory bound.
    for b in range(out.shape[0]):
        blk = words[b * block_words:(b + 1) * block_words]
        s1 = np.uint64(0)
        t = np.uint64(0)
        for i in range(blk.size):
            x = np.uint64(blk[i])
            s1 += x
            t += np.uint64(i) * x
        out[b, 0] = s1
        out[b, 1] = np.uint64(blk.size) * s1 - t


def fletcher64_blocks(arr, block_words=BLOCK_WORDS):
    """Checksums of ``arr``'s bytes, per block of ``block_words`` 32-bit
    little-endian words: an ``(nblocks, 2)`` uint64 array of the Fletcher
    sums ``(sum w_i, sum of the running sums)``, both modulo 2**64."""
    a = np.ascontiguousarray(arr).reshape(-1)
    if a.nbytes % 4:
        raise CheckpointError(f"checksums need a multiple of 4 bytes, got {a.nbytes}")
    words = a.view(np.uint32)
    out = np.empty(((words.size + block_words - 1) // block_words, 2), np.uint64)
    if out.shape[0]:
        _fletcher64_kernel(words, block_words, out)
    return out


# -- collective error handling -----------------------------------------------------
def _agree(comm, exc, what):
    """Raise on every rank if ``exc`` is set on any rank (see _comm.agree)."""
    _comm.agree(comm, exc, what, classes=_CLASSES, default=CheckpointError)


def _test_kill(point, rank):
    spec = os.environ.get("MPIGC_CHECKPOINT_TEST_KILL")
    if spec:
        p, _, r = spec.partition(":")
        if p == point and int(r or 0) == rank:
            os.kill(os.getpid(), signal.SIGKILL)


def _default_fsync():
    return os.environ.get("MPIGC_CHECKPOINT_FSYNC", "1").strip().lower() not in (
        "0", "false", "no", "off")


def _fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- raw positioned I/O --------------------------------------------------------------
def _pwrite_all(fd, arr, offset):
    mv = memoryview(arr).cast("B")
    done = 0
    while done < len(mv):
        k = os.pwrite(fd, mv[done:], offset + done)
        if k <= 0:
            raise CheckpointError(f"short write at offset {offset + done}")
        done += k


def _pread_into(fd, arr, offset, fname):
    mv = memoryview(arr).cast("B")
    done = 0
    while done < len(mv):
        k = os.preadv(fd, [mv[done:]], offset + done)
        if k <= 0:
            raise CheckpointError(f"{fname}: truncated (expected {len(mv)} bytes at offset "
                                  f"{offset}, the file ends after {done})")
        done += k


def _layout_of(e):
    return (e.n, e.dtype.name, json.dumps(e.config, sort_keys=True), int(e.calls))


def _digest(rows):
    """CRC32 of the per-key metadata ``[(key, n, dtype, config_json, calls)]``."""
    return zlib.crc32(json.dumps(rows, separators=(",", ":")).encode())


def _rank_name(r):
    return f"rank-{r:05d}.h5"


# -- save ----------------------------------------------------------------------------
def _write_rank_file(fname, rows, held, token, rank, size, fsync):
    """This rank's residuals into ``fname``. Returns (file size, has_worker,
    has_owner) where the latter are lists of 0/1 per key."""
    h5py = _h5py()
    plan, has_w, has_o = [], [], []
    with h5py.File(fname, "w", libver=_LIBVER) as f:
        f.attrs["format"] = RANK_FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["token"] = token
        f.attrs["rank"] = rank
        f.attrs["world_size"] = size
        f.attrs["nkeys"] = len(rows)
        f.attrs["keys_crc32"] = _digest(rows)
        for i, row in enumerate(rows):
            key = row[0]
            e = held[key]
            g = f.create_group(f"k{i:06d}")
            g.attrs["key"] = key
            for name, arr, flags in (("worker", e.worker, has_w), ("owner", e.owner, has_o)):
                flags.append(0 if arr is None else 1)
                if arr is None:
                    continue
                arr = arr.reshape(-1)
                if not arr.flags.c_contiguous:  # pragma: no cover - entries are contiguous
                    arr = np.ascontiguousarray(arr)
                if arr.nbytes % 4:  # pragma: no cover - work dtypes are float32/64
                    raise CheckpointError(f"key {key!r}: {arr.dtype} is not a work dtype")
                if arr.size == 0:
                    g.create_dataset(name, shape=(0,), dtype=arr.dtype)
                    g.create_dataset(f"{name}_{CHECKSUM}", shape=(0, 2), dtype=np.uint64)
                    continue
                nblocks = -(-arr.nbytes // (4 * BLOCK_WORDS))
                plan.append((arr, _create_raw(h5py, g, name, arr.shape, arr.dtype),
                             _create_raw(h5py, g, f"{name}_{CHECKSUM}", (nblocks, 2),
                                         np.dtype(np.uint64))))
    # The HDF5 structure is complete; the residuals go straight to their extents,
    # block by block, each block checksummed just before it is written (while it
    # is in cache), the checksum table after its array.
    fd = os.open(fname, os.O_WRONLY)
    try:
        for i, (arr, off, sums_off) in enumerate(plan):
            bitems = BLOCK_WORDS * 4 // arr.itemsize
            sums = np.empty((-(-arr.size // bitems), 2), np.uint64)
            for b in range(sums.shape[0]):
                blk = arr[b * bitems:(b + 1) * bitems]
                _fletcher64_kernel(blk.view(np.uint32), BLOCK_WORDS, sums[b:b + 1])
                _pwrite_all(fd, blk, off + b * bitems * arr.itemsize)
            _pwrite_all(fd, sums, sums_off)
            if i == 0:
                _test_kill("data", rank)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    if not plan:
        _test_kill("data", rank)
    return os.path.getsize(fname), has_w, has_o


def _create_raw(h5py, group, name, shape, dtype):
    """A contiguous dataset with its space allocated now; returns its file
    offset (its bytes are written with pwrite after the file is closed)."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    dsid = h5py.h5d.create(group.id, name.encode(), h5py.h5t.py_create(dtype),
                           h5py.h5s.create_simple(tuple(shape)), dcpl=dcpl)
    try:
        return dsid.get_offset()
    finally:
        dsid.close()


def _write_manifest(path, token, rows, size, step, file_nbytes, has_w, has_o,
                    skipped_steps, fsync, extra=None):
    h5py = _h5py()
    tmp = os.path.join(path, f"{MANIFEST}.tmp-{token}")
    vstr = h5py.string_dtype("utf-8")
    meta = _manifest_meta(token, rows, size, step, file_nbytes, has_w, has_o, skipped_steps)
    meta["attrs"].update(extra or {})
    with h5py.File(tmp, "w", libver=_LIBVER) as f:
        for k, v in meta["attrs"].items():
            f.attrs[k] = v
        f.attrs["meta_crc32"] = _meta_crc(meta)
        f.create_dataset("keys", data=np.array([r[0] for r in rows], dtype=object),
                         dtype=vstr)
        f.create_dataset("n", data=np.array([r[1] for r in rows], np.int64))
        f.create_dataset("dtype", data=np.array([r[2] for r in rows], dtype=object),
                         dtype=vstr)
        f.create_dataset("config", data=np.array([r[3] for r in rows], dtype=object),
                         dtype=vstr)
        f.create_dataset("calls", data=np.array([r[4] for r in rows], np.int64))
        f.create_dataset("has_worker", data=np.array(has_w, np.uint8).reshape(len(rows)))
        f.create_dataset("has_owner", data=np.array(has_o, np.uint8).reshape(len(rows)))
        f.create_dataset("file_nbytes", data=np.array(file_nbytes, np.int64))
    if fsync:
        _fsync_path(tmp)
    return tmp


def _manifest_meta(token, rows, size, step, file_nbytes, has_w, has_o, skipped_steps):
    attrs = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "mpigc_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": int(size), "token": token, "data_dir": f"data-{token}",
        "checksum": CHECKSUM, "checksum_block_words": BLOCK_WORDS,
        "keys_crc32": _digest(rows), "skipped_steps": int(skipped_steps),
    }
    if step is not None:
        attrs["step"] = int(step)
    return {"attrs": attrs, "rows": [list(r) for r in rows],
            "has_worker": [int(x) for x in has_w], "has_owner": [int(x) for x in has_o],
            "file_nbytes": [int(x) for x in file_nbytes]}


def _meta_crc(meta):
    m = {"attrs": {k: v for k, v in meta["attrs"].items() if k != "created"},
         **{k: v for k, v in meta.items() if k != "attrs"}}
    return zlib.crc32(json.dumps(m, sort_keys=True, separators=(",", ":")).encode())


def hier_groups(entries):
    """For mpigc's own modules (checkpoints, mpigc.torch's state records):
    ``{(key, L, n): {slice: entry}}``: the hierarchical residuals among
    ``entries`` (``{key: entry}``), grouped by the user's key and layout."""
    hier = {}
    for k, e in entries.items():
        sk = _hierarchy.parse_slice_key(k)
        if sk is not None:
            hier.setdefault((sk[0], sk[2], sk[3]), {})[sk[1]] = e
    return hier


def hier_rows(c, hier):
    """For mpigc's own modules: ``{(key, L, n): (dtype name, config json, calls)}`` of every
    hierarchical key held by any rank (collective), and ``hier`` completed
    with an empty ``{}`` for those this rank holds no slice of (a buffer of
    fewer elements than slices leaves some ranks without one). Raises on
    every rank where the ranks that hold a key disagree on it, or where a key
    has residuals of several layouts."""
    mine = {}
    for (b, L, n), ents in hier.items():
        e = ents[min(ents)]
        mine[(b, L, n)] = (e.dtype.name, json.dumps(e.config, sort_keys=True), int(e.calls))
    rows, exc = {}, None
    for r, theirs in enumerate(c.allgather(mine)):
        for k, v in theirs.items():
            if rows.setdefault(k, v) != v and exc is None:
                exc = MismatchError(f"save_checkpoint: ranks disagree on the hierarchical "
                                    f"residuals of key {k[0]!r} (rank {r}: {v}, another: "
                                    f"{rows[k]})")
    bases = [b for b, _, _ in rows]
    if exc is None and len(set(bases)) < len(bases):
        exc = StateError(f"keys {sorted({b for b in bases if bases.count(b) > 1})} hold "
                         "hierarchical residuals of several layouts (nodes or sizes) "
                         "across the ranks; reset() the stale ones")
    _agree(c, exc, "save_checkpoint")
    for k in rows:
        hier.setdefault(k, {})
    return rows


def hier_to_flat(c, lay, hier, rows, size, rank):
    """``{key@hier: entry}``: each hierarchical key's residuals of this rank
    in the flat layout of the communicator (collective; ``hier`` and ``rows``
    from :func:`hier_rows`; see ``mpigc._hierarchy.to_flat_form``)."""
    flags = []
    for (b, L, n), ents in sorted(hier.items()):
        flags.append([int(any(e.worker is not None for e in ents.values())),
                      int(any(e.owner is not None for e in ents.values()))])
        if L != lay.L or any((e.world_size, e.rank) != (lay.M, lay.node)
                             for e in ents.values()):
            flags[-1].append(1)
    exc = None
    if any(len(f) > 2 for f in flags):
        exc = StateError(f"hierarchical residuals were made on another node layout than "
                         f"this communicator's ({lay.describe()}): save on the "
                         "communicator (and MPIGC_NODE_SPLIT) they were used with")
    _agree(c, exc, "save_checkpoint")
    flags = np.array(flags, np.int64).reshape(-1, 2)
    c.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
    out = {}
    for i, ((b, L, n), ents) in enumerate(sorted(hier.items())):
        dtype, config, calls = rows[(b, L, n)]
        slices = {s: (e.worker, e.owner) for s, e in ents.items()}
        w, o = _hierarchy.to_flat_form(lay, slices, n, np.dtype(dtype), bool(flags[i, 0]),
                                       bool(flags[i, 1]))
        out[b + HIER_SUFFIX] = new_entry(n, dtype, size, rank, json.loads(config), calls,
                                         w, o)
    return out


def check_hierarchy_mode(mode):
    """Raise :class:`ConfigError` unless ``mode`` is a ``hierarchy=`` value
    of the checkpoint functions: a mode, or None ("as saved" for a load,
    "not recorded" for a save)."""
    if mode is not None and mode not in _hierarchy.HIERARCHY_MODES:
        raise ConfigError(f"hierarchy must be one of {_hierarchy.HIERARCHY_MODES} or None, "
                          f"got {mode!r}")


def _same_mode(modes, what):
    """Raise MismatchError (on every rank: ``modes`` is every rank's
    ``hierarchy=``, gathered) unless the ranks passed the same value."""
    if any(m != modes[0] for m in modes):
        raise MismatchError(f"{what}: ranks pass different hierarchy= (" + ", ".join(
            f"rank {r}: {m!r}" for r, m in enumerate(modes)) + "); it must be the same "
            "on every rank")


def _auto_is_hierarchical(nodes, node_sizes):
    """Whether ``hierarchy="auto"`` is hierarchical on a layout of ``nodes``
    nodes of ``node_sizes`` ranks (as ``Layout.hierarchical("auto")``)."""
    return nodes > 1 and max(node_sizes, default=0) > 1


def _saved_layout(meta):
    """``(nodes, node_sizes)`` of the saving communicator's layout, recorded
    in the manifest (attribute ``hierarchy``) by a save that holds
    hierarchical rows or records ``hierarchy_mode="auto"``; None when absent."""
    a = meta["attrs"]
    if "hierarchy" not in a:
        return None
    try:
        saved = json.loads(a["hierarchy"])
        return int(saved["nodes"]), [int(x) for x in saved["node_sizes"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{meta.get('path')}: the node layout of its hierarchical "
                              f"rows (manifest attribute hierarchy) is unreadable: "
                              f"{exc!r}") from exc


def _saved_hierarchy(meta, comm, skip=()):
    """The ``hierarchy=`` mode that :func:`load_checkpoint` installs the
    hierarchical rows (``key@hier``) of the checkpoint ``meta`` (a manifest)
    for by default, on ``comm`` (collective where it must look at the node
    layout; the same on every rank). Flat rows stay flat by default whatever
    this mode is.

    1. The mode recorded by ``save_checkpoint(..., hierarchy=)``, if any.
    2. ``"flat"`` when no row (other than those of ``skip``) is hierarchical.
    3. ``"node"`` when the saving layout is not hierarchical under
       ``"auto"`` (one node, or one rank per node): only ``"node"`` made
       hierarchical residuals there.
    4. ``"auto"`` when the loading layout is hierarchical under ``"auto"``
       (``"auto"`` and ``"node"`` install the same residuals there).

    Otherwise ``"auto"`` and ``"node"`` would install the residuals
    differently (flat and hierarchical) and nothing says which the
    collectives will use: ConfigError (the caller raises it on every rank).
    """
    a = meta["attrs"]
    mode = a.get("hierarchy_mode")
    if mode is not None:
        if mode not in _hierarchy.HIERARCHY_MODES:
            raise CheckpointError(f"{meta.get('path')}: unknown hierarchy_mode {mode!r}")
        return mode
    hier = sorted(r[0][:-len(HIER_SUFFIX)] for r in meta["rows"]
                  if r[0].endswith(HIER_SUFFIX) and r[0] not in skip)
    saved = _saved_layout(meta)
    if not hier or saved is None:  # a save records the layout of any it holds
        return "flat"
    nodes, sizes = saved
    if not _auto_is_hierarchical(nodes, sizes):
        return "node"
    lay = _hierarchy.layout(comm)
    if lay.hierarchical("auto"):
        return "auto"
    raise ConfigError(
        f"the checkpoint holds hierarchical residuals of key(s) {hier}, saved on "
        f"{nodes} nodes of {sizes} ranks; on this communicator's layout "
        f"({lay.M} node(s) of {list(lay.node_sizes)} ranks) hierarchy='auto' would use "
        "them flat and hierarchy='node' hierarchical, and the checkpoint does not say "
        "which: pass load_checkpoint(..., hierarchy=) (load_training_state(..., "
        "hierarchy=)) the value the collectives are called with")


def _is_hierarchical(comm, mode):
    """Whether a call with ``hierarchy=mode`` on ``comm`` is hierarchical
    (collective on the layout's first use)."""
    return mode != "flat" and _hierarchy.layout(comm).hierarchical(mode)


def _installed_forms(comm, rows, hierarchy, mode):
    """``{row: True where it is installed as hierarchical residuals}`` for
    the checkpoint rows ``rows`` (a key, or ``key@hier``) loaded on ``comm``
    (collective where it looks at the node layout; the same on every rank).

    With ``hierarchy=`` given, every row takes the form a call with that
    ``hierarchy=`` takes on ``comm``. Without it (``hierarchy`` None), each
    row keeps the form it was saved in: a flat row stays flat, a
    hierarchical row is installed hierarchical where ``mode`` (from
    :func:`_saved_hierarchy`) is hierarchical on ``comm``, flat otherwise
    (the collectives called with ``mode`` are flat there)."""
    if hierarchy is not None:
        on = bool(rows) and _is_hierarchical(comm, hierarchy)
        return dict.fromkeys(rows, on)
    hier = [k for k in rows if k.endswith(HIER_SUFFIX)]
    on = bool(hier) and _is_hierarchical(comm, mode)
    return {k: on and k.endswith(HIER_SUFFIX) for k in rows}


def _unread_flat_rows(meta, comm, rows, forms):
    """A warning (or None) for a load without ``hierarchy=`` where the flat
    rows may not be the keys the collectives read: the checkpoint records
    ``hierarchy="auto"``, its saving layout is not hierarchical under it (or
    not recorded), and this one is. A key of single calls saved there is flat
    and is hierarchical here; a key of grouped calls stays flat under
    ``"auto"``. The checkpoint cannot tell them apart; flat rows stay flat."""
    if meta["attrs"].get("hierarchy_mode") != "auto":
        return None
    flat = sorted(k for k in rows if not forms[k] and not k.endswith(HIER_SUFFIX))
    saved = _saved_layout(meta)
    if not flat or (saved is not None and _auto_is_hierarchical(*saved)):
        return None
    if not _is_hierarchical(comm, "auto"):
        return None
    where = "on a layout it did not record" if saved is None else \
        f"on {saved[0]} node(s) of {saved[1]} ranks"
    return (f"load_checkpoint: the checkpoint records hierarchy='auto', flat where it was "
            f"saved ({where}) and hierarchical here; its flat key(s) {flat} are installed "
            "flat, as saved, which single calls with hierarchy='auto' no longer read here "
            "(grouped calls do): pass hierarchy='auto' to install every key hierarchical")


def to_layout(c, comm, entries, mode, hierarchical=None):
    """For mpigc's own modules: the loaded entries (``{row: entry}`` in the
    flat layout; a row is a key, or ``key@hier`` for hierarchical residuals)
    installed on ``comm`` (collective): hierarchical residuals of its node
    layout (keys ``key@hier[...]``) for the rows where ``hierarchical``
    (``{row: bool}``, the same on every rank) is true, flat ones (``key``)
    for the others. Without ``hierarchical``, every row takes the form a call
    with ``hierarchy=mode`` takes on ``comm``. Raises CheckpointError where
    two rows of one key would be installed as one."""
    if hierarchical is None:
        on = _is_hierarchical(comm, mode)
        hierarchical = dict.fromkeys(entries, on)
    targets = {}
    for k in entries:
        b = k[:-len(HIER_SUFFIX)] if k.endswith(HIER_SUFFIX) else k
        targets.setdefault((b, bool(hierarchical[k])), []).append(k)
    clash = sorted(b for (b, _), ks in targets.items() if len(ks) > 1)
    if clash:  # the same on every rank (from the manifest)
        raise CheckpointError(f"key(s) {clash} hold both flat and hierarchical residuals, "
                              "which this load would install in one form: load without "
                              "hierarchy= (each row in the form it was saved in), or with "
                              "strict=False and configs= naming one of them")
    out = {}
    hier = []
    for (b, on), ks in sorted(targets.items()):
        if on:
            hier.append((b, ks[0]))
        else:
            out[b] = entries[ks[0]]
    if not hier:
        return out
    lay = _hierarchy.layout(comm)
    # a rank may hold no worker residual after resharding (fewer old ranks than
    # new): the decisions below must be the same on every rank
    flags = np.array([[int(entries[k].worker is not None), int(entries[k].owner is not None)]
                      for _, k in hier], np.int64).reshape(-1, 2)
    c.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
    for i, (b, k) in enumerate(hier):
        e = entries[k]
        w, o = e.worker, e.owner
        if flags[i, 0] and w is None:
            w = np.zeros(e.n, e.dtype)
        if flags[i, 1] and o is None:
            lo, hi = shard_bounds(e.n, lay.size)[lay.rank]
            o = np.zeros(hi - lo, e.dtype)
        parts = _hierarchy.from_flat_form(lay, w, o, e.n, e.dtype)
        for s, (w, o) in parts.items():
            lo, hi = shard_bounds(e.n, lay.L)[s]
            out[_hierarchy.slice_key(b, s, lay.L, e.n)] = new_entry(
                hi - lo, e.dtype, lay.M, lay.node, dict(e.config), e.calls, w, o)
    return out


def save_checkpoint(path, feedback=None, comm=None, step=None, *, fsync=None,
                    hierarchy=None):
    """Save the residuals of ``feedback`` to the checkpoint ``path`` (collective).

    Every rank writes its own residuals to its own HDF5 file (in parallel,
    memory O(own residuals), no copies); rank 0 then commits the new
    checkpoint by atomically renaming its manifest into place, and removes
    the previous one. A save killed at any point leaves the previous
    checkpoint at ``path`` valid.

    Parameters
    ----------
    path : str or os.PathLike
        A directory (created if missing) on a file system every rank sees.
    feedback : ErrorFeedback, optional
        Default: the process-wide store.
    comm : mpi4py.MPI.Intracomm, optional
        Default ``MPI.COMM_WORLD``; every key must have been used on a
        communicator of this size (the rank must match too).
    step : int, optional
        Stored as is; :func:`load_checkpoint` returns it.
    fsync : bool, optional
        Flush files and directories to stable storage (default: true, or
        ``$MPIGC_CHECKPOINT_FSYNC``).
    hierarchy : {"flat", "auto", "node"}, optional
        The ``hierarchy=`` the collectives were called with on ``comm``.
        Recorded in the manifest (attribute ``hierarchy_mode``; with
        ``"auto"``, the node layout too), so that :func:`load_checkpoint`
        installs the hierarchical residuals for the same mode by default on
        a layout where it differs (flat keys stay flat). Default: not
        recorded.

    Returns
    -------
    str
        ``path``.

    Raises
    ------
    StateError
        On every rank, when a key is in use by a pending collective or was
        used on another communicator.
    MismatchError
        When ranks hold different keys (or configs, sizes, call counts), or
        pass different ``hierarchy=``.
    ConfigError
        On every rank, for a ``hierarchy`` that is not one of the modes.
    CheckpointError
        When a file cannot be written; the previous checkpoint is kept.
    """
    cs = _comm.resolve(comm)
    c, size, rank = cs.comm, cs.size, cs.rank
    fb = get_default_feedback() if feedback is None else feedback
    path = os.fspath(path)
    fsync = _default_fsync() if fsync is None else bool(fsync)
    txn, held, exc, rows = None, None, None, []
    try:
        if not isinstance(fb, ErrorFeedback):
            raise StateError(f"feedback: expected an ErrorFeedback, got {type(fb).__name__}")
        if step is not None and (isinstance(step, bool) or not isinstance(
                step, (int, np.integer))):
            raise ConfigError(f"step: expected an int or None, got {step!r}")
        check_hierarchy_mode(hierarchy)
        txn = fb.transaction()  # holds every key while the save reads them
        held = txn.hold_all()
        hier = hier_groups(held)
        for key in sorted(held):
            e = held[key]
            if _hierarchy.parse_slice_key(key) is not None:
                continue
            if (e.world_size, e.rank) != (size, rank):
                raise StateError(
                    f"key {key!r} holds residuals of rank {e.rank} of {e.world_size}, but "
                    f"this is rank {rank} of {size}: save with the communicator the key "
                    "was used on")
            rows.append((key, *_layout_of(e)))
        for b, _, _ in hier:  # several layouts of one key: hier_rows, on every rank
            if b + HIER_SUFFIX in held:
                raise StateError(f"key {b!r} clashes with the row of its hierarchical "
                                 f"residuals ({b + HIER_SUFFIX!r} is a key too)")
    except Exception as e:  # noqa: BLE001 - raised collectively
        exc = e
    token, datadir, committed = None, None, False
    extra = {}
    try:
        _agree(c, exc, "save_checkpoint")
        hrows = hier_rows(c, hier)
        for (b, L, n), (dtype, config, calls) in sorted(hrows.items()):
            rows.append((b + HIER_SUFFIX, n, dtype, config, calls))
        digests = c.allgather((_digest(rows), len(rows), hierarchy))
        if any(d[:2] != digests[0][:2] for d in digests):
            detail = ", ".join(f"rank {r}: {n} key(s), crc {d:08x}"
                               for r, (d, n, _) in enumerate(digests))
            raise MismatchError(f"save_checkpoint: ranks hold different keys, configs, sizes "
                                f"or call counts ({detail})")
        _same_mode([d[2] for d in digests], "save_checkpoint")
        if hierarchy is not None:
            extra["hierarchy_mode"] = hierarchy
        if any(r[0].endswith(HIER_SUFFIX) for r in rows):
            # every rank has the same rows: the hierarchical residuals go to the
            # flat layout (collective), with the node layout recorded
            lay = _hierarchy.layout(comm)
            held.update(hier_to_flat(c, lay, hier, hrows, size, rank))
            extra["hierarchy"] = json.dumps(lay.describe(), sort_keys=True)
        elif hierarchy == "auto":
            # whether "auto" was hierarchical here: a load on a layout where it
            # is says when the flat rows may be keys it reads hierarchical
            extra["hierarchy"] = json.dumps(_hierarchy.layout(comm).describe(),
                                            sort_keys=True)
        # rank 0 makes the directory for this save's data
        exc = None
        if rank == 0:
            try:
                if os.path.exists(path) and not os.path.isdir(path):
                    raise CheckpointError(f"{path}: exists and is not a directory; a "
                                          "checkpoint is a directory")
                os.makedirs(path, exist_ok=True)
                token = secrets.token_hex(8)
                os.mkdir(os.path.join(path, f"data-{token}"))
            except Exception as e:  # noqa: BLE001
                exc = e
        _agree(c, exc, "save_checkpoint")
        token = c.bcast(token, root=0)
        datadir = os.path.join(path, f"data-{token}")
        # every rank writes its file
        exc, res = None, None
        try:
            if not os.path.isdir(datadir):
                raise CheckpointError(f"{datadir} is not visible on this rank: the "
                                      "checkpoint must be on a file system all ranks share")
            res = _write_rank_file(os.path.join(datadir, _rank_name(rank)), rows, held,
                                   token, rank, size, fsync)
        except Exception as e:  # noqa: BLE001
            exc = e
        _agree(c, exc, "save_checkpoint")
        res = c.gather(res, root=0)
        # rank 0 commits: manifest written, flushed, renamed into place
        exc = None
        if rank == 0:
            try:
                if fsync:
                    _fsync_path(datadir)
                nb = [r[0] for r in res]
                hw = [max(r[1][i] for r in res) for i in range(len(rows))]
                ho = [max(r[2][i] for r in res) for i in range(len(rows))]
                tmp = _write_manifest(path, token, rows, size, step, nb, hw, ho,
                                      fb.skipped_steps, fsync, extra)
                _test_kill("manifest", rank)
                os.replace(tmp, os.path.join(path, MANIFEST))
                committed = True
                if fsync:
                    _fsync_path(path)
                _test_kill("cleanup", rank)
                _remove_stale(path, token)
            except Exception as e:  # noqa: BLE001
                exc = e
        _agree(c, exc, "save_checkpoint")
    except BaseException:
        if rank == 0 and datadir is not None and not committed:
            shutil.rmtree(datadir, ignore_errors=True)
            tmp = os.path.join(path, f"{MANIFEST}.tmp-{token}")
            if os.path.exists(tmp):
                os.unlink(tmp)
        raise
    finally:
        if txn is not None:
            txn.end()
    return path


def _remove_stale(path, token):
    """Remove data directories and manifest temporaries other than ``token``'s
    (the previous checkpoint, and what killed saves left behind)."""
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if name.startswith("data-") and name != f"data-{token}" and os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)
        elif name.startswith(f"{MANIFEST}.tmp-"):
            try:
                os.unlink(full)
            except OSError:
                pass


# -- reading -------------------------------------------------------------------------
def _read_manifest(path):
    """The manifest as a dict (what rank 0 broadcasts); CheckpointError if
    ``path`` is not a readable mpigc checkpoint."""
    h5py = _h5py()
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such checkpoint")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not an mpigc checkpoint (expected a directory "
                              f"holding {MANIFEST}, got a file)")
    mf = os.path.join(path, MANIFEST)
    if not os.path.isfile(mf):
        raise CheckpointError(f"{path}: not an mpigc checkpoint, or its first save did not "
                              f"complete ({MANIFEST} is missing)")
    try:
        with h5py.File(mf, "r") as f:
            attrs = {k: _py(v) for k, v in f.attrs.items()}
            if attrs.get("format") != FORMAT:
                raise CheckpointError(f"{mf}: not an mpigc checkpoint manifest (format "
                                      f"{attrs.get('format')!r}, expected {FORMAT!r})")
            ver = attrs.get("format_version")
            if not isinstance(ver, int) or ver > FORMAT_VERSION or ver < 1:
                raise CheckpointError(f"{mf}: format version {ver!r}; this mpigc "
                                      f"({__version__}) reads versions 1 to {FORMAT_VERSION}")
            keys = [_py(k) for k in f["keys"][()]]
            cols = {name: f[name][()] for name in ("n", "calls", "has_worker", "has_owner",
                                                   "file_nbytes")}
            dts = [_py(x) for x in f["dtype"][()]]
            cfgs = [_py(x) for x in f["config"][()]]
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - h5py raises OSError, KeyError, ...
        raise CheckpointError(f"{mf}: unreadable manifest (corrupted, truncated or "
                              f"foreign): {exc}") from exc
    stored_crc = attrs.pop("meta_crc32", None)
    if attrs.get("checksum") != CHECKSUM or not isinstance(
            attrs.get("checksum_block_words"), int) or attrs["checksum_block_words"] <= 0:
        raise CheckpointError(f"{mf}: unknown checksum {attrs.get('checksum')!r} / block "
                              f"{attrs.get('checksum_block_words')!r}")
    ddir = attrs.get("data_dir")
    if not isinstance(ddir, str) or not ddir.startswith("data-") or os.sep in ddir:
        raise CheckpointError(f"{mf}: bad data_dir attribute {ddir!r}")
    rows = [[k, int(n), d, cfg, int(cl)]
            for k, n, d, cfg, cl in zip(keys, cols["n"], dts, cfgs, cols["calls"])]
    meta = {"attrs": attrs, "rows": rows,
            "has_worker": [int(x) for x in cols["has_worker"]],
            "has_owner": [int(x) for x in cols["has_owner"]],
            "file_nbytes": [int(x) for x in cols["file_nbytes"]]}
    if stored_crc != _meta_crc(meta):
        raise CheckpointError(f"{mf}: manifest checksum mismatch (corrupted)")
    meta["path"] = path
    meta["datadir"] = os.path.join(path, attrs["data_dir"])
    return meta


def _py(v):
    if isinstance(v, bytes):
        return v.decode("utf-8")
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        return float(v)
    if isinstance(v, np.ndarray):
        return v.tolist()
    return v


class _RankFile:
    """One old rank's file, opened for reading (HDF5 for the structure, a
    plain descriptor for the residuals)."""

    def __init__(self, meta, r):
        h5py = _h5py()
        self.fname = os.path.join(meta["datadir"], _rank_name(r))
        if not os.path.isfile(self.fname):
            raise CheckpointError(f"{self.fname}: missing (checkpoint incomplete)")
        nbytes = os.path.getsize(self.fname)
        if nbytes != meta["file_nbytes"][r]:
            raise CheckpointError(f"{self.fname}: {nbytes} bytes, the manifest says "
                                  f"{meta['file_nbytes'][r]} (truncated or modified)")
        try:
            self.f = h5py.File(self.fname, "r")
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"{self.fname}: unreadable (corrupted): {exc}") from exc
        a = self.f.attrs
        want = {"format": RANK_FORMAT, "token": meta["attrs"]["token"], "rank": r,
                "world_size": meta["attrs"]["world_size"],
                "keys_crc32": meta["attrs"]["keys_crc32"]}
        for k, v in want.items():
            got = _py(a.get(k))
            if got != v:
                self.close()
                raise CheckpointError(f"{self.fname}: attribute {k} is {got!r}, expected "
                                      f"{v!r} (foreign or mixed-up file)")
        self.fd = os.open(self.fname, os.O_RDONLY)
        self.scratch = None
        self.block_words = meta["attrs"]["checksum_block_words"]

    def close(self):
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None
        self.f.close()

    def dataset(self, i, name, dtype, n):
        """``(offset, checksums)`` of residual ``name`` of key ``i``, or None
        if this rank had none."""
        g = self.f.get(f"k{i:06d}")
        if g is None:
            raise CheckpointError(f"{self.fname}: group k{i:06d} is missing")
        if name not in g:
            return None
        ds = g[name]
        if ds.dtype != dtype or ds.shape != (n,):
            raise CheckpointError(f"{self.fname}: k{i:06d}/{name} holds {ds.shape} "
                                  f"{ds.dtype}, expected ({n},) {dtype}")
        sums = g[f"{name}_{CHECKSUM}"][()]
        off = ds.id.get_offset() if n else 0
        if n and off is None:
            raise CheckpointError(f"{self.fname}: k{i:06d}/{name} has no data")
        return off, sums

    def _check(self, got, want, i, name, block):
        if not np.array_equal(got, want):
            raise CheckpointError(f"{self.fname}: checksum mismatch in k{i:06d}/{name} "
                                  f"(block {block} of {self.block_words * 4} bytes): the data "
                                  "is corrupted")

    def read(self, i, name, dtype, n, lo, hi, out, add):
        """Residual ``name`` of key ``i``, elements [lo, hi), into ``out``
        (added to it when ``add``); verifies the checksum of every block
        read. Returns False if this rank had no such residual."""
        found = self.dataset(i, name, dtype, n)
        if found is None:
            return False
        off, sums = found
        item = dtype.itemsize
        bitems = self.block_words * 4 // item
        if sums.shape != ((n + bitems - 1) // bitems, 2):
            raise CheckpointError(f"{self.fname}: k{i:06d}/{name}: checksum table has shape "
                                  f"{sums.shape}, expected ({(n + bitems - 1) // bitems}, 2)")
        if self.scratch is None:
            self.scratch = np.empty(self.block_words * 4, np.uint8)
        got = np.empty((1, 2), np.uint64)
        for b in range(lo // bitems, (hi + bitems - 1) // bitems):
            blo, bhi = b * bitems, min(n, (b + 1) * bitems)
            direct = not add and lo <= blo and bhi <= hi
            # a whole block goes straight to its place, else through the scratch block
            blk = out[blo - lo:bhi - lo] if direct else \
                self.scratch[:(bhi - blo) * item].view(dtype)
            _pread_into(self.fd, blk, off + blo * item, self.fname)
            _fletcher64_kernel(blk.view(np.uint32), self.block_words, got)  # in cache
            self._check(got, sums[b:b + 1], i, name, b)
            if not direct:
                a, z = max(lo, blo), min(hi, bhi)
                dst = out[a - lo:z - lo]
                if add:
                    dst += blk[a - blo:z - blo]
                else:
                    dst[...] = blk[a - blo:z - blo]
        return True


def worker_sources(old_size, new_size, new_rank):
    """Old ranks whose worker residuals new rank ``new_rank`` receives
    (summed): those congruent to it modulo ``new_size``. Each old rank goes to
    exactly one new rank, so the total over ranks is kept."""
    return list(range(new_rank, old_size, new_size))


def owner_sources(n, old_size, new_size, new_rank):
    """``[(old_rank, lo, hi)]``: the global element ranges of new rank
    ``new_rank``'s owner shard held by each old owner."""
    nlo, nhi = shard_bounds(n, new_size)[new_rank]
    out = []
    for r, (olo, ohi) in enumerate(shard_bounds(n, old_size)):
        a, z = max(nlo, olo), min(nhi, ohi)
        if z > a:
            out.append((r, a, z))
    return out


def _read_entries(meta, skip, new_size, new_rank):
    """This rank's new entries ``{key: entry}`` (memory: its own residuals
    plus one 4 MiB block)."""
    old_size = meta["attrs"]["world_size"]
    files = {}

    def rf(r):
        if r not in files:
            files[r] = _RankFile(meta, r)
        return files[r]

    entries = {}
    try:
        for i, (key, n, dname, cfg, calls) in enumerate(meta["rows"]):
            if key in skip:
                continue
            dtype = np.dtype(dname)
            worker = owner = None
            if meta["has_worker"][i]:
                w, got = None, False
                for r in worker_sources(old_size, new_size, new_rank):
                    if w is None:
                        w = np.empty(n, dtype)
                    got |= rf(r).read(i, "worker", dtype, n, 0, n, w, add=got)
                worker = w if got else None
            if meta["has_owner"][i]:
                nlo, nhi = shard_bounds(n, new_size)[new_rank]
                o, got = None, False
                for r, a, z in owner_sources(n, old_size, new_size, new_rank):
                    olo, ohi = shard_bounds(n, old_size)[r]
                    if o is None:
                        o = np.zeros(nhi - nlo, dtype)
                    got |= rf(r).read(i, "owner", dtype, ohi - olo, a - olo, z - olo,
                                      o[a - nlo:z - nlo], add=False)
                owner = o if got else None
            entries[key] = new_entry(n, dtype, new_size, new_rank, json.loads(cfg), calls,
                                     worker, owner)
    finally:
        for f in files.values():
            f.close()
    return entries


def _normal_config(cfg):
    return get_compressor(dict(cfg) if isinstance(cfg, dict) else cfg).get_config()


def _hint(saved, used):
    """``" (" + what to do + ")"`` where residuals saved under config ``saved``
    meet ``used`` because ``"2bit"`` changed meaning, else ``""``."""
    text = config_change_hint(saved, used)
    return f" ({text})" if text else ""


def _mismatches(meta, fb, configs):
    """``{key: reason}`` for the checkpoint's keys that do not fit what is in
    use: ``configs[key]`` if given, else the store's live entries of the key.
    A key is the user's key for both forms: a hierarchical row (``key@hier``)
    is checked against ``configs[key]`` and the live slice entries
    (``key@hier[s/L:n]``, whose buffer size is ``n``) as well as a flat one."""
    live = {}
    for k, e in fb.entries().items():
        sk = _hierarchy.parse_slice_key(k)
        base, n = (k, e.n) if sk is None else (sk[0], sk[3])
        live.setdefault(base, []).append((n, e.dtype.name, dict(e.config)))
    expected = {}
    if configs is not None:
        if not hasattr(configs, "items"):
            raise ConfigError(f"configs: expected a mapping key -> compressor, got "
                              f"{type(configs).__name__}")
        expected = {str(k): _normal_config(v) for k, v in configs.items()}
    out = {}
    for key, n, dname, cfg, _ in meta["rows"]:
        base = key[:-len(HIER_SUFFIX)] if key.endswith(HIER_SUFFIX) else key
        try:
            saved = _normal_config(json.loads(cfg))
        except MpigcError as exc:
            out[key] = f"the saved config {cfg} is not usable here ({exc})"
            continue
        want = expected.get(key, expected.get(base))
        if want is not None:
            if want != saved:
                out[key] = f"saved {json.dumps(saved, sort_keys=True)}, configs= gives " \
                           f"{json.dumps(want, sort_keys=True)}" + _hint(saved, want)
            continue
        for ln, ld, lc in live.get(base, ()):
            if (ln, ld) != (n, dname):
                out[key] = f"saved {n} values of {dname}, in use {ln} values of {ld}"
            elif _normal_config(lc) != saved:
                out[key] = f"saved {json.dumps(saved, sort_keys=True)}, in use " \
                           f"{json.dumps(_normal_config(lc), sort_keys=True)}" \
                           + _hint(saved, _normal_config(lc))
            if key in out:
                break
    return out


def _check_step(meta, step):
    """ConfigError for a ``step`` that is not an int; MismatchError where the
    checkpoint (its manifest ``meta``) was not saved with ``step``."""
    if step is None:
        return
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise ConfigError(f"load_checkpoint: step: expected an int or None, got {step!r}")
    saved = meta["attrs"].get("step")
    if saved is None:
        raise MismatchError(f"load_checkpoint: {meta.get('path')}: step={int(step)} expected, "
                            "but the checkpoint records no step (save it with "
                            "save_checkpoint(..., step=)); nothing loaded")
    if int(saved) != int(step):
        raise MismatchError(f"load_checkpoint: {meta.get('path')}: saved at step {int(saved)}, "
                            f"step={int(step)} expected (residuals of another save than the "
                            "model's, e.g. a job killed between its two saves); nothing loaded")


def load_checkpoint(path, feedback=None, comm=None, strict=True, *, configs=None,
                    hierarchy=None, step=None):
    """Load the checkpoint ``path`` into ``feedback`` (collective).

    The store's content is replaced by the checkpoint's. On the world size
    it was saved with, every rank gets back exactly its residuals (the steps
    that follow are bit-identical to an uninterrupted run). On another world
    size M, new rank j receives the sum of the worker residuals of the old
    ranks i with ``i % M == j`` (so their total over ranks is kept), and the
    owner residuals are re-sharded to the new layout
    (``numpy.array_split`` of the elements over M ranks).

    Parameters
    ----------
    path : str or os.PathLike
        A checkpoint written by :func:`save_checkpoint`.
    feedback : ErrorFeedback, optional
        Default: the process-wide store.
    comm : mpi4py.MPI.Intracomm, optional
        Default ``MPI.COMM_WORLD``; any size.
    strict : bool
        A key whose saved compressor config (or size, dtype) differs from the
        one in use raises :class:`MismatchError` on every rank (default).
        With ``strict=False`` such keys are re-initialised (no residuals,
        call count 0) with a warning.
    configs : mapping, optional
        ``{key: compressor}`` (id, dict or Compressor) the keys will be used
        with. Without it, a key is compared with the store's live entry of
        that key, if any (so a fresh store accepts any checkpoint).
    hierarchy : {"flat", "auto", "node"}, optional
        Default (None): every key is installed in the form it was saved in,
        key by key, at any world size: a flat key (a row ``key``: flat
        calls, grouped calls) as a flat key, a hierarchical one (a row
        ``key@hier``) as hierarchical residuals of ``comm``'s node layout
        (worker residuals summed per node and slice, owner residuals moved
        to the group owners). A key saved in both forms keeps both. The
        hierarchical rows follow the mode that made them, where
        the layout changes what it does: the mode recorded by
        ``save_checkpoint(..., hierarchy=)``; without one, ``"node"`` when
        the saving layout is not hierarchical under ``"auto"``, ``"auto"``
        (the same as ``"node"`` there) when the loading layout is
        hierarchical under ``"auto"``, and otherwise :class:`ConfigError` on
        every rank asks for ``hierarchy=`` (hierarchical residuals are never
        left unused). Where that mode is flat on ``comm`` (``"flat"``
        recorded, or ``"auto"`` on one node), they are installed flat.
        Flat keys stay flat even where a recorded ``"auto"`` was flat on
        the saving layout and is hierarchical here (a key of single calls,
        hierarchical here, cannot be told from one of grouped calls, flat
        under ``"auto"``): a ``UserWarning`` says so.

        Given, it is the ``hierarchy=`` the collectives will be called with
        on ``comm``, and every key, flat or hierarchical when saved, on any
        node layout, is installed in the form a (single) call with it takes
        on ``comm``: hierarchical residuals of this layout where it is
        hierarchical, flat ones otherwise. The totals are kept either way.
        Keys used with other modes, or in grouped calls (which
        ``"auto"`` reduces flat), are loaded without ``hierarchy=``.
    step : int, optional
        The step the caller resumes from (e.g. the one recorded in its
        model file): the checkpoint must have been saved with
        ``save_checkpoint(..., step=step)``, otherwise (another step, or
        none recorded) :class:`MismatchError` on every rank, before
        anything is installed. This catches residuals of an earlier save
        paired with a later model (a job killed between its two saves).
        Default (None): no check.

    Returns
    -------
    dict
        ``{"step", "world_size" (saved), "keys" (the checkpoint's rows),
        "reinitialised", "forms" ({row: "flat" or "hierarchical"}: how each
        row that was loaded is installed), "hierarchy" (the ``hierarchy=``
        given, or the mode the hierarchical rows were installed for),
        "mpigc_version", "format_version"}``.

    Raises
    ------
    CheckpointError
        On every rank, for a missing, foreign, truncated or corrupted
        checkpoint, or a key whose flat and hierarchical rows this load
        would install in one form; the store is unchanged.
    MismatchError
        On every rank, for a config mismatch with ``strict=True``, when
        the ranks pass different ``hierarchy=``, or for a ``step`` the
        checkpoint was not saved with; the store is unchanged.
    ConfigError
        On every rank, for a ``step`` that is not an int, for a
        ``hierarchy`` that is not a mode, or none given
        where the checkpoint cannot say which (see ``hierarchy``).
    StateError
        On every rank, when a key of the store is in use by a pending
        collective on any rank; every rank's store is unchanged.
    """
    cs = _comm.resolve(comm)
    c, size, rank = cs.comm, cs.size, cs.rank
    fb = get_default_feedback() if feedback is None else feedback
    exc = None
    if not isinstance(fb, ErrorFeedback):
        exc = StateError(f"feedback: expected an ErrorFeedback, got {type(fb).__name__}")
    meta = _comm.on_root(c, lambda: _read_manifest(path), "load_checkpoint", exc=exc,
                         classes=_CLASSES, default=CheckpointError)
    exc, mism = None, {}
    try:
        _check_step(meta, step)
        mism = _mismatches(meta, fb, configs)
    except Exception as e:  # noqa: BLE001
        exc = e
    _agree(c, exc, "load_checkpoint")
    union, modes = {}, []
    for part, mode in c.allgather((sorted(mism.items()), hierarchy)):
        union.update(part)
        modes.append(mode)
    _same_mode(modes, "load_checkpoint")
    if union:
        detail = "; ".join(f"{k!r}: {v}" for k, v in sorted(union.items()))
        if strict:
            raise MismatchError(f"load_checkpoint: {len(union)} key(s) do not match the "
                                f"compressors in use ({detail}); pass strict=False to "
                                "re-initialise them")
        warnings.warn(f"load_checkpoint: re-initialising {len(union)} key(s) whose saved "
                      f"config does not match ({detail})", stacklevel=2)
    exc, entries, forms, mode, note = None, None, None, hierarchy, None
    try:
        check_hierarchy_mode(hierarchy)
        rows = [r[0] for r in meta["rows"] if r[0] not in union]
        if hierarchy is None:  # decided from the manifest: the same on every rank
            mode = _saved_hierarchy(meta, comm, union)
        forms = _installed_forms(comm, rows, hierarchy, mode)
        if hierarchy is None:
            note = _unread_flat_rows(meta, comm, rows, forms)
        entries = _read_entries(meta, union, size, rank)
    except Exception as e:  # noqa: BLE001
        exc = e if isinstance(e, MpigcError) else CheckpointError(f"{type(e).__name__}: {e}")
    _agree(c, exc, "load_checkpoint")
    entries = to_layout(c, comm, entries, mode, forms)
    # the install is a transaction (mpigc._residual_txn): it holds the keys until
    # every rank has installed, and is undone where another rank could not
    exc, txn = None, fb.transaction()
    try:
        txn.install(entries, skipped_steps=meta["attrs"].get("skipped_steps", 0))
    except Exception as e:  # noqa: BLE001
        exc = e
    try:
        _agree(c, exc, "load_checkpoint")
    except BaseException:
        if txn.held:
            txn.restore()
        raise
    finally:
        txn.end()
    if note is not None:
        warnings.warn(note, stacklevel=2)
    a = meta["attrs"]
    return {"step": a.get("step"), "world_size": a["world_size"],
            "keys": [r[0] for r in meta["rows"]], "reinitialised": sorted(union),
            "hierarchy": mode, "forms": {k: "hierarchical" if h else "flat"
                                         for k, h in forms.items()},
            "mpigc_version": a["mpigc_version"], "format_version": a["format_version"]}


# -- command line ----------------------------------------------------------------------
def _checkpoints_below(path, depth=2):
    """Checkpoints (folders holding a manifest) under folder ``path``, at most
    ``depth`` levels down, relative to it; sorted."""
    found = []
    top = os.fspath(path)
    for d, dirs, files in os.walk(top):
        rel = os.path.relpath(d, top)
        level = 0 if rel == "." else rel.count(os.sep) + 1
        if level and MANIFEST in files:
            found.append(rel)
            dirs[:] = []  # a checkpoint's data folders are not checkpoints
        elif level >= depth:
            dirs[:] = []
        dirs.sort()
    return sorted(found)


def describe(path, verify=True):
    """What checkpoint ``path`` holds, as a JSON-ready dict (no MPI
    communication): ``valid``, ``errors``, the manifest's ``format``,
    ``format_version``, ``mpigc_version``, ``created``, ``world_size``,
    ``step``, ``data_dir``, ``data_bytes``, ``hierarchy_mode`` (recorded by
    the save, or None), ``node_layout`` (``{"nodes", "node_sizes"}`` of the
    saving communicator where recorded, else None), ``keys`` (one dict per
    row: ``key`` (the user's key), ``row`` (``key``, or ``key@hier``),
    ``form`` (``"flat"`` or ``"hierarchical"``: the form a load without
    ``hierarchy=`` keeps), ``n``, ``dtype``, ``calls``, ``config``,
    ``residuals``) and
    ``checksums`` (``"OK"``, ``"FAILED"``, or None without ``verify``). When
    ``path`` is a folder without a manifest, ``checkpoints_inside`` names the
    checkpoints found up to two levels below it."""
    abspath = os.path.abspath(os.fspath(path))
    doc = {"path": abspath, "valid": False, "errors": []}
    try:
        meta = _read_manifest(path)
    except CheckpointError as exc:
        doc["errors"].append(str(exc))
        if os.path.isdir(abspath):
            doc["checkpoints_inside"] = _checkpoints_below(abspath)
        return doc
    a = meta["attrs"]
    doc.update(format=a["format"], format_version=a["format_version"],
               mpigc_version=a["mpigc_version"], created=a.get("created"),
               world_size=a["world_size"], step=a.get("step"), data_dir=a["data_dir"],
               data_bytes=sum(meta["file_nbytes"]), hierarchy_mode=a.get("hierarchy_mode"),
               node_layout=None, keys=[], checksums=None)
    try:
        saved = _saved_layout(meta)
    except CheckpointError as exc:
        doc["errors"].append(str(exc))
        saved = None
    if saved is not None:
        doc["node_layout"] = {"nodes": saved[0], "node_sizes": saved[1]}
    for i, (key, n, dname, cfg, calls) in enumerate(meta["rows"]):
        parts = [p for p, h in (("worker", meta["has_worker"][i]),
                                ("owner", meta["has_owner"][i])) if h]
        try:
            cfg = json.loads(cfg)
        except (TypeError, ValueError):
            pass  # shown as stored
        hier = key.endswith(HIER_SUFFIX)
        doc["keys"].append({"key": key[:-len(HIER_SUFFIX)] if hier else key, "row": key,
                            "form": "hierarchical" if hier else "flat", "n": n,
                            "dtype": dname, "calls": calls, "config": cfg,
                            "residuals": parts})
    if not verify:
        doc["valid"] = not doc["errors"]
        return doc
    nbytes, errors = 0, doc["errors"]
    size = a["world_size"]
    for r in range(size):
        try:
            f = _RankFile(meta, r)
        except CheckpointError as exc:
            errors.append(str(exc))
            continue
        try:
            for i, (key, n, dname, cfg, calls) in enumerate(meta["rows"]):
                dtype = np.dtype(dname)
                lo, hi = shard_bounds(n, size)[r]
                for name, m in (("worker", n), ("owner", hi - lo)):
                    # blockwise: memory stays at one block
                    found = f.dataset(i, name, dtype, m)
                    if found is None:
                        continue
                    step = f.block_words * 4 // dtype.itemsize
                    for s in range(0, m, step):
                        tmp = np.empty(min(step, m - s), dtype)
                        f.read(i, name, dtype, m, s, s + tmp.size, tmp, add=False)
                    nbytes += m * dtype.itemsize
        except CheckpointError as exc:
            errors.append(str(exc))
        finally:
            f.close()
    doc["checksums"] = "FAILED" if errors else "OK"
    doc["verified_bytes"] = nbytes
    doc["valid"] = not errors
    return doc


def _config_text(cfg):
    return cfg if isinstance(cfg, str) else json.dumps(cfg, sort_keys=True)


def info(path, verify=True, file=None, as_json=False):
    """Print what checkpoint ``path`` holds and verify its checksums (as text,
    or as the JSON document of :func:`describe` with ``as_json``).
    Returns 0 when it is valid, 1 otherwise (no MPI communication)."""
    out = file or sys.stdout
    doc = describe(path, verify)
    if as_json:
        print(json.dumps(doc, indent=1), file=out)
        return 0 if doc["valid"] else 1
    if "format" not in doc:  # no readable manifest
        for e in doc["errors"]:
            print(f"error: {e}", file=out)
        inside = doc.get("checkpoints_inside")
        if inside:
            print(f"checkpoints inside it: {', '.join(inside)} (run info on one of them)",
                  file=out)
        return 1
    print(f"checkpoint   {doc['path']}", file=out)
    print(f"format       {doc['format']} version {doc['format_version']} "
          f"(mpigc {doc['mpigc_version']}), created {doc['created']}", file=out)
    print(f"world size   {doc['world_size']}", file=out)
    print(f"step         {'none' if doc['step'] is None else doc['step']}", file=out)
    print(f"data         {doc['data_dir']}/ ({doc['world_size']} file(s), "
          f"{doc['data_bytes']} bytes)", file=out)
    mode, nl = doc["hierarchy_mode"], doc["node_layout"]
    print("hierarchy    " + ("no mode recorded" if mode is None else f"mode {mode!r} recorded")
          + ("" if nl is None else f", saved on {nl['nodes']} node(s) of "
             f"{nl['node_sizes']} ranks"), file=out)
    print(f"keys         {len(doc['keys'])}", file=out)
    for k in doc["keys"]:
        form = "flat" if k["form"] == "flat" else f"hierarchical (row {k['row']!r})"
        print(f"  {k['key']!r}: shape ({k['n']},) {k['dtype']}, calls {k['calls']}, "
              f"config {_config_text(k['config'])}, residuals: "
              f"{', '.join(k['residuals']) or 'none'}; {form}", file=out)
    if not verify:
        for e in doc["errors"]:
            print(f"error: {e}", file=out)
        return 0 if doc["valid"] else 1
    if doc["errors"]:
        for e in doc["errors"]:
            print(f"error: {e}", file=out)
        print(f"checksums    FAILED ({len(doc['errors'])} error(s))", file=out)
        return 1
    print(f"checksums    OK ({CHECKSUM}, {doc['verified_bytes']} bytes of residuals "
          f"verified)", file=out)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mpigc.checkpoint",
                                     description="Inspect mpigc residual checkpoints.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="print keys, shapes, world size, configs, step; "
                                    "verify checksums")
    p.add_argument("path")
    p.add_argument("--no-verify", action="store_true", help="skip reading the residuals")
    p.add_argument("--json", action="store_true",
                   help="print a JSON document instead of text (same exit status)")
    args = parser.parse_args(argv)
    return info(args.path, verify=not args.no_verify, as_json=args.json)


if __name__ == "__main__":
    # ``python -m mpigc.checkpoint`` runs this file as ``__main__``: run the
    # imported module's command, so its kernel and classes are the ones of
    # ``mpigc.checkpoint`` (one compile, cached with every other use of them)
    from mpigc.checkpoint import main as _main
    sys.exit(_main())
