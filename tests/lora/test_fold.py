"""The shrink folded into the base GEMM (``fold_shrink``): each site's packed A arena stored as rows
under its base weight, so that a decode-sized forward takes every adapter's ``x @ A.T`` from the
base GEMM and runs only the expand after it.

The tiny models here would not fold under the default limit (their adapters' A rows are a large
share of the base rows), so most tests raise it; one checks the limit itself.
"""

from __future__ import annotations

import pytest
import torch

import peft_fastlora as fastlora
from peft_fastlora import Tuning
from peft_fastlora.compat.peft import base_layer_of
from peft_fastlora.backend.segmented import SegmentedLoRABackend

pytest.importorskip("peft")
from peft import LoraConfig  # noqa: E402

from _helpers import count_backend_calls  # noqa: E402
from _models import ARCHS, build_peft_lm, left_padded_batch  # noqa: E402
from test_fusion_pool import IDS, NAMES, TOL, build, greedy, layers_of, logits, storage_bytes  # noqa: E402
from test_register_adapter import folders  # noqa: E402,F401 (a fixture)

BACKENDS = ["torch_native", "triton"]


@pytest.fixture
def no_limit():
    """Every site folds for every call, whatever its arena's size."""
    return Tuning(fold_max_share=1e9)


@pytest.fixture
def calls(monkeypatch):
    return count_backend_calls(monkeypatch, SegmentedLoRABackend, ("run_packed_lora", "run_packed_expand"))


@pytest.fixture(scope="module")
def reference():
    return {arch: (logits(m), greedy(m)) for arch, m in (("llama", build("llama")), ("qwen2", build("qwen2")))}


def one_token(model, names=NAMES):
    with torch.no_grad():
        return model(input_ids=IDS[:, -1:], adapter_names=names).logits


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases, zeros under the arena
def test_folded_sites_equal_peft(arch, backend, reference, no_limit, calls):
    ref_logits, ref_tokens = reference[arch]
    m = build(arch)
    ref_one = one_token(m)
    report = fastlora.patch(m, backend=backend, fold_shrink=True, tuning=no_limit)
    assert report.shrink_folded == "8 of 8 sites", report
    assert "shrink folded into the base GEMM: 8 of 8 sites" in str(report)
    torch.testing.assert_close(logits(m), ref_logits, **TOL)
    assert calls["run_packed_expand"] == 8 and calls["run_packed_lora"] == 0, calls  # one per site
    torch.testing.assert_close(one_token(m), ref_one, **TOL)
    assert torch.equal(greedy(m), ref_tokens)


def test_base_weights_are_views_of_the_folded_tensor_and_come_back_on_unpatch(no_limit):
    m = build()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    params_before = sum(p.numel() for p in m.parameters())
    bytes_before = storage_bytes(m)
    fastlora.patch(m, fold_shrink=True, tuning=no_limit)
    state = fastlora.get_state(m)
    o_proj = layers_of(m)[0].self_attn.o_proj
    site = next(s for s in state.sites if s.members[0] is o_proj)
    fold = site.pool.fold
    assert fold.kind == "linear" and site.pool.folded()
    w = o_proj.base_layer.weight
    assert w.data_ptr() == fold.ext.data_ptr()  # the base rows first, then the arena
    assert site.pool.lora_a.data_ptr() == fold.ext[w.shape[0]:].data_ptr()
    # the model's own view is unchanged: same parameters, same values, no second copy of a weight
    assert sum(p.numel() for p in m.parameters()) == params_before
    after = m.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    arenas = sum(s.pool.lora_a.untyped_storage().nbytes() for s in state.sites if s.pool.folded())
    assert storage_bytes(m) <= bytes_before + arenas
    fastlora.unpatch(m)
    assert o_proj.base_layer.weight.untyped_storage().nbytes() == w.numel() * w.element_size()
    restored = m.state_dict()
    assert all(torch.equal(restored[k], before[k]) for k in before)


def _kinds(sites, tuning=Tuning()):
    """Each site's fold under the limits: "always", "per_call" or "none"."""
    out = []
    for s in sites:
        share = s.pool.lora_a.shape[0] / s.pool.offsets[-1]
        out.append("always" if share <= tuning.fold_max_share else
                   "per_call" if share <= tuning.fold_call_share else "none")
    return out


