"""What a call tells the LoRA layers (``call_context.CallContext``): one value per call, entered at
its boundary, seen by every layer of the call, per thread, and gone when the call returns."""

from __future__ import annotations

import threading

import pytest
import torch

import peft_fastlora as fastlora
from peft_fastlora.call_context import OUTSIDE, CallScope, ForwardBoundary

from _models import tiny_peft_llama


def _record_contexts(model):
    """The ``CallContext`` every LoRA layer's forward saw, in order (hooks on each q_proj)."""
    state, seen = fastlora.get_state(model), []
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append(state.context()))
             for name, m in model.named_modules() if name.endswith("q_proj")]
    return seen, hooks


def test_scopes_nest_and_restore_even_on_errors():
    scope = CallScope()
    outer = OUTSIDE.replace(checked=True, fold=True)
    with scope.entered(outer):
        with pytest.raises(RuntimeError):
            with scope.entered(outer.replace(names=("a",))):
                assert scope.current().names == ("a",) and scope.current().fold
                raise RuntimeError("inside")
        assert scope.current() is outer
    assert scope.current() is OUTSIDE


def test_each_thread_has_its_own_context():
    scope, seen, inside = CallScope(), [], threading.Event()
    release = threading.Event()

    def other():
        with scope.entered(OUTSIDE.replace(names=("b",))):
            inside.set()
            release.wait(10)
            seen.append(scope.current().names)

    with scope.entered(OUTSIDE.replace(names=("a",))):
        thread = threading.Thread(target=other)
        thread.start()
        assert inside.wait(10)
        assert scope.current().names == ("a",)  # the other thread's scope is not this one's
        release.set()
        thread.join(10)
    assert seen == [("b",)]


def test_a_boundary_runs_once_and_a_failed_one_is_not_retried():
    calls = []

    def begin(names):
        calls.append(list(names))
        raise RuntimeError("slots")

    boundary = ForwardBoundary(begin)
    with pytest.raises(RuntimeError):
        boundary.run(["a"])
    boundary.run(["a"])  # the next layer of the same forward: no second attempt
    assert calls == [["a"]] and boundary.fold is False


def test_generate_call_is_one_checked_context_then_gone():
    model = tiny_peft_llama()
    ids = torch.randint(3, 128, (3, 5))
    names = ["a", "b", "__base__"]
    fastlora.patch(model)
    try:
        seen, hooks = _record_contexts(model)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=names,
                           max_new_tokens=3, do_sample=False, pad_token_id=0)
        for h in hooks:
            h.remove()
        assert seen and all(c.checked and c.boundary is None for c in seen)
        assert all(c.names == tuple(names) for c in seen)  # fastlora holds the names for the call
        assert len({id(c) for c in seen}) == 1  # one value for the whole call
        assert fastlora.get_state(model).context() is OUTSIDE
    finally:
        fastlora.unpatch(model)


def test_a_forward_outside_a_call_carries_its_boundary():
    model = tiny_peft_llama()
    ids = torch.randint(3, 128, (2, 4))
    fastlora.patch(model)
    try:
        seen, hooks = _record_contexts(model)
        with torch.no_grad():
            model(input_ids=ids, adapter_names=["a", "b"])
            model(input_ids=ids, adapter_names=["b", "b"])
        for h in hooks:
            h.remove()
        first, second = seen[: len(seen) // 2], seen[len(seen) // 2:]
        for forward in (first, second):
            assert all(not c.checked and c.boundary is forward[0].boundary for c in forward)
            assert forward[-1].boundary.fold is not None  # the first layer ran the boundary
        assert first[0].boundary is not second[0].boundary  # each forward its own
    finally:
        fastlora.unpatch(model)
