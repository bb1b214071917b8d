"""The decode expand's wide launch (``ops.lora_expand_wide``: rank-sized column spans) against the
torch backend and against the expand's other launch, under the Triton interpreter: fresh random
inputs, widths that cut spans and tiles, ranks of every class (1 to 128, not multiples of 16),
chunks of one to 16 rows, rows with no adapter, padded and packed B, and the shrink read from the
columns of a folded GEMM."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from peft_fastlora.backend.torch_native import TorchNativeLoRABackend  # noqa: E402
from peft_fastlora.backend.triton import TritonLoRABackend  # noqa: E402
from peft_fastlora.batch import NO_ADAPTER, ForwardBatch, ForwardMode  # noqa: E402

from _helpers import pack  # noqa: E402
from test_triton_kernels import TOLERANCES, DTYPE_IDS, assert_close, check_untouched, poisoned_base  # noqa: E402

CPU = torch.device("cpu")
# (offsets of the modules, slot ranks per module): wide modules cut the 256-column spans of 4K
# tiles (and the tiles of the larger rank classes); a narrow one shrinks the tile
SITES = {
    "qkv_wide": ([0, 300, 337, 374], [[8, 8, 8], [72, 0, 40], [128, 128, 24], [1, 16, 33]]),
    "o_narrow": ([0, 37], [[64], [5], [128], [17]]),
    "five": ([0, 264, 300, 530, 531, 600], [[16] * 5, [64, 8, 32, 1, 128], [24] * 5, [0, 8, 0, 8, 0]]),
}
# rows per adapter slot (NO_ADAPTER rows in between): one-row chunks, 16-row chunks and a 17th row
COMPOSITIONS = {
    "one_row_each": [0, 1, 2, 3, NO_ADAPTER, 3, 2],
    "skewed": [1] * 17 + [NO_ADAPTER, 0, 3] + [2] * 5,
    "all_base": [NO_ADAPTER] * 5,
}


def inputs(site, comp, dtype, seed):
    offsets, slot_ranks = SITES[site]
    c = len(offsets) - 1
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.tensor(slot_ranks, dtype=torch.int32)
    r_max = int(ranks.max())
    scalings = (torch.rand(ranks.shape, generator=gen) * 2 + 0.25).float()
    wi = COMPOSITIONS[comp]
    tok = torch.tensor(wi)
    y = torch.randn(len(wi), c * r_max, generator=gen)
    b = torch.randn(len(slot_ranks), offsets[-1], r_max, generator=gen) / 4
    for s in range(len(slot_ranks)):  # NaN past each rank: a read there shows
        for j in range(c):
            b[s, offsets[j]:offsets[j + 1], int(ranks[s, j]):] = float("nan")
            y[tok == s, j * r_max + int(ranks[s, j]):(j + 1) * r_max] = float("nan")
    y[tok < 0] = float("nan")
    fb = ForwardBatch(len(wi), [1] * len(wi), ForwardMode.DECODE, CPU)
    tri, ref = TritonLoRABackend(len(slot_ranks), CPU), TorchNativeLoRABackend(len(slot_ranks), CPU)
    for be in (tri, ref):
        be.prepare_lora_batch(fb, wi, ranks[:, 0].tolist(), [1.0] * len(slot_ranks), use_cuda_graph=False)
    base = poisoned_base(tok, offsets[-1], dtype)
    return offsets, ranks.contiguous(), scalings.contiguous(), tok, y.to(dtype), b.to(dtype), base, tri, ref


def expand(tri, y, b, offsets, ranks, scalings, base, wide, **kw):
    from peft_fastlora.ops import lora_expand

    bi = tri.batch_info
    return lora_expand(y, b, offsets, ranks, scalings, base.clone(), bi.sorted_token_ids, bi.chunk_slot,
                       bi.chunk_start, bi.chunk_len, block_m=bi.block_m, wide=wide, **kw)


@pytest.mark.parametrize("comp", list(COMPOSITIONS))
@pytest.mark.parametrize("site", list(SITES))
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=DTYPE_IDS)
def test_wide_equals_torch_and_the_other_launch(dtype, atol, rtol, site, comp):
    offsets, ranks, scalings, tok, y, b, base, tri, ref = inputs(site, comp, dtype, seed=len(site) + len(comp))
    assert tri.batch_info.block_m == 16
    want = ref._expand_checked(y, b, offsets, base.clone(), ranks, scalings, ref.batch_info)
    for wide in (True, False):
        got = expand(tri, y, b, offsets, ranks, scalings, base, wide)
        assert not got.isnan().any(), f"wide={wide}: read past a rank"
        check_untouched(got, base, tok)
        assert_close(got, want, atol, rtol, f"expand {site} ({comp}, wide={wide})")


@pytest.mark.parametrize("folded", [False, True])
@pytest.mark.parametrize("site", list(SITES))
@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES, ids=DTYPE_IDS)
def test_wide_packed(dtype, atol, rtol, site, folded):
    """Packed B (shuffled blocks, NaN gaps): equal to the padded expand; ``folded``: the shrink read
    from the columns of each slot's A rows (``y_cols``), as after a GEMM over [W; A]."""
    offsets, ranks, scalings, tok, y, b, base, tri, ref = inputs(site, "skewed", dtype, seed=7)
    c, r_max = len(offsets) - 1, b.shape[2]
    want = ref._expand_checked(y, b, offsets, base.clone(), ranks, scalings, ref.batch_info)
    a = torch.zeros(b.shape[0], c * r_max, 3, dtype=dtype)
    w = pack(a, b, offsets, ranks, seed=3)
    kw = dict(b_offs=w.b_offs, b_align=w.align)
    y_in = y
    if folded:
        # y's columns moved to each (slot, module)'s A rows; NaN in every other column
        y_in = torch.full((y.shape[0], w.a.shape[0] + 5), float("nan"), dtype=dtype)[:, 5:]
        for s in range(b.shape[0]):
            for j in range(c):
                rk, row = int(ranks[s, j]), int(w.a_rows[s, j])
                y_in[:, row:row + rk] = y[:, j * r_max:j * r_max + rk]
        kw.update(y_cols=w.a_rows, max_rank=w.max_rank)
    got = expand(tri, y_in, w.b, offsets, ranks, scalings, base, True, **kw)
    assert not got.isnan().any(), "read outside a block or a slot's columns"
    check_untouched(got, base, tok)
    assert_close(got, want, atol, rtol, f"packed wide expand {site} (folded={folded})")


