"""``ops.int8_lora`` on the GPU: its dequantization equal, bit for bit, to bitsandbytes' own CUDA
dequantization cast to the model's dtype (fp16, bf16, fp32) at 8B widths; its deltas against the
torch reference with a tolerance per dtype; and replayed from a CUDA graph with new values."""

import pytest
import torch

from peft_fastlora.ops.int8_lora import int8_dequant_lora, int8_dequant_lora_reference

from test_int8_lora import lora_case, product

pytestmark = pytest.mark.gpu
bnb = pytest.importorskip("bitsandbytes")
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def cuda(*tensors):
    return [t.cuda() for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n", [(1, 6144), (32, 28672), (153, 4096), (7, 1000)])
def test_dequantization_is_bitsandbytes_own(m, n, dtype):
    acc, row, col = cuda(*product(m, n, 4096, seed=m + n))
    ours = int8_dequant_lora(acc, row, col, dtype)
    theirs = torch.ops.bitsandbytes.int8_mm_dequant.default(acc, row, col, dtype=dtype)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_deltas_at_8b_widths(dtype):
    widths = (4096, 1024, 1024)
    ranks = [(16, 16, 16)] * 6 + [(8, 0, 8), (32, 32, 32)]
    m = 32
    acc, row, col = cuda(*product(m, sum(widths), 256, seed=3))
    lora = lora_case(m, widths, ranks, dtype, seed=3)
    lora = lora._replace(**{k: getattr(lora, k).cuda() for k in ("tail", "b", "token_slot", "ranks", "scalings",
                                                                 "a_rows", "b_offs")})
    out = int8_dequant_lora(acc, row, col, dtype, lora)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, int8_dequant_lora_reference(acc, row, col, dtype, lora), atol=atol, rtol=rtol)


def test_replayed_from_a_cuda_graph():
    m, widths = 24, (512, 128)
    acc, row, col = cuda(*product(m, sum(widths), 64, seed=4))
    lora = lora_case(m, widths, [(8, 8), (16, 0), (4, 4)], torch.bfloat16, seed=4)
    lora = lora._replace(**{k: getattr(lora, k).cuda() for k in ("tail", "b", "token_slot", "ranks", "scalings",
                                                                 "a_rows", "b_offs")})
    out = int8_dequant_lora(acc, row, col, torch.bfloat16, lora)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        int8_dequant_lora(acc, row, col, torch.bfloat16, lora, out=out)
    new_acc, new_row, _ = cuda(*product(m, sum(widths), 64, seed=5))
    acc.copy_(new_acc)
    row.copy_(new_row)
    lora.token_slot[:m].copy_(lora.token_slot[:m].flip(0))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, int8_dequant_lora_reference(acc, row, col, torch.bfloat16, lora),
                               atol=1.6e-2, rtol=1.6e-2)
