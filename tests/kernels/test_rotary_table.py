"""Rotary cos / sin from a table in decode graphs (``ops.rotary_table``, ``base_ops.rotary_tables``):
the gather against torch's indexing, the table against the module's own forward for each static
rope type, the modules left alone, and generate through emulated graphs against PEFT's."""

from __future__ import annotations

import importlib
import pytest
import torch
from torch import nn

import peft_fastlora as fastlora
from peft_fastlora.base_ops.rotary_tables import RotaryTables, TableMismatch, build_table, table_blocker
from peft_fastlora.ops import rotary_table as table_ops
from peft_fastlora.instance_methods import InstancePatches

from _helpers import count_calls
from _models import build_peft_lm, left_padded_batch, tiny_llama

ROPES = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "linear": dict(rope_type="linear", factor=2.0, rope_theta=10000.0),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64, rope_theta=500000.0),
    "yarn": dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=64, rope_theta=10000.0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [2, 10, 64, 96])
@pytest.mark.parametrize("shape", [(1, 1), (4, 1), (3, 5)])
def test_gather_equals_indexing(dtype, dim, shape):
    gen = torch.Generator().manual_seed(dim * 31 + shape[1])
    length = 37
    table = torch.randn(2, length, dim, generator=gen).to(dtype)
    pos = torch.randint(0, length, shape, generator=gen)
    pos.view(-1)[0] = length - 1
    for ids in (pos, pos.int()):
        cos, sin = table_ops.gather_cos_sin(table, ids)
        assert cos.shape == sin.shape == shape + (dim,) and cos.is_contiguous() and sin.is_contiguous()
        assert torch.equal(cos, table[0][pos]) and torch.equal(sin, table[1][pos])
        ref = table_ops.gather_cos_sin_reference(table, ids)
        assert torch.equal(ref[0], cos) and torch.equal(ref[1], sin)


def test_positions_outside_the_table_are_clamped_not_read_past_it():
    table = torch.arange(2 * 5 * 4, dtype=torch.float32).view(2, 5, 4)
    pos = torch.tensor([[-3, 0, 4, 9]])
    for gather in (table_ops.gather_cos_sin, table_ops.gather_cos_sin_reference):
        cos, sin = gather(table, pos)
        assert torch.equal(cos[0], table[0][torch.tensor([0, 0, 4, 4])])
        assert torch.equal(sin[0], table[1][torch.tensor([0, 0, 4, 4])])


def test_bad_tables_and_positions_are_refused():
    with pytest.raises(ValueError, match="contiguous"):
        table_ops.gather_cos_sin(torch.zeros(3, 4, 2), torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="integers"):
        table_ops.gather_cos_sin(torch.zeros(2, 4, 2), torch.zeros(1, 1))


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_equals_the_module_at_any_positions(rope, dtype):
    module = tiny_llama(rope_parameters=ROPES[rope], max_position_embeddings=2048).model.rotary_emb
    assert table_blocker(module) is None
    forward = type(module).forward
    table = build_table(module, forward, 300, dtype, torch.device("cpu"))
    assert table.shape == (2, 300, module.inv_freq.numel() * 2) and table.dtype == dtype
    x = torch.empty(0, dtype=dtype)
    for shape in ((1, 1), (6, 1), (2, 7)):
        pos = torch.randint(0, 300, shape)
        want = forward(module, x, pos)
        got = table_ops.gather_cos_sin(table, pos)
        assert all(torch.equal(w, g) for w, g in zip(want, got)), rope


