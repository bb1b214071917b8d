"""Soak: many ``generate`` calls as a server would see them, on a patched model, with memory watched.

Each call draws a batch size (1 to --max-rows), left-padded prompts (1 to --max-prompt tokens per
row), new tokens (1 to --max-new), a random mix of adapters and ``"__base__"``, and samples in a
quarter of the calls. Half-way (half the calls, or half of --time-limit, whichever comes first)
one adapter is added and another deleted. The first call, and the first after that change, is the
largest shape the soak draws from, after ``fastlora.warmup`` has captured every bucket (what a
server would do at its start and after changing its adapters, which drops the graphs), so that
"memory after the change no higher than before it" tests that nothing accumulates, not the luck of
the draw. (Without the second warm-up, the graphs are captured again as traffic needs them and
PyTorch's caching allocator, emptied with the old graphs' pool, keeps one more block size for each
new largest prefill: reserved memory grows in steps while allocated memory stays flat.) The summary's
``memory_bounded`` compares the reserved peaks after and before the change; ``allocated_flat`` asks
that in each half no call leaves more allocated than its first call did.

With --compare-peft (the tiny fp32 models), every greedy call is also run on an identical
unpatched model and the tokens compared. Where they differ, the first differing step is looked up
in PEFT's scores: a flip between two logits closer than --tie-tol is a rounding tie (fp32 sums in
another order: the fused q/k/v GEMM, rows padded to the graph bucket), anything else a mismatch.

    python benchmarks/soak_graphs.py --model tiny-llama --calls 300 --compare-peft    # soak_tiny-llama_h200.csv
    python benchmarks/soak_graphs.py --model 8b --calls 50
    python benchmarks/soak_graphs.py --model 8b --min-rows 65 --max-rows 128 --tag 65_128
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as hx  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)


def tiny_peft(arch: str, device: str):
    """A tiny fp32 model with six adapters of ranks 2-32 (half on all projections, half on q/v)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    cfg_cls = {"tiny-llama": transformers.LlamaConfig, "tiny-qwen2": transformers.Qwen2Config,
               "tiny-gemma2": transformers.Gemma2Config}[arch]
    torch.manual_seed(0)
    extra, attn = {}, {}
    if arch == "tiny-qwen2":
        extra = dict(use_sliding_window=False)
    elif arch == "tiny-gemma2":  # sliding and full layers (a window every call fits: graphed), soft-capping,
        # GELU-tanh MLPs, eager attention as transformers runs Gemma 2
        extra = dict(head_dim=32, sliding_window=1024, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                     query_pre_attn_scalar=32)
        attn = dict(attn_implementation="eager")
    base = transformers.AutoModelForCausalLM.from_config(cfg_cls(**TINY, **extra), **attn).to(device).eval()
    base.generation_config.eos_token_id = None
    model = None
    for i, r in enumerate([2, 4, 8, 16, 32, 8]):
        cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=ALL if i % 2 == 0 else ["q_proj", "v_proj"],
                         init_lora_weights=False)
        if model is None:
            model = get_peft_model(base, cfg, adapter_name=f"a{i}")
        else:
            model.add_adapter(f"a{i}", cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(0.05)
    return model.eval()


def draw(rng: random.Random, args, names, first: bool):
    rows = args.max_rows if first else rng.randint(args.min_rows, args.max_rows)
    lengths = [args.max_prompt if first else rng.randint(1, args.max_prompt) for _ in range(rows)]
    new = args.max_new if first else rng.randint(1, args.max_new)
    mix = [rng.choice(names + ["__base__"]) for _ in range(rows)]
    sample = (not first) and rng.random() < 0.25
    return rows, lengths, new, mix, sample


def batch(lengths, vocab, device, seed):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, width - n:] = 1
    return dict(input_ids=ids.to(device), attention_mask=mask.to(device))


