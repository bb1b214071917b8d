"""Writes ``fine_tune_then_serve.ipynb`` next to this file.

The notebook is generated so that it can be reviewed as plain Python: edit the cells here, then run

    python examples/_make_notebook.py             # cells only, outputs cleared
    python examples/_make_notebook.py --execute   # and run it (a few CPU minutes), outputs kept

The committed notebook is the executed one, so a reader on a code host sees its tables and plots.
The char-level tokenizer cell is copied from ``_chartok.py`` (the serving script and the tests use
that module), so the notebook stays self-contained without a second copy to keep in sync.
``tests/e2e/test_notebook.py`` checks that the committed notebook's cells are this script's, and
executes it.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
NOTEBOOK = HERE / "fine_tune_then_serve.ipynb"


def _chartok_source() -> str:
    """``_chartok.py`` without its module docstring and ``__future__`` import."""
    text = (HERE / "_chartok.py").read_text()
    text = text.split('"""', 2)[2]  # drop the module docstring
    text = re.sub(r"^from __future__ import annotations\n", "", text.lstrip("\n"), flags=re.M)
    return text.strip("\n") + "\n\ntokenizer = build_char_tokenizer()\n" + (
        'enc = tokenizer(["rev:cafe=", "up:bed="], padding=True)\n'
        'print("vocabulary size:", len(tokenizer))\n'
        'print("input_ids:", enc["input_ids"])\n'
        'print("decoded:  ", tokenizer.batch_decode(enc["input_ids"], skip_special_tokens=True))')


