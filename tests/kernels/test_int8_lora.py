"""The 8-bit dequantization with LoRA deltas (``ops.int8_lora``) against its torch reference in
Triton's interpreter: fresh random products and scales, odd shapes, mixed ranks, an adapter on one
module only, rows with no adapter, free arena columns and B space holding NaN (never read into a
result), rows not a whole tile, and bad operands refused. The dequantized base is compared bit for
bit (it must be bitsandbytes' own); the deltas within a tolerance per dtype. ``test_int8_lora_gpu.py``
runs it on the GPU against bitsandbytes itself."""

import pytest
import torch

from peft_fastlora.ops.int8_lora import (Int8Lora, dequantize_reference, int8_dequant_lora,
                                         int8_dequant_lora_reference)

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3)}
DEQ = 6.200012e-05  # bitsandbytes' CUDA constant for 1 / 127^2


def product(m, n, k, seed):
    """An int32 product of int8 rows and columns over ``k`` inputs, and positive row / column scales."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int32)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int32)
    row = torch.rand(m, generator=g) * 4 + 0.01
    col = torch.rand(n, generator=g) * 0.5 + 0.001
    return a @ w.T, row, col


def lora_case(m, widths, slot_ranks, dtype, seed, gap=3, row_slots=None):
    """An ``Int8Lora`` laid out as ``lora.pool`` packs a site: module j's region of the A arena holds
    each slot's block (``slot_ranks[s][j]`` rows, none for rank 0) with ``gap`` free rows after it;
    free tail columns and B space hold NaN. Rows take the slots in turn, every third none."""
    g = torch.Generator().manual_seed(seed)
    slots, c = len(slot_ranks), len(widths)
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    a_rows = torch.zeros(slots, c, dtype=torch.int32)
    b_offs = torch.zeros(slots, c, dtype=torch.int64)
    col, elem, blocks = 0, 0, []
    for j in range(c):
        for s in range(slots):
            r = slot_ranks[s][j]
            if r:
                a_rows[s, j], b_offs[s, j] = col, elem
                blocks.append((col, r, elem, widths[j]))
                col += r + gap
                elem += widths[j] * r + gap
    tail = torch.full((m, col + 2), float("nan"))
    b = torch.full((elem + 4,), float("nan"))
    for c0, r, e0, w in blocks:
        tail[:, c0: c0 + r] = torch.randn(m, r, generator=g)
        b[e0: e0 + w * r] = torch.randn(w * r, generator=g) / r ** 0.5
    if row_slots is None:
        row_slots = [-1 if i % 3 == 2 else i % slots for i in range(m)]
    scalings = torch.tensor([[0.5 + s + 0.25 * j for j in range(c)] for s in range(slots)], dtype=torch.float32)
    return Int8Lora(tail.to(dtype), b.to(dtype), torch.tensor(row_slots + [0, 1], dtype=torch.int32),
                    torch.tensor(slot_ranks, dtype=torch.int32), scalings, a_rows, b_offs, tuple(offsets))


@pytest.mark.parametrize("m,n,seed", [(1, 64, 0), (5, 100, 1), (33, 130, 2), (70, 64, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dequantize_alone_is_the_reference_bit_for_bit(m, n, seed, dtype):
    acc, row, col = product(m, n, 48, seed)
    out = int8_dequant_lora(acc, row, col, dtype)
    assert out.dtype == dtype and out.shape == (m, n)
    assert torch.equal(out, dequantize_reference(acc, row, col, dtype))


def test_dequantize_rounds_through_fp16_as_bitsandbytes_does():
    # values past fp16's range become inf, and a bf16 result is the fp16 value cast again
    acc = torch.tensor([[16129 * 64, 1, -3]], dtype=torch.int32)
    row, col = torch.tensor([127.0]), torch.tensor([127.0, 1.0, 0.5])
    out = int8_dequant_lora(acc, row, col, torch.float32)
    assert out[0, 0] == float("inf")
    assert torch.equal(out, dequantize_reference(acc, row, col, torch.float32))
    assert out[0, 1] == torch.tensor(127.0 * DEQ, dtype=torch.float16).float()



@pytest.mark.parametrize("m,widths,slot_ranks,seed", [
    (7, (64, 16, 16), [(4, 4, 4), (8, 0, 8), (16, 16, 0)], 0),  # q/k/v-like, mixed ranks, a module skipped
    (21, (48, 48), [(2, 2), (0, 8)], 1),  # gate/up-like, widths not a whole column tile
    (3, (40,), [(8,), (4,), (1,)], 2),  # one layer, more slots than rows
    (40, (64,), [(32,), (16,)], 3),  # rows past one tile, rank 32
    (9, (32, 16), [(16, 8)] * 5 + [(8, 16)], 4),  # a module's blocks past one dot's columns
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_deltas_equal_the_reference(m, widths, slot_ranks, seed, dtype):
    n = sum(widths)
    acc, row, col = product(m, n, 32, seed)
    lora = lora_case(m, widths, slot_ranks, dtype, seed)
    out = int8_dequant_lora(acc, row, col, dtype, lora)
    ref = int8_dequant_lora_reference(acc, row, col, dtype, lora)
    assert torch.isfinite(out).all()
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    base = dequantize_reference(acc, row, col, dtype)
    slots = lora.token_slot[:m]
    assert torch.equal(out[slots < 0], base[slots < 0])  # rows with no adapter: the base, exactly
    assert not torch.allclose(out[slots >= 0], base[slots >= 0])  # the deltas matter


def test_rows_of_one_adapter_and_all_base_rows():
    acc, row, col = product(17, 64, 16, 5)
    for row_slots in ([1] * 17, [-1] * 17):
        lora = lora_case(17, (32, 32), [(4, 8), (8, 4)], torch.float32, 5, row_slots=row_slots)
        out = int8_dequant_lora(acc, row, col, torch.float32, lora)
        torch.testing.assert_close(out, int8_dequant_lora_reference(acc, row, col, torch.float32, lora),
                                   atol=1e-5, rtol=1e-5)
    assert torch.equal(out, dequantize_reference(acc, row, col, torch.float32))


def test_bad_operands_are_refused():
    acc, row, col = product(4, 32, 8, 0)
    with pytest.raises(ValueError, match="int32"):
        int8_dequant_lora(acc.float(), row, col, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        int8_dequant_lora(acc, row[:3], col, torch.float32)
    lora = lora_case(2, (32,), [(4,)], torch.float32, 0)
    with pytest.raises(ValueError, match="every row"):
        int8_dequant_lora(acc, row, col, torch.float32, lora)