def classify(out, want, scores, prompt_width, tie_tol):
    """(rows equal, rows that part at a rounding tie, rows that part otherwise, smallest gap seen)."""
    equal = ties = other = 0
    worst = None
    for r in range(out.shape[0]):
        if torch.equal(out[r], want[r]):
            equal += 1
            continue
        diff = (out[r, prompt_width:] != want[r, prompt_width:]).nonzero()
        step = int(diff[0]) if len(diff) else 0
        top2 = scores[step][r].float().topk(2).values
        gap = float(top2[0] - top2[1])
        worst = gap if worst is None else max(worst, gap)
        if gap <= tie_tol:
            ties += 1
        else:
            other += 1
    return equal, ties, other, worst


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama", choices=["tiny-llama", "tiny-qwen2", "tiny-gemma2", "1b", "8b"])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--min-rows", type=int, default=1,
                   help="the fewest rows a call draws (65 with --max-rows 128: every call in ops.glu_lora's range)")
    p.add_argument("--max-rows", type=int, default=300)
    p.add_argument("--max-prompt", type=int, default=600)
    p.add_argument("--max-new", type=int, default=90)
    p.add_argument("--compare-peft", action="store_true")
    p.add_argument("--tie-tol", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds for the whole run, the model's build and warm-up included: no call starts "
                        "that the longest so far says would end past it (the summary says how many ran)")
    p.add_argument("--out", default=hx.RESULTS)
    p.add_argument("--tag", default="", help="added to the CSV's name")
    p.add_argument("--smoke", action="store_true", help="CPU, emulated graphs, tiny sizes: checks the script")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    if not 1 <= args.min_rows <= args.max_rows:
        p.error(f"--min-rows must be 1 to --max-rows ({args.max_rows}), got {args.min_rows}")
    import peft_fastlora as fastlora
    from peft import LoraConfig

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("soak_graphs needs a CUDA GPU (or --smoke); nothing run")
        return 0
    if args.model in ("1b", "8b"):
        hx.DEVICE = device
        model = hx.add_adapters(hx.build_base(args.model), 8, 16)
        vocab, refs = 128256, None
    else:
        model = tiny_peft(args.model, device)
        vocab = TINY["vocab_size"]
        refs = tiny_peft(args.model, device) if args.compare_peft else None
    report = fastlora.patch(model, cuda_graphs="emulate" if args.smoke else "auto")
    print(report, flush=True)
    # as a server would: every bucket the traffic can reach captured before it, caches sized for the
    # longest call
    runner = fastlora.get_state(model).graph_runner
    top = runner.bucket_for(min(args.max_rows, runner.buckets[-1])) if runner is not None else None
    buckets = [b for b in runner.buckets if b <= top] if runner is not None else None
    warm = fastlora.warmup(model, batch_sizes=buckets, max_length=args.max_prompt + args.max_new)
    print(warm, flush=True)
    rng = random.Random(args.seed)
    names = sorted(report.adapters)
    rows_out, errors = [], []
    cuda = device == "cuda"
    change_at, rewarm = None, None
    longest = 0.0  # the longest call so far, its PEFT reference included
    for i in range(args.calls):
        elapsed = time.perf_counter() - t_start
        if args.time_limit is not None and elapsed + longest > args.time_limit:
            print(f"time limit reached after {i} calls", flush=True)
            break
        half_time = args.time_limit is not None and elapsed > args.time_limit / 2
        if change_at is None and (i == args.calls // 2 or half_time):  # one adapter added, one deleted
            for m in [model] + ([refs] if refs is not None else []):
                torch.manual_seed(99)
                m.add_adapter("late", LoraConfig(r=12, lora_alpha=24, target_modules=["o_proj", "up_proj", "v_proj"],
                                                 init_lora_weights=False))
                m.delete_adapter(names[1])
                m.eval()
            names = [n for n in names if n != names[1]] + ["late"]
            rewarm = fastlora.warmup(model, batch_sizes=buckets, max_length=args.max_prompt + args.max_new)
            print(f"call {i}: adapters changed; {rewarm}", flush=True)
            change_at = i
        rows, lengths, new, mix, sample = draw(rng, args, names, first=i in (0, change_at))
        inputs = batch(lengths, vocab, device, seed=i)
        kw = dict(max_new_tokens=new, min_new_tokens=new, pad_token_id=0, adapter_names=mix)
        kw.update(do_sample=True, top_k=50) if sample else kw.update(do_sample=False)
        t0 = time.perf_counter()
        ok, equal, ties, other, gap = True, "", "", "", ""
        try:
            with torch.no_grad():
                if sample:
                    torch.manual_seed(i)
                out = model.generate(**inputs, **kw)
            if cuda:
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - the soak counts every error
            ok = False
            errors.append((i, f"{type(e).__name__}: {e}"))
            print(f"call {i}: ERROR {type(e).__name__}: {e}", flush=True)
        dt = time.perf_counter() - t0
        if ok and refs is not None and not sample:
            with torch.no_grad():
                ref = refs.generate(**inputs, **kw, output_scores=True, return_dict_in_generate=True)
            equal, ties, other, gap = classify(out, ref.sequences, ref.scores, inputs["input_ids"].shape[1],
                                               args.tie_tol)
        longest = max(longest, time.perf_counter() - t0)
        st = fastlora.get_state(model).graph_runner.stats if fastlora.get_state(model).graph_runner else {}
        row = dict(call=i, rows=rows, prompt_width=max(lengths), new_tokens=new, sampling=int(sample),
                   ok=int(ok), seconds=round(dt, 3), rows_equal=equal, rows_tie_flip=ties,
                   rows_mismatch=other, largest_gap_at_flip=gap,
                   captures=st.get("captures", 0), graphs=st.get("graphs", 0),
                   capture_failures=st.get("capture_failures", 0), eager_steps=st.get("eager_steps", 0),
                   cache_mib=round(st.get("cache_bytes", 0) / 2**20, 1),
                   graph_pool_mib=round((st.get("graph_pool_bytes") or 0) / 2**20, 1),
                   reserved_mib=round(torch.cuda.memory_reserved() / 2**20, 1) if cuda else 0,
                   allocated_mib=round(torch.cuda.memory_allocated() / 2**20, 1) if cuda else 0)
        rows_out.append(row)
        if i % 10 == 0 or not ok:
            print(row, flush=True)
        else:  # (a run stopped from outside still shows every call's shape and comparison)
            compared = f", rows equal / tie flip / mismatch {equal} / {ties} / {other}" if equal != "" else ""
            print(f"call {i}: {rows} rows, {new} new tokens, {'sampled' if sample else 'greedy'}, ok {int(ok)}, "
                  f"{dt:.1f} s{compared}", flush=True)
    # before and after the change (no change made: the two halves of the calls)
    half = change_at if change_at is not None else len(rows_out) // 2
    before, after = rows_out[:half], rows_out[half:]
    peak = lambda rows, key: max((r[key] for r in rows), default=0)  # noqa: E731
    greedy = [r for r in rows_out if r["rows_equal"] != ""]
    summary = dict(model=args.model, calls=len(rows_out), errors=len(errors),
                   greedy_calls_compared=len(greedy),
                   greedy_calls_token_equal=sum(r["rows_tie_flip"] == 0 and r["rows_mismatch"] == 0 for r in greedy),
                   rows_compared=sum(r["rows"] for r in greedy),
                   rows_tie_flip=sum(r["rows_tie_flip"] for r in greedy),
                   rows_mismatch=sum(r["rows_mismatch"] for r in greedy),
                   adapter_change_at=change_at,
                   reserved_mib_before_max=peak(before, "reserved_mib"),
                   reserved_mib_after_max=peak(after, "reserved_mib"),
                   allocated_mib_before_max=peak(before, "allocated_mib"),
                   allocated_mib_after_max=peak(after, "allocated_mib"),
                   memory_bounded=bool(after) and peak(after, "reserved_mib") <= peak(before, "reserved_mib"),
                   # each window's first call is its largest shape, after a warm-up: no later call
                   # of the window may leave more allocated (the caching allocator's reserve aside)
                   allocated_flat=all(peak(w, "allocated_mib") <= w[0]["allocated_mib"] for w in (before, after) if w),
                   seconds=round(time.perf_counter() - t_start, 1),
                   warmup_captures=warm.captures, warmup_s=round(warm.seconds, 2),
                   rewarm_captures=rewarm.captures if rewarm is not None else None)
    final = fastlora.get_state(model).graph_runner.stats if fastlora.get_state(model).graph_runner else {}
    summary.update({f"final_{k}": v for k, v in final.items() if k != "eager_reasons"})
    summary["eager_reasons"] = final.get("eager_reasons", {})
    print("SUMMARY", summary, flush=True)
    for i, e in errors[:20]:
        print(f"error in call {i}: {e}")
    if args.smoke and args.out == hx.RESULTS:  # a smoke run's rows are no result
        return 0 if not errors else 1
    os.makedirs(args.out, exist_ok=True)
    hx.DEVICE = device
    vers = hx.versions()
    stem = "_".join(x for x in ("soak", args.model, args.tag) if x)
    with open(hx.out_path(args.out, stem, vers["gpu"]), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(vers) + list(rows_out[0]))
        w.writeheader()
        for r in rows_out:
            w.writerow({**vers, **r})
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