CELLS = [
    ("md", "intro", """\
# Fine-tune three LoRA adapters, then serve them together with `peft_fastlora`

A common serving pattern: **one base model, many small LoRA adapters**, one per task or per customer.
Requests for different adapters arrive together, and we want to answer them **in one batch** rather
than one adapter at a time. PEFT supports this through `generate(..., adapter_names=[...])`, with one
adapter name per row. `peft_fastlora` makes exactly that call fast: `fastlora.patch(model)` swaps the
LoRA layers' forwards for batched kernels (Triton on CUDA, plain torch on CPU) and leaves the results
unchanged.

In this notebook we

1. build a tiny Llama-style model and a character-level tokenizer from scratch (no downloads),
2. pretrain it briefly on a *copy* task, so that it knows how to read and write strings,
3. fine-tune three LoRA adapters of different ranks on three new tasks (reverse, upper-case, repeat each letter),
4. save the adapters, load all of them into one `PeftModel` and patch it with `peft_fastlora`,
5. serve a **mixed batch**, where every row uses its own adapter and some rows use the plain base model,
6. measure each adapter's accuracy on held-out words, and check that the tokens are identical to PEFT's own
   mixed-adapter path,
7. plot the training losses and the throughput of PEFT vs. `peft_fastlora`.

Everything runs on a CPU in a few minutes; all seeds are fixed."""),
    ("code", "setup", """\
import copy
import csv
import random
import tempfile
import time
import zlib
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import peft_fastlora as fastlora

T_START = time.perf_counter()
SEED = 0
random.seed(SEED)
torch.manual_seed(SEED)
torch.set_num_threads(1)  # the matrices are tiny: one thread is as fast as several, and reproducible

# Training always runs on the CPU (the model is tiny); serving uses the GPU when there is one.
SERVE_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
print(f"torch {torch.__version__}, peft_fastlora {fastlora.__version__}, serving on {SERVE_DEVICE}")"""),
    ("md", "tokenizer-md", """\
## 1. A character-level tokenizer

Real models come with a tokenizer; ours is built here: one token per character. It is a
[`tokenizers`](https://github.com/huggingface/tokenizers) `WordLevel` model whose pre-tokenizer splits
text into single characters, wrapped in `PreTrainedTokenizerFast`, so it behaves like any Hugging Face
tokenizer: batching with **left padding** (what batched generation with a decoder-only model needs),
`batch_decode`, `save_pretrained`. The same code lives in `examples/_chartok.py` for the serving script."""),
    ("code", "tokenizer", None),  # filled from _chartok.py
    ("md", "tasks-md", """\
## 2. The tasks

Each task maps a short word over the letters `a`-`h` to an answer; the prompt names the task:

| adapter   | prompt          | answer      | LoRA rank |
|-----------|-----------------|-------------|-----------|
| *(base)*  | `copy:cafe=`    | `cafe`      | -         |
| `reverse` | `rev:cafe=`     | `efac`      | 16        |
| `upper`   | `up:cafe=`      | `CAFE`      | 4         |
| `repeat`  | `rep:cafe=`     | `ccaaffee`  | 8         |

The base model is pretrained on `copy` only, so it has never seen the three adapter tasks. Every
answer ends with the end-of-sequence token, so generation stops by itself.

About one word in eight (chosen by a checksum of the word) is **held out**: never used in training,
only for measuring accuracy at the end."""),
    ("code", "tasks", """\
ALPHABET = "abcdefgh"
PRETRAIN_TASK = ("copy", lambda w: w)
TASKS = {  # adapter name -> (prompt prefix, answer function, LoRA rank, training steps)
    "reverse": ("rev", lambda w: w[::-1], 16, 320),  # the hardest: it gets the most steps
    "upper": ("up", str.upper, 4, 120),
    "repeat": ("rep", lambda w: "".join(c + c for c in w), 8, 160),  # (not "double": a Module method)
}
MAX_NEW_TOKENS = 14  # the longest answer: "repeat" of a 6-letter word, plus the end token


def is_held_out(word: str) -> bool:
    return zlib.crc32(word.encode()) % 8 == 0


def random_word(rng: random.Random, alphabet: str = ALPHABET, held_out: bool = False) -> str:
    \"\"\"A word of 3-6 letters; training words and held-out words never overlap.\"\"\"
    while True:
        word = "".join(rng.choice(alphabet) for _ in range(rng.randint(3, 6)))
        if is_held_out(word) == held_out:
            return word


def make_example(prefix: str, answer_fn, word: str):
    return f"{prefix}:{word}=", answer_fn(word)


for name, (prefix, fn, rank, _) in TASKS.items():
    print(f"{name:8s} rank {rank:2d}:", make_example(prefix, fn, "cafe"))"""),
    ("md", "model-md", """\
## 3. A tiny base model, pretrained on copying

A 3-layer Llama with hidden size 128 (about half a million parameters), built from a config, so nothing is
downloaded. The training loop is plain PyTorch: AdamW with a one-cycle learning-rate schedule, batches
of 32 random examples, and a loss on the answer tokens only (the prompt is context). The same loop
fine-tunes the adapters below.

The pretraining words mix lower- and upper-case letters, so the base model already knows how to write
every character that the adapters will need."""),
    ("code", "model", """\
config = LlamaConfig(
    vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    pad_token_id=tokenizer.pad_token_id)
base = LlamaForCausalLM(config)
print(f"{sum(p.numel() for p in base.parameters()) / 1e6:.2f} M parameters")


def collate(pairs):
    \"\"\"Tokenize (prompt, answer) pairs: prompt + answer + </s>, right-padded; labels mask the prompt.\"\"\"
    ids, labels = [], []
    for prompt, answer in pairs:
        p = tokenizer(prompt)["input_ids"]
        a = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(map(len, ids))
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id)
    label_ids = torch.full((len(ids), width), -100)
    attention_mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, (i, l) in enumerate(zip(ids, labels)):
        input_ids[row, :len(i)] = torch.tensor(i)
        label_ids[row, :len(l)] = torch.tensor(l)
        attention_mask[row, :len(i)] = 1
    return input_ids, attention_mask, label_ids


def train(model, sample, steps, lr, batch_size=32, seed=SEED):
    \"\"\"Train the parameters with requires_grad=True on examples from sample(rng); returns the losses.\"\"\"
    rng = random.Random(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    losses = []
    for _ in range(steps):
        input_ids, attention_mask, labels = collate([sample(rng) for _ in range(batch_size)])
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    return losses


@torch.no_grad()
def generate(model, prompts, adapter_names=None, max_new_tokens=MAX_NEW_TOKENS):
    \"\"\"Greedy decoding of one left-padded batch: (new token ids, decoded completions).\"\"\"
    enc = tokenizer(prompts, padding=True, return_tensors="pt").to(model.device)
    extra = {} if adapter_names is None else {"adapter_names": list(adapter_names)}
    out = model.generate(**enc, **extra, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    new = out[:, enc["input_ids"].shape[1]:].cpu()
    return new, tokenizer.batch_decode(new, skip_special_tokens=True)"""),
    ("code", "pretrain", """\
losses = {}
t0 = time.perf_counter()
copy_prefix, copy_fn = PRETRAIN_TASK
losses["base (copy)"] = train(
    base, lambda rng: make_example(copy_prefix, copy_fn, random_word(rng, ALPHABET + ALPHABET.upper())),
    steps=200, lr=3e-3)
print(f"pretraining: {time.perf_counter() - t0:.0f} s, final loss {losses['base (copy)'][-1]:.4f}")
print(generate(base, ["copy:cafe=", "copy:BadGe="])[1])"""),
    ("md", "finetune-md", """\
## 4. Fine-tune three LoRA adapters

Each adapter is trained on its own copy of the base model with `get_peft_model`; only the LoRA matrices
train, the base weights stay frozen. The adapters cover all attention and MLP projections
(`q/k/v/o_proj`, `gate/up/down_proj`) and have different ranks, which `peft_fastlora` serves together
in one batch. After training, `save_pretrained` writes each adapter (a few hundred KB) into its own
folder: `workdir/adapters/<name>/`."""),
    ("code", "finetune", """\
# a temporary folder, deleted by the notebook's last cell; set KEEP_DIR to a folder of yours to keep
# the saved base model and adapters (section 11 serves them from the command line)
KEEP_DIR = None
_tmp = None if KEEP_DIR else tempfile.TemporaryDirectory(prefix="fastlora_demo_")
workdir = Path(KEEP_DIR) if KEEP_DIR else Path(_tmp.name)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

for i, (name, (prefix, fn, rank, steps)) in enumerate(TASKS.items()):
    t0 = time.perf_counter()
    torch.manual_seed(SEED + 1 + i)  # the LoRA initialisation
    lora_config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=TARGETS)
    peft_model = get_peft_model(copy.deepcopy(base), lora_config)
    losses[name] = train(peft_model, lambda rng: make_example(prefix, fn, random_word(rng)),
                         steps=steps, lr=5e-3, seed=SEED + 1 + i)
    peft_model.save_pretrained(workdir / "adapters" / name)
    print(f"{name:8s} rank {rank:2d}: {time.perf_counter() - t0:4.0f} s, final loss {losses[name][-1]:.4f}")

# The base model and the tokenizer go next to the adapters, as a serving job would find them.
base.save_pretrained(workdir / "base")
tokenizer.save_pretrained(workdir / "base")
print(sorted(str(p.relative_to(workdir)) for p in workdir.glob("*/*")))"""),
    ("md", "load-md", """\
## 5. Load every adapter into one `PeftModel` and patch it

`PeftModel.from_pretrained` loads the first adapter, `load_adapter` adds the others under their own
names. Then one call, `fastlora.patch(model)`, prepares the fast path: it stacks the adapters' LoRA
weights per layer, fuses sibling projections (q/k/v and gate/up) into one matrix multiply each, and
installs thin forwards on the LoRA layers. The returned `PatchReport` says what it did; anything it
cannot accelerate stays on PEFT's own path (and is listed in `report.left_on_peft`)."""),
    ("code", "load", """\
served_base = LlamaForCausalLM.from_pretrained(workdir / "base")
names = list(TASKS)
model = PeftModel.from_pretrained(served_base, workdir / "adapters" / names[0], adapter_name=names[0])
for name in names[1:]:
    model.load_adapter(workdir / "adapters" / name, adapter_name=name)
model = model.to(SERVE_DEVICE).eval()
print("adapters loaded:", list(model.peft_config))

report = fastlora.patch(model)
print(report)
print("backend:", report.backend, "| adapters:", report.adapters)
print("sites (name, kind, LoRA layers):", *report.sites[:4], "...", sep="\\n  ")
assert report.adapters == sorted(TASKS) and not report.left_on_peft"""),
    ("md", "mixed-md", """\
## 6. Serve one mixed batch

Each row names its adapter in `adapter_names`; `"__base__"` means the base model without any adapter.
The batch is left-padded and decoded greedily, exactly as with PEFT alone: the patch changes how
the batch is computed, not how you call `generate`."""),
    ("code", "mixed", """\
requests = [  # (adapter, word, task whose prompt we send)
    ("reverse", "cafe", "reverse"), ("upper", "badge", "upper"), ("repeat", "head", "repeat"),
    ("__base__", "cafe", "reverse"), ("reverse", "decade", "reverse"), ("upper", "beach", "upper"),
    ("__base__", "badge", "upper"), ("repeat", "ace", "repeat"),
]
prompts = [make_example(TASKS[task][0], TASKS[task][1], w)[0] for _, w, task in requests]
expected = [make_example(TASKS[task][0], TASKS[task][1], w)[1] for _, w, task in requests]
_, completions = generate(model, prompts, adapter_names=[a for a, _, _ in requests])

print(f"{'adapter':10s} {'prompt':14s} {'completion':14s} expected")
for (adapter, _, _), prompt, got, want in zip(requests, prompts, completions, expected):
    print(f"{adapter:10s} {prompt:14s} {got:14s} {want:12s} {'ok' if got == want else '--'}")"""),
    ("md", "accuracy-md", """\
## 7. Accuracy on held-out words, served in mixed batches

For every task we take 48 held-out words and send each prompt twice: once to the task's adapter and
once to `"__base__"`. All rows are shuffled together and served in mixed batches of 32, so every
batch contains all adapters and the base model. The adapters should solve their tasks; the base
model, which only learned to copy, should not."""),
    ("code", "accuracy", """\
eval_rng = random.Random(SEED + 100)
rows = []  # (adapter, task, prompt, expected answer)
for task, (prefix, fn, _, _) in TASKS.items():
    words = set()
    while len(words) < 48:
        word = random_word(eval_rng, held_out=True)
        if word != word[::-1]:  # a palindrome's reverse is itself: copying would "solve" it
            words.add(word)
    for word in sorted(words):
        prompt, answer = make_example(prefix, fn, word)
        rows += [(task, task, prompt, answer), ("__base__", task, prompt, answer)]
eval_rng.shuffle(rows)
BATCH = 32
batches = [rows[i:i + BATCH] for i in range(0, len(rows), BATCH)]


def serve(model, batches):
    \"\"\"Token ids and completions for every batch of (adapter, task, prompt, answer) rows.\"\"\"
    token_ids, completions = [], []
    for batch in batches:
        ids, texts = generate(model, [r[2] for r in batch], adapter_names=[r[0] for r in batch])
        token_ids.append(ids)
        completions += texts
    return token_ids, completions


t0 = time.perf_counter()
fast_ids, fast_completions = serve(model, batches)
print(f"served {len(rows)} rows in {len(batches)} mixed batches in {time.perf_counter() - t0:.1f} s "
      f"(backend {report.backend!r})\\n")

accuracy = {}
for (adapter, task, _, answer), got in zip(rows, fast_completions):
    hits = accuracy.setdefault((task, adapter), [])
    hits.append(got == answer)
accuracy = {key: sum(v) / len(v) for key, v in accuracy.items()}

print(f"{'task':8s} {'adapter':>8s} {'base':>6s}")
for task in TASKS:
    print(f"{task:8s} {accuracy[task, task]:8.2f} {accuracy[task, '__base__']:6.2f}")

for task in TASKS:
    assert accuracy[task, task] >= 0.8, f"adapter {task!r} solved only {accuracy[task, task]:.0%}"
    assert accuracy[task, "__base__"] <= 0.1, f"the base model solved {task!r}: {accuracy[task, '__base__']:.0%}\""""),
    ("md", "parity-md", """\
## 8. Same tokens as PEFT's own mixed-adapter path

`fastlora.unpatch(model)` restores PEFT's forwards. Serving the very same batches again must give the
very same token ids, row by row. (`with fastlora.patched(model): ...` patches for one block only.)"""),
    ("code", "parity", """\
fastlora.unpatch(model)
t0 = time.perf_counter()
peft_ids, peft_completions = serve(model, batches)
print(f"PEFT native: {time.perf_counter() - t0:.1f} s for the same {len(rows)} rows")

for fast, native in zip(fast_ids, peft_ids):
    assert torch.equal(fast, native), "fastlora and PEFT disagree"
assert fast_completions == peft_completions
print(f"identical token ids for all {len(rows)} rows")
report = fastlora.patch(model)  # patch again for the rest of the notebook"""),
    ("md", "loss-md", """\
## 9. Training losses

The copy pretraining, then each adapter's fine-tuning (a loss per step, log scale)."""),
    ("code", "loss", """\
fig, ax = plt.subplots(figsize=(8, 4))
for label, values in losses.items():
    ax.plot(values, label=label, linewidth=1)
ax.set_yscale("log")
ax.set_xlabel("step")
ax.set_ylabel("cross-entropy on answer tokens")
ax.set_title("Pretraining (copy) and LoRA fine-tuning")
ax.legend()
plt.show()"""),
    ("md", "throughput-md", """\
## 10. Throughput: PEFT vs. `peft_fastlora`

With a GPU, this cell measures decode throughput live for a few batch sizes: every batch mixes all three
adapters and the base model, and each row generates 32 tokens. (This toy model is far too small to show
realistic numbers; the benchmarks in `benchmarks/` use real model sizes.)

On a CPU there is nothing meaningful to measure: the cell plots the committed GPU results in
`benchmarks/results/generate_with_peft_h200.csv` when they exist (8B and 1B Llama shapes, bf16, 8 adapters of
rank 16), three of its methods, on a log scale:

- **PEFT mixed batch**: PEFT's own `generate(..., adapter_names=...)`, which loops over the adapters
  in every LoRA layer;
- **fastlora**: the same call on the patched model (Triton kernels, fused projections, CUDA graphs);
- **base model alone**: the model without any adapter, patched by fastlora (same graphs and kernels),
  the ceiling that serving adapters can approach."""),
    ("code", "throughput", """\
def measure_tokens_per_s(model, batch_size, new_tokens=32, repeats=3):
    rng = random.Random(SEED)
    adapters = [(names + ["__base__"])[i % (len(names) + 1)] for i in range(batch_size)]
    prompts = [f"{TASKS[names[i % len(names)]][0]}:{random_word(rng)}=" for i in range(batch_size)]
    enc = tokenizer(prompts, padding=True, return_tensors="pt").to(SERVE_DEVICE)
    kwargs = dict(adapter_names=adapters, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        model.generate(**enc, **kwargs)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            model.generate(**enc, **kwargs)
        torch.cuda.synchronize()
    return repeats * batch_size * new_tokens / (time.perf_counter() - t0)


def find_results(name="generate_with_peft_h200.csv"):
    for folder in [Path.cwd(), *Path.cwd().parents]:
        path = folder / "benchmarks" / "results" / name
        if path.is_file():
            return path
    return None


if torch.cuda.is_available():
    batch_sizes = [4, 16, 64]
    results = {"peft": [], "fastlora": []}
    for bs in batch_sizes:
        fastlora.unpatch(model)
        results["peft"].append(measure_tokens_per_s(model, bs))
        fastlora.patch(model)
        results["fastlora"].append(measure_tokens_per_s(model, bs))
        print(f"batch {bs:3d}: PEFT {results['peft'][-1]:8.0f} tok/s, "
              f"fastlora {results['fastlora'][-1]:8.0f} tok/s")
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, values in results.items():
        ax.plot(batch_sizes, values, marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (mixed adapters)")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"Toy model, live on {torch.cuda.get_device_name()}")
    ax.legend()
    plt.show()
elif (csv_path := find_results()) is not None:
    with open(csv_path, newline="") as f:
        records = [r for r in csv.DictReader(f) if r.get("tokens_per_s")]
    models = sorted({r["model"] for r in records})
    shown = {"peft_native": "PEFT mixed batch", "fastlora_graphs": "fastlora",
             "base_graphs_attn": "base model alone"}
    shown_path = csv_path.relative_to(csv_path.parents[2])  # benchmarks/results/...: no machine's path
    print(f"{len(records)} rows from {shown_path} ({records[0].get('gpu', '?')}); models: {', '.join(models)}")
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model_name in zip(axes[0], models):
        for method, label in shown.items():
            points = sorted((int(r["batch"]), float(r["tokens_per_s"])) for r in records
                            if r["model"] == model_name and r["method"] == method)
            if points:
                ax.plot([b for b, _ in points], [t for _, t in points], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size (rows; adapters mixed round-robin)")
        ax.set_ylabel("decode tokens / s (log scale)")
        ax.set_title(model_name)
        ax.legend()
    fig.suptitle("Committed benchmark results")
    plt.show()
else:
    print("No GPU here and no committed results (benchmarks/results/generate_with_peft_h200.csv) yet: "
          "nothing to plot.")"""),
    ("md", "slots-md", """\
## 11. Many adapters: registered by name, served from slots

With hundreds of adapters, loading each into PEFT (one set of modules per adapter, all on the GPU)
stops scaling. `fastlora.register_adapters` reads saved adapter folders into CPU memory instead, with
no PEFT module built for them, and `patch(..., max_loras_per_batch=M)` gives the stacks M slots (in
GPU memory on a GPU): before each call, the adapters it uses are copied into slots (the least
recently used others give theirs up). `fastlora.from_folders` does all of it from a base model:
the LoRA layers come from a PEFT adapter of rank 1 and zero weights over every module the folders
target (`fastlora_layers`: it changes nothing), then `patch`, then `register_adapters`. Two slots for three adapters, so each
batch below uses at most two of them; the tokens must equal the model above, which loaded the same
folders into PEFT."""),
    ("code", "slots", """\
layers = fastlora.from_folders(LlamaForCausalLM.from_pretrained(workdir / "base").to(SERVE_DEVICE),
                               workdir / "adapters", max_loras_per_batch=2)  # two slots
print(fastlora.get_state(layers).report)

for pair in [("reverse", "upper"), ("upper", "repeat"), ("repeat", "reverse"), ("reverse", "upper")]:
    rows = [(a, w, task) for a, w, task in requests if a in pair or a == "__base__"]
    pair_prompts = [make_example(TASKS[task][0], TASKS[task][1], w)[0] for _, w, task in rows]
    row_adapters = [a for a, _, _ in rows]
    got, texts = generate(layers, pair_prompts, adapter_names=row_adapters)
    want, _ = generate(model, pair_prompts, adapter_names=row_adapters)
    assert torch.equal(got, want), pair
    print(f"{' + '.join(pair):16s}", texts)
print("slots:", dict(fastlora.get_state(layers).registry.stats))
fastlora.unpatch(layers)
del layers"""),
    ("md", "next-md", """\
## 12. Next steps

The folders written above (in a temporary folder that the next cell deletes: set `KEEP_DIR` in
section 4 to keep them) are exactly what the command-line server expects: a base model directory
(model and tokenizer) and one folder per adapter. To answer a JSONL file of requests
(`{"adapter": ..., "prompt": ...}` per line) in mixed batches:

```bash
python examples/serve_many_adapters.py --base KEEP_DIR/base --adapters KEEP_DIR/adapters \\
    --requests requests.jsonl --out answers.jsonl --batch-size 32 --max-new-tokens 14
```

With your own models the recipe is the same: train adapters with PEFT as usual, load them into one
`PeftModel`, call `fastlora.patch(model)`, and pass `adapter_names` to `generate`."""),
    ("code", "cleanup", """\
if _tmp is not None:
    _tmp.cleanup()
print(f"all checks passed; notebook ran in {time.perf_counter() - T_START:.0f} s")"""),
]


def build_notebook() -> nbformat.NotebookNode:
    cells = []
    for kind, cell_id, source in CELLS:
        if cell_id == "tokenizer":
            source = _chartok_source()
        cell = new_markdown_cell(source) if kind == "md" else new_code_cell(source)
        cell["id"] = cell_id  # stable ids keep the file diff-friendly
        cells.append(cell)
    nb = new_notebook(cells=cells)
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    return nb


def execute(nb: nbformat.NotebookNode) -> None:
    """Run every cell in place (nbclient, from the test extra), in the examples folder."""
    import nbclient

    nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(HERE)}}).execute()
    for cell in nb.cells:  # keep what the cells print and plot; drop progress bars and warnings
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if not (o.output_type == "stream" and o.name == "stderr")]
        cell.metadata.pop("execution", None)  # the run's timestamps


def main(argv=None) -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--execute", action="store_true", help="run the notebook and keep its outputs")
    args = p.parse_args(argv)
    nb = build_notebook()
    if args.execute:
        execute(nb)
    nbformat.write(nb, NOTEBOOK)
    print(f"wrote {NOTEBOOK}" + (" (executed)" if args.execute else ""))


if __name__ == "__main__":
    main()
