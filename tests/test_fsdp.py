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
