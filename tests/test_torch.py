"""mpigc.torch in one process (no mpirun): bucket layout, keys, errors, hooks."""
import os
import subprocess
import sys

import numpy as np
import pytest

import mpigc
from support import background


def test_import_mpigc_does_not_import_torch():
    code = "import sys, mpigc; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("cap", [1, 2])
def test_kernels_leave_torch_thread_count_alone(cap):
    """Numba's OpenMP pool starting must not change torch's OpenMP threads
    (it did: 1 -> NUMBA_NUM_THREADS, 2.4x slower forward passes)."""
    pytest.importorskip("torch")
    code = (
        "import numpy as np, torch; torch.set_num_threads(1)\n"
        "torch.nn.Linear(1024, 1024)(torch.ones(64, 1024))\n"  # torch's OpenMP in use
        "from mpigc.kernels import cpu\n"
        f"cpu.set_max_threads({cap})\n"
        "x = np.ones(1 << 20, np.float32); out = np.empty(x.size // 4, np.uint8)\n"
        "cpu.pack_2bit(x, None, None, out, 0.5)\n"
        "assert torch.get_num_threads() == 1, torch.get_num_threads()\n")
    env = {**os.environ, "NUMBA_NUM_THREADS": "2"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.fixture(scope="module")
def torch():
    t = pytest.importorskip("torch")
    t.set_num_threads(1)
    return t


@pytest.fixture(scope="module")
def mt(torch):
    import mpigc.torch
    return mpigc.torch

@pytest.fixture
def gloo_group(torch, tmp_path):
    """A one-process gloo process group (for DDP in this process), destroyed
    after the test; skips where torch.distributed has no gloo."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    yield dist
    dist.destroy_process_group()


def mlp(torch, widths=(8, 16, 16, 4), dtype=None):
    torch.manual_seed(0)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]).to(dtype or torch.float32)


def test_buckets_follow_reverse_registration_order_and_cap(torch, mt):
    model = mlp(torch)
    sync = mt.GradientSync(model, op="2bit", bucket_mb=300 * 4 / 2**20)  # 300 floats
    names = [n for n, _ in model.named_parameters()]
    flat = [n for b in sync.buckets for n in b.names]
    assert flat == names[::-1]
    for b in sync.buckets[:-1]:
        # a bucket closes as soon as it reaches the cap
        assert b.n >= 300 and b.n - b.numels[-1] < 300
    assert [b.index for b in sync.buckets] == list(range(len(sync.buckets)))
    for b in sync.buckets:
        assert b.offsets == list(np.cumsum([0] + b.numels[:-1]))
        assert b.flat.dtype == np.float32 and b.flat.size == b.n


def test_bucket_keys_are_stable_and_content_derived(torch, mt):
    a = mt.GradientSync(mlp(torch), op="2bit", bucket_mb=0.001)
    b = mt.GradientSync(mlp(torch), op="2bit", bucket_mb=0.001)
    assert [x.key for x in a.buckets] == [x.key for x in b.buckets]
    assert len({x.key for x in a.buckets}) == len(a.buckets)
    c = mt.GradientSync(mlp(torch, widths=(8, 16, 17, 4)), op="2bit", bucket_mb=0.001)
    assert a.buckets[0].key != c.buckets[0].key  # other sizes, other key
    assert a.buckets[-1].key == c.buckets[-1].key  # same content, same key
    assert a.buckets[0].key.startswith("torch/4.bias..")


def test_one_dtype_per_bucket(torch, mt):
    model = mlp(torch)
    model[0].double()
    sync = mt.GradientSync(model, op="2bit", bucket_mb=25)
    dtypes = sorted(b.flat.dtype.name for b in sync.buckets)
    assert dtypes == ["float32", "float64"]


def test_frozen_parameters_are_left_out(torch, mt):
    model = mlp(torch)
    model[0].requires_grad_(False)
    sync = mt.GradientSync(model, op="2bit")
    assert "0.weight" not in sync.names and "2.weight" in sync.names


def test_bad_arguments(torch, mt):
    with pytest.raises(mpigc.ConfigError):
        mt.GradientSync(mlp(torch), bucket_mb=0)
    with pytest.raises(mpigc.ConfigError):
        mt.GradientSync(mlp(torch), op="nope")
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(mpigc.DTypeError, match="complex64"):
        mt.GradientSync([("z", p)])
    with pytest.raises(mpigc.ConfigError):
        mt.DistributedOptimizer(torch.optim.SGD(mlp(torch).parameters(), lr=1))


def test_single_rank_equals_allreduce(torch, mt):
    model, ref = mlp(torch), mlp(torch)
    sync = mt.GradientSync(model, op="1bit", bucket_mb=0.001)
    fb = mpigc.ErrorFeedback()
    x = torch.randn(5, 8)
    model(x).sum().backward()
    ref(x).sum().backward()
    sync.wait()
    params = dict(ref.named_parameters())
    for b in sync.buckets:
        flat = np.concatenate([params[n].grad.reshape(-1).numpy() for n in b.names])
        mpigc.allreduce(flat, op="1bit", key=b.key, average=True, feedback=fb)
        got = np.concatenate([dict(model.named_parameters())[n].grad.reshape(-1).numpy()
                              for n in b.names])
        assert got.tobytes() == flat.tobytes()
    assert sorted(sync.feedback.keys()) == sorted(fb.keys())


def test_wait_without_backward_is_a_noop_and_hooks_can_be_removed(torch, mt):
    model = mlp(torch)
    sync = mt.GradientSync(model, op="2bit")
    sync.wait()
    assert all(p.grad is None for p in model.parameters())
    sync.remove_hooks()
    model(torch.randn(2, 8)).sum().backward()
    assert all(b.started_at is None for b in sync.buckets)
    sync.wait()  # nothing was recorded: no-op
    assert len(sync.feedback) == 0


def test_half_precision_parameters_use_float32_buckets(torch, mt):
    model = mlp(torch).to(torch.bfloat16)
    sync = mt.GradientSync(model, op="none")
    assert {b.flat.dtype.name for b in sync.buckets} == {"float32"}
    model(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    sync.wait()
    assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())


# -- device buckets in Numba's CUDA simulator, across ranks -------------------------
SIM_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi",
                          "test_torch_gpu_sim_mpi.py")


# about 8 minutes in all on the 2-core VM under load; MPIGC_TORCH_SIM_RANKS="3" halves it
_SIM_RANKS = [int(k) for k in os.environ.get("MPIGC_TORCH_SIM_RANKS", "2 3").split()]
_SIM_GROUPS = ["ops", "skip", "state", "hook", "hier"]  # hier last: it sets MPIGC_NODE_SPLIT
_SIM_RUNS = background.Runs()  # a job per rank count, side by side (support/background.py)


@pytest.mark.parametrize("ranks", _SIM_RANKS)
@pytest.mark.parametrize("group", _SIM_GROUPS)
def test_device_buckets_in_the_simulator(group, ranks, request):
    """``mpirun -n K python tests/mpi/test_torch_gpu_sim_mpi.py GROUP ...`` with
    ``NUMBA_ENABLE_CUDASIM=1`` (that file says what each group checks): device
    buckets give the gradients, parameters and residuals of host buckets, bit
    for bit. A subprocess, so this session never imports the simulator. The
    selected groups of a rank count are one job (each rank imports torch and
    the simulator once, about 6 CPU s); each test checks its own group's line."""
    import shutil
    pytest.importorskip("torch")
    exe = (shutil.which("mpirun") or shutil.which("mpiexec")
           or shutil.which("mpirun", path=os.path.dirname(sys.executable)))
    if exe is None:
        pytest.skip("no mpirun on PATH or next to this Python")
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMBA_ENABLE_CUDASIM", "MPIGC_CUDA_AWARE", "MPIGC_DEVICE")}
    env.update(NUMBA_ENABLE_CUDASIM="1", MPIGC_CUDA_AWARE="0", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
               PYTHONUNBUFFERED="1")
    timeout = int(os.environ.get("MPIGC_TEST_TIMEOUT", "900"))
    chosen = background.selected(request, "test_device_buckets_in_the_simulator",
                                 "group", "ranks")

    def groups(k):
        return [g for g in _SIM_GROUPS if (g, k) in chosen] or [group]

    def cmd(k):
        return [exe, "--oversubscribe", "-n", str(k), sys.executable, SIM_SCRIPT, *groups(k)]
    # the most ranks first (the longest)
    counts = sorted({k for _, k in chosen}, key=lambda k: -k)
    _SIM_RUNS.start({k: (cmd(k), env, timeout) for k in counts})
    r = _SIM_RUNS.result(ranks, cmd(ranks), env, timeout)
    if isinstance(r, subprocess.TimeoutExpired):
        pytest.fail(f"{' '.join(cmd(ranks))} timed out after {timeout} s:\n{r.stdout}")
    mine = [line for line in r.stdout.splitlines() if line.startswith(f"FAIL {group} ")]
    # the job's exit status is the last group's to check (a crash after every line)
    last = group == groups(ranks)[-1]
    assert f"ok {group}" in r.stdout.splitlines() and not mine and \
        (r.returncode == 0 or not last), \
        f"{' '.join(cmd(ranks))}: exit {r.returncode}\n" + "\n".join(mine)[-6000:] + \
        f"\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}"


def test_a_step_shows_in_torch_profiler(torch, mt):
    """GradientSync's bucket calls are torch.profiler ranges (start and wait)
    while the profiler records, and nothing when it does not."""
    model = mlp(torch)
    sync = mt.GradientSync(model, op="2bit", bucket_mb=300 * 4 / 2**20)
    x = torch.ones(4, 8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x).sum().backward()
        sync.wait()
    names = [e.name for e in prof.events()]
    for b in sync.buckets:
        assert f"mpigc: start bucket {b.key}" in names, names
        assert f"mpigc: wait bucket {b.key}" in names, names
    model(x).sum().backward()  # outside a profile: no range is made, the step works
    sync.wait()


class _Clock:
    """A stand-in for the ``time`` module of ``mpigc.torch._common``: each
    sleep of a wait moves the clock on by ``step`` seconds."""

    def __init__(self, step=0.5):
        self.now, self.step = 1000.0, step

    def monotonic(self):
        return self.now

    def sleep(self, _):
        self.now += self.step


def test_a_long_wait_says_so_on_stderr_and_again_every_five_times_that(mt, monkeypatch,
                                                                         capsys):
    """The torch layer's one wait for the other ranks: a line on stderr
    after warn_s, then every 5 * warn_s, naming who waits, for what, and the
    likely causes; StateError at the timeout; counted from ``since`` when
    given (the calls of one step share one schedule)."""
    from mpigc.torch import _common
    clock = _Clock()
    monkeypatch.setattr(_common, "time", clock)

    def wait(until, **kw):
        start = clock.now
        _common.wait_request(lambda: clock.now - start >= until, "GradientSync (rank 0 of 2)",
                             _common.STEP, **kw)
        return [ln for ln in capsys.readouterr().err.splitlines()]

    lines = wait(12.5, timeout=None, warn_s=1)
    assert [ln.split(" for the other ranks")[0] for ln in lines] == [
        f"mpigc: GradientSync (rank 0 of 2): still waiting after {t} s" for t in (1, 6, 11)]
    assert all("to reach this step's gradient synchronisation. A rank that ran out of "
               "batches (uneven inputs)?" in ln and "called on some ranks only" in ln
               and "(no timeout; said again every 5 s;" in ln for ln in lines)
    assert wait(200, timeout=None, warn_s=None) == []  # $MPIGC_TORCH_WARN_S=0
    with pytest.raises(mpigc.StateError, match=r"^GradientSync \(rank 0 of 2\): the other "
                       r"ranks did not reach this step's gradient synchronisation within "
                       r"8 s\. A rank that ran out of batches .* The step stays pending"):
        wait(100, timeout=8, warn_s=1)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and "after 6 s" in lines[1] and "a StateError after 8 s" in lines[1]
    # a wait of the same step that begins 0.5 s after it: the step's schedule
    lines = wait(6.5, timeout=None, warn_s=1, since=clock.now - 0.5)
    assert len(lines) == 2 and "after 1 s" in lines[0] and "after 6 s" in lines[1]
    # one that begins 3 s after it (a slow backward): its first line warn_s
    # after its own start (at 4 s of the step, not 6), then every 5 s
    lines = wait(9.5, timeout=None, warn_s=1, since=clock.now - 3)
    assert len(lines) == 2 and "after 4 s" in lines[0] and "after 9 s" in lines[1]
    # and so before a timeout that the schedule's next point would pass
    with pytest.raises(mpigc.StateError, match="within 3 s"):
        wait(100, timeout=3, warn_s=1, since=clock.now - 1.5)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "still waiting after 2 s" in lines[0]


def test_a_wait_whose_polls_are_slow_says_why_on_time(mt, monkeypatch, capsys):
    """Polls that a loaded machine makes slow (20 ms each here; under load
    27 on 2 cores, GradientSync's first 200 polls took 1.4 s): the line
    still comes at warn_s and the StateError at the timeout. Before, the
    first 200 polls read no clock, so the first line came after 4 s, said
    "after 4 s", past the 3 s timeout (test_torch_waits_mpi's uneven inputs
    failed under load: no "still waiting after 1 s")."""
    from mpigc.torch import _common
    clock = _Clock(step=0.0002)
    monkeypatch.setattr(_common, "time", clock)
    start = clock.now

    def slow_poll():
        clock.now += 0.02
        return False

    with pytest.raises(mpigc.StateError, match="within 3 s"):
        _common.wait_request(slow_poll, "GradientSync (rank 0 of 2)", _common.STEP,
                             timeout=3, warn_s=1)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "still waiting after 1 s" in lines[0], lines
    assert clock.now - start < 3.1
    # a wait that ends soon stays quick: no sleep before its 200th poll
    polls, before = [], clock.now
    _common.wait_request(lambda: len(polls) > 150 or polls.append(1), "x", _common.STEP,
                         timeout=3, warn_s=1)
    assert clock.now == before and capsys.readouterr().err == ""


def test_the_first_line_of_a_wait_comes_from_the_environment(mt, monkeypatch):
    from mpigc.torch import _common
    for env, warn_s in (("60", 60.0), ("0", None), ("2.5", 2.5)):
        monkeypatch.setenv("MPIGC_TORCH_WARN_S", env)
        assert _common.resolve_warn_s() == warn_s
    monkeypatch.delenv("MPIGC_TORCH_WARN_S")
    assert _common.resolve_warn_s() == 60.0
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv("MPIGC_TORCH_WARN_S", bad)
        with pytest.raises(mpigc.ConfigError, match="MPIGC_TORCH_WARN_S"):
            mt.GradientSync(mlp(__import__("torch")), op="2bit")


def test_an_error_in_the_ddp_hook_reaches_backward_as_itself(torch, mt, gloo_group):
    """DDP (one process, gloo) with the hook: NonFiniteError in the hook
    (nonfinite="raise", a NaN gradient) is what backward() raises, its
    message unchanged (it was "RuntimeError: Unable to cast ... to
    Tensor"), and DDP finished its step: the next steps run."""
    model = mlp(torch)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005)
    state = mt.CommHookState(ddp, op="2bit", nonfinite="raise")
    ddp.register_comm_hook(state, mt.comm_hook)
    x = torch.randn(4, 8)
    ddp(x).sum().backward()
    h = model[0].bias.register_hook(lambda g: g * float("nan"))
    with pytest.raises(mpigc.NonFiniteError, match="non-finite") as got:
        ddp(x).sum().backward()
    assert "Unable to cast" not in str(got.value)
    h.remove()
    for _ in range(2):
        ddp.zero_grad()
        ddp(x).sum().backward()
        assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())


