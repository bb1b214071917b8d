"""``fastlora.register_adapter``: adapters served by name from saved PEFT folders or state dicts,
held in CPU memory, with no PEFT module built for them (CPU).

The oracle: the same folder loaded into PEFT (``load_adapter``) on an identical model, served by
PEFT's own mixed batch. Every bad input raises an error naming the problem and leaves the model
serving exactly as before.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file

import peft_fastlora as fastlora
from peft_fastlora import get_state

from _continuous import cb_config, greedy_config, peft_alone, requires_cb
from _patch_models import ALL, VOCAB, build, logits, tiny_llama

TOL = dict(atol=1e-5, rtol=1e-5)
PEFT_ADAPTERS = (("sql", ALL + ["embed_tokens"], 4, {}), ("chat", ("q_proj", "v_proj"), 8, {}))


def _ids(rows, seed):
    return torch.randint(3, VOCAB, (rows, 5), generator=torch.Generator().manual_seed(seed))


def _save(folder, targets, r, seed, **kw):
    """A LoRA adapter of random weights saved by PEFT's ``save_pretrained`` into ``folder``."""
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=3 * r, target_modules=list(targets), init_lora_weights=False, **kw)
    model = get_peft_model(tiny_llama(), cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n or "lora_embedding_B" in n:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(seed + len(n)))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "ql": _save(str(root / "ql"), ("q_proj", "v_proj", "down_proj"), 16, seed=1),
        "emb": _save(str(root / "emb"), ("embed_tokens", "o_proj"), 2, seed=2),
        "rs": _save(str(root / "rs"), ("gate_proj", "up_proj", "k_proj"), 6, seed=3, use_rslora=True),
        "wide": _save(str(root / "wide"), ALL, 32, seed=4),  # a larger rank than the PEFT adapters'
    }


def _pair(folders, names, **patch_kw):
    """(patched model with ``names`` registered, PEFT reference with them loaded)."""
    m, ref = build(adapters=PEFT_ADAPTERS), build(adapters=PEFT_ADAPTERS)
    fastlora.patch(m, **patch_kw)
    for name in names:
        fastlora.register_adapter(m, name, folders[name])
        ref.load_adapter(folders[name], adapter_name=name)
    ref.eval()
    return m, ref


def _same(m, ref, names, seed=0):
    ids = _ids(len(names), seed)
    torch.testing.assert_close(logits(m, names, ids), logits(ref, names, ids), **TOL)


def test_registered_folders_equal_the_same_folders_loaded_into_peft(folders):
    m, ref = _pair(folders, ["ql", "emb", "rs", "wide"])
    state = get_state(m)
    assert set(state.registry.names) == {"sql", "chat", "ql", "emb", "rs", "wide"}
    assert "ql" not in m.peft_config and not any(".ql." in n for n, _ in m.named_parameters())  # no PEFT module
    assert "4 registered in CPU memory" in str(state.report)
    _same(m, ref, ["ql", "sql", "__base__", "emb", "rs", "wide", "chat", "ql"])
    for names in (["wide"] * 3, ["emb", "__base__"], ["rs", "chat"]):
        _same(m, ref, names, seed=len(names))
    ids = _ids(3, 9)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0,
              adapter_names=["emb", "ql", "__base__"])
    with torch.no_grad():
        assert torch.equal(m.generate(input_ids=ids, **kw), ref.generate(input_ids=ids, **kw))


def test_a_state_dict_with_its_config(folders):
    m, ref = build(adapters=PEFT_ADAPTERS), build(adapters=PEFT_ADAPTERS)
    fastlora.patch(m)
    source = build(adapters=(("x", ("q_proj", "up_proj"), 4, {}),))
    sd = get_peft_model_state_dict(source, adapter_name="x")
    fastlora.register_adapter(m, "x", state_dict=sd, config=source.peft_config["x"])
    ref.add_adapter("x", source.peft_config["x"])
    ref.load_state_dict({k.replace(".weight", ".x.weight"): v for k, v in sd.items()}, strict=False)
    _same(m, ref, ["x", "sql", "__base__", "x"])


@pytest.fixture(params=["direct", "staged"])
def host_copies(request, monkeypatch):
    """Loads as on the CPU (one copy per view) or as on CUDA (``_helpers.stage_host_copies``)."""
    from _helpers import STAGED_ON_CPU, stage_host_copies

    staged = stage_host_copies(monkeypatch) if request.param == "staged" else []
    yield dict(tuning=STAGED_ON_CPU) if request.param == "staged" else {}
    assert bool(staged) == (request.param == "staged"), "the staged path did not run"
    if staged:  # registered adapters' buffers are queued before the pools place them
        assert "prestage" in staged, staged


