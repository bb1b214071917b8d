"""The decode plan: decided once per build, and what the report says of it."""

from __future__ import annotations

import torch

import peft_fastlora as fastlora
from peft_fastlora.decode.plan import DecodePlan

from _models import tiny_peft_llama


def test_report_words_for_each_plan():
    assert DecodePlan("cuda_graphs=False").report_fields() == {"cuda_graphs": "off (cuda_graphs=False)"}
    on = DecodePlan(None, emulate=False, stop_check_off=None, token_selection_off=None).report_fields()
    assert on == {"cuda_graphs": "on", "stop_check": "deferred",
                  "token_selection": "one kernel for greedy calls, their next inputs written on the GPU"}
    cpu = DecodePlan(None, emulate=True, stop_check_off="not on cuda",
                     token_selection_off="the stop check is read every step").report_fields()
    assert cpu == {"cuda_graphs": "emulated", "stop_check": "per step (not on cuda)",
                   "token_selection": "transformers' (the stop check is read every step)"}


def test_the_plan_follows_the_options_and_the_runner_follows_the_plan():
    model = tiny_peft_llama()
    with fastlora.patched(model, cuda_graphs="emulate") as report:
        state = fastlora.get_state(model)
        assert state.decode_plan.graphs_off is None and state.decode_plan.emulate
        assert state.graph_runner is not None and report.cuda_graphs == "emulated"
        assert state.decode_plan.stop_check_off is not None  # the deferred check needs CUDA
        assert report.stop_check == f"per step ({state.decode_plan.stop_check_off})"
    with fastlora.patched(model, cuda_graphs=False) as report:
        state = fastlora.get_state(model)
        assert state.decode_plan == DecodePlan("cuda_graphs=False")
        assert state.graph_runner is None and report.cuda_graphs == "off (cuda_graphs=False)"
        ids = torch.randint(3, 128, (2, 4))
        with torch.no_grad():  # an eager call still works
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=["a", "b"],
                           max_new_tokens=2, do_sample=False, pad_token_id=0)
