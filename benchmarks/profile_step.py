"""Where the time of one decode step goes: per-kernel CUDA time of a step, base model and fastlora.

Kernels are timed by torch.profiler on eager decode steps over transformers' ``StaticCache`` (inside
a graph the same kernels run, without the launch gaps; the graph path's static caches also write
K/V with one kernel, where transformers' cache here runs its own update). Writes the top kernels
per configuration to --out as CSV.

    python benchmarks/profile_step.py --model 8b --batch 32
"""

from __future__ import annotations

import argparse
import csv
import inspect
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_generate import add_adapters, build_base, versions  # noqa: E402


def decode_inputs(model, batch, prompt, names):
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=prompt + 16)
    forward = getattr(model, "get_base_model", lambda: model)().forward
    # transformers 5.2x renamed the forward's past_key_values to cache
    kw = {"cache" if "cache" in inspect.signature(forward).parameters else "past_key_values": cache}
    if names is not None:
        kw["adapter_names"] = names
    ids = torch.randint(3, 1000, (batch, prompt), device="cuda")
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **kw)  # the prefill fills the static cache in place
    step = dict(input_ids=torch.randint(3, 1000, (batch, 1), device="cuda"),
                attention_mask=torch.ones(batch, prompt + 1, dtype=torch.long, device="cuda"),
                use_cache=True, **kw)
    return step, cache


def profile(model, step, cache, steps=3):
    from torch.profiler import ProfilerActivity, profile as prof

    lengths = [layer.cumulative_length.clone() for layer in cache.layers]

    def one():
        for layer, n in zip(cache.layers, lengths):
            layer.cumulative_length.copy_(n)
        with torch.no_grad():
            model(**step)

    for _ in range(2):
        one()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(steps):
            one()
        torch.cuda.synchronize()
    totals, counts = {}, {}
    for evt in p.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            totals[evt.name] = totals.get(evt.name, 0.0) + evt.device_time / steps
            counts[evt.name] = counts.get(evt.name, 0) + 1
    return sorted(((k, t, counts[k] / steps) for k, t in totals.items()), key=lambda kv: -kv[1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="8b")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=192)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default="benchmarks/results/profile_step_h200.csv")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_step needs a CUDA GPU; nothing measured")
        return 0
    import peft_fastlora as fastlora

    vers = versions()
    model = build_base(args.model)
    rows = []
    step, cache = decode_inputs(model, args.batch, args.prompt, None)
    results = {"base": profile(model, step, cache)}
    # the base model with fastlora's decode attention and small ops (eager steps: rotary and
    # SiLU-mul are on by default only with graphs, so they are asked for)
    report = fastlora.patch(model, cuda_graphs=False, fuse_rotary=True, fuse_silu_mul=True)
    if report.decode_attention == "on":
        step, cache = decode_inputs(model, args.batch, args.prompt, None)
        results["base_fast"] = profile(model, step, cache)
    fastlora.unpatch(model)
    peft_model = add_adapters(model, args.adapters, args.rank)
    names = [f"a{i % args.adapters}" for i in range(args.batch)]
    # eager steps with what the graphed step runs (rotary and SiLU-mul are on by default only with graphs)
    fastlora.patch(peft_model, cuda_graphs=False, fuse_rotary=True, fuse_silu_mul=True)
    step, cache = decode_inputs(peft_model, args.batch, args.prompt, names)
    results["fastlora"] = profile(peft_model, step, cache)
    fastlora.unpatch(peft_model)
    for config, kernels in results.items():
        total = sum(t for _, t, _ in kernels)
        launches = sum(c for _, _, c in kernels)
        print(f"\n{config}: {total / 1e3:.3f} ms of kernel time in {launches:.0f} kernels per decode step "
              f"(batch {args.batch})")
        for name, t, c in kernels[: args.top]:
            print(f"  {t / 1e3:8.3f} ms  {100 * t / total:5.1f}%  x{c:<5.0f} {name[:100]}")
            rows.append(dict(**vers, model=args.model, batch=args.batch, config=config, kernel=name[:200],
                             ms_per_step=round(t / 1e3, 4), share=round(t / total, 4), launches_per_step=c,
                             step_kernel_ms=round(total / 1e3, 3), step_launches=launches))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
