"""The documentation as a test (issue 32): every code block of README.md and
docs/*.md runs exactly as written, and what the doc says it prints is compared,
or the block is marked as not run, with the reason.

How a fenced block is classified
--------------------------------
- ```` ```python ````: a program, run. With ``>>>`` lines it is a doctest session,
  run by :mod:`doctest` (the lines after a ``>>>`` statement are its output).
  Otherwise its stdout is compared with its *output block*, if it has one, and every
  expression statement whose line ends in a comment ``# -> VALUE`` is checked:
  ``repr`` of its value must be ``VALUE``. A block that raises fails.
- an untagged block (```` ``` ````) right after a python block, with only blank lines
  between, is that block's *output block*: what the program prints, compared line by
  line (trailing spaces and blank lines at either end ignored). Anywhere else an
  untagged block must carry a marker (below).
- ```` ```text ````: not code (a formula, a layout, a message): never run.
- any other language (``bash``, ...) is not run by this test and must carry a
  ``skip`` marker saying why (the README's quick start, for one, is run by .ci/run).

A block that cannot be classified fails its test, so a new block must either run or
say why not.

Markers
-------
An HTML comment on the line right before the opening fence (several directives
separated by ``;``, or several such lines, except for ``skip``, which takes the
rest of its line)::

    <!-- doctest: skip (needs a GPU) -->   not run; the reason is shown in the report
    <!-- doctest: mpirun -n 3 -->          run under ``mpirun -n 3``; the output block is
                                           every rank's stdout, rank 0's first
    <!-- doctest: mpirun -n 1,2,3,4 -->    run at each count; the output block is the
                                           outputs of the runs one after the other
    <!-- doctest: env NAME=VALUE ... -->   run with these environment variables (the doc
                                           must say so in its text too)
    <!-- doctest: import mpigc -->         run with these modules imported first (a doctest
                                           snippet that takes the page's imports as read)
    <!-- doctest: continues -->            run in the namespace of the previous python
                                           block of the doc (same ranks and env)
    <!-- doctest: output -->               on an untagged block: the output of the
                                           previous python block, although text comes
                                           between
    <!-- doctest: ellipsis -->             on an output block or a doctest: ``...``
                                           matches any text

How it runs
-----------
The blocks of one doc that run in plain ``python``, and the blocks of all docs (those
with a selected test) that run under ``mpirun -n K`` for one K, run in one launch of
``tests/support/docs_harness.py``, one after another, each as a script of its own (fresh
namespace, fresh working directory, mpigc's process-wide residual store and traffic
counters reset in between): 11 launches, not 16 (one per doc and way before; a rank's
start, imports and ``mpirun`` cost more than most blocks). The plain-python launches
stay one per doc: what the engine keeps for a process (its buffer pools) shows in a
block that measures the process's memory (``docs/error-feedback.md``'s tracemalloc).
A launch starts when the first test of its blocks runs, under a timeout
(``$MPIGC_DOCS_TIMEOUT`` seconds, default 300). The environment is the caller's
without any ``MPIGC_*`` setting (the docs describe the defaults; ``MPIGC_CACHE_DIR``
and ``MPIGC_COMPILE_LOCK_TIMEOUT`` are kept) and without ``NUMBA_ENABLE_CUDASIM``. One test per block (``test_doc_block[docs/x.md:LINE]``, LINE
the opening fence's; a failure shows the doc's output, the printed one and a diff); the
terminal summary gives the counts per doc: blocks run, compared, failed, skipped by
reason, output and text blocks, and the time of each launch.

    python -m pytest -q tests/test_docs.py            # all docs (about 1.5 minutes)
    python -m pytest -q tests/test_docs.py -k user-guide
"""
import collections
import dataclasses
import difflib
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESS = os.path.join(ROOT, "tests", "support", "docs_harness.py")
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                              for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_MARKER = re.compile(r"^\s*<!--\s*doctest:\s*(?P<body>.*?)\s*-->\s*$")
_PYTHON = {"python", "py", "python3", "pycon"}
_OUTPUT = {"", "output"}
_PROGRAM_MARKERS = {"mpirun", "env", "import", "continues"}  # for python blocks only
LAUNCH_TIMEOUT = int(os.environ.get("MPIGC_DOCS_TIMEOUT", "300"))  # per launch, seconds


