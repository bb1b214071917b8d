"""Decode graphs on the GPU under server-like traffic: call sequences that once crashed the
process, more shapes than graphs kept, injected capture failures followed by healthy calls on the
same and on another model, warm-up, and weight edits through ``.data`` between graphed calls.

float32 tiny Llama with six adapters of ranks 2-32, so that greedy tokens can be compared with
PEFT's own mixed path exactly. Every test runs three times: with the shrink folded into the base
GEMM at every site (the limit lifted: at this size the adapters' A rows are a large share of the
base rows), with the default limit, which leaves these sites on the fused kernel, and folded with
every base GEMM of the decode steps through the streaming GEMM (``base_ops.stream_linears``; its
width and dtype limits lifted for this model, float32 included, so that tokens still compare).
A fourth run streams a second pair of models whose adapters leave gate/up alone, so that each MLP
also takes ``act(gate) * up`` from one GEMM (the ``glu`` epilogue) through the same traffic.
"""

import pytest
import torch

import peft_fastlora as fastlora
from peft_fastlora.decode import capture as cuda_graph
from peft_fastlora import get_state
from _graphs import TRAFFIC_NAMES as NAMES, traffic_inputs as _inputs, traffic_model as _model

pytestmark = pytest.mark.gpu


_TUNING = {}  # the current parametrisation's (every patch of this file takes it: ``_patch``)


@pytest.fixture(autouse=True, params=["folded", "default_limit", "folded_streamed", "streamed_plain_mlp"])
def fold_limit(request):
    tuning = fastlora.Tuning()
    if request.param != "default_limit":
        tuning = tuning.replace(fold_max_share=1e9)
    if "streamed" in request.param:
        tuning = tuning.replace(stream_min_n=16, stream_min_k=16,
                                stream_dtypes=(torch.float32, torch.bfloat16, torch.float16))
    if request.param == "folded_streamed":  # the wide layers' tiles and rows; the other pass keeps the
        tuning = tuning.replace(stream_narrow_n=16)  # narrow ones' (K ranges, cuBLAS past 32 rows)
    _TUNING["current"] = tuning
    return request.param


def _patch(model, **options):
    return fastlora.patch(model, tuning=_TUNING["current"], **options)


_PAIRS = {}  # plain_mlp -> the (fastlora's, PEFT's) pair, built once for the module


@pytest.fixture
def pair(fold_limit):
    plain_mlp = fold_limit == "streamed_plain_mlp"
    if plain_mlp not in _PAIRS:
        _PAIRS[plain_mlp] = (_model(plain_mlp=plain_mlp), _model(plain_mlp=plain_mlp))
    return _PAIRS[plain_mlp]


def _names(rows, seed):
    g = torch.Generator().manual_seed(seed)
    pool = NAMES + ["__base__"]
    return [pool[int(i)] for i in torch.randint(0, len(pool), (rows,), generator=g)]


def _equal_to_peft(pair, rows, prompt, new, seed, **kw):
    m, ref = pair
    inputs, names = _inputs(rows, prompt, seed), _names(rows, seed)
    with torch.no_grad():
        out = m.generate(**inputs, adapter_names=names, max_new_tokens=new, do_sample=False, **kw)
        want = ref.generate(**inputs, adapter_names=names, max_new_tokens=new, do_sample=False, **kw)
    assert torch.equal(out, want), (rows, prompt, new, seed)


@pytest.mark.parametrize("sizes", [[1, 5], [1, 5, 1, 5], [8, 16, 5], [5, 1]])
def test_batch_size_sequences_that_crashed(pair, sizes, fold_limit):
    report = _patch(pair[0])
    if fold_limit == "streamed_plain_mlp":  # the GLU epilogue is what this pass is for
        assert "act-mul in gate/up's GEMM x2" in str(report), report
    try:
        for i, rows in enumerate(sizes):
            _equal_to_peft(pair, rows, 12, 16, seed=i)
        stats = get_state(pair[0]).graph_runner.stats
    finally:
        fastlora.unpatch(pair[0])
    assert stats["capture_failures"] == 0 and stats["eager_steps"] == 0, stats
    assert stats["replays"] == 15 * len(sizes), stats
    if fold_limit == "folded" and torch.cuda.get_device_capability()[0] >= 9:  # expands behind cuBLAS
        assert stats["early_edges"] > 0 and stats["early_launch_off"] is None, stats


