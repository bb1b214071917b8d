"""``patch`` behaves like PEFT: same errors, same fallbacks, same outputs, and a clean ``unpatch``.

Every test builds two identical tiny models from the same seeds: ``m`` is patched, ``ref`` stays
PEFT's own. Adapters use ``init_lora_weights=False`` (random, non-zero B) so that each adapter
changes the output and a wrong slot, a stale stack or a skipped delta shows up. A PEFT forward that
raises inside a layer leaves PEFT's ``adapter_names`` hooks registered (PEFT's context manager has
no ``finally``: huggingface/peft#3475), so a *reference* model is not used for anything else after
such an error; a patched model removes them (``guard_peft_forward_hooks``) and is checked to
work after its errors.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import peft_fastlora as fastlora
from peft_fastlora.backend.segmented import SegmentedLoRABackend
from peft_fastlora import get_state

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from peft import LoraConfig, get_peft_model  # noqa: E402

from _helpers import count_backend_calls  # noqa: E402
from _patch_models import ALL, IDS, build, logits, lora, tiny_llama  # noqa: E402

MASK = torch.ones_like(IDS)
NAMES = ["sql", "chat", "__base__", "sql"]
TOL = dict(atol=1e-5, rtol=1e-5)  # fp32; the fused GEMM may sum in another order than q/k/v alone

BACKEND_METHODS = ("run_packed_lora", "run_packed_embedding_lora", "run_lora_a_sgemm", "run_lora_b_sgemm",
                   "run_lora_a_embedding",
                   "prepare_lora_batch")


# ---- builders (``build``, ``logits``, ``lora``, ``tiny_llama``: ``_patch_models.py``) ------------
def pair(**kw):
    """(patched model, PEFT reference), identical weights."""
    m, ref = build(**kw), build(**kw)
    return m, ref


def assert_raises_like_peft(m, ref, names, match):
    """The patched model raises PEFT's own ValueError (same message) for these adapter names."""
    with pytest.raises(ValueError, match=match) as got:
        logits(m, names)
    with pytest.raises(ValueError) as want:
        logits(ref, names)
    assert str(got.value) == str(want.value)


def assert_same_as(m, ref, names=NAMES):
    torch.testing.assert_close(logits(m, names), logits(ref, names), **TOL)