def test_more_registered_adapters_than_gpu_slots(folders, host_copies):
    m, ref = _pair(folders, ["ql", "emb", "rs", "wide"], max_loras_per_batch=2, **host_copies)
    state = get_state(m)
    assert " in slots (2 for 6 adapters" in str(state.report)  # on the CPU: not "GPU slots"
    rng = random.Random(3)
    names_all = ["sql", "chat", "ql", "emb", "rs", "wide"]
    for call in range(16):
        used = rng.sample(names_all, rng.randint(1, 2))
        _same(m, ref, [rng.choice(used + ["__base__"]) for _ in range(rng.randint(1, 5))], seed=call)
    assert state.registry.stats["evictions"] > 0


def test_blocks_moved_by_compaction_are_copied_again_from_the_cpu_store(folders, tmp_path, monkeypatch, host_copies):
    """Registered adapters are copied into their slot once, not at every call: when compaction
    slides a resident block to make room, its weights must move with it (on the device)."""
    from peft_fastlora.lora import arena as arena_module

    folders = dict(folders, r8=_save(str(tmp_path / "r8"), ("q_proj", "v_proj"), 8, seed=5),
                   r24=_save(str(tmp_path / "r24"), ("q_proj", "v_proj"), 24, seed=6))
    registered = ["ql", "emb", "rs", "wide", "r8", "r24"]
    m, ref = _pair(folders, registered, max_loras_per_batch=2, **host_copies)
    moves, alloc = [], arena_module.RowArena.alloc

    def counted(self, slot, rows):
        moved = alloc(self, slot, rows)
        moves.extend(moved)
        return moved

    monkeypatch.setattr(arena_module.RowArena, "alloc", counted)
    from test_gpu_slots import _check_pool_invariants

    rng = random.Random(11)
    for call in range(40):
        used = rng.sample(registered, 2)
        _same(m, ref, used + [rng.choice(used + ["__base__"])], seed=call)
        _check_pool_invariants(get_state(m))
    assert moves, "no compaction happened: the test exercised nothing"


def test_unregister(folders):
    """Unregistered, an adapter is refused by name, and no pool keeps its host weights (runs,
    sources or view pairs of a slot it held): its CPU memory can go."""
    m, ref = _pair(folders, ["ql"])
    _same(m, ref, ["ql", "sql"])  # in a slot: its runs made
    state = get_state(m)
    a = next(iter(state.stored["ql"].modules.values()))[0]
    storage = a.untyped_storage().data_ptr()

    def held():
        tensors = [t for site in state.sites for pool in [site.pool]
                   for entries in pool._sources.values() for _, ta, tb, *_ in entries for t in (ta, tb)]
        tensors += [r.src for site in state.sites for runs in site.pool._runs.values() for r in runs]
        tensors += [src for site in state.sites for pairs in site.pool._fixed.values() for _, src in pairs]
        return [t for t in tensors if t.untyped_storage().data_ptr() == storage]

    assert held()
    fastlora.unregister_adapter(m, "ql")
    assert not held() and "ql" not in state.stored
    with pytest.raises(ValueError, match="non-existing adapter.*ql"):
        logits(m, ["ql", "sql"], _ids(2, 0))
    _same(m, ref, ["sql", "chat"])
    with pytest.raises(ValueError, match="no registered adapter named 'ql'"):
        fastlora.unregister_adapter(m, "ql")


def _edited(folders, tmp_path, name, config=None, weights=None):
    """A copy of a saved folder with its config and / or weights edited."""
    src, dst = folders[name], str(tmp_path / f"bad_{name}")
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "adapter_config.json")) as f:
        cfg = json.load(f)
    from safetensors.torch import load_file

    sd = load_file(os.path.join(src, "adapter_model.safetensors"))
    if config:
        cfg.update(config)
    if weights:
        sd = weights(sd)
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(sd, os.path.join(dst, "adapter_model.safetensors"))
    return dst


def _first(sd, suffix):
    return next(k for k in sorted(sd) if k.endswith(suffix))


