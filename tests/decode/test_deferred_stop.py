"""The stop check read one step late on graphed calls (``decode/deferred_stop.py``), without a GPU.

On CUDA, transformers' ``DeferredStopCheck`` copies the "all rows finished" flag to pinned memory
behind an event. CPU tensors have no events, and fastlora defers on CUDA only; these tests let the
check run on the CPU with a stand-in event (a CPU copy is done when it returns) so that the copied
loop, the one extra step and its undoing are checked here, against PEFT's tokens. The GPU tests
(``test_generate_gpu.py``) run the same checks with real events through CUDA graphs.
"""

import pytest
import torch
from transformers.generation import StoppingCriteria, StoppingCriteriaList
from transformers.generation import utils as gen_utils

import peft_fastlora as fastlora
from peft_fastlora.decode import deferred_stop
from _helpers import TokenStream
from _models import tiny_peft_llama

NAMES = ["a", "__base__", "b", "a"]


@pytest.fixture(scope="module")
def model():
    return tiny_peft_llama()


def _inputs(batch=4, new=10):
    torch.manual_seed(1)
    ids = torch.randint(1, 128, (batch, 7))
    mask = torch.ones_like(ids)
    if batch > 1:  # one left-padded row
        ids[1, :2], mask[1, :2] = 0, 0
    return dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)


def _stats(model):
    return fastlora.get_state(model).graph_runner.stats


def test_length_stop_equals_peft_and_defers(model, cpu_events):
    kw = _inputs()
    ref = model.generate(**kw, adapter_names=NAMES)
    with fastlora.patched(model, cuda_graphs="emulate") as report:
        out = model.generate(**kw, adapter_names=NAMES)
        stats = _stats(model)
        assert report.stop_check == "deferred" and "stop check deferred" in str(report)
    assert torch.equal(out, ref)
    assert stats["deferred_stop_calls"] == 1 and stats["steps_undone"] == 0, stats
    assert stats["fused_selection_calls"] == 1 and not stats["selection_reasons"], stats
    assert gen_utils.DeferredStopCheck.__module__ == gen_utils.__name__  # transformers' module untouched


def test_eos_stop_undoes_the_extra_step(model, cpu_events):
    kw = _inputs()
    free = model.generate(**kw, adapter_names=NAMES)
    # every row's token at its 3rd new step ends it: all rows finish together there (or before)
    eos = sorted({int(t) for t in free[:, 7 + 2]})
    ref = model.generate(**kw, adapter_names=NAMES, eos_token_id=eos)
    assert ref.shape[1] <= 7 + 3  # the call does stop early
    with fastlora.patched(model, cuda_graphs="emulate"):
        out = model.generate(**kw, adapter_names=NAMES, eos_token_id=eos)
        stats = _stats(model)
        again = model.generate(**kw, adapter_names=NAMES, eos_token_id=eos)  # the extra step's cache entry is reset
    assert torch.equal(out, ref) and torch.equal(again, ref)
    assert stats["deferred_stop_calls"] == 1 and stats["steps_undone"] == 1, stats
    assert stats["fused_selection_calls"] == 1, stats


def test_streamer_gets_every_token_once(model, cpu_events):
    kw = _inputs(batch=1, new=6)
    ref_stream, out_stream = TokenStream(), TokenStream()
    ref = model.generate(**kw, adapter_names=["b"], streamer=ref_stream)
    with fastlora.patched(model, cuda_graphs="emulate"):
        out = model.generate(**kw, adapter_names=["b"], streamer=out_stream)
        assert _stats(model)["deferred_stop_calls"] == 1
        assert _stats(model)["selection_reasons"] == {"a streamer": 1}  # transformers' loop streams
    assert torch.equal(out, ref)
    assert len(ref_stream.chunks) == 1 + 6 + 1 and out_stream.chunks == ref_stream.chunks


