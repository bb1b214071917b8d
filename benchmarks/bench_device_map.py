"""Mixed-adapter decode with the model split over GPUs by accelerate's device_map: PEFT's own
mixed batch against fastlora, in one run.

    python benchmarks/bench_device_map.py --model 8b     # every visible GPU: device_map_8b_h200.csv
    python benchmarks/bench_device_map.py --smoke                                # CPU: checks the script

The model is built on the first GPU (random bf16 weights), its decoder layers dispatched in equal
runs over the visible GPUs with accelerate's ``dispatch_model`` (the hooks ``from_pretrained(...,
device_map=...)`` installs; the embedding on the first GPU, the final norm and LM head on the last),
then it gets ``--adapters`` adapters of rank ``--rank`` on all 7 projections. Rows: the base model
alone (transformers' eager decode), PEFT's mixed batch, fastlora (its decode graphs are off here: a
graph captures one device; steps run eagerly through the Triton backend). Floor: every byte a step
reads (weights, the adapters the batch uses, KV cache) over one GPU's copy bandwidth: the GPUs of a
device_map run one after the other.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as hx  # noqa: E402


def split_over(model, devices: list):
    """Dispatch the decoder layers of ``model`` (a causal LM) in equal runs over ``devices``."""
    from accelerate import dispatch_model

    inner = model.model
    layers = model.config.num_hidden_layers
    first, last = devices[0], devices[-1]
    device_map = {f"model.{name}": (last if name == "norm" else first)
                  for name, _ in inner.named_children() if name != "layers"}
    device_map.update({f"model.layers.{i}": devices[i * len(devices) // layers] for i in range(layers)})
    device_map["lm_head"] = last
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dispatch_model(model, device_map=device_map)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hx.add_model_args(p, adapters=8)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=2)
    hx.add_run_args(p)
    p.add_argument("--short-tokens", type=int, default=8, help="new tokens for PEFT's (slow) mixed batch")
    args = p.parse_args(argv)
    if not hx.start(args, "bench_device_map"):
        return 0
    if args.smoke:
        args.model, args.adapters, args.batches, args.prompt = "tiny", 2, [2], 8
        args.new_tokens, args.short_tokens, args.reps = 4, 3, 1
    import peft_fastlora as fastlora

    cuda = hx.DEVICE == "cuda"
    n_gpus = torch.cuda.device_count() if cuda else 0
    info = hx.versions()
    bw = hx.copy_bandwidth() if cuda else 1e11
    base = hx.build_base(args.model)
    wbytes = hx.weight_bytes(base)
    if n_gpus > 1 or not cuda:  # (the smoke test checks the map on two "devices" of the CPU)
        base = split_over(base, list(range(n_gpus)) if cuda else ["cpu", "cpu"])
    devices = sorted({str(q.device) for q in base.parameters()})
    print("devices:", devices, flush=True)
    first = devices[0]
    ids = {b: torch.randint(3, 1000, (b, args.prompt), generator=torch.Generator().manual_seed(b)).to(first)
           for b in args.batches}

    def kw(b, n):
        return dict(input_ids=ids[b], attention_mask=torch.ones_like(ids[b]), max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=0)

    results = {}
    for b in args.batches:
        results[("hf_eager_base", b)] = hx.measure(lambda n, b=b: base.generate(**kw(b, n)), args.short_tokens, 1)
    model = hx.add_adapters(base, args.adapters, args.rank)
    names = {b: hx.round_robin(b, args.adapters) for b in args.batches}
    for b in args.batches:
        results[("peft_native", b)] = hx.measure(
            lambda n, b=b: model.generate(**kw(b, n), adapter_names=names[b]), args.short_tokens, 1)
    report = fastlora.patch(model)
    print("fastlora", report, flush=True)
    for b in args.batches:
        results[("fastlora", b)] = hx.measure(
            lambda n, b=b: model.generate(**kw(b, n), adapter_names=names[b]), args.new_tokens, args.reps)
    fastlora.unpatch(model)
    rows = []
    for (method, b), (prefill, step, _) in results.items():
        used = min(b, args.adapters) if method != "hf_eager_base" else 0
        floor = 1e3 * (wbytes + used * hx.lora_bytes_per_adapter(args.model, args.rank)
                       + hx.kv_bytes(args.model, b, args.prompt + args.new_tokens / 2)) / bw
        peft_step = results[("peft_native", b)][1]
        rows.append(dict(**info, model=hx.model_label(args.model), gpus=len(devices), method=method, batch=b,
                         adapters=args.adapters, rank=args.rank, prefill_ms=round(prefill, 2),
                         decode_ms_per_step=round(step, 3), tokens_per_s=round(1e3 * b / step, 1),
                         floor_ms=round(floor, 3), ratio_to_floor=round(step / floor, 3),
                         speedup_vs_peft=round(peft_step / step, 2), copy_bw_tbs=round(bw / 1e12, 3),
                         fastlora_report=str(report) if method == "fastlora" else ""))
        print({k: rows[-1][k] for k in ("method", "batch", "decode_ms_per_step", "tokens_per_s", "ratio_to_floor",
                                        "speedup_vs_peft")}, flush=True)
    if args.out:
        hx.write_csv(rows, hx.out_path(args.out, f"device_map_{args.model}", info["gpu"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
