"""Where the time between two graph replays goes (#13): a graphed decode step of ``generate`` is
the replay's GPU time plus a gap in which the GPU waits for the host (transformers' loop
synchronises at every step) or runs work outside the graph (logits, token selection).

Times one graphed ``generate`` call of the patched model (8 adapters r16, batch 32), the GPU time
of its replays (``bench_generate.ReplayTimes``), then profiles the same call with cProfile and
prints the functions with the most own time and the most cumulative time. ``--sync-debug``: then
one more call under ``torch.cuda.set_sync_debug_mode("warn")``, counting each place (the innermost
frames outside torch) that made the host wait for the GPU.

    python benchmarks/host_gap.py --model 8b
"""

import argparse
import cProfile
import collections
import io
import os
import pstats
import sys
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_generate as bg  # noqa: E402
import peft_fastlora as fastlora  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="1b", choices=sorted(bg.SHAPES))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--base", action="store_true", help="the model without adapters (bench_generate's base rows)")
    p.add_argument("--first-token", action="store_true",
                   help="profile calls of one new token (the prefill and the call's set-up: first-token latency)")
    p.add_argument("--sync-debug", action="store_true", help="count the host's waits for the GPU in one call")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks the script only")
    args = p.parse_args(argv)
    if args.smoke:
        bg.DEVICE, args.model, args.batch, args.new_tokens, args.top = "cpu", "tiny", 2, 4, 5
    model = bg.build_base(args.model)
    model = model if args.base else bg.add_adapters(model, 8, 16)
    ids = torch.randint(3, 1000, (args.batch, 128), device=bg.DEVICE)
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    if not args.base:
        kw["adapter_names"] = [f"a{i % 8}" for i in range(args.batch)]
    print(fastlora.patch(model, cuda_graphs="auto" if bg.DEVICE == "cuda" else "emulate"), flush=True)
    gen = lambda n: model.generate(**kw, max_new_tokens=n, min_new_tokens=n)  # noqa: E731
    _, step, _ = bg.measure(gen, args.new_tokens, 2)
    print(f"decode step {step:.3f} ms, replay (GPU) {bg.measure.replay_ms} ms", flush=True)
    calls, tokens = (5, 1) if args.first_token else (1, args.new_tokens)
    if args.first_token:
        t1, _, _ = bg.measure(gen, 2, 3)
        print(f"first token (a call of one new token) {t1:.2f} ms", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        gen(tokens)
        bg.sync()
    prof.disable()
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
        print(f"# by {key}, {calls} call(s) of {tokens} new token(s)")
        print("\n".join(line[:180] for line in out.getvalue().splitlines()[5:]), flush=True)
    if args.sync_debug and bg.DEVICE == "cuda":
        print(f"# host waits for the GPU in one call of {args.new_tokens} new tokens (innermost frames outside torch)")
        for where, n in count_syncs(lambda: gen(args.new_tokens)).most_common(args.top):
            print(f"{n:6d}  {where}")
    return 0


def count_syncs(call):
    """Run ``call`` with CUDA's sync debug mode warning, and count where each wait came from."""
    places = collections.Counter()
    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename
                  and "warnings" not in f.filename]
        places[" <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[-3:][::-1])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
            bg.sync()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = show
    return places


if __name__ == "__main__":
    sys.exit(main())
