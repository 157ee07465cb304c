"""The CUDA math settings (splitz_fast.cuda_math): TF32 exactly where asked, the user's settings restored, through
the per-backend precision API where the running torch has it (never mixed with the legacy flags, which torch refuses
to read once the two disagree). The flags are plain process state: this runs on the CPU with a CUDA device named."""
from __future__ import annotations

import pytest
import torch

from splitz_fast import cuda_math as math_settings
from splitz_fast.cuda_math import convolutions_use_tf32, cuda_math, matmuls_use_tf32

CUDA = torch.device("cuda")


@pytest.fixture
def restored_flags():
    """Whatever a test sets, the process's flags are as they were afterwards."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    if math_settings.NEW_PRECISION_API:
        before = (cudnn.benchmark, torch.backends.fp32_precision, cudnn.fp32_precision, cudnn.conv.fp32_precision,
                  cudnn.rnn.fp32_precision, matmul.fp32_precision)
    else:
        before = (cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32)
    yield
    if math_settings.NEW_PRECISION_API:
        (cudnn.benchmark, torch.backends.fp32_precision, cudnn.fp32_precision, cudnn.conv.fp32_precision,
         cudnn.rnn.fp32_precision, matmul.fp32_precision) = before
    else:
        cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32 = before


def _state() -> tuple[bool, bool]:
    return convolutions_use_tf32(), matmuls_use_tf32()


def test_tf32_exactly_where_asked_and_the_settings_restored(restored_flags):
    """PyTorch's defaults (TF32 convolutions, IEEE matmuls): float32 must switch TF32 off, tf32 on, and the user's
    settings come back; nothing is touched off CUDA."""
    assert _state() == (True, False)
    with cuda_math(CUDA, tf32=False):
        assert _state() == (False, False) and torch.backends.cudnn.benchmark
    assert _state() == (True, False)
    with cuda_math(CUDA, tf32=True):
        assert _state() == (True, True)
    with cuda_math(torch.device("cpu"), tf32=False):
        assert _state() == (True, False)
    assert _state() == (True, False)


@pytest.mark.skipif(not math_settings.NEW_PRECISION_API, reason="this torch has only the legacy allow_tf32 flags")
def test_a_user_of_the_new_precision_api_is_followed_and_restored(restored_flags):
    """A user who set convolutions to IEEE with the per-backend API (cuDNN RNNs left at TF32): torch refuses to read
    the legacy flags then, so a switch through them would fail; the settings are read and put back in the new API."""
    torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision = "ieee", "tf32"
    with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
        torch.backends.cudnn.allow_tf32  # what the legacy switch would read
    assert _state() == (False, True)
    with cuda_math(CUDA, tf32=True):
        assert _state() == (True, True)
    assert (torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision) == ("ieee", "tf32")
    with cuda_math(CUDA, tf32=False):
        assert _state() == (False, False)
    assert _state() == (False, True)


@pytest.mark.skipif(not math_settings.NEW_PRECISION_API, reason="this torch has only the legacy allow_tf32 flags")
def test_an_inherited_precision_is_read_through_its_parents(restored_flags):
    """``"none"`` inherits: a matmul precision left at ``none`` under a global ``tf32`` is TF32."""
    torch.backends.cuda.matmul.fp32_precision = "none"
    torch.backends.fp32_precision = "tf32"
    assert matmuls_use_tf32()
