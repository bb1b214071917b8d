"""Patching a model and registering adapters strand no GPU memory. Each (re-)fuse of a group drops
the previous copy of its weights; left in the allocator's cache, that copy's segment is split by the
smaller buffers allocated next (another group's, the stacks) and what they leave free in it is
stranded: the continuous-batching engine, which sizes its KV cache from the driver's free memory,
loses it. ``fusion.release_cached`` hands each dropped copy back at once.

The mechanism needs weights the allocator gives segments of their own (blocks of 10 MB and more), as
an 8B model's are: the model here has the 8B layout's widths and two layers. Small models' weights
share 20 MB segments with everything else, and their split does not come from the fuses. The test
runs the same patch and registration with ``release_cached`` and with it disabled, each in a fresh
process (what an earlier test or run leaves in the allocator's segments changes what is split), and
requires the second to strand memory (the mechanism is reproduced) and the first far less."""

import gc
import json
import os
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.utils import get_peft_model_state_dict

import peft_fastlora as fastlora
from peft_fastlora.lora import fusion
from _models import tiny_llama

pytestmark = pytest.mark.gpu
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LARGE_SEGMENT = 10 * 2**20  # the caching allocator's threshold for a block's own segment


def _stranded() -> int:
    """Bytes the allocator holds unallocated in large-block segments it cannot give back. Garbage
    first: tensors an earlier test in this process left to the collector would otherwise be freed
    in the middle of this one and count as split."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_stats()["inactive_split_bytes.large_pool.current"]


def _patch_and_register() -> tuple:
    """(bytes stranded by patching and registering 16 adapters, bytes of the fused weights)."""
    base = tiny_llama(0, vocab_size=512, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                      num_attention_heads=32, num_key_value_heads=8).to("cuda", torch.bfloat16).eval()
    config = LoraConfig(r=16, lora_alpha=32, target_modules=ALL, init_lora_weights=False)
    model = get_peft_model(base, config, adapter_name="seed", autocast_adapter_dtype=False).eval()
    seed = {k: v.detach().cpu() for k, v in get_peft_model_state_dict(model, adapter_name="seed").items()}
    before = _stranded()
    fastlora.patch(model)
    try:
        gen = torch.Generator().manual_seed(0)
        fastlora.register_adapters(model, {f"r{i}": ({k: v + 0.01 * torch.randn(v.shape, generator=gen).to(v.dtype)
                                                      for k, v in seed.items()}, config) for i in range(16)})
        exts = [g.ext for g in fastlora.get_state(model).groups if g.ext is not None]
        assert exts and min(e.numel() * e.element_size() for e in exts) >= LARGE_SEGMENT
        return _stranded() - before, sum(e.numel() * e.element_size() for e in exts)
    finally:
        fastlora.unpatch(model)
        del model, base
        _stranded()


def _in_fresh_process(release: bool) -> tuple:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                                        os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, __file__, "release" if release else "keep"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return tuple(json.loads(done.stdout.strip().splitlines()[-1]))


def test_patch_and_registration_strand_no_memory():
    kept, fused = _in_fresh_process(release=False)
    released, _ = _in_fresh_process(release=True)
    # without the release the dropped copies' segments are split (on the 8B model: 2.5 GB of 15)
    assert kept >= LARGE_SEGMENT, (kept, fused)
    assert released < kept / 4, (released, kept, fused)


if __name__ == "__main__":
    if sys.argv[1] == "keep":
        fusion.release_cached = lambda device: None
    print(json.dumps(_patch_and_register()))