BAD = {
    "dora without magnitudes": (dict(config={"use_dora": True}), "has no lora_magnitude_vector .its config has use_dora"),
    "lora_bias without biases": (dict(config={"lora_bias": True}), "has no lora_B.bias .its config has lora_bias"),
    "dora with lora_bias": (dict(config={"use_dora": True, "lora_bias": True}), "lora_bias=True is not supported for DoRA"),
    "a bias of the wrong width": (dict(config={"lora_bias": True}, weights=lambda sd: {
        **sd, **{k.replace("lora_B.weight", "lora_B.bias"): torch.zeros(3) for k in sd if k.endswith("lora_B.weight")}}),
        r"has a bias of \(3,\) torch.float32; its base layer takes \(\d+,\)"),
    "a magnitude without dora": (dict(weights=lambda sd: {**sd, _first(sd, "lora_A.weight").replace(
        "lora_A.weight", "lora_magnitude_vector"): torch.ones(32)}), "unexpected key .*lora_magnitude_vector"),
    "rank_pattern": (dict(config={"rank_pattern": {"q_proj": 4}}), "rank_pattern is not supported"),
    # LoRA variants found through PEFT's own tags on LoraConfig's fields, not a list of ours
    "kasa": (dict(config={"kasa_config": {}}), "the LoRA variant kasa_config is not supported"),
    "bdlora": (dict(config={"use_bdlora": {}}), "the LoRA variant use_bdlora is not supported"),
    "velora": (dict(config={"velora_config": {}}), "the LoRA variant velora_config is not supported"),
    "mica": (dict(config={"init_lora_weights": "mica"}), "the LoRA variant init_lora_weights='mica' is not supported"),
    "ia3": (dict(config={"peft_type": "IA3"}), "peft_type 'IA3'.*LoRA adapters only"),
    "extra key": (dict(weights=lambda sd: {**sd, "base_model.model.model.norm.weight": torch.ones(64)}),
                  "unexpected key 'base_model.model.model.norm.weight'"),
    "missing B": (dict(weights=lambda sd: {k: v for k, v in sd.items() if k != _first(sd, "lora_B.weight")}),
                  "has no lora_B weight"),
    "wrong shape": (dict(weights=lambda sd: {**sd, _first(sd, "lora_A.weight"): torch.zeros(16, 7)}),
                    r"down_proj. has A \(16, 7\) and B \(32, 16\); its base layer takes A \(r, 48\)"),
    "not served": (dict(weights=lambda sd: {**sd, "base_model.model.lm_head.lora_A.weight": torch.zeros(16, 64),
                                            "base_model.model.lm_head.lora_B.weight": torch.zeros(VOCAB, 16)}),
                   "targets 'base_model.model.lm_head', which is not a LoRA layer fastlora serves"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_folder_is_refused_naming_it_and_nothing_changes(folders, tmp_path, case):
    edit, match = BAD[case]
    bad = _edited(folders, tmp_path, "ql", **edit)
    m, ref = _pair(folders, ["emb"])
    state = get_state(m)
    before = (list(state.registry.names), str(state.report), state.generation)
    with pytest.raises(ValueError, match=match) as e:
        fastlora.register_adapter(m, "bad", bad)
    assert "bad_ql" in str(e.value)  # the file or folder is named
    assert (list(state.registry.names), str(state.report), state.generation) == before
    _same(m, ref, ["emb", "sql", "__base__"])


def test_bad_calls_are_refused(folders, tmp_path):
    m, ref = _pair(folders, ["ql"])
    with pytest.raises(ValueError, match="already exists"):
        fastlora.register_adapter(m, "sql", folders["emb"])
    with pytest.raises(ValueError, match="already exists"):
        fastlora.register_adapter(m, "ql", folders["emb"])
    with pytest.raises(ValueError, match="invalid adapter name '__base__'"):
        fastlora.register_adapter(m, "__base__", folders["emb"])
    with pytest.raises(ValueError, match="either a folder path or a state_dict"):
        fastlora.register_adapter(m, "z")
    with pytest.raises(ValueError, match="needs its LoraConfig"):
        fastlora.register_adapter(m, "z", state_dict={})
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        fastlora.register_adapter(m, "z", str(tmp_path / "missing"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="has no adapter_config.json"):
        fastlora.register_adapter(m, "z", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="not patched"):
        fastlora.register_adapter(build(adapters=PEFT_ADAPTERS), "z", folders["emb"])
    _same(m, ref, ["ql", "sql", "__base__"])


@requires_cb
def test_continuous_batching_serves_registered_adapters(folders):
    m, ref = _pair(folders, ["ql", "emb"])
    prompts = [[int(t) for t in _ids(1, s)[0][: 3 + s]] for s in range(4)]
    names = ["ql", "emb", "sql", "__base__"]
    out = m.generate_batch(prompts, generation_config=greedy_config(4), continuous_batching_config=cb_config(),
                           adapter_names=names)
    got = [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]
    for tokens, p, n in zip(got, prompts, names):
        assert tokens == peft_alone(ref, p, n, 4), n


def test_many_at_once_all_or_none(folders, tmp_path):
    m, ref = build(adapters=PEFT_ADAPTERS), build(adapters=PEFT_ADAPTERS)
    fastlora.patch(m)
    bad = _edited(folders, tmp_path, "rs", config={"use_dora": True})
    with pytest.raises(ValueError, match="bad_rs.*use_dora"):
        fastlora.register_adapters(m, {"ql": folders["ql"], "rs": bad})
    assert get_state(m).stored == {} and get_state(m).registry.names == ["chat", "sql"]
    fastlora.register_adapters(m, {"ql": folders["ql"], "emb": folders["emb"]})
    for name in ("ql", "emb"):
        ref.load_adapter(folders[name], adapter_name=name)
    ref.eval()
    _same(m, ref, ["emb", "ql", "chat", "__base__"])


def test_registered_adapters_outlive_the_peft_adapters_that_made_their_layers(folders):
    m, ref = _pair(folders, ["ql", "emb"])
    for model in (m, ref):
        model.set_adapter("chat")
        model.delete_adapter("sql")  # PEFT keeps the (now empty) LoRA layers: the sites stay
    _same(m, ref, ["emb", "ql", "chat", "__base__"])


def test_a_registered_adapter_whose_layers_go_is_dropped(folders, caplog, monkeypatch):
    m, ref = _pair(folders, ["ql", "emb"])
    state = get_state(m)
    layers = state.served_layers()
    monkeypatch.setattr(type(state), "served_layers", lambda self: {k: v for k, v in layers.items() if "o_proj" not in k})
    with caplog.at_level("WARNING", logger="peft_fastlora"):
        state.rescan()  # as after a PEFT change that took the o_proj LoRA layers away
    assert "registered adapter 'emb' dropped" in caplog.text and "'ql'" not in caplog.text
    assert set(state.registry.names) == {"chat", "sql", "ql"} and set(state.stored) == {"ql"}
    _same(m, ref, ["ql", "sql", "__base__"])
    with pytest.raises(ValueError, match="non-existing adapter.*emb"):
        logits(m, ["emb"], _ids(1, 0))


def test_a_batch_of_more_distinct_registered_adapters_than_the_first_build_had(folders):
    """The default limit of distinct adapters per batch follows the adapters registered later
    (else a patch with few PEFT adapters, then 512 registered, would refuse a batch of 17 distinct
    ones with 'exceed max_loras_per_batch=16')."""
    m = build(adapters=PEFT_ADAPTERS[1:])
    ref = build(adapters=PEFT_ADAPTERS[1:])
    fastlora.patch(m)
    source = build(adapters=(("x", ("q_proj", "v_proj"), 4, {}),))
    sd, cfg = get_peft_model_state_dict(source, adapter_name="x"), source.peft_config["x"]
    fastlora.register_adapters(m, {f"x{i}": ({k: v * (1 + i / 10) for k, v in sd.items()}, cfg) for i in range(20)})
    for i in range(20):
        ref.add_adapter(f"x{i}", cfg)
        ref.load_state_dict({k.replace(".weight", f".x{i}.weight"): v * (1 + i / 10) for k, v in sd.items()},
                            strict=False)
    _same(m, ref, [f"x{i}" for i in range(20)] + ["chat", "__base__"])


@requires_cb
def test_registered_and_unregistered_while_a_manager_serves(folders):
    """A server adds a tenant while serving, then removes one: the new name is served at once,
    requests of the removed one fail one by one naming it, the others go on."""
    import time

    from _continuous import collect

    m, ref = _pair(folders, ["ql"])
    ref.load_adapter(folders["rs"], adapter_name="rs")
    ref.eval()
    prompts = [[int(t) for t in _ids(1, s)[0][: 3 + s % 3]] for s in range(5)]
    manager = m.init_continuous_batching(generation_config=greedy_config(300),
                                         continuous_batching_config=cb_config(max_requests_per_batch=1))
    manager.start()
    try:
        first = manager.add_request(prompts[0], adapter_name="sql", max_new_tokens=6)
        fastlora.register_adapter(m, "rs", folders["rs"])  # while the engine serves
        added = manager.add_request(prompts[1], adapter_name="rs", max_new_tokens=6)
        done = collect(manager, [first, added])
        doomed = manager.add_request(prompts[2], adapter_name="ql", streaming=True)
        partial = manager.get_result(request_id=doomed, timeout=30)
        assert partial is not None and not partial.is_finished()  # decoding now
        others = [manager.add_request(prompts[3], adapter_name="chat", max_new_tokens=6),
                  manager.add_request(prompts[4], adapter_name="rs", max_new_tokens=6)]
        fastlora.unregister_adapter(m, "ql")
        finished, deadline = {}, time.monotonic() + 60
        while len(finished) < 3:
            assert time.monotonic() < deadline, f"timed out; finished: {sorted(finished)}"
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                finished[r.request_id] = r
        assert manager.is_running()
    finally:
        manager.stop(block=True)
    assert done[first] == peft_alone(ref, prompts[0], "sql", 6)
    assert done[added] == peft_alone(ref, prompts[1], "rs", 6)
    assert finished[doomed].error is not None and "'ql'" in finished[doomed].error
    for rid, p, n in zip(others, prompts[3:], ["chat", "rs"]):
        assert finished[rid].error is None, finished[rid].error
        assert list(finished[rid].generated_tokens) == peft_alone(ref, p, n, 6), n


def test_other_saved_forms_and_unreadable_files(folders, tmp_path):
    m, ref = _pair(folders, [])
    torch.manual_seed(5)
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["v_proj"], init_lora_weights=False))
    model.save_pretrained(str(tmp_path / "bin"), safe_serialization=False)  # adapter_model.bin
    fastlora.register_adapter(m, "bin", str(tmp_path / "bin"))
    ref.load_adapter(str(tmp_path / "bin"), adapter_name="bin")
    ref.eval()
    _same(m, ref, ["bin", "sql", "__base__"])
    broken = _edited(folders, tmp_path, "emb")
    with open(os.path.join(broken, "adapter_model.safetensors"), "wb") as f:
        f.write(b"not a safetensors file")
    with pytest.raises(ValueError, match="adapter_model.safetensors: cannot be read"):
        fastlora.register_adapter(m, "broken", broken)
    with open(os.path.join(broken, "adapter_config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="adapter_config.json: not valid JSON"):
        fastlora.register_adapter(m, "broken", broken)
    os.remove(os.path.join(broken, "adapter_model.safetensors"))
    with open(os.path.join(broken, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}, f)
    with pytest.raises(FileNotFoundError, match="has none of adapter_model.safetensors, adapter_model.bin"):
        fastlora.register_adapter(m, "broken", broken)
    _same(m, ref, ["bin", "chat"])


def test_from_folders_serves_a_folder_of_adapters(folders, tmp_path):
    import shutil

    from peft import PeftModel

    root = tmp_path / "all"
    for name in ("ql", "rs", "wide", "emb"):
        shutil.copytree(folders[name], root / name)
    (root / "notes").mkdir()  # a sub-folder without an adapter is not one
    m = fastlora.from_folders(tiny_llama(), str(root), max_loras_per_batch=2)
    state = get_state(m)
    assert sorted(state.stored) == ["emb", "ql", "rs", "wide"] and list(m.peft_config) == ["fastlora_layers"]
    # the layer-making adapter of zeros is served (it changes nothing) but not reported as the user's
    assert state.report.adapters == ["emb", "ql", "rs", "wide"] and "for 4 adapters" in str(state.report)
    ref = PeftModel.from_pretrained(tiny_llama(), folders["ql"], adapter_name="ql")
    for name in ("rs", "wide", "emb"):
        ref.load_adapter(folders[name], adapter_name=name)
    ref.eval()
    for names in (["ql", "rs", "__base__"], ["wide", "emb"], ["emb", "ql", "emb"], ["rs"]):
        _same(m, ref, names, seed=len(names))
    with pytest.raises(ValueError, match="has no sub-folder with an adapter_config.json"):
        fastlora.from_folders(tiny_llama(), str(root / "notes"))
    pattern = _edited(folders, tmp_path, "ql", config={"target_modules": ".*proj"})
    with pytest.raises(ValueError, match="targets modules by the pattern"):
        fastlora.from_folders(tiny_llama(), {"p": pattern})


def test_from_folders_report_counts_the_users_adapters_in_slots(folders):
    """On the CPU the report speaks of slots, not GPU slots, and counts the registered adapters
    without the layer-making adapter of zeros; building the PEFT model prints no deprecation of
    transformers' that PEFT's wrapping triggers."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = fastlora.from_folders(tiny_llama(), {n: folders[n] for n in ("ql", "rs", "wide")}, max_loras_per_batch=2)
    text = str(get_state(m).report)
    assert " in slots (2 for 3 adapters, loaded on demand)" in text and "GPU slots" not in text, text
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]


def test_a_rebuild_that_fails_while_registering_leaves_the_model_serving(folders, monkeypatch):
    from peft_fastlora.lora import pool as pool_module

    m, ref = _pair(folders, ["ql"])
    real, failures = pool_module.SitePool.rebuild, [0]

    def failing(self, *a, **k):
        if failures[0] == 0:
            failures[0] += 1
            raise RuntimeError("injected: out of memory for the stacks")
        return real(self, *a, **k)

    monkeypatch.setattr(pool_module.SitePool, "rebuild", failing)
    with pytest.raises(RuntimeError, match="injected"):
        fastlora.register_adapter(m, "wide", folders["wide"])
    assert sorted(get_state(m).stored) == ["ql"]
    _same(m, ref, ["ql", "sql", "__base__"])


def test_a_forward_that_cannot_take_fastloras_path_is_refused_for_registered_adapters(folders):
    m, ref = _pair(folders, ["ql"])
    ids = _ids(2, 0)
    with pytest.raises(ValueError, match=r"registered adapter\(s\) ql .*gradients are enabled"):
        m(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=["ql", "sql"])
    m.train()  # training mode: PEFT's own error, as for any adapter
    with pytest.raises(ValueError, match="training mode"):
        m(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=["ql", "sql"])
    m.eval()
    _same(m, ref, ["ql", "sql"])
    with torch.enable_grad():  # PEFT's adapters keep PEFT's (slow) path with gradients
        out = m(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=["chat", "sql"]).logits
        want = ref(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=["chat", "sql"]).logits
    torch.testing.assert_close(out, want, **TOL)


def _peft_rows(ref, names, ids):
    """PEFT row by row with each row's adapter active (PEFT refuses DoRA in ``adapter_names``)."""
    out = []
    with torch.no_grad():
        for i, name in enumerate(names):
            ref.set_adapter(name)
            out.append(ref(input_ids=ids[i:i + 1], attention_mask=torch.ones_like(ids[i:i + 1])).logits)
    return torch.cat(out)


@pytest.mark.parametrize("kind", ["lora_bias", "dora"])
def test_registered_bias_and_dora_folders_equal_peft(kind, tmp_path):
    """Folders saved by PEFT with a bias on B or DoRA, registered by name: served through the slots
    beside PEFT's own adapters, equal to the same folders loaded into PEFT (row by row)."""
    config = {"lora_bias": True} if kind == "lora_bias" else {"use_dora": True}
    kinds = {"k1": _save(str(tmp_path / "k1"), ("q_proj", "v_proj", "down_proj"), 4, seed=5, **config),
             "k2": _save(str(tmp_path / "k2"), ALL, 8, seed=6, **config)}
    if kind == "dora":  # magnitudes off their initial norms, as trained ones are
        from safetensors.torch import load_file

        for folder in kinds.values():
            path = os.path.join(folder, "adapter_model.safetensors")
            sd = load_file(path)
            save_file({k: v * 1.3 if k.endswith("lora_magnitude_vector") else v for k, v in sd.items()}, path)
    m, ref = build(adapters=PEFT_ADAPTERS), build(adapters=PEFT_ADAPTERS)
    fastlora.patch(m, max_loras_per_batch=3)
    for name, folder in kinds.items():
        fastlora.register_adapter(m, name, folder)
        ref.load_adapter(folder, adapter_name=name)
    ref.eval()
    for seed, names in enumerate((["k1", "sql", "k2", "k1"], ["chat", "k2", "sql", "k2"], ["k1", "k2", "chat", "k1"])):
        ids = _ids(len(names), seed)
        torch.testing.assert_close(logits(m, names, ids), _peft_rows(ref, names, ids), **TOL)
    assert get_state(m).report.adapter_fallbacks == []
