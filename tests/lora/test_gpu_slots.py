"""Fewer GPU slots than adapters (``patch(max_loras_per_batch=M)``), on the CPU.

The stacks hold M adapters; each call's adapters are put in slots before its forwards, the least
recently used others giving theirs up. Every call is compared with PEFT's own mixed batch on an
identical model: adapters of different ranks and targets (q/v only, the MLP only, the embedding)
take slots that others held, so a stale rank, scaling or view of the previous tenant shows up.
"""

from __future__ import annotations

import random

import pytest
import torch

import peft_fastlora as fastlora
from peft_fastlora import get_state

from _continuous import cb_config, greedy_config, peft_alone, requires_cb
from _patch_models import ALL, VOCAB, build, logits

TOL = dict(atol=1e-5, rtol=1e-5)
ADAPTERS = (("sql", ALL, 4, {}), ("chat", ("q_proj", "v_proj"), 8, {}), ("mlp", ("gate_proj", "down_proj"), 2, {}),
            ("wide", ("o_proj", "up_proj"), 16, {}), ("emb", ("embed_tokens", "q_proj"), 4, {}),
            ("kv", ("k_proj", "v_proj"), 6, {}))
NAMES = sorted(a[0] for a in ADAPTERS)


def _pair():
    return build(adapters=ADAPTERS), build(adapters=ADAPTERS)


def _ids(rows, seed):
    return torch.randint(3, VOCAB, (rows, 5), generator=torch.Generator().manual_seed(seed))


def _same(m, ref, names, seed=0):
    ids = _ids(len(names), seed)
    torch.testing.assert_close(logits(m, names, ids), logits(ref, names, ids), **TOL)


def test_stacks_hold_the_slots_and_every_call_equals_peft():
    m, ref = _pair()
    report = fastlora.patch(m, max_loras_per_batch=3)
    state = get_state(m)
    assert " in slots (3 for 6 adapters, loaded on demand)" in str(report)  # on the CPU: not "GPU slots"
    assert all(site.pool.num_slots == 3 for site in state.sites)
    rng = random.Random(0)
    for call in range(25):
        used = rng.sample(NAMES, rng.randint(1, 3))
        names = [rng.choice(used + ["__base__"]) for _ in range(rng.randint(1, 6))]
        _same(m, ref, names, seed=call)
    stats = state.registry.stats
    assert stats["loads"] > 6 and stats["evictions"] > 0 and stats["load_seconds"] > 0, stats


def test_the_least_recently_used_adapter_gives_up_its_slot():
    m, ref = _pair()
    fastlora.patch(m, max_loras_per_batch=3)
    registry = get_state(m).registry
    for names in (["sql"], ["chat", "sql"], ["mlp"]):
        _same(m, ref, names)
    assert registry.resident == ["sql", "chat", "mlp"]
    _same(m, ref, ["sql"])  # sql used again: chat is now the least recent
    _same(m, ref, ["wide", "__base__"])
    assert registry.resident == ["sql", "wide", "mlp"] and registry.stats["evictions"] == 1
    _same(m, ref, ["emb", "kv", "wide"])  # sql and mlp go (mlp before sql? both older than wide)
    assert set(registry.resident) == {"emb", "kv", "wide"} and registry.slot["wide"] == 1
    _same(m, ref, ["chat", "emb", "__base__", "chat"])


def test_more_distinct_adapters_than_slots_is_refused_and_the_model_still_serves():
    m, ref = _pair()
    fastlora.patch(m, max_loras_per_batch=2)
    with pytest.raises(ValueError, match="3 distinct adapters in one batch exceed max_loras_per_batch=2"):
        logits(m, ["sql", "chat", "mlp"], _ids(3, 1))
    with torch.no_grad(), pytest.raises(ValueError, match="the slots of the adapter stacks"):
        m.generate(input_ids=_ids(3, 2), attention_mask=torch.ones(3, 5, dtype=torch.long),
                   adapter_names=["kv", "chat", "emb"], max_new_tokens=2, do_sample=False)
    _same(m, ref, ["kv", "emb", "__base__"])


