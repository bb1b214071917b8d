"""Fused q/k/v and gate/up base GEMMs, and the adapter pool that stacks A and B per site.

Checks that fusion is invisible (same logits and greedy tokens as PEFT, same parameters, same
storage bytes), that it really is one GEMM per group (counted at the aten level), and that the
stacks hold exactly PEFT's weights, ranks and scalings for adapters of different ranks and targets.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import peft_fastlora as fastlora
from peft_fastlora.backend.segmented import SegmentedLoRABackend
from peft_fastlora.lora.fusion import FusedGroup, IntactWatch
from peft_fastlora.lora.sites import FusedSite
from peft_fastlora import get_state
from peft_fastlora.lora.pool import AdapterRegistry

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

from _helpers import count_backend_calls  # noqa: E402
from _models import llama_config  # noqa: E402

VOCAB = 100  # not 2 * INTER: the GEMM count tells widths apart
HIDDEN, INTER, HEADS, KV_HEADS = 32, 48, 4, 2
HEAD_DIM = HIDDEN // HEADS
Q_OUT, KV_OUT = HIDDEN, KV_HEADS * HEAD_DIM  # 32, 16: qkv is 64 wide, gate_up 96
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = torch.randint(3, VOCAB, (4, 6), generator=torch.Generator().manual_seed(2))
MASK = torch.ones_like(IDS)
NAMES = ["sql", "chat", "__base__", "mlp"]
TOL = dict(atol=1e-5, rtol=1e-5)

# three adapters: different ranks, targets, alphas, rslora and a per-layer rank/alpha pattern
ADAPTERS = (
    ("sql", dict(r=4, lora_alpha=8, target_modules=ALL)),
    ("chat", dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], use_rslora=True)),
    ("mlp", dict(r=2, lora_alpha=3, target_modules=["gate_proj", "k_proj"],
                 rank_pattern={"layers.1.mlp.gate_proj": 6}, alpha_pattern={"layers.1.mlp.gate_proj": 5})),
)


def tiny(arch="llama", seed=0):
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    if arch == "qwen2":  # q/k/v carry biases; HF initialises them to zero, which would test nothing
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
        with torch.no_grad():
            for mod in model.modules():
                if isinstance(mod, torch.nn.Linear) and mod.bias is not None:
                    mod.bias.normal_(0.0, 0.5)
        return model
    return transformers.LlamaForCausalLM(llama_config(**common)).eval()


def build(arch="llama", adapters=ADAPTERS):
    model = None
    for i, (name, kw) in enumerate(adapters):
        torch.manual_seed(200 + i)
        cfg = LoraConfig(init_lora_weights=False, **kw)
        if model is None:
            model = get_peft_model(tiny(arch), cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
    return model.eval()


def logits(model, names=NAMES, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=names).logits


def greedy(model, names=NAMES, n=4):
    with torch.no_grad():
        return model.generate(input_ids=IDS, attention_mask=MASK, adapter_names=names, max_new_tokens=n,
                              do_sample=False)


def storage_bytes(model) -> int:
    seen = {}
    for p in model.parameters():
        s = p.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def layers_of(model):
    return model.base_model.model.model.layers


@pytest.fixture
def calls(monkeypatch):
    return count_backend_calls(monkeypatch, SegmentedLoRABackend, ("run_packed_lora",))


@pytest.fixture(scope="module")
def reference():
    """PEFT's own logits and greedy tokens for the default model (computed once)."""
    ref = build()
    return logits(ref), greedy(ref)


# ---- fused and unfused equal PEFT --------------------------------------------------------------
@pytest.mark.parametrize("fuse", [True, False])
def test_fused_and_unfused_match_peft(fuse, reference, calls):
    ref_logits, ref_tokens = reference
    m = build()
    report = fastlora.patch(m, fuse=fuse)
    if fuse:
        assert report.counts() == {"qkv": 2, "gate_up": 2, "linear": 4}
    else:
        assert report.counts() == {"linear": 14}
    torch.testing.assert_close(logits(m), ref_logits, **TOL)
    assert torch.equal(greedy(m), ref_tokens)
    assert calls["run_packed_lora"] > 0


class MatmulWidths(TorchDispatchMode):
    """Records (rows, output width) of every aten matmul-like op."""

    OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default, torch.ops.aten.linear.default, torch.ops.aten.matmul.default}

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.OPS:
            self.shapes.append((out.shape[-2], out.shape[-1]))
        return out