def base_logits(ids=IDS):
    with torch.no_grad():
        return tiny_llama()(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


@pytest.fixture
def calls(monkeypatch):
    """Counts backend calls (class level, so it survives a re-scan that builds a new backend)."""
    return count_backend_calls(monkeypatch, SegmentedLoRABackend, BACKEND_METHODS)


def instance_forwards(model):
    return [n for n, mod in model.named_modules() if "forward" in mod.__dict__]


def lora_hook_count(model):
    return sum(len(mod._forward_pre_hooks) + len(mod._forward_hooks) for mod in model.modules()
               if hasattr(mod, "lora_A"))


def assert_still_serves(m, **kw):
    """After an error inside a call, the patched model has no stale hooks and equals a fresh PEFT model."""
    assert lora_hook_count(m) == 0
    assert_same_as(m, build(**kw), ["sql", "__base__", "sql", "__base__"])


# ---- bad inputs ----------------------------------------------------------------------------------
def test_unknown_adapter_name_raises_like_peft():
    m, ref = pair()
    fastlora.patch(m)
    bad = ["sql", "zzz", "__base__", "yyy"]
    assert_raises_like_peft(m, ref, bad, "non-existing adapter.*yyy, zzz")
    assert_still_serves(m)


def test_adapter_names_length_mismatch_raises_like_peft():
    m, ref = pair()
    fastlora.patch(m)
    assert_raises_like_peft(m, ref, ["sql", "chat"], "Length of `adapter_names`.*2 and 4")


def test_too_many_distinct_adapters_in_one_batch():
    m, ref = pair(adapters=(("sql", ALL, 4, {}), ("chat", ("q_proj", "v_proj"), 8, {}),
                            ("mlp", ("gate_proj",), 2, {})))
    report = fastlora.patch(m, max_loras_per_batch=2)
    assert report.adapters == ["chat", "mlp", "sql"]
    assert_same_as(m, ref, ["sql", "chat", "__base__", "chat"])  # two distinct: served
    with pytest.raises(ValueError, match="3 distinct adapters in one batch exceed max_loras_per_batch=2"):
        logits(m, ["sql", "chat", "mlp", "__base__"])
    with torch.no_grad(), pytest.raises(ValueError, match="max_loras_per_batch=2"):
        m.generate(input_ids=IDS, attention_mask=MASK, adapter_names=["mlp", "chat", "sql", "sql"],
                   max_new_tokens=2, do_sample=False)
    assert_still_serves(m, adapters=(("sql", ALL, 4, {}), ("chat", ("q_proj", "v_proj"), 8, {}),
                                     ("mlp", ("gate_proj",), 2, {})))


def test_unknown_backend_leaves_the_model_alone():
    m = build()
    before = {n: p.data_ptr() for n, p in m.named_parameters()}
    with pytest.raises(ValueError, match="unknown backend 'nope'.*torch_native"):
        fastlora.patch(m, backend="nope")
    assert get_state(m) is None
    assert instance_forwards(m) == []
    assert {n: p.data_ptr() for n, p in m.named_parameters()} == before
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        fastlora.get_backend("nope")


def test_triton_backend_on_cpu_without_the_interpreter(monkeypatch):
    """Asked for by name where its kernels cannot run: refused at patch time, with the fix named,
    and not listed by ``available_backends``."""
    from peft_fastlora import kernel_support

    monkeypatch.setattr(kernel_support, "interpreting", lambda: False)
    assert fastlora.available_backends("cpu") == ["torch_native"]
    m = build()
    with pytest.raises(ValueError, match="backend 'triton' cannot serve this model: its kernels need CUDA "
                                         "tensors, the model is on cpu.*TRITON_INTERPRET=1.*torch_native"):
        fastlora.patch(m, backend="triton")
    assert get_state(m) is None and instance_forwards(m) == []
    monkeypatch.setattr(kernel_support, "interpreting", lambda: True)  # what the CPU tests run under
    assert fastlora.available_backends("cpu") == ["torch_native", "triton"]


def test_patch_model_without_peft_speeds_up_the_base_model_only():
    model = tiny_llama()
    kw = dict(input_ids=IDS, attention_mask=MASK, max_new_tokens=5, do_sample=False)
    ref = model.generate(**kw)
    report = fastlora.patch(model, cuda_graphs="emulate")
    assert report.adapters == [] and report.num_patched_layers == 0
    assert str(report).startswith("fastlora: base model only (no LoRA adapters); decode graphs emulated")
    out = model.generate(**kw)
    stats = get_state(model).graph_runner.stats
    fastlora.unpatch(model)
    assert torch.equal(out, ref)
    assert stats["captures"] == 1 and stats["replays"] == 4, stats
    assert get_state(model) is None and instance_forwards(model) == []


def test_patch_peft_model_without_lora_adapters():
    model = get_peft_model(tiny_llama(), lora(["q_proj"]), adapter_name="only")
    model.delete_adapter("only")
    with pytest.raises(ValueError, match="holds no LoRA adapters"):
        fastlora.patch(model)
    assert get_state(model) is None and instance_forwards(model) == []


@pytest.mark.parametrize("kind", ["LOHA", "IA3"])
def test_patch_non_lora_peft_model(kind):
    if kind == "LOHA":
        cfg = peft.LoHaConfig(target_modules=["q_proj", "v_proj"])
    else:
        cfg = peft.IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"])
    model = get_peft_model(tiny_llama(), cfg)
    with pytest.raises(TypeError, match=f"LoRA adapters only.*{kind}.*peft.tuners.{kind.lower()}.layer"):
        fastlora.patch(model)
    assert get_state(model) is None and instance_forwards(model) == []


# ---- fallbacks and the report ------------------------------------------------------------------
def test_lora_bias_adapters_served_by_fastlora(calls):
    """B's bias (``lora_bias=True``) rides in the expand: every site on fastlora's path, equal to
    PEFT's mixed batch, the bias only in the rows and modules of the adapters that have one."""
    adapters = (("sql", ALL, 4, {}), ("biased", ("q_proj", "down_proj"), 4, {"lora_bias": True}),
                ("biased_all", ALL, 8, {"lora_bias": True}))
    m, ref = pair(adapters=adapters)
    for model in (m, ref):  # PEFT starts B (and its bias) at zero: give the biases values
        torch.manual_seed(3)
        for name, p in model.named_parameters():
            if "lora_B" in name and name.endswith(".bias"):
                p.data.normal_()
    report = fastlora.patch(m)
    assert report.adapter_fallbacks == [] and report.left_on_peft == [], report
    assert any(site.pool.bias is not None for site in get_state(m).sites)
    for names in (["biased", "sql", "__base__", "biased_all"], ["sql", "__base__", "sql", "sql"]):
        calls.clear()
        assert_same_as(m, ref, names)
        assert calls["qkv"] == 2 and calls["gate_up"] == 2
    # the bias matters: zeroed, the same rows give other logits (fastlora's stacks follow the values)
    biases = [p for n, p in m.named_parameters() if ".lora_B.biased." in n and n.endswith(".bias")]
    with_bias = logits(m, ["biased"] * 4)
    for p in biases:
        p.data.zero_()
    assert len(biases) == 4 and not torch.allclose(logits(m, ["biased"] * 4), with_bias)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.lin = nn.Linear(8, 10)

    def forward(self, x):
        return self.lin(self.conv(x).mean(dim=(2, 3)))


def _conv_model():
    torch.manual_seed(0)
    model = get_peft_model(ConvNet().eval(), lora(["conv", "lin"], r=2), adapter_name="sql")
    torch.manual_seed(1)
    model.add_adapter("chat", lora(["conv", "lin"], r=2))
    return model.eval()


def test_conv2d_left_on_peft(calls):
    m, ref = _conv_model(), _conv_model()
    report = fastlora.patch(m)
    assert report.left_on_peft == [
        ("base_model.model.conv", "peft.tuners.lora.layer.Conv2d over Conv2d is not handled by fastlora")]
    assert report.sites == [("base_model.model.lin", "linear", 1)]
    assert "1 left on PEFT's path" in str(report)
    x = torch.randn(3, 3, 5, 5)
    names = ["sql", "chat", "__base__"]
    with torch.no_grad():
        torch.testing.assert_close(m(x, adapter_names=names), ref(x, adapter_names=names), **TOL)
    assert calls["linear"] == 1


def test_report_summary_and_log(caplog):
    m = build()
    with caplog.at_level("INFO", logger="peft_fastlora"):
        report = fastlora.patch(m)
    text = str(report)
    assert text == report.summary()
    assert text.startswith("fastlora: patched 14 LoRA layers in 8 sites (2 gate_up, 4 linear, 2 qkv) for 2 "
                           "adapters on backend 'torch_native'; 0 left on PEFT's path")
    assert text.endswith("; decode graphs off (the model is not on CUDA); decode attention off (the model is "
                         "not on CUDA); continuous batching on; shrink folded into the base GEMM: off (not on CUDA); "
                         "siblings without LoRA in one GEMM: off (the model is not on CUDA); decode GEMMs streamed: off (the "
                         "model is not on CUDA); one-kernel RMSNorm off (the model is not on CUDA), rotary off (the model "
                         "is not on CUDA), act-mul off (the model is not on CUDA)")
    assert report.counts() == {"qkv": 2, "gate_up": 2, "linear": 4}
    assert report.num_patched_layers == 14 and report.adapters == ["chat", "sql"]
    assert report.backend == "torch_native" and report.device == "cpu"
    assert report.stack_bytes > 0 and not report.left_on_peft and not report.fusion_blocked
    assert report.continuous_batching == "on"
    assert text in [r.getMessage() for r in caplog.records if r.name == "peft_fastlora"]


# ---- same behaviour as PEFT ----------------------------------------------------------------------
def test_base_rows_equal_the_base_model(calls):
    m, ref = pair()
    fastlora.patch(m)
    base = base_logits()
    names = ["__base__", "sql", "__base__", "chat"]
    got = logits(m, names)
    torch.testing.assert_close(got[[0, 2]], base[[0, 2]], **TOL)
    assert not torch.allclose(got[[1, 3]], base[[1, 3]], atol=1e-3)  # the adapters do something
    torch.testing.assert_close(got, logits(ref, names), **TOL)
    torch.testing.assert_close(logits(m, ["__base__"] * 4), base, **TOL)
    assert calls["prepare_lora_batch"] >= 1


def test_interleaved_rows_equal_single_adapter_runs():
    m, ref = pair()
    fastlora.patch(m)
    ids = torch.cat([IDS, IDS[:2]])
    names = ["__base__", "sql", "chat", "__base__", "sql", "chat"]
    got = logits(m, names, ids)
    for name in ("sql", "chat"):
        ref.set_adapter(name)
        alone = logits(ref, ids=ids)
        rows = [i for i, n in enumerate(names) if n == name]
        torch.testing.assert_close(got[rows], alone[rows], **TOL)
    rows = [i for i, n in enumerate(names) if n == "__base__"]
    torch.testing.assert_close(got[rows], base_logits(ids)[rows], **TOL)


def test_disable_adapter_wins_over_adapter_names(calls):
    m, ref = pair()
    fastlora.patch(m)
    with m.disable_adapter():
        got = logits(m, NAMES)
    torch.testing.assert_close(got, base_logits(), **TOL)
    assert calls["qkv"] == 0
    assert_same_as(m, ref)  # enabled again after the block
    assert calls["qkv"] == 2


def test_training_step_then_serving(calls):
    m, ref = pair()
    fastlora.patch(m)
    before = logits(m, NAMES)
    calls.clear()
    losses = []
    for model in (m, ref):
        model.train()
        model.set_adapter("sql")  # only sql's weights train
        params = [p for p in model.parameters() if p.requires_grad]
        assert params
        opt = torch.optim.AdamW(params, lr=1e-2)
        for _ in range(2):
            loss = model(input_ids=IDS, attention_mask=MASK, labels=IDS).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
        model.eval()
    assert calls["qkv"] == 0  # training forwards ran PEFT's path
    assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=1e-6)
    after = logits(m, NAMES)
    assert not torch.allclose(after, before, atol=1e-4)  # the step changed the served outputs
    torch.testing.assert_close(after, logits(ref, NAMES), **TOL)
    assert calls["qkv"] == 2
    # PEFT refuses adapter_names in training mode; so does the patched model
    m.train()
    with pytest.raises(ValueError, match="training mode"):
        logits(m, NAMES)


