"""CPU parity of the patched models with PEFT's own mixed-adapter path.

The oracle is PEFT itself, on the same model object: the reference is computed before ``patch`` (or
after ``unpatch``), then the same inputs go through the patched model. Tiny random models of seven
architectures (Llama, Mistral, Qwen2 with q/k/v biases, Qwen3, Gemma 2 with embedding scale and
soft-capping, Phi-3 with pre-fused projections, GPT-2 with Conv1D) carry three adapters of different
ranks / alphas / targets (one rsLoRA, one on the token embedding); LoRA B is random, never zero.

Each parity test also checks that the fast path really ran: the backend's methods are counted, and
PEFT's own ``_mixed_batch_forward`` must not be called while the model is patched.

Tolerance (fp32 logits): atol 1e-5, rtol 1e-4. fastlora computes the same products as PEFT, only
grouped differently (one GEMM over concatenated q/k/v or gate/up weights, LoRA products accumulated
in fp32 and added once), so results may differ by a few ulp per layer; the observed worst case on these
models is ~1e-7 (Gemma 2; 0 elsewhere) on logits of magnitude < 1. Every adapter moves its rows'
logits by > 0.05 (asserted; 0.11 to 0.49 observed), so a delta that is lost, applied twice, scaled
wrongly or routed to the wrong row cannot pass, while reduction-order noise has two orders of
magnitude of room.
"""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from peft.tuners.lora import layer as lora_layer

import peft_fastlora as fastlora

from _helpers import SITE_KINDS
from _models import ARCHS, build_peft_lm, build_peft_mlp, left_padded_batch
from _models import PARITY_ATOL as ATOL, PARITY_LENGTHS as LENGTHS, PARITY_NAMES as NAMES, PARITY_RTOL as RTOL

MIN_ADAPTER_EFFECT = 0.05  # smallest max-abs change of an adapter row's logits versus the base model

# a second mix for the same shape as NAMES: the batch info must follow the names, not stay cached
NAMES_2 = ["a2", "a2", "__base__", "a0", "a1", "a0", "__base__", "a1"]

BACKEND_METHODS = ("run_packed_lora", "run_packed_embedding_lora", "run_lora_a_sgemm", "run_lora_b_sgemm",
                   "run_lora_a_embedding")
LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3", "gemma2"}


# ---- helpers ------------------------------------------------------------------------------------
@contextlib.contextmanager
def fast_path_probe(model):
    """Patch ``model``; yield (report, counts) where counts holds the backend calls made and
    ``"peft_mixed"``, the calls of PEFT's own mixed-batch forward (must stay 0). Unpatches after."""
    counts = collections.Counter()
    with pytest.MonkeyPatch.context() as mp:
        for cls in (lora_layer.Linear, lora_layer.Embedding):
            original = cls._mixed_batch_forward

            def counted(self, *args, _orig=original, **kwargs):
                counts["peft_mixed"] += 1
                return _orig(self, *args, **kwargs)

            mp.setattr(cls, "_mixed_batch_forward", counted)
        with _patched_with_counters(model, counts) as report:
            yield report, counts


@contextlib.contextmanager
def _patched_with_counters(model, counts):
    """``fastlora.patch`` with every backend method of ``BACKEND_METHODS`` counted into ``counts``."""
    report = fastlora.patch(model)
    try:
        backend = fastlora.get_state(model).backend
        assert backend.name == "torch_native"
        for name in BACKEND_METHODS:
            method = getattr(backend, name)

            def wrapper(*args, _m=method, _n=name, **kwargs):
                counts[_n] += 1
                if _n == "run_packed_lora":  # also by the kind of site served
                    counts[SITE_KINDS[args[1].stack_num]] += 1
                return _m(*args, **kwargs)

            setattr(backend, name, wrapper)  # instance attribute: dropped with the state on unpatch
        yield report
    finally:
        fastlora.unpatch(model)


