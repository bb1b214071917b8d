"""The grouped gather GEMM on the GPU: against its torch reference per dtype, and captured with its
plan in one CUDA graph, replayed under routings that change every step (the plan reads nothing
back, so the graph's fixed grid serves any routing of the same pair count)."""

import pytest
import torch

from peft_fastlora.ops.grouped_gemm import grouped_gemm, grouped_gemm_reference, plan_groups

pytestmark = pytest.mark.gpu

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2),
       torch.bfloat16: dict(atol=6e-2, rtol=4e-2)}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("tokens, k, groups, n, kdim", [(1, 8, 128, 1536, 2048), (32, 8, 128, 96, 768),
                                                        (77, 2, 8, 200, 4096), (300, 4, 1024, 16, 2048)])
def test_kernel_equals_reference(dtype, tokens, k, groups, n, kdim):
    g = torch.Generator("cuda").manual_seed(tokens + groups)
    x = torch.randn(tokens, kdim, device="cuda", generator=g).to(dtype)
    w = (torch.randn(groups, n, kdim, device="cuda", generator=g) / kdim ** 0.5).to(dtype)
    keys = torch.randint(-1, groups, (tokens * k,), device="cuda", generator=g)
    block_m = 16 if tokens * k <= 256 else 64
    got = grouped_gemm(x, w, plan_groups(keys, groups, block_m), torch.zeros(tokens * k, n, device="cuda", dtype=dtype),
                       in_div=k)
    ref = grouped_gemm_reference(x, w, keys, torch.zeros(tokens * k, n, device="cuda", dtype=dtype), in_div=k)
    torch.testing.assert_close(got, ref, **TOL[dtype])


def test_plan_and_kernel_captured_replay_any_routing():
    g = torch.Generator("cuda").manual_seed(0)
    tokens, k, groups, n, kdim = 24, 4, 16, 64, 256
    x = torch.randn(tokens, kdim, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(groups, n, kdim, device="cuda", generator=g, dtype=torch.bfloat16) / 16
    scale = torch.rand(groups, device="cuda", generator=g)
    keys = torch.randint(0, groups, (tokens * k,), device="cuda", generator=g)
    out = torch.zeros(tokens * k, n, device="cuda", dtype=torch.bfloat16)

    def step():
        out.zero_()
        grouped_gemm(x, w, plan_groups(keys, groups, 16), out, in_div=k, scale=scale)

    step()  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i in range(5):
        keys.copy_(torch.randint(-1, groups, (tokens * k,), device="cuda", generator=g))
        if i == 3:
            keys.fill_(5)  # every pair to one group: its chunks past the first
        x.copy_(torch.randn(tokens, kdim, device="cuda", generator=g))
        graph.replay()
        ref = grouped_gemm_reference(x, w, keys, torch.zeros_like(out), in_div=k, scale=scale)
        torch.testing.assert_close(out, ref, **TOL[torch.bfloat16])
