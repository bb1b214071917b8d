"""Prefill with mixed adapters: fastlora against the same base model patched by fastlora, against the
unpatched HF model and against PEFT's mixed batch, in one run.

    python benchmarks/bench_prefill.py --model 8b --rows 8 --tokens 2048   # prefill_8b_h200.csv
    python benchmarks/bench_prefill.py --model 8b --glu-expand             # and the fastlora_glu_expand arm
    python benchmarks/bench_prefill.py --smoke      # CPU: checks the script, measures nothing

One forward over ``--rows`` prompts of ``--tokens`` tokens (the logits of the last token only, as
``generate`` asks), timed as the median of ``--reps``:

- ``hf_base``: the base model, unpatched (transformers, no adapters);
- ``base_patched``: the base model patched by fastlora (``fastlora.patch`` on the plain model): the
  like-for-like reference (``ratio_to_base_patched``);
- ``peft``: PEFT's mixed batch, one adapter per row (round-robin);
- ``fastlora``: the same PeftModel patched, the same adapter names;
- ``fastlora_glu_expand`` (``--glu-expand``): the same with ``Tuning(glu_expand_min_tokens=...)``
  reached by this forward: gate/up's deltas added inside the activation's launch (``ops.glu_expand``).
  ``fastlora`` then runs with ``Tuning(glu_expand_min_tokens=None)`` (the expand, then the
  activation), so that the two rows are the two arms; without the flag it runs with the default
  ``Tuning()``. Each fastlora row says its threshold (``glu_expand_min_tokens``, "off" for None)
  and how many gated MLPs may take the kernel (``glu_expand_mlps``, the patch report's).

Floors: weight bytes / copy bandwidth, and 2 x parameters x tokens / the bf16 dense peak
(``--peak-tflops``); prefill at this size is bound by the second.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as hx  # noqa: E402

# one prefill's GPU timeline with --kernel-split (``harness.GpuWindow``): how much of it the GPU
# idles between kernels, the host's synchronising calls that can cause it, and the wall time
# outside the GPU's first-to-last activity (the host's work before the first kernel)
WINDOW_COLUMNS = ("gpu_busy_share", "idle_share", "idle_gaps_over_100us", "outside_gpu_span_ms", "host_syncs",
                  "host_sync_ms", "kernel_launches")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hx.add_model_args(p, adapters=8)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--kernel-split", action="store_true",
                   help="also the GPU time of one prefill by kernel, patched base and each fastlora row: "
                        "<csv stem>_kernels.csv")
    p.add_argument("--glu-expand", action="store_true",
                   help="also fastlora_glu_expand (gate/up's deltas inside the activation's launch), and fastlora "
                        "with it off: the two arms")
    p.add_argument("--peak-tflops", type=float, default=0,
                   help="bf16 dense peak of the GPU (0: the specified one, harness.SPEC_BF16_FLOPS)")
    hx.add_run_args(p)
    args = p.parse_args(argv)
    if not hx.start(args, "bench_prefill"):
        return 0
    if args.smoke:
        args.model, args.rows, args.tokens, args.reps = "tiny", 2, 16, 1
    import peft_fastlora as fastlora

    vers = hx.versions()
    bw = hx.copy_bandwidth()
    model = hx.build_base(args.model)
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(3, 1000, (args.rows, args.tokens), device=hx.DEVICE)
    mask = torch.ones_like(ids)
    names = hx.round_robin(args.rows, args.adapters)

    def forward(m, **kw):
        with torch.no_grad():
            return m(input_ids=ids, attention_mask=mask, logits_to_keep=1, **kw)

    kernels = []  # (method, kernel row) with --kernel-split
    windows = {}  # method: one prefill's GPU timeline (busy and idle shares, syncs) with --kernel-split

    def time_it(m, method=None, **kw):
        forward(m, **kw)  # warm-up: kernels compiled
        t = hx.timed(lambda: forward(m, **kw), args.reps)
        if args.kernel_split and method:  # one prefill's kernels: the totals of two forwards less one's
            split = hx.kernel_times(lambda k: [forward(m, **kw) for _ in range(k)], 1)
            kernels.extend(dict(method=method, **r) for r in split)
            window = hx.GpuWindow()
            window.start()
            forward(m, **kw)
            timeline = window.stop()
            windows[method] = {k: timeline[k] for k in WINDOW_COLUMNS}
        return t

    times = {"hf_base": time_it(model)}
    print(fastlora.patch(model), file=sys.stderr)
    times["base_patched"] = time_it(model, "base_patched")
    fastlora.unpatch(model)  # before PEFT wraps the model's layers
    peft_model = hx.add_adapters(model, args.adapters, args.rank)
    times["peft"] = time_it(peft_model, adapter_names=names)
    arms = {"fastlora": fastlora.Tuning(glu_expand_min_tokens=None) if args.glu_expand else fastlora.Tuning()}
    if args.glu_expand:
        arms["fastlora_glu_expand"] = fastlora.Tuning(glu_expand_min_tokens=args.rows * args.tokens)
    glu = {}  # method: (threshold, gated MLPs that may take ops.glu_expand)
    for method, tuning in arms.items():
        report = fastlora.patch(peft_model, tuning=tuning)
        print(report, file=sys.stderr)
        glu[method] = ("off" if tuning.glu_expand_min_tokens is None else tuning.glu_expand_min_tokens,
                       report.lora_glu_expand_mlps)
        times[method] = time_it(peft_model, method, adapter_names=names)
        fastlora.unpatch(peft_model)
    peak = args.peak_tflops * 1e12 or hx.spec_flops(vers["gpu"])
    if not peak:
        sys.exit(f"the bf16 peak of {vers['gpu']} is not in harness.SPEC_BF16_FLOPS: pass --peak-tflops")
    flops_ms = 1e3 * 2 * params * args.rows * args.tokens / peak
    bytes_ms = 1e3 * hx.weight_bytes(model) / bw
    rows = [dict(**vers, model=hx.model_label(args.model), rows=args.rows, tokens=args.tokens,
                 adapters=0 if "base" in method else args.adapters, rank=args.rank, method=method,
                 prefill_ms=round(1e3 * t, 2), ratio_to_base_patched=round(t / times["base_patched"], 3),
                 ratio_to_hf_base=round(t / times["hf_base"], 3), flop_floor_ms=round(flops_ms, 2),
                 byte_floor_ms=round(bytes_ms, 2), ratio_to_flop_floor=round(1e3 * t / flops_ms, 3),
                 copy_bw_tbs=round(bw / 1e12, 3), glu_expand_min_tokens=glu.get(method, ("", ""))[0],
                 glu_expand_mlps=glu.get(method, ("", ""))[1],
                 **windows.get(method, dict.fromkeys(WINDOW_COLUMNS, "")))
            for method, t in times.items()]
    for r in rows:
        print({k: r[k] for k in ("method", "prefill_ms", "ratio_to_base_patched", "ratio_to_hf_base",
                                 "ratio_to_flop_floor")}, file=sys.stderr)
    if args.out:
        path = hx.out_path(args.out, f"prefill_{args.model}", vers["gpu"])
        hx.write_csv(rows, path)
        if kernels:
            hx.write_csv(kernels, os.path.splitext(path)[0] + "_kernels.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