def test_inference_mode_then_no_grad_then_training():
    # what fastlora allocates inside a forward (batch-info buffers, re-fused weights after
    # model.to() or an adapter change) must not become inference tensors
    m, ref = pair()
    fastlora.patch(m)
    for model in (m, ref):
        model.to(torch.float64).to(torch.float32)  # the next forward re-fuses
        torch.manual_seed(7)
        model.add_adapter("new", lora(["o_proj"], r=2, alpha=4))  # ... and re-scans
        model.eval()
    with torch.inference_mode():
        torch.testing.assert_close(logits(m, NAMES), logits(ref, NAMES), **TOL)
    names = ["chat", "new", "sql", "__base__"]
    assert_same_as(m, ref, names)  # in-place refresh of the buffers, outside inference mode
    m.train()
    m.set_adapter("sql")
    loss = m(input_ids=IDS, attention_mask=MASK, labels=IDS).loss
    loss.backward()
    assert _q_layer(m).lora_A["sql"].weight.grad is not None
    assert all(not p.is_inference() for p in m.parameters())


def test_merged_adapter(calls):
    m, ref = pair()
    fastlora.patch(m)
    for model in (m, ref):
        model.set_adapter("sql")
        model.merge_adapter()
    torch.testing.assert_close(logits(m), logits(ref), **TOL)
    for model in (m, ref):
        model.unmerge_adapter()
    assert_same_as(m, ref)
    assert calls["qkv"] == 2
    for model in (m, ref):
        model.merge_adapter(["chat"])
    assert_raises_like_peft(m, ref, NAMES, "merged adapters")