def test_fused_sites_keep_no_tensor_alive_after_their_siblings_ran():
    """A fused group's stash (its input and the siblings' outputs) is dropped once every sibling
    has taken its output: a prefill's inputs must not stay pinned, every layer's, for the rest of
    the forward and past it (the 8B soak's large prefills ran out of memory that way)."""
    import weakref

    m = build()
    fastlora.patch(m)
    state = get_state(m)
    seen = []
    for site in state.sites:
        if isinstance(site, FusedSite):
            site.group.members[0].register_forward_pre_hook(
                lambda mod, args: seen.append(weakref.ref(args[0])))
    logits(m)
    fused = [s for s in state.sites if isinstance(s, FusedSite)]
    assert len(fused) == 4 and len(seen) == 4
    assert all(s._stash is None for s in fused)
    assert all(ref() is None for ref in seen)  # the inputs themselves were freed


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_one_gemm_per_fused_group(arch):
    m = build(arch)
    fastlora.patch(m)
    tokens = IDS.numel()

    def base_gemm_widths(model):
        mode = MatmulWidths()
        with mode:
            logits(model)
        # LoRA products run on the rows of one adapter only (never all: row 2 is __base__)
        return Counter(w for rows, w in mode.shapes if rows == tokens)

    fused = base_gemm_widths(m)
    # per layer: one qkv (64), one gate_up (96), o_proj and down_proj (32); plus the lm_head
    assert fused == Counter({Q_OUT + 2 * KV_OUT: 2, 2 * INTER: 2, HIDDEN: 4, VOCAB: 1}), fused
    fastlora.unpatch(m)
    unfused = base_gemm_widths(m)
    assert unfused == Counter({HIDDEN: 2 + 2 + 2, KV_OUT: 4, INTER: 4, VOCAB: 1}), unfused


def test_storage_bytes_and_parameters_unchanged():
    m, ref = build(), build()
    before = storage_bytes(m)
    params = dict(m.named_parameters())
    fastlora.patch(m)
    logits(m)
    assert storage_bytes(m) == before  # the fused tensor replaces the members' storage, no copy
    attn = layers_of(m)[0].self_attn
    q, k, v = (getattr(attn, n).base_layer.weight for n in ("q_proj", "k_proj", "v_proj"))
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert q.untyped_storage().nbytes() == (Q_OUT + 2 * KV_OUT) * HIDDEN * 4
    assert all(p is params[n] for n, p in m.named_parameters())
    sd, sd_ref = m.state_dict(), ref.state_dict()
    assert list(sd) == list(sd_ref) and all(torch.equal(sd[k], sd_ref[k]) for k in sd)
    fastlora.unpatch(m)
    assert storage_bytes(m) == before
    assert q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()


def test_each_fuse_and_unfuse_hands_the_dropped_copy_back(monkeypatch):
    """A (re-)fuse gives the allocator's cache back once it has dropped the previous copy (on CUDA,
    so that smaller buffers cannot split its segment); never while the current stream captures."""
    import peft_fastlora.lora.fusion as fusion

    released = []
    monkeypatch.setattr(fusion, "release_cached", lambda device: released.append(torch.device(device).type))
    m = build()
    fastlora.patch(m)
    fused = len(released)
    assert fused >= len(get_state(m).groups) > 0 and set(released) == {"cpu"}
    fastlora.unpatch(m)
    assert len(released) > fused

    emptied = []
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    fusion.release_cached(torch.device("cpu"))
    fusion.release_cached(torch.device("cuda", 0))
    capturing[0] = True
    fusion.release_cached(torch.device("cuda", 0))
    assert emptied == [1]


# ---- the pool ------------------------------------------------------------------------------------
def test_mixed_targets_and_ranks_in_one_batch(calls):
    m, ref = build(), build()
    fastlora.patch(m)
    names = ["mlp", "chat", "__base__", "sql", "chat", "mlp"]
    ids = torch.cat([IDS, IDS[:2]])
    torch.testing.assert_close(logits(m, names, ids), logits(ref, names, ids), **TOL)
    assert calls["run_packed_lora"] == 8  # 2 layers x (qkv, gate_up, o, down): one call per site


def _site(state, kind, layer):
    return next(s for s in state.sites if s.kind == kind and f"layers.{layer}." in s.name)


