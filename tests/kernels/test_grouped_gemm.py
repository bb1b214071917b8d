"""The grouped gather GEMM of routed experts (``ops/grouped_gemm.py``): its chunk plan, and the
kernel against its torch reference with fresh random routings, odd shapes, pairs without a group,
scales, accumulation and strided weights."""

import pytest
import torch

from peft_fastlora.ops.grouped_gemm import grouped_gemm, grouped_gemm_reference, max_chunks_for, plan_groups

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("pairs, groups, block_m", [(1, 1, 16), (7, 3, 16), (64, 5, 16), (100, 200, 16),
                                                     (33, 4, 32), (0, 4, 16)])
def test_plan_covers_every_grouped_pair_once(pairs, groups, block_m):
    g = torch.Generator().manual_seed(pairs * 31 + groups)
    keys = torch.randint(-1, groups + 2, (pairs,), generator=g)  # some -1 and out of range
    plan = plan_groups(keys, groups, block_m)
    assert plan.chunk_group.numel() == max_chunks_for(pairs, groups, block_m)
    seen = []
    for c in range(plan.chunk_group.numel()):
        group, start, length = (int(t[c]) for t in (plan.chunk_group, plan.chunk_start, plan.chunk_len))
        if group < 0:
            assert length == 0
            continue
        assert 0 < length <= block_m
        ids = plan.sorted_ids[start: start + length].tolist()
        assert all(int(keys[i]) == group for i in ids), (c, ids)
        seen += ids
    expected = sorted(i for i in range(pairs) if 0 <= int(keys[i]) < groups)
    assert sorted(seen) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens, k, groups, n, kdim", [(1, 2, 4, 24, 40), (9, 2, 8, 96, 32), (37, 4, 5, 17, 70),
                                                        (20, 1, 64, 48, 16)])
def test_kernel_equals_reference(dtype, tokens, k, groups, n, kdim):
    g = torch.Generator().manual_seed(tokens + 7 * groups + n)
    pairs = tokens * k
    x = torch.randn(tokens, kdim, generator=g).to(dtype)
    w = torch.randn(groups, n, kdim, generator=g).to(dtype) / kdim ** 0.5
    keys = torch.randint(-1, groups, (pairs,), generator=g)
    plan = plan_groups(keys, groups, 16)
    fill = torch.randn(pairs, n, generator=g).to(dtype)
    got = grouped_gemm(x, w, plan, fill.clone(), in_div=k)
    ref = grouped_gemm_reference(x, w, keys, fill.clone(), in_div=k)
    torch.testing.assert_close(got, ref, **TOL[dtype])
    ungrouped = keys < 0
    assert torch.equal(got[ungrouped], fill[ungrouped])  # pairs without a group left as they were


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_scaled_accumulate_over_strided_weights(dtype):
    """LoRA's expand: groups are (slot, expert), scaled per slot, added onto the base output; the
    weights a (slots, experts, N, r) stack seen through a transposed view."""
    g = torch.Generator().manual_seed(5)
    slots, experts, n, r, pairs = 3, 4, 40, 16, 29
    u = torch.randn(pairs, r, generator=g).to(dtype)
    stack = torch.randn(slots, experts, r, n, generator=g).to(dtype).transpose(-1, -2)  # (S, E, N, r), strided
    w = stack.reshape(slots * experts, n, r) if stack.is_contiguous() else stack.flatten(0, 1)
    scale = torch.tensor([0.5, 2.0, -1.25])
    keys = torch.randint(-1, slots * experts, (pairs,), generator=g)
    base = torch.randn(pairs, n, generator=g).to(dtype)
    plan = plan_groups(keys, slots * experts, 16)
    got = grouped_gemm(u, w, plan, base.clone(), scale=scale, scale_div=experts, accumulate=True)
    ref = grouped_gemm_reference(u, w, keys, base.clone(), scale=scale, scale_div=experts, accumulate=True)
    torch.testing.assert_close(got, ref, **TOL[dtype])
    assert not torch.allclose(got, base)


def test_shapes_are_checked():
    x, w = torch.zeros(4, 8), torch.zeros(2, 6, 8)
    plan = plan_groups(torch.zeros(8, dtype=torch.long), 2, 16)
    with pytest.raises(ValueError, match="pairs"):
        grouped_gemm(x, w, plan, torch.zeros(8, 6))  # 8 pairs from 4 rows needs in_div=2
    with pytest.raises(ValueError, match="does not match"):
        grouped_gemm(x, torch.zeros(2, 6, 9), plan, torch.zeros(8, 6), in_div=2)
