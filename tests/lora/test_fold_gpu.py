"""The shrink folded into the base GEMM, on the GPU, at a size where the default limit folds every
site (four rank-8 adapters on a 512-wide model: the A rows add at most 1/8 of each site's base rows).

float32 for exact greedy tokens against PEFT's mixed path, through the decode graphs and eagerly;
bf16 logits within a bf16 tolerance; fewer GPU slots than adapters; and a random call sequence
with an adapter deleted and another added half-way (the sites are rebuilt and fold again).
"""

import random

import pytest
import torch
from peft import LoraConfig, get_peft_model

import peft_fastlora as fastlora
from _models import tiny_llama

pytestmark = pytest.mark.gpu
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NAMES = ["a0", "a1", "a2", "a3"]


def _model(dtype=torch.float32, seed=0):
    base = tiny_llama(seed, vocab_size=512, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                      num_key_value_heads=2).to("cuda", dtype).eval()
    base.generation_config.eos_token_id = None
    model = None
    for i, name in enumerate(NAMES):
        torch.manual_seed(100 + i)
        cfg = LoraConfig(r=8, lora_alpha=8 + 8 * i, target_modules=ALL, init_lora_weights=False,
                         use_rslora=i == 3)
        if model is None:
            model = get_peft_model(base, cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(0.05)
    return model.to(dtype).eval()


def _inputs(rows, prompt, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 512, (rows, prompt), generator=g)
    mask = torch.ones_like(ids)
    ids[1::3, :2] = 0
    mask[1::3, :2] = 0
    return dict(input_ids=ids.cuda(), attention_mask=mask.cuda(), pad_token_id=0, do_sample=False)


@pytest.fixture(scope="module")
def model():
    return _model()


def test_every_site_folds_and_graphs_equal_peft(model):
    names = ["a0", "__base__", "a1", "a2", "a0", "a3", "__base__", "a1"]
    inputs = _inputs(len(names), 11, seed=1)
    with torch.no_grad():
        want = model.generate(**inputs, adapter_names=names, max_new_tokens=48)
    with fastlora.patched(model) as report:
        assert report.shrink_folded == "8 of 8 sites", report
        graphs = model.generate(**inputs, adapter_names=names, max_new_tokens=48)
        stats = fastlora.get_state(model).graph_runner.stats
    with fastlora.patched(model, cuda_graphs=False):
        eager = model.generate(**inputs, adapter_names=names, max_new_tokens=48)
    assert stats["replays"] >= 40 and stats["eager_steps"] == 0, stats
    assert torch.equal(graphs, want)
    assert torch.equal(eager, want)


def test_folded_and_unfolded_graphs_agree_with_fewer_slots_than_adapters(model):
    mixes = [["a0", "a1", "a0", "__base__"], ["a2", "a3", "a3", "a2"], ["a1", "__base__", "a3", "a1"]]
    inputs = _inputs(4, 7, seed=2)
    with torch.no_grad():
        want = [model.generate(**inputs, adapter_names=n, max_new_tokens=16) for n in mixes]
    for fold in (True, False):
        with fastlora.patched(model, max_loras_per_batch=2, fold_shrink=fold) as report:
            assert report.shrink_folded == ("8 of 8 sites" if fold else "off (fold_shrink=False)")
            for _ in range(2):
                for names, ref in zip(mixes, want):
                    out = model.generate(**inputs, adapter_names=names, max_new_tokens=16)
                    assert torch.equal(out, ref), (fold, names)


def test_bf16_folded_logits_close_to_peft():
    model = _model(torch.bfloat16, seed=3)
    names = ["a0", "__base__", "a1", "a2", "a3", "a0"]
    ids = torch.randint(1, 512, (len(names), 1), device="cuda")  # one token: a decode-sized forward
    with torch.no_grad():
        ref = model(input_ids=ids, adapter_names=names).logits.float()
        with fastlora.patched(model) as report:
            assert report.shrink_folded == "8 of 8 sites"
            out = model(input_ids=ids, adapter_names=names).logits.float()
        base = model.get_base_model()(input_ids=ids).logits.float()
    err = (out - ref).norm() / ref.norm()
    delta = (ref - base).norm() / ref.norm()
    assert delta > 1e-2  # the adapters matter, so the comparison below means something
    assert err < 1e-2, (err.item(), delta.item())


def test_random_calls_with_an_adapter_deleted_and_one_added():
    """Random batch sizes, prompts and mixes, greedy, against an unpatched twin; half-way an
    adapter is deleted and a new one added on both (the patched model's sites are rebuilt)."""
    m, ref = _model(seed=4), _model(seed=4)
    rng = random.Random(5)
    fastlora.patch(m)
    try:
        names_now = list(NAMES)
        for call in range(12):
            if call == 6:
                torch.manual_seed(77)
                for model in (m, ref):
                    model.delete_adapter("a2")
                    torch.manual_seed(77)
                    model.add_adapter("late", LoraConfig(r=8, lora_alpha=16, target_modules=ALL,
                                                         init_lora_weights=False))
                names_now = ["a0", "a1", "a3", "late"]
                # the new adapter's B is random: scale it as the others were
                with torch.no_grad():
                    for model in (m, ref):
                        for n, p in model.named_parameters():
                            if "lora_B" in n and ".late." in n:
                                p.mul_(0.05)
            rows = rng.choice([1, 3, 8, 17, 33])
            names = [rng.choice(names_now + ["__base__"]) for _ in range(rows)]
            inputs = _inputs(rows, rng.randint(3, 20), seed=call)
            with torch.no_grad():
                out = m.generate(**inputs, adapter_names=names, max_new_tokens=rng.randint(4, 20))
                want = ref.generate(**inputs, adapter_names=names, max_new_tokens=out.shape[1] - inputs["input_ids"].shape[1])
            assert torch.equal(out, want), (call, rows, names)
            if call >= 6:
                assert fastlora.get_state(m).report.shrink_folded == "8 of 8 sites"
    finally:
        fastlora.unpatch(m)


def _many(dtype=torch.float32, n=12, seed=6):
    """``n`` adapters of ranks 8-32 on q/k/v/o: with 4 slots the attention arenas exceed 1/8 of
    their base rows, and the sites stage their folds (``fusion.FOLD_STAGE_MARGIN``)."""
    base = tiny_llama(seed, vocab_size=512, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                      num_key_value_heads=2).to("cuda", dtype).eval()
    base.generation_config.eos_token_id = None
    model = None
    for i in range(n):
        torch.manual_seed(300 + i)
        cfg = LoraConfig(r=[8, 16, 24, 32][i % 4], lora_alpha=16, target_modules=ALL[:4], init_lora_weights=False)
        model = get_peft_model(base, cfg, adapter_name=f"m{i}") if model is None else model
        if i:
            model.add_adapter(f"m{i}", cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05)
    return model.to(dtype).eval()


def test_staged_folds_through_graphs_with_random_calls_equal_peft():
    """12 adapters in 4 GPU slots: the attention sites stage their folds. Warm-up, then random
    batch sizes, prompts and mixes of 1-4 adapters (loads and evictions between calls), greedy
    fp32 through the graphs against an unpatched twin; both fold choices are taken."""
    m, ref = _many(), _many()
    rng = random.Random(8)
    names_all = [f"m{i}" for i in range(12)]
    with fastlora.patched(m, max_loras_per_batch=4) as report:
        state = fastlora.get_state(m)
        staged = [s.pool for s in state.sites if s.pool.staging is not None]
        assert staged and "staged" in report.shrink_folded, report.shrink_folded
        fastlora.warmup(m, batch_sizes=[8, 16], max_length=64)
        chose = []
        for call in range(16):
            rows = rng.choice([2, 5, 8, 13, 16])
            pick = rng.sample(names_all, rng.randint(1, 4))
            names = [rng.choice(pick + ["__base__"]) for _ in range(rows)]
            inputs = _inputs(rows, rng.randint(3, 20), seed=100 + call)
            with torch.no_grad():
                out = m.generate(**inputs, adapter_names=names, max_new_tokens=rng.randint(4, 24))
                want = ref.generate(**inputs, adapter_names=names,
                                    max_new_tokens=out.shape[1] - inputs["input_ids"].shape[1])
            chose.append(state.last_fold)
            assert torch.equal(out, want), (call, rows, names, state.last_fold)
        stats = state.graph_runner.stats
        assert stats["replays"] > 0 and stats["eager_steps"] == 0, stats
        assert set(chose) == {False, True}, chose


def test_bf16_staged_fold_logits_close_to_peft():
    model = _many(torch.bfloat16)
    names = ["m0", "m5", "__base__", "m10", "m3", "m5"]
    ids = torch.randint(1, 512, (len(names), 1), device="cuda")
    with torch.no_grad():
        ref = model(input_ids=ids, adapter_names=names).logits.float()
        with fastlora.patched(model, max_loras_per_batch=4):
            out = model(input_ids=ids, adapter_names=names).logits.float()
            assert fastlora.get_state(model).last_fold
        base = model.get_base_model()(input_ids=ids).logits.float()
    err = (out - ref).norm() / ref.norm()
    delta = (ref - base).norm() / ref.norm()
    assert delta > 1e-2
    assert err < 1e-2, (err.item(), delta.item())


def test_engine_steps_past_256_tokens_fold_under_a_raised_limit_and_equal_peft(monkeypatch):
    """``Tuning.fold_max_tokens`` raised: transformers' engine packs prefill chunks of hundreds of
    tokens beside decode tokens, every shrink comes from the folded GEMMs (no shrink kernel runs),
    and each fp32 request's greedy tokens equal PEFT's for that prompt alone."""
    from _continuous import cb_config, greedy_config, peft_alone, random_prompts, requires_cb
    from _helpers import count_backend_calls
    from peft_fastlora.backend.segmented import SegmentedLoRABackend
    from peft_fastlora.tuning import Tuning

    if requires_cb.args[0]:
        pytest.skip(requires_cb.kwargs["reason"])
    m, ref = _model(seed=9), _model(seed=9)
    calls = count_backend_calls(monkeypatch, SegmentedLoRABackend, ("run_packed_lora", "run_packed_expand"))
    prompts = random_prompts([300, 170, 90, 41, 260, 7], seed=9)
    names = ["a0", "a2", "__base__", "a3", "a1", "a0"]
    with fastlora.patched(m, tuning=Tuning(fold_max_tokens=2048)) as report:
        assert report.shrink_folded == "8 of 8 sites", report
        out = m.generate_batch(prompts, generation_config=greedy_config(12), adapter_names=names,
                               continuous_batching_config=cb_config(max_batch_tokens=512, num_blocks=256))
    got = [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]
    assert calls["run_packed_expand"] > 0 and calls["run_packed_lora"] == 0, calls
    for tokens, p, n in zip(got, prompts, names):
        assert tokens == peft_alone(ref, p, n, 12), (n, len(p))