@dataclasses.dataclass
class Block:
    doc: str
    line: int                      # the opening fence, 1-based
    end: int                       # the closing fence
    lang: str
    code: str                      # the content, dedented by the fence's indent
    markers: list
    kind: str = ""                 # python, doctest, output, text, skip, error
    reason: str = ""               # skip reason, or why it cannot be classified
    ranks: tuple = (None,)         # None: plain python; else mpirun -n K
    env: dict = dataclasses.field(default_factory=dict)
    imports: list = dataclasses.field(default_factory=list)
    continues: bool = False
    ellipsis: bool = False
    output: "Block" = dataclasses.field(default=None, repr=False, compare=False)  # its output
    owner: "Block" = dataclasses.field(default=None, repr=False, compare=False)   # its program
    ns: str = ""

    @property
    def id(self):
        return f"{self.doc}:{self.line}"

    @property
    def first(self):
        return self.line + 1


def _directives(lines):
    """The directives of the marker lines ``lines``: ``[(name, argument)]``, and
    the errors."""
    out, errors = [], []
    for body in lines:
        if body.startswith("skip"):
            m = re.fullmatch(r"skip\s*\((.+)\)", body)
            if m:
                out.append(("skip", m.group(1).strip()))
            else:
                errors.append(f"marker {body!r}: expected 'skip (REASON)'")
            continue
        for d in filter(None, (p.strip() for p in body.split(";"))):
            m = re.fullmatch(r"mpirun\s+-n\s+(\d+(?:\s*,\s*\d+)*)", d)
            if m:
                out.append(("mpirun", tuple(int(k) for k in m.group(1).split(","))))
            elif d.startswith("env ") or d == "env":
                pairs = d.split()[1:]
                if not pairs or not all(re.fullmatch(r"[A-Za-z_]\w*=\S*", p) for p in pairs):
                    errors.append(f"marker {d!r}: expected 'env NAME=VALUE ...'")
                else:
                    out.append(("env", dict(p.split("=", 1) for p in pairs)))
            elif re.fullmatch(r"import\s+[\w.]+(\s*,\s*[\w.]+)*", d):
                out.append(("import", [m.strip() for m in d[len("import"):].split(",")]))
            elif d in ("continues", "output", "ellipsis"):
                out.append((d, True))
            else:
                errors.append(f"unknown marker {d!r}")
    return out, errors


def parse(doc, text=None):
    """The fenced blocks of ``doc`` (a path relative to the repository, or
    ``text`` under that name), classified."""
    if text is None:
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            text = f.read()
    lines = text.split("\n")
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.group("indent"), m.group("fence"), m.group("info").strip()
        j = i + 1
        while j < len(lines):
            c = _FENCE.match(lines[j])
            if (c and c.group("fence")[0] == fence[0] and len(c.group("fence")) >= len(fence)
                    and not c.group("info").strip()):
                break
            j += 1
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip()
                for ln in lines[i + 1:j]]
        k, marks = i - 1, []
        while k >= 0 and _MARKER.match(lines[k]):
            marks.insert(0, _MARKER.match(lines[k]).group("body"))
            k -= 1
        blocks.append(Block(doc, i + 1, j + 1, info.split()[0].lower() if info else "",
                            "\n".join(body) + "\n", marks))
        i = j + 1
    _classify(blocks, lines)
    return blocks


