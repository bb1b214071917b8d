"""LoRA on mixture-of-experts models: fastlora's mixed batch (adapters on attention and on the routed
experts) against the same base model patched by fastlora and against PEFT, in one run.

Random-weight bf16 models of real widths (``--model``; fewer layers with ``--layers``, stated in the
CSV), ``--adapters`` adapters of rank ``--rank`` on q/k/v/o and on ``experts.gate_up_proj`` and
``experts.down_proj`` (PEFT's ``target_parameters``), a round-robin adapter mix. Methods:

- ``base_patched``: the base model (no PEFT) patched by fastlora, its experts as fastlora's grouped
  GEMMs (``grouped_experts``, the like-for-like reference of the two fastlora rows);
- ``base_patched_hf[_<impl>]``: the same with ``grouped_experts=False``: its experts computed by
  transformers' experts implementation (its default, then each of ``--experts-impls``);
- ``fastlora_base_rows``: the PEFT model patched, every row ``"__base__"`` (fastlora's grouped
  expert GEMMs, no adapter);
- ``fastlora_mixed``: the PEFT model patched, the adapter mix;
- ``peft_loop``: PEFT itself: its mixed batch refuses expert adapters, so each adapter's rows are
  generated with that adapter active, one adapter after another.

Decode ms/step = (time of ``generate`` with T new tokens - time with 1) / (T - 1). The floor: the
bytes a step reads at uniform routing (every non-expert weight, the experts a batch of B tokens is
expected to hit, the LoRA factors of the adapters used on attention and on those experts) over the
copy bandwidth measured in this run.

    python benchmarks/bench_moe.py --model qwen3-30b-a3b --layers 24 --batch 32   # moe_qwen3-30b-a3b_h200.csv
    python benchmarks/bench_moe.py --smoke                                        # CPU: checks the script
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as hx  # noqa: E402

SHAPES = {  # config class, model class, fields
    "qwen3-30b-a3b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        vocab_size=151936, norm_topk_prob=True, decoder_sparse_step=1)),
    "mixtral-8x7b": ("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000)),
    "tiny-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, vocab_size=512,
        decoder_sparse_step=1)),
}
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


def build_base(shape: str, layers: int, impl=None):
    import transformers

    cfg_name, model_name, fields = SHAPES[shape]
    fields = dict(fields, num_hidden_layers=layers or fields["num_hidden_layers"])
    cfg = getattr(transformers, cfg_name)(**fields, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if impl is not None:
        cfg._experts_implementation = impl
    return hx.instantiate(model_name, cfg)


def add_adapters(model, n: int, rank: int):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ATTENTION, target_parameters=EXPERTS,
                     init_lora_weights=False)
    peft_model = get_peft_model(model, cfg, adapter_name="a0", autocast_adapter_dtype=False)
    for i in range(1, n):
        peft_model.add_adapter(f"a{i}", cfg, autocast_adapter_dtype=False)
    with torch.no_grad():  # small B: random adapters nudge the model instead of swamping it
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.01)
    return peft_model.eval()


def floor_bytes(model, shape: str, layers: int, batch: int, adapters_used: int, rank: int) -> float:
    """Bytes one decode step reads at uniform routing (see the module's docstring)."""
    _, _, f = SHAPES[shape]
    experts = f.get("num_experts", f.get("num_local_experts"))
    k = f["num_experts_per_tok"]
    inter = f.get("moe_intermediate_size", f["intermediate_size"])
    h = f["hidden_size"]
    expert_bytes = 2 * 3 * inter * h  # bf16 gate, up, down
    total = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" not in n)
    dense = total - layers * experts * expert_bytes
    hit = experts * (1 - (1 - k / experts) ** batch)  # distinct experts a batch is expected to route to
    per_adapter_hit = experts * (1 - (1 - k / experts) ** (batch / max(adapters_used, 1)))
    heads, kv, hd = f["num_attention_heads"], f["num_key_value_heads"], f.get("head_dim", h // f["num_attention_heads"])
    attn_lora = rank * (4 * h + heads * hd + 2 * kv * hd + heads * hd)
    expert_lora = rank * (h + 2 * inter + inter + h)
    lora = 2 * layers * adapters_used * (attn_lora + per_adapter_hit * expert_lora)
    return dense + layers * hit * expert_bytes + lora


def runner_stats(model):
    import peft_fastlora as fastlora

    state = fastlora.get_state(model)
    runner = state.graph_runner if state is not None else None
    if runner is None:
        return {}
    s = runner.stats
    return dict(replays=s.get("replays", 0), eager_steps=s.get("eager_steps", 0),
                eager_reasons="; ".join(f"{k}: {v}" for k, v in s.get("eager_reasons", {}).items())[:300])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the model has (stated in the CSV)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--peft-tokens", type=int, default=4, help="new tokens of PEFT's (slow) loop")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--experts-impls", nargs="*", default=["grouped_mm"],
                   help="transformers' experts implementations measured for the base model besides its default")
    p.add_argument("--skip-peft", action="store_true")
    hx.add_run_args(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.layers, args.batch, args.adapters, args.rank = "tiny-moe", None, 4, 2, 4
        args.new_tokens, args.peft_tokens, args.reps, args.experts_impls = 3, 2, 1, []
    if not hx.start(args, "bench_moe"):
        return 0
    import peft_fastlora as fastlora

    layers = args.layers or SHAPES[args.model][2]["num_hidden_layers"]
    versions = hx.versions()
    bw = hx.copy_bandwidth()
    g = torch.Generator().manual_seed(1)
    vocab = SHAPES[args.model][2]["vocab_size"]
    ids = torch.randint(3, vocab, (args.batch, args.prompt), generator=g).to(hx.DEVICE)
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    names = hx.round_robin(args.batch, args.adapters)
    graphs = "emulate" if hx.DEVICE == "cpu" else True
    rows = []

    def row(method, step_ms, floor, **extra):
        r = dict(model=args.model, layers=layers, batch=args.batch, adapters=args.adapters, rank=args.rank,
                 method=method, decode_ms=round(step_ms, 3), replay_ms=round(hx.measure.replay_ms or 0, 3) or "",
                 **hx.floor_columns(step_ms, floor, bw, versions["gpu"]), **extra, **versions)
        rows.append(r)
        print(" | ".join(f"{k}={v}" for k, v in r.items() if k not in versions), flush=True)

    def decode_ms(gen, tokens):
        _, step, _ = hx.measure(gen, tokens, args.reps)
        return step

    # the base model patched by fastlora: its experts as fastlora's grouped GEMMs, then as each of
    # transformers' implementations (its default first)
    bases = [("base_patched", None, "auto")] + [("base_patched_hf" + (f"_{impl}" if impl else ""), impl, False)
                                                for impl in [None] + list(args.experts_impls)]
    for method, impl, grouped in bases:
        try:
            base = build_base(args.model, layers, impl)
        except Exception as e:  # noqa: BLE001 - an implementation this transformers does not have
            print(f"{method}: not built ({type(e).__name__}: {e})", flush=True)
            continue
        print(fastlora.patch(base, cuda_graphs=graphs, grouped_experts=grouped), flush=True)
        gen = lambda n, m=base: m.generate(**inputs, max_new_tokens=n, min_new_tokens=n)  # noqa: E731
        step = decode_ms(gen, args.new_tokens)
        floor = floor_bytes(base, args.model, layers, args.batch, 0, args.rank)
        row(method, step, floor, **runner_stats(base))
        fastlora.unpatch(base)
        del base, gen
        gc.collect()
        if hx.DEVICE == "cuda":
            torch.cuda.empty_cache()

    model = add_adapters(build_base(args.model, layers), args.adapters, args.rank)
    floor = floor_bytes(model, args.model, layers, args.batch, min(args.adapters, args.batch), args.rank)
    report = fastlora.patch(model, cuda_graphs=graphs)
    print(report, flush=True)
    for method, mix in (("fastlora_base_rows", ["__base__"] * args.batch), ("fastlora_mixed", names)):
        gen = lambda n, mix=mix: model.generate(**inputs, adapter_names=mix, max_new_tokens=n, min_new_tokens=n)  # noqa: E731
        step = decode_ms(gen, args.new_tokens)
        row(method, step, floor, **runner_stats(model))
    fastlora.unpatch(model)
    mixed = rows[-1]["decode_ms"]
    base_best = min(r["decode_ms"] for r in rows if r["method"].startswith("base_patched"))
    rows[-1]["ratio_to_base_patched"] = round(mixed / base_best, 3)
    if not args.skip_peft:
        by_adapter = {}
        for i, n in enumerate(names):
            by_adapter.setdefault(n, []).append(i)

        def peft_loop(n):
            for name, idx in by_adapter.items():
                model.set_adapter(name)
                sub = {k: (v[idx] if torch.is_tensor(v) else v) for k, v in inputs.items()}
                model.generate(**sub, max_new_tokens=n, min_new_tokens=n)

        with torch.no_grad():
            step = decode_ms(peft_loop, args.peft_tokens)
        row("peft_loop", step, floor)
        rows[-2]["speedup_vs_peft"] = round(step / mixed, 2)
    out = hx.out_path(args.out, f"moe_{args.model}", versions["gpu"])
    if out:
        hx.write_csv(rows, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
