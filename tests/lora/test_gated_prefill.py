"""A LoRA gate/up site's deltas inside the activation's launch at prefill (``Tuning.glu_expand_min_tokens``:
the base GEMM, the shrink, then ``ops.glu_expand`` through ``TritonLoRABackend.run_packed_glu``), in
Triton's interpreter: a float32 PeftModel with adapters of mixed ranks, one on gate alone and one on up
alone, and "__base__" rows, its logits and tokens equal to PEFT's mixed batch; only prefills of rows
of at least the kernel's row tile take it (not short rows, decode steps, or continuous-batching steps).
The kernel itself: ``tests/kernels/test_glu_expand.py``."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

pytest.importorskip("triton")

import peft_fastlora as fastlora  # noqa: E402
from peft_fastlora.backend.packed import block_align  # noqa: E402
from peft_fastlora.ops.glu_expand import BLOCK_M  # noqa: E402

from _helpers import record_glu_expand_launches  # noqa: E402
from _models import left_padded_batch, tiny_llama  # noqa: E402

NAMES = ["a", "__base__", "b", "c"]
# rows of more than a tile (a tile across two rows' adapters too), one left-padded
LONG_ROWS = [BLOCK_M + 6, BLOCK_M + 6, BLOCK_M - 10, BLOCK_M + 6]
OPTIONS = dict(backend="triton", fuse_silu_mul=True, cuda_graphs=False)


def _model():
    """Adapters of ranks 8 (gate, up, q), 16 (gate alone: up's rank 0) and 12 (up alone and down:
    ranks no multiple of 8, so B's blocks sit at any element)."""
    base = tiny_llama(0, vocab_size=128)
    base.generation_config.eos_token_id = None
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "q_proj"],
                                            init_lora_weights=False), adapter_name="a")
    model.add_adapter("b", LoraConfig(r=16, lora_alpha=32, target_modules=["gate_proj"], init_lora_weights=False))
    model.add_adapter("c", LoraConfig(r=12, lora_alpha=24, target_modules=["up_proj", "down_proj"],
                                      init_lora_weights=False))
    assert block_align([8, 16, 12]) == 1
    return model.eval()


@pytest.fixture
def launches(monkeypatch):
    """The token count of every ``ops.glu_expand`` launch."""
    return record_glu_expand_launches(monkeypatch)


def _logits(model, batch, names):
    with torch.no_grad():
        return model(**batch, adapter_names=names).logits


def _same(got, want):
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_prefill_of_long_rows_equals_peft(launches):
    model = _model()
    batch = left_padded_batch(LONG_ROWS, seed=1)
    want = _logits(model, batch, NAMES)
    without = _logits(model, batch, ["__base__"] * len(NAMES))
    assert all((want[i] - without[i]).abs().max() > 0.05 for i in (0, 2, 3))  # every adapter moves its row
    tuning = fastlora.Tuning(glu_expand_min_tokens=len(LONG_ROWS) * max(LONG_ROWS))
    with fastlora.patched(model, tuning=tuning, **OPTIONS) as report:
        layers = model.config.num_hidden_layers
        assert report.lora_glu_expand_mlps == layers and "deltas in the act-mul's launch at prefill" in str(report)
        _same(_logits(model, batch, NAMES), want)
    assert launches == [batch["input_ids"].numel()] * layers


def test_generate_takes_it_at_prefill_only(launches):
    """The prefill's MLPs take the kernel; the decode steps (4 tokens each) do not. PEFT's tokens
    and logits."""
    model = _model()
    batch = left_padded_batch(LONG_ROWS, seed=2)
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = model.generate(**batch, adapter_names=NAMES, **kw)
        with fastlora.patched(model, tuning=fastlora.Tuning(glu_expand_min_tokens=BLOCK_M), **OPTIONS):
            got = model.generate(**batch, adapter_names=NAMES, **kw)
    assert launches == [batch["input_ids"].numel()] * model.config.num_hidden_layers
    assert torch.equal(got.sequences, want.sequences)
    _same(torch.stack(got.logits), torch.stack(want.logits))


@pytest.mark.parametrize("rows, min_tokens", [([BLOCK_M - 1] * 4, 16), (LONG_ROWS, None), (LONG_ROWS, 10 ** 6)],
                         ids=["rows_shorter_than_a_tile", "off", "fewer_tokens"])
def test_other_forwards_keep_the_two_launches(launches, rows, min_tokens):
    """Rows shorter than the kernel's row tile (tiles would hold several adapters), the threshold
    off (None: the MLPs get no such path), or a forward below it: the expand, then the activation;
    PEFT's logits."""
    model = _model()
    names = (NAMES * len(rows))[: len(rows)]
    batch = left_padded_batch(rows, seed=3)
    want = _logits(model, batch, names)
    with fastlora.patched(model, tuning=fastlora.Tuning(glu_expand_min_tokens=min_tokens), **OPTIONS) as report:
        assert report.lora_glu_expand_mlps == (0 if min_tokens is None else model.config.num_hidden_layers)
        _same(_logits(model, batch, names), want)
    assert launches == []


def test_a_backend_other_than_triton_reports_none():
    model = _model()
    with fastlora.patched(model, backend="torch_native", fuse_silu_mul=True, cuda_graphs=False,
                          tuning=fastlora.Tuning(glu_expand_min_tokens=16)) as report:
        assert report.lora_glu_expand_mlps == 0 and "at prefill" not in str(report)


@pytest.mark.parametrize("value", [0, -1, True, 64.0, "64"])
def test_a_bad_threshold_names_the_field(value):
    with pytest.raises(ValueError, match="Tuning.glu_expand_min_tokens must be a positive int or None"):
        fastlora.Tuning(glu_expand_min_tokens=value)
    assert fastlora.Tuning().glu_expand_min_tokens == 4096
    assert fastlora.Tuning(glu_expand_min_tokens=None).glu_expand_min_tokens is None
