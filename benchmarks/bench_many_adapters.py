"""Hundreds of registered adapters served from M GPU slots, against all of them resident, against the
same base model patched by fastlora (no adapters) and against the unpatched HF model, in one run.

    python benchmarks/bench_many_adapters.py --model 8b --adapters 512 --slots 64   # many_adapters_8b_h100.csv
    python benchmarks/bench_many_adapters.py --smoke      # CPU: checks the script, measures nothing

Random-weight Llama shape in bf16. One PEFT adapter (rank 8) makes the LoRA layers; ``--adapters``
more, of ranks drawn from ``--ranks``, are registered by name from state dicts
(``fastlora.register_adapters``: pinned CPU memory, no PEFT modules). Batches of ``--batch`` rows
draw their adapters from a Zipf distribution over the registered ones. Modes:

- ``base_patched``: the base model patched by fastlora, no adapters, the same batches (the
  like-for-like reference of the two adapter modes);
- ``hf_base``: the unpatched HF base model, the same batches;
- ``slots``: the stacks hold ``--slots`` adapters, loaded on demand (least recently used out);
- ``resident``: every adapter in the stacks.

Per mode: time to first token of a fresh batch, loads included (``generate`` with one new token),
p50 / p99; steady-state decode, output tokens/s over batches of ``--new`` tokens each (loads
included), and its time per token against ``base_patched`` and ``hf_base``; the decode step (ms)
with ``--batch`` distinct adapters in the batch and with none (the base step), from (time of T new
tokens - time of 1) / (T - 1); GPU memory allocated, the stacks' bytes (beside all the adapters' own
bytes), the CPU store's bytes and the process's resident memory.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as hx  # noqa: E402


def rss_gb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def zipf_batch(rng, names, rows, s):
    weights = [1 / (k + 1) ** s for k in range(len(names))]
    return rng.choices(names, weights, k=rows)


def decode_ms(model, ids, names, new):
    kw = dict(adapter_names=names) if names is not None else {}

    def gen(k):
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                           do_sample=False, pad_token_id=0, **kw)

    _, step, _ = hx.measure(gen, new, reps=3)
    return step


def profile_decode(model, batches, args, mode, new=None):
    """cProfile of ``generate`` of ``new`` tokens (default --new) over these batches: the top
    functions by own and by cumulative time, written to ``many_adapters_profile_<mode>.txt``."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    with torch.no_grad():
        prof.enable()
        for ids, batch in batches:
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=batch,
                           max_new_tokens=new or args.new, min_new_tokens=new or args.new, do_sample=False,
                           pad_token_id=0)
        hx.sync()
        prof.disable()
    text = io.StringIO()
    text.write(f"{mode}: {len(batches)} batches in {time.perf_counter() - t0:.3f} s under the profiler\n")
    for key, n in (("tottime", 45), ("cumulative", 70)):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(n)
    path = os.path.join(args.out or ".", f"many_adapters_profile_{mode}.txt")
    with open(path, "w") as f:
        f.write(text.getvalue())
    print(f"written {path}", file=sys.stderr)


def kernel_profile(model, ids, names, steps, args, tag):
    """``harness.kernel_times`` of a decode step with these rows' adapters, over ``steps``
    steps, printed and written to ``many_adapters_kernels_<tag>.csv`` under --out."""
    def gen(k):
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=names,
                       max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0)

    rows = [dict(tag=tag, **r) for r in hx.kernel_times(gen, steps)]
    print(f"{tag}: {hx.kernel_split(rows)} us a step; top: "
          + "; ".join(f"{r['kernel'][:40]} {r['us_per_step']:.0f}" for r in rows[:6]), file=sys.stderr)
    if args.out and rows:
        hx.write_csv(rows, os.path.join(args.out, f"many_adapters_kernels_{tag}.csv"))


def batch_ids(args, k):
    g = torch.Generator().manual_seed(k)
    return torch.randint(3, hx.SHAPES[args.model]["vocab_size"], (args.batch, args.prompt), generator=g).to(hx.DEVICE)


