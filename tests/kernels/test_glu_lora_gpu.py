"""The one-launch LoRA gate/up (``ops.glu_lora``) on the GPU: Llama-3-8B's gate/up at 65-128 rows with
8 adapters of rank 16 and with mixed ranks (one adapter on gate only), bf16 and fp16, against the
torch reference; float32 at odd shapes; CUDA graph replays with the rows' adapters changed between
them (the counters back at zero each time); x written by a long PDL launch just before, in one
graph; tiles that stop waiting; and a patched float32 model's greedy tokens equal to PEFT's through
the graphs under random traffic (batch sizes across the 65-128 band and below it, adapters added
and deleted, a sampled call). Run on a GPU machine:

    python -m pytest -m gpu tests/test_glu_lora_gpu.py
"""

import importlib
import random

import pytest
import torch

import peft_fastlora.ops.glu_lora as gl
from peft_fastlora.ops.glu_lora import glu_lora, glu_lora_reference, glu_lora_shrink_reference
from peft_fastlora.ops.tma_gemm import TmaConfig

from _graphs import captured
from test_glu_lora import SHRINK_SIZES, TOL, glu_case, with_bt

pytestmark = pytest.mark.gpu

GLU_TILE = TmaConfig(128, 64, 1, 8, 4)  # the committed table's gated tile
RANKS = {"8x16": [(16, 16)] * 8, "mixed": [(8, 8), (16, 0), (32, 32), (64, 16), (16, 16)]}


def _check(x, w, n, lora, dtype, config=GLU_TILE, **kwargs):
    """The scratch the shrink programs wrote against the reference's shrink, and the output against
    the reference from that scratch (a shrink sum rounding the other way moves a delta by a unit of
    the shrink's last place, times B: more than ``TOL`` allows in an output near zero), each within
    ``TOL``; the counters back at zero."""
    out = glu_lora(x, w, n, lora, "silu", config, **kwargs)
    torch.cuda.synchronize()
    assert not lora.counters.any(), lora.counters
    atol, rtol = TOL[dtype]
    m, r = x.shape[0], w.shape[0] - 2 * n
    shrink = lora.scratch[:m, :r]
    torch.testing.assert_close(shrink.float(), glu_lora_shrink_reference(x, w, n, lora), atol=atol, rtol=rtol)
    want = glu_lora_reference(x, w, n, lora, "silu", shrink=shrink)
    torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=rtol)
    return out


