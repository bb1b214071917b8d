"""End to end on the GPU: generate through Triton and CUDA graphs vs PEFT's own mixed path.

float32 models, so that greedy tokens can be compared exactly over many steps (bf16 rounds the LoRA
delta differently from PEFT); the bf16 path is compared on logits with a bf16 tolerance.
"""

import pytest
import torch

import peft_fastlora as fastlora
from _helpers import TokenStream
from _graphs import generate_inputs as _inputs, generate_model as _model

pytestmark = pytest.mark.gpu


def _peft_tokens(model, inputs, names, steps):
    fastlora.unpatch(model)
    return model.generate(**inputs, adapter_names=names, max_new_tokens=steps)


def _graphed_on_fastlora(model, inputs, names, steps):
    """The tokens of one graphed call on the patched model, every site on fastlora's path and
    every decode step replayed."""
    report = fastlora.patch(model)
    try:
        assert report.adapter_fallbacks == [] and report.left_on_peft == [], report
        out = model.generate(**inputs, adapter_names=names, max_new_tokens=steps)
        stats = fastlora.get_state(model).graph_runner.stats
    finally:
        fastlora.unpatch(model)
    assert stats["replays"] >= steps - 4 and stats["eager_steps"] == 0, stats
    return out


@pytest.fixture(scope="module")
def model():
    return _model(n_adapters=8)


def test_graphs_equal_eager_and_peft_over_64_steps(model):
    names = ["a0", "__base__", "a1", "a2", "a0", "a3"]
    inputs = _inputs(len(names))
    ref = _peft_tokens(model, inputs, names, 64)
    fastlora.patch(model, cuda_graphs=False)
    eager = model.generate(**inputs, adapter_names=names, max_new_tokens=64)
    fastlora.unpatch(model)
    report = fastlora.patch(model)
    assert report.backend == "triton"
    graphs = model.generate(**inputs, adapter_names=names, max_new_tokens=64)
    stats = fastlora.get_state(model).graph_runner.stats
    fastlora.unpatch(model)
    assert stats["replays"] >= 60 and stats["eager_steps"] == 0, stats
    assert torch.equal(eager, ref)
    assert torch.equal(graphs, ref)


def test_lora_bias_adapters_in_graphs_equal_peft():
    """Adapters with a bias on B beside plain ones and base rows: graphed decode (fused, wide and
    folded expands) equal to PEFT's mixed batch over 32 steps, every site on fastlora's path."""
    biased = _model(n_adapters=6, biased=(0, 3, 4))
    names = ["a0", "__base__", "a1", "a3", "a4", "a2", "a0", "a5"]
    inputs = _inputs(len(names))
    ref = _peft_tokens(biased, inputs, names, 32)
    out = _graphed_on_fastlora(biased, inputs, names, 32)
    assert torch.equal(out, ref)


