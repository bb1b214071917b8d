"""Patching a model and registering adapters strand no GPU memory. Each (re-)fuse of a group drops
the previous copy of its weights; handed back to the driver at once (``fusion.release_cached``),
no smaller buffer allocated next (another group's, the stacks) splits its segment, so what the
continuous-batching engine finds free is all the model does not hold."""

import gc

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.utils import get_peft_model_state_dict

import peft_fastlora as fastlora
from _models import tiny_llama

pytestmark = pytest.mark.gpu
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _stranded() -> int:
    """Bytes the allocator holds unallocated in large-block segments it cannot give back (the
    fused copies are large blocks; the small-block pool's 2 MB segments are left out). Garbage
    first: tensors an earlier test in this process left to the collector would otherwise be freed
    in the middle of this one and count as split."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_stats()["inactive_split_bytes.large_pool.current"]


def test_patch_and_registration_strand_no_memory():
    base = tiny_llama(0, vocab_size=512, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=2).to("cuda", torch.bfloat16).eval()
    config = LoraConfig(r=16, lora_alpha=32, target_modules=ALL, init_lora_weights=False)
    model = get_peft_model(base, config, adapter_name="seed", autocast_adapter_dtype=False).eval()
    seed = {k: v.detach().cpu() for k, v in get_peft_model_state_dict(model, adapter_name="seed").items()}
    before = _stranded()
    fastlora.patch(model)
    try:
        gen = torch.Generator().manual_seed(0)
        fastlora.register_adapters(model, {f"r{i}": ({k: v + 0.01 * torch.randn(v.shape, generator=gen).to(v.dtype)
                                                      for k, v in seed.items()}, config) for i in range(16)})
        groups = fastlora.get_state(model).groups
        fused = sum(g.ext.numel() * g.ext.element_size() for g in groups if g.ext is not None)
        assert fused > 0
        stranded = _stranded() - before
        assert stranded < 0.05 * fused, (stranded, fused)
    finally:
        fastlora.unpatch(model)
