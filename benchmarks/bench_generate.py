"""End-to-end decode in HF ``generate``: fastlora's mixed-adapter batch against PEFT's, against the
same base model patched by fastlora (no adapters) and against the unpatched HF model, in one run.

Random-weight Llama shapes in bf16 (``--models``), ``--adapters`` adapters of rank ``--rank`` on all
seven projections, a round-robin adapter mix. Methods, each on the same prompts:

- ``hf_eager_base``: the unpatched HF base model (transformers' own eager decode);
- ``base_graphs``: the base model patched by fastlora with transformers' own attention and small
  ops, through fastlora's decode graphs;
- ``base_graphs_attn``: the base model patched by fastlora with its defaults (decode attention,
  one-kernel norms, rotary, act-mul, KV write, decode GEMMs): the like-for-like reference of
  ``fastlora_graphs`` (its ``ratio_to_base_graphs``);
- ``peft_native``: PEFT's own mixed batch (``generate(..., adapter_names=...)``, unpatched);
- ``fastlora_eager_unfused`` / ``fastlora_eager`` / ``fastlora_graphs``: the PeftModel patched,
  without fused projections, without graphs, and with both (the default).

Per row: decode ms/step = (time of ``generate`` with T new tokens - time with 1) / (T - 1); the
graph replay's own GPU time; the byte floor = (base weights + LoRA weights of the adapters the batch
uses + KV read at the mean filled length) / the copy bandwidth measured in this run, and the same
floor at the GPU's specified bandwidth; speed-up over PEFT and agreement of greedy tokens with it
(in bf16 random weights near-ties part rows: correctness is tested in fp32, not here).

    python benchmarks/bench_generate.py --models 8b --graphs-only      # generate_8b_h200.csv
    python benchmarks/bench_generate.py --models 1b 8b --csv generate_with_peft_h200.csv
    python benchmarks/bench_generate.py --smoke --models tiny --batches 2   # CPU: checks the script
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as hx  # noqa: E402

# the base model under fastlora's graph harness: with transformers' own attention and small ops,
# and with fastlora's decode attention, RMSNorm, rotary, SiLU-mul and KV-write kernels
HF_OPS = hx.HF_OPS
FAST_OPS = {}  # the defaults, as fastlora_graphs below
PATCH_EXTRA = {}  # options every fastlora method here is patched with (--stream-gemm, --narrow-gemms)
METHODS = ("hf_eager_base", "base_graphs", "base_graphs_attn", "peft_native", "fastlora_eager_unfused",
           "fastlora_eager", "fastlora_graphs", "fastlora_graphs_plain", "fastlora_graphs_lora_bias",
           "fastlora_graphs_dora")
# --kinds: adapters of another kind, as many as --adapters, the same rows: (name prefix, LoraConfig fields).
# "plain" is measured first whenever kinds are asked for: as many plain adapters again, so that each
# kind is compared with a model holding as many adapters (stacks, folds) as it does
KINDS = {"plain": ("p", {}), "lora_bias": ("b", dict(lora_bias=True)), "dora": ("d", dict(use_dora=True))}


def model_runner_stats(model):
    """The graph runner's counters that say how the steps ran (None: no runner)."""
    import peft_fastlora as fastlora

    runner = fastlora.get_state(model).graph_runner
    if runner is None:
        return None
    return {k: v for k, v in runner.stats.items() if k in (
        "replays", "eager_steps", "advanced_calls", "advanced_steps", "advance_reasons", "selection_reasons",
        "early_edges", "early_launch_off", "rotary_table_off")}


def run_base(model, batches, args, kw, results):
    """The base model alone: unpatched HF eager, then patched by fastlora with HF's ops and with its own."""
    import peft_fastlora as fastlora

    graphs = "emulate" if hx.DEVICE == "cpu" else "auto"
    for b in batches if not args.graphs_only else ():
        results[("hf_eager_base", b)] = hx.measure(lambda n, b=b: model.generate(**kw(b, n)), args.short_tokens, 1)
    for method, ops in (("base_graphs", HF_OPS), ("base_graphs_attn", FAST_OPS))[args.graphs_only:]:
        report = fastlora.patch(model, cuda_graphs=graphs, **ops, **PATCH_EXTRA)
        print(method, report, flush=True)
        if method == "base_graphs_attn" and report.decode_attention != "on":
            fastlora.unpatch(model)
            continue
        for b in batches:
            results[(method, b)] = hx.measure(lambda n, b=b: model.generate(**kw(b, n)), args.new_tokens, args.reps)
            results[(method, b, "replay")] = hx.measure.replay_ms
            if model_runner_stats(model) is not None:
                print(method, b, "graph runner:", model_runner_stats(model), flush=True)
            if args.kernel_split:
                results[(method, b, "kernels")] = hx.kernel_times(lambda n, b=b: model.generate(**kw(b, n)),
                                                                  args.kernel_split)
        fastlora.unpatch(model)


