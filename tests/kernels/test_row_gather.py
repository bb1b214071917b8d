"""``ops.row_gather``: rows listed by a table on the device into the first rows of a buffer,
against plain indexing. A copy is exact: every dtype is compared bit for bit. On CPU under
Triton's interpreter (conftest) and through the torch reference; ``test_row_gather_gpu.py``
replays the launch in a CUDA graph."""

import random

import pytest
import torch

pytest.importorskip("triton")

import peft_fastlora.ops.row_gather as rg  # noqa: E402
from peft_fastlora.ops.row_gather import GATHER_BLOCK, gather_rows  # noqa: E402


def gather_case(device, dtype, rows, cols, picked, seed, dst_rows=None, stale=()):
    """A random ``src`` (rows, cols), a sentinel-filled ``dst``, the table listing ``picked`` (then
    ``stale`` entries past the count, which must be ignored) and the expected ``dst``."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(rows, cols, generator=g).to(dtype).to(device)
    dst = torch.full((dst_rows or max(1, len(picked)) + 2, cols), -7.0, dtype=dtype, device=device)
    table = torch.tensor([len(picked)] + list(picked) + list(stale), dtype=torch.int32, device=device)
    want = dst.clone()
    for i, r in enumerate(picked):
        want[i] = src[r] if 0 <= r < rows else 0
    return src, table, dst, want


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_listed_rows_land_first_in_table_order(use_kernel, dtype, monkeypatch):
    """Fresh random picks (repeats, out of order, the last row), columns around the block (one, a
    block less one, a block and one, a vocabulary's odd width); rows past the count keep their
    values, and so does everything when the count is 0."""
    if not use_kernel:
        monkeypatch.setattr(rg, "kernel_runs_on", lambda *t: False)
    rng = random.Random(7)
    for cols in (1, GATHER_BLOCK - 1, GATHER_BLOCK + 1, 3 * GATHER_BLOCK + 77):
        rows = rng.randrange(1, 12)
        picked = [rng.randrange(rows) for _ in range(rng.randrange(0, 6))] + [rows - 1]
        src, table, dst, want = gather_case("cpu", dtype, rows, cols, picked, seed=cols,
                                            stale=[rng.randrange(rows) for _ in range(3)])
        gather_rows(src, table, dst)
        assert torch.equal(dst, want), (cols, picked)
    src, table, dst, want = gather_case("cpu", dtype, 5, 100, [], seed=1, dst_rows=4)
    gather_rows(src, table, dst)
    assert torch.equal(dst, want) and (dst == -7).all()


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "reference"])
def test_a_listed_row_outside_src_gives_zeros(use_kernel, monkeypatch):
    if not use_kernel:
        monkeypatch.setattr(rg, "kernel_runs_on", lambda *t: False)
    src, table, dst, want = gather_case("cpu", torch.float32, 4, 50, [2, 4, -1, 0], seed=3)
    gather_rows(src, table, dst)
    assert torch.equal(dst, want)
    assert (dst[1] == 0).all() and (dst[2] == 0).all()


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "reference"])
def test_a_count_past_dst_or_the_table_copies_only_what_both_hold(use_kernel, monkeypatch):
    if not use_kernel:
        monkeypatch.setattr(rg, "kernel_runs_on", lambda *t: False)
    src = torch.randn(6, 30)
    guard = torch.full((5, 30), -7.0)
    dst = guard[:2]  # rows past it must keep their sentinel
    gather_rows(src, torch.tensor([9, 4, 1, 3, 5], dtype=torch.int32), dst)  # count 9: 2 rows fit
    assert torch.equal(dst, src[[4, 1]]) and (guard[2:] == -7).all()
    dst = torch.full((6, 30), -7.0)
    gather_rows(src, torch.tensor([4, 2, 0], dtype=torch.int32), dst)  # count 4, two entries
    assert torch.equal(dst[:2], src[[2, 0]]) and (dst[2:] == -7).all()


def test_a_strided_source_reads_its_own_rows():
    base = torch.randn(6, 40)
    src = base[:, ::2]  # columns 2 apart
    table = torch.tensor([3, 5, 0, 2], dtype=torch.int32)
    dst = torch.zeros(4, 20)
    gather_rows(src, table, dst)
    assert torch.equal(dst[:3], src[[5, 0, 2]]) and (dst[3] == 0).all()


@pytest.mark.parametrize("bad, match", [
    (dict(table=torch.tensor([1, 0], dtype=torch.int64)), "int32"),
    (dict(table=torch.zeros(1, 2, dtype=torch.int32)), "1-D"),
    (dict(dst=torch.zeros(2, 9)), "same columns"),
    (dict(dst=torch.zeros(2, 8, dtype=torch.float16)), "dtype"),
])
def test_bad_arguments_are_refused(bad, match):
    args = dict(src=torch.zeros(3, 8), table=torch.tensor([1, 0], dtype=torch.int32), dst=torch.zeros(2, 8))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        gather_rows(**args)