def test_more_shapes_than_graphs_kept(pair):
    _patch(pair[0], graph_buckets=[1, 2, 4, 8, 16], max_graphs=2)
    try:
        fastlora.warmup(pair[0], batch_sizes=[16], max_length=96)  # the shared cache sized once
        state = get_state(pair[0])
        runner = state.graph_runner
        # what the runner should do, by least recently used, from each call's (bucket, fold choice)
        kept = [(k[1], k[2][1]) for k in runner.graphs]
        captures, evictions = runner.stats["captures"], runner.stats["evictions"]
        for i, rows in enumerate([1, 2, 3, 9, 16, 1, 5, 2, 12, 1]):
            _equal_to_peft(pair, rows, 5 + 7 * i, 6, seed=10 + i)
            assert len(runner.graphs) <= 2
            key = (runner.bucket_for(rows), state.last_fold)
            if key in kept:
                kept.remove(key)
            else:
                captures += 1
                if len(kept) == 2:
                    kept.pop(0)
                    evictions += 1
            kept.append(key)
        stats = runner.stats
    finally:
        fastlora.unpatch(pair[0])
    # without per-call folds: bucket 16 (warm-up), then 1 2 4 16 16 1 8 2 16 1 with two graphs
    # kept: 9 captures after the warm-up (the second 16 replays), 8 evictions
    assert captures >= 10 and evictions >= 8
    assert stats["evictions"] == evictions and stats["captures"] == captures, stats
    assert stats["capture_failures"] == 0, stats
    assert stats["graph_pool_bytes"] is None or stats["graph_pool_bytes"] > 0, stats


def _healthy(pair, seed):
    """RNG, a sampling call and a graphed greedy call on a second, freshly patched model."""
    torch.rand(8, device="cuda").sum().item()
    m, ref = pair
    with torch.no_grad():
        m.generate(**_inputs(3, 7, seed), adapter_names=["a1", "a0", "__base__"], max_new_tokens=8,
                   do_sample=True, top_k=50)
    other, other_ref = _model(seed=1), _model(seed=1)
    _patch(other)
    try:
        _equal_to_peft((other, other_ref), 4, 9, 8, seed=seed)
        assert get_state(other).graph_runner.stats["captures"] == 1
    finally:
        fastlora.unpatch(other)


def test_capture_that_syncs_fails_cleanly_and_the_process_stays_healthy(pair):
    """A host sync inside the capture (a hook calling ``.item()``) invalidates the capture: the
    step runs eagerly, later calls work, on this model and on another one, sampling included."""
    m, _ = pair
    _patch(m)
    norm = m.base_model.model.model.layers[0].input_layernorm

    def sync_when_capturing(module, args, out):
        if torch.cuda.is_current_stream_capturing():
            out.sum().item()

    hook = norm.register_forward_hook(sync_when_capturing)
    try:
        _equal_to_peft(pair, 3, 9, 10, seed=21)  # the capture fails, the call decodes eagerly
        stats = get_state(m).graph_runner.stats
        assert stats["capture_failures"] == 1 and stats["captures"] == 0, stats
        assert any(r.startswith("capture failed") for r in stats["eager_reasons"]), stats
        hook.remove()
        _equal_to_peft(pair, 5, 9, 10, seed=22)  # another bucket: captured
        assert get_state(m).graph_runner.stats["captures"] == 1
        _healthy(pair, seed=23)
    finally:
        hook.remove()
        fastlora.unpatch(m)


def test_allocator_failure_in_capture_begin_is_recovered(pair):
    """The failure the old runner hit: capturing into a pool whose graphs were all freed trips an
    allocator assert inside ``capture_begin``. ``cuda_graph.capture`` must leave the process
    healthy after it (RNG not stuck in capture mode, stream and allocator restored)."""

    class ReusedHandle:  # a plain pool handle, reused after its only graph was freed
        id = torch.cuda.graph_pool_handle()

    x = torch.randn(64, device="cuda")
    graph, out = cuda_graph.capture(lambda: x * 2, ReusedHandle, lambda: None)
    del graph, out
    try:
        graph, out = cuda_graph.capture(lambda: x * 3, ReusedHandle, lambda: None)
    except RuntimeError as e:
        failure = str(e)
    else:
        del graph, out
        pytest.skip("this torch accepts a freed pool handle again: nothing to recover from")
    assert "use_count" in failure or "pool" in failure.lower(), failure
    assert not torch.cuda.is_current_stream_capturing()
    _healthy(pair, seed=31)
    _patch(pair[0])
    try:
        _equal_to_peft(pair, 6, 8, 12, seed=32)
    finally:
        fastlora.unpatch(pair[0])


