"""Server-like traffic over GPU slots, on the CPU (emulated decode graphs).

A random sequence of operations, each checked against PEFT's own path on an identical model:
generate calls (greedy and sampling, 1-5 rows, up to three distinct adapters of three slots),
adapters registered from saved folders and unregistered, PEFT adapters added, deleted and edited
in place. The reference loads the same folders into PEFT, so every call's tokens must be equal.
"""

from __future__ import annotations

import random

import pytest
import torch
from peft import LoraConfig, get_peft_model

import peft_fastlora as fastlora
from peft_fastlora import get_state

from _patch_models import ALL, VOCAB, build, lora, tiny_llama

SCAFFOLD = (("layers", ALL, 1, {}),)  # rank 1 over every module: makes the LoRA layers


def _save(folder, targets, r, seed):
    torch.manual_seed(seed)
    model = get_peft_model(tiny_llama(), LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets),
                                                    init_lora_weights=False))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("traffic")
    specs = [(("q_proj", "v_proj"), 8), (ALL, 4), (("gate_proj", "up_proj", "down_proj"), 16), (("o_proj",), 2),
             (("k_proj", "down_proj"), 32), (("q_proj", "up_proj"), 6)]
    return {f"f{i}": _save(str(root / f"f{i}"), t, r, seed=200 + i) for i, (t, r) in enumerate(specs)}


def _generate(model, rows, names, seed, sample):
    ids = torch.randint(3, VOCAB, (rows, 4 + seed % 5), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(model.device)
    mask = torch.ones_like(ids)
    mask[0, : seed % 3] = 0  # a left-padded row
    kw = dict(max_new_tokens=3 + seed % 4, pad_token_id=0, adapter_names=names)
    if sample:
        torch.manual_seed(seed)
        kw.update(do_sample=True, top_k=10)
    else:
        kw.update(do_sample=False)
    with torch.no_grad():
        return model.generate(input_ids=ids * mask, attention_mask=mask, **kw)


def run_traffic(m, ref, folders, seed, steps=36, compare_sampled=True):
    """The random operations on (patched model ``m``, PEFT reference ``ref``), each generate call's
    tokens compared (sampled ones only where ``compare_sampled``: on the GPU, logits equal to a
    rounding can still draw another token). Returns the count of each operation."""
    rng = random.Random(seed)
    registered, peft_added, counts = set(), set(), {}
    for step in range(steps):
        op = rng.choices(["generate", "register", "unregister", "add", "delete", "edit"], [10, 2, 1, 1, 1, 1])[0]
        counts[op] = counts.get(op, 0) + 1
        known = sorted(registered | peft_added | {"layers"})
        if op == "generate":
            used = rng.sample(known, min(len(known), rng.randint(1, 3)))
            rows = rng.randint(1, 5)
            names = [rng.choice(used + ["__base__"]) for _ in range(rows)]
            sample = rng.random() < 0.3
            out, want = _generate(m, rows, names, 1000 * seed + step, sample), _generate(ref, rows, names, 1000 * seed + step, sample)
            assert out.shape == want.shape, (step, names, sample)
            if compare_sampled or not sample:
                assert torch.equal(out, want), (step, names, sample)
        elif op == "register" and len(registered) < len(folders):
            name = rng.choice(sorted(set(folders) - registered))
            fastlora.register_adapter(m, name, folders[name])
            ref.load_adapter(folders[name], adapter_name=name)
            ref.eval()
            registered.add(name)
        elif op == "unregister" and registered:
            name = rng.choice(sorted(registered))
            fastlora.unregister_adapter(m, name)
            ref.delete_adapter(name)
            registered.discard(name)
        elif op == "add":
            name = f"p{step}"
            targets = rng.sample(ALL, rng.randint(1, 4))
            for model in (m, ref):
                torch.manual_seed(step)
                model.add_adapter(name, lora(targets, 4 + step % 3, 8))
            peft_added.add(name)
        elif op == "delete" and peft_added:
            name = rng.choice(sorted(peft_added))
            for model in (m, ref):
                model.delete_adapter(name)
            peft_added.discard(name)
        elif op == "edit" and peft_added:
            name = rng.choice(sorted(peft_added))
            for model in (m, ref):
                for module in model.modules():
                    if hasattr(module, "lora_B") and name in module.lora_B:
                        with torch.no_grad():
                            module.lora_B[name].weight.mul_(1.5)
    return counts


@pytest.mark.parametrize("seed,loads", [(0, "direct"), (1, "staged")])
def test_random_operations_equal_peft(folders, seed, loads, monkeypatch):
    """``loads``: registered adapters copied into slots view by view (the CPU's path), or staged
    one buffer per adapter as on CUDA."""
    from _helpers import STAGED_ON_CPU, stage_host_copies

    staged = stage_host_copies(monkeypatch) if loads == "staged" else []
    m, ref = build(adapters=SCAFFOLD), build(adapters=SCAFFOLD)
    for model in (m, ref):
        model.generation_config.eos_token_id = None
    fastlora.patch(m, max_loras_per_batch=3, cuda_graphs="emulate",
                   **({"tuning": STAGED_ON_CPU} if loads == "staged" else {}))
    counts = run_traffic(m, ref, folders, seed)
    state = get_state(m)
    assert counts["generate"] > 15 and counts.get("register", 0) > 1 and state.registry.num_slots <= 3, counts
    stats = state.graph_runner.stats
    assert stats["capture_failures"] == 0, stats
    assert bool(staged) == (loads == "staged"), "the staged load path did not run"