def _classify(blocks, lines):
    prev_py = None  # the last python block
    for n, b in enumerate(blocks):
        directives, errors = _directives(b.markers)
        d = collections.defaultdict(list)
        for name, arg in directives:
            d[name].append(arg)
        prev = blocks[n - 1] if n else None
        adjacent = (prev is not None and prev.kind in ("python", "doctest", "skip")
                    and prev.lang in _PYTHON
                    and all(not ln.strip() or _MARKER.match(ln)
                            for ln in lines[prev.end:b.line - 1]))
        if errors:
            b.kind, b.reason = "error", "; ".join(errors)
        elif b.lang in _OUTPUT and (d["output"] or (adjacent and not d["skip"])):
            owner = prev if adjacent else prev_py
            if owner is None or owner.output is not None:
                b.kind, b.reason = "error", "an output block without a python block before it"
            else:
                b.owner, owner.output = owner, b
                b.ellipsis = bool(d["ellipsis"])
                if owner.kind == "skip":
                    b.kind, b.reason = "skip", f"output of a skipped block (line {owner.line})"
                elif owner.kind == "doctest":
                    b.kind, b.reason = "error", "a doctest has its output inline"
                else:
                    b.kind = "output"
        elif d["skip"]:
            b.kind, b.reason = "skip", d["skip"][0]
        elif b.lang == "text":
            b.kind = "text"
        elif b.lang in _PYTHON:
            b.kind = "doctest" if re.search(r"^>>> ", b.code, re.M) else "python"
            b.ranks = d["mpirun"][0] if d["mpirun"] else (None,)
            for env in d["env"]:
                b.env.update(env)
            b.imports = [m for names in d["import"] for m in names]
            b.ellipsis = bool(d["ellipsis"])
            b.ns = b.id
            if d["continues"]:
                base = prev_py
                if base is None or base.kind not in ("python", "doctest"):
                    b.kind, b.reason = "error", "'continues' needs a python block before it"
                elif (base.ranks, base.env) != (b.ranks, b.env):
                    b.kind, b.reason = "error", (f"'continues' needs the ranks and env of "
                                                 f"line {base.line}")
                else:
                    b.continues, b.ns = True, base.ns
            if b.kind == "doctest" and b.ranks != (None,):
                b.kind, b.reason = "error", "a doctest runs in one process (no mpirun)"
        elif b.lang in _OUTPUT:
            b.kind, b.reason = "error", (
                "an untagged block that is not the output of a python block: tag it "
                "```text if it is not code, or mark it (<!-- doctest: output --> or "
                "<!-- doctest: skip (REASON) -->)")
        else:
            b.kind, b.reason = "error", (f"a ```{b.lang} block is not run here: mark it "
                                         "<!-- doctest: skip (REASON) -->")
        misplaced = sorted(name for name, v in d.items() if v and (
            name in _PROGRAM_MARKERS and b.lang not in _PYTHON
            or name == "output" and b.lang not in _OUTPUT))
        if misplaced and b.kind != "error":
            b.kind, b.reason = "error", f"marker(s) {', '.join(misplaced)} on a ```{b.lang} block"
        if b.lang in _PYTHON:
            prev_py = b


# -- launches ---------------------------------------------------------------------------
def _env():
    keep = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")
    env = {k: v for k, v in os.environ.items()
           if k in keep or k.split("_")[0] not in ("OMPI", "PMIX", "PRTE", "OPAL", "MPIGC")
           and k != "NUMBA_ENABLE_CUDASIM"}
    for k in ("MPIGC_CACHE_DIR", "MPIGC_COMPILE_LOCK_TIMEOUT"):
        if k in os.environ:
            env[k] = os.environ[k]
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", PYTHONUNBUFFERED="1",
               PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
               # a waiting rank yields its core (tests/run.sh says why); what a block
               # prints does not depend on it
               OMPI_MCA_mpi_yield_when_idle="1")
    return env


class Launches:
    """The launches of the harness, each run once when a test first needs it:
    ``result(block, ranks) -> (outputs per rank, error)``. One per doc for plain
    python (``ranks`` None: a block may measure the process's memory, which
    earlier docs' blocks would change), one per rank count for the blocks of
    all the docs in ``docs`` (the docs of the selected tests; ``None``: all)
    under ``mpirun``: the harness isolates each block already, and each launch
    pays its ranks' start, imports and ``mpirun`` (16 launches were 11)."""

    def __init__(self, blocks):
        self.groups = collections.defaultdict(list)
        for b in blocks:
            if b.kind in ("python", "doctest"):
                for k in b.ranks:
                    self.groups[self._key(b, k)].append(b)
        self.docs = None
        self.done = {}
        self.timings = {}
        self.tmp = None  # made by the first launch

    @staticmethod
    def _key(b, k):
        return (b.doc if k is None else None, k)

    def result(self, b, k):
        key = self._key(b, k)
        if key not in self.done:
            self.done[key] = self._launch(key)
        ranks, failure = self.done[key]
        return [r["blocks"].get(b.id) for r in ranks], failure

    def _launch(self, key):
        doc, k = key
        if self.tmp is None:
            self.tmp = tempfile.mkdtemp(prefix="mpigc-docs-")
        name = re.sub(r"[^A-Za-z0-9]", "_", doc or "docs") + f"_n{k or 0}"
        blocks = [b for b in self.groups[key] if self.docs is None or b.doc in self.docs]
        spec = {"workdir": os.path.join(self.tmp, name), "results": os.path.join(self.tmp, name),
                "blocks": [{"id": b.id, "file": b.doc, "first": b.first, "code": b.code,
                            "mode": "doctest" if b.kind == "doctest" else "exec",
                            "env": b.env, "ns": b.ns, "ellipsis": b.ellipsis,
                            "imports": b.imports}
                           for b in blocks]}
        path = os.path.join(self.tmp, name + ".json")
        with open(path, "w") as f:
            json.dump(spec, f)
        if k is None:
            cmd = [sys.executable, HARNESS, path]
        else:
            mpirun = shutil.which("mpirun") or shutil.which(
                "mpirun", path=os.path.dirname(sys.executable))
            if mpirun is None:
                pytest.skip("no mpirun on PATH")
            cmd = [mpirun, "--oversubscribe", "-n", str(k), sys.executable, HARNESS, path]
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, env=_env(), capture_output=True, text=True,
                               timeout=LAUNCH_TIMEOUT, cwd=self.tmp)
            failure = None if p.returncode == 0 else (
                f"{' '.join(cmd)}: exit {p.returncode}\n--- stdout\n{p.stdout[-4000:]}"
                f"\n--- stderr\n{p.stderr[-4000:]}")
        except subprocess.TimeoutExpired as exc:
            failure = f"{' '.join(cmd)}: timed out after {LAUNCH_TIMEOUT} s\n{exc.stderr or ''}"
        self.timings[key] = time.monotonic() - t0
        ranks = []
        for r in range(k or 1):
            try:
                with open(f"{spec['results']}.rank{r}.json") as f:
                    ranks.append(json.load(f))
            except (OSError, ValueError):
                ranks.append({"current": "(did not start)", "blocks": {}})
        if failure:
            failure += "".join(f"\nrank {r} was running {s['current']}"
                               for r, s in enumerate(ranks) if s["current"])
        return ranks, failure


