"""The low-precision quantizers against golden vectors: E4M3 bytes of hand-encoded values, the
zero block, ties at a grid midpoint, saturation, E8M0 exponents at and just above powers of two,
and shapes a format cannot take."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_core.precision import e8m0, fp4, fp8, int4, mx, nvfp4


def _bytes(q: torch.Tensor) -> list[int]:
    return q.view(torch.uint8).flatten().tolist()


def test_e4m3_values_encode_to_their_hand_computed_bytes_and_saturate():
    # sign | exponent (bias 7) | 3 mantissa bits; 17 is the tie between 16 and 18: even → 16
    q, s = fp8.quantize_per_tensor(torch.tensor([448.0, 1.0, -0.5, 17.0]))
    assert s.tolist() == [1.0]
    assert _bytes(q) == [0x7E, 0x38, 0xB0, 0x58]
    sat = fp8.cast_e4m3(torch.tensor([500.0, -1e30, float("nan")]))
    assert sat.float()[:2].tolist() == [448.0, -448.0] and sat.float()[2].isnan()


def test_e4m3_subnormals_encode_exactly_and_their_ties_go_to_even():
    # with amax 448 the scale is 1: 2^-9 is the smallest subnormal (byte 1), 2^-7 is byte 4,
    # 1.5 · 2^-9 ties between bytes 1 and 2 (→ 2, even), 0.5 · 2^-9 ties with 0 (→ 0)
    x = torch.tensor([448.0, 2.0**-9, 2.0**-7, 1.5 * 2.0**-9, 0.5 * 2.0**-9, -(2.0**-9)])
    q, s = fp8.quantize_per_tensor(x)
    assert s.tolist() == [1.0]
    assert _bytes(q) == [0x7E, 0x01, 0x04, 0x02, 0x00, 0x81]


def test_a_zero_block_quantizes_to_zero_with_a_positive_scale():
    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(0))
    w[128:, :128] = 0
    q, s = fp8.quantize_block(w)
    assert s.shape == (2, 3) and bool((s > 0).all()) and bool(s.isfinite().all())
    assert _bytes(q[128:, :128]) == [0] * 128 * 128
    assert fp8.dequantize_block(q, s)[128:, :128].abs().sum() == 0
    zeros, scale = fp8.quantize_per_tensor(torch.zeros(3))
    assert _bytes(zeros) == [0, 0, 0] and scale.item() > 0


def test_block_scales_come_from_each_block_alone_and_padding_raises_none():
    w = torch.randn(300, 260, generator=torch.Generator().manual_seed(1))
    q, s = fp8.quantize_block(w)
    assert q.shape == w.shape and s.shape == (3, 3)
    corner = w[256:, 256:]  # a 44 × 4 block, zero-padded to 128 × 128
    assert s[2, 2] == corner.abs().amax() / 448
    err = (fp8.dequantize_block(q, s) - w).abs()
    bound = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :260] * 16  # half ulp
    assert bool((err <= bound).all())
    with pytest.raises(ValueError, match="2-D weight"):
        fp8.quantize_block(torch.ones(4))


def test_the_scale_divides_and_never_multiplies_by_its_reciprocal():
    """x / s lands exactly on the tie 17 (→ 16); x · (1/s) lands one ulp above it (→ 18)."""
    amax = torch.tensor(0.46164819598197937)
    s = amax / 448
    x = torch.tensor(17.0) * s
    assert (x / s).item() == 17.0 and (x * (1 / s)).item() > 17.0
    q, scale = fp8.quantize_per_tensor(torch.stack([amax, x]))
    assert scale.item() == s.item()
    assert q.float().tolist() == [448.0, 16.0]


@pytest.mark.parametrize("k", range(-30, 30, 7))
def test_rceil_takes_the_next_power_of_two_just_above_one(k):
    exact = torch.tensor([2.0**k * 448])
    above = torch.tensor([math.ldexp(1 + 2**-23, k) * 448])
    assert e8m0.rceil(exact, 448).item() == k + 127
    assert (above / 448).item() > 2.0**k  # the division keeps the step above 2^k
    assert e8m0.rceil(above, 448).item() == k + 128
    # a float log2 rounds the step away for |k| ≥ 4: what the integer bits avoid
    if abs(k) >= 4:
        assert math.ceil(torch.log2(above / 448).item()) == k


def test_e8m0_special_values_and_bytes():
    special = torch.tensor([0.0, float("inf"), float("nan")])
    assert e8m0.rceil(special, 448).tolist() == [0, 254, 255]
    assert e8m0.floor(torch.tensor([0.0, 448.0, 500.0, 1.0]), 8).tolist() == [0, 127, 127, 119]
    values = e8m0.value(torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8))
    assert values[:4].tolist() == [2.0**-127, 2.0**-126, 1.0, 2.0**127] and values[4].isnan()


def test_mxfp8_rceil_fits_a_block_that_floor_saturates():
    """amax 500: RCEIL's scale 2 keeps it (250, the nearest E4M3 256), FLOOR's scale 1
    saturates it to 448."""
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 500.0, -3.0
    q, e = mx.quantize_mxfp8(w)
    assert e.tolist() == [[128]] and q.float()[0, :2].tolist() == [256.0, -1.5]
    assert mx.dequantize_mxfp8(q, e)[0, :2].tolist() == [512.0, -3.0]
    q, e = mx.quantize_mxfp8(w, rule="floor")
    assert e.tolist() == [[127]] and q.float()[0, 0].item() == 448.0


def test_mxfp8_round_trips_within_half_an_e4m3_ulp_and_keeps_zero_blocks():
    w = torch.randn(8, 96, generator=torch.Generator().manual_seed(2)) * 5
    w[3, 32:64] = 0
    q, e = mx.quantize_mxfp8(w)
    assert e.shape == (8, 3) and e.dtype == torch.uint8 and e[3, 1] == 0
    x = mx.dequantize_mxfp8(q, e)
    bound = e8m0.value(e).repeat_interleave(32, 1) * 16  # 448 < 2^9: half ulp ≤ 16 · X
    assert bool(((x - w).abs() <= bound).all())
    assert x[3, 32:64].abs().sum() == 0


def test_a_last_dim_mx_cannot_block_is_refused():
    with pytest.raises(ValueError, match=r"shape \(4, 33\) does not divide"):
        mx.quantize_mxfp8(torch.ones(4, 33))
    with pytest.raises(ValueError, match="unknown MX scale rule"):
        mx.quantize_mxfp8(torch.ones(1, 32), rule="even")


def test_e2m1_rounds_ties_to_the_even_code_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, -0.1, -6.5, 0.26])
    got = fp4.decode(fp4.encode(x)).tolist()
    assert got == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.0, -6.0, 0.5]
    assert fp4.encode(torch.tensor([-0.1])).tolist() == [8]  # −0 keeps its sign
    grid = torch.tensor(fp4.GRID)
    assert fp4.decode(fp4.encode(grid)).tolist() == list(fp4.GRID)  # every value is exact


def test_fp4_packs_the_even_element_in_the_low_nibble():
    codes = fp4.encode(torch.tensor([1.0, -6.0, 0.5, 3.0]))  # codes 2, 15, 1, 5
    assert fp4.pack(codes).tolist() == [2 | 15 << 4, 1 | 5 << 4]
    assert torch.equal(fp4.unpack(fp4.pack(codes)), codes)
    with pytest.raises(ValueError, match="last dim 3 is odd"):
        fp4.pack(codes[:3])


def test_mxfp4_round_trips_within_its_grid_step():
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    packed, e = mx.quantize_mxfp4(w)
    assert packed.shape == (4, 32) and e.shape == (4, 2)
    x = mx.dequantize_mxfp4(packed, e)
    bound = e8m0.value(e).repeat_interleave(32, 1)  # RCEIL: no saturation, half step ≤ 1 · X
    assert bool(((x - w).abs() <= bound).all())
    amax = w.view(4, 2, 32).abs().amax(-1)  # RCEIL: every block's amax fits 6 · X
    assert bool((amax <= 6 * e8m0.value(e)).all()) and bool((amax > 3 * e8m0.value(e)).all())


def _nvfp4_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    grid = torch.tensor(fp4.GRID)
    mids = (grid[1:] + grid[:-1]) / 2  # every E2M1 tie, scaled so the block scale is exact
    ties = torch.cat([mids, -mids, torch.tensor([6.0, -6.0])]).repeat(2, 1)
    zero_block = torch.randn(4, 64, generator=g)
    zero_block[1, 16:32] = 0
    return {
        "random": 16 * torch.randn(32, 128, generator=g),
        "bf16": torch.randn(8, 64, generator=g).bfloat16().float(),
        "ties": ties,
        "zero_block": zero_block,
        "zeros": torch.zeros(2, 32),
        "tiny": torch.full((2, 16), 1e-30),  # scales underflow e4m3: subnormal or zero
        "near_pow2": torch.tensor([[math.ldexp(1 + 2**-23, 3)] + [0.5] * 15] * 2),
        "huge": torch.tensor([[3e38] + [1.0] * 15]),
    }


@pytest.mark.parametrize("case", list(_nvfp4_inputs()))
def test_nvfp4_is_transformer_engines_reference_bit_for_bit(case):
    from tests import nvfp4_reference

    x = _nvfp4_inputs()[case]
    packed, s8, g_dec = nvfp4.quantize(x)
    ref_packed, ref_s8 = nvfp4_reference.quantize(x, x.abs().amax())
    assert packed.tolist() == ref_packed.tolist()
    assert _bytes(s8) == _bytes(ref_s8)
    assert bool(nvfp4.dequantize(packed, s8, g_dec).isfinite().all())
    if case in ("zeros", "zero_block"):
        rows = x == 0
        assert bool((nvfp4.dequantize(packed, s8, g_dec)[rows] == 0).all())


def test_nvfp4_gate_and_up_share_one_global_scale():
    g = torch.Generator().manual_seed(4)
    gate, up = torch.randn(8, 32, generator=g), 5 * torch.randn(8, 32, generator=g)
    (gp, gs, gd), (upk, us, ud) = nvfp4.quantize_pair(gate, up)
    assert gd.item() == ud.item() == nvfp4.global_decode_scale(up.abs().amax()).item()
    shared = nvfp4.quantize(gate, up.abs().amax())
    assert torch.equal(gp, shared[0]) and _bytes(gs) == _bytes(shared[1])
    assert _bytes(gs) != _bytes(nvfp4.quantize(gate)[1])  # its own amax would scale otherwise
    with pytest.raises(ValueError, match="by 16"):
        nvfp4.quantize(torch.ones(2, 24))


def test_int4_groups_round_half_even_within_seven_levels():
    # group of 8: amax 3.5 → s = 0.5; 0.25 / 0.5 = 0.5 → 0 and 0.75 / 0.5 = 1.5 → 2 (even)
    w = torch.tensor([[3.5, 0.25, 0.75, -3.5, -0.25, 1.0, 0.0, -1.25]])
    q, s = int4.quantize(w, 8)
    assert s.tolist() == [[0.5]]
    assert q.tolist() == [[7, 0, 2, -7, 0, 2, 0, -2]]
    assert int4.dequantize(q, s).tolist() == [[3.5, 0.0, 1.0, -3.5, 0.0, 1.0, 0.0, -1.0]]
    zq, zs = int4.quantize(torch.zeros(1, 8), 8)
    assert zs.item() == pytest.approx(1e-5) and zq.abs().sum() == 0
    with pytest.raises(ValueError, match="INT4 blocks the last dim by 8"):
        int4.quantize(torch.ones(2, 12), 8)


def test_int4_packs_eight_offset_nibbles_per_int32_low_first():
    q = torch.tensor([[-7, -1, 0, 1, 7, 3, -3, 7]], dtype=torch.int8)
    packed = int4.pack(q)
    nibbles = [v + 8 for v in q.flatten().tolist()]
    word = sum(n << (4 * j) for j, n in enumerate(nibbles))
    assert packed.dtype == torch.int32
    assert packed.item() == word - (1 << 32 if word >= 1 << 31 else 0)
    assert int4.unpack(packed).tolist() == q.tolist()
    big = torch.randint(
        -7, 8, (16, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(5)
    )
    assert torch.equal(int4.unpack(int4.pack(big)), big)


def _mx_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(6)
    return {
        "random": 16 * torch.randn(64, 256, generator=g),
        "bf16": torch.randn(32, 64, generator=g).bfloat16().float(),
        "zeros": torch.zeros(2, 64),
        "boundary": torch.linspace(-512, 512, 64).repeat(2, 1) + 1e-3,
        "saturating": torch.tensor([[500.0] + [1.0] * 31]),
    }


TORCHAO = Path(__file__).parents[1] / ".venv" / "torchao"


@pytest.fixture(scope="module")
def torchao_mx(tmp_path_factory):
    """torchao 0.18's bytes for every MX input, from its own process (tests/torchao_mx_oracle.py)."""
    assert (TORCHAO / "torchao").is_dir(), f"torchao is missing: run `make {TORCHAO}/.installed`"
    d = tmp_path_factory.mktemp("torchao")
    inputs = {**_mx_inputs(), "near_pow2": _NEAR_POW2}
    torch.save(inputs, d / "in.pt")
    env = {**os.environ, "PYTHONPATH": str(TORCHAO)}
    oracle = Path(__file__).with_name("torchao_mx_oracle.py")
    subprocess.run([sys.executable, str(oracle), str(d / "in.pt"), str(d / "out.pt")], env=env,
                   check=True, timeout=300)  # fmt: skip
    return torch.load(d / "out.pt")


