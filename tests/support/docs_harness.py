"""Run the code blocks of the documentation in one process (one rank of an
``mpirun``, or a plain ``python``), for ``tests/test_docs.py``.

    python tests/support/docs_harness.py SPEC.json                 # single-process blocks
    mpirun -n K python tests/support/docs_harness.py SPEC.json     # every rank runs every block

``SPEC.json`` holds ``{"workdir": DIR, "results": PREFIX, "blocks": [...]}``; each
block is ``{"id", "file", "first", "code", "mode", "env", "ns", "imports", "ellipsis"}``.
The blocks run one after another, each as ``__main__`` of a script of its own: a fresh
namespace (the namespace of an earlier block where ``ns`` names it: a continued block;
the modules ``imports`` names imported into it), a fresh
working directory ``DIR/<id>`` (shared by the ranks), its ``env`` set for its
duration. What a script could see of an earlier one in the same process is reset in
between: mpigc's process-wide residual store and its traffic counters.

``mode`` is ``"exec"`` (the block's stdout is recorded, and every expression statement
whose line ends in ``# -> VALUE`` is checked: ``repr`` of its value must be ``VALUE``)
or ``"doctest"`` (``>>>`` examples, run by :mod:`doctest`). After each block, this
rank's results so far are written to ``PREFIX.rank<r>.json``: ``{"current": id or
None, "blocks": {id: {"stdout", "error", "checks", "doctest"}}}``, so a launch that
times out still says which block it was in.
"""
import ast
import contextlib
import doctest
import importlib
import io
import json
import os
import re
import sys
import tokenize
import traceback

_ARROW = re.compile(r"#\s*->\s?(.*?)\s*$")


def rank():
    for var in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def arrow_comments(code):
    """``{line: expected}`` of the ``# -> VALUE`` comments of ``code`` (lines of
    the block, 1-based)."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.COMMENT:
            m = _ARROW.match(tok.string)
            if m:
                out[tok.start[0]] = m.group(1)
    return out


class _Arrows(ast.NodeTransformer):
    """``expr  # -> VALUE`` becomes ``__doc_expect__(expr, VALUE, line)``."""

    def __init__(self, expected):
        self.expected = expected

    def visit_Expr(self, node):
        want = self.expected.get(node.end_lineno)
        if want is None:
            return node
        call = ast.Call(func=ast.Name("__doc_expect__", ast.Load()),
                        args=[node.value, ast.Constant(want), ast.Constant(node.end_lineno)],
                        keywords=[])
        return ast.copy_location(ast.Expr(ast.copy_location(call, node.value)), node)


def compile_block(code, filename, first):
    """The block as a code object whose line numbers are those of the doc, and
    its ``# ->`` expectations."""
    tree = ast.parse(code, filename, "exec")
    expected = arrow_comments(code)
    if expected:
        tree = ast.fix_missing_locations(_Arrows(expected).visit(tree))
    ast.increment_lineno(tree, first - 1)
    return compile(tree, filename, "exec"), {k + first - 1: v for k, v in expected.items()}


def _reset_process_state():
    """What one script could leave to the next in the same process."""
    mpigc = sys.modules.get("mpigc")
    if mpigc is not None:
        with contextlib.suppress(Exception):  # a request left pending: the block's error
            mpigc.get_default_feedback().reset()
        mpigc.reset_traffic()


def _barrier():
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.COMM_WORLD.Barrier()


def run_block(blk, namespaces):
    res = {"stdout": "", "error": None, "checks": [], "doctest": None}
    ns = namespaces.setdefault(blk["ns"], {"__name__": "__main__", "__file__": blk["file"],
                                           "__builtins__": __builtins__})
    checks = res["checks"]

    def expect(value, want, line):
        got = repr(value)
        checks.append({"line": line, "expected": want, "got": got, "ok": got == want})
        return value

    ns["__doc_expect__"] = expect
    out = io.StringIO()
    try:
        for name in blk.get("imports", ()):
            importlib.import_module(name)
            top = name.split(".")[0]
            ns[top] = sys.modules[top]
        with contextlib.redirect_stdout(out):
            if blk["mode"] == "doctest":
                test = doctest.DocTestParser().get_doctest(
                    blk["code"], ns, blk["id"], blk["file"], blk["first"] - 1)
                report = io.StringIO()
                runner = doctest.DocTestRunner(verbose=False, optionflags=doctest.ELLIPSIS
                                               if blk.get("ellipsis") else 0)
                runner.run(test, out=report.write, clear_globs=False)
                res["doctest"] = {"failed": runner.failures, "tried": runner.tries,
                                  "report": report.getvalue()}
            else:
                code, _ = compile_block(blk["code"], blk["file"], blk["first"])
                exec(code, ns)
    except BaseException as exc:  # noqa: BLE001 - reported, the next block runs
        tb = exc.__traceback__.tb_next or exc.__traceback__  # from the block's frame on
        res["error"] = "".join(traceback.format_exception(type(exc), exc, tb))
    finally:
        sys.stdout.flush()
    res["stdout"] = out.getvalue()
    return res


def main(argv):
    with open(argv[1]) as f:
        spec = json.load(f)
    r = rank()
    path = f"{spec['results']}.rank{r}.json"
    state = {"current": None, "blocks": {}}
    namespaces = {}
    home = os.getcwd()
    for blk in spec["blocks"]:
        state["current"] = blk["id"]
        with open(path, "w") as f:
            json.dump(state, f)
        wd = os.path.join(spec["workdir"], re.sub(r"[^A-Za-z0-9_.-]", "_", blk["id"]))
        os.makedirs(wd, exist_ok=True)
        saved = {k: os.environ.get(k) for k in blk["env"]}
        os.environ.update(blk["env"])
        os.chdir(wd)
        try:
            state["blocks"][blk["id"]] = run_block(blk, namespaces)
        finally:
            os.chdir(home)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            _reset_process_state()
            _barrier()
    state["current"] = None
    with open(path, "w") as f:
        json.dump(state, f)


if __name__ == "__main__":
    main(sys.argv)