def traffic(model, args, names, rng):
    """First-token times over ``--ttft-batches`` fresh batches, then decode tokens/s over
    ``--decode-batches`` batches of ``--new`` tokens, and the distinct adapters of those (``names``
    None: the model serves no adapters, the same prompts)."""
    def gen(ids, batch, new):
        kw = dict(adapter_names=batch) if batch is not None else {}
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=0, **kw)

    draw = (lambda: zipf_batch(rng, names, args.batch, args.zipf)) if names else (lambda: None)
    gen(batch_ids(args, -1), names[:1] * args.batch if names else None, 1)  # prefill compiled before the clock
    ttft = []
    for k in range(args.ttft_batches):  # fresh batches: loads of adapters not in slots included
        ids, batch = batch_ids(args, k), draw()
        hx.sync()
        t0 = time.perf_counter()
        gen(ids, batch, 1)
        hx.sync()
        ttft.append(time.perf_counter() - t0)
    tokens, distinct, t0 = 0, [], time.perf_counter()
    for k in range(args.decode_batches):
        batch = draw()
        distinct.append(len(set(batch)) if batch else 0)
        gen(batch_ids(args, 100 + k), batch, args.new)
        tokens += args.batch * args.new
    hx.sync()
    ttft.sort()
    return dict(ttft_p50_s=round(ttft[len(ttft) // 2], 4),
                ttft_p99_s=round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 4),
                decode_tokens_per_s=round(tokens / (time.perf_counter() - t0), 1),
                mean_distinct_per_batch=round(sum(distinct) / len(distinct), 1))


def memory_columns() -> dict:
    return dict(gpu_allocated_gb=round(torch.cuda.memory_allocated() / 2**30, 2) if hx.DEVICE == "cuda" else 0,
                process_rss_gb=round(rss_gb(), 2))


def run_base(base, args, mode, rows_out, info):
    """The base model alone on the same prompts: patched by fastlora (``base_patched``) or not."""
    import peft_fastlora as fastlora

    if mode == "base_patched":
        print(fastlora.patch(base, tuning=args.tuning), file=sys.stderr)
        fastlora.warmup(base, batch_sizes=[args.batch], max_length=args.prompt + args.new + 2)
    row = dict(mode=mode, model=args.model, registered=0, slots=0, batch=args.batch, prompt=args.prompt,
               new=args.new, zipf=args.zipf, **traffic(base, args, None, random.Random(args.seed)))
    row["base_step_ms"] = round(decode_ms(base, batch_ids(args, 999), None, args.step_tokens), 3)
    row["base_replay_ms"] = hx.measure.replay_ms and round(hx.measure.replay_ms, 3)
    row.update(memory_columns(), **info)
    if mode == "base_patched":
        fastlora.unpatch(base)
    print(row, file=sys.stderr)
    rows_out.append(row)


def run_mode(model, adapters, args, slots, rows_out, info):
    import peft_fastlora as fastlora

    fastlora.patch(model, max_loras_per_batch=slots, tuning=args.tuning)
    t = time.perf_counter()
    fastlora.register_adapters(model, adapters)
    hx.sync()
    register_s = time.perf_counter() - t
    state = fastlora.get_state(model)
    mode = "slots" if slots else "resident"
    names = sorted(adapters, key=lambda n: int(n[1:]))
    rng = random.Random(args.seed)
    fastlora.warmup(model, batch_sizes=[args.batch], max_length=args.prompt + args.new + 2)
    if args.gc_freeze:  # what a server does once it is set up: the objects of now are never scanned again
        gc.collect()
        gc.freeze()
    measured = traffic(model, args, names, rng)
    if args.profile:  # the host's time by function, over more batches of the same traffic (after the clock)
        profile_decode(model, [(batch_ids(args, 200 + k), zipf_batch(rng, names, args.batch, args.zipf))
                               for k in range(args.decode_batches)], args, mode)
        # fresh batches of one token each: what a first token waits for on the host (loads, staging)
        profile_decode(model, [(batch_ids(args, 300 + k), zipf_batch(rng, names, args.batch, args.zipf))
                               for k in range(args.ttft_batches)], args, f"{mode}_first_token", new=1)
    ids = batch_ids(args, 999)
    spread = [names[(k * 7) % len(names)] for k in range(args.batch)]  # --batch distinct adapters
    mixed = decode_ms(model, ids, spread, args.step_tokens)
    mixed_folded = state.last_fold  # the per-call choice of that call (staged sites: its blocks fit)
    mixed_replay = hx.measure.replay_ms
    base = decode_ms(model, ids, ["__base__"] * args.batch, args.step_tokens)
    base_replay = hx.measure.replay_ms
    if args.kernel_profile:
        tag = f"{mode}_{len(adapters)}"
        kernel_profile(model, ids, spread, args.kernel_profile, args, f"{tag}_distinct")
        kernel_profile(model, ids, ["__base__"] * args.batch, args.kernel_profile, args, f"{tag}_base")
    stats = dict(state.registry.stats)
    row = dict(mode=mode, model=args.model, registered=len(adapters), slots=slots or len(adapters),
               batch=args.batch, prompt=args.prompt, new=args.new, zipf=args.zipf, register_s=round(register_s, 2),
               **measured, mixed_step_ms=round(mixed, 3), mixed_folded=mixed_folded,
               base_step_ms=round(base, 3), mixed_replay_ms=mixed_replay and round(mixed_replay, 3),
               base_replay_ms=base_replay and round(base_replay, 3),
               mixed_vs_base=round(mixed / base, 3), shrink_folded=state.report.shrink_folded,
               loads=stats["loads"], evictions=stats["evictions"],
               load_s=round(stats["load_seconds"], 3), block_moves=stats.get("block_moves", 0),
               stack_gb=round(state.report.stack_bytes / 2**30, 2),
               # every registered adapter's own weights (the stacks hold the resident ones)
               adapter_gb=round(state.report.adapter_bytes / 2**30, 2),
               cpu_store_gb=round(state.report.store_bytes / 2**30, 2), **memory_columns(), **info)
    for ref in rows_out:  # time per output token against the base model's runs of the same batches
        if ref["mode"] in ("base_patched", "hf_base"):
            row[f"decode_time_per_token_vs_{ref['mode']}"] = round(
                ref["decode_tokens_per_s"] / row["decode_tokens_per_s"], 3)
    print(row, file=sys.stderr)
    rows_out.append(row)
    gc.unfreeze()
    fastlora.unpatch(model)


MODES = ["base_patched", "hf_base", "slots", "resident"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="8b", choices=sorted(hx.SHAPES))
    p.add_argument("--adapters", type=int, default=512)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--targets", nargs="+", default=["q_proj", "k_proj", "v_proj", "o_proj"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--ttft-batches", type=int, default=30)
    p.add_argument("--decode-batches", type=int, default=6)
    p.add_argument("--step-tokens", type=int, default=32)
    p.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    p.add_argument("--seed", type=int, default=0)
    hx.add_run_args(p)
    p.add_argument("--fold-limit", type=float, default=None,
                   help="most A rows per base row for a site to fold its shrink into the base GEMM "
                        "(Tuning.fold_max_share; large: every site folds)")
    p.add_argument("--fold-call-share", type=float, default=None,
                   help="most A rows per base row for a site to fold for the calls that use enough of them "
                        "(Tuning.fold_call_share; 0: no per-call folds)")
    p.add_argument("--tag", default="", help="added to the CSV's name (an A/B's side)")
    p.add_argument("--gc-freeze", action="store_true",
                   help="gc.freeze() once the adapters are registered and the model warmed up (as servers do)")
    p.add_argument("--kernel-profile", type=int, default=0, metavar="STEPS",
                   help="after the measurement, the GPU time by kernel of the distinct and the base step "
                        "over STEPS decode steps (many_adapters_kernels_<mode>_<n>_*.csv)")
    p.add_argument("--profile", action="store_true",
                   help="after the measurement, profile the host over as many more decode batches per mode")
    args = p.parse_args(argv)
    if not hx.start(args, "bench_many_adapters"):
        return 0
    from peft_fastlora import Tuning

    tuning = Tuning()
    if args.fold_limit is not None:
        tuning = tuning.replace(fold_max_share=args.fold_limit)
    if args.fold_call_share is not None:
        tuning = tuning.replace(fold_call_share=args.fold_call_share)
    args.tuning = tuning
    if args.smoke:
        args.model, args.adapters, args.slots, args.ranks = "tiny", 12, 6, [2, 4, 8]
        args.batch, args.prompt, args.new, args.ttft_batches, args.decode_batches, args.step_tokens = 6, 8, 4, 3, 2, 4
    from peft import LoraConfig, get_peft_model

    info = dict(hx.versions(), gc_frozen=args.gc_freeze,
                fold_call_share="library" if args.fold_call_share is None else args.fold_call_share)
    path = hx.out_path(args.out, "_".join(x for x in ("many_adapters", args.model, args.tag) if x), info["gpu"])
    base = hx.build_base(args.model)
    rows = []
    for mode in [m for m in MODES if m in args.modes and m in ("base_patched", "hf_base")]:
        run_base(base, args, mode, rows, info)  # before PEFT wraps the base model's layers
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=args.targets), adapter_name="seed",
                           autocast_adapter_dtype=False).eval()
    t = time.perf_counter()
    adapters = hx.adapter_state_dicts(model, args.adapters, args.ranks, args.targets, args.seed, pin=hx.DEVICE == "cuda")
    print(f"{args.adapters} adapters made in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    for mode in [m for m in ("slots", "resident") if m in args.modes]:
        run_mode(model, adapters, args, args.slots if mode == "slots" else None, rows, info)
        if path:
            hx.write_csv(rows, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