def test_one_names_list_reused_and_changed_in_place():
    # PEFT hands the caller's list to every layer as is; a serving loop may reuse and edit it
    m, ref = pair()
    fastlora.patch(m)
    names = list(NAMES)
    assert_same_as(m, ref, names)
    names[0], names[2] = "chat", "sql"
    assert_same_as(m, ref, names)
    with torch.no_grad():  # and across the decode steps of generate
        out = [model.generate(input_ids=IDS, attention_mask=MASK, adapter_names=names, max_new_tokens=3,
                              do_sample=False) for model in (m, ref)]
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("active", ["sql", "chat"])
def test_active_adapter_path(active, calls):
    m, ref = pair()
    fastlora.patch(m)
    for model in (m, ref):
        model.set_adapter(active)
    torch.testing.assert_close(logits(m), logits(ref), **TOL)
    assert sum(calls.values()) == 0  # no adapter_names: PEFT's own forward


def test_patch_twice_changes_nothing():
    m = build()
    r1 = fastlora.patch(m)
    state = get_state(m)
    ptrs = {n: p.data_ptr() for n, p in m.named_parameters()}
    forwards = {n: mod.__dict__["forward"] for n, mod in m.named_modules() if "forward" in mod.__dict__}
    hooks = len(state.inner._forward_pre_hooks)
    r2 = fastlora.patch(m)  # the same options: the same report, nothing touched
    assert r2 is r1 and get_state(m) is state
    with pytest.raises(ValueError, match=r"already patched with other options \(fuse: True -> False; "
                                         r"graph_buckets: .* -> \(2, 4\)\).*unpatch"):
        fastlora.patch(m, fuse=False, graph_buckets=[4, 2])
    assert get_state(m) is state and state.options.fuse is True
    assert {n: p.data_ptr() for n, p in m.named_parameters()} == ptrs
    assert {n: mod.__dict__["forward"] for n, mod in m.named_modules() if "forward" in mod.__dict__} == forwards
    assert len(state.inner._forward_pre_hooks) == hooks
    fastlora.unpatch(m)
    assert fastlora.patch(m, fuse=False).num_patched_layers > 0  # after unpatch: the new options


