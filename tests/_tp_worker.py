"""One rank of the tensor-parallel tests (run by torchrun, 2 processes).

    _tp_worker.py PATH ARCH DEVICE GRAPHS [LAYOUT [OPS [HEADS]]]   e.g. /tmp/x llama cpu emulate  |  /tmp/x qwen2 cuda auto whole torch

A tiny model of ``ARCH`` (``tests/_models.py``) loaded with transformers' tensor parallelism (gloo on
the CPU, NCCL on GPUs), two LoRA adapters whose weights are those of an unsharded reference (sharded
the way PEFT sharded them), then ``fastlora.patch(cuda_graphs=GRAPHS)``: every LoRA Linear runs on
fastlora's path from this rank's shards (colwise: B's rows; rowwise: A's columns, the delta added to
the base layer's partial sums before its one all-reduce), decode steps run through the graph
runner with the collectives inside, and mixed batches and ``generate`` give PEFT's results on the
unsharded model.

LAYOUT: "peft" keeps the adapters as this PEFT made them (sharded DTensors since PEFT 0.21.2);
"whole" replaces them by whole plain weights on every rank, as older PEFT leaves them.
OPS: "kernels" (fastlora's decode attention, RMSNorm, rotary and SiLU-mul kernels; on the CPU in
Triton's interpreter) or "torch" (transformers' own).
HEADS: "heads" has the second adapter target the embedding (sharded by vocabulary rows) and the LM
head (``colwise_gather_output``) too, on which PEFT's own mixed batch fails under TP.
FASTLORA_TEST_FOLD=1 in the environment: every Linear site's shrink folded into its base GEMM (the
size limit lifted), row-sharded layers reducing their partial shrinks with their partial sums.
"""

import os
import sys

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import AutoModelForCausalLM

import peft_fastlora as fastlora

from _models import build_causal_lm

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(path, tp: bool, device, heads: bool = False):
    kw = dict(tp_plan="auto") if tp else {}
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    if not tp:
        base = base.to(device)
    base.generation_config.pad_token_id, base.generation_config.eos_token_id = 0, None
    torch.manual_seed(1)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False))
    torch.manual_seed(2)
    other = ["q_proj", "v_proj", "down_proj"] + (["embed_tokens", "lm_head"] if heads else [])
    model.add_adapter("other", LoraConfig(r=8, target_modules=other, init_lora_weights=False))
    return model.eval()


