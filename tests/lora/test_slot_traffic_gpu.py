"""Server-like traffic over GPU slots, on the GPU: ``test_slot_traffic``'s random operations
(generate calls, adapters registered from saved folders and unregistered, PEFT adapters added,
deleted and edited in place) on an fp32 tiny Llama through the real decode graphs, with
registered adapters held in pinned memory and loaded the way CUDA loads them (each one's buffer
queued to the GPU before the pools place it). Greedy calls equal PEFT's tokens; sampled ones run
(their logits differ from PEFT's by a rounding, which can draw another token)."""

import pytest

import peft_fastlora as fastlora
from peft_fastlora import get_state

from _patch_models import build
from test_slot_traffic import SCAFFOLD, folders, run_traffic  # noqa: F401 (a fixture)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_equal_peft_on_the_gpu(folders, seed, monkeypatch):  # noqa: F811
    import peft_fastlora.lora.slot_loader as loader_module

    queued, prestage = [], loader_module.prestage  # loads of registered adapters, over every rebuild
    monkeypatch.setattr(loader_module, "prestage", lambda buffers, *rest: queued.append(len(buffers)) or
                        prestage(buffers, *rest))
    m, ref = build(adapters=SCAFFOLD).cuda(), build(adapters=SCAFFOLD).cuda()
    for model in (m, ref):
        model.generation_config.eos_token_id = None
    fastlora.patch(m, max_loras_per_batch=3)
    counts = run_traffic(m, ref, folders, seed, steps=48, compare_sampled=False)
    state = get_state(m)
    assert counts["generate"] > 20 and counts.get("register", 0) > 1, counts
    # (the registry's own counters start again at each adapter change: counted here instead)
    assert sum(queued) > 1, "registered adapters were not loaded into slots"
    stats = state.graph_runner.stats
    assert stats["capture_failures"] == 0 and stats["replays"] > 0, stats
    assert state.backend.fused_timeouts() == 0
