"""``ops.glu_expand`` on the GPU: Llama-3-8B's gate/up (n = 14,336) at prefill sizes with 8 adapters
of rank 16 and with mixed ranks (one adapter on gate only), rows without an adapter and sequence
boundaries inside row tiles, bf16 and fp16, against the two launches it replaces (the Triton
backend's packed expand into the base output, then ``ops.act_mul``) and against the torch
reference; and a patched float32 model's greedy tokens and logits equal to PEFT's with
``Tuning.glu_expand_min_rows`` set. Run on a GPU machine:

    python -m pytest -m gpu tests/kernels/test_glu_expand_gpu.py
"""

import pytest
import torch

from peft_fastlora.backend.triton import TritonLoRABackend
from peft_fastlora.batch import NO_ADAPTER, ForwardBatch, ForwardMode
from peft_fastlora.ops import act_mul, glu_expand_reference, lora_shrink

from _helpers import pack

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}
RANKS = {"8x16": [(16, 16)] * 8, "mixed": [(8, 8), (16, 0), (32, 32), (64, 16), (16, 16)]}
SEQ_LENS = [700, 1, 1347, 64, 33]  # 2,145 tokens; boundaries inside 64-row tiles


def _case(ranks, dtype, n=14336, k=4096, seed=0):
    torch.manual_seed(seed)
    dev = torch.device("cuda")
    num_slots, r = len(ranks), max(max(p) for p in ranks)
    rank_table = torch.tensor(ranks, dtype=torch.int32, device=dev)
    scalings = (torch.rand(num_slots, 2, device=dev) + 0.5).float()
    a = torch.randn(num_slots, 2 * r, k, device=dev, dtype=dtype) / k ** 0.5
    b = torch.randn(num_slots, 2 * n, r, device=dev, dtype=dtype) / 4
    w = pack(a, b, [0, n, 2 * n], rank_table, seed=seed)
    rows = [i % num_slots if i % 4 != 3 else NO_ADAPTER for i in range(len(SEQ_LENS))]
    be = TritonLoRABackend(num_slots, dev)
    fb = ForwardBatch(len(SEQ_LENS), SEQ_LENS, ForwardMode.EXTEND, dev)
    be.prepare_lora_batch(fb, rows, [max(p) for p in ranks], [1.0] * num_slots, use_cuda_graph=False)
    s = sum(SEQ_LENS)
    x = torch.randn(s, k, device=dev, dtype=dtype)
    base = torch.randn(s, 2 * n, device=dev, dtype=dtype)
    return be, w, x, base, rank_table, scalings


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("ranks", sorted(RANKS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_llama_8b_gate_up_prefill(dtype, ranks, act):
    be, w, x, base, rank_table, scalings = _case(RANKS[ranks], dtype)
    got = be.run_packed_glu(x, w, base, act, layer_ranks=rank_table, layer_scalings=scalings)
    projected = be.run_packed_lora(x, w, base_output=base.clone(), layer_ranks=rank_table, layer_scalings=scalings)
    n = w.offsets[1]
    two_launches = act_mul(projected[:, :n], projected[:, n:], act)
    torch.cuda.synchronize()
    atol, rtol = TOL[dtype]
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), two_launches.float(), atol=atol, rtol=rtol)
    bi = be.batch_info
    y = lora_shrink(x, w.a, 2, rank_table, bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len,
                    block_m=bi.block_m, a_rows=w.a_rows, max_rank=w.max_rank)
    rows = torch.arange(0, x.shape[0], 37, device=x.device)  # a sample of rows: the reference loops on the host
    want = glu_expand_reference(y[rows], w.b, w.b_offs, rank_table, scalings, bi.token_slot[rows].contiguous(),
                                base[rows], act, max_rank=w.max_rank, b_align=w.align)
    torch.testing.assert_close(got[rows].float(), want.float(), atol=atol, rtol=rtol)


def test_patched_float32_model_equals_peft_with_the_prefill_glu(monkeypatch):
    """Prefills of 4 rows x 63 tokens take the kernel (65 rows and more), decode steps of 4 rows do not."""
    import peft_fastlora as fastlora
    import peft_fastlora.ops as ops
    from peft import LoraConfig, get_peft_model

    from _models import left_padded_batch, tiny_llama

    calls, launch = [], ops.glu_expand

    def spy(y, *args, **kw):
        calls.append(y.shape[0])
        return launch(y, *args, **kw)

    monkeypatch.setattr(ops, "glu_expand", spy)
    base = tiny_llama(0, vocab_size=128).cuda()
    base.generation_config.eos_token_id = None
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "q_proj"],
                                            init_lora_weights=False), adapter_name="a").eval()
    model.add_adapter("b", LoraConfig(r=16, lora_alpha=16, target_modules=["gate_proj"], init_lora_weights=False))
    batch = {k: v.cuda() for k, v in left_padded_batch([40, 17, 63, 5], seed=3).items()}
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, adapter_names=["a", "__base__", "b", "a"],
              output_logits=True, return_dict_in_generate=True)
    tuning = fastlora.Tuning(stream_min_n=16, stream_min_k=16, stream_narrow_n=16, glu_expand_min_rows=65,
                             stream_dtypes=(torch.float32, torch.bfloat16, torch.float16))
    with torch.no_grad():
        want = model.generate(**batch, **kw)
        with fastlora.patched(model, backend="triton", stream_gemm=True, fuse_silu_mul=True, tuning=tuning) as report:
            got = model.generate(**batch, **kw)
    layers = model.config.num_hidden_layers
    assert calls == [batch["input_ids"].numel()] * layers, (calls, str(report))
    assert torch.equal(got.sequences, want.sequences)
    a, b = torch.stack(got.logits).float(), torch.stack(want.logits).float()
    assert (a - b).abs().max() <= 1e-4 * b.abs().max(), (a - b).abs().max()
