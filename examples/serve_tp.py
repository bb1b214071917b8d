"""Mixed-adapter generation on a model split over ranks by transformers' tensor parallelism.

    NCCL_NVLS_ENABLE=0 PYTHONHASHSEED=0 torchrun --standalone --nproc_per_node 2 examples/serve_tp.py
    torchrun --standalone --nproc_per_node 2 examples/serve_tp.py      # no GPU: 2 CPU processes (gloo)

Rank 0 saves a small random Llama and two LoRA adapters to a folder (no downloads); every rank
then loads the base with ``tp_plan="auto"``, the adapters with PEFT, patches the model and runs
the same mixed batch (every rank makes the same calls with the same adapter names). Rank 0 checks
the tokens against PEFT on the whole model, loaded alone in that process.
"""

import argparse
import os
import shutil
import tempfile
import warnings

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import peft_fastlora as fastlora

ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_model_and_adapters(folder: str) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(f"{folder}/base")
    for name, cfg in (("sql", LoraConfig(r=8, lora_alpha=16, target_modules=ALL_PROJ, init_lora_weights=False)),
                      ("chat", LoraConfig(r=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False))):
        base = AutoModelForCausalLM.from_pretrained(f"{folder}/base")
        get_peft_model(base, cfg).save_pretrained(f"{folder}/{name}")


def load(folder: str, tp: bool, device):
    kw = dict(tp_plan="auto") if tp else dict(device_map={"": device})
    base = AutoModelForCausalLM.from_pretrained(f"{folder}/base", dtype=torch.float32, **kw)
    model = PeftModel.from_pretrained(base, f"{folder}/sql", adapter_name="sql")
    model.load_adapter(f"{folder}/chat", adapter_name="chat")
    return model.eval()


def main(argv=None) -> int:
    # PEFT (0.21) reads transformers' deprecated is_gradient_checkpointing whenever it wraps a
    # model: the FutureWarning is about PEFT's code, not this script's
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", default=None, help="where rank 0 saves the model (default: a temporary folder)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    folder = [args.folder or (tempfile.mkdtemp(prefix="fastlora_tp_") if rank == 0 else None)]
    dist.broadcast_object_list(folder, src=0)
    folder = folder[0]
    if rank == 0:
        save_model_and_adapters(folder)
    dist.barrier()

    model = load(folder, tp=True, device=device)
    report = fastlora.patch(model)
    if rank == 0:
        print(report)
    names = ["sql", "chat", "__base__", "sql"]
    torch.manual_seed(1)  # the same prompts on every rank
    input_ids = torch.randint(1, 256, (len(names), 10)).to(device)
    kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=8,
                  do_sample=False, pad_token_id=0)
    with torch.no_grad():
        tokens = model.generate(**kwargs, adapter_names=names)
    ok = True
    if rank == 0:
        reference = load(folder, tp=False, device=device)  # PEFT alone, the whole model, this process
        with torch.no_grad():
            want = reference.generate(**kwargs, adapter_names=names)
        for row, name in enumerate(names):
            print(f"row {row} [{name:>8}] -> {tokens[row, input_ids.shape[1]:].tolist()}")
        ok = torch.equal(tokens, want)
        print(f"{dist.get_world_size()} ranks on {device.type}, decode graphs {report.cuda_graphs}: "
              f"tokens equal to PEFT on the whole model: {ok}")
    fastlora.unpatch(model)  # its decode graphs (and the collectives in them) go before the process group
    dist.barrier()
    if rank == 0 and args.folder is None:
        shutil.rmtree(folder, ignore_errors=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
