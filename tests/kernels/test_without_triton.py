"""fastlora without Triton (a CPU install: CUDA builds of torch bring Triton, the CPU build does not).

A child process blocks the ``triton`` import as if the package were absent, then imports fastlora,
imports every kernel module, patches a PEFT model with the torch backend and checks its tokens
against PEFT's own mixed batch, through eager decode and through emulated decode graphs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import sys
    sys.modules["triton"] = None  # `import triton` now raises ModuleNotFoundError, as when not installed

    import importlib
    import pkgutil

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    import peft_fastlora as fastlora
    from peft_fastlora import kernel_support, ops

    assert kernel_support.triton_missing() == "the triton package is not installed"
    for module in pkgutil.iter_modules(ops.__path__):  # every kernel module imports ...
        importlib.import_module("peft_fastlora.ops." + module.name)
    assert not kernel_support.interpreting()
    try:  # ... and a launch says what is missing
        ops.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6)
    except ModuleNotFoundError as e:
        assert "needs the triton package" in str(e), e
    else:
        raise AssertionError("a kernel launched without Triton")
    assert fastlora.available_backends("cpu") == ["torch_native"]

    def build():
        torch.manual_seed(0)
        base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2, pad_token_id=0))
        model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                init_lora_weights=False), adapter_name="a")
        model.add_adapter("b", LoraConfig(r=2, target_modules=["k_proj", "gate_proj"], init_lora_weights=False))
        return model.eval()

    ids = torch.randint(1, 64, (4, 6), generator=torch.Generator().manual_seed(1))
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
              pad_token_id=0, adapter_names=["a", "b", "__base__", "a"])
    for graphs in (False, "emulate"):
        model = build()
        want = model.generate(**kw)
        try:
            fastlora.patch(model, backend="triton")
        except ValueError as e:
            assert "the triton package is not installed" in str(e), e
        else:
            raise AssertionError("the Triton backend was accepted without Triton")
        report = fastlora.patch(model, cuda_graphs=graphs)
        assert report.backend == "torch_native", report.backend
        assert "Triton kernels off: the triton package is not installed" in str(report), report
        assert torch.equal(model.generate(**kw), want), graphs
    assert sys.modules["triton"] is None
    print("ok without triton")
""")


def test_import_patch_and_generate_without_triton():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(os.path.dirname(__file__), "..", "..")] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok without triton" in done.stdout, done.stderr[-4000:]
