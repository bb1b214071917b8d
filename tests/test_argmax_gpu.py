"""``ops.argmax`` on the GPU: torch.argmax's answer for logits of real vocabulary sizes (ties, NaN,
infinities, signed zeros, random low-resolution rows), and a graphed greedy call of a model with a
32k vocabulary that picks its tokens through it, PEFT's tokens. Run on the device machine:

    python -m pytest -m gpu tests/test_argmax_gpu.py
"""

import pytest
import torch
from peft import LoraConfig, get_peft_model

import peft_fastlora as fastlora
import peft_fastlora.ops.argmax as argmax_ops
from peft_fastlora.ops.argmax import argmax_rows

from _helpers import count_calls
from _models import left_padded_batch, tiny_llama
from test_argmax import _hard_rows

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 32, 128, 300])
@pytest.mark.parametrize("cols", [32000, 50257, 128256, 151936])
def test_equals_torch_argmax(dtype, rows, cols):
    x = _hard_rows(rows, cols, dtype, seed=rows + cols).cuda()
    assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1))
    q = torch.randint(-2, 3, (rows, cols), device="cuda").to(dtype)  # many equal maxima a row
    assert torch.equal(argmax_rows(q), torch.argmax(q, dim=-1))
    s = torch.randn(rows, 2, cols, device="cuda", dtype=dtype)[:, 1]  # a step's logits[:, -1]
    assert torch.equal(argmax_rows(s), torch.argmax(s, dim=-1))


def test_graphed_greedy_call_with_a_32k_vocabulary_equals_peft(monkeypatch):
    base = tiny_llama(2, vocab_size=32000).to("cuda")  # float32: the tokens equal PEFT's exactly
    base.generation_config.eos_token_id = None
    model = get_peft_model(base, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
                           adapter_name="a").eval()
    batch = {k: v.cuda() for k, v in left_padded_batch([5, 9, 3], seed=2).items()}
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, adapter_names=["a", "__base__", "a"])
    with torch.no_grad():
        ref = model.generate(**batch, **kw)
        calls = count_calls(monkeypatch, argmax_ops, ["argmax_rows"])
        with fastlora.patched(model) as report:
            out = model.generate(**batch, **kw)
            stats = dict(fastlora.get_state(model).graph_runner.stats)
    assert report.stop_check == "deferred" and stats["replays"] >= 8, (str(report), stats)
    assert calls["argmax_rows"] == 12, calls
    assert torch.equal(out, ref)