ALL = [b for doc in DOCS for b in parse(doc)]
TESTED = [b for b in ALL if b.kind not in ("output", "text")]
_LAUNCHES = Launches(ALL)
_OUTCOME = {}  # block id -> "compared", "ran" or "failed", for the tests that ran


def _matches(expected, got, ellipsis):
    if not ellipsis:
        return expected == got
    pattern = ".*?".join(re.escape(p) for p in expected.split("..."))
    return re.fullmatch(pattern, got, re.S) is not None


def _normal(text):
    return "\n".join(ln.rstrip() for ln in text.strip("\n").split("\n")).strip("\n")


def _where(b, k):
    return f"{b.id}" + ("" if k is None else f" (mpirun -n {k})")


@pytest.mark.parametrize("b", TESTED, ids=[b.id for b in TESTED])
def test_doc_block(b):
    if b.kind == "error":
        pytest.fail(f"{b.id}: cannot classify this ```{b.lang} block: {b.reason}",
                    pytrace=False)
    if b.kind == "skip":
        pytest.skip(b.reason)
    got, problems = [], []
    for k in b.ranks:
        per_rank, failure = _LAUNCHES.result(b, k)
        _OUTCOME[b.id] = "failed"
        if any(r is None for r in per_rank):
            problems.append(f"{_where(b, k)} did not complete:\n{failure}")
            continue
        if failure:  # every block completed, then the launch failed (at exit, say)
            problems.append(f"{_where(b, k)}: the launch failed after the block:\n{failure}")
        for r, res in enumerate(per_rank):
            who = _where(b, k) + ("" if k is None else f", rank {r}")
            if res["error"]:
                problems.append(f"{who} raised:\n{res['error']}")
            for c in res["checks"]:
                if not c["ok"]:
                    problems.append(f"{who}, line {c['line']}: '# -> {c['expected']}' but the "
                                    f"value is {c['got']}")
            if res["doctest"] and res["doctest"]["failed"]:
                problems.append(f"{who}: doctest failed:\n{res['doctest']['report']}")
        got.append("".join(res["stdout"] for res in per_rank))
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)
    compared = b.kind == "doctest" or b.output is not None
    if b.output is not None:
        want, have = _normal(b.output.code), _normal("".join(got))
        if not _matches(want, have, b.output.ellipsis):
            shown = have.split("\n")
            if b.output.ellipsis and len(shown) == want.count("\n") + 1:
                # lines that match on their own are shown as the doc has them
                shown = [w if _matches(w, h, True) else h
                         for w, h in zip(want.split("\n"), shown)]
            diff = "\n".join(difflib.unified_diff(want.split("\n"), shown,
                                                  "the doc", "printed", lineterm=""))
            how = "" if b.ranks == (None,) else f"; mpirun -n {','.join(map(str, b.ranks))}"
            pytest.fail(f"{b.id}: the output differs from the doc's output block (line "
                        f"{b.output.line}{how})\n--- the doc says:\n{want}\n--- the block "
                        f"printed:\n{have}\n--- diff:\n{diff}", pytrace=False)
    per_rank, _ = _LAUNCHES.result(b, b.ranks[0])
    compared = compared or any(r["checks"] for r in per_rank if r)
    _OUTCOME[b.id] = "compared" if compared else "ran"