def test_warmup_then_traffic_captures_nothing_more(pair):
    _patch(pair[0], graph_buckets=[1, 4, 16])
    try:
        report = fastlora.warmup(pair[0], max_length=96)
        # a graph per bucket, and per fold choice where some sites fold per call
        per_bucket = 2 if get_state(pair[0]).folds_per_call() else 1
        assert 3 <= report.captures <= 3 * per_bucket and report.cache_bytes > 0 and report.seconds > 0, report
        for i, rows in enumerate([3, 16, 1, 11, 4]):
            _equal_to_peft(pair, rows, 10 + 3 * i, 20, seed=40 + i)
        stats = get_state(pair[0]).graph_runner.stats
    finally:
        fastlora.unpatch(pair[0])
    assert stats["captures"] == report.captures and stats["eager_steps"] == 0, stats


def test_dot_data_edit_between_graphed_calls(pair):
    m, ref = pair
    _patch(m)
    try:
        _equal_to_peft(pair, 4, 9, 12, seed=50)
        for model in (m, ref):
            model.base_model.model.model.layers[1].mlp.down_proj.lora_B["a0"].weight.data.mul_(-3.0)
        _equal_to_peft(pair, 4, 9, 12, seed=50)
        stats = get_state(m).graph_runner.stats
    finally:
        fastlora.unpatch(m)
        for model in (m, ref):
            model.base_model.model.model.layers[1].mlp.down_proj.lora_B["a0"].weight.data.div_(-3.0)
    assert stats["captures"] == 1, stats  # the same graph served the new values


def test_base_weight_given_new_storage_between_graphed_calls(pair):
    """``weight.data = ...`` on base layers (a fused member, a single one): new storage the fused
    (and folded) weights no longer hold; the next call re-fuses and equals PEFT."""
    m, ref = pair

    def edit(scale_o, scale_up):
        for model in (m, ref):
            layers = model.base_model.model.model.layers
            layers[0].self_attn.o_proj.base_layer.weight.data = layers[0].self_attn.o_proj.base_layer.weight.data * scale_o
            up = getattr(layers[1].mlp.up_proj, "base_layer", layers[1].mlp.up_proj)  # (plain without LoRA)
            up.weight.data = up.weight.data * scale_up

    _patch(m)
    try:
        _equal_to_peft(pair, 4, 9, 12, seed=60)
        edit(2.0, 0.5)  # powers of two: undone exactly below
        _equal_to_peft(pair, 4, 9, 12, seed=60)
        _equal_to_peft(pair, 6, 5, 8, seed=61)
    finally:
        fastlora.unpatch(m)
        edit(0.5, 2.0)


def test_memory_bounded_over_a_random_sequence(pair):
    """After a warm-up of every bucket and a first call of the largest shape (what a server does),
    no later call of 40 random ones leaves more memory allocated than the first did (the fused
    LoRA kernel's workspace included: sized once for every launch), and the second half reserves
    no more than the first (the caching allocator keeps freed blocks)."""
    buckets = [1, 2, 4, 8, 16, 24, 32, 48]
    _patch(pair[0], graph_buckets=buckets)
    g = torch.Generator().manual_seed(60)
    reserved, allocated = [], []
    try:
        report = fastlora.warmup(pair[0], max_length=160)
        assert len(buckets) <= report.captures <= 2 * len(buckets), report
        for i in range(40):
            rows = int(torch.randint(1, 40, (1,), generator=g))
            prompt = int(torch.randint(1, 120, (1,), generator=g))
            new = int(torch.randint(1, 30, (1,), generator=g))
            if i == 0:  # the largest shape drawn, first
                rows, prompt, new = 39, 119, 29
            with torch.no_grad():
                pair[0].generate(**_inputs(rows, prompt, 100 + i), adapter_names=_names(rows, i),
                                 max_new_tokens=new, do_sample=bool(i % 4 == 0))
            torch.cuda.synchronize()
            reserved.append(torch.cuda.memory_reserved())
            allocated.append(torch.cuda.memory_allocated())
        stats = get_state(pair[0]).graph_runner.stats
    finally:
        fastlora.unpatch(pair[0])
    assert max(allocated[1:]) <= allocated[0], allocated
    assert max(reserved[20:]) <= max(reserved[:20]), reserved
    assert stats["capture_failures"] == 0 and stats["captures"] == report.captures, stats
