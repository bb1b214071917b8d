"""Greedy steps whose next inputs the GPU writes (``decode/step_advance.py``), without a GPU: the
graphs emulated, CUDA events stood in for. The oracle is twofold: the static inputs each replay
reads equal those transformers' loop builds and the runner copies (step by step, switched off
against on), and the tokens equal PEFT's own ``generate``."""

import pytest
import torch

import peft_fastlora as fastlora
from peft_fastlora.compat.modules import TRANSFORMERS_VERSION, set_attn_implementation
from peft_fastlora.decode import step_advance
from peft_fastlora.decode.runner import DecodeGraphRunner
from _helpers import count_calls
from _models import build_peft_lm, left_padded_batch, with_sliding_window

NAMES = ["a0", "__base__", "a1", "a2", "a0"]


LENGTHS = [5, 9, 3, 7, 4]  # five rows: a bucket of eight, so three padding rows


def _model(arch, attn):
    prepare = with_sliding_window(64) if arch in ("mistral", "gemma2") else None
    model = build_peft_lm(arch, prepare_base=prepare)
    set_attn_implementation(model.get_base_model(), attn)
    return model


def _record(monkeypatch, rows):
    """Every replay's static tensor inputs (their first ``rows`` rows), in order."""
    seen = []
    original = DecodeGraphRunner._replay

    def recording(self, entry, batch_info):
        step = {}
        for name, v in DecodeGraphRunner._flat(entry["static"]):
            if isinstance(v, torch.Tensor):
                step[name] = (v[:rows] if v.dim() and v.shape[0] > 1 else v).clone()
        seen.append(step)
        return original(self, entry, batch_info)

    monkeypatch.setattr(DecodeGraphRunner, "_replay", recording)
    return seen


def _generate(model, names, **gen):
    batch = left_padded_batch((LENGTHS * 2)[:len(names)])
    gen = dict(dict(do_sample=False, pad_token_id=0), **gen)
    with torch.no_grad():
        return model.generate(**batch, adapter_names=names, **gen)


@pytest.mark.parametrize("arch,attn", [("llama", "eager"), ("qwen2", "sdpa"), ("mistral", "sdpa"),
                                       ("gemma2", "eager")])
def test_each_replay_reads_the_inputs_transformers_builds(arch, attn, cpu_events, monkeypatch):
    """With the stop check read every step, every step's inputs come from transformers' loop
    through the runner's copies; with the deferred check, all but the first decode step's come from
    the GPU. Both runs must feed the graphs the same tensors (additive and boolean masks, Gemma 2's
    dict of masks, left padding, padding rows)."""
    model = _model(arch, attn)
    gen = dict(max_new_tokens=7, eos_token_id=[2, 7])
    ref = _generate(model, NAMES, **gen)
    runs = {}
    seen = _record(monkeypatch, len(NAMES))
    for enabled in (False, True):
        seen.clear()
        with fastlora.patched(model, cuda_graphs="emulate", defer_stop_check=enabled):
            out = _generate(model, NAMES, **gen)
            stats = fastlora.get_state(model).graph_runner.stats
        assert torch.equal(out, ref), (enabled, out, ref)
        runs[enabled] = (list(seen), stats)
    (off, off_stats), (on, on_stats) = runs[False], runs[True]
    assert off_stats["advanced_steps"] == 0, off_stats
    assert on_stats["advanced_calls"] == 1 and on_stats["advanced_steps"] == len(on) - 1 > 3, on_stats
    assert len(on) == len(off) and set(on[0]) == set(off[0]), (len(on), len(off), set(on[0]), set(off[0]))
    assert "attention_mask" in on[0] or any(k.startswith("attention_mask.") for k in on[0]), set(on[0])
    for i, (a, b) in enumerate(zip(off, on)):
        for name in a:
            assert torch.equal(a[name], b[name]), (i, name, a[name], b[name])