@pytest.mark.parametrize("ranks", sorted(RANKS))
@pytest.mark.parametrize("m", [65, 96, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_llama_8b_gate_up(dtype, m, ranks):
    x, w, lora = glu_case(m, 14336, 4096, RANKS[ranks], dtype, device="cuda", seed=m)
    _check(x, w, 14336, lora, dtype)


@pytest.mark.parametrize("form", sorted(SHRINK_SIZES))
@pytest.mark.parametrize("ranks", sorted(RANKS))
def test_llama_8b_gate_up_with_b_columns(ranks, form):
    """B's columns through a descriptor (``GluLora.bt``, written by ``b_columns``: the host's layout),
    with shrink programs of 16 rows or 64."""
    n = 14336
    x, w, lora = glu_case(128, n, 4096, RANKS[ranks], torch.bfloat16, device="cuda", seed=3)
    want = with_bt(lora, n)
    got = torch.full_like(want.bt, float("nan"))
    gl.b_columns(lora.b, lora.col_slot, lora.ranks, lora.a_rows, lora.b_offs, lora.t0, want.t0_pad, got)
    assert torch.equal(got, want.bt)
    _check(x, w, n, want._replace(bt=got), torch.bfloat16, **SHRINK_SIZES[form])


@pytest.mark.parametrize("form", [None] + sorted(SHRINK_SIZES))
@pytest.mark.parametrize("m,n,k", [(70, 1000, 520), (128, 77, 4104), (100, 4096, 104)])
def test_odd_shapes_in_float32(m, n, k, form):
    """Odd shapes, B gathered from the packed arena (form None) or its columns, with shrink programs
    of 16 rows or 64."""
    x, w, lora = glu_case(m, n, k, RANKS["mixed"], torch.float32, device="cuda")
    if form is not None:
        lora = with_bt(lora, n)
    _check(x, w, n, lora, torch.float32, config=TmaConfig(64, 32, 1, 4, 2), **SHRINK_SIZES.get(form, {}))


def test_graph_replays_follow_the_rows_adapters():
    """Captured once; replayed with the rows' slots rewritten in place (another mix, rows of no
    adapter, one adapter only): each replay equals the reference for its slots, the counters end
    at zero each time."""
    n = 14336
    x, w, lora = glu_case(128, n, 4096, RANKS["8x16"], torch.bfloat16, device="cuda")
    out = torch.empty(128, n, dtype=torch.bfloat16, device="cuda")
    graph, _ = captured(lambda: glu_lora(x, w, n, lora, "silu", GLU_TILE, out=out, check=False))
    gen = torch.Generator().manual_seed(3)
    mixes = [torch.randint(-1, 8, (128,), generator=gen), torch.full((128,), -1), torch.full((128,), 5),
             torch.randint(-1, 8, (128,), generator=gen)]
    for mix in mixes:
        lora.token_slot[:128].copy_(mix.to(torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert not lora.counters.any(), lora.counters
        atol, rtol = TOL[torch.bfloat16]
        want = glu_lora_reference(x, w, n, lora, "silu", shrink=lora.scratch[:128])
        torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=rtol)
        torch.testing.assert_close(lora.scratch[:128, :w.shape[0] - 2 * n].float(),
                                   glu_lora_shrink_reference(x, w, n, lora), atol=atol, rtol=rtol)


def test_x_written_by_a_long_pdl_gemm_just_before_in_a_graph():
    """x written by a long PDL launch (``ops.tma_gemm``, which lets the next launch start at once)
    right before, in one graph: the launch's programs, resident early, must read x only after their
    wait. Each replay, with new inputs to the GEMM, equals the reference from that replay's x: within
    ``TOL`` but for at most one output in 10^5 (the GEMM's x meets, once in a few million outputs, a
    gate or up sum at a rounding boundary where the float32 reference rounds the other way), and
    within twice ``TOL`` everywhere; an x read early, the last replay's, would be far off nearly
    everywhere."""
    from peft_fastlora.ops.tma_gemm import tma_gemm

    n, k, k_in = 14336, 4096, 32768
    x, w, lora = glu_case(128, n, k, RANKS["8x16"], torch.bfloat16, device="cuda", seed=11)
    g = torch.Generator(device="cuda").manual_seed(12)
    h = torch.randn(128, k_in, device="cuda", dtype=torch.bfloat16, generator=g)
    w_in = torch.randn(k, k_in, device="cuda", dtype=torch.bfloat16, generator=g) * k_in ** -0.5
    out = torch.empty(128, n, dtype=torch.bfloat16, device="cuda")

    def step():
        tma_gemm(h, w_in, out=x, config=TmaConfig(64, 64, 1, 4, 4))
        glu_lora(x, w, n, lora, "silu", GLU_TILE, out=out)

    graph, _ = captured(step)
    atol, rtol = TOL[torch.bfloat16]
    for seed in range(4):
        h.copy_(torch.randn(128, k_in, device="cuda", dtype=torch.bfloat16,
                            generator=torch.Generator(device="cuda").manual_seed(100 + seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert not lora.counters.any(), lora.counters
        want_x = (h.float() @ w_in.float().T).to(torch.bfloat16)
        torch.testing.assert_close(x.float(), want_x.float(), atol=2e-2, rtol=2e-2)
        want = glu_lora_reference(x, w, n, lora, "silu", shrink=lora.scratch[:128]).float()
        err = (out.float() - want).abs()
        assert (err > atol + rtol * want.abs()).float().mean() <= 1e-5, f"replay {seed}: outputs off the reference"
        torch.testing.assert_close(out.float(), want, atol=2 * atol, rtol=2 * rtol)
        torch.testing.assert_close(lora.scratch[:128, :w.shape[0] - 2 * n].float(),
                                   glu_lora_shrink_reference(x, w, n, lora), atol=atol, rtol=rtol)


def test_tiles_that_stop_waiting_compute_the_shrink_themselves():
    """The count never reaches the shrink programs' number and ``SPIN_LIMIT`` is 0: every tile
    writes the whole shrink to the scratch (NaN before) itself, racing the shrink programs. The
    waiting launch's result, the counters back at zero."""
    n, config = 4096, TmaConfig(64, 32, 1, 4, 2)  # float32: no rounding of the shrink to tell the two apart
    x, w, lora = glu_case(96, n, 1024, RANKS["mixed"], torch.float32, device="cuda")
    waited = _check(x, w, n, lora, torch.float32, config=config)
    lora.counters[0] = -1000
    lora.scratch.fill_(float("nan"))
    alone = glu_lora(x, w, n, lora, "silu", config, spin_limit=0)
    torch.cuda.synchronize()
    assert not lora.counters.any(), lora.counters
    atol, rtol = TOL[torch.float32]
    torch.testing.assert_close(alone, waited, atol=atol, rtol=rtol)


def _float32_model():
    from peft import LoraConfig, get_peft_model

    from _models import tiny_llama

    base = tiny_llama(7, hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                      vocab_size=128, num_hidden_layers=2).cuda()
    base.generation_config.eos_token_id = None
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=["gate_proj", "up_proj", "q_proj"],
                                            init_lora_weights=False), adapter_name="a").eval()
    model.add_adapter("b", LoraConfig(r=8, lora_alpha=8, target_modules=["gate_proj", "down_proj"],
                                      init_lora_weights=False))
    model.add_adapter("c", LoraConfig(r=32, lora_alpha=16, target_modules=["up_proj", "gate_proj", "v_proj"],
                                      init_lora_weights=False))
    return model


def test_float32_model_tokens_equal_peft_through_graphs_under_traffic(monkeypatch):
    """A float32 Llama whose every decode GEMM past 8 rows takes the TMA kernel (float32 tiles) and
    whose gate/up takes ``ops.glu_lora``: greedy calls of random batch sizes (9-128 rows, and a few
    below), random adapter mixes, an adapter added and one deleted mid-way, a sampled call, through
    CUDA graphs: each greedy call's tokens those of PEFT's own mixed batch on an identical model."""
    from peft import LoraConfig

    import peft_fastlora as fastlora
    from _helpers import count_calls
    from _models import left_padded_batch

    tuning = fastlora.Tuning(stream_min_n=16, stream_min_k=16, stream_narrow_n=16, stream_max_rows=8,
                             stream_dtypes=(torch.float32, torch.bfloat16, torch.float16),
                             tma_tiles={cls: TmaConfig(64, 32, 1, 4, 2)._asdict()
                                        for cls in ("deep", "square", "tall", "wide", "glu")})
    calls = count_calls(monkeypatch, importlib.import_module("peft_fastlora.base_ops.stream_linears"), ["glu_lora"])
    model, twin = _float32_model(), _float32_model()
    rng = random.Random(11)
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    adapters = ["a", "b", "c", "__base__"]
    taken = []
    with fastlora.patched(model, stream_gemm=True, cuda_graphs=True, tuning=tuning) as report, torch.no_grad():
        assert report.stream_lora_gated_mlps == 2, str(report)
        for call in range(10):
            if call == 3:
                for m in (model, twin):
                    torch.manual_seed(5)
                    m.add_adapter("d", LoraConfig(r=16, lora_alpha=16, target_modules=["gate_proj", "up_proj"],
                                                  init_lora_weights=False))
                adapters.append("d")
            if call == 7:
                for m in (model, twin):
                    m.delete_adapter("b")
                    m.set_adapter("a")  # (PEFT's model keeps the deleted name as its active adapter)
                adapters.remove("b")
            rows = rng.choice([9, 40, 65, 70, 96, 128, 128, 100, 3])
            names = [rng.choice(adapters) for _ in range(rows)]
            batch = {k: v.cuda() for k, v in left_padded_batch([rng.randint(2, 9) for _ in range(rows)],
                                                                seed=call).items()}
            before = calls["glu_lora"]
            got = model.generate(**batch, adapter_names=names, **kw)
            taken.append((rows, calls["glu_lora"] - before))
            want = twin.generate(**batch, adapter_names=names, **kw)
            assert torch.equal(got, want), (call, rows, (got != want).nonzero()[:4].tolist())
            if call == 5:  # a sampled call through the same graphs
                torch.manual_seed(0)
                model.generate(**batch, adapter_names=names, max_new_tokens=3, do_sample=True, top_k=5,
                               pad_token_id=0)
    # (a graph captured for an earlier call's bucket replays the launch without calling it again)
    assert sum(n for _, n in taken) >= 4, taken
