"""mpigc.torch.register_fsdp_hooks in one process (no mpirun): its errors."""
import pytest

import mpigc

torch = pytest.importorskip("torch")
import mpigc.torch as mt  # noqa: E402


def test_exported_beside_the_ddp_hook():
    assert "register_fsdp_hooks" in mt.__all__ and "FsdpHookState" in mt.__all__
    assert mt.register_fsdp_hooks.__module__ == mt.CommHookState.__module__.replace(
        "_hook", "_fsdp")


def test_not_fsdp():
    with pytest.raises(mpigc.ConfigError, match="no FSDP2 module.*fully_shard"):
        mt.register_fsdp_hooks(torch.nn.Linear(3, 3), op="2bit", threshold=0.5)


def test_not_a_module():
    with pytest.raises(mpigc.ConfigError, match="expected a torch.nn.Module"):
        mt.register_fsdp_hooks([torch.zeros(3)], op="none")


def test_bad_op():
    with pytest.raises(mpigc.ConfigError):
        mt.register_fsdp_hooks(torch.nn.Linear(3, 3), op="nonsense")


def test_bad_feedback():
    with pytest.raises(mpigc.ConfigError, match="feedback"):
        mt.register_fsdp_hooks(torch.nn.Linear(3, 3), op="none", feedback=3)


@pytest.mark.parametrize("n_ranks", [1, 2, 3, 4, 5])
def test_checkpoint_rows_follow_fsdp_layout(n_ranks):
    """The DCP record's layout conversion is FSDP's own (torch._chunk_cat on
    dim 0, padded): parameter elements -> flat -> elements round trip, and
    the flat layout equals _chunk_cat's."""
    from mpigc.torch import _fsdp
    shapes = [[7, 5], [7], [3, 7], [3], [1, 2, 2]]
    params = [torch.arange(1.0, 1 + int(torch.tensor(s).prod())).reshape(s) * (i + 1)
              for i, s in enumerate(shapes)]
    want = torch._chunk_cat(params, dim=0, num_chunks=n_ranks).reshape(-1).numpy()
    flat = _fsdp._from_params([p.reshape(-1).numpy() for p in params], shapes, n_ranks,
                              want.dtype)
    assert (flat == want).all()
    back = _fsdp._to_params(flat, shapes, n_ranks)
    assert all((b == p.reshape(-1).numpy()).all() for b, p in zip(back, params))