@pytest.mark.parametrize("layer", [0, 1])
def test_pool_holds_peft_weights_ranks_and_scalings(layer):
    m = build()
    fastlora.patch(m)
    logits(m)
    state = get_state(m)
    slot = state.registry.slot
    assert state.registry.names == ["chat", "mlp", "sql"]
    blk = layers_of(m)[layer]
    for kind, parent, names in (("qkv", blk.self_attn, ("q_proj", "k_proj", "v_proj")),
                                ("gate_up", blk.mlp, ("gate_proj", "up_proj"))):
        site = _site(state, kind, layer)
        assert isinstance(site, FusedSite)
        pool = site.pool
        # packed: every adapter at its own rank, only for its modules
        blocks = [(j, int(pool.ranks[s, j])) for s in range(3) for j in range(len(names)) if int(pool.ranks[s, j])]
        assert pool.lora_a.shape == (sum(rows for _, rows in blocks), HIDDEN)
        assert pool.lora_b.shape == (sum(rows * (pool.offsets[j + 1] - pool.offsets[j]) for j, rows in blocks),)
        for j, mod_name in enumerate(names):
            mod = getattr(parent, mod_name)
            lo, hi = pool.offsets[j], pool.offsets[j + 1]
            for adapter in ("chat", "mlp", "sql"):
                s = slot[adapter]
                rank = int(pool.ranks[s, j])
                if adapter not in mod.lora_A:
                    assert rank == 0 and float(pool.scalings[s, j]) == 0.0
                    continue
                a, b = mod.lora_A[adapter].weight, mod.lora_B[adapter].weight
                assert rank == a.shape[0]
                assert float(pool.scalings[s, j]) == pytest.approx(mod.scaling[adapter])
                assert torch.equal(pool.packed_view_a(s, j, rank), a)
                assert torch.equal(pool.packed_view_b(s, j, rank), b)
                assert hi - lo == b.shape[0]
    # the rank/alpha pattern reached layer 1's gate_proj only
    gate = _site(state, "gate_up", layer).pool
    assert int(gate.ranks[slot["mlp"], 0]) == (6 if layer == 1 else 2)
    assert float(gate.scalings[slot["mlp"], 0]) == pytest.approx(5 / 6 if layer == 1 else 3 / 2)
    assert float(_site(state, "qkv", layer).pool.scalings[slot["chat"], 0]) == pytest.approx(16 / 8 ** 0.5)


def test_pool_stale_detection():
    m = build()
    fastlora.patch(m)
    logits(m)
    state = get_state(m)
    pool = _site(state, "qkv", 0).pool
    s = state.registry.slot["chat"]
    weight = layers_of(m)[0].self_attn.v_proj.lora_A["chat"].weight
    assert not pool.stale(state.registry, torch.float32)
    assert pool.stale(state.registry, torch.float16)  # another dtype asked for
    # new values, same tensor: not stale; the next call boundary copies them into the same stack
    with torch.no_grad():
        weight.mul_(1.5)
    assert not pool.stale(state.registry, torch.float32)
    old = pool.lora_a
    logits(m, ["chat", "sql", "__base__", "chat"])
    assert pool.lora_a is old and torch.equal(pool.packed_view_a(s, 2, 8), weight)
    # the parameter re-pointed at other storage: stale, and the next forward rebuilds
    weight.data = weight.data * 2.0
    assert pool.stale(state.registry, torch.float32)
    logits(m)
    assert pool.lora_a is not old and not pool.stale(state.registry, torch.float32)
    assert torch.equal(pool.packed_view_a(s, 2, 8), weight)


def test_registry_slots():
    reg = AdapterRegistry(["sql", "chat", "mlp"])
    assert reg.names == ["chat", "mlp", "sql"] and len(reg) == 3
    assert reg.slots_for(["sql", "__base__", "chat", "sql"]) == [2, -1, 0, 2]
    with pytest.raises(ValueError, match="Trying to infer with non-existing adapter\\(s\\): nope, zzz"):
        reg.slots_for(["zzz", "sql", "nope"])


# ---- fusion details ------------------------------------------------------------------------------
def test_qwen2_biases_fused(calls):
    m, ref = build("qwen2"), build("qwen2")
    report = fastlora.patch(m)
    assert report.counts()["qkv"] == 2
    group: FusedGroup = _site(get_state(m), "qkv", 0).group
    attn = layers_of(m)[0].self_attn
    biases = [getattr(attn, n).base_layer.bias for n in ("q_proj", "k_proj", "v_proj")]
    assert all(b is not None for b in biases) and group.bias is not None
    assert group.bias.shape == (Q_OUT + 2 * KV_OUT,)
    assert torch.equal(group.bias, torch.cat([b.detach() for b in biases]))
    assert all(b.untyped_storage().data_ptr() == group.bias.untyped_storage().data_ptr() for b in biases)
    assert group.bias.abs().sum() > 0
    torch.testing.assert_close(logits(m), logits(ref), **TOL)
    assert calls["qkv"] == 2
    assert torch.equal(greedy(m), greedy(ref))


