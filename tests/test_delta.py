"""Disk-delta encodings: exact for any two tensors, small for small updates."""

import pytest
import torch

from miles_core.weights import delta

INT = {4: torch.int32, 2: torch.int16}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_delta_decodes_to_the_exact_bytes(dtype):
    g = torch.Generator().manual_seed(0)
    old = torch.randn(3, 1001, generator=g).to(dtype)
    cases = {
        "one ulp": (old.view(INT[old.element_size()]) + 1).view(dtype),
        "big changes": old + torch.randn(old.shape, generator=g).to(dtype),
        "same": old.clone(),
    }
    special = old.clone().view(-1)
    special[:4] = torch.tensor([float("nan"), float("inf"), -0.0, -float("inf")]).to(dtype)
    cases["specials"] = special.view(old.shape)
    for what, new in cases.items():
        encoding, packed = delta.encode(new, old)
        out = delta.decode(packed, old, encoding)
        assert out.shape == new.shape and out.dtype == new.dtype
        assert torch.equal(out.view(torch.uint8), new.view(torch.uint8)), what


def test_bit_patterns_at_the_ends_of_the_integer_range_round_trip():
    old = torch.tensor([32767, -32768, 7], dtype=torch.int16).view(torch.bfloat16)
    new = torch.tensor([-32768, 32767, 8], dtype=torch.int16).view(torch.bfloat16)
    encoding, packed = delta.encode(new, old)
    assert torch.equal(delta.decode(packed, old, encoding).view(torch.int16), new.view(torch.int16))


def test_a_small_bf16_update_encodes_to_a_small_fraction_and_fp32_picks_xor():
    g = torch.Generator().manual_seed(1)
    w = 0.02 * torch.randn(200_000, generator=g)
    step = 1e-5 * torch.sign(torch.randn(w.shape, generator=g))
    encoding, packed = delta.encode((w + step).bfloat16(), w.bfloat16())
    assert encoding == delta.ULP and packed.numel() < 0.1 * w.numel() * 2
    encoding, packed = delta.encode(w + step, w)  # fp32: nearly every element moves many ulps
    assert encoding == delta.XOR and packed.numel() < 0.75 * w.numel() * 4


def test_bad_deltas_are_refused():
    old = torch.randn(10)
    encoding, packed = delta.encode(old + 1, old)
    with pytest.raises(ValueError, match="unknown delta encoding"):
        delta.decode(packed, old, "gzip")
    with pytest.raises(ValueError, match="does not match the base"):
        delta.decode(packed, torch.randn(11), encoding)
    with pytest.raises(ValueError, match="same dtype and size"):
        delta.encode(old.bfloat16(), old)
