"""``ops.int8_dequant`` on the GPU: its dequantization equal, bit for bit, to bitsandbytes' own CUDA
dequantization cast to the model's dtype (fp16, bf16, fp32) at 8B widths; with an addend, equal to
that output plus the addend; and replayed from a CUDA graph with new values."""

import pytest
import torch

from peft_fastlora.ops.int8_dequant import int8_dequant

from test_int8_dequant import delta, product

pytestmark = pytest.mark.gpu
bnb = pytest.importorskip("bitsandbytes")


def cuda(*tensors):
    return [t.cuda() for t in tensors]


def bnb_dequant(acc, row, col, dtype):
    return torch.ops.bitsandbytes.int8_mm_dequant.default(acc, row, col, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n", [(1, 6144), (32, 28672), (153, 4096), (7, 1000)])
def test_dequantization_is_bitsandbytes_own(m, n, dtype):
    acc, row, col = cuda(*product(m, n, 4096, seed=m + n))
    assert torch.equal(int8_dequant(acc, row, col, dtype), bnb_dequant(acc, row, col, dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n", [(32, 6144), (5, 28672), (70, 1000)])
def test_the_addend_is_bitsandbytes_output_plus_it(m, n, dtype):
    acc, row, col = cuda(*product(m, n, 4096, seed=m * n))
    d = delta(m, n, dtype, seed=m, zero_rows=range(0, m, 4)).cuda()
    assert torch.equal(int8_dequant(acc, row, col, dtype, d), bnb_dequant(acc, row, col, dtype) + d)


def test_replayed_from_a_cuda_graph():
    m, n = 24, 640
    acc, row, col = cuda(*product(m, n, 64, seed=4))
    d = delta(m, n, torch.bfloat16, seed=4).cuda()
    out = int8_dequant(acc, row, col, torch.bfloat16, d)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        int8_dequant(acc, row, col, torch.bfloat16, d, out=out)
    new_acc, new_row, _ = cuda(*product(m, n, 64, seed=5))
    acc.copy_(new_acc)
    row.copy_(new_row)
    d.copy_(delta(m, n, torch.bfloat16, seed=5).cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, bnb_dequant(acc, row, col, torch.bfloat16) + d)
