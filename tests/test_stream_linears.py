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
    streams.skip = lambda: True  # the owner's test (the state's: a continuous-batching forward)
    streams.linear(x, w)
    assert calls["stream_gemm"] == 2
    streams.skip = None
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


def test_patched_model_streams_its_decode_gemms_through_calls_and_an_adapter_change(monkeypatch):
    """``patch(stream_gemm=True)`` on a bf16 model (the interpreter runs the kernel; every layer
    made wide enough): the fused groups and the other linear layers stream through emulated graphs
    over calls of changing batch sizes, and again after an adapter is added (the rebuilt groups
    take the GEMM too); each step's logits stay within bf16 rounding (about 1% here, as between
    fastlora and PEFT) of the same step with the kernel off, and ``unpatch`` leaves no forward
    behind."""
    import peft_fastlora as fastlora
    from _models import LLAMA_LIKE_ALL, left_padded_batch, tiny_peft_llama

    monkeypatch.setattr(sl, "MIN_N", 16)
    monkeypatch.setattr(sl, "MIN_K", 16)
    model = tiny_peft_llama().to(torch.bfloat16)
    calls_rows = [[5, 9, 3], [7], [4, 6, 2, 8, 5]]
    names = {3: ["a", "__base__", "b"], 1: ["b"], 5: ["a", "b", "a", "__base__", "b"]}

    def run(on, add_adapter=False):
        report = fastlora.patch(model, stream_gemm=on, cuda_graphs="emulate")
        counter = count_calls(monkeypatch, stream_ops, ["stream_gemm"])
        logits = []
        try:
            with torch.no_grad():
                if add_adapter:
                    model.add_adapter("c", LoraConfig(r=2, lora_alpha=2, target_modules=LLAMA_LIKE_ALL,
                                                      init_lora_weights=False))
                for rows in calls_rows:
                    out = model.generate(**left_padded_batch(rows, seed=len(rows)), max_new_tokens=4,
                                         do_sample=False, pad_token_id=0, adapter_names=names[len(rows)],
                                         output_logits=True, return_dict_in_generate=True)
                    logits.append((out.sequences[:, -4:], torch.stack(out.logits)))
        finally:
            fastlora.unpatch(model)
            if add_adapter:
                model.delete_adapter("c")
        return report, counter["stream_gemm"], logits

    off_report, off_calls, off = run(False)
    on_report, on_calls, on = run(True)
    assert "decode GEMMs streamed: off (stream_gemm=False)" in str(off_report) and off_calls == 0
    assert "decode GEMMs streamed: fused groups and" in str(on_report), on_report
    assert on_calls > 0
    compared = 0
    for (tok_a, a), (tok_b, b) in zip(on, off):
        for step in range(4):  # while the tokens agree (bf16: a near tie may round the other way)
            if not torch.equal(tok_a[:, :step], tok_b[:, :step]):
                break
            assert ((a[step].float() - b[step].float()).norm() / b[step].float().norm()).item() < 2e-2
            compared += 1
    assert compared >= 8
    _, after_calls, _ = run(True, add_adapter=True)
    assert after_calls >= on_calls  # the groups rebuilt for the new adapter still stream
    for m in model.modules():
        assert "forward" not in m.__dict__ or not isinstance(m, torch.nn.Linear), m