def one_row_unmasked() -> bool:
    """Whether transformers drops the 2-D mask of one unpadded row (5.24 and later)."""
    from packaging.version import Version

    return Version(TRANSFORMERS_VERSION) >= Version("5.24")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_tokens_equal_peft_over_calls_of_changing_shape(arch, cpu_events):
    """Calls of 1-5 rows (other buckets, other EOS id counts, none) one after the other: each equals
    PEFT's, each after the first decode step advances on the GPU, and calls of one bucket share
    its step-advance graph whatever their rows and EOS ids."""
    model = _model(arch, "eager" if arch == "gemma2" else "sdpa")
    calls = [(NAMES, dict(max_new_tokens=6, eos_token_id=[2, 7])),
             (NAMES[:1], dict(max_new_tokens=5)),
             (NAMES[:3], dict(max_new_tokens=6, eos_token_id=3)),
             (NAMES, dict(max_new_tokens=4, eos_token_id=[2, 7])),
             (NAMES[:4], dict(max_new_tokens=6, eos_token_id=[9, 8, 7, 6, 5]))]
    refs = [_generate(model, names, **gen) for names, gen in calls]
    with fastlora.patched(model, cuda_graphs="emulate"):
        outs = [_generate(model, names, **gen) for names, gen in calls]
        runner = fastlora.get_state(model).graph_runner
        stats = runner.stats
        kept = sorted(k for entry in runner.graphs.values() for k in entry.get("advance", {}))
    for out, ref in zip(outs, refs):
        assert torch.equal(out, ref), (out, ref)
    # the one-row call has no padding and so no 2-D mask (transformers >= 5.24): under Gemma 2's
    # window, shorter than the cache, the step mask and this path are transformers' own
    refused = 1 if arch == "gemma2" and one_row_unmasked() else 0
    assert stats["advanced_calls"] == len(calls) - refused, stats
    assert stats["advance_reasons"] == ({"a mask fastlora's step mask did not build": 1} if refused else {}), stats
    # buckets 8 (five rows, twice), 4 (three and four rows, other EOS lists), 1 (the config's EOS)
    assert kept == [(True, False)] * (3 - refused), kept


def test_rows_that_stop_are_padded_and_the_extra_step_undone(cpu_events):
    """EOS ids taken from a free run's tokens, so rows stop at different steps and all stop before
    the maximum: the GPU's unfinished flags, the pad and the deferred check's undo stay right."""
    model = _model("llama", "sdpa")
    free = _generate(model, NAMES, max_new_tokens=8)
    start = max(LENGTHS)
    eos = sorted({int(free[0, start + 2]), int(free[2, start + 4])})
    ref = _generate(model, NAMES, max_new_tokens=8, eos_token_id=eos, pad_token_id=5)
    with fastlora.patched(model, cuda_graphs="emulate"):
        out = _generate(model, NAMES, max_new_tokens=8, eos_token_id=eos, pad_token_id=5)
        stats = fastlora.get_state(model).graph_runner.stats
    assert torch.equal(out, ref), (out, ref)
    assert (ref[:, start:] == 5).any()  # the premise: some row finished early and was padded
    assert stats["advanced_calls"] == 1, stats


def test_a_minimum_length_advances_once_it_stops_suppressing(cpu_events):
    model = _model("llama", "sdpa")
    free = _generate(model, NAMES, max_new_tokens=8)
    start = max(LENGTHS)
    eos = sorted({int(t) for t in free[:, start + 1]})  # the rows' second tokens, hidden until the 4th
    ref = _generate(model, NAMES, max_new_tokens=8, eos_token_id=eos, min_new_tokens=4)
    with fastlora.patched(model, cuda_graphs="emulate"):
        out = _generate(model, NAMES, max_new_tokens=8, eos_token_id=eos, min_new_tokens=4)
        runner = fastlora.get_state(model).graph_runner
        stats = runner.stats
        kept = [k for entry in runner.graphs.values() for k in entry.get("advance", {})]
    assert torch.equal(out, ref), (out, ref)
    # from the first decode step on the GPU, with the suppressed ids, then without them
    assert stats["advanced_calls"] == 1 and not stats["advance_reasons"], stats
    assert sorted(kept) == [(True, False), (True, True)], kept


def test_blocker_names_what_it_cannot_advance():
    mask = torch.zeros(2, 1, 1, 16, dtype=torch.bool)
    setattr(mask, step_advance.MASK_TAG, 0)
    ok = dict(input_ids=torch.zeros(2, 1, dtype=torch.int64), attention_mask=mask,
              position_ids=torch.zeros(2, 1, dtype=torch.int64), use_cache=True, cache=object())
    assert step_advance.blocker(ok, 2, 16, 16) is None
    windowed = mask.clone()
    setattr(windowed, step_advance.MASK_TAG, 8)
    cases = {
        "more than 16 suppressed ids": (ok, 17, 16),
        "a step input it does not advance (token_type_ids)": (dict(ok, token_type_ids=torch.zeros(2, 1)), 0, 16),
        "a mask fastlora's step mask did not build": (dict(ok, attention_mask=mask.clone()), 0, 16),
        "the call outgrows its mask (a sliding window or the cache)": (ok, 0, 17),
        "no (rows, 1) int64 input_ids": (dict(ok, input_ids=torch.zeros(2, 1, dtype=torch.int32)), 0, 16),
        "position_ids not (rows, 1) integers": (dict(ok, position_ids=torch.zeros(2, 3, dtype=torch.int64)),
                                                0, 16),
    }
    for why, (inputs, n_suppress, widest) in cases.items():
        assert step_advance.blocker(inputs, 2, widest, n_suppress) == why
    assert step_advance.blocker(dict(ok, attention_mask=windowed), 2, 9, 0) == \
        "the call outgrows its mask (a sliding window or the cache)"
    assert step_advance.blocker(dict(ok, attention_mask={"full": mask, "sliding": mask}), 2, 16, 0) is None