def test_dtype_change_after_patch(calls):
    m, ref = build(), build()
    fastlora.patch(m)
    torch.testing.assert_close(logits(m), logits(ref), **TOL)
    state = get_state(m)
    for model in (m, ref):
        model.to(torch.float64)
    calls.clear()
    got = logits(m)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, logits(ref), atol=1e-10, rtol=1e-10)
    assert sum(calls.values()) == 0  # float64 is not a backend dtype: PEFT's path served it
    assert all(g.is_intact() and g.weight.dtype == torch.float64 for g in state.groups)  # fused again
    assert storage_bytes(m) == storage_bytes(ref)
    for model in (m, ref):
        model.to(torch.float32)
    torch.testing.assert_close(logits(m), logits(ref), **TOL)
    assert calls["qkv"] == 2  # back on the fast path
    assert all(g.is_intact() and g.weight.dtype == torch.float32 for g in state.groups)
    assert storage_bytes(m) == storage_bytes(ref)


def test_the_flat_intact_check_agrees_with_each_group_s():
    """``IntactWatch`` (each call's check of every fused group at once) sees a member moved off
    the fused tensor by ``.data`` or replaced by a new Parameter, and stops holding once a group
    is fused again."""
    m = build()
    fastlora.patch(m)
    groups = get_state(m).groups
    watch = IntactWatch(groups)
    assert watch.holds(groups) and watch.intact()
    q = layers_of(m)[1].self_attn.q_proj.base_layer
    q.weight.data = q.weight.data.clone()
    assert not watch.intact() and not all(g.is_intact() for g in groups)
    owner = next(g for g in groups if q in g.bases)
    owner.fuse()
    assert not watch.holds(groups)
    watch = IntactWatch(groups)
    assert watch.intact()
    up = layers_of(m)[0].mlp.up_proj.base_layer
    up.weight = torch.nn.Parameter(up.weight.detach().clone())
    assert not watch.intact()
    torch.testing.assert_close(logits(m), logits(build()), **TOL)  # re-fused by the next call's check
    assert all(g.is_intact() for g in groups)
    owner.unfuse()
    assert not IntactWatch(groups).intact()  # a group not fused: each group is asked
    torch.testing.assert_close(logits(m), logits(build()), **TOL)
    assert all(g.is_intact() for g in groups)


def test_the_flat_fold_check_agrees_with_each_pool_s():
    """``FoldWatch`` (each call's check of every site's fold at once) says a fold is lost exactly
    when a pool would: a folded group's member or a single folded layer moved off its fused tensor,
    or a pool rebuilt; the next call rebuilds what was lost and the watch holds again."""
    from peft_fastlora.lora.watch import FoldWatch

    m = build()
    fastlora.patch(m, fold_shrink=True)
    state = get_state(m)
    logits(m)
    pools = [site.pool for site in state.sites]
    assert sum(p.fold_attached for p in pools) >= 2  # a fused group's and a single layer's folds
    watch = FoldWatch(state.sites)
    assert watch.holds(state.sites) and watch.intact() and not any(p.fold_lost() for p in pools)
    for mod in (layers_of(m)[1].self_attn.k_proj.base_layer, layers_of(m)[0].self_attn.o_proj.base_layer):
        site = next(s for s in state.sites if mod in [b for b in (getattr(s.pool.fold, "bases", None) or ())])
        assert site.pool.fold_attached
        mod.weight.data = mod.weight.data.clone()
        assert not watch.intact() and site.pool.fold_lost()
        torch.testing.assert_close(logits(m), logits(build()), **TOL)  # rebuilt by the next call's check
        assert not site.pool.fold_lost() and not watch.intact()  # (the old watch: the arena it saw is gone)
        watch = FoldWatch(state.sites)
        assert watch.intact() and not any(s.pool.fold_lost() for s in state.sites)
    site = next(s for s in state.sites if s.pool.fold_attached)
    state._rebuild_pool(site, site.pool.lora_a.dtype)  # a rebuild replaces the arena it watched
    assert not watch.intact()
    assert FoldWatch(state.sites).intact()


def test_fusion_blocked_by_a_forward_hook():
    m, ref = build(), build()
    layers_of(m)[0].self_attn.k_proj.base_layer.register_forward_hook(lambda mod, args, out: None)
    report = fastlora.patch(m)
    assert report.fusion_blocked == [("base_model.model.model.layers.0.self_attn.qkv",
                                      "base layer has forward hooks (offloading or similar)")]
    assert "; 1 group not fused;" in str(report)
    assert report.counts() == {"qkv": 1, "gate_up": 2, "linear": 4 + 3}
    torch.testing.assert_close(logits(m), logits(ref), **TOL)


