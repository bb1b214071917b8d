"""Prefill with mixed adapters against the base model's prefill, same harness, one run.

    python benchmarks/bench_prefill.py --model 8b --rows 8 --tokens 2048 --out benchmarks/results
    python benchmarks/bench_prefill.py --smoke      # CPU: checks the script, measures nothing

One forward over ``rows`` prompts of ``tokens`` tokens (the logits of the last token only, as
``generate`` asks), timed as the median of ``--reps``:

- ``base``: the base model (transformers, no adapters);
- ``peft``: PEFT's mixed batch, one adapter per row;
- ``fastlora``: the same model patched, the same adapter names.

Floors: weight bytes / copy bandwidth, and 2 x parameters x tokens / the bf16 dense peak
(``--peak-tflops``); prefill at this size is bound by the second.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_generate as bg  # noqa: E402  (shapes, builders, timing, versions)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bg.add_model_args(p, adapters=8)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak of the GPU (H100/H200 SXM)")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        bg.DEVICE = "cpu"
        args.model, args.rows, args.tokens, args.reps = "tiny", 2, 16, 1
    elif not torch.cuda.is_available():
        print("bench_prefill needs a CUDA GPU (or --smoke); nothing measured")
        return 0
    import peft_fastlora as fastlora

    vers = bg.versions()
    bw = bg.copy_bandwidth() if bg.DEVICE == "cuda" else 1e11
    model = bg.build_base(args.model)
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(3, 1000, (args.rows, args.tokens), device=bg.DEVICE)
    mask = torch.ones_like(ids)
    names = [f"a{i % args.adapters}" for i in range(args.rows)]

    def forward(m, **kw):
        with torch.no_grad():
            return m(input_ids=ids, attention_mask=mask, logits_to_keep=1, **kw)

    times = {}
    forward(model)
    times["base"] = bg.timed(lambda: forward(model), args.reps)
    peft_model = bg.add_adapters(model, args.adapters, args.rank)
    forward(peft_model, adapter_names=names)
    times["peft"] = bg.timed(lambda: forward(peft_model, adapter_names=names), args.reps)
    print(fastlora.patch(peft_model), file=sys.stderr)
    forward(peft_model, adapter_names=names)
    times["fastlora"] = bg.timed(lambda: forward(peft_model, adapter_names=names), args.reps)
    fastlora.unpatch(peft_model)
    flops_ms = 1e3 * 2 * params * args.rows * args.tokens / (args.peak_tflops * 1e12)
    bytes_ms = 1e3 * bg.weight_bytes(model) / bw
    rows = [dict(**vers, model=f"llama-{args.model}", rows=args.rows, tokens=args.tokens,
                 adapters=0 if method == "base" else args.adapters, rank=args.rank, method=method,
                 prefill_ms=round(1e3 * t, 2), ratio_to_base=round(t / times["base"], 3),
                 flop_floor_ms=round(flops_ms, 2), byte_floor_ms=round(bytes_ms, 2),
                 ratio_to_flop_floor=round(1e3 * t / flops_ms, 3))
            for method, t in times.items()]
    for r in rows:
        print({k: r[k] for k in ("method", "prefill_ms", "ratio_to_base", "ratio_to_flop_floor")}, file=sys.stderr)
    if args.out and not args.smoke:
        print(f"written {bg.write_csv(rows, args.out, 'prefill_h200.csv')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