def test_emulated_decode_graphs_stay_valid_across_swaps():
    m, ref = _pair()
    for model in (m, ref):
        model.generation_config.eos_token_id = None
    fastlora.patch(m, max_loras_per_batch=2, cuda_graphs="emulate")
    state = get_state(m)
    calls = [["sql", "chat", "sql"], ["mlp", "__base__", "wide"], ["emb", "emb", "kv"], ["chat", "wide", "chat"],
             ["kv", "sql", "__base__"]]
    captures = None
    for i, names in enumerate(calls):
        ids = _ids(3, 10 + i)
        mask = torch.ones_like(ids)
        mask[0, :2] = mask[2, :1] = 0  # left padding
        batch = dict(input_ids=ids * mask, attention_mask=mask)
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, adapter_names=names)
        with torch.no_grad():
            out, want = m.generate(**batch, **kw), ref.generate(**batch, **kw)
        assert torch.equal(out, want), (i, names)
        if captures is None:
            captures = state.graph_runner.stats["captures"]
    stats = state.graph_runner.stats
    assert stats["captures"] == captures and stats["eager_steps"] == 0, stats  # swaps recaptured nothing
    assert state.registry.stats["evictions"] >= 6


def test_values_edited_in_place_are_followed_in_a_slot():
    m, ref = _pair()
    fastlora.patch(m, max_loras_per_batch=2)
    _same(m, ref, ["chat", "sql"])
    for model in (m, ref):
        layer = model.base_model.model.model.layers[0].self_attn.q_proj
        with torch.no_grad():
            layer.lora_B["chat"].weight.mul_(3.0)
    _same(m, ref, ["chat", "__base__"])
    _same(m, ref, ["mlp", "wide"])  # chat leaves its slot, then comes back: loaded again
    _same(m, ref, ["chat", "kv"])


def test_an_adapter_added_through_peft_joins_the_slots():
    m, ref = _pair()
    fastlora.patch(m, max_loras_per_batch=2)
    _same(m, ref, ["sql", "chat"])
    from _patch_models import lora

    for model in (m, ref):
        torch.manual_seed(7)
        model.add_adapter("new", lora(("v_proj", "down_proj"), 12, 24))
    _same(m, ref, ["new", "sql", "new"])
    assert get_state(m).registry.num_slots == 2 and len(get_state(m).registry) == 7


def test_a_slot_that_held_a_biased_adapter_adds_no_bias_for_the_next():
    """``lora_bias`` adapters through the slots: a slot's bias row follows its adapter (zeros for
    one without a bias), calls alternating between biased and plain adapters in two slots."""
    adapters = ADAPTERS[:3] + (("biased", ("q_proj", "down_proj"), 4, {"lora_bias": True}),
                               ("biased_all", ALL, 8, {"lora_bias": True}))
    m, ref = build(adapters=adapters), build(adapters=adapters)
    fastlora.patch(m, max_loras_per_batch=2)
    for names in (["biased", "sql"], ["chat", "mlp"], ["biased_all", "__base__"], ["sql", "chat"],
                  ["biased", "biased_all"], ["mlp", "biased"]):
        _same(m, ref, names)
    assert get_state(m).report.adapter_fallbacks == []


def test_by_default_every_adapter_keeps_its_slot():
    m, ref = _pair()
    report = fastlora.patch(m)
    registry = get_state(m).registry
    assert registry.all_resident and registry.resident == NAMES and "GPU slots" not in str(report)
    _same(m, ref, ["sql", "chat", "mlp", "wide", "emb", "kv"])
    assert registry.stats["loads"] == 0


@requires_cb
def test_continuous_batching_with_fewer_slots_than_adapters(caplog):
    """Each engine step holds at most as many requests as slots (so as many adapters); every
    request gets PEFT's tokens for its prompt alone, while adapters come and go from the slots."""
    m, ref = _pair()
    fastlora.patch(m, max_loras_per_batch=2)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 9))] for _ in range(10)]
    names = [NAMES[i % len(NAMES)] for i in range(9)] + ["__base__"]
    with caplog.at_level("WARNING", logger="peft_fastlora"):
        out = m.generate_batch(prompts, generation_config=greedy_config(4), continuous_batching_config=cb_config(),
                               adapter_names=names)
    assert "max_requests_per_batch=2 (each step's adapters must fit the slots)" in caplog.text
    got = [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]
    for tokens, p, n in zip(got, prompts, names):
        assert tokens == peft_alone(ref, p, n, 4), n
    assert get_state(m).registry.stats["evictions"] > 0