def test_one_step_advance_graph_per_kind_of_call(cpu_events):
    """Calls of 5-8 rows with 0-3 EOS ids and minimum lengths, all in the bucket of eight, share
    one step-advance graph per kind of call (an EOS criterion or not, EOS ids suppressed or not),
    and every call equals PEFT's."""
    model = _model("llama", "sdpa")
    names = (NAMES * 2)[:8]
    calls = [(names[:r], dict(max_new_tokens=4, eos_token_id=list(range(90, 90 + e)) or None, **extra))
             for r, e, extra in ((5, 1, {}), (6, 2, {}), (7, 3, dict(min_new_tokens=3)), (8, 1, {}),
                                 (7, 3, dict(min_new_tokens=2)), (6, 0, {}), (5, 2, dict(min_new_tokens=3)))]
    refs = [_generate(model, n, **g) for n, g in calls]
    with fastlora.patched(model, cuda_graphs="emulate", graph_buckets=(8,)):
        outs = [_generate(model, n, **g) for n, g in calls]
        runner = fastlora.get_state(model).graph_runner
        kept = [sorted(entry.get("advance", {})) for entry in runner.graphs.values()]
        stats = runner.stats
    for out, ref in zip(outs, refs):
        assert torch.equal(out, ref), (out, ref)
    assert stats["advanced_calls"] == len(calls), stats
    # (EOS criterion, suppressing): the sixth call has none; the minimum lengths suppress at first
    assert kept == [[(False, False), (True, False), (True, True)]], kept


def test_warmup_captures_the_step_advance_graphs_calls_use(cpu_events):
    """After ``warmup`` every decode graph has its step-advance graphs for the model's EOS ids
    with and without a minimum length: greedy calls of any rows in the buckets add none."""
    model = _model("llama", "sdpa")
    model.generation_config.eos_token_id = [90, 91]
    with fastlora.patched(model, cuda_graphs="emulate", graph_buckets=(4, 8)):
        fastlora.warmup(model, max_length=64)
        runner = fastlora.get_state(model).graph_runner
        before = {k: sorted(e.get("advance", {})) for k, e in runner.graphs.items()}
        for rows, extra in ((3, {}), (5, {}), (8, dict(min_new_tokens=2)), (1, {})):
            _generate(model, (NAMES * 2)[:rows], max_new_tokens=4, **extra)
        after = {k: sorted(e.get("advance", {})) for k, e in runner.graphs.items()}
        stats = runner.stats
    assert stats["advanced_calls"] >= 4 + len(before), stats
    assert before and all(kinds == [(True, False), (True, True)] for kinds in before.values()), before
    assert after == before, (before, after)


def test_stop_flag_and_tokens_from_the_step_advance_launch(cpu_events, monkeypatch):
    """The stop check reads the flag the step-advance launch sets and the ids come from its
    history, once. Rows stop at different steps on EOS ids, a minimum length switches the advance
    graph mid-call, and the extra step is undone: the tokens equal PEFT's."""
    from peft_fastlora.decode import stop_flag

    calls = count_calls(monkeypatch, stop_flag.FlagStopCheck, ["__call__"])
    flushes = count_calls(monkeypatch, step_advance.StepAdvance, ["flush"])
    model = _model("llama", "sdpa")
    free = _generate(model, NAMES, max_new_tokens=9)
    start = max(LENGTHS)
    eos = sorted({int(free[0, start + 5]), int(free[2, start + 6]), int(free[1, start + 1])})
    gens = [dict(max_new_tokens=9, eos_token_id=eos, pad_token_id=5),
            dict(max_new_tokens=9, eos_token_id=eos, pad_token_id=5, min_new_tokens=3),
            dict(max_new_tokens=7)]
    refs = [_generate(model, NAMES, **g) for g in gens]
    with fastlora.patched(model, cuda_graphs="emulate"):
        outs = [_generate(model, NAMES, **g) for g in gens]
        stats = fastlora.get_state(model).graph_runner.stats
    for out, ref in zip(outs, refs):
        assert torch.equal(out, ref), (out, ref)
    assert stats["advanced_calls"] == 3 and stats["deferred_stop_calls"] == 3, stats
    # a check a step; a flush a call, and one more where the minimum length ended
    assert calls["__call__"] >= sum(o.shape[1] for o in outs) - 3 * start - 3 and flushes["flush"] == 4