def test_classification_rules():
    """What the runner does with each kind of block (on a made-up doc)."""
    doc = "\n".join([
        "```python", "print(1)", "```", "", "```", "1", "```",              # program + output
        "text", "```", "orphan", "```",                                     # untagged: error
        "```bash", "ls", "```",                                             # shell: error
        "<!-- doctest: skip (needs a GPU) -->", "```bash", "nvidia-smi", "```",
        "<!-- doctest: mpirun -n 2; env A=1 -->", "```python", "x = 1", "```",
        "prose", "<!-- doctest: output -->", "```", "out", "```",           # marked output
        "<!-- doctest: continues -->", "<!-- doctest: mpirun -n 2; env A=1 -->",
        "```python", "print(x)", "```",
        "<!-- doctest: skip (a fragment) -->", "```python", "f(", "```", "", "```", "o", "```",
        "```text", "a = b", "```",
        "<!-- doctest: mpirun 2 -->", "```python", "pass", "```",          # bad marker
        "<!-- doctest: env A=1 -->", "```text", "t", "```",                # misplaced marker
        "```python", ">>> 1", "1", "```"])
    got = [(b.line, b.kind, b.ranks, b.env, b.continues) for b in parse("x.md", doc)]
    assert [g[:2] for g in got] == [(1, "python"), (5, "output"), (9, "error"), (12, "error"),
                                    (16, "skip"), (20, "python"), (25, "output"),
                                    (30, "python"), (34, "skip"), (38, "skip"), (41, "text"),
                                    (45, "error"), (49, "error"), (52, "doctest")]
    assert got[5][2:] == ((2,), {"A": "1"}, False) and got[7][2:] == ((2,), {"A": "1"}, True)


def _counts():
    """Per doc: blocks run (by the tests that ran), compared, failed, skipped by
    reason, output, text, unclassified."""
    per = collections.OrderedDict((d, collections.Counter()) for d in DOCS)
    reasons = collections.defaultdict(collections.Counter)
    for b in ALL:
        c = per[b.doc]
        if b.kind in ("python", "doctest"):
            c["run"] += b.id in _OUTCOME
            c[_OUTCOME.get(b.id, "not run")] += 1
        elif b.kind == "skip":
            c["skipped"] += 1
            reasons[b.doc][re.sub(r" \(line \d+\)$", "", b.reason)] += 1
        elif b.kind in ("text", "output"):
            c[b.kind] += 1
        else:
            c["unclassified"] += 1
    return per, reasons


class _Summary:
    def pytest_terminal_summary(self, terminalreporter):
        if not _OUTCOME and not _LAUNCHES.done:
            return
        tr = terminalreporter
        per, reasons = _counts()
        tr.write_sep("-", "docs as a test (tests/test_docs.py)")
        total = collections.Counter()

        def line(c):
            return (f"{c['run']} run ({c['compared']} compared, {c['failed']} failed), "
                    f"{c['skipped']} skipped, {c['output']} output blocks, {c['text']} text"
                    + (f", {c['not run']} not run (deselected)" if c["not run"] else "")
                    + (f", {c['unclassified']} UNCLASSIFIED" if c["unclassified"] else ""))
        for doc, c in per.items():
            total.update(c)
            tr.write_line(f"{doc}: {line(c)}")
            for reason, n in sorted(reasons[doc].items()):
                tr.write_line(f"    skipped {n}: {reason}")
        tr.write_line(f"all docs: {line(total)}")
        tr.write_line("launches: " + ", ".join(
            f"{d or 'all docs'} {'python' if k is None else f'mpirun -n {k}'} {t:.0f} s"
            for (d, k), t in _LAUNCHES.timings.items())
            + f"; {sum(_LAUNCHES.timings.values()):.0f} s in all")


@pytest.fixture(scope="module", autouse=True)
def _summary(request):
    plugin = _Summary()
    request.config.pluginmanager.register(plugin, "mpigc-docs-summary")
    # the launches run the blocks of the docs that have a selected test (a block may
    # continue an earlier one of its doc, so a doc runs whole)
    _LAUNCHES.docs = {it.callspec.params["b"].doc for it in request.session.items
                      if getattr(it, "originalname", None) == "test_doc_block"
                      and str(it.path) == str(request.node.path)}
    yield
    if _LAUNCHES.tmp:
        shutil.rmtree(_LAUNCHES.tmp, ignore_errors=True)
