"""Answer a JSONL file of requests, each naming its adapter, in mixed-adapter batches.

    python examples/serve_many_adapters.py --base BASE_DIR --adapters ADAPTERS_DIR \\
        --requests requests.jsonl --out answers.jsonl [--batch-size 32] [--max-new-tokens 32]
    python examples/serve_many_adapters.py --tiny      # a demo that needs no files at all
    python examples/serve_many_adapters.py --tiny --continuous   # the same, continuously batched

``ADAPTERS_DIR`` holds one PEFT adapter per sub-folder (saved with ``save_pretrained``); the folder
name is the adapter name. Each request line is ``{"adapter": NAME, "prompt": TEXT}`` (``"__base__"``
for none); each answer line adds ``"completion"``, in request order.

``--continuous`` serves through transformers' continuous batching instead of static batches: every
request is queued at once with its adapter, a finished request leaves the batch at once and a
waiting one takes its place; each answer line then also has ``"latency_s"`` (from queueing to the
last token), and the summary gives the median and 95th percentile.

``--register`` loads no adapter into PEFT: ``fastlora.from_folders`` registers each folder by name,
held in CPU memory and copied into one of ``--slots`` slots (GPU memory on a GPU) when a batch uses
it: hundreds of adapters on one GPU. Each batch then holds at most ``--slots`` distinct adapters (a
request whose adapter does not fit waits for a later batch; answers stay in request order).

``--tiny`` builds a random tiny Llama and a character tokenizer instead of loading ``--base``; what
it is not given it makes in a temporary folder: three random adapters for that base (saved as PEFT
saves them), a requests file, and the answers file (its path is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from typing import List

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

import peft_fastlora as fastlora


def read_requests(path: str) -> List[dict]:
    requests = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            req = json.loads(line)
            if not isinstance(req, dict) or "adapter" not in req or "prompt" not in req:
                raise ValueError(f"{path}:{n}: a request needs 'adapter' and 'prompt', got {line.strip()[:80]}")
            requests.append(req)
    return requests


def tiny_base():
    """The random tiny Llama and character tokenizer of ``--tiny`` (the same on every call)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _chartok import build_char_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        pad_token_id=tokenizer.pad_token_id))
    return base, tokenizer


TINY_ADAPTERS = {  # name -> (rank, alpha, target modules): different ranks and targets on purpose
    "upper": (4, 8, ["q_proj", "v_proj"]),
    "reverse": (8, 32, ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]),
    "sum": (2, 4, ["gate_proj", "up_proj", "down_proj"]),
}
TINY_PROMPTS = ["abc=", "hello=", "12+7=", "xyz", "Fast LoRA!", "q=", "serve=", "a b c"]


def make_tiny_files(args, folder: str) -> None:
    """Fill in what ``--tiny`` was not given: adapters, requests, answers path (in ``folder``)."""
    from peft import LoraConfig, get_peft_model

    if args.adapters is None:
        args.adapters = os.path.join(folder, "adapters")
        for i, (name, (r, alpha, targets)) in enumerate(TINY_ADAPTERS.items()):
            torch.manual_seed(100 + i)
            cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
            get_peft_model(tiny_base()[0], cfg, adapter_name=name).save_pretrained(args.adapters)
    if args.requests is None:
        args.requests = os.path.join(folder, "requests.jsonl")
        names = list(TINY_ADAPTERS) + ["__base__"]
        with open(args.requests, "w") as f:
            for i, prompt in enumerate(TINY_PROMPTS * 2):
                f.write(json.dumps({"adapter": names[i % len(names)], "prompt": prompt}) + "\n")
    if args.out is None:
        args.out = os.path.join(folder, "answers.jsonl")