@pytest.mark.parametrize("extra, reason", [
    (dict(return_dict_in_generate=True), "return_dict_in_generate returns the cache"),
    (dict(penalty_alpha=0.6, top_k=4), "decoding mode"),
    (dict(tokenizer=object()), "tokenizer given"),
    (dict(custom_generate=lambda *a, **k: None), "the caller's custom_generate"),
    (dict(synced_gpus=True), "synced_gpus"),
])
def test_calls_that_keep_the_per_step_check(model, extra, reason):
    why = deferred_stop.call_reason(model.base_model.model, (), dict(_inputs(), **extra))
    assert why is not None and why.startswith(reason), why
    assert deferred_stop.call_reason(model.base_model.model, (), _inputs()) is None


def test_returned_cache_call_checks_every_step_and_equals_peft(model, cpu_events):
    kw = dict(_inputs(), return_dict_in_generate=True)
    ref = model.generate(**kw, adapter_names=NAMES)
    with fastlora.patched(model, cuda_graphs="emulate"):
        out = model.generate(**kw, adapter_names=NAMES)
        stats = _stats(model)
        cache = out.past_key_values
    assert torch.equal(out.sequences, ref.sequences)
    assert stats["deferred_stop_calls"] == 0 and stats["replays"] > 0, stats
    assert not hasattr(cache, deferred_stop.CALL_ATTR)


def test_option_off_and_cpu_report_the_per_step_check(model):
    with fastlora.patched(model, cuda_graphs="emulate", defer_stop_check=False) as report:
        assert report.stop_check == "per step (defer_stop_check=False)"
        model.generate(**_inputs(), adapter_names=NAMES)
        assert _stats(model)["deferred_stop_calls"] == 0
    with fastlora.patched(model, cuda_graphs="emulate") as report:  # no CUDA events on the CPU
        assert report.stop_check == "per step (not on cuda)"
    with pytest.raises(TypeError, match="defer_stop_check must be True or False"):
        fastlora.patch(model, defer_stop_check="auto")


class _FailAtStep(StoppingCriteria):
    def __init__(self, step):
        self.step, self.calls = step, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.step:
            raise RuntimeError("injected failure")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_a_call_that_raises_unmarks_its_cache_and_the_next_call_serves(model, cpu_events):
    kw = _inputs()
    ref = model.generate(**kw, adapter_names=NAMES)
    with fastlora.patched(model, cuda_graphs="emulate"):
        runner = fastlora.get_state(model).graph_runner
        with pytest.raises(RuntimeError, match="injected failure"):
            model.generate(**kw, adapter_names=NAMES, stopping_criteria=StoppingCriteriaList([_FailAtStep(4)]))
        caches = [e.cache for e in runner.caches._entries.values()]
        assert caches and not any(hasattr(c, deferred_stop.CALL_ATTR) for c in caches)
        out = model.generate(**kw, adapter_names=NAMES)
        assert runner.stats["deferred_stop_calls"] == 1
    assert torch.equal(out, ref)


@pytest.mark.parametrize("extra", [
    dict(do_sample=True, top_k=20, temperature=0.8),
    dict(do_sample=True, top_k=20, num_return_sequences=2),
    dict(max_length=7 + 6, max_new_tokens=None),
    dict(min_new_tokens=4, max_new_tokens=8),
])
def test_other_call_forms_equal_peft(model, cpu_events, extra):
    kw = {k: v for k, v in dict(_inputs(), **extra).items() if v is not None}
    # PEFT wants a name per generated row (rows repeated for num_return_sequences)
    names = [n for n in NAMES for _ in range(kw.get("num_return_sequences", 1))]
    torch.manual_seed(3)
    ref = model.generate(**kw, adapter_names=names)
    with fastlora.patched(model, cuda_graphs="emulate"):
        torch.manual_seed(3)
        out = model.generate(**kw, adapter_names=names)
        assert _stats(model)["deferred_stop_calls"] == 1
    assert torch.equal(out, ref)


def test_generation_config_asking_for_the_cache_keeps_the_per_step_check(model, cpu_events):
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=5, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    kw = {k: v for k, v in _inputs().items() if k in ("input_ids", "attention_mask")}
    ref = model.generate(**kw, generation_config=gc, adapter_names=NAMES)
    with fastlora.patched(model, cuda_graphs="emulate"):
        out = model.generate(**kw, generation_config=gc, adapter_names=NAMES)
        assert _stats(model)["deferred_stop_calls"] == 0
    assert torch.equal(out.sequences, ref.sequences)