def test_default_limits_fold_small_arenas_always_and_larger_ones_per_call(reference, calls, monkeypatch):
    """A site folds for every call while its A rows add at most 1/8 of its base rows, for the calls
    that use enough of them up to ``fold_call_share`` (lowered here so that this model has all three
    kinds), and keeps the fused kernel past it."""
    tuning = Tuning(fold_call_share=0.4)
    m = build()
    report = fastlora.patch(m, fold_shrink=True, tuning=tuning)
    sites = fastlora.get_state(m).sites
    kinds = _kinds(sites, tuning)
    assert {"always", "per_call", "none"} <= set(kinds), kinds
    assert [s.pool.folded() for s in sites] == [k != "none" for k in kinds]
    assert [s.pool.folds_per_call() for s in sites] == [k == "per_call" for k in kinds]
    n_always, n_call = kinds.count("always"), kinds.count("per_call")
    assert report.shrink_folded == (f"{n_always} of 8 sites (and {n_call} more in calls whose adapters use "
                                    f"at least 33% of their A rows)"), report.shrink_folded
    assert [name for name, _ in report.fold_refused] == [s.name for s, k in zip(sites, kinds) if k == "none"]
    assert all("would add more than 0.4 of its" in why for _, why in report.fold_refused), report.fold_refused
    torch.testing.assert_close(logits(m), reference["llama"][0], **TOL)
    assert fastlora.get_state(m).last_fold  # every adapter: all their rows
    assert calls["run_packed_expand"] == n_always + n_call and calls["run_packed_lora"] == kinds.count("none")


def test_per_call_sites_fold_for_calls_that_use_enough_of_them(calls):
    """Under the default limits this model's larger arenas fold per call: a call whose adapters
    hold at least a third of those arenas' rows takes the folded GEMM there, one using less the
    fused kernel; both equal PEFT."""
    m = build()
    state_names = sorted(n for n in NAMES if n != "__base__")
    want = {name: logits(m, [name, "__base__"] * 2) for name in state_names}
    want_all = logits(m)
    fastlora.patch(m, fold_shrink=True)
    state = fastlora.get_state(m)
    per_call = [s.pool for s in state.sites if s.pool.folds_per_call()]
    assert per_call and len(per_call) < len(state.sites), _kinds(state.sites)
    tails = sum(p.lora_a.shape[0] for p in per_call)
    chose = set()
    for name in state_names:
        calls.clear()
        torch.testing.assert_close(logits(m, [name, "__base__"] * 2), want[name], **TOL)
        used = sum(p.rows_used([state.registry.slot[name]]) for p in per_call)
        folds = used >= state.options.tuning.fold_min_use * tails
        assert state.last_fold == folds
        assert calls["run_packed_lora"] == (0 if folds else len(per_call)), (name, calls)
        chose.add(folds)
    assert chose == {False, True}, "the adapters here should exercise both choices"
    torch.testing.assert_close(logits(m), want_all, **TOL)
    assert state.last_fold


def test_emulated_graphs_keyed_by_the_fold_choice():
    """With per-call sites, a call that folds and one that does not replay different graphs; the
    default limit keeps both per bucket, so alternating calls capture each once."""
    m = build()
    few, many = ["mlp", "__base__"] * 2, NAMES  # "mlp" alone holds little of the per-call rows
    want = {tuple(n): greedy(m, n, n=5) for n in (few, many)}
    with fastlora.patched(m, cuda_graphs="emulate", fold_shrink=True, graph_buckets=[4]):
        state = fastlora.get_state(m)
        assert state.folds_per_call() and state.graph_runner.max_graphs == 2
        chose = []
        for _ in range(3):
            for names in (few, many):
                assert torch.equal(greedy(m, names, n=5), want[tuple(names)]), names
                chose.append(state.last_fold)
        assert chose == [False, True] * 3
        stats = state.graph_runner.stats
        assert stats["captures"] == 2 and stats["evictions"] == 0 and stats["replays"] > 0, stats