def test_what_slots_keep_stays_bounded_over_many_swaps():
    """A server swaps adapters for days: the views, pairs and lists kept for the slots must not
    grow with the number of calls (only with slots, modules and ranks)."""
    m, _ = _pair()
    fastlora.patch(m, max_loras_per_batch=2)
    state = get_state(m)
    rng = random.Random(9)

    def kept():
        pools = [site.pool for site in state.sites]
        for p in pools:  # views: a bounded cache, whatever the places and ranks seen
            assert len(p._view_cache) <= 4 * p.num_slots * p.stack_num, len(p._view_cache)
        return (sum(len(p.copies) + len(p._fixed) + len(p._runs) for p in pools), len(state._watches),
                len(state.slots._refresher._merged), tuple(state.registry._recent) != (), len(state.registry.slot))

    for k in range(400):
        used = rng.sample(NAMES, 2)
        logits(m, [rng.choice(used + ["__base__"]) for _ in range(3)], _ids(3, k % 7))
        if k == 100:
            early = kept()
    late = kept()
    assert late == early and late[2] <= 8 and late[4] == 2, (early, late)
    assert state.registry.stats["loads"] > 300


def test_a_load_that_fails_leaves_no_half_written_slot(monkeypatch):
    """An error while adapters are copied into slots (out of memory, say) fails that call; the
    adapters are not taken for loaded, so the next call loads them again and equals PEFT. The
    garbage collector is paused during every load and back on after it, failed or not (and left
    off where the user had turned it off)."""
    import gc

    from peft_fastlora.lora import pool as pool_module

    m, ref = _pair()
    fastlora.patch(m, max_loras_per_batch=2)
    _same(m, ref, ["sql", "chat"])
    real, failures, collecting = pool_module.SitePool.load, [0], []

    def failing(self, placed):
        collecting.append(gc.isenabled())
        if failures[0] == 0:
            failures[0] += 1
            self._place(*placed[0])  # the first pool's slot is half rewritten, then the error
            raise RuntimeError("injected: out of memory while loading")
        return real(self, placed)

    monkeypatch.setattr(pool_module.SitePool, "load", failing)
    with pytest.raises(RuntimeError, match="injected"):
        logits(m, ["mlp", "sql"], _ids(2, 3))
    assert gc.isenabled()
    registry = get_state(m).registry
    assert "mlp" not in registry.slot and None in registry.resident
    _same(m, ref, ["mlp", "sql", "__base__"])  # loaded again, whole
    assert gc.isenabled()
    gc.disable()
    try:
        _same(m, ref, ["chat", "mlp"])
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert collecting and not any(collecting), collecting


def test_stacks_hold_exactly_the_adapters_own_bytes():
    """Pad-free: ranks 2-16 and targets that differ per adapter (the embedding too), yet every
    site's stacks hold exactly its adapters' weights."""
    m, _ = _pair()
    report = fastlora.patch(m)
    logits(m, ["sql"], _ids(1, 0))
    own = sum(p.numel() * 4 for n, p in m.named_parameters() if "lora_" in n)  # fp32
    state = get_state(m)
    assert report.adapter_bytes == own
    assert {site.kind for site in state.sites} >= {"embedding", "qkv", "linear"}
    for site in state.sites:
        assert site.pool.nbytes() == site.pool.adapter_nbytes() > 0, site.name
    assert state.report.stack_bytes == own
    assert f"adapters' own weights {own / 2**20:.1f} MiB" in str(report)


def test_sites_know_whether_their_adapters_ranks_differ():
    """The fused decode kernel's launch is chosen by it: q/k/v holds ranks 4, 8, 4 and 6 (mixed);
    a model whose adapters share one rank has none mixed."""
    m, _ = _pair()
    fastlora.patch(m)
    logits(m, ["sql"], _ids(1, 0))
    mixed = {site.kind: site.pool.packed.mixed_ranks for site in get_state(m).sites if site.pool.packed is not None}
    assert mixed["qkv"] is True
    same = build(adapters=(("a", ALL, 8, {}), ("b", ("q_proj", "v_proj"), 8, {})))
    fastlora.patch(same)
    logits(same, ["a"], _ids(1, 0))
    assert not any(site.pool.packed.mixed_ranks for site in get_state(same).sites if site.pool.packed is not None)


