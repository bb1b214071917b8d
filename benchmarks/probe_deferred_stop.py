"""Probe (#13): how much of a graphed decode step is the per-step synchronisation of
transformers' loop?

``generate`` checks after every step whether all rows have finished (``StopCheck``: a
device-to-host read), so the host prepares the next step while the GPU waits. transformers has a
deferred check (``DeferredStopCheck``: the flag is read one step late, the one extra step undone)
that it enables on "mps" only. This probe enables it on CUDA *inside this process only* (a
monkeypatch of ``is_supported``, never done by the library) and times the patched model's graphed
step both ways, with the replays' GPU time, then checks that the tokens are equal both ways, for
calls stopped by length and by an end-of-sequence token.

    python benchmarks/probe_deferred_stop.py --model 8b --out benchmarks/results/probe_deferred_stop_h200.csv
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_generate as bg  # noqa: E402
import peft_fastlora as fastlora  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bg.add_model_args(p, adapters=8)
    bg.add_decode_args(p, new_tokens=64, reps=3)
    args = p.parse_args(argv)
    if args.smoke:
        bg.DEVICE, args.model, args.batches, args.new_tokens, args.reps = "cpu", "tiny", [2], 4, 1
    from transformers.generation import utils as gen_utils

    deferred = gen_utils.DeferredStopCheck
    original_is_supported, original_init = deferred.__dict__["is_supported"], deferred.__init__

    def internal_cache_init(self, input_ids, max_length, cache, cache_is_returned, streamer=None):
        # fastlora's static caches are its own and reset by each call: none to roll back
        original_init(self, input_ids, max_length, cache, False, streamer)
    model = bg.add_adapters(bg.build_base(args.model), args.adapters, args.rank)
    print(fastlora.patch(model, cuda_graphs="auto" if bg.DEVICE == "cuda" else "emulate"), flush=True)
    modes = ("sync", "deferred") if bg.DEVICE == "cuda" else ("sync",)  # (no CPU events: CUDA only)
    rows, info = [], bg.versions()
    for b in args.batches:
        ids = torch.randint(3, 1000, (b, args.prompt), device=bg.DEVICE)
        names = [f"a{i % args.adapters}" for i in range(b)]
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                  adapter_names=names)
        tokens = {}
        for mode in modes:
            if mode == "deferred":
                deferred.is_supported = staticmethod(lambda device, cache, returned, is_assistant: not is_assistant)
                deferred.__init__ = internal_cache_init
            try:
                _, step, out = bg.measure(lambda n: model.generate(**kw, max_new_tokens=n, min_new_tokens=n),
                                          args.new_tokens, args.reps)
                replay = bg.measure.replay_ms
                # stopped by an end-of-sequence token: the first row's token at step 5 of the first call
                eos = int(out[0, args.prompt + min(4, args.new_tokens - 1)])
                eos_out = model.generate(**kw, max_new_tokens=args.new_tokens, eos_token_id=eos)
            finally:
                deferred.is_supported, deferred.__init__ = original_is_supported, original_init
            tokens[mode] = (out, eos_out)
            rows.append(dict(**info, model=args.model, batch=b, mode=mode, decode_ms_per_step=round(step, 3),
                             graph_replay_ms=round(replay, 3) if replay else ""))
            print(rows[-1], flush=True)
        if "deferred" in tokens:
            same = [torch.equal(x, y) for x, y in zip(tokens["sync"], tokens["deferred"])]
            print(f"batch {b}: tokens equal with the deferred check: by length {same[0]}, by eos {same[1]}",
                  flush=True)
            for r in rows[-2:]:
                r["tokens_equal_length_stop"], r["tokens_equal_eos_stop"] = same
    if args.out and not args.smoke:
        print("written", bg.write_csv(rows, os.path.dirname(args.out) or ".", os.path.basename(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