def test_warmup_captures_both_fold_choices_then_traffic_captures_nothing():
    m = build()
    with fastlora.patched(m, cuda_graphs="emulate", fold_shrink=True, graph_buckets=[1, 2, 4]):
        state = fastlora.get_state(m)
        report = fastlora.warmup(m, max_length=16)
        keys = {(k[1], k[2]) for k in state.graph_runner.graphs}
        assert {(4, ("fold", True)), (4, ("fold", False)), (1, ("fold", False))} <= keys, keys
        assert report.captures == len(keys)
        for names in (NAMES, ["mlp", "__base__"] * 2, ["sql"] * 4, ["chat", "sql", "mlp", "mlp"]):
            greedy(m, names, n=3)
        for names in (["sql"], ["mlp"], ["chat", "__base__"], ["sql", "chat"]):
            with torch.no_grad():
                m.generate(input_ids=IDS[:len(names)], attention_mask=torch.ones_like(IDS[:len(names)]),
                           adapter_names=names, max_new_tokens=3, do_sample=False)
        assert state.graph_runner.stats["captures"] == report.captures, state.graph_runner.stats


@pytest.mark.parametrize("option,why", [(False, "off (fold_shrink=False)"), ("auto", "off (not on CUDA)")])
def test_off_and_auto_on_cpu(option, why, no_limit, calls):
    m = build()
    report = fastlora.patch(m, fold_shrink=option, tuning=no_limit)
    assert report.shrink_folded == why and report.fold_refused == []
    assert all(s.pool.fold is None for s in fastlora.get_state(m).sites)
    logits(m)
    assert calls["run_packed_expand"] == 0


def test_bad_option():
    with pytest.raises(ValueError, match="fold_shrink must be True, False or 'auto'"):
        fastlora.patch(build(), fold_shrink="yes")


