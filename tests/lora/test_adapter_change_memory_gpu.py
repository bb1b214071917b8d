"""A model whose adapters change again and again holds the same GPU memory after each change.

A change (one adapter deleted, another of the same shape added) rebuilds the sites' stacks, the
graphs are warmed again and the same largest call runs (float32, so that an added adapter has
the others' dtype): the allocated bytes come back to what they
were before the first change, and the allocator's reserve does not grow from one change to the next
(a kept copy of the old stacks or graph pool would add its size at every change).
"""

import gc

import pytest
import torch
from peft import LoraConfig, get_peft_model

import peft_fastlora as fastlora
from _models import tiny_llama

pytestmark = pytest.mark.gpu
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BUCKETS = [1, 2, 4, 8, 16, 32, 64]
PROMPT, NEW = 200, 16
MIB = 2**20


def _config(i):
    return LoraConfig(r=8 + 8 * (i % 2), lora_alpha=16, target_modules=ALL if i % 2 else ["q_proj", "v_proj"],
                      init_lora_weights=False)


def _largest_call(model, names):
    ids = torch.randint(3, 512, (BUCKETS[-1], PROMPT), device="cuda")
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                       do_sample=False, pad_token_id=0, adapter_names=[names[i % len(names)] for i in range(len(ids))])
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def test_repeated_adapter_changes_hold_memory_flat():
    torch.manual_seed(0)
    base = tiny_llama(0, vocab_size=512, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                      num_key_value_heads=2).to("cuda").eval()
    base.generation_config.eos_token_id = None
    model = get_peft_model(base, _config(0), adapter_name="a0")
    for i in range(1, 4):
        model.add_adapter(f"a{i}", _config(i))
    model.eval()
    kinds = {f"a{i}": i % 2 for i in range(4)}  # each adapter's config
    names = list(kinds)
    fastlora.patch(model)
    fastlora.warmup(model, batch_sizes=BUCKETS, max_length=PROMPT + NEW)
    first = _largest_call(model, names)
    seen = []
    for change in range(4):
        gone, new = names[change % 2], f"b{change}"
        kinds[new] = kinds.pop(gone)  # the same shape as the adapter it replaces
        torch.manual_seed(10 + change)
        model.add_adapter(new, _config(kinds[new]))
        model.delete_adapter(gone)
        model.eval()
        names = [n for n in names if n != gone] + [new]
        fastlora.warmup(model, batch_sizes=BUCKETS, max_length=PROMPT + NEW)
        seen.append(_largest_call(model, names))
    allocated = [a for a, _ in seen]
    reserved = [r for _, r in seen]
    assert max(allocated) - first[0] <= MIB, f"allocated grew over the changes: {first[0]} then {allocated}"
    # the first change may settle the reserve (its warm-up reuses the graph pool); later ones keep it
    assert max(reserved[1:]) - reserved[0] <= 8 * MIB, f"the reserve grew change after change: {reserved}"
