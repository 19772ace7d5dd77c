"""docs/wire-format.md's fingerprint example against the code: the settings
JSON and the CRC it shows are those the agreement row of that call carries
(tests/test_docs.py runs the example itself, which only checks its arithmetic)."""
import json
import os
import re

import numpy as np

from mpigc import _settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_fingerprint_example_is_the_codes(monkeypatch):
    for var in ("MPIGC_NONFINITE", "MPIGC_MIN_COMPRESS_BYTES"):
        monkeypatch.delenv(var, raising=False)
    # allreduce(buf, "2bit", key="w", threshold=0.5) on 4096 float32 values (16 KiB),
    # one rank
    *_, settings, fp = _settings.settings_for(
        "allreduce", np.dtype(np.float32), 1, "2bit", {"threshold": 0.5}, "w", False,
        "compressed", None,
        4096, None)
    with open(os.path.join(ROOT, "docs", "wire-format.md"), encoding="utf-8") as f:
        doc = f.read()
    block = next(b for b in re.findall(r"^```python\n(.*?)^```", doc, re.S | re.M)
                 if "zlib.crc32(json.dumps(settings" in b)
    assert json.dumps(settings, sort_keys=True) + "\n" in block, (
        f"docs/wire-format.md: the fingerprinted settings are now\n"
        f"{json.dumps(settings, sort_keys=True)}")
    assert block.rstrip().endswith(f"\n{fp}"), f"docs/wire-format.md: the CRC is now {fp}"