def test_patched_context_manager(calls):
    m, ref = pair()
    with fastlora.patched(m) as report:
        assert isinstance(report, fastlora.PatchReport) and get_state(m) is not None
        assert_same_as(m, ref)
    assert calls["qkv"] == 2
    assert get_state(m) is None and instance_forwards(m) == []
    calls.clear()
    assert_same_as(m, ref)
    assert sum(calls.values()) == 0
    with pytest.raises(RuntimeError, match="inside"):
        with fastlora.patched(m):
            raise RuntimeError("inside")
    assert get_state(m) is None and instance_forwards(m) == []


# ---- adapters that change after patch -------------------------------------------------------------
def test_add_adapter_on_new_modules_after_patch(calls):
    m, ref = pair(adapters=(("sql", ("q_proj", "v_proj"), 4, {}), ("chat", ("q_proj", "v_proj"), 8, {})))
    report = fastlora.patch(m)
    assert report.counts() == {"qkv": 2}
    for model in (m, ref):
        torch.manual_seed(7)
        model.add_adapter("new", lora(["k_proj", "o_proj", "gate_proj", "up_proj"], r=2, alpha=4))
    names = ["new", "sql", "__base__", "chat"]
    assert_same_as(m, ref, names)
    report = fastlora.patch(m)
    assert report.adapters == ["chat", "new", "sql"]
    assert report.counts() == {"qkv": 2, "gate_up": 2, "linear": 2}
    assert calls["gate_up"] == 2 and calls["qkv"] == 2
    assert not torch.allclose(logits(m, names)[0], logits(m, ["__base__"] * 4)[0], atol=1e-4)


def test_added_adapter_with_live_dropout_stays_on_peft(calls):
    # add_adapter leaves its new modules in training mode: a dropout > 0 is then live in PEFT's
    # mixed path too (random), so fastlora must not serve those layers until model.eval()
    m, ref = pair()
    fastlora.patch(m)
    for model in (m, ref):
        torch.manual_seed(7)
        model.add_adapter("noisy", lora(["q_proj", "v_proj"], r=2, alpha=4, lora_dropout=0.5))
    logits(m, ["noisy", "sql", "__base__", "sql"])
    assert calls["qkv"] == 0 and calls["gate_up"] == 2
    for model in (m, ref):
        model.eval()
    calls.clear()
    assert_same_as(m, ref, ["noisy", "sql", "__base__", "chat"])
    assert calls["qkv"] == 2


def test_delete_adapter_after_patch():
    m, ref = pair()
    fastlora.patch(m)
    assert_same_as(m, ref)
    for model in (m, ref):
        model.delete_adapter("chat")
    assert_same_as(m, ref, ["sql", "__base__", "sql", "sql"])
    assert fastlora.patch(m).adapters == ["sql"]
    with pytest.raises(ValueError, match="non-existing adapter.*chat"):
        logits(m, NAMES)
    # added again under its name, on other modules: a new adapter, recognised by its config object
    for model in (m, ref):
        torch.manual_seed(3)
        model.add_adapter("chat", LoraConfig(r=2, target_modules=["o_proj", "down_proj"], init_lora_weights=False))
    assert_same_as(m, ref)