# -- issue 45 items 4, 5: Horovod users, models under the compression cutoff ------
class FP16Compressor:
    """Stands in for Horovod's ``hvd.Compression.fp16`` (a class of that name)."""


@pytest.mark.parametrize("kwargs, way", [
    ({"named_parameters": "NAMED"}, r"named_parameters= is Horovod's: pass the model"),
    ({"compression": FP16Compressor}, r"compression= is Horovod's: .*op='fp16' here"),
    ({"backward_passes_per_step": 2}, r"backward_passes_per_step= is Horovod's: .*no_sync"),
    ({"gradient_predivide_factor": 2.0}, r"gradient_predivide_factor= is Horovod's: .*"
                                          r"average=True"),
    ({"op": 0}, r"op=0 \(Horovod's hvd.Average\?\) names a reduction: in mpigc op= is "
                r"the compressor.*average=True"),
    ({"op": 1}, r"hvd.Sum.*average=False gives the sum"),
    ({"op": 2}, r"hvd.Adasum.*adasum has no mpigc equivalent"),
    ({"op": "average"}, r"unknown compressor 'average'.*op= is the compressor"),
    ({"op": "1bit", "rel_threshold": 1.5},
     r"1bit takes parameters block_size, error_feedback; got 'rel_threshold' "
     r"\(rel_threshold=1.5 is a parameter of 2bit"),
])
def test_half_migrated_horovod_calls_say_the_mpigc_way(torch, mt, kwargs, way):
    """DistributedOptimizer (and GradientSync, which checks its arguments)
    with Horovod's keywords: a ConfigError that names the mpigc equivalent
    (before: "pass either a module or sync=", "2bit takes parameters ...;
    got 'compression'", "got int")."""
    model = mlp(torch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = dict(kwargs)
    if kwargs.get("named_parameters") == "NAMED":
        kwargs["named_parameters"] = model.named_parameters()
        make = lambda: mt.DistributedOptimizer(opt, **kwargs)  # noqa: E731
    else:
        make = lambda: mt.DistributedOptimizer(opt, model, **kwargs)  # noqa: E731
    with pytest.raises(mpigc.ConfigError, match=way):
        make()
    if "named_parameters" not in kwargs:
        with pytest.raises(mpigc.ConfigError, match=way):
            mt.GradientSync(model, **kwargs)
    # nothing stayed hooked: the model can be wrapped now
    mt.DistributedOptimizer(opt, model, op="none").sync.remove_hooks()


def test_core_allreduce_op_average_says_op_is_the_compressor():
    """mpigc.allreduce(x, op="average") or op=hvd.Sum: the error says that
    op= is the compressor here and how to average or sum (it said only
    "unknown compressor 'average'")."""
    x = np.ones(8, np.float32)
    with pytest.raises(mpigc.ConfigError, match=r"op='average' names a reduction.*"
                                                r"average=True gives the mean"):
        mpigc.allreduce(x, op="average", key="hvd-average")
    with pytest.raises(mpigc.ConfigError, match=r"average=False gives the sum"):
        mpigc.allreduce(x, op="sum", key="hvd-sum")
    with pytest.raises(mpigc.ConfigError, match=r"hvd.Average"):
        mpigc.allreduce(x, op=0, key="hvd-0")


def _uncompressed_warnings(record):
    return [w for w in record if "MPIGC_MIN_COMPRESS_BYTES" in str(w.message)]


def test_a_model_under_the_cutoff_warns_that_nothing_is_compressed(torch, mt, monkeypatch):
    """GradientSync and DistributedOptimizer whose buckets are all under
    $MPIGC_MIN_COMPRESS_BYTES (PyTorch's DDP tutorial model, a Linear(20, 1))
    compress nothing: one UserWarning at the user's line, naming the cutoff
    and the fix. Not for op="none", a cutoff of 0, or a bucket above it."""
    import warnings
    monkeypatch.delenv("MPIGC_MIN_COMPRESS_BYTES", raising=False)
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        sync = mt.GradientSync(model, op="2bit")
    got = _uncompressed_warnings(record)
    assert len(got) == 1, [str(w.message) for w in record]
    w = got[0]
    assert w.category is UserWarning and w.filename == __file__, (w.category, w.filename)
    assert "8192-byte cutoff" in str(w.message) and "84 bytes" in str(w.message)
    assert "MPIGC_MIN_COMPRESS_BYTES=0" in str(w.message)
    sync.remove_hooks()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                      op="1bit")
        for _ in range(3):  # once, at construction: not at every step
            opt.zero_grad()
            model(torch.ones(2, 20)).sum().backward()
            opt.step()
    got = _uncompressed_warnings(record)
    assert [w.filename for w in got] == [__file__], [str(w.message) for w in record]
    opt.sync.remove_hooks()
    # several small buckets of a model above the cutoff: a larger bucket fixes it
    big = mlp(torch, widths=(16,) * 11)  # 10 layers of 272 floats: 10880 bytes
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        mt.GradientSync(big, op="2bit", bucket_mb=300 * 4 / 2**20).remove_hooks()
    got = _uncompressed_warnings(record)
    assert len(got) == 1 and "bucket_mb=" in str(got[0].message), [str(w.message) for w in record]
    quiet = [lambda: mt.GradientSync(model, op="none"),
             lambda: mt.GradientSync(big, op="2bit")]
    for make in quiet:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            make().remove_hooks()
        assert not _uncompressed_warnings(record), [str(w.message) for w in record]
    monkeypatch.setenv("MPIGC_MIN_COMPRESS_BYTES", "0")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        mt.GradientSync(model, op="2bit").remove_hooks()
    assert not _uncompressed_warnings(record), [str(w.message) for w in record]


@pytest.mark.parametrize("params", [{}, {"threshold": 0.5}], ids=["groups", "ddp-buckets"])
def test_the_ddp_hook_warns_once_when_no_bucket_is_compressed(torch, mt, gloo_group,
                                                               monkeypatch, params):
    """The DDP hook, whose calls are DDP's buckets (absolute 2bit) or its own
    groups (relative 2bit), all under the cutoff: one UserWarning at the
    first step, none at the next ones."""
    import warnings
    monkeypatch.delenv("MPIGC_MIN_COMPRESS_BYTES", raising=False)
    model = mlp(torch)  # 484 floats: 1936 bytes
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = mt.CommHookState(ddp, op="2bit", **params)
    ddp.register_comm_hook(state, mt.comm_hook)
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            ddp.zero_grad()
            ddp(x).sum().backward()
    got = _uncompressed_warnings(record)
    assert len(got) == 1, [str(w.message) for w in record]
    assert "CommHookState" in str(got[0].message) and "1936 bytes" in str(got[0].message)
