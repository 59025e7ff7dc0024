import pytest
import torch

from dist_engine.distributed.groups import resolve_backend


@pytest.mark.parametrize(("cuda", "expected"), [(True, "nccl"), (False, "gloo")])
def test_auto_backend_follows_cuda(monkeypatch, cuda, expected):
    # Both answers on every machine: asking torch here would test only the branch this host takes.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert resolve_backend("auto") == expected
    assert resolve_backend("gloo") == "gloo"


def test_nccl_is_taken_with_cuda_and_refused_without(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_backend("nccl") == "nccl"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="'nccl' but CUDA is not available"):
        resolve_backend("nccl")


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="must be auto, nccl or gloo, got 'mpi'"):
        resolve_backend("mpi")
