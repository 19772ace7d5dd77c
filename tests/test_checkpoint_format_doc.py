"""docs/checkpoint-format.md against the code (issue 32, fix 6).

- ``keys_crc32``: the doc's recipe (the functions of its python block that
  defines ``keys_crc32``, taken from the doc and run alone: h5py, zlib and
  json) recomputes the attribute of real checkpoints, with keys that exercise
  every rule the doc states (the manifest's order, configs as JSON strings,
  non-ASCII keys, int keys, EF off, float64, call counts).
- The signatures at the top of the doc are those of the code.
"""
import ast
import inspect
import os
import re

import h5py
import numpy as np
import pytest

import mpigc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "checkpoint-format.md")


def _doc():
    with open(DOC, encoding="utf-8") as f:
        return f.read()


def _python_blocks(text):
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


@pytest.fixture(scope="module")
def recipe():
    """The doc's ``keys_crc32``, from the doc's imports and functions only."""
    blocks = [b for b in _python_blocks(_doc()) if "def keys_crc32(" in b]
    assert len(blocks) == 1, "docs/checkpoint-format.md: expected one block defining keys_crc32"
    tree = ast.parse(blocks[0])
    tree.body = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                 and all(a.name in ("json", "zlib", "h5py") for a in n.names)
                 or isinstance(n, ast.FunctionDef)]
    ns = {}
    exec(compile(tree, DOC, "exec"), ns)
    return ns["keys_crc32"]


def _stored(path):
    with h5py.File(os.path.join(path, "manifest.h5"), "r") as f:
        crc, data_dir = int(f.attrs["keys_crc32"]), f.attrs["data_dir"]
    with h5py.File(os.path.join(path, data_dir, "rank-00000.h5"), "r") as f:
        return crc, int(f.attrs["keys_crc32"])


def test_keys_crc32_recipe_of_the_doc_is_the_codes(tmp_path, recipe):
    fb = mpigc.ErrorFeedback()
    calls = [  # buffers of 8 KiB or more: compressed, so every key has an entry
        (np.ones(3000, np.float32), "2bit", "fc1.weight", {}),
        (np.ones(3000, np.float32), "2bit", "fc1.weight", {}),  # calls 2
        (np.full(2000, 0.3), "1bit", "conv/1.bias", {"block_size": 256}),  # float64
        (np.ones(3000, np.float32), "terngrad", "schlüssel é 鍵", {"seed": 3, "clip": 2.5}),
        (np.ones(3000, np.float32), "fp16", 'quote"d\\key', {}),  # EF off: no residual
        (np.ones(3000, np.float32), "2bit", 7, {"rel_threshold": 1.5, "block_size": 512}),
        (np.ones(5000, np.float16), "bf16", "A-upper", {"error_feedback": True}),
    ]
    for buf, op, key, params in calls:
        mpigc.allreduce(buf, op, key=key, feedback=fb, **params)
    path = str(tmp_path / "ckpt")
    mpigc.save_checkpoint(path, fb, step=3)
    manifest, rank_file = _stored(path)
    assert recipe(os.path.join(path, "manifest.h5")) == manifest == rank_file
    with h5py.File(os.path.join(path, "manifest.h5"), "r") as f:
        keys = list(f["keys"].asstr()[()])
    assert keys == sorted(keys) and "7" in keys and "schlüssel é 鍵" in keys

    # another state, another CRC: the recipe follows the content, not a constant
    mpigc.allreduce(np.ones(3000, np.float32), "2bit", key="fc1.weight", feedback=fb)
    mpigc.save_checkpoint(path, fb)
    manifest2, _ = _stored(path)
    assert manifest2 != manifest and recipe(os.path.join(path, "manifest.h5")) == manifest2


def test_keys_crc32_recipe_of_an_empty_checkpoint(tmp_path, recipe):
    path = str(tmp_path / "empty")
    mpigc.save_checkpoint(path, mpigc.ErrorFeedback())
    assert recipe(os.path.join(path, "manifest.h5")) == _stored(path)[0]


@pytest.mark.parametrize("name", ["save_checkpoint", "load_checkpoint"])
def test_signatures_in_the_doc_are_the_codes(name):
    want = f"mpigc.{name}{inspect.signature(getattr(mpigc, name))}"
    lines = [ln for b in _python_blocks(_doc()) for ln in b.splitlines()
             if ln.startswith(f"mpigc.{name}(")]
    assert lines, f"docs/checkpoint-format.md: no signature line of mpigc.{name}"
    got = re.sub(r"\s*->.*$", "", lines[0])
    assert got == want, f"docs/checkpoint-format.md says\n  {got}\nthe code is\n  {want}"
