"""What a user who calls fastlora wrongly is told: the error names the mistake and the fix, with the
error type PEFT (or Python) gives for that kind of mistake."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import peft_fastlora as fastlora
from peft_fastlora import get_state

from test_patch_behaviour import IDS, MASK, build


def test_adapter_names_as_one_string_asks_for_a_list():
    m = build()
    fastlora.patch(m)
    kw = dict(input_ids=IDS, attention_mask=MASK, max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match=r"adapter_names must be a list with one adapter name per row.*"
                                         r"got the string 'sql'.*\['sql'\] \* batch_size"):
        m.generate(**kw, adapter_names="sql")
    with torch.no_grad(), pytest.raises(ValueError, match="adapter_names must be a list"):
        m(input_ids=IDS, attention_mask=MASK, adapter_names="a4")
    out = m.generate(**kw, adapter_names=["sql"] * IDS.shape[0])  # the model serves as before
    assert out.shape == (IDS.shape[0], IDS.shape[1] + 2)


@pytest.mark.parametrize("thing", [nn.Linear(2, 2), "model", None])
def test_patch_says_what_it_takes(thing):
    with pytest.raises(TypeError, match=r"fastlora.patch takes a PeftModel holding LoRA adapters .*or a "
                                        r"transformers model that generates.*got "):
        fastlora.patch(thing)
    if isinstance(thing, nn.Module):
        assert get_state(thing) is None


def test_unknown_backend_on_a_patched_model_is_an_unknown_backend():
    """The name is checked before the options are compared with the patched model's."""
    m = build()
    fastlora.patch(m)
    state = get_state(m)
    with pytest.raises(ValueError, match=r"unknown backend 'cuda'; the backends are 'auto', torch_native"):
        fastlora.patch(m, backend="cuda")
    assert get_state(m) is state
    with pytest.raises(ValueError, match="already patched with other options"):  # a real backend
        fastlora.patch(m, backend="triton")


@pytest.mark.parametrize("fields, pattern", [
    (dict(stream_max_rows=-1), "Tuning.stream_max_rows must be a non-negative number"),
    (dict(stream_max_rows=True), "Tuning.stream_max_rows must be a non-negative number"),
    (dict(fold_max_tokens=-1), "Tuning.fold_max_tokens must be a non-negative number"),
])
def test_a_bad_tuning_value_names_the_field(fields, pattern):
    with pytest.raises(ValueError, match=pattern):
        fastlora.Tuning(**fields)