def test_dora_adapters_in_graphs_equal_peft_row_by_row():
    """DoRA adapters beside plain ones and base rows, graphed (fused, wide and folded expands with
    DoRA's epilogue): each row's tokens equal PEFT's for that row alone with its adapter active
    (PEFT refuses DoRA in ``adapter_names``)."""
    model = _model(n_adapters=5, dora=(1, 3))
    names = ["a1", "__base__", "a0", "a3", "a1", "a2", "a4", "a3"]
    inputs = _inputs(len(names))
    refs = []
    for i, name in enumerate(names):
        row = {k: v[i:i + 1] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        if name == "__base__":
            with model.disable_adapter():
                refs.append(model.generate(**row, max_new_tokens=24))
        else:
            model.set_adapter(name)
            refs.append(model.generate(**row, max_new_tokens=24))
    out = _graphed_on_fastlora(model, inputs, names, 24)
    for i, ref in enumerate(refs):  # a left-padded row alone keeps its padding: compare the new tokens
        assert torch.equal(out[i, -24:], ref[0, -24:]), (i, names[i])


def test_changing_mixes_more_adapters_than_at_capture_and_all_base(model):
    batch = 8
    inputs = _inputs(batch)
    mixes = [["a0"] * batch,  # captured with one adapter
             [f"a{i}" for i in range(batch)],  # then eight distinct ones
             ["__base__"] * batch,
             ["a5", "a5", "__base__", "a7", "a1", "a1", "a6", "__base__"]]
    refs = [_peft_tokens(model, inputs, names, 24) for names in mixes]
    fastlora.patch(model)
    try:
        outs, folds = [], set()
        for names in mixes:
            outs.append(model.generate(**inputs, adapter_names=names, max_new_tokens=24))
            folds.add(fastlora.get_state(model).last_fold)
        stats = fastlora.get_state(model).graph_runner.stats
    finally:
        fastlora.unpatch(model)
    # one graph per fold choice the calls made (sites folded per call: fold_shrink), replayed for every mix
    assert stats["captures"] == len(folds), stats
    for names, out, ref in zip(mixes, outs, refs):
        assert torch.equal(out, ref), names


def test_no_memory_growth_over_repeated_calls(model):
    names = ["a1", "a0", "__base__", "a2"]
    inputs = _inputs(len(names))
    fastlora.patch(model)
    try:
        for _ in range(3):
            model.generate(**inputs, adapter_names=names, max_new_tokens=16)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for _ in range(50):
            model.generate(**inputs, adapter_names=names, max_new_tokens=16)
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
    finally:
        fastlora.unpatch(model)
    assert after - before < 1 << 20, (before, after)


def test_bf16_logits_close_to_peft():
    model = _model(torch.bfloat16, n_adapters=4)
    names = ["a0", "__base__", "a1", "a2", "a3", "a0"]
    ids = torch.randint(1, 512, (len(names), 17), device="cuda")
    with torch.no_grad():
        ref = model(input_ids=ids, adapter_names=names).logits.float()
        fastlora.patch(model)
        out = model(input_ids=ids, adapter_names=names).logits.float()
        fastlora.unpatch(model)
        base = model.get_base_model()(input_ids=ids).logits.float()
    err = (out - ref).norm() / ref.norm()
    delta = (ref - base).norm() / ref.norm()
    assert delta > 1e-2  # the adapters matter, so the comparison below means something
    assert err < 1e-2, (err.item(), delta.item())


def test_deferred_stop_check_equals_peft_for_length_and_eos_stops(model):
    names = ["a0", "__base__", "a1", "a2", "a0", "a3"]
    inputs = _inputs(len(names))
    ref = _peft_tokens(model, inputs, names, 32)
    eos = sorted({int(t) for t in ref[:, 9 + 4]})  # each row's 5th new token ends it
    fastlora.unpatch(model)
    ref_eos = model.generate(**inputs, adapter_names=names, max_new_tokens=32, eos_token_id=eos)
    assert ref_eos.shape[1] <= 9 + 5
    report = fastlora.patch(model)
    try:
        assert report.stop_check == "deferred", report
        runner = fastlora.get_state(model).graph_runner
        out = model.generate(**inputs, adapter_names=names, max_new_tokens=32)
        after_length = dict(runner.stats)
        out_eos = model.generate(**inputs, adapter_names=names, max_new_tokens=32, eos_token_id=eos)
        stats = runner.stats
    finally:
        fastlora.unpatch(model)
    assert torch.equal(out, ref) and torch.equal(out_eos, ref_eos)
    assert after_length["deferred_stop_calls"] == 1 and after_length["steps_undone"] == 0, after_length
    assert stats["deferred_stop_calls"] == 2 and stats["steps_undone"] == 1, stats
    assert stats["eager_steps"] == 0, stats


def test_deferred_stop_check_random_calls_equal_the_per_step_check(model):
    # a server's traffic: batch sizes, lengths, adapters, EOS stops, sampling and streaming mixed;
    # each call run with the check deferred and with it every step (same kernels: equal tokens)
    rng = torch.Generator().manual_seed(7)
    adapters = ["__base__"] + [f"a{i}" for i in range(8)]
    calls = []
    for i in range(14):
        batch = int(torch.randint(1, 25, (1,), generator=rng))
        names = [adapters[int(j)] for j in torch.randint(0, len(adapters), (batch,), generator=rng)]
        kw = dict(_inputs(max(batch, 2), prompt=int(torch.randint(4, 30, (1,), generator=rng))))
        kw = {k: (v[:batch] if torch.is_tensor(v) else v) for k, v in kw.items()}
        kw["max_new_tokens"] = int(torch.randint(2, 40, (1,), generator=rng))
        if i % 3 == 1:
            kw.update(do_sample=True, top_k=50, temperature=0.9)
        if i % 4 == 2:
            kw["eos_token_id"] = [int(t) for t in torch.randint(1, 512, (200,), generator=rng)]
        calls.append((names, kw, i % 5 == 3))
    results = {}
    for defer in (True, False):
        fastlora.patch(model, defer_stop_check=defer)
        try:
            outs = []
            for names, kw, stream in calls:
                torch.manual_seed(11)
                streamer = TokenStream() if stream else None
                out = model.generate(**kw, adapter_names=names, streamer=streamer)
                outs.append((out, streamer.chunks if stream else None))
            results[defer] = (outs, fastlora.get_state(model).graph_runner.stats)
        finally:
            fastlora.unpatch(model)
    (deferred, stats), (per_step, stats_off) = results[True], results[False]
    assert stats["deferred_stop_calls"] == len(calls) and stats_off["deferred_stop_calls"] == 0, stats
    assert stats["steps_undone"] >= 1, stats  # some EOS call stopped every row early
    for i, ((a, sa), (b, sb)) in enumerate(zip(deferred, per_step)):
        assert torch.equal(a, b), (i, calls[i][0])
        if sa is not None:
            assert sa == sb, i