def test_load_adapter_from_disk_after_patch(tmp_path, calls):
    torch.manual_seed(11)
    donor = get_peft_model(tiny_llama(), lora(["q_proj", "k_proj", "down_proj"], r=3, alpha=5)).eval()
    donor.save_pretrained(tmp_path)
    m, ref = pair()
    fastlora.patch(m)
    logits(m, NAMES)
    for model in (m, ref):
        model.load_adapter(str(tmp_path), adapter_name="loaded")
    calls.clear()
    names = ["loaded", "sql", "loaded", "__base__"]
    assert_same_as(m, ref, names)
    assert calls["qkv"] == 2
    assert "loaded" in fastlora.patch(m).adapters
    donor_out = logits(donor, ["default"] * 4)
    torch.testing.assert_close(logits(m, names)[[0, 2]], donor_out[[0, 2]], **TOL)


def _q_layer(model, i=0):
    return model.base_model.model.model.layers[i].self_attn.q_proj


def test_weights_changed_in_place_are_used():
    m, ref = pair()
    fastlora.patch(m)
    before = logits(m, NAMES)
    for model in (m, ref):
        with torch.no_grad():
            _q_layer(model).lora_B["sql"].weight.add_(0.25)
            model.base_model.model.model.layers[1].mlp.gate_proj.lora_A["sql"].weight.mul_(2.0)
    after = logits(m, NAMES)
    assert not torch.allclose(after, before, atol=1e-4)
    torch.testing.assert_close(after, logits(ref, NAMES), **TOL)
    for model in (m, ref):  # a changed scaling (PEFT's set_scale) too
        _q_layer(model, 1).set_scale("chat", 3.0)
    assert_same_as(m, ref)


@pytest.mark.parametrize("which", ["lora_A", "lora_B"])
def test_weights_changed_through_dot_data_are_used(which):
    # `.data` edits bump no version counter: the values are copied at every call boundary instead
    m, ref = pair()
    fastlora.patch(m)
    logits(m, NAMES)
    for model in (m, ref):
        getattr(_q_layer(model), which)["sql"].weight.data.add_(0.25)
    assert_same_as(m, ref)


def test_parameters_are_checked_for_the_adapters_a_call_uses():
    """A call checks the parameters of its own adapters only (the cost follows the adapters used,
    not the number loaded); an adapter re-pointed while unused is caught by the first call that
    uses it."""
    m, ref = pair()
    fastlora.patch(m)
    state = get_state(m)
    logits(m, ["sql", "__base__", "sql", "sql"])
    generation = state.generation
    for model in (m, ref):
        w = _q_layer(model).lora_B["chat"].weight
        w.data = w.data + 0.5  # new storage: the stacks' copy of it is stale
    assert_same_as(m, ref, ["sql", "__base__", "sql", "sql"])  # chat unused: not checked, not rebuilt
    assert state.generation == generation
    assert_same_as(m, ref, ["chat", "sql", "__base__", "chat"])  # chat used: noticed, rebuilt
    assert state.generation > generation


def test_a_parameter_replaced_in_its_module_is_noticed():
    """The per-call check compares storage addresses every call and module / parameter identity
    only after a registration (PyTorch's global hooks). A new Parameter sharing the old one's
    storage, whose storage is then swapped, keeps the old object's address: only the identity
    check, armed by the registration, notices it."""
    m, ref = pair()
    fastlora.patch(m)
    state = get_state(m)
    names = ["chat", "sql", "__base__", "chat"]
    assert_same_as(m, ref, names)
    generation = state.generation
    for model in (m, ref):
        module = _q_layer(model).lora_B["chat"]
        module.weight = torch.nn.Parameter(module.weight.detach())  # same storage, a new object
        module.weight.data = module.weight.data + 0.5  # then new storage, for the new object only
    assert_same_as(m, ref, names)
    assert state.generation > generation
    generation = state.generation
    for model in (m, ref):  # a new module in the ModuleDict
        layer = _q_layer(model)
        new = torch.nn.Linear(layer.lora_A["sql"].weight.shape[0], layer.lora_B["sql"].weight.shape[0], bias=False)
        with torch.no_grad():
            new.weight.copy_(layer.lora_B["sql"].weight * -2.0)
        layer.lora_B["sql"] = new
    assert_same_as(m, ref, names)
    assert state.generation > generation