def test_modules_a_table_cannot_serve_are_named():
    dynamic = tiny_llama(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0)).model.rotary_emb
    assert "rope type 'dynamic'" in table_blocker(dynamic)

    class ThreeArgRotaryEmbedding(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", torch.ones(2))
            self.rope_type = "default"

        def forward(self, x, position_ids, layer_type=None):
            return x, x

    assert "is not (x, position_ids)" in table_blocker(ThreeArgRotaryEmbedding())
    assert table_blocker(nn.Linear(2, 2)) == "not a rotary embedding"


class BatchDependentRotaryEmbedding(nn.Module):
    """Looks like a static rotary embedding, but its outputs depend on the batch's size."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(4))
        self.rope_type = "default"

    def forward(self, x, position_ids):
        v = (position_ids[..., None].float() + position_ids.shape[0]).expand(*position_ids.shape, 8).to(x.dtype)
        return v.cos(), v.sin()


def test_a_module_whose_outputs_are_not_per_position_keeps_its_forward():
    patches = InstancePatches()
    module = BatchDependentRotaryEmbedding()
    with pytest.raises(TableMismatch):
        build_table(module, type(module).forward, 16, torch.float32, torch.device("cpu"))
    root = nn.ModuleDict({"rotary_emb": module})
    tables = RotaryTables()
    done, skipped = tables.install(root, patches)
    assert [n for n, _ in done] == ["rotary_emb"] and skipped == []
    pos = torch.tensor([[3], [5]])
    x = torch.zeros(2, 1, 4)
    with tables.active(16):
        got = module(x, pos)
    assert "BatchDependentRotaryEmbedding" in tables.off
    want = type(module).forward(module, x, pos)
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    tables.remove()
    patches.restore()
    assert "forward" not in module.__dict__


def test_inside_active_only_and_outside_the_module_own_forward(monkeypatch):
    patches = InstancePatches()
    module = tiny_llama().model.rotary_emb
    root = nn.ModuleDict({"rotary_emb": module})
    tables = RotaryTables()
    tables.install(root, patches)
    calls = count_calls(monkeypatch,
            importlib.import_module("peft_fastlora.base_ops.rotary_tables"), ["gather_cos_sin"])
    x, pos = torch.zeros(3, 1, 8), torch.tensor([[4], [0], [9]])
    want = type(module).forward(module, x, pos)
    outside = module(x, pos)
    assert calls["gather_cos_sin"] == 0
    with tables.active(10):
        inside = module(x, pos)
        assert calls["gather_cos_sin"] == 2  # the build's check, then the lookup
        module(x, pos)  # the table is built once
        assert calls["gather_cos_sin"] == 3
        assert len(tables.held()) == 1 and tables.held()[0].shape[1] == 10
    with tables.active(40):  # a longer one replaces it (graphs keep the one they read)
        module(x, pos)
    assert tables.held()[0].shape[1] == 40
    for got in (outside, inside):
        assert all(torch.equal(w, g) for w, g in zip(want, got))
    tables.remove()
    patches.restore()


def _generate(model, batch, names, **extra):
    return model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=0, adapter_names=names, **extra)


def test_generate_reads_the_table_in_graphs_and_equals_peft(monkeypatch):
    model = build_peft_lm("llama")
    batch = left_padded_batch([5, 9, 3, 7])
    names = ["a0", "__base__", "a1", "a2"]
    rotary = model.get_base_model().model.rotary_emb
    with torch.no_grad():
        ref = _generate(model, batch, names)
        # positions the caller passes: transformers extends them step by step
        own_pos = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0) + 5
        ref_own = _generate(model, batch, names, position_ids=own_pos)
        report = fastlora.patch(model, fuse_rotary=True, cuda_graphs="emulate")
        calls = count_calls(monkeypatch,
                importlib.import_module("peft_fastlora.base_ops.rotary_tables"), ["gather_cos_sin"])
        tokens = _generate(model, batch, names)
        graphed = calls["gather_cos_sin"]
        tokens_own = _generate(model, batch, names, position_ids=own_pos)
        stats = fastlora.get_state(model).graph_runner.stats
        fastlora.unpatch(model)
    assert "cos/sin from a table in graphs x1" in str(report), report
    # the emulated capture and every replay of the 5 decode steps read the table (and the build's check)
    assert graphed >= 6, graphed
    assert calls["gather_cos_sin"] == graphed  # the call with its own positions: the module's forward
    assert torch.equal(tokens, ref) and torch.equal(tokens_own, ref_own)
    assert stats["rotary_table_off"] == {} and stats["eager_steps"] == 0
    assert "forward" not in rotary.__dict__ and not any(k.startswith("_fastlora") for k in rotary.__dict__)


class FailingRotaryEmbedding(BatchDependentRotaryEmbedding):
    """Its forward fails on the table's one-row batch of every position (a shape it cannot take)."""

    def forward(self, x, position_ids):
        if position_ids.shape[1] > 1:
            raise RuntimeError("one position a row only")
        return super().forward(x, position_ids)


def test_a_module_whose_table_cannot_be_built_keeps_its_forward():
    patches = InstancePatches()
    module = FailingRotaryEmbedding()
    tables = RotaryTables()
    tables.install(nn.ModuleDict({"rotary_emb": module}), patches)
    x, pos = torch.zeros(2, 1, 4), torch.tensor([[3], [5]])
    with tables.active(16):
        got = module(x, pos)
    assert "building its table failed (RuntimeError: one position a row only)" in tables.off["FailingRotaryEmbedding"]
    want = type(module).forward(module, x, pos)
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    tables.remove()
    patches.restore()