def same_logits(tp, ref, ids, mixes):
    """For each adapter mix, the sharded model's logits equal PEFT's on the unsharded one."""
    for names in mixes:
        with torch.no_grad():
            got = tp(ids, adapter_names=names).logits
            want = ref(ids, adapter_names=names).logits
        got = got.full_tensor() if isinstance(got, DTensor) else got
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def main(path, arch, device_type, graphs, layout="peft", ops="kernels", heads=""):
    cuda = device_type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if rank == 0:
        build_causal_lm(arch).save_pretrained(path)
    dist.barrier()
    heads = heads == "heads"
    tp, ref = build(path, True, device, heads), build(path, False, device, heads)
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():  # the same adapter weights on both (PEFT's TP init draws other numbers)
        for name, p in tp.named_parameters():
            if "lora_" in name:
                src = ref_params[name].detach()
                if (isinstance(p, DTensor) or p.shape != src.shape) and layout == "whole":
                    owner, attr = name.rsplit(".", 1)
                    setattr(tp.get_submodule(owner), attr, torch.nn.Parameter(src.clone()))
                elif isinstance(p, DTensor):
                    p.to_local().copy_(distribute_tensor(src, p.device_mesh, p.placements, src_data_rank=None).to_local())
                elif p.shape != src.shape:  # a plain local shard (PEFT's LM head B): this rank's chunk
                    d = next(i for i in range(p.dim()) if p.shape[i] != src.shape[i])
                    p.copy_(src.narrow(d, rank * -(-src.shape[d] // dist.get_world_size()), p.shape[d]))
                else:
                    p.copy_(src)
    if layout == "whole":
        assert not any(isinstance(p, DTensor) for n, p in tp.named_parameters() if "lora_" in n)
        assert all(p.shape == ref_params[n].shape for n, p in tp.named_parameters() if "lora_" in n)
    # the base-model kernels too (on the CPU they run in Triton's interpreter only when asked for)
    with_kernels = ops == "kernels"
    kernels = dict(decode_attention=with_kernels, fuse_norms=with_kernels, fuse_rotary=with_kernels,
                   fuse_silu_mul=with_kernels)
    fold = os.environ.get("FASTLORA_TEST_FOLD") == "1"
    report = fastlora.patch(tp, cuda_graphs=graphs, fold_shrink=fold, tuning=fastlora.Tuning(fold_max_share=1e9),
                            **kernels)
    # every LoRA Linear served from this rank's shards; q/k/v and gate/up fused within the rank
    assert report.num_patched_layers == 14 + 2 * heads and not report.left_on_peft and not report.fusion_blocked, report
    assert report.cuda_graphs == ("emulated" if graphs == "emulate" else "on"), report.cuda_graphs
    state = fastlora.get_state(tp)
    styles = sorted({(s.name.rsplit(".", 1)[-1], s.kind, getattr(s, "tp", None)) for s in state.sites})
    expected = [("down_proj", "linear", "rowwise"), ("gate_up", "gate_up", None), ("o_proj", "linear", "rowwise"),
                ("qkv", "qkv", None)]
    # the embedding is sharded by vocabulary rows where the model's plan says so (transformers 5.24's
    # Llama plan; 5.17's leaves it whole on every rank)
    emb_sharded = heads and any(isinstance(p, DTensor) for n, p in tp.named_parameters()
                                if "embed_tokens.base_layer" in n)
    if heads:
        expected = sorted(expected + [("embed_tokens", "embedding", "vocab" if emb_sharded else None),
                                      ("lm_head", "linear", "colwise_gather")])
    assert styles == expected, styles
    for g in state.groups:  # each rank's shards are views of its fused weight
        assert g.is_intact() and g.weight.shape[0] == sum(b.weight.to_local().shape[0] for b in g.bases)
    assert report.continuous_batching.startswith("off"), report
    n_sites = 8 + 2 * heads
    assert report.shrink_folded == (f"8 of {n_sites} sites" if fold else "off (fold_shrink=False)"), report
    # with the heads: the embedding (a lookup) and the gathered LM head keep their paths, saying why
    assert all(n.endswith(("embed_tokens", "lm_head")) for n, _ in report.fold_refused), report.fold_refused
    if with_kernels:
        assert report.decode_attention == "on", report
        assert report.fused_norms and report.fused_rotary and report.fused_mlps, report
    calls = []
    backend = state.backend
    run_lora, run_expand = backend.run_packed_lora, backend.run_packed_expand
    backend.run_packed_lora = lambda *a, **k: (calls.append("lora"), run_lora(*a, **k))[1]
    backend.run_packed_expand = lambda *a, **k: (calls.append("expand"), run_expand(*a, **k))[1]
    if heads:  # PEFT's own mixed batch fails on these layers under TP: fastlora's path is the only one
        assert report.num_patched_layers == 16
    ids = torch.tensor([[1, 5, 9, 33, 70, 101, 7, 3], [2, 44, 8, 90, 11, 12, 64, 100], [4, 4, 8, 9, 10, 11, 2, 3]],
                       device=device)
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
    # (with the embedding sharded: fastlora sums its ranks' lookups with one all_reduce where
    # transformers' own path makes its one reduction through a DTensor collective, not counted here)
    assert with_lora == without + emb_sharded and without > 0, (with_lora, without)
    same_logits(tp, ref, ids, (["default", "other", "__base__"], ["other", "other", "default"]))
    import importlib

    attention_op = importlib.import_module("peft_fastlora.base_ops.attention_registry")  # where the kernel is called

    attention_calls, decode_attention = [], attention_op.decode_attention
    attention_op.decode_attention = lambda *a, **k: (attention_calls.append(1), decode_attention(*a, **k))[1]
    # generate: greedy tokens equal to PEFT's on the unsharded model, decode steps through the graphs
    # (a second call with more rows takes another bucket)
    for rows, names, new in ((3, ["other", "default", "__base__"], 6),
                             (5, ["default", "__base__", "other", "other", "default"], 9)):
        prompt = torch.cat([ids, ids.flip(0)])[:rows]
        kw = dict(attention_mask=torch.ones_like(prompt), adapter_names=names, max_new_tokens=new,
                  do_sample=False, pad_token_id=0)
        with torch.no_grad():
            got, want = tp.generate(input_ids=prompt, **kw), ref.generate(input_ids=prompt, **kw)
        assert torch.equal(got, want), (rows, got, want)
    # then traffic: random batch sizes, left-padded lengths and adapter mixes (the same draws on
    # every rank), an adapter deleted half-way on both models
    g = torch.Generator().manual_seed(5)
    # interpreted kernels (CPU): the two calls above only (the traffic runs in the torch-ops variants)
    calls_n = 16 if cuda else 0 if with_kernels else 4
    for call in range(calls_n):
        if call == calls_n // 2:
            tp.delete_adapter("other")
            ref.delete_adapter("other")
        names_now = ["default", "__base__"] + (["other"] if call < calls_n // 2 else [])
        rows = int(torch.randint(1, 10, (1,), generator=g))
        lens = torch.randint(1, 13, (rows,), generator=g)
        width = int(lens.max())
        prompt = torch.randint(3, 100, (rows, width), generator=g)
        mask = (torch.arange(width)[None, :] >= (width - lens)[:, None]).long()
        prompt = (prompt * mask).to(device)
        names = [names_now[int(i)] for i in torch.randint(0, len(names_now), (rows,), generator=g)]
        kw = dict(attention_mask=mask.to(device), adapter_names=names, do_sample=False, pad_token_id=0,
                  max_new_tokens=int(torch.randint(1, 11, (1,), generator=g)))
        with torch.no_grad():
            got, want = tp.generate(input_ids=prompt, **kw), ref.generate(input_ids=prompt, **kw)
        assert torch.equal(got, want), (call, names, got, want)
    attention_op.decode_attention = decode_attention
    assert bool(attention_calls) == with_kernels  # fastlora's decode attention over this rank's heads
    stats = state.graph_runner.stats
    assert stats["replays"] > 0 and stats["eager_steps"] == 0 and stats["capture_failures"] == 0, stats
    assert calls and (("expand" in calls) == fold), set(calls)  # the layers ran fastlora's path
    # an adapter registered by name from a folder saved whole: each rank serves its part of it
    torch.manual_seed(3)
    ref.add_adapter("reg", LoraConfig(r=6, target_modules=TARGETS, init_lora_weights=False))
    folder = os.path.join(path + "_saved", "reg")
    if rank == 0:
        ref.save_pretrained(path + "_saved", selected_adapters=["reg"])
    dist.barrier()
    fastlora.register_adapter(tp, "reg", folder)
    same_logits(tp, ref, ids, (["reg", "default", "__base__"], ["reg", "reg", "reg"]))
    fastlora.unpatch(tp)
    print(f"rank {rank}: ok {arch} {device_type} graphs={graphs} layout={layout} ops={ops} heads={heads} "
          f"fold={fold} captures={stats['captures']} "
          f"replays={stats['replays']}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