def test_row_arena_first_fit_and_compaction():
    from peft_fastlora.lora.arena import RowArena

    arena = RowArena(48)
    assert arena.alloc(0, 16) == {} and arena.alloc(1, 8) == {} and arena.alloc(2, 16) == {}
    assert [arena.start_of(s) for s in (0, 1, 2)] == [0, 16, 24]
    arena.free(1)
    assert arena.alloc(3, 8) == {} and arena.start_of(3) == 16  # the gap it left, first fit
    arena.free(0)
    arena.free(3)
    # free: 0-16, 16-24 (one gap of 24) and 40-48; 24 rows fit in the first without moving
    assert arena.alloc(4, 24) == {} and arena.start_of(4) == 0
    arena.free(4)
    arena.alloc(5, 8)  # at 0: gaps 8-24 (16) and 40-48 (8), 24 free in all
    assert arena.start_of(5) == 0
    moved = arena.alloc(6, 24)  # no gap of 24: compacted, slot 2 slid down next to slot 5
    assert moved == {2: (24, 8, 16)} and arena.start_of(2) == 8 and arena.start_of(6) == 24
    with pytest.raises(RuntimeError, match="do not fit"):
        arena.alloc(7, 8)
    with pytest.raises(RuntimeError, match="already holds"):
        arena.alloc(6, 8)


def test_compaction_under_slot_traffic_equals_peft(monkeypatch):
    """Slots swapped among adapters of ranks 2-16 fragment the arenas until a block only fits
    after compaction; the blocks that moved are moved on the device, every call still equals
    PEFT, and the gate/up sites' table of each arena row's slot follows the blocks."""
    from peft_fastlora.lora import arena as arena_module

    m, ref = _pair()
    # (folded whatever their size, B's columns too)
    fastlora.patch(m, max_loras_per_batch=2, fold_shrink=True, stream_gemm=True,
                   tuning=fastlora.Tuning(fold_max_share=1.0))
    compactions, alloc = [], arena_module.RowArena.alloc

    def counted(self, slot, rows):
        moved = alloc(self, slot, rows)
        compactions.append(len(moved))
        return moved

    monkeypatch.setattr(arena_module.RowArena, "alloc", counted)
    rng = random.Random(4)
    gate_up = [site.pool for site in get_state(m).sites if site.pool.column_slots]
    assert gate_up
    checked = []
    for call in range(60):
        used = rng.sample(NAMES, 2)
        _same(m, ref, used + [rng.choice(used + ["__base__"]) for _ in range(2)], seed=call)
        for pool in gate_up:  # ops.glu_lora's table: each arena row's slot follows the blocks
            want = torch.full_like(pool.col_slot, -1)
            for (slot, j), rank in zip(torch.cartesian_prod(torch.arange(2), torch.arange(2)).tolist(),
                                       pool.ranks.flatten().tolist()):
                row = int(pool.packed.a_rows[slot, j])
                want[row: row + rank] = slot
            assert torch.equal(pool.col_slot, want), call
            if pool.glu_buffers is not None:  # and B's columns (ops.glu_lora's bt) follow the blocks and values
                checked.append(pool)
                bt = torch.zeros_like(pool.glu_buffers.bt)
                t0, t0_pad, n = pool.region_start(1), pool.glu_buffers.t0_pad, bt.shape[0]
                for c in (pool.col_slot >= 0).nonzero().flatten().tolist():
                    slot, j = int(pool.col_slot[c]), int(c >= t0)
                    rank, first = int(pool.ranks[slot, j]), int(pool.packed.a_rows[slot, j])
                    off = int(pool.packed.b_offs[slot, j])
                    block = pool.packed.b[off: off + n * rank].view(n, rank)
                    bt[:, c if c < t0 else t0_pad + c - t0] = block[:, c - first]
                assert torch.equal(pool.glu_buffers.bt, bt), call
    assert sum(1 for n in compactions if n) >= 2, compactions  # this seed compacts twice
    assert checked  # (some gate/up sites folded without staging: they keep B's columns)


