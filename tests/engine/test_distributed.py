import pytest
import torch

from dist_engine.distributed.groups import resolve_backend


def test_auto_backend_follows_cuda():
    expected = "nccl" if torch.cuda.is_available() else "gloo"
    assert resolve_backend("auto") == expected
    assert resolve_backend("gloo") == "gloo"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_nccl_without_cuda_is_refused():
    with pytest.raises(ValueError, match="'nccl' but CUDA is not available"):
        resolve_backend("nccl")


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="must be auto, nccl or gloo, got 'mpi'"):
        resolve_backend("mpi")
