"""The LoRA expand in the TMA GEMM's epilogue on the GPU: the 8B gate/up shape at 65-128 rows with
the library's gated tile (8 adapters of rank 16, and mixed ranks 8-64 with modules left out), bf16
and fp16 against a float32 reference; float32 odd shapes over three modules; a split-K launch; graph
replays whose plan and shrink are refilled in place; and a tiny float32 Llama whose gate/up sites
take the path (limits lowered) through real decode graphs, random batch sizes across the 65-128
boundary and adapter changes, greedy tokens equal to PEFT's. Run on the device machine:

    python -m pytest -m gpu tests/test_lora_epilogue_gpu.py
"""

import random

import pytest
import torch

from _lora_epilogue_cases import make_lora
from peft_fastlora.ops.silu_mul import act_mul
from peft_fastlora.ops.stream_gemm import StreamWorkspace
from peft_fastlora.ops.tma_gemm import TmaConfig, tma_gemm, tma_gemm_reference
from test_stream_gemm_gpu import TOL, _captured

pytestmark = pytest.mark.gpu

GLU_TILE = TmaConfig(128, 64, 1, 8, 4)  # base_ops/tma_tiles_h200.json's gated tile
K, N = 4096, 14336  # Llama-3-8B's gate and up: 4,096 inputs, 14,336 outputs each
RANKS = {"r16x8": [[16, 16]] * 8,
         "mixed": [[8, 8], [16, 0], [32, 32], [64, 64], [0, 16], [24, 24], [8, 40], [16, 16]]}


def _slots(m, n_slots, seed, base_share=0.25):
    rng = random.Random(seed)
    return [-1 if rng.random() < base_share else rng.randrange(n_slots) for _ in range(m)]


def _weights(m, n_out, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).cuda()
    w = (torch.randn(n_out, k, generator=g) / k ** 0.5).to(dtype).cuda()
    return x, w


