"""The page table of each engine step (``continuous.pages``), through which the in-place attention
finds every request's keys, against the engine's own read index (CPU).

A started manager serves prompts longer than a page and than a step (prefill chunks with history
beside decode rows, requests ending and new ones taking their pages, and a cache too small for the
requests in flight); before each forward, every request's keys as the table names them are
compared with the slots the engine would read for them, and every request's tokens with PEFT's. A step that would need more pages than the table holds, or a block table shorter than a
request's keys, is refused by name instead of reading another request's keys.
"""

from __future__ import annotations

import copy

import pytest
import torch

import peft_fastlora as fastlora
from peft_fastlora import get_state
from peft_fastlora.compat.engine import cb_layer_indices, cb_step_key_counts
from peft_fastlora.continuous import pages as step_pages
from peft_fastlora.kernel_support import interpreting

from _continuous import cb_config, greedy_config, peft_alone, random_prompts, requires_cb, serve
from _models import build_peft_lm

pytestmark = [requires_cb, pytest.mark.skipif(not interpreting(), reason="the in-place kernel runs on CPU under "
                                                                         "TRITON_INTERPRET=1")]


def _engine_slots(processor, layer: int, request_id: str, keys: int) -> list:
    """The cache slots the engine's read index would list for a request's first ``keys`` keys."""
    cache = processor.cache
    groups = len(getattr(cache, "cache_allocators", None) or cache.group_cache_managers)
    reads, writes = [[] for _ in range(groups)], [[] for _ in range(groups)]
    cache.extend_read_and_write_indices(request_id, 0, keys, reads, writes)
    return cb_layer_indices(cache, layer, {"read_index": reads, "write_index": writes})[0]


@pytest.mark.parametrize("page, blocks", [(4, 64), (4, 12)], ids=["roomy", "pressure"])
def test_each_steps_pages_name_the_keys_the_engine_would_read(page, blocks, monkeypatch):
    """``pressure``: a cache too small for the requests in flight, so that the engine frees some
    requests' pages and requeues them (their keys are computed again into other pages): every
    request still equals PEFT's tokens for its prompt alone."""
    m = build_peft_lm("llama")
    ref = copy.deepcopy(m)
    fastlora.patch(m, engine_attention="paged")
    checked = []
    load = step_pages.StepPages.load

    def load_and_check(self, processor):
        load(self, processor)
        ids, keys = cb_step_key_counts(processor)
        for layer in self._layer_group:
            table = self.of_layer(layer)
            for i, (rid, n) in enumerate(zip(ids, keys)):
                assert table.slots(i, n).tolist() == _engine_slots(processor, layer, rid, n), (rid, n, layer)
        checked.append(max(keys))

    monkeypatch.setattr(step_pages.StepPages, "load", load_and_check)
    from transformers.generation.continuous_batching import offloading_manager

    offloads = []
    owner = next(c for c in vars(offloading_manager).values() if isinstance(c, type) and hasattr(c, "offload_requests"))
    offload = owner.offload_requests
    monkeypatch.setattr(owner, "offload_requests", lambda self, *a, **k: (offloads.append(1), offload(self, *a, **k))[1])
    prompts = random_prompts([3, 40, 9, 33, 1, 17, 26], seed=5)
    names = ["a0", "a1", "__base__", "a2", "a1", "a0", "a2"]
    try:
        manager = m.init_continuous_batching(
            generation_config=greedy_config(6),
            continuous_batching_config=cb_config(max_batch_tokens=24, page=page, num_blocks=blocks))
        manager.start()
        got = serve(manager, [(p, n, 6) for p, n in zip(prompts, names)])
        manager.stop(block=True)
    finally:
        fastlora.unpatch(m)
    assert len(checked) > 10 and max(checked) > 2 * page  # many steps, requests over several pages
    assert bool(offloads) == (blocks < 64)  # the small cache made the engine free and requeue requests
    for tokens, p, n in zip(got, prompts, names):
        assert tokens == peft_alone(ref, p, n, 6), (n, len(p))


def test_a_stopped_manager_lets_its_cache_and_pages_go():
    """The page table and the engine's skipped read indices keep no cycle through the batch
    processor: its cache goes by reference counting alone when the manager stops."""
    import gc
    import weakref

    m = build_peft_lm("llama")
    fastlora.patch(m, engine_attention="paged")
    gc.disable()
    try:
        manager = m.init_continuous_batching(generation_config=greedy_config(4),
                                             continuous_batching_config=cb_config(max_batch_tokens=24))
        manager.start()
        serve(manager, [(p, "a0", 4) for p in random_prompts([5, 20], seed=3)])
        processor = manager.batch_processor
        assert getattr(processor.cache, "_fastlora_pages", None) is not None  # the in-place path ran
        refs = weakref.ref(processor), weakref.ref(processor.cache), weakref.ref(processor.model_runner)
        del processor
        manager.stop(block=True)
        assert [r() for r in refs] == [None, None, None]
    finally:
        gc.enable()
        fastlora.unpatch(m)


class _Group:
    def __init__(self, tables, size=4, stride=4):
        self.size, self.stride = size, stride
        self.tables = lambda: tables


def test_a_block_table_shorter_than_the_step_is_refused():
    with pytest.raises(RuntimeError, match="block tables hold 3 of the 4 pages"):
        step_pages._blocks_of({"r0": [5, 2], "r1": [7]}, ["r0", "r1"], [2, 2], 4)


def test_a_step_needing_more_pages_than_the_table_holds_is_refused(monkeypatch):
    table = step_pages.StepPages.__new__(step_pages.StepPages)
    table.groups, table._size, table._cu_len, table.capacity = [_Group({"r0": list(range(9))})], 4, 4, 2
    table._host = torch.zeros(4 + 2, dtype=torch.int32)
    table._host_np, table._device = table._host.numpy(), torch.zeros(6, dtype=torch.int32)
    monkeypatch.setattr(step_pages, "cb_step_key_counts", lambda processor: (["r0"], [33]))
    with pytest.raises(RuntimeError, match="reads 9 pages of keys, more than the 2"):
        table.load(None)
