"""The TMA-fed decode GEMM on the GPU: Llama-3-8B shapes (and their folded ``[W; A]`` widths) at
65-128 rows in bf16/fp16 against a float32 reference, odd shapes and float32, the residual and GLU
epilogues, split-K's tickets across launches and graph replays, and a PDL chain (a norm writing the
GEMM's input just before it) equal to plain launches. Run on a GPU machine:

    python -m pytest -m gpu tests/test_tma_gemm_gpu.py
"""

import pytest
import torch

from peft_fastlora.ops.silu_mul import act_mul
from peft_fastlora.ops.stream_gemm import StreamWorkspace, stream_gemm_reference
from peft_fastlora.ops.tma_gemm import TmaConfig, tma_gemm
from test_stream_gemm_gpu import TOL, pdl_chain_equals_plain, shape_case, split_k_replays_equal_eager

pytestmark = pytest.mark.gpu

# (K, N): the 8B layer's GEMMs, and with 8 adapters' A (rank 16) stacked under each weight
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
          "qkv_folded": (4096, 6528), "down_folded": (14336, 4224)}
CONFIGS = [TmaConfig(128, 64, 1, 8, 4), TmaConfig(64, 128, 2, 4, 4), TmaConfig(256, 64, 1, 8, 3),
           TmaConfig(128, 128, 4, 8, 3)]


def _ids(c):
    return f"n{c.block_n}k{c.block_k}s{c.split_k}w{c.num_warps}st{c.num_stages}"


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
@pytest.mark.parametrize("m", [65, 96, 128])
@pytest.mark.parametrize("site", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_llama_shapes(dtype, site, m, config):
    shape_case(tma_gemm, config, dtype, m, *SHAPES[site], bias=site == "qkv")


@pytest.mark.parametrize("m,n,k", [(70, 1000, 520), (129, 77, 4104), (100, 4096, 104), (3, 200, 64)])
@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_odd_shapes_and_float32(m, n, k, config):
    """Outputs not a whole tile, K not a whole tile or range, rows past one block (129); float32 with
    no TF32 rounding."""
    x = torch.randn(m, k, device="cuda")
    w = torch.randn(n, k, device="cuda") / k ** 0.5
    out = tma_gemm(x, w, config=config._replace(num_stages=2), workspace=StreamWorkspace("cuda", 4 * m * n, n))
    torch.testing.assert_close(out, stream_gemm_reference(x, w), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[3], TmaConfig(64, 128, 2, 4, 4)],
                         ids=["split1", "split4", "add_tile"])
@pytest.mark.parametrize("m,n_add", [(128, 4096), (80, 4096), (128, 1000)])
def test_residual_added_in_the_epilogue(config, m, n_add):
    """down_proj (folded: 4,224 outputs) with the residual on its first columns, as a decoder layer
    folds it; the columns past ``n_add`` get none (``add_tile``: ``stream_linears.ADD_TILES``' deep tile)."""
    k, n = SHAPES["down_folded"]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
    add = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)[:, :n_add]
    out = tma_gemm(x, w, config=config, workspace=StreamWorkspace("cuda", 4 * m * n, n), add=add)
    atol, rtol = TOL[torch.bfloat16]
    torch.testing.assert_close(out.float(), stream_gemm_reference(x, w, add=add).float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("m", [65, 128])
@pytest.mark.parametrize("config", [TmaConfig(64, 64, 1, 8, 4), TmaConfig(128, 64, 1, 8, 3)], ids=_ids)
def test_glu_at_the_gate_up_shape(act, m, config):
    """The fused [gate; up] weight with the activation in the epilogue: the bits of the GEMM's output
    through ``act_mul`` (libdevice's tanh on both sides), the GEMM the reference's."""
    k, n2 = SHAPES["gate_up"]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n2, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
    out = tma_gemm(x, w, config=config, glu=act)
    both = tma_gemm(x, w, config=config)
    assert out.shape == (m, n2 // 2)
    torch.testing.assert_close(out, act_mul(both[:, :n2 // 2], both[:, n2 // 2:], act), atol=0, rtol=0)
    atol, rtol = TOL[torch.bfloat16]
    torch.testing.assert_close(both.float(), stream_gemm_reference(x, w).float(), atol=atol, rtol=rtol)


def test_split_k_across_launches_and_graph_replays():
    """Split-K launches of two shapes share a workspace: each launch, eager or replayed, gives the same
    bits as the first eager one (the partials are summed in range order, the tickets reset)."""
    split_k_replays_equal_eager(tma_gemm, CONFIGS[3], rows=128)


def test_pdl_chain_in_a_graph_equals_plain_launches():
    """A norm writes each GEMM's input just before it, in one graph: with PDL (the GEMM's programs
    start while the norm runs and wait before their first load) the outputs equal launches with PDL
    off."""
    pdl_chain_equals_plain(tma_gemm, [CONFIGS[0], CONFIGS[3]], rows=96)
