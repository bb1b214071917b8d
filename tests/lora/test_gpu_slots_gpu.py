"""Fewer GPU slots than adapters on the GPU: adapters swapped into slots between graphed calls.

fp32 tiny Llama with six adapters of ranks 2-32 and two target sets, three slots: random call
sequences (batch sizes, lengths, greedy) whose tokens must equal PEFT's own mixed path, through
the real decode graphs and the Triton kernels, with no recapture caused by a swap; bf16 runs the
same sequences without errors.
"""

import random

import pytest
import torch

import peft_fastlora as fastlora
from peft_fastlora import get_state

from _graphs import TRAFFIC_NAMES as NAMES, traffic_inputs as _inputs, traffic_model as _model

pytestmark = pytest.mark.gpu


def _calls(seed, n=12):
    rng = random.Random(seed)
    for _ in range(n):
        used = rng.sample(NAMES, rng.randint(1, 3))
        rows = rng.choice([1, 2, 3, 5, 8])
        yield rows, rng.randint(3, 20), rng.randint(2, 10), [rng.choice(used + ["__base__"]) for _ in range(rows)]


def test_swaps_between_graphed_calls_equal_peft():
    m, ref = _model(), _model()
    fastlora.patch(m, max_loras_per_batch=3)
    try:
        state = get_state(m)
        assert state.backend.name == "triton" and state.graph_runner is not None
        assert all(site.pool.num_slots == 3 for site in state.sites)
        fastlora.warmup(m, batch_sizes=[1, 2, 3, 5, 8], max_length=64)  # every call below fits
        captured = state.graph_runner.stats["captures"]
        for i, (rows, prompt, new, names) in enumerate(_calls(seed=0)):
            inputs = _inputs(rows, prompt, seed=i)
            with torch.no_grad():
                out = m.generate(**inputs, adapter_names=names, max_new_tokens=new, do_sample=False)
                want = ref.generate(**inputs, adapter_names=names, max_new_tokens=new, do_sample=False)
            assert torch.equal(out, want), (i, rows, names)
        stats, slots = state.graph_runner.stats, state.registry.stats
    finally:
        fastlora.unpatch(m)
    assert stats["eager_steps"] == 0 and stats["capture_failures"] == 0, stats
    assert stats["captures"] == captured, stats  # swaps recaptured nothing
    assert slots["evictions"] > 0, slots


def test_bf16_swaps_run():
    m = _model().to(torch.bfloat16)
    fastlora.patch(m, max_loras_per_batch=2)
    try:
        for i, (rows, prompt, new, names) in enumerate(_calls(seed=1, n=10)):
            names = [n for n in names if n in names[:1] or n == "__base__"] or ["__base__"]
            names = (names * rows)[:rows]
            with torch.no_grad():
                out = m.generate(**_inputs(rows, prompt, seed=40 + i), adapter_names=names, max_new_tokens=new,
                                 do_sample=False)
            assert out.shape == (rows, prompt + new)
        stats = get_state(m).graph_runner.stats
        assert stats["eager_steps"] == 0 and stats["capture_failures"] == 0, stats
        assert get_state(m).registry.stats["loads"] > 2
    finally:
        fastlora.unpatch(m)


def _saved(folder, targets, r, seed):
    from peft import LoraConfig, get_peft_model

    from _models import tiny_llama

    torch.manual_seed(seed)
    base = tiny_llama(0, vocab_size=512, hidden_size=128, intermediate_size=256)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), init_lora_weights=False))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(0.05)
    model.save_pretrained(folder)
    return folder


def test_registered_adapters_swapped_through_graphs_equal_peft(tmp_path):
    """Adapters registered from saved folders (pinned CPU memory, no PEFT modules) and PEFT's
    own, three slots, real graphs: tokens equal PEFT with the same folders loaded."""
    folders = {f"r{i}": _saved(str(tmp_path / f"r{i}"), targets, r, seed=50 + i) for i, (targets, r) in
               enumerate([(("q_proj", "v_proj"), 64), (("down_proj", "o_proj", "k_proj"), 4), (("gate_proj",), 12)])}
    m, ref = _model(), _model()
    fastlora.patch(m, max_loras_per_batch=3)
    try:
        fastlora.register_adapters(m, folders)
        for name, folder in folders.items():
            ref.load_adapter(folder, adapter_name=name)
        ref.eval()
        state = get_state(m)
        assert all(a.is_pinned() for s in state.stored.values() for a, _, _ in s.modules.values())
        fastlora.warmup(m, batch_sizes=[1, 2, 4, 8], max_length=64)
        captured = state.graph_runner.stats["captures"]
        rng = random.Random(5)
        every = NAMES + list(folders)
        for i in range(12):
            used = rng.sample(every, rng.randint(1, 3))
            rows = rng.choice([1, 2, 4, 7])
            names = [rng.choice(used + ["__base__"]) for _ in range(rows)]
            inputs = _inputs(rows, rng.randint(3, 20), seed=70 + i)
            with torch.no_grad():
                out = m.generate(**inputs, adapter_names=names, max_new_tokens=8, do_sample=False)
                want = ref.generate(**inputs, adapter_names=names, max_new_tokens=8, do_sample=False)
            assert torch.equal(out, want), (i, names)
        stats = state.graph_runner.stats
        assert stats["captures"] == captured and stats["eager_steps"] == 0, stats
        assert state.registry.stats["evictions"] > 0
    finally:
        fastlora.unpatch(m)


def test_continuous_batching_through_engine_graphs_with_fewer_slots():
    """Three slots for six adapters in the engine: at most three requests per step, adapters
    loaded into slots between the engine's graphed steps; every request equals PEFT alone."""
    from _continuous import cb_config, greedy_config, peft_alone, serve
    from _graphs import traffic_prompts as _prompts

    m, ref = _model(), _model()
    fastlora.patch(m, max_loras_per_batch=3)
    try:
        prompts, names = _prompts(12, seed=31)
        manager = m.init_continuous_batching(generation_config=greedy_config(12),
                                             continuous_batching_config=cb_config(num_blocks=128, use_cuda_graph=True))
        manager.warmup()
        manager.start()
        try:
            out = serve(manager, list(zip(prompts, names, [12] * len(prompts))))
        finally:
            manager.stop(block=True)
        stats = manager.fastlora_graphs.stats
        assert stats["graphed_steps"] > 0 and stats["eager_steps"] == 0, stats
        assert get_state(m).registry.stats["evictions"] > 0
    finally:
        fastlora.unpatch(m)
    for tokens, p, n in zip(out, prompts, names):
        assert tokens == peft_alone(ref, p, n, 12), n