def test_wide_chosen_for_decode_tiles_only():
    """The default takes the wide launch for row tiles of up to 16 and ranks up to 128; asked for
    elsewhere, it is an error naming the limit."""
    import importlib

    le = importlib.import_module("peft_fastlora.ops.lora_expand")

    offsets, ranks, scalings, tok, y, b, base, tri, ref = inputs("o_narrow", "one_row_each", torch.float32, 0)
    calls = []
    orig = le.launch_wide
    le.launch_wide = lambda *a, **k: calls.append(k["block_m"]) or orig(*a, **k)
    try:
        expand(tri, y, b, offsets, ranks, scalings, base, None)
        assert calls == [16]
        bi = tri.batch_info
        with pytest.raises(ValueError, match="wide launch takes row tiles of up to 16"):
            le.lora_expand(y, b, offsets, ranks, scalings, base.clone(), bi.sorted_token_ids, bi.chunk_slot,
                           bi.chunk_start, bi.chunk_len, block_m=32, wide=True)
        big = torch.zeros(b.shape[0], b.shape[1], 136, dtype=b.dtype)
        big_y = torch.zeros(y.shape[0], 136, dtype=y.dtype)
        with pytest.raises(ValueError, match="ranks up to 128, got 16 and 136"):
            expand(tri, big_y, big, offsets, ranks, scalings, base, True)
        expand(tri, big_y, big, offsets, ranks, scalings, base, None)  # the other launch
        assert calls == [16]
    finally:
        le.launch_wide = orig
