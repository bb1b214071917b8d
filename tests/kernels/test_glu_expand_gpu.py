"""``ops.glu_expand`` on the GPU: Llama-3-8B's gate/up (n = 14,336) at a prefill's size, 8 adapters of
rank 16 and mixed ranks (one adapter on gate alone), rows without an adapter and sequence boundaries
inside row tiles, bf16 and fp16, against the two launches it replaces (the Triton backend's packed
expand into the base output, then ``ops.act_mul``) and against the torch reference; a width and a
token count that are no tile multiple; decode-like rows (every tile many adapters); the same bits
with and without PDL; and a patched float32 model's greedy tokens and logits equal to PEFT's with
the prefill taking the kernel. Run on a GPU machine:

    python -m pytest -m gpu tests/kernels/test_glu_expand_gpu.py
"""

import pytest
import torch

from peft_fastlora.backend.triton import TritonLoRABackend
from peft_fastlora.batch import NO_ADAPTER, ForwardBatch, ForwardMode
from peft_fastlora.ops import act_mul, glu_expand, glu_expand_reference, lora_shrink, pdl

from _helpers import pack, record_glu_expand_launches

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}
RANKS = {"8x16": [(16, 16)] * 8, "mixed": [(8, 8), (16, 0), (32, 32), (64, 16), (16, 16)]}
PREFILL = [700, 1, 1283, 64]  # 2,048 tokens; boundaries inside 64-row tiles


def _case(ranks, dtype, seq_lens=PREFILL, n=14336, k=4096, seed=0):
    torch.manual_seed(seed)
    dev = torch.device("cuda")
    num_slots, r = len(ranks), max(max(p) for p in ranks)
    rank_table = torch.tensor(ranks, dtype=torch.int32, device=dev)
    scalings = (torch.rand(num_slots, 2, device=dev) + 0.5).float()
    a = torch.randn(num_slots, 2 * r, k, device=dev, dtype=dtype) / k ** 0.5
    b = torch.randn(num_slots, 2 * n, r, device=dev, dtype=dtype) / 4
    w = pack(a, b, [0, n, 2 * n], rank_table, seed=seed)
    rows = [i % num_slots if i % 4 != 3 else NO_ADAPTER for i in range(len(seq_lens))]
    be = TritonLoRABackend(num_slots, dev)
    fb = ForwardBatch(len(seq_lens), seq_lens, ForwardMode.EXTEND, dev)
    be.prepare_lora_batch(fb, rows, [max(p) for p in ranks], [1.0] * num_slots, use_cuda_graph=False)
    s = sum(seq_lens)
    x = torch.randn(s, k, device=dev, dtype=dtype)
    base = torch.randn(s, 2 * n, device=dev, dtype=dtype)
    return be, w, x, base, dict(layer_ranks=rank_table, layer_scalings=scalings)