def _names_seen_by(layer):
    """Wrap a patched layer's forward: records (PEFT hooks on it, adapter_names it got) per call."""
    seen, patched = [], layer.forward

    def spy(*args, **kwargs):
        seen.append((len(layer._forward_pre_hooks), kwargs.get("adapter_names")))
        return patched(*args, **kwargs)

    layer.forward = spy
    return seen, patched


def test_fastlora_takes_adapter_names_in_place_of_peft_hooks():
    # PEFT walks every module and hooks every LoRA layer at each call: a cost that grows with the
    # adapters loaded. Where every such layer is fastlora's, fastlora holds the call's names instead.
    m, ref = pair()
    fastlora.patch(m)
    layer = _q_layer(m)
    seen, patched = _names_seen_by(layer)
    assert_same_as(m, ref)
    kw = dict(input_ids=IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(m.generate(**kw, adapter_names=NAMES), ref.generate(**kw, adapter_names=NAMES))
    layer.forward = patched
    assert seen and all(hooks == 0 and names is None for hooks, names in seen), seen
    assert_raises_like_peft(m, ref, ["sql", "nope", "__base__", "sql"], "non-existing adapter")


def test_modules_to_save_keep_peft_hooks():
    # a wrapper fastlora does not serve needs the names from PEFT's hooks: PEFT's way, unchanged
    def build_mts():
        torch.manual_seed(7)
        model = get_peft_model(tiny_llama(), lora(("q_proj", "v_proj"), modules_to_save=["lm_head"]), adapter_name="sql")
        model.add_adapter("chat", lora(("q_proj", "o_proj"), modules_to_save=["lm_head"]))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "modules_to_save" in name:
                    p.add_(torch.randn_like(p) * 0.1)
        return model.eval()

    m, ref = build_mts(), build_mts()
    fastlora.patch(m)
    layer = _q_layer(m)
    seen, patched = _names_seen_by(layer)
    assert_same_as(m, ref)
    layer.forward = patched
    assert seen and all(hooks == 1 and names == NAMES for hooks, names in seen), seen


# ---- unpatch ----------------------------------------------------------------------------------
def _files(root):
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), root)] = f.read()
    return out


def test_unpatch_round_trip(tmp_path):
    m, ref = pair()
    params = dict(m.named_parameters())
    inner_hooks = len(m.base_model.model._forward_pre_hooks)
    fastlora.patch(m)
    logits(m, NAMES)
    fastlora.unpatch(m)
    fastlora.unpatch(m)  # a no-op the second time
    assert get_state(m) is None and instance_forwards(m) == []
    assert len(m.base_model.model._forward_pre_hooks) == inner_hooks
    after = dict(m.named_parameters())
    assert after.keys() == params.keys() and all(after[k] is params[k] for k in params)
    assert_same_as(m, ref)
    torch.testing.assert_close(logits(m), logits(ref), **TOL)
    sd, sd_ref = m.state_dict(), ref.state_dict()
    assert list(sd) == list(sd_ref)
    for k in sd:
        assert torch.equal(sd[k], sd_ref[k]), k
    # no fused tensor left: every parameter owns exactly its own storage again
    ptrs = set()
    for name, p in m.named_parameters():
        storage = p.untyped_storage()
        assert storage.nbytes() == p.numel() * p.element_size(), name
        assert storage.data_ptr() not in ptrs, f"{name} shares storage"
        ptrs.add(storage.data_ptr())
    m.save_pretrained(tmp_path / "patched")
    ref.save_pretrained(tmp_path / "ref")
    got, want = _files(tmp_path / "patched"), _files(tmp_path / "ref")
    assert sorted(got) == sorted(want) and "sql/adapter_model.safetensors" in got
    assert got == want


def test_save_pretrained_while_patched(tmp_path):
    m, ref = pair()
    fastlora.patch(m)
    logits(m, NAMES)
    m.save_pretrained(tmp_path / "patched")
    ref.save_pretrained(tmp_path / "ref")
    assert _files(tmp_path / "patched") == _files(tmp_path / "ref")


