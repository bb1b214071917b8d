"""``compat.peft.active_adapter_names``: the adapters a forward without names applies, whichever
way the model names them."""

from __future__ import annotations

import pytest

from peft_fastlora.compat.peft import active_adapter_names


class _Property:
    def __init__(self, value):
        self.active_adapters = value


class _Method:
    def __init__(self, value=None, loaded=True):
        self._value, self._loaded = value, loaded

    def active_adapters(self):
        if not self._loaded:
            raise ValueError("No adapter loaded. Please load an adapter first.")
        return self._value


@pytest.mark.parametrize("model, want", [
    (_Property(["a", "b"]), ["a", "b"]),  # PeftModel: a property
    (_Property("a"), ["a"]),
    (_Property(None), []),
    (object(), []),  # no adapters at all
    (_Method(["a"]), ["a"]),  # transformers' PEFT integration: a method
    (_Method(loaded=False), []),  # ... which raises where it loaded none
], ids=["property", "property_str", "property_none", "absent", "method", "method_none_loaded"])
def test_active_adapter_names(model, want):
    assert active_adapter_names(model) == want


def test_config_variants_reads_peft_tags():
    """Plain LoRA, DoRA and lora_bias ask for no other variant; the tagged fields and a tagged
    ``init_lora_weights`` value are named."""
    from peft import LoraConfig

    from peft_fastlora.compat.peft import config_variants

    assert config_variants(LoraConfig(r=4)) == []
    assert config_variants(LoraConfig(r=4, use_dora=True)) == []
    assert config_variants(LoraConfig(r=4, lora_bias=True)) == []
    assert config_variants(LoraConfig(r=4, init_lora_weights="gaussian")) == []
    assert config_variants(LoraConfig(r=4, init_lora_weights="mica")) == ["init_lora_weights='mica'"]
    assert config_variants(LoraConfig(r=4, alora_invocation_tokens=[3, 4])) == ["alora_invocation_tokens"]
    assert config_variants(LoraConfig(r=4, kasa_config={}, use_bdlora={})) == ["use_bdlora", "kasa_config"]
    assert config_variants(object()) == []  # not a dataclass: nothing to read
