"""Which layers and which GEMMs ``base_ops.stream_linears`` sends to the weight-streaming kernel,
on CPU (Triton's interpreter runs the kernel; ``test_stream_linears_gpu.py`` runs a model)."""

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model

import peft_fastlora.base_ops.stream_linears as sl
import peft_fastlora.ops.stream_gemm as stream_ops

from _helpers import count_calls
from _models import tiny_llama


def test_install_skips_fusible_siblings_and_their_base_layers():
    model = get_peft_model(tiny_llama(0), LoraConfig(r=4, target_modules=["q_proj", "o_proj", "down_proj"]))
    streams = sl.StreamLinears(torch.device("cpu"))
    names = {n.split("layers.0.")[-1] for n, _ in streams.install(model) if "layers.1" not in n}
    assert {"self_attn.o_proj.base_layer", "mlp.down_proj.base_layer"} <= names
    assert not any(part in n for n in names for part in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    assert any(n.endswith("lm_head") for n, _ in streams.modules)
    # the LoRA layers themselves are not plain nn.Linear: PEFT's forward stays theirs
    assert "forward" not in model.base_model.model.model.layers[0].self_attn.o_proj.__dict__


def test_decode_sized_bf16_gemms_take_the_kernel_others_keep_f_linear(monkeypatch):
    monkeypatch.setattr(sl, "MIN_N", 16)
    monkeypatch.setattr(sl, "MIN_K", 16)
    streams = sl.StreamLinears(torch.device("cpu"))
    calls = count_calls(monkeypatch, stream_ops, ["stream_gemm"])
    w = (torch.randn(48, 64) / 8).bfloat16()
    b = torch.randn(48).bfloat16()
    x = torch.randn(2, 3, 64).bfloat16()
    out = streams.linear(x, w, b)
    assert calls["stream_gemm"] == 1 and out.shape == (2, 3, 48)
    ref = (x.float() @ w.float().T + b.float()).bfloat16()
    torch.testing.assert_close(out.float(), ref.float(), atol=1.6e-2, rtol=1.6e-2)
    for other in (torch.randn(65, 64).bfloat16(),           # past MAX_ROWS: a prefill
                  torch.randn(3, 64),                        # float32 (w bf16: F.linear's own error)
                  torch.randn(3, 64).bfloat16().requires_grad_()):
        try:
            streams.linear(other, w)
        except RuntimeError:
            assert other.dtype == torch.float32  # F.linear refused the mixed dtypes, as it would anyway
    with torch.no_grad():
        streams.linear(torch.randn(3, 64).bfloat16().requires_grad_(), w)  # no gradient: the kernel
    assert calls["stream_gemm"] == 2
    torch.testing.assert_close(streams.linear(torch.randn(3, 64), w.float()).shape, torch.Size([3, 48]))
    assert calls["stream_gemm"] == 2  # float32: F.linear
    monkeypatch.setattr(sl, "MIN_N", 4096)
    streams.linear(x, w)
    assert calls["stream_gemm"] == 2  # too narrow a layer: cuBLAS
    monkeypatch.setattr(sl, "MIN_N", 16)
    monkeypatch.setattr(sl, "MIN_K", 2048)
    streams.linear(x, w)
    assert calls["stream_gemm"] == 2  # too shallow a reduction: cuBLAS


@pytest.mark.parametrize("m,n,k,split", [(1, 4096, 14336, 1), (32, 4096, 14336, 2), (16, 4096, 4096, 2),
                                         (64, 4096, 4096, 1), (32, 6144, 4096, 1), (64, 28672, 4096, 1)])
def test_tile_choice(m, n, k, split):
    assert sl._config(m, n, k).split_k == split


def test_workspace_covers_every_split_launch(monkeypatch):
    """A split launch of the widest splitting layer and the most rows fits the model's workspace."""
    monkeypatch.setattr(sl, "MIN_N", 16)
    monkeypatch.setattr(sl, "MIN_K", 16)
    streams = sl.StreamLinears(torch.device("cpu"))
    n, k = 64, 64  # square: splits past 8 rows
    assert sl._config(24, n, k).split_k == 2
    w = torch.randn(n, k).bfloat16()
    x = torch.randn(24, k).bfloat16()
    torch.testing.assert_close(streams.linear(x, w).float(), F.linear(x.float(), w.float()).bfloat16().float(),
                               atol=3e-2, rtol=1.6e-2)
    assert streams.workspace.part.numel() >= 2 * sl.MAX_ROWS * sl.SPLIT_MAX_N
