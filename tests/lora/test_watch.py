"""The flat per-step checks of ``lora.watch``: what an engine step learns without walking the
layers in Python."""

import copy
import pickle

import pytest
import torch
from torch import nn

import peft_fastlora as fastlora
from peft_fastlora.compat.adapters import CountedScaling, scaling_epoch
from peft_fastlora.compat.peft import registration_epoch
from peft_fastlora.lora.watch import StructureWatch

from _patch_models import build, logits

NAMES = ["sql", "chat", "__base__", "sql"]


def _layer():
    a = nn.ModuleDict({"x": nn.Linear(2, 2), "y": nn.Linear(2, 2)})
    b = nn.ModuleDict({"x": nn.Linear(2, 2), "y": nn.Linear(2, 2)})
    scaling = {"x": 1.0, "y": 0.5}
    return a, b, scaling, (a._modules, tuple(a._modules), b._modules, tuple(b._modules), scaling, dict(scaling), {})


def test_structure_watch_passes_while_nothing_moved():
    _, _, _, entry = _layer()
    watch = StructureWatch("stacks", [], [entry])
    epoch = registration_epoch()
    assert watch.unchanged("stacks", epoch) and watch.unchanged("stacks", epoch)
    assert not watch.unchanged("other stacks", epoch)


def test_an_adapter_leaving_without_a_registration_is_seen_by_the_sizes():
    a, _, _, entry = _layer()
    watch = StructureWatch("stacks", [], [entry])
    epoch = registration_epoch()
    assert watch.unchanged("stacks", epoch)  # the keys compared once at this epoch
    del a["y"]  # (a deletion registers nothing)
    assert registration_epoch() == epoch
    assert not watch.unchanged("stacks", epoch)


def test_an_adapter_swapped_for_another_at_the_same_size_is_seen_through_the_epoch():
    _, b, _, entry = _layer()
    watch = StructureWatch("stacks", [], [entry])
    assert watch.unchanged("stacks", registration_epoch())
    del b["y"]
    b["z"] = nn.Linear(2, 2)  # as many adapters as before, another name: a registration
    assert not watch.unchanged("stacks", registration_epoch())


def test_a_scaling_changed_in_place_is_seen():
    _, _, scaling, entry = _layer()
    watch = StructureWatch("stacks", [], [entry])
    epoch = registration_epoch()
    assert watch.unchanged("stacks", epoch)
    scaling["x"] = 2.0  # PEFT's set_scale writes the dict
    assert not watch.unchanged("stacks", epoch)


def _counted_layer():
    a, b, scaling, entry = _layer()
    scaling = CountedScaling(scaling)
    return scaling, (*entry[:4], scaling, dict(scaling), {})


@pytest.mark.parametrize("change", ["set", "multiply", "delete", "pop", "update", "setdefault", "or", "popitem",
                                    "clear"])
def test_every_in_place_change_of_a_counted_scaling_is_seen(change):
    """Over counted scalings the watch compares one counter, not the dicts: every way a dict
    changes in place must move it."""
    scaling, entry = _counted_layer()
    watch = StructureWatch("stacks", [], [entry])
    epoch = registration_epoch()
    assert watch.unchanged("stacks", epoch) and watch.unchanged("stacks", epoch)
    {"set": lambda: scaling.__setitem__("x", 2.0), "multiply": lambda: scaling.__setitem__("x", scaling["x"] * 3),
     "delete": lambda: scaling.__delitem__("y"), "pop": lambda: scaling.pop("y"),
     "update": lambda: scaling.update(x=4.0), "setdefault": lambda: scaling.setdefault("z", 1.0),
     "or": lambda: scaling.__ior__({"x": 5.0}), "popitem": scaling.popitem, "clear": scaling.clear}[change]()
    assert not watch.unchanged("stacks", epoch)
    assert StructureWatch("stacks", [], [entry]).unchanged("stacks", epoch)  # a new watch starts from here


def test_a_counted_scaling_copies_and_pickles_as_a_plain_dict():
    scaling, _ = _counted_layer()
    for copied in (copy.copy(scaling), copy.deepcopy(scaling), pickle.loads(pickle.dumps(scaling))):
        assert type(copied) is dict and copied == {"x": 1.0, "y": 0.5}


def test_patch_counts_the_layers_scalings_and_unpatch_gives_plain_dicts_back():
    """PEFT's ``set_scale`` on a patched model goes through the counted dict (and its result equals
    PEFT's); unpatched, every layer has a plain dict with the same items."""
    m, ref = build(), build()
    layers = [mod for mod in m.modules() if isinstance(mod.__dict__.get("scaling"), dict)]
    before = [dict(mod.scaling) for mod in layers]
    fastlora.patch(m)
    assert layers and all(type(mod.scaling) is CountedScaling for mod in layers)
    epoch = scaling_epoch()
    for model in (m, ref):
        next(mod for mod in model.modules() if isinstance(mod.__dict__.get("scaling"), dict)
             and "chat" in mod.scaling).set_scale("chat", 3.0)
    assert scaling_epoch() > epoch
    torch.testing.assert_close(logits(m, NAMES), logits(ref, NAMES), atol=1e-5, rtol=1e-5)
    fastlora.unpatch(m)
    assert all(type(mod.scaling) is dict for mod in layers)
    changed = [i for i, (mod, was) in enumerate(zip(layers, before)) if dict(mod.scaling) != was]
    assert len(changed) == 1