def run_adapters(peft_model, batches, args, kw, names, results):
    """PEFT's own mixed batch, then the PeftModel patched: eager unfused, eager, graphs."""
    import peft_fastlora as fastlora

    graphs = "emulate" if hx.DEVICE == "cpu" else "auto"
    mem = torch.cuda if hx.DEVICE == "cuda" else None
    for b in batches if not args.graphs_only else ():
        results[("peft_native", b)] = hx.measure(
            lambda n, b=b: peft_model.generate(**kw(b, n), adapter_names=names[b]), args.short_tokens, 1)
    mem_peft = mem.memory_allocated() if mem else 0
    if mem:
        mem.reset_peak_memory_stats()
    for method, opts in (("fastlora_eager_unfused", dict(fuse=False, cuda_graphs=False)),
                         ("fastlora_eager", dict(cuda_graphs=False)),
                         ("fastlora_graphs", dict(cuda_graphs=graphs)))[2 if args.graphs_only else 0:]:
        report = fastlora.patch(peft_model, **opts, **PATCH_EXTRA)
        mem_patched = mem.memory_allocated() if mem else 0
        print(report, flush=True)
        steps = args.new_tokens if method == "fastlora_graphs" else args.short_tokens
        for b in batches:
            gen = lambda n, b=b: peft_model.generate(**kw(b, n), adapter_names=names[b])  # noqa: E731
            results[(method, b)] = hx.measure(gen, steps, args.reps if method == "fastlora_graphs" else 1)
            results[(method, b, "replay")] = hx.measure.replay_ms
            if args.kernel_split and method == "fastlora_graphs":
                results[(method, b, "kernels")] = hx.kernel_times(gen, args.kernel_split)
        if method == "fastlora_graphs" and model_runner_stats(peft_model) is not None:
            print("graph runner:", model_runner_stats(peft_model), flush=True)
        fastlora.unpatch(peft_model)
        results[(method, "mem")] = dict(mem_before_patch_gb=mem_peft / 2**30, mem_after_patch_gb=mem_patched / 2**30,
                                        peak_mem_gb=(mem.max_memory_allocated() if mem else 0) / 2**30)
    kinds = ["plain"] + [k for k in args.kinds if k != "plain"] if args.kinds else []
    runs = {}  # (method, batch) -> [(measure, replay ms)] over the rounds
    for _ in range(args.kind_rounds if kinds else 0):  # plain, kind, ..., again: drift hits every kind alike
        for kind in kinds:  # as many adapters again of this kind, the same rows: the kind's cost
            prefix, config = KINDS[kind]
            hx.add_adapters(peft_model, args.adapters, args.rank, prefix=prefix, **config)
            fastlora.patch(peft_model, cuda_graphs=graphs, **PATCH_EXTRA)
            for b in batches:
                rows = [prefix + n[1:] for n in names[b]]
                gen = lambda n, b=b, rows=rows: peft_model.generate(**kw(b, n), adapter_names=rows)  # noqa: E731
                runs.setdefault((f"fastlora_graphs_{kind}", b), []).append(
                    (hx.measure(gen, args.new_tokens, args.reps), hx.measure.replay_ms))
            fastlora.unpatch(peft_model)
            for i in range(args.adapters):  # each kind against the plain adapters alone
                peft_model.delete_adapter(f"{prefix}{i}")
    for key, measured in runs.items():  # the round with the median step, and the median replay
        measured.sort(key=lambda m: m[0][1])
        results[key] = measured[len(measured) // 2][0]
        replays = sorted(r for _, r in measured if r is not None)
        results[key + ("replay",)] = replays[len(replays) // 2] if replays else None


def run_model(shape, args, bw, vers, rows, kernel_rows):
    batches = args.batches
    model = hx.build_base(shape)
    if args.quant:
        hx.quantize_base(model, args.quant)
    wbytes = hx.weight_bytes(model)
    gen_ids = {b: torch.randint(3, 1000, (b, args.prompt), device=hx.DEVICE) for b in batches}

    def kw(b, n):
        return dict(input_ids=gen_ids[b], attention_mask=torch.ones_like(gen_ids[b]), max_new_tokens=n,
                    min_new_tokens=n, do_sample=False, pad_token_id=0)

    results = {}
    run_base(model, batches, args, kw, results)
    gc.collect()
    if hx.DEVICE == "cuda":
        torch.cuda.empty_cache()
    peft_model = hx.add_adapters(model, args.adapters, args.rank)
    names = {b: hx.round_robin(b, args.adapters) for b in batches}
    run_adapters(peft_model, batches, args, kw, names, results)

    for b in batches:
        used = min(b, args.adapters)
        peft, hf = results.get(("peft_native", b)), results.get(("hf_eager_base", b))
        # fastlora_graphs runs with fastlora's decode attention when it could be enabled: its
        # base-model reference is then the base model with the same attention
        ref = "base_graphs_attn" if ("base_graphs_attn", b) in results else "base_graphs"
        for method in METHODS:
            if (method, b) not in results:
                continue
            prefill, decode, toks = results[(method, b)]
            replay = results.get((method, b, "replay"))
            base_ref = ref if method in ("fastlora_graphs", "base_graphs_attn") else "base_graphs"
            n = toks.shape[1] - args.prompt
            lora = 0 if "base" in method else used * hx.lora_bytes_per_adapter(shape, args.rank)
            floor_bytes = wbytes + lora + hx.kv_bytes(shape, b, args.prompt + n / 2)
            floors = hx.floor_columns(decode, floor_bytes, bw, vers["gpu"])
            match = ""
            if peft is not None and "base" not in method:
                k = min(toks.shape[1], peft[2].shape[1])
                match = f"{(toks[:, args.prompt:k] == peft[2][:, args.prompt:k]).float().mean().item():.3f}"
            mrow = results.get((method, "mem"), {})
            rows.append(dict(**vers, model=hx.model_label(shape), batch=b,
                             adapters=0 if "base" in method else args.adapters, rank=args.rank, method=method,
                             new_tokens=n, prefill_ms=round(prefill, 2), decode_ms_per_step=round(decode, 3),
                             tokens_per_s=round(1e3 * b / decode, 1),
                             ratio_to_base_graphs=(round(decode / results[(base_ref, b)][1], 3)
                                                   if (base_ref, b) in results else ""),
                             ratio_to_plain_twin=(round(decode / results[("fastlora_graphs_plain", b)][1], 3)
                                                  if method.startswith("fastlora_graphs_")
                                                  and ("fastlora_graphs_plain", b) in results else ""),
                             base_reference=base_ref,
                             ratio_to_hf_eager_base=round(decode / hf[1], 3) if hf is not None else "",
                             **floors,
                             # the replayed step's GPU time alone, and against the floor
                             graph_replay_ms=round(replay, 3) if replay else "",
                             replay_to_floor=round(replay / floors["floor_ms"], 3) if replay else "",
                             speedup_vs_peft=round(peft[1] / decode, 2) if peft is not None else "",
                             greedy_match_vs_peft=match, copy_bw_tbs=round(bw / 1e12, 3),
                             **{k: round(v, 2) for k, v in mrow.items()}))
            if args.kernel_split:  # the step's kernels by family; GEMMs + attention alone against the floor
                ks = results.get((method, b, "kernels"))
                split = hx.kernel_split(ks) if ks else {}
                rows[-1].update({k: split.get(k, "") for k in ("gemm_us", "attention_us", "lora_us", "other_us",
                                                               "kernels_us")})
                rows[-1]["gemm_attention_to_floor"] = (
                    round((split["gemm_us"] + split["attention_us"]) / 1e3 / floors["floor_ms"], 3) if ks else "")
                for r in ks or ():
                    kernel_rows.append(dict(model=rows[-1]["model"], batch=b, method=method, **r))
    peft_model = model = None  # (the lambdas above close over both names: rebinding frees them too)
    gc.collect()
    if hx.DEVICE == "cuda":
        torch.cuda.empty_cache()


def plot(rows, path):
    """Decode tokens/s by method and batch, one panel a model, log scale."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5), squeeze=False)
    for ax, m in zip(axes[0], models):
        sub = [r for r in rows if r["model"] == m]
        methods = list(dict.fromkeys(r["method"] for r in sub))
        batches = sorted({int(r["batch"]) for r in sub})
        w = 0.8 / len(methods)
        for i, meth in enumerate(methods):
            ys = [next(float(r["tokens_per_s"]) for r in sub if r["method"] == meth and int(r["batch"]) == b)
                  for b in batches]
            ax.bar([j + i * w for j in range(len(batches))], ys, w, label=meth)
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
        ax.set_yscale("log")
        ax.set_ylabel("decode tokens/s (log)")
        ax.set_title(f"{m}, {sub[0]['gpu']}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def apply_flags(args) -> dict:
    """The patch options the A/B flags ask for (``PATCH_EXTRA``: public options and ``Tuning``); the
    settings every CSV row records."""
    if args.stream_gemm == "off":
        PATCH_EXTRA["stream_gemm"] = False
    if args.narrow_gemms == "off":  # layers narrower than the narrow limit keep cuBLAS
        from peft_fastlora import Tuning

        default = Tuning()
        PATCH_EXTRA["tuning"] = default.replace(stream_min_n=default.stream_narrow_n)
    return dict(stream_gemm=args.stream_gemm, narrow_gemms=args.narrow_gemms)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["1b", "8b"], choices=sorted(hx.SHAPES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32, 128])
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--short-tokens", type=int, default=8, help="new tokens for the slow eager methods")
    p.add_argument("--reps", type=int, default=2)
    hx.add_run_args(p)
    p.add_argument("--name", default="generate",
                   help="the CSV's stem: <name>_<model>[_<tag>]_<gpu>.csv, one file a model (and a PNG)")
    p.add_argument("--tag", default="", help="added to the file names (an A/B's side)")
    p.add_argument("--csv", default=None, help="instead, one file in --out for every model's rows")
    p.add_argument("--kinds", nargs="*", default=[], choices=sorted(KINDS),  # (plain is always added)
                   help="also the same rows through as many adapters of these kinds (fastlora_graphs_<kind>), "
                        "beside as many plain ones again (fastlora_graphs_plain: the like-for-like reference)")
    p.add_argument("--kind-rounds", type=int, default=1,
                   help="measure the kinds (and their plain twin) this many times in turn; each row is the "
                        "round with the median step (and the median replay)")
    p.add_argument("--quant", choices=hx.QUANTS, default=None,
                   help="every method over a bitsandbytes base (QLoRA's); add it to --name or --tag")
    p.add_argument("--graphs-only", action="store_true",
                   help="only fastlora_graphs and base_graphs_attn (the graphed step and its like-for-like base)")
    p.add_argument("--kernel-split", type=int, default=0, metavar="STEPS",
                   help="the graphed rows' step time by kernel family over STEPS steps (GEMMs, attention, LoRA, "
                        "other), GEMMs + attention alone against the floor, and <csv stem>_kernels.csv")
    p.add_argument("--stream-gemm", choices=["auto", "off"], default="auto",
                   help="off: the base GEMMs on cuBLAS (patch(stream_gemm=False)), for an A/B")
    p.add_argument("--narrow-gemms", choices=["on", "off"], default="on",
                   help="off: layers narrower than 4,096 outputs (a 1B model's q/k/v, o, down) keep cuBLAS, for an A/B")
    args = p.parse_args(argv)
    if args.kind_rounds < 1:
        p.error(f"--kind-rounds must be at least 1, got {args.kind_rounds}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if not hx.start(args, "bench_generate"):
        return 0
    vers = dict(hx.versions(), **apply_flags(args))
    bw = hx.copy_bandwidth()
    print(vers, f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    all_rows = []
    for shape in args.models:
        rows, kernel_rows = [], []
        run_model(shape, args, bw, vers, rows, kernel_rows)
        all_rows += rows
        if args.out and not args.csv:
            stem = "_".join(x for x in (args.name, shape, args.tag) if x)
            path = hx.write_csv(rows, hx.out_path(args.out, stem, vers["gpu"]))
            plot(rows, os.path.splitext(path)[0] + ".png")
            if kernel_rows:
                hx.write_csv(kernel_rows, os.path.splitext(path)[0] + "_kernels.csv")
    if args.out and args.csv:
        path = hx.write_csv(all_rows, os.path.join(args.out, args.csv))
        plot(all_rows, os.path.splitext(path)[0] + ".png")
    cols = ["model", "batch", "method", "prefill_ms", "decode_ms_per_step", "graph_replay_ms", "tokens_per_s",
            "ratio_to_base_graphs", "ratio_to_hf_eager_base", "ratio_to_floor", "ratio_to_spec_floor",
            "replay_to_floor", "speedup_vs_peft", "greedy_match_vs_peft"]
    cols += ["gemm_us", "attention_us", "kernels_us", "gemm_attention_to_floor"] if args.kernel_split else []
    cols += ["ratio_to_plain_twin"] if args.kinds else []
    print(" | ".join(cols))
    for r in all_rows:
        print(" | ".join(str(r[c]) for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
