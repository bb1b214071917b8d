"""Shared by the GPU tests: a capture helper, and the float32 tiny PEFT Llamas (with their inputs)
that several GPU files compare with PEFT's own tokens."""

import gc

import torch
from peft import LoraConfig, get_peft_model

import peft_fastlora as fastlora

from _continuous import random_prompts
from _models import tiny_llama


def captured(fn, warmups: int = 1, reset=None):
    """``fn`` run ``warmups`` times on a side stream (compiles, allocates), ``reset()`` (when given)
    to undo what those runs advanced, then ``fn`` captured with the garbage collector off (a
    collected Triton kernel object must not unload its module mid-capture): (graph, its output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    if reset is not None:
        reset()
    graph = torch.cuda.CUDAGraph()
    gc.disable()
    try:
        with torch.cuda.graph(graph):
            out = fn()
    finally:
        gc.enable()
    return graph, out


# ---- the graph-traffic tests' fp32 tiny Llama (also the GPU tests of continuous batching, GPU slots
# and paged attention): six adapters of ranks 2-32, two target sets --------------------------------
TRAFFIC_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TRAFFIC_RANKS = [2, 4, 8, 16, 32, 8]
TRAFFIC_NAMES = [f"a{i}" for i in range(len(TRAFFIC_RANKS))]


def traffic_model(seed=0, plain_mlp=False):
    base = tiny_llama(seed, vocab_size=512, hidden_size=128, intermediate_size=256).to("cuda").eval()
    base.generation_config.eos_token_id = None
    model = None
    wide = [t for t in TRAFFIC_TARGETS if not (plain_mlp and t in ("gate_proj", "up_proj"))]
    for i, r in enumerate(TRAFFIC_RANKS):
        cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=wide if i % 2 == 0 else ["q_proj", "v_proj", "down_proj"],
                         init_lora_weights=False)
        if model is None:
            model = get_peft_model(base, cfg, adapter_name=TRAFFIC_NAMES[i])
        else:
            model.add_adapter(TRAFFIC_NAMES[i], cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(0.05)  # nudge the random model, do not swamp it
    return model.eval()


def traffic_inputs(rows, prompt, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 512, (rows, prompt), generator=g)
    mask = torch.ones_like(ids)
    for r in range(1, rows, 3):  # some left-padded rows
        pad = int(torch.randint(0, prompt, (1,), generator=g))
        ids[r, :pad] = 0
        mask[r, :pad] = 0
    return dict(input_ids=ids.cuda(), attention_mask=mask.cuda(), pad_token_id=0)


def traffic_prompts(n, seed):
    """``n`` engine requests for ``traffic_model``: random prompts of 1-119 tokens, and the adapter
    of each (one of ``TRAFFIC_NAMES`` or "__base__")."""
    pool = TRAFFIC_NAMES + ["__base__"]
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(1, 120, (n,), generator=g)]
    names = [pool[int(i)] for i in torch.randint(0, len(pool), (n,), generator=g)]
    return random_prompts(lengths, seed), names


# ---- the generate tests' fp32 tiny Llama (also greedy selection and step advance on the GPU):
# up to eight adapters of ranks 1-64, rsLoRA on every other one ------------------------------------
GENERATE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def generate_model(dtype=torch.float32, n_adapters=4, biased=(), dora=()):
    """A tiny Llama on CUDA with ``n_adapters`` adapters of mixed ranks and targets; the adapters
    numbered in ``biased`` have a bias on B (``lora_bias=True``), those in ``dora`` are DoRA ones
    (their magnitudes moved off the initial norms)."""
    base = tiny_llama(0, vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_attention_heads=8).to("cuda", dtype).eval()
    base.generation_config.eos_token_id = None
    ranks = [8, 16, 4, 32, 8, 16, 64, 1]
    model = get_peft_model(base, LoraConfig(r=ranks[0], lora_alpha=16, target_modules=GENERATE_TARGETS,
                                            init_lora_weights=False, lora_bias=0 in biased, use_dora=0 in dora),
                           adapter_name="a0")
    for i in range(1, n_adapters):
        targets = ["q_proj", "v_proj"] if i % 3 == 1 else GENERATE_TARGETS
        model.add_adapter(f"a{i}", LoraConfig(r=ranks[i], lora_alpha=8 * (i + 1), target_modules=targets,
                                              use_rslora=i % 2 == 1, init_lora_weights=False,
                                              lora_bias=i in biased, use_dora=i in dora))
    # small B so that random adapters nudge a random model instead of swamping it
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(0.05)
            if "lora_magnitude_vector" in n:
                p.mul_(torch.linspace(0.7, 1.3, p.numel(), device=p.device).view_as(p))
    return model.to(dtype).eval()


def generate_inputs(batch, prompt=9):
    ids = torch.randint(1, 512, (batch, prompt), device="cuda")
    mask = torch.ones_like(ids)
    ids[1::3, :3] = 0  # some left-padded rows
    mask[1::3, :3] = 0
    return dict(input_ids=ids, attention_mask=mask, pad_token_id=0, do_sample=False)


def random_calls(model, seed=21, n=16):
    """Random batch sizes, prompts, adapters, EOS lists (random ones: rows stop apart or never;
    ones taken from each row's own tokens: every row stops early, so the deferred check undoes a
    step), pad ids, minimum lengths and lengths: (adapter names, generate kwargs) per call, for
    ``generate_model(n_adapters=8)``."""
    rng = torch.Generator().manual_seed(seed)
    adapters = ["__base__"] + [f"a{i}" for i in range(8)]
    calls = []
    for i in range(n):
        batch = int(torch.randint(1, 17 if i % 4 == 3 else 41, (1,), generator=rng))
        names = [adapters[int(j)] for j in torch.randint(0, len(adapters), (batch,), generator=rng)]
        kw = dict(generate_inputs(max(batch, 2), prompt=int(torch.randint(3, 40, (1,), generator=rng))))
        kw = {k: (v[:batch] if torch.is_tensor(v) else v) for k, v in kw.items()}
        kw["max_new_tokens"] = int(torch.randint(8 if i % 4 == 3 else 1, 48, (1,), generator=rng))
        if i % 4 == 1:
            n_ids = int(torch.randint(1, 17, (1,), generator=rng))
            kw["eos_token_id"] = [int(t) for t in torch.randint(1, 512, (n_ids,), generator=rng)]
            kw["pad_token_id"] = int(torch.randint(0, 512, (1,), generator=rng))
        if i % 8 == 7:
            kw["min_new_tokens"] = int(torch.randint(1, 5, (1,), generator=rng))
        calls.append((names, kw))
    # EOS ids from each row's own free-running tokens at a step before the last (at most 16 rows)
    fastlora.patch(model)
    try:
        for i in range(3, len(calls), 4):
            names, kw = calls[i]
            free = model.generate(**kw, adapter_names=names)[:, kw["input_ids"].shape[1]:]
            step = int(torch.randint(kw.get("min_new_tokens", 0), free.shape[1] - 2, (1,), generator=rng))
            kw["eos_token_id"] = sorted({int(t) for t in free[:, step]})
    finally:
        fastlora.unpatch(model)
    return calls
