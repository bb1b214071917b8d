"""fastlora's greedy loop (``decode/greedy_loop.py``: each step's token selection in one kernel)
against PEFT's own ``generate``, without a GPU: the graphs emulated, the kernel under Triton's
interpreter, CUDA events stood in for (as in ``test_deferred_stop.py``). Every call form it serves
must give PEFT's tokens exactly; every other form keeps transformers' loop, says why, and still
gives PEFT's tokens."""

import pytest
import torch
from transformers.generation import StoppingCriteria, StoppingCriteriaList

import peft_fastlora as fastlora
from _models import tiny_peft_llama

NAMES = ["a", "__base__", "b", "a"]


@pytest.fixture(scope="module")
def model():
    return tiny_peft_llama()


def _inputs(batch=4, new=10, seed=1):
    torch.manual_seed(seed)
    ids = torch.randint(1, 128, (batch, 7))
    mask = torch.ones_like(ids)
    if batch > 1:  # one left-padded row
        ids[1, :2], mask[1, :2] = 0, 0
    return dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)


def _free_tokens(model, kw, names):
    """The tokens of an unpatched call with no EOS: what the EOS cases pick their ids from."""
    return model.generate(**kw, adapter_names=names)[:, kw["input_ids"].shape[1]:]


def _run(model, kw, names):
    ref = model.generate(**kw, adapter_names=names)
    with fastlora.patched(model, cuda_graphs="emulate"):
        out = model.generate(**kw, adapter_names=names)
        stats = fastlora.get_state(model).graph_runner.stats
    return out, ref, stats


def _eos_cases(free):
    """Call forms with EOS ids chosen from the free run's tokens, so that rows stop at different
    steps, finished rows are padded, and minimum lengths suppress ids the rows would pick."""
    early = sorted({int(t) for t in free[:, 1]})  # most rows' 2nd token
    fourth = sorted({int(t) for t in free[:, 3]})  # their 4th: the last a minimum of 4 new tokens hides
    one = [int(free[0, 3])]  # row 0 stops at its 4th token, the others maybe later or never
    return {
        "rows stop apart, pad 5": dict(eos_token_id=one, pad_token_id=5),
        "several ids": dict(eos_token_id=early + one),
        "min_new_tokens hides them": dict(eos_token_id=early, min_new_tokens=4),
        "min_length hides them": dict(eos_token_id=early, min_length=7 + 3),
        "all rows stop at once": dict(eos_token_id=sorted({int(t) for t in free[:, 2]})),
        "min_new_tokens at its last step": dict(eos_token_id=fourth, min_new_tokens=4),
        "min_length at its last step": dict(eos_token_id=fourth, min_length=7 + 4),
    }


@pytest.mark.parametrize("case", ["rows stop apart, pad 5", "several ids", "min_new_tokens hides them",
                                  "min_length hides them", "all rows stop at once",
                                  "min_new_tokens at its last step", "min_length at its last step"])
def test_eos_and_minimum_lengths_equal_peft(model, cpu_events, case):
    kw = _inputs()
    kw = dict(kw, **_eos_cases(_free_tokens(model, kw, NAMES))[case])
    out, ref, stats = _run(model, kw, NAMES)
    assert torch.equal(out, ref), (out, ref)
    assert stats["fused_selection_calls"] == 1 and not stats["selection_reasons"], stats


@pytest.mark.parametrize("extra", [dict(max_length=7 + 6, max_new_tokens=None), dict(max_new_tokens=1)])
def test_length_forms_and_one_row_equal_peft(model, cpu_events, extra):
    for batch, names in ((4, NAMES), (1, ["b"])):
        kw = {k: v for k, v in dict(_inputs(batch=batch), **extra).items() if v is not None}
        out, ref, stats = _run(model, kw, names)
        assert torch.equal(out, ref) and out.is_contiguous(), (out, ref)
        assert stats["fused_selection_calls"] == 1, stats


def test_int32_prompt_ids_give_transformers_int64_result(model, cpu_events):
    kw = _inputs()
    kw["input_ids"] = kw["input_ids"].to(torch.int32)
    out, ref, stats = _run(model, kw, NAMES)
    assert out.dtype == ref.dtype and torch.equal(out, ref), (out.dtype, ref.dtype)
    assert stats["fused_selection_calls"] == 1, stats


class _Never(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("extra, reason", [
    (dict(repetition_penalty=1.3), "logits processor RepetitionPenaltyLogitsProcessor"),
    (dict(do_sample=True, top_k=5), "sampling"),
    (dict(stopping_criteria=StoppingCriteriaList([_Never()])), "stopping criterion _Never"),
    (dict(max_time=30.0), "stopping criterion MaxTimeCriteria"),
])
def test_other_forms_keep_transformers_loop_and_say_why(model, cpu_events, extra, reason):
    kw = dict(_inputs(), **extra)
    torch.manual_seed(4)
    ref = model.generate(**kw, adapter_names=NAMES)
    with fastlora.patched(model, cuda_graphs="emulate"):
        torch.manual_seed(4)
        out = model.generate(**kw, adapter_names=NAMES)
        stats = fastlora.get_state(model).graph_runner.stats
    assert torch.equal(out, ref)
    assert stats["fused_selection_calls"] == 0 and stats["selection_reasons"] == {reason: 1}, stats
    assert stats["deferred_stop_calls"] == 1, stats


def test_the_report_says_which_token_selection_greedy_calls_get(model, cpu_events, monkeypatch):
    with fastlora.patched(model, cuda_graphs="emulate") as report:
        assert report.token_selection == "one kernel for greedy calls, their next inputs written on the GPU"
        assert "token selection one kernel for greedy calls, their next inputs written on the GPU" in str(report)
    with fastlora.patched(model, cuda_graphs="emulate", defer_stop_check=False) as report:
        assert report.token_selection == "transformers' (the stop check is read every step)"


def test_a_vocabulary_of_several_chunks(cpu_events):
    """A vocabulary wider than one program's block: the row's programs meet in the slot."""
    from peft import LoraConfig, get_peft_model
    from peft_fastlora.ops.greedy_select import block_for
    from _models import LLAMA_LIKE_ALL, tiny_llama

    base = tiny_llama(0, vocab_size=2 * block_for(3) + 5)
    base.generation_config.eos_token_id = None
    m = get_peft_model(base, LoraConfig(r=4, target_modules=LLAMA_LIKE_ALL, init_lora_weights=False),
                       adapter_name="a").eval()
    torch.manual_seed(0)
    kw = dict(input_ids=torch.randint(1, 2 * block_for(3), (3, 5)), max_new_tokens=6, do_sample=False, pad_token_id=0)
    free = _free_tokens(m, kw, ["a", "__base__", "a"])
    kw["eos_token_id"] = [int(free[1, 2])]
    out, ref, stats = _run(m, kw, ["a", "__base__", "a"])
    assert torch.equal(out, ref), (out, ref)
    assert stats["fused_selection_calls"] == 1, stats