@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize("case", list(_mx_inputs()))
def test_mx_formats_match_torchao_byte_for_byte(torchao_mx, case, rule):
    x = _mx_inputs()[case]
    q, e = mx.quantize_mxfp8(x, rule)
    assert torchao_mx[(case, "e4m3", rule)] == (e.flatten().tolist(), _bytes(q))
    packed, e4 = mx.quantize_mxfp4(x, rule)
    assert torchao_mx[(case, "e2m1", rule)] == (e4.flatten().tolist(), packed.flatten().tolist())


# amax / 448 = 2^-6 · (1 + 2^-23): RCEIL's scale is 2^-5
_NEAR_POW2 = torch.tensor([[math.ldexp(1 + 2**-23, -6) * 448] + [0.1] * 31])


def test_torchao_018_rceil_misses_the_step_just_above_a_power_of_two(torchao_mx):
    """Where torchao 0.18 is wrong (a float log2 rounds the step away); FLOOR agrees."""
    _, e = mx.quantize_mxfp8(_NEAR_POW2, "rceil")
    assert e.item() == -6 + 128
    assert torchao_mx[("near_pow2", "e4m3", "rceil")][0] == [-6 + 127]
    q, e = mx.quantize_mxfp8(_NEAR_POW2, "floor")
    assert torchao_mx[("near_pow2", "e4m3", "floor")] == (e.flatten().tolist(), _bytes(q))
