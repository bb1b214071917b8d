"""Mixed-adapter decode under transformers' tensor parallelism: TP=2 against TP=1, same harness.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONHASHSEED=0 \\
        torchrun --standalone --nproc_per_node 2 benchmarks/bench_tp.py --model 8b      # tp_8b_h200.csv
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_tp.py --smoke     # CPU, gloo: checks the script

Rank 0 first builds the model (random bf16 weights) on its GPU alone and saves it; with ``--adapters``
adapters of rank ``--rank`` on all 7 projections it times fastlora's graphed decode step at TP=1,
twice: with fastlora's base-model kernels (decode attention, RMSNorm, rotary, SiLU-mul: the
single-GPU default) and without them (what TP runs today: the comparison that isolates the split).
Then both ranks load the saved model with ``tp_plan="auto"``, add the same adapters, patch and time
the same calls at TP=2. Floors: the bytes each GPU reads per step (its half of the weights, of the
adapters used and of the KV cache) over the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as hx  # noqa: E402


def kwargs_for(ids, new):
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                do_sample=False, pad_token_id=0)


def time_decode(model, batches, args, names_for):
    """{batch: (prefill ms, decode ms/step)} for patched ``model`` (the same prompts on every rank)."""
    out = {}
    for b in batches:
        torch.manual_seed(b)
        ids = torch.randint(3, 1000, (b, args.prompt)).to(hx.DEVICE)
        prefill, step, _ = hx.measure(lambda n: model.generate(**kwargs_for(ids, n), adapter_names=names_for(b)),
                                      args.new_tokens, args.reps)
        out[b] = (prefill, step)
    return out


def ratio(step, reference):
    return round(step / reference, 3) if reference else ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hx.add_model_args(p, adapters=8)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    hx.add_run_args(p)
    p.add_argument("--path", default="/tmp/fastlora_bench_tp_model")
    p.add_argument("--skip-tp1", action="store_true",
                   help="TP=2 alone (a model whose one-GPU runs would not add what the run is for)")
    args = p.parse_args(argv)
    if not hx.start(args, "bench_tp"):
        return 0
    if args.smoke:
        args.model, args.adapters, args.batches, args.prompt, args.new_tokens, args.reps = "tiny", 2, [2], 8, 4, 1
    import peft_fastlora as fastlora

    cuda = hx.DEVICE == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    names_for = lambda b: hx.round_robin(b, args.adapters)  # noqa: E731
    graphs = "auto" if cuda else "emulate"
    rows, info = [], hx.versions()
    bw = hx.copy_bandwidth() if cuda else 1e11
    wbytes = 0
    if rank == 0:
        base = hx.build_base(args.model)
        wbytes = hx.weight_bytes(base)
        base.save_pretrained(args.path)
        model = hx.add_adapters(base, args.adapters, args.rank)
        tp1_runs = () if args.skip_tp1 else (("tp1_fastlora_ops", {}), ("tp1_hf_ops", hx.HF_OPS))
        for label, ops in tp1_runs:
            report = fastlora.patch(model, cuda_graphs=graphs, **ops)
            print(label, report, flush=True)
            for b, (prefill, step) in time_decode(model, args.batches, args, names_for).items():
                rows.append((label, 1, b, prefill, step))
            print(label, "graph runner:", fastlora.get_state(model).graph_runner.stats, flush=True)
            fastlora.unpatch(model)
        del model, base
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    dist.barrier()
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(args.path, dtype=torch.bfloat16, tp_plan="auto")
    base.generation_config.eos_token_id = None
    model = hx.add_adapters(base, args.adapters, args.rank)
    report = fastlora.patch(model, cuda_graphs=graphs)
    if rank == 0:
        print(f"tp{world}", report, flush=True)
    for b, (prefill, step) in time_decode(model, args.batches, args, names_for).items():
        rows.append((f"tp{world}", world, b, prefill, step))
    stats = fastlora.get_state(model).graph_runner.stats if fastlora.get_state(model).graph_runner else {}
    stats = dict(stats)
    # release the graphs (and the collectives captured in them) before the process group goes:
    # graphs holding captured collectives keep the ranks' processes from exiting
    fastlora.unpatch(model)
    if rank == 0:
        print("graph runner:", stats, flush=True)
        table, one = [], {(r[0], r[2]): r[4] for r in rows}
        for label, tp, b, prefill, step in rows:
            used = min(b, args.adapters)
            per_gpu = (wbytes + used * hx.lora_bytes_per_adapter(args.model, args.rank)
                       + hx.kv_bytes(args.model, b, args.prompt + args.new_tokens / 2)) / tp
            floor = 1e3 * per_gpu / bw
            table.append(dict(**info, model=hx.model_label(args.model), method=label, tp=tp, batch=b,
                              adapters=args.adapters, rank=args.rank, prefill_ms=round(prefill, 2),
                              decode_ms_per_step=round(step, 3), tokens_per_s=round(1e3 * b / step, 1),
                              per_gpu_floor_ms=round(floor, 3), ratio_to_floor=round(step / floor, 3),
                              ratio_to_tp1_fastlora_ops=ratio(step, one.get(("tp1_fastlora_ops", b))),
                              ratio_to_tp1_hf_ops=ratio(step, one.get(("tp1_hf_ops", b))),
                              copy_bw_tbs=round(bw / 1e12, 3),
                              # the TP run's graph runner over all its calls (TP=1: see the log)
                              graph_replays=stats.get("replays", "") if tp > 1 else "",
                              eager_steps=stats.get("eager_steps", "") if tp > 1 else ""))
            print({k: table[-1][k] for k in ("method", "batch", "decode_ms_per_step", "ratio_to_floor",
                                             "ratio_to_tp1_fastlora_ops", "ratio_to_tp1_hf_ops")}, flush=True)
        if args.out:
            path = hx.write_csv(table, hx.out_path(args.out, f"tp_{args.model}", info["gpu"]))
            print(open(path).read(), flush=True)  # the CSV in the log too
        shutil.rmtree(args.path, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