def test_prefill_sized_forward_keeps_the_shrink_kernel(no_limit, calls):
    """Over ``Tuning.fold_max_tokens`` (256) tokens the sites launch the shrink kernel, which reads
    each adapter's A for its own tokens only: by default the fold serves decode-sized forwards."""
    m = build()
    ids = torch.randint(3, 100, (2, 150), generator=torch.Generator().manual_seed(5))
    names = ["sql", "chat"]
    want = logits(m, names, ids)
    fastlora.patch(m, backend="torch_native", fold_shrink=True, tuning=no_limit)
    got = logits(m, names, ids)
    assert calls["run_packed_expand"] == 0 and calls["run_packed_lora"] == 8, calls
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fold_token_limit_decides_per_forward(backend, no_limit, calls):
    """``Tuning.fold_max_tokens``: a forward of at most that many tokens takes the shrink from the
    folded GEMM, a larger one the shrink kernel; both equal PEFT. Raised past 256, a forward in the
    32-row tile folds too."""
    ids = torch.randint(3, 100, (2, 150), generator=torch.Generator().manual_seed(5))
    names = ["sql", "chat"]
    for limit, tokens, folded in ((4, 8, False), (8, 8, True), (4096, 300, True), (299, 300, False)):
        m = build()
        want = logits(m, names, ids[:, : tokens // 2])
        fastlora.patch(m, backend=backend, fold_shrink=True, tuning=no_limit.replace(fold_max_tokens=limit))
        calls.clear()
        got = logits(m, names, ids[:, : tokens // 2])
        expected = dict(run_packed_expand=8, run_packed_lora=0) if folded else dict(run_packed_expand=0, run_packed_lora=8)
        assert {k: calls[k] for k in expected} == expected, (limit, tokens, calls)
        torch.testing.assert_close(got, want, **TOL)
        fastlora.unpatch(m)


def test_replaced_base_weight_refolds_and_stays_equal_to_peft(no_limit, calls):
    m = build()
    fastlora.patch(m, fold_shrink=True, tuning=no_limit)
    logits(m)
    layer = layers_of(m)[1]
    with torch.no_grad():  # new storage (and values) for a fused member and for a single layer
        layer.self_attn.q_proj.base_layer.weight.data = layer.self_attn.q_proj.base_layer.weight.data * 1.5
        layer.mlp.down_proj.base_layer.weight.data = layer.mlp.down_proj.base_layer.weight.data - 0.1
    got = logits(m)
    assert all(s.pool.folded() for s in fastlora.get_state(m).sites)  # refolded around the new storage
    assert calls["run_packed_expand"] == 16 and calls["run_packed_lora"] == 0, calls
    fastlora.unpatch(m)
    torch.testing.assert_close(got, logits(m), **TOL)


def test_slots_and_an_added_adapter_stay_folded_and_equal_to_peft(no_limit):
    """Fewer GPU slots than adapters (loads and compaction write into the arena under the
    weight), then an adapter added after patching (the sites are rebuilt and fold again)."""
    m = build()
    mixes = [["sql", "sql", "chat", "__base__"], ["mlp", "chat", "mlp", "__base__"], ["mlp", "mlp", "mlp", "mlp"]]
    want = [logits(m, names) for names in mixes]
    fastlora.patch(m, max_loras_per_batch=2, fold_shrink=True, tuning=no_limit)
    for _ in range(2):
        for names, ref in zip(mixes, want):
            torch.testing.assert_close(logits(m, names), ref, **TOL)
    torch.manual_seed(9)
    m.add_adapter("late", LoraConfig(r=4, lora_alpha=4, target_modules=["o_proj", "up_proj"],
                                     init_lora_weights=False))
    names = ["late", "sql", "__base__", "late"]
    got = logits(m, names)
    assert all(s.pool.folded() for s in fastlora.get_state(m).sites)
    fastlora.unpatch(m)
    torch.testing.assert_close(got, logits(m, names), **TOL)


def test_emulated_graphs_through_folded_sites(no_limit):
    m = build()
    names = ["chat", "__base__", "mlp", "sql"]
    want = greedy(m, names, n=6)
    with fastlora.patched(m, cuda_graphs="emulate", fold_shrink=True, tuning=no_limit):
        assert fastlora.get_state(m).report.shrink_folded == "8 of 8 sites"
        got = greedy(m, names, n=6)
        assert fastlora.get_state(m).graph_runner.stats["replays"] > 0
    assert torch.equal(got, want)


def test_registered_adapters_through_slots_and_compaction_folded(folders, tmp_path, no_limit):
    """Adapters registered by name, two GPU slots: loads and compaction moves write into the
    arena under the base weights; every call equals the same folders loaded into PEFT."""
    import random

    from test_register_adapter import _pair, _same, _save

    folders = dict(folders, r8=_save(str(tmp_path / "r8"), ("q_proj", "v_proj"), 8, seed=5),
                   r24=_save(str(tmp_path / "r24"), ("q_proj", "v_proj"), 24, seed=6))
    registered = ["ql", "emb", "rs", "wide", "r8", "r24"]
    m, ref = _pair(folders, registered, max_loras_per_batch=2, fold_shrink=True, tuning=no_limit)
    sites = fastlora.get_state(m).sites
    assert all(s.pool.folded() for s in sites if s.kind != "embedding")
    rng = random.Random(11)
    for call in range(30):
        used = rng.sample(registered, 2)
        _same(m, ref, used + [rng.choice(used + ["__base__"])], seed=call)
    assert sum(s.pool.block_moves for s in sites) > 0, "no compaction happened: the test exercised nothing"
    assert all(s.pool.folded() for s in sites if s.kind != "embedding")


def test_continuous_batching_through_folded_sites(no_limit, calls):
    """transformers' engine: one forward mixes requests' prefill chunks and decode tokens, each
    with its adapter; every site folded, each request equals PEFT serving it alone."""
    from _continuous import cb_config, greedy_config, peft_alone, requires_cb

    if requires_cb.args[0]:
        pytest.skip(requires_cb.kwargs["reason"])
    m, ref = build(), build()
    fastlora.patch(m, fold_shrink=True, tuning=no_limit)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (3, 7, 2, 5, 4)]  # this model's vocabulary
    names = ["sql", "chat", "__base__", "mlp", "sql"]
    out = m.generate_batch(prompts, generation_config=greedy_config(5), continuous_batching_config=cb_config(),
                           adapter_names=names)
    got = [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]
    assert calls["run_packed_expand"] > 0
    for tokens, p, n in zip(got, prompts, names):
        assert tokens == peft_alone(ref, p, n, 5), n


def test_continuous_batching_steps_past_256_tokens_fold_under_a_raised_limit(no_limit, calls):
    """With ``fold_max_tokens`` raised, engine steps of hundreds of tokens (prefill chunks beside
    decode tokens, the 32-row tile) take every shrink from the folded GEMMs: no shrink kernel runs,
    and each request equals PEFT serving it alone."""
    from _continuous import cb_config, greedy_config, peft_alone, requires_cb

    if requires_cb.args[0]:
        pytest.skip(requires_cb.kwargs["reason"])
    m, ref = build(), build()
    fastlora.patch(m, fold_shrink=True, tuning=no_limit.replace(fold_max_tokens=4096))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (120, 90, 70, 40)]
    names = ["sql", "chat", "mlp", "__base__"]
    out = m.generate_batch(prompts, generation_config=greedy_config(4),
                           continuous_batching_config=cb_config(max_batch_tokens=512, num_blocks=128),
                           adapter_names=names)
    got = [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]
    assert calls["run_packed_expand"] > 0 and calls["run_packed_lora"] == 0, calls
    for tokens, p, n in zip(got, prompts, names):
        assert tokens == peft_alone(ref, p, n, 4), n


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_architecture_with_folded_sites_equals_peft(arch, no_limit, calls):
    """The seven tiny architectures of the parity tests (Qwen2's q/k/v biases, Gemma 2's scaled
    embedding and soft-capping, Phi-3's pre-fused projections, GPT-2's Conv1D): every site over a
    plain ``nn.Linear`` folds (Conv1D and embeddings keep their paths), logits and greedy tokens
    equal PEFT's."""
    from _models import PARITY_ATOL as ATOL, PARITY_LENGTHS as LENGTHS, PARITY_NAMES as MIX, PARITY_RTOL as RTOL

    model = build_peft_lm(arch)
    batch = left_padded_batch(LENGTHS, seed=1)
    with torch.no_grad():
        want = model(**batch, adapter_names=MIX).logits
        want_tokens = model.generate(**batch, adapter_names=MIX, max_new_tokens=5, do_sample=False)
    with fastlora.patched(model, fold_shrink=True, tuning=no_limit) as report:
        sites = fastlora.get_state(model).sites
        foldable = [s for s in sites if s.kind != "embedding"
                    and all(type(base_layer_of(m)) is torch.nn.Linear for m in s.members)]
        assert [s.name for s in sites if s.pool.folded()] == [s.name for s in foldable]
        assert report.shrink_folded == f"{len(foldable)} of {len(sites)} sites"
        why = dict(report.fold_refused)  # every other site, with its reason
        assert sorted(why) == sorted(s.name for s in sites if s not in foldable)
        for s in sites:
            if s.kind == "embedding":
                assert why[s.name] == "an embedding: a lookup, not a GEMM"
            elif s not in foldable:
                assert "Conv1D, not nn.Linear" in why[s.name], why[s.name]
        with torch.no_grad():
            got = model(**batch, adapter_names=MIX).logits
            tokens = model.generate(**batch, adapter_names=MIX, max_new_tokens=5, do_sample=False)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    assert torch.equal(tokens, want_tokens)
    assert (calls["run_packed_expand"] > 0) == bool(foldable), calls


def _staged_pools(m):
    return [s.pool for s in fastlora.get_state(m).sites if s.pool.staging is not None]


STAGED_MIXES = [["sql", "sql", "chat", "__base__"], ["mlp", "chat", "mlp", "__base__"], ["mlp"] * 4,
                ["sql", "mlp", "sql", "mlp"], ["chat"] * 4, ["__base__"] * 4]


def test_staged_fold_with_fewer_slots_equals_peft(calls):
    """Fewer GPU slots than adapters, default limits: the larger arenas are not stored under the
    base weight; a staging tail is, and a call that folds copies its adapters' A blocks there
    first. Every mix equals PEFT, whichever choice it makes, across loads and evictions, and a
    value edited between calls reaches the staged rows."""
    m, ref = build(), build()
    report = fastlora.patch(m, max_loras_per_batch=2, fold_shrink=True)
    staged = _staged_pools(m)
    assert staged and "staged: such a call's A blocks are copied under the base weight first" in report.shrink_folded
    state = fastlora.get_state(m)
    assert all(p.folds_per_call() and p.fold.tail.data_ptr() == p.staging.rows.data_ptr() for p in staged)
    assert all(p.lora_a.data_ptr() != p.staging.rows.data_ptr() for p in staged)  # the arena has its own storage
    chose = set()
    for step in range(2):
        for names in STAGED_MIXES:
            calls.clear()
            torch.testing.assert_close(logits(m, names), logits(ref, names), **TOL)
            slots = {state.registry.slot[n] for n in names if n != "__base__"}
            fits = all(p.rows_used(slots) <= p.fold_rows() for p in staged)
            assert state.last_fold == (fits and state.slots.decide_fold(slots)), names
            if state.last_fold:
                assert calls["run_packed_lora"] == 0, (names, calls)
            chose.add(state.last_fold)
        with torch.no_grad():  # an in-place edit of an adapter's A: the next call stages the new values
            for model in (m, ref):
                layers_of(model)[step].self_attn.q_proj.lora_A["sql"].weight.mul_(-1.5)
    assert chose == {False, True}, "the mixes should exercise both choices"


def test_staged_fold_refused_for_a_call_that_does_not_fit(monkeypatch, calls):
    """A staging tail smaller than two adapters' blocks: a call of both takes the fused kernel,
    one of either alone folds; both equal PEFT."""
    m, ref = build(), build()
    fastlora.patch(m, max_loras_per_batch=2, fold_shrink=True, tuning=Tuning(fold_stage_margin=0.75))
    state, staged = fastlora.get_state(m), _staged_pools(m)
    assert staged
    for names, folds in ((["sql", "chat"] * 2, False), (["sql", "__base__"] * 2, True)):
        calls.clear()
        torch.testing.assert_close(logits(m, names), logits(ref, names), **TOL)
        slots = {state.registry.slot[n] for n in names if n != "__base__"}
        assert all(p.can_stage(slots) for p in staged) == folds
        assert state.last_fold == folds
        assert (calls["run_packed_lora"] > 0) == (not folds), calls


def test_staged_fold_through_emulated_graphs_and_warmup():
    """Graphed decode through staged sites: warm-up captures both choices per bucket (its fold
    mix from the adapters in slots, within the staging rows), then changing mixes replay them,
    token-equal to PEFT."""
    m = build()
    mixes = [["chat", "sql", "__base__", "sql"], ["mlp", "__base__", "mlp", "chat"], ["sql"] * 4, ["mlp", "chat"] * 2]
    want = [greedy(m, names, n=5) for names in mixes]
    with fastlora.patched(m, cuda_graphs="emulate", fold_shrink=True, max_loras_per_batch=2, graph_buckets=[4]):
        state = fastlora.get_state(m)
        assert _staged_pools(m) and state.graph_runner.max_graphs == 2
        prone = state.slots.fold_prone_adapters(2)  # the largest that fit the staging rows together
        assert len(prone) == 2 and all(sum(p.adapter_rows(n) for n in prone) <= p.fold_rows() for p in _staged_pools(m))
        report = fastlora.warmup(m, max_length=16)
        keys = {k[2] for k in state.graph_runner.graphs}
        assert keys == {("fold", True), ("fold", False)}, keys
        for _ in range(2):
            for names, ref in zip(mixes, want):
                assert torch.equal(greedy(m, names, n=5), ref), names
        assert state.graph_runner.stats["captures"] == report.captures, state.graph_runner.stats


def test_continuous_batching_steps_never_stage(monkeypatch):
    """transformers' engine with staged sites (fewer slots than adapters): its steps keep the fused
    kernel (its graphs are not keyed by the fold choice), so no step stages; each request equals
    PEFT serving it alone."""
    from _continuous import cb_config, greedy_config, peft_alone, requires_cb

    from peft_fastlora.lora.pool import SitePool

    if requires_cb.args[0]:
        pytest.skip(requires_cb.kwargs["reason"])
    staged_calls = []
    original = SitePool.stage_call
    monkeypatch.setattr(SitePool, "stage_call", lambda self, *a: staged_calls.append(1) or original(self, *a))
    m, ref = build(), build()
    fastlora.patch(m, fold_shrink=True, max_loras_per_batch=2)
    assert _staged_pools(m)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (3, 6, 2, 5)]
    names = ["sql", "chat", "sql", "chat"]
    out = m.generate_batch(prompts, generation_config=greedy_config(4), continuous_batching_config=cb_config(),
                           adapter_names=names)
    got = [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]
    assert not staged_calls and not fastlora.get_state(m).last_fold
    for tokens, p, n in zip(got, prompts, names):
        assert tokens == peft_alone(ref, p, n, 4), n
    logits(m, ["sql", "chat", "__base__", "sql"])  # a plain call with the same adapters stages again
    assert staged_calls and fastlora.get_state(m).last_fold
