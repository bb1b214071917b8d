"""Quickstart: one mixed-adapter batch through fastlora, on CPU or CUDA.

Builds a small random Llama from a config (no downloads), adds three LoRA adapters with different
ranks and targets, patches the model, runs one mixed batch with ``generate`` and checks the tokens
against PEFT's own mixed-batch path.

    python examples/quickstart.py
"""

import warnings

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import peft_fastlora as fastlora


def build_model(device, dtype):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    model = LlamaForCausalLM(config)
    all_proj = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    # init_lora_weights=False: random non-zero B, so each adapter visibly changes the output
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=all_proj,
                                             init_lora_weights=False), adapter_name="sql")
    model.add_adapter("chat", LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                         init_lora_weights=False))
    model.add_adapter("math", LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=all_proj,
                                         init_lora_weights=False))
    return model.to(device=device, dtype=dtype).eval()


def main():
    # PEFT (0.21) reads transformers' deprecated is_gradient_checkpointing whenever it wraps a
    # model: the FutureWarning is about PEFT's code, not this script's
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # float32 so that the token check below is exact on CPU and GPU alike (bf16 rounds the
    # LoRA delta differently from PEFT, which keeps adapters in float32)
    dtype = torch.float32
    model = build_model(device, dtype)
    names = ["sql", "chat", "__base__", "math", "sql", "chat"]
    input_ids = torch.randint(1, 256, (len(names), 12), device=device)
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, :3] = 0  # one left-padded row
    attention_mask[1, :3] = 0
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=8,
                  do_sample=False, pad_token_id=0)

    peft_tokens = model.generate(**kwargs, adapter_names=names)  # PEFT's own mixed path
    report = fastlora.patch(model)
    print(report)
    fast_tokens = model.generate(**kwargs, adapter_names=names)
    for row, name in enumerate(names):
        new = fast_tokens[row, input_ids.shape[1]:].tolist()
        print(f"row {row} [{name:>8}] -> {new}")
    same = torch.equal(fast_tokens, peft_tokens)
    print(f"device {device}, backend {report.backend}: tokens equal to PEFT's mixed path: {same}")
    if not same:
        raise SystemExit("fastlora and PEFT disagree")


if __name__ == "__main__":
    main()
