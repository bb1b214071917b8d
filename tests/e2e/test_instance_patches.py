"""``InstancePatches``: the one way fastlora changes a user's objects, and puts them back."""

import torch

from peft_fastlora.instance_methods import InstancePatches


class Thing:
    def greet(self):
        return "class"


def test_set_bind_wrap_then_restore_in_reverse_order():
    thing, patches = Thing(), InstancePatches()
    thing.mine = "own value"
    patches.set(thing, "mine", "patched")
    patches.bind(thing, "greet", lambda self: f"bound to {type(self).__name__}")
    assert thing.greet() == "bound to Thing"
    original = patches.wrap(thing, "greet", lambda inner: lambda self: inner() + ", wrapped")
    assert original() == "bound to Thing"  # the method it replaced, the first patch
    assert thing.greet() == "bound to Thing, wrapped" and thing.greet.__name__ == "<lambda>"
    assert len(patches) == 3
    patches.restore()
    assert len(patches) == 0
    assert thing.mine == "own value" and "greet" not in thing.__dict__ and thing.greet() == "class"
    patches.restore()  # nothing left: a no-op


def test_a_module_forward_comes_back_to_its_class():
    layer, patches = torch.nn.Linear(3, 2), InstancePatches()
    x = torch.randn(4, 3)
    want = layer(x)
    patches.bind(layer, "forward", lambda module, inp: torch.zeros(inp.shape[0], module.out_features))
    assert torch.equal(layer(x), torch.zeros(4, 2))
    patches.restore()
    assert "forward" not in layer.__dict__ and torch.equal(layer(x), want)


def test_an_instance_attribute_set_by_someone_else_is_put_back_as_it_was():
    layer, patches = torch.nn.Linear(3, 2), InstancePatches()

    def theirs(inp):
        return inp

    layer.forward = theirs  # another library's instance forward, before fastlora
    patches.bind(layer, "forward", lambda module, inp: inp * 2)
    patches.restore()
    assert layer.__dict__["forward"] is theirs