def _check(be, w, x, base, tables, act, dtype):
    got = be.run_packed_glu(x, w, base, act, **tables)
    projected = be.run_packed_lora(x, w, base_output=base.clone(), **tables)
    n = w.offsets[1]
    two_launches = act_mul(projected[:, :n], projected[:, n:], act)
    torch.cuda.synchronize()
    atol, rtol = TOL[dtype]
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), two_launches.float(), atol=atol, rtol=rtol)
    bi = be.batch_info
    y = lora_shrink(x, w.a, 2, tables["layer_ranks"], bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start,
                    bi.chunk_len, block_m=bi.block_m, a_rows=w.a_rows, max_rank=w.max_rank)
    want = glu_expand_reference(y, w.b, w.b_offs, tables["layer_ranks"], tables["layer_scalings"], bi.token_slot,
                                base, act, max_rank=w.max_rank, b_align=w.align)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)
    return got


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("ranks", sorted(RANKS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_llama_8b_gate_up_prefill(dtype, ranks, act):
    _check(*_case(RANKS[ranks], dtype), act, dtype)


@pytest.mark.parametrize("layout", ["odd_shape", "decode_like"])
def test_odd_shapes_and_tiles_of_many_adapters(layout):
    """A width and a token count that are no tile multiple; or one token a row (every tile holds
    many adapters: the loop over slots)."""
    if layout == "odd_shape":
        case = _case(RANKS["mixed"], torch.bfloat16, seq_lens=[333, 1, 950, 77], n=14336 - 40)
    else:
        case = _case(RANKS["8x16"], torch.bfloat16, seq_lens=[1] * 1000, n=4096)
    _check(*case, "silu", torch.bfloat16)


def test_the_same_bits_with_and_without_pdl():
    be, w, x, base, tables = _case(RANKS["mixed"], torch.bfloat16, n=4096)
    with pdl.launches(pdl.OFF):
        off = be.run_packed_glu(x, w, base, "silu", **tables)
    with pdl.launches(pdl.FULL):
        full = be.run_packed_glu(x, w, base, "silu", **tables)
    assert torch.equal(off, full)


@pytest.mark.parametrize("launch", [dict(block_m=32, block_n=128), dict(block_m=64, block_n=64, num_warps=8),
                                    dict(block_m=128, block_n=64, num_warps=8, num_stages=2)],
                         ids=["32x128", "64x64_w8", "128x64_w8_s2"])
def test_other_launches_give_the_same_result(launch):
    """The launches ``sweep_expand.py --kernels glu`` times: the default's result."""
    be, w, x, base, tables = _case(RANKS["mixed"], torch.bfloat16, n=4096)
    bi = be.batch_info
    y = lora_shrink(x, w.a, 2, tables["layer_ranks"], bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start,
                    bi.chunk_len, block_m=bi.block_m, a_rows=w.a_rows, max_rank=w.max_rank)
    args = (y, w.b, w.b_offs, tables["layer_ranks"], tables["layer_scalings"], bi.token_slot, base)
    want = glu_expand(*args, max_rank=w.max_rank, b_align=w.align)
    got = glu_expand(*args, max_rank=w.max_rank, b_align=w.align, **launch)
    torch.testing.assert_close(got.float(), want.float(), atol=1.6e-2, rtol=1.6e-2)


def test_patched_float32_model_equals_peft_with_the_prefill_glu(monkeypatch):
    """Prefills of 4 rows of 80 tokens take the kernel; decode steps of 4 rows do not."""
    import peft_fastlora as fastlora
    from peft import LoraConfig, get_peft_model

    from _models import left_padded_batch, tiny_llama

    calls = record_glu_expand_launches(monkeypatch)
    base = tiny_llama(0, vocab_size=128).cuda()
    base.generation_config.eos_token_id = None
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "q_proj"],
                                            init_lora_weights=False), adapter_name="a").eval()
    model.add_adapter("b", LoraConfig(r=16, lora_alpha=32, target_modules=["gate_proj"], init_lora_weights=False))
    batch = {k: v.cuda() for k, v in left_padded_batch([70, 17, 80, 5], seed=3).items()}
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, adapter_names=["a", "__base__", "b", "a"],
              output_logits=True, return_dict_in_generate=True)
    tuning = fastlora.Tuning(stream_min_n=16, stream_min_k=16, stream_narrow_n=16, glu_expand_min_tokens=64,
                             stream_dtypes=(torch.float32, torch.bfloat16, torch.float16))
    with torch.no_grad():
        want = model.generate(**batch, **kw)
        with fastlora.patched(model, backend="triton", stream_gemm=True, fuse_silu_mul=True, tuning=tuning) as report:
            assert report.lora_glu_expand_mlps == model.config.num_hidden_layers, str(report)
            got = model.generate(**batch, **kw)
    layers = model.config.num_hidden_layers
    assert calls == [batch["input_ids"].numel()] * layers, (calls, str(report))
    assert torch.equal(got.sequences, want.sequences)
    a, b = torch.stack(got.logits).float(), torch.stack(want.logits).float()
    assert (a - b).abs().max() <= 1e-4 * b.abs().max(), (a - b).abs().max()