def test_a_load_that_fails_after_compaction_leaves_every_slot_right(monkeypatch):
    """The copy to the GPU fails (out of memory for the staging buffer, say) in a load whose
    compaction has already slid the blocks of an adapter that stays in its slot: the tables on the
    GPU still point where its blocks were. A next call with only adapters in slots (no load to
    rewrite the tables) must not read them: it and every call after equal PEFT (the stacks are
    rebuilt, the graphs' generation moves on), and the tables say where every block is."""
    import peft_fastlora.lora.slot_loader as loader_module
    from peft_fastlora.lora import arena as arena_module

    m, ref = _pair()
    fastlora.patch(m, max_loras_per_batch=2)
    state = get_state(m)
    moved_now, alloc = [], arena_module.RowArena.alloc

    def counted(self, slot, rows):
        moved = alloc(self, slot, rows)
        moved_now.extend(moved)  # the other slots whose blocks slid
        return moved

    real_copy, failed, call_names = loader_module.copy_from_host, [], []

    def copy(pairs, runs=(), prestaged=None, tuning=None):
        slid = {state.registry.resident[slot] for slot in moved_now} - set(call_names) - {None}
        if slid and not failed:
            failed.append((state.generation, sorted(slid)))
            raise RuntimeError("injected: out of memory for the staging buffer")
        return real_copy(pairs, runs, prestaged, tuning)

    monkeypatch.setattr(arena_module.RowArena, "alloc", counted)
    monkeypatch.setattr(loader_module, "copy_from_host", copy)
    rng = random.Random(1)  # slides the blocks of an adapter that stays, in its 8th call
    for call in range(40):
        used = rng.sample(NAMES, rng.randint(1, 2))
        names = used + [rng.choice(used + ["__base__"])]
        moved_now.clear()
        call_names[:] = names
        if failed:
            _same(m, ref, names, seed=call)
            continue
        try:
            _same(m, ref, names, seed=call)
        except RuntimeError as e:
            assert "injected" in str(e)
            generation, slid = failed[0]
            assert all(name in state.registry.slot for name in slid)
            _same(m, ref, slid, seed=call)  # only adapters in their slots: no load rewrites the tables
            assert state.generation > generation
            _check_pool_invariants(state)  # the tables on the device say where every block is
            _same(m, ref, names, seed=call)  # the failed call again, then the rest of the traffic
    assert failed, "the traffic never slid a block of an adapter staying in its slot"


def _check_pool_invariants(state):
    """Every resident adapter's blocks hold its weights, where the tables say; no two blocks of a
    module overlap, and all lie inside the module's region."""
    for site in state.sites:
        pool = site.pool
        rows = pool.packed.a_rows.tolist()
        assert rows == pool._slot_a_rows and pool.packed.b_offs.tolist() == pool._slot_b_offs
        for arena in pool._arenas:
            spans = sorted(arena.blocks.values())
            assert all(s + n <= t for (s, n), (t, _) in zip(spans, spans[1:])), spans
            assert all(s >= 0 and s + n <= arena.capacity for s, n in spans), (spans, arena.capacity)
        for slot, name in enumerate(state.registry.resident):
            if name is None:
                continue
            for j, a, b, *_ in pool._sources.get(name, ()):
                k = a.shape[0]
                assert int(pool.ranks[slot, j]) == k
                assert torch.equal(pool.packed_view_a(slot, j, k), a), (site.name, name, j)
                assert torch.equal(pool.packed_view_b(slot, j, k), b), (site.name, name, j)


def test_packed_pools_stay_consistent_under_random_calls():
    """Random calls over adapters of ranks 2-16 (the embedding among the targets) through 3 slots:
    after every call, the stacks, the tables and the arenas agree with the adapters' weights."""
    m, ref = _pair()
    fastlora.patch(m, max_loras_per_batch=3)
    state = get_state(m)
    rng = random.Random(21)
    for call in range(80):
        used = rng.sample(NAMES, rng.randint(1, 3))
        names = [rng.choice(used + ["__base__"]) for _ in range(rng.randint(1, 5))]
        logits(m, names, _ids(len(names), call))
        _check_pool_invariants(state)
        if call % 20 == 0:
            _same(m, ref, names, seed=call)
    assert state.registry.stats["evictions"] > 20