def load_model(args):
    if args.tiny:
        base, tokenizer = tiny_base()
    else:
        if not args.base:
            raise SystemExit("--base (a model folder) or --tiny is required")
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.base)
        base = AutoModelForCausalLM.from_pretrained(args.base)
    tokenizer.padding_side = "left"  # decoder-only batches are padded on the left
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    names = sorted(d for d in os.listdir(args.adapters) if os.path.isdir(os.path.join(args.adapters, d)))
    if not names:
        raise SystemExit(f"no adapter folders in {args.adapters}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if getattr(args, "register", False):  # patched here: the folders are registered by name
        folders = {n: os.path.join(args.adapters, n) for n in names}
        model = fastlora.from_folders(base.to(device).eval(), folders, max_loras_per_batch=args.slots)
        return model, tokenizer, names
    model = PeftModel.from_pretrained(base, os.path.join(args.adapters, names[0]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(os.path.join(args.adapters, name), adapter_name=name)
    return model.to(device).eval(), tokenizer, names


def patch_and_register(model, args, names):
    """``fastlora.patch`` (a ``--register`` model is patched already, by ``from_folders``)."""
    if getattr(args, "register", False):
        return fastlora.get_state(model).report
    return fastlora.patch(model)


def plan_batches(requests, size, max_adapters=None):
    """Lists of request indices, each at most ``size`` rows and, where ``max_adapters`` is given,
    at most that many distinct adapters (``"__base__"`` rows need none): a patched model with M
    slots takes at most M adapters in one batch. Requests keep their order within and across
    batches, except that a request whose adapter does not fit a batch waits for a later one."""
    waiting, plan = list(range(len(requests))), []
    while waiting:
        batch, adapters, later = [], set(), []
        for i in waiting:
            name = requests[i]["adapter"]
            fits = (name == "__base__" or name in adapters or max_adapters is None
                    or len(adapters) < max_adapters)
            if len(batch) < size and fits:
                batch.append(i)
                if name != "__base__":
                    adapters.add(name)
            else:
                later.append(i)
        plan.append(batch)
        waiting = later
    return plan


def progress(total):
    try:
        from tqdm import tqdm

        # disable=None: a live bar on a terminal only; a log gets the summary line instead of a
        # line per refresh (and the last state twice: once at 100%, once when the bar closes)
        return tqdm(total=total, unit="req", disable=None)
    except ImportError:
        class Plain:
            def __init__(self):
                self.n = 0

            def update(self, k):
                self.n += k
                print(f"{self.n}/{total} requests", file=sys.stderr)

            def close(self):
                pass
        return Plain()


def serve_continuously(model, tokenizer, requests, args):
    """(completion, seconds from queueing to the last token) per request, in request order."""
    import time

    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    # explicit sizes: without them the engine sizes its cache from free memory (on CPU, gigabytes)
    cb = ContinuousBatchingConfig(num_blocks=max(1, args.cache_tokens // 256), max_batch_tokens=args.max_batch_tokens)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    bar, queued, done = progress(len(requests)), {}, {}
    try:
        for i, r in enumerate(requests):
            ids = tokenizer(r["prompt"])["input_ids"]
            rid = manager.add_request(ids, request_id=f"r{i}", adapter_name=r["adapter"])
            queued[rid] = (i, time.perf_counter())
        while len(done) < len(requests):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("the continuous-batching loop stopped; see the log above")
                continue
            if not result.is_finished():
                continue
            if result.error is not None:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            i, t0 = queued[result.request_id]
            text = tokenizer.decode(result.generated_tokens, skip_special_tokens=True)
            done[i] = (text, time.perf_counter() - t0)
            bar.update(1)
    finally:
        manager.stop(block=True)
        bar.close()
    return [done[i] for i in range(len(requests))]


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and every option's default."""


def main(argv=None) -> int:
    # PEFT (0.21) reads transformers' deprecated is_gradient_checkpointing whenever it wraps a
    # model: the FutureWarning is about PEFT's code, not this script's
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    p.add_argument("--base", help="base model folder (save_pretrained)")
    p.add_argument("--tokenizer", help="tokenizer folder (default: --base)")
    p.add_argument("--tiny", action="store_true",
                   help="a random tiny Llama with a character tokenizer; makes the files it is not given")
    p.add_argument("--adapters", help="folder with one PEFT adapter per sub-folder (required without --tiny)")
    p.add_argument("--requests", help="JSONL: {'adapter': ..., 'prompt': ...} per line (required without --tiny)")
    p.add_argument("--out", help="JSONL answers, in request order (required without --tiny)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--no-fastlora", action="store_true", help="serve through PEFT's own mixed batch")
    p.add_argument("--register", action="store_true",
                   help="register the adapters by name (CPU memory, slots on demand) instead of loading them into PEFT")
    p.add_argument("--slots", type=int, default=None, help="--register: slots, the most adapters one batch uses (default: one per adapter)")
    p.add_argument("--continuous", action="store_true",
                   help="continuous batching (transformers' engine, one adapter per request)")
    p.add_argument("--max-batch-tokens", type=int, default=256, help="--continuous: tokens per forward")
    p.add_argument("--cache-tokens", type=int, default=16384, help="--continuous: KV-cache size in tokens")
    args = p.parse_args(argv)
    if args.register and args.no_fastlora:
        raise SystemExit("--register needs fastlora: PEFT does not know registered adapters")
    if args.continuous and args.no_fastlora:
        raise SystemExit("--continuous needs fastlora: PEFT's own path has no per-request adapters "
                         "in continuous batching")
    if args.batch_size < 1 or args.max_new_tokens < 1:
        raise SystemExit("--batch-size and --max-new-tokens must be positive")
    if args.slots is not None and args.slots < 1:
        raise SystemExit("--slots must be positive")
    if args.tiny:
        make_tiny_files(args, tempfile.mkdtemp(prefix="fastlora_demo_"))
    missing = [f"--{n}" for n in ("adapters", "requests", "out") if getattr(args, n) is None]
    if missing:
        p.error(f"{', '.join(missing)} required (or --tiny, which makes them)")

    requests = read_requests(args.requests)
    model, tokenizer, names = load_model(args)
    unknown = sorted({r["adapter"] for r in requests} - set(names) - {"__base__"})
    if unknown:  # before any work: a typo must not cost a whole run
        raise ValueError(f"requests name unknown adapter(s) {', '.join(unknown)}; loaded: {', '.join(names)}")
    if not args.no_fastlora:
        print(patch_and_register(model, args, names), file=sys.stderr)

    if args.continuous:
        answers = serve_continuously(model, tokenizer, requests, args)
        with open(args.out, "w") as out:
            for r, (text, latency) in zip(requests, answers):
                out.write(json.dumps({"adapter": r["adapter"], "prompt": r["prompt"], "completion": text,
                                      "latency_s": round(latency, 4)}) + "\n")
        lat = sorted(latency for _, latency in answers)
        print(f"{len(requests)} answers written to {args.out}; latency p50 {lat[len(lat) // 2]:.3f} s, "
              f"p95 {lat[min(len(lat) - 1, int(0.95 * len(lat)))]:.3f} s", file=sys.stderr)
        return 0

    # with --register --slots M a batch may use at most M adapters (the model's slots)
    max_adapters = args.slots if args.register and not args.no_fastlora else None
    bar, answers, written = progress(len(requests)), [None] * len(requests), 0
    with open(args.out, "w") as out:
        for group in plan_batches(requests, args.batch_size, max_adapters):
            enc = tokenizer([requests[i]["prompt"] for i in group], return_tensors="pt", padding=True).to(model.device)
            with torch.no_grad():
                ids = model.generate(**enc, adapter_names=[requests[i]["adapter"] for i in group],
                                     max_new_tokens=args.max_new_tokens, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id)
            texts = tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            for i, text in zip(group, texts):
                answers[i] = text
            while written < len(requests) and answers[written] is not None:  # in request order
                r = requests[written]
                out.write(json.dumps({"adapter": r["adapter"], "prompt": r["prompt"],
                                      "completion": answers[written]}) + "\n")
                written += 1
            bar.update(len(group))
    bar.close()
    print(f"{len(requests)} answers written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
