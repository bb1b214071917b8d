"""The flat per-step checks of ``lora.watch``: what an engine step learns without walking the
layers in Python."""

from torch import nn

from peft_fastlora.compat.peft import registration_epoch
from peft_fastlora.lora.watch import StructureWatch


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
