"""The noise of a sample is a function of its index only (not of batching), written into a given buffer and cast after
the float32 sum."""
from __future__ import annotations

import pytest
import torch

from splitz_fast.sampling.engine import NOISE_BLOCK, NoiseStream


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------- noise streams
@pytest.mark.parametrize("backend", ["auto", "reference"])  # the Philox stream (native kernel), the fallback
@pytest.mark.parametrize("channels_last", [False, True])
def test_noise_stream_is_a_function_of_the_sample_index_only(channels_last, backend, monkeypatch):
    monkeypatch.setenv("SPLITZ_BACKEND", backend)
    latent = torch.rand(3, 4, 5, generator=_gen(1))
    whole = NoiseStream(7, torch.device("cpu")).noisy(latent, 300, 0.5, torch.float32, channels_last)
    for sizes in ([1, 63, 64, 65, 107], [300], [NOISE_BLOCK] * 4 + [44], [17] * 17 + [11]):
        stream = NoiseStream(7, torch.device("cpu"))
        parts = [stream.noisy(latent, k, 0.5, torch.float32, channels_last) for k in sizes]
        assert torch.equal(torch.cat(parts), whole), sizes
        assert stream.offset == 300
    other_seed = NoiseStream(8, torch.device("cpu")).noisy(latent, 300, 0.5, torch.float32, channels_last)
    assert not torch.equal(other_seed, whole)
    if channels_last:
        assert whole.is_contiguous(memory_format=torch.channels_last)


def test_noise_stream_writes_into_a_given_buffer_and_casts_after_the_float32_sum():
    latent = torch.rand(6, generator=_gen(2))
    ref = NoiseStream(3, torch.device("cpu")).noisy(latent, 40, 0.3, torch.float32, False)
    out = torch.full((40, 6), float("nan"), dtype=torch.bfloat16)
    got = NoiseStream(3, torch.device("cpu")).noisy(latent, 40, 0.3, torch.bfloat16, False, out=out)
    assert got is out and torch.equal(out, ref.to(torch.bfloat16))
