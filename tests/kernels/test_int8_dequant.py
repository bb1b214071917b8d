"""The 8-bit dequantization (``ops.int8_dequant``) against its torch reference in Triton's
interpreter: fresh random products and scales, odd shapes, rows not a whole tile, fp16 overflow,
an addend (a LoRA delta) summed in the same launch with rows of zeros (rows with no adapter), and
bad operands refused. Every comparison is bit for bit: the dequantization must be bitsandbytes' own,
and the sum one rounding of the two, as adding the tensors rounds. ``test_int8_dequant_gpu.py``
runs it on the GPU against bitsandbytes itself."""

import pytest
import torch

from peft_fastlora.ops.int8_dequant import dequantize_reference, int8_dequant

DEQ = 6.200012e-05  # bitsandbytes' CUDA constant for 1 / 127^2


def product(m, n, k, seed):
    """An int32 product of int8 rows and columns over ``k`` inputs, and positive row / column scales."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int32)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int32)
    row = torch.rand(m, generator=g) * 4 + 0.01
    col = torch.rand(n, generator=g) * 0.5 + 0.001
    return a @ w.T, row, col


def delta(m, n, dtype, seed, zero_rows=()):
    """A LoRA-delta-like addend: small random values, the given rows zero."""
    g = torch.Generator().manual_seed(seed + 100)
    d = torch.randn(m, n, generator=g) * 0.05
    d[list(zero_rows)] = 0
    return d.to(dtype)


@pytest.mark.parametrize("m,n,seed", [(1, 64, 0), (5, 100, 1), (33, 130, 2), (70, 64, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dequantize_alone_is_the_reference_bit_for_bit(m, n, seed, dtype):
    acc, row, col = product(m, n, 48, seed)
    out = int8_dequant(acc, row, col, dtype)
    assert out.dtype == dtype and out.shape == (m, n)
    assert torch.equal(out, dequantize_reference(acc, row, col, dtype))


def test_dequantize_rounds_through_fp16_as_bitsandbytes_does():
    # values past fp16's range become inf, and a result in another dtype is the fp16 value cast
    acc = torch.tensor([[16129 * 64, 1, -3]], dtype=torch.int32)
    row, col = torch.tensor([127.0]), torch.tensor([127.0, 1.0, 0.5])
    out = int8_dequant(acc, row, col, torch.float32)
    assert out[0, 0] == float("inf")
    assert torch.equal(out, dequantize_reference(acc, row, col, torch.float32))
    assert out[0, 1] == torch.tensor(127.0 * DEQ, dtype=torch.float16).float()


@pytest.mark.parametrize("m,n,seed", [(1, 40, 0), (7, 130, 1), (21, 64, 2), (40, 200, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_addend_is_summed_with_one_rounding(m, n, seed, dtype):
    acc, row, col = product(m, n, 32, seed)
    zero_rows = range(2, m, 3)
    d = delta(m, n, dtype, seed, zero_rows)
    out = int8_dequant(acc, row, col, dtype, d)
    base = dequantize_reference(acc, row, col, dtype)
    assert torch.equal(out, dequantize_reference(acc, row, col, dtype, d))
    assert torch.equal(out, base + d)
    rows = torch.tensor([i in zero_rows for i in range(m)])
    assert torch.equal(out[rows], base[rows])  # rows with no adapter: the base, exactly
    if (~rows).any():
        assert not torch.equal(out[~rows], base[~rows])  # the addend matters


def test_into_a_given_output_and_empty_products():
    acc, row, col = product(6, 48, 16, 4)
    out = torch.full((6, 48), float("nan"))
    d = delta(6, 48, torch.float32, 4)
    assert int8_dequant(acc, row, col, torch.float32, d, out=out) is out
    assert torch.equal(out, dequantize_reference(acc, row, col, torch.float32) + d)
    empty = int8_dequant(acc[:0], row[:0], col, torch.float32)
    assert empty.shape == (0, 48)


def test_bad_operands_are_refused():
    acc, row, col = product(4, 32, 8, 0)
    with pytest.raises(ValueError, match="int32"):
        int8_dequant(acc.float(), row, col, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        int8_dequant(acc, row[:3], col, torch.float32)
    with pytest.raises(ValueError, match="addend"):
        int8_dequant(acc, row, col, torch.float32, delta(3, 32, torch.float32, 0))
    with pytest.raises(ValueError, match="addend"):
        int8_dequant(acc, row, col, torch.float32, delta(4, 32, torch.float16, 0))
    with pytest.raises(ValueError, match="addend"):
        int8_dequant(acc, row, col, torch.float32, delta(32, 4, torch.float32, 0).T)