def assert_fast_path(arch: str, report, counts: collections.Counter, forwards: int):
    """Every patched site made its backend call in each of ``forwards`` model forwards, and
    PEFT's own mixed-batch forward never ran."""
    assert counts["peft_mixed"] == 0, f"PEFT's mixed-batch forward ran {counts['peft_mixed']} times"
    sites = collections.Counter(report.counts())
    if arch in LLAMA_LIKE:
        assert sites["qkv"] == sites["gate_up"] == 2, sites  # fused in both layers
    else:
        assert sites["qkv"] == sites["gate_up"] == 0, sites
    expected = {
        # one packed call per linear site, fused or not
        "qkv": sites["qkv"],
        "gate_up": sites["gate_up"],
        "linear": sites["linear"],
        "run_packed_embedding_lora": sites["embedding"],
        # the contract's calls serve the interface, not the model path
        "run_lora_a_embedding": 0,
        "run_lora_b_sgemm": 0,
        "run_lora_a_sgemm": 0,
    }
    got = {k: counts[k] for k in expected}
    assert got == {k: v * forwards for k, v in expected.items()}, (got, expected, forwards)


def assert_logits_close(out: torch.Tensor, ref: torch.Tensor, names):
    """``torch.testing.assert_close`` with the worst row and its adapter in the message."""
    assert out.shape == ref.shape and out.dtype == ref.dtype == torch.float32
    per_row = (out - ref).abs().flatten(1).amax(1)
    worst = int(per_row.argmax())
    torch.testing.assert_close(
        out, ref, atol=ATOL, rtol=RTOL,
        msg=lambda m: f"{m}\nper-row max |diff|: {per_row.tolist()}; worst row {worst} "
                      f"(adapter {names[worst]!r})")


def no_instance_forwards(model) -> bool:
    return not any("forward" in m.__dict__ for m in model.modules())


# ---- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """These matrices are tiny (32 x 64): intra-op threads only add synchronisation, and on a busy
    2-core machine their spin-waits made the module 4x slower. Restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=list(ARCHS))
def lm(request):
    """(arch, PEFT model with adapters a0/a1/a2, left-padded batch); built once per arch."""
    arch = request.param
    model = build_peft_lm(arch)
    batch = left_padded_batch(LENGTHS, seed=1)
    assert (batch["attention_mask"][:, 0] == 0).any(), "the batch must have left padding"
    yield arch, model, batch
    fastlora.unpatch(model)


# ---- the patch itself ---------------------------------------------------------------------------
def test_report_sites(lm):
    arch, model, _ = lm
    n_lora = sum(isinstance(m, lora_layer.LoraLayer) for m in model.modules())
    report = fastlora.patch(model)
    try:
        assert report.backend == "torch_native"
        assert report.adapters == ["a0", "a1", "a2"]
        assert report.counts() == ARCHS[arch].expected_sites
        assert report.num_patched_layers == n_lora
        assert report.left_on_peft == [] and report.adapter_fallbacks == [] and report.fusion_blocked == []
    finally:
        fastlora.unpatch(model)
    assert no_instance_forwards(model)


# ---- logits -------------------------------------------------------------------------------------
@torch.no_grad()
def test_logits_parity(lm):
    arch, model, batch = lm
    ref = model(**batch, adapter_names=NAMES).logits
    ref_2 = model(**batch, adapter_names=NAMES_2).logits
    base = model(**batch, adapter_names=["__base__"] * len(NAMES)).logits
    assert torch.isfinite(ref).all() and torch.isfinite(ref_2).all()

    # sanity: each adapter row is far from the base model (otherwise parity proves nothing),
    # and "__base__" rows are exactly the base model
    effect = (ref - base).abs().flatten(1).amax(1)
    for i, name in enumerate(NAMES):
        if name == "__base__":
            assert effect[i] == 0, (i, effect[i])
        else:
            assert effect[i] > MIN_ADAPTER_EFFECT, f"adapter {name} barely changes row {i}: {effect[i]}"

    all_base = ["__base__"] * len(NAMES)
    with fast_path_probe(model) as (report, counts):
        out = model(**batch, adapter_names=NAMES).logits
        out_2 = model(**batch, adapter_names=NAMES_2).logits
        assert_fast_path(arch, report, counts, forwards=2)
        out_base = model(**batch, adapter_names=all_base).logits  # no adapter in the batch at all
    assert_logits_close(out, ref, NAMES)
    assert_logits_close(out_2, ref_2, NAMES_2)
    assert_logits_close(out_base, base, all_base)

    # unpatch gives PEFT back its exact model
    assert no_instance_forwards(model)
    assert torch.equal(model(**batch, adapter_names=NAMES).logits, ref)