def _dispatched(offload=False, io_same_device=False):
    """``build()``'s model with accelerate's device_map hooks put on its base model first (as
    ``from_pretrained(..., device_map=...)`` then PEFT do): every layer's hook moves its inputs to
    the layer's device. ``offload`` / ``io_same_device``: hooks that do more than that."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module, attach_align_device_hook_on_blocks

    blocks = ["model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
    model = None
    for i, (name, kw) in enumerate(ADAPTERS):
        torch.manual_seed(200 + i)
        cfg = LoraConfig(init_lora_weights=False, **kw)
        if model is None:
            base = tiny()
            attach_align_device_hook_on_blocks(base, execution_device={b: "cpu" for b in blocks},
                                               offload={b: False for b in blocks})
            if offload or io_same_device:
                k_proj = base.model.layers[0].self_attn.k_proj
                add_hook_to_module(k_proj, AlignDevicesHook("cpu", offload=offload, io_same_device=io_same_device))
            model = get_peft_model(base, cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
    return model.eval()


def test_device_map_hooks_that_only_move_inputs_leave_fusion_and_fold(reference):
    ref_logits, ref_tokens = reference
    m = _dispatched()
    q_base = layers_of(m)[0].self_attn.q_proj.base_layer
    assert type(q_base._hf_hook).__name__ == "AlignDevicesHook" and "forward" in q_base.__dict__
    report = fastlora.patch(m, fold_shrink=True)
    assert report.fusion_blocked == [] and report.counts() == {"qkv": 2, "gate_up": 2, "linear": 4}, report
    # folded as without the hooks: the sites that fold only per call do so for their A rows' share
    assert report.shrink_folded == ("5 of 8 sites (and 3 more in calls whose adapters use at least 33% "
                                    "of their A rows)"), report.shrink_folded
    assert report.fold_refused == [], report.fold_refused
    torch.testing.assert_close(logits(m), ref_logits, **TOL)
    assert torch.equal(greedy(m), ref_tokens)
    fastlora.unpatch(m)
    assert type(q_base._hf_hook).__name__ == "AlignDevicesHook" and "forward" in q_base.__dict__
    torch.testing.assert_close(logits(m), ref_logits, **TOL)


@pytest.mark.parametrize("hook", ["offload", "io_same_device"])
def test_device_map_hooks_that_do_more_block_fusion(hook, reference):
    m = _dispatched(**{hook: True})
    report = fastlora.patch(m, fold_shrink=True)
    assert report.fusion_blocked == [("base_model.model.model.layers.0.self_attn.qkv",
                                      "base layer has forward hooks (offloading or similar)")], report
    if hook == "io_same_device":  # (an offloading hook without a weights map has no weights to serve)
        torch.testing.assert_close(logits(m), reference[0], **TOL)


def _mutations():
    def scaling(v):
        v.scaling["chat"] = v.scaling["chat"] * 2
    def new_parameter(v):
        v.lora_B["chat"].weight = torch.nn.Parameter(v.lora_B["chat"].weight.detach().clone())
    def new_module(v):
        old = v.lora_A["chat"]
        v.lora_A["chat"] = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    def new_storage(v):
        v.lora_A["chat"].weight.data = v.lora_A["chat"].weight.data.clone()
    def in_place(v):
        with torch.no_grad():
            v.lora_B["chat"].weight.add_(1.0)
    def through_data(v):
        v.lora_B["chat"].weight.data.add_(1.0)
    def deleted(v):
        del v.lora_B["chat"]
    return {f.__name__: f for f in (scaling, new_parameter, new_module, new_storage, in_place,
                                    through_data, deleted)}


VALUE_ONLY = ("in_place", "through_data")  # copied at the next call boundary, no rebuild


@pytest.mark.parametrize("mutation", sorted(_mutations()))
def test_pool_sees_every_kind_of_change(mutation):
    """The per-forward check (``SitePool._watch``) covers what the full signature covers: every
    change of structure; changed values are not a change of structure."""
    m = build()
    fastlora.patch(m)
    logits(m)
    state = get_state(m)
    pool = _site(state, "qkv", 0).pool
    assert pool._watched is not None and not pool.stale(state.registry, torch.float32)
    _mutations()[mutation](layers_of(m)[0].self_attn.v_proj)
    structural = mutation not in VALUE_ONLY
    assert pool.stale(state.registry, torch.float32) == structural
    assert (pool._current_signature(state.registry) != pool._signature) == structural  # the slow check agrees