def test_forgotten_no_grad_is_served_by_peft_and_warned_once(calls, caplog):
    m, ref = pair()
    fastlora.patch(m)
    with caplog.at_level("WARNING", logger="peft_fastlora"):
        for _ in range(2):
            got = m(input_ids=IDS, attention_mask=MASK, adapter_names=NAMES).logits  # no torch.no_grad()
    torch.testing.assert_close(got, logits(ref, NAMES), **TOL)
    assert sum(calls.values()) == 0  # PEFT's path served it
    warned = [r.getMessage() for r in caplog.records if "gradients enabled" in r.getMessage()]
    assert len(warned) == 1 and "torch.no_grad() or torch.inference_mode()" in warned[0]


def test_a_2d_input_of_another_batch_keeps_peft_length_error():
    """Rows x tokens flattened are served only in a layout an earlier layer of the forward
    established; a 2-D batch of another size handed to a LoRA layer directly keeps PEFT's error."""
    m = build()
    fastlora.patch(m)
    layer = m.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad(), pytest.raises(ValueError, match="Length of `adapter_names`"):
        layer(torch.randn(4, 64), adapter_names=["sql", "chat"])


def test_forgotten_no_grad_with_plain_fused_siblings(calls):
    """Adapters on q_proj alone: k_proj and v_proj join its fused group without LoRA. PEFT's path
    (gradients enabled) hands the call's adapter names to the LoRA layer, not to its plain siblings."""
    adapters = (("sql", ("q_proj",), 4, {}), ("chat", ("q_proj",), 8, {}))
    m, ref = pair(adapters=adapters)
    fastlora.patch(m)
    got = m(input_ids=IDS, attention_mask=MASK, adapter_names=NAMES).logits  # no torch.no_grad()
    torch.testing.assert_close(got, logits(ref, NAMES), **TOL)
    assert sum(calls.values()) == 0


@pytest.mark.parametrize("variant", ["velora_config", "monteclora_config"])
def test_other_lora_variants_fall_back_naming_the_variant(variant, calls):
    """An adapter of a LoRA variant fastlora does not compute (PEFT's own variant class on the
    layer), beside a plain one: batches that use it take PEFT's path and equal PEFT's mixed batch,
    the report names the variant; batches without it stay on fastlora's path."""
    import dataclasses

    if variant not in {f.name for f in dataclasses.fields(LoraConfig)}:
        pytest.skip(f"this PEFT has no {variant}")
    kinds = (("sql", ALL, 4, {}), ("var", ("q_proj", "v_proj"), 4, {variant: {}}))
    m, ref = pair(adapters=kinds)
    report = fastlora.patch(m)
    assert {a for _, a, _ in report.adapter_fallbacks} == {"var"}, report
    assert all(r.startswith("LoRA variant ") for _, _, r in report.adapter_fallbacks), report
    assert len(report.adapter_fallbacks) == 4  # q_proj and v_proj of both layers
    assert_same_as(m, ref, ["var", "sql", "__base__", "var"])
    calls.clear()
    assert_same_as(m, ref, ["sql", "__base__", "sql", "sql"])
    assert calls["qkv"] == 2 and calls["gate_up"] == 2


def test_bias_and_dora_adapters_fall_back_where_layers_are_sharded(monkeypatch, calls):
    """Under tensor parallelism a B bias would be added by every rank and DoRA's norms need the
    whole weight: such adapters are left to PEFT's path, with the reason (the sharding probe faked
    here; the two-process TP tests cover plain LoRA). Batches without them stay on fastlora's path."""
    import peft_fastlora.compat.adapters as adapters

    monkeypatch.setattr(adapters, "tp_style", lambda layer, declared=None: "colwise")
    kinds = (("sql", ALL, 4, {}), ("biased", ("q_proj", "down_proj"), 4, {"lora_bias": True}),
             ("dora", ("v_proj",), 4, {"use_dora": True}))
    m, ref = pair(adapters=kinds)
    report = fastlora.patch(m)
    reasons = {(a, r) for _, a, r in report.adapter_fallbacks}
    assert reasons == {("biased", "lora_bias under tensor parallelism"), ("dora", "DoRA under tensor parallelism")}
    assert_same_as(m, ref, ["biased", "sql", "__base__", "biased"])  # PEFT's path where "biased" is used
    calls.clear()
    assert_same_as(m, ref, ["sql", "__base__", "sql", "sql"])
    assert calls["qkv"] == 2 and calls["gate_up"] == 2
