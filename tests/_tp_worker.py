"""One rank of ``test_tensor_parallel_cpu.py`` (run by torchrun, 2 processes, gloo on CPU).

A tiny Llama loaded with transformers' tensor parallelism, two LoRA adapters whose weights are
those of an unsharded reference (sharded the way PEFT sharded them), then ``fastlora.patch``:
every LoRA Linear runs on fastlora's path from this rank's shards (colwise: B's rows; rowwise: A's
columns, the delta added to the base layer's partial sums before its one all-reduce), graphs and
base-model kernels stay off, and mixed batches and ``generate`` give PEFT's results on the
unsharded model.
"""

import sys

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import AutoModelForCausalLM

import peft_fastlora as fastlora
from peft_fastlora import _compat

from _models import llama_config

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(path, tp: bool):
    kw = dict(tp_plan="auto") if tp else {}
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    torch.manual_seed(1)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False))
    torch.manual_seed(2)
    model.add_adapter("other", LoraConfig(r=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                          init_lora_weights=False))
    return model.eval()


def main(path):
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(llama_config(hidden_size=64, intermediate_size=128)).save_pretrained(path)
    dist.barrier()
    tp, ref = build(path, True), build(path, False)
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():  # the same adapter weights on both (PEFT's TP init draws other numbers)
        for name, p in tp.named_parameters():
            if "lora_" in name:
                src = ref_params[name].detach()
                if isinstance(p, DTensor):
                    p.to_local().copy_(distribute_tensor(src, p.device_mesh, p.placements, src_data_rank=None).to_local())
                else:
                    p.copy_(src)
    report = fastlora.patch(tp)
    # every LoRA Linear served from this rank's shards (unfused: fusion of sharded weights is not done)
    assert report.num_patched_layers == 14 and not report.left_on_peft, report
    state = fastlora.get_state(tp)
    styles = sorted({(s.name.rsplit(".", 1)[-1], s.tp) for s in state.sites})
    assert styles == [("down_proj", "rowwise"), ("gate_proj", "colwise"), ("k_proj", "colwise"),
                      ("o_proj", "rowwise"), ("q_proj", "colwise"), ("up_proj", "colwise"),
                      ("v_proj", "colwise")], styles
    assert _compat.TP_REASON in report.decode_attention and report.continuous_batching.startswith("off"), report
    calls = []
    backend = state.backend
    run_lora = backend.run_lora
    backend.run_lora = lambda *a, **k: (calls.append(1), run_lora(*a, **k))[1]
    ids = torch.tensor([[1, 5, 9, 33, 70, 101, 7, 3], [2, 44, 8, 90, 11, 12, 64, 100], [4, 4, 8, 9, 10, 11, 2, 3]])
    # one all-reduce per rowwise layer, as without LoRA (the delta joins the base partial sums)
    reduces, all_reduce = [], dist.all_reduce
    dist.all_reduce = lambda *a, **k: (reduces.append(1), all_reduce(*a, **k))[1]
    try:
        with torch.no_grad():
            tp(ids, adapter_names=["default", "other", "__base__"])
            with_lora = len(reduces)
            with tp.disable_adapter():
                tp(ids)
            without = len(reduces) - with_lora
    finally:
        dist.all_reduce = all_reduce
    assert with_lora == without > 0, (with_lora, without)
    for names in (["default", "other", "__base__"], ["other", "other", "default"]):
        with torch.no_grad():
            got = tp(ids, adapter_names=names).logits
            want = ref(ids, adapter_names=names).logits
        got = got.full_tensor() if isinstance(got, DTensor) else got
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    kw = dict(attention_mask=torch.ones_like(ids), adapter_names=["other", "default", "__base__"],
              max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(tp.generate(input_ids=ids, **kw), ref.generate(input_ids=ids, **kw))
    assert calls  # the layers ran fastlora's path
    fastlora.unpatch(tp)
    print(f"rank {dist.get_rank()}: ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