# ---- generate -----------------------------------------------------------------------------------
GEN_MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=20, top_p=0.9, temperature=0.8),
    "beams": dict(do_sample=False, num_beams=2),
    # PEFT repeats names for beams but not for num_return_sequences: one name per returned row
    "return_seqs": dict(do_sample=True, top_k=30, top_p=0.95, num_return_sequences=2),
}


def _generate(model, batch, names, mode):
    kwargs = dict(GEN_MODES[mode])
    n_ret = kwargs.get("num_return_sequences", 1)
    names = [n for n in names for _ in range(n_ret)]
    torch.manual_seed(1234)
    return model.generate(**batch, adapter_names=names, max_new_tokens=8, **kwargs)


@pytest.mark.parametrize("mode", list(GEN_MODES))
@torch.no_grad()
def test_generate_parity(lm, mode):
    arch, model, batch = lm
    ref = _generate(model, batch, NAMES, mode)
    prompt_len = batch["input_ids"].shape[1]
    assert ref.shape[1] > prompt_len

    with fast_path_probe(model) as (_report, counts):
        out = _generate(model, batch, NAMES, mode)
        assert counts["peft_mixed"] == 0
        assert counts["run_packed_embedding_lora"] >= 2, counts  # prefill and at least one decode step
        if arch in LLAMA_LIKE:
            assert counts["qkv"] > 0 and counts["gate_up"] > 0, counts
    assert torch.equal(out, ref), f"{mode}: patched tokens\n{out[:, prompt_len:]}\nPEFT's\n{ref[:, prompt_len:]}"

    if mode == "greedy":
        # sanity: the adapters change what is generated
        base = _generate(model, batch, ["__base__"] * len(NAMES), mode)
        rows = [i for i, n in enumerate(NAMES) if n != "__base__"]
        assert not torch.equal(ref[rows, prompt_len:], base[rows, prompt_len:])


@torch.no_grad()
def test_return_sequences_needs_one_name_per_returned_row():
    """Names not repeated for num_return_sequences: the same ValueError on both paths."""
    model = build_peft_lm("llama")
    batch = left_padded_batch(LENGTHS, seed=1)
    kwargs = dict(do_sample=True, num_return_sequences=2, max_new_tokens=2)
    with pytest.raises(ValueError, match="Length of `adapter_names`") as peft_err:
        model.generate(**batch, adapter_names=NAMES, **kwargs)
    with fastlora.patched(model):
        with pytest.raises(ValueError, match="Length of `adapter_names`") as fast_err:
            model.generate(**batch, adapter_names=NAMES, **kwargs)
    assert str(fast_err.value) == str(peft_err.value)


# ---- the interleaved-batch oracle on a plain torch MLP ------------------------------------------
@pytest.mark.parametrize("shape", [(9, 24), (9, 5, 24)], ids=["2d", "3d"])
@torch.no_grad()
def test_interleaved_batch_oracle(shape):
    """Rows alternate __base__, adapter0, adapter1; each slice equals the single-adapter run."""
    model = build_peft_mlp()
    x = torch.randn(*shape)
    names = ["__base__", "adapter0", "adapter1"] * (shape[0] // 3)

    refs = {}
    with model.disable_adapter():
        refs["__base__"] = model(x[0::3])
    for k, name in enumerate(("adapter0", "adapter1")):
        model.set_adapter(name)
        refs[name] = model(x[k + 1::3])
    model.set_adapter("adapter0")
    # sanity: LoRA B is non-zero, each adapter moves its rows away from the base model
    for k, name in enumerate(("adapter0", "adapter1")):
        with model.disable_adapter():
            base_rows = model(x[k + 1::3])
        assert (refs[name] - base_rows).abs().max() > MIN_ADAPTER_EFFECT, name

    peft_mixed = model(x, adapter_names=names)
    with fast_path_probe(model) as (report, counts):
        assert report.counts() == {"linear": 2}
        out = model(x, adapter_names=names)
        assert counts["peft_mixed"] == 0
        assert counts["linear"] == 2 and counts["run_packed_lora"] == 2, counts
    for k, name in enumerate(("__base__", "adapter0", "adapter1")):
        torch.testing.assert_close(out[k::3], refs[name], atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(peft_mixed[k::3], refs[name], atol=ATOL, rtol=RTOL)
    assert no_instance_forwards(model)