@pytest.mark.parametrize("ranks", list(RANKS))
@pytest.mark.parametrize("m", [65, 96, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gate_up_at_the_8b_shape(dtype, m, ranks):
    """The gated output is the plain launch's (deltas included) through ``act_mul``, bit for bit; the
    plain launch is the float32 reference's within one rounding."""
    x, w = _weights(m, 2 * N, K, dtype, seed=m)
    table = RANKS[ranks]
    lora = make_lora(m, [N, N], table, dtype, device="cuda", token_slots=_slots(m, len(table), m), seed=m)
    out = tma_gemm(x, w, config=GLU_TILE, glu="silu", lora=lora)
    both = tma_gemm(x, w, config=GLU_TILE, lora=lora)
    torch.testing.assert_close(out, act_mul(both[:, :N], both[:, N:], "silu"), atol=0, rtol=0)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(both.float(), tma_gemm_reference(x, w, lora=lora).float(), atol=atol, rtol=rtol)
    none = lora.token_slot[:m] < 0
    assert torch.equal(both[none], tma_gemm(x, w, config=GLU_TILE)[none])  # rows without adapter: the GEMM


@pytest.mark.parametrize("m,widths,k", [(70, [1000, 520, 77], 520), (129, [33, 4096], 104), (3, [200], 64)])
def test_float32_odd_shapes(m, widths, k):
    """Modules cut mid-tile, K not a whole tile, rows past one 128-row block; float32 with no TF32."""
    x, w = _weights(m, sum(widths), k, torch.float32, seed=k)
    lora = make_lora(m, widths, [[8] * len(widths), [16] * len(widths), [5, 0, 3][:len(widths)]], torch.float32,
                     device="cuda", token_slots=_slots(m, 3, k, 0.2), seed=k)
    out = tma_gemm(x, w, config=TmaConfig(64, 64, 1, 4, 2), lora=lora)
    torch.testing.assert_close(out, tma_gemm_reference(x, w, lora=lora), atol=1e-4, rtol=1e-4)


def test_split_k_adds_the_deltas_once():
    """An o_proj-shaped split-K launch (4 ranges): the deltas ride in one range's partial."""
    m = 128
    x, w = _weights(m, 4096, 4096, torch.bfloat16, seed=1)
    lora = make_lora(m, [4096], [[16]] * 8, torch.bfloat16, device="cuda", token_slots=_slots(m, 8, 1), seed=1)
    out = tma_gemm(x, w, config=TmaConfig(128, 128, 4, 8, 3), workspace=StreamWorkspace("cuda", 4 * m * 4096, 4096),
                   lora=lora)
    atol, rtol = TOL[torch.bfloat16]
    torch.testing.assert_close(out.float(), tma_gemm_reference(x, w, lora=lora).float(), atol=atol, rtol=rtol)


def test_graph_replays_follow_the_plan_refilled_in_place():
    """Captured once at 96 rows; the plan (token and chunk slots) and the shrink refilled in place for
    other adapter mixes, including none: each replay equals an eager launch on the new contents."""
    m = 96
    x, w = _weights(m, 2 * N, K, torch.bfloat16, seed=5)
    table = RANKS["mixed"]
    lora = make_lora(m, [N, N], table, torch.bfloat16, device="cuda", token_slots=_slots(m, 8, 0), seed=0)
    graph, out = _captured(lambda: tma_gemm(x, w, config=GLU_TILE, glu="silu", lora=lora))
    for seed, share in ((1, 0.25), (2, 0.0), (3, 1.0), (4, 0.5)):
        fresh = make_lora(m, [N, N], table, torch.bfloat16, device="cuda", token_slots=_slots(m, 8, seed, share),
                          seed=seed)
        for name in ("y", "token_slot"):
            getattr(lora, name).copy_(getattr(fresh, name))
        lora.chunk_slot.fill_(-1)
        lora.chunk_slot[:fresh.chunk_slot.shape[0]].copy_(fresh.chunk_slot)
        graph.replay()
        torch.testing.assert_close(out, tma_gemm(x, w, config=GLU_TILE, glu="silu", lora=lora), atol=0, rtol=0)


def test_tiny_model_through_decode_graphs_matches_peft(monkeypatch):
    """A float32 tiny Llama whose gate/up sites take the path past 4 rows (limits lowered, a small
    gated tile): random batch sizes across the boundary and the largest bucket, an adapter added and
    one deleted between calls, greedy tokens equal to PEFT's; the path was taken."""
    from peft import LoraConfig, get_peft_model

    import peft_fastlora as fastlora
    from peft_fastlora.base_ops import stream_linears as sl
    from peft_fastlora.lora import fusion
    from _models import tiny_llama

    monkeypatch.setattr(fusion, "FOLD_MAX_SHARE", 1e9)
    for name, value in (("MIN_N", 16), ("MIN_K", 16), ("NARROW_N", 16), ("MAX_ROWS", 4),
                        ("_DTYPES", (torch.float32, torch.bfloat16, torch.float16))):
        monkeypatch.setattr(sl, name, value)
    monkeypatch.setattr(sl, "tma_tiles", lambda path=None: {"glu": sl.TmaTile(TmaConfig(64, 32, 1, 4, 2))})
    taken, original = [], sl.StreamLinears.gated_lora

    def spy(self, *args, **kw):
        out = original(self, *args, **kw)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(sl.StreamLinears, "gated_lora", spy)

    def build():
        base = tiny_llama(0, vocab_size=512, hidden_size=128, intermediate_size=256).to("cuda").eval()
        base.generation_config.eos_token_id = None
        model = None
        for i, (r, targets) in enumerate([(8, ["gate_proj", "up_proj", "q_proj"]), (16, ["gate_proj"]),
                                          (32, ["up_proj", "down_proj", "v_proj"]), (4, ["gate_proj", "up_proj"])]):
            cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False)
            model = get_peft_model(base, cfg, adapter_name=f"a{i}") if model is None else model
            if i:
                model.add_adapter(f"a{i}", cfg)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.mul_(0.05)
        return model.eval()

    m, ref = build(), build()
    report = fastlora.patch(m, fold_shrink=True)
    assert report.stream_lora_gated_mlps == m.config.num_hidden_layers, report
    rng = random.Random(0)
    names = ["a0", "a1", "a2", "a3", "__base__"]
    try:
        for call, rows in enumerate([70, 5, 128, 96, 3, 100, 65, 80]):
            if call == 4:
                for model in (m, ref):
                    model.add_adapter("a4", LoraConfig(r=8, lora_alpha=8, target_modules=["gate_proj", "up_proj"],
                                                       init_lora_weights=False))
                names.append("a4")
            if call == 6:
                for model in (m, ref):
                    model.delete_adapter("a1")
                names.remove("a1")
            g = torch.Generator().manual_seed(call)
            ids = torch.randint(1, 512, (rows, 10), generator=g).cuda()
            mask = torch.ones_like(ids)
            mask[1::3, :rng.randrange(1, 9)] = 0  # some left-padded rows
            row_names = [rng.choice(names) for _ in range(rows)]
            kw = dict(input_ids=ids, attention_mask=mask, pad_token_id=0, max_new_tokens=6, do_sample=False)
            with torch.no_grad():
                got = m.generate(**kw, adapter_names=row_names)
                want = ref.generate(**kw, adapter_names=row_names)
            assert torch.equal(got, want), (call, rows)
    finally:
        fastlora.unpatch(m)
    assert sum(taken) > 0 and not all(taken)  # taken past 4 rows, declined at 5 and 3 (bucket of 8)
