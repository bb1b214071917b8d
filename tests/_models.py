"""Tiny random models and LoRA adapters for the CPU tests (no downloads).

Each architecture gets a config small enough for a forward in milliseconds (hidden 32-48, 2 layers,
vocab 112) and three adapters that differ in rank, ``lora_alpha``, ``use_rslora`` and target
modules; one targets only the attention input projections, one includes the token embedding.
``init_lora_weights=False`` keeps PEFT's random init of both A and B, so every adapter changes the
output (a zero B would make every parity test pass trivially).

Used by ``e2e/test_parity_models.py``; other test files may import the builders, and every test that
needs a tiny Llama builds it with ``llama_config`` / ``tiny_llama``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import torch
from torch import nn

VOCAB = 112
PAD_ID = 0
ADAPTERS = ("a0", "a1", "a2")  # PEFT's registry sorts names; keep them sortable on purpose

LLAMA_LIKE_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class ArchSpec:
    """How to build one tiny architecture and which modules its three adapters target."""

    name: str
    make_config: Callable[[], object]
    targets: Tuple[Sequence[str], Sequence[str], Sequence[str]]  # a0, a1, a2
    # what ``PatchReport.counts()`` must show: site kind -> number of sites
    expected_sites: Dict[str, int]


def _common(**kw):
    base = dict(vocab_size=VOCAB, num_hidden_layers=2, pad_token_id=PAD_ID, bos_token_id=1,
                eos_token_id=2, tie_word_embeddings=False)
    base.update(kw)
    return base


def llama_config(**overrides):
    """A tiny ``LlamaConfig``; every keyword overrides a default or adds a field.

    Defaults: vocab ``VOCAB``, hidden 32, intermediate 64, 2 layers, 4 heads / 2 KV heads,
    pad / bos / eos ids 0 / 1 / 2, untied embeddings. ``LlamaConfig``'s own default pad id is
    ``None``: pass ``pad_token_id=None`` to keep it.
    """
    from transformers import LlamaConfig
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, pad_token_id=PAD_ID, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False)
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_llama(seed: int = 0, **overrides):
    """``torch.manual_seed(seed)``, then a random ``LlamaForCausalLM(llama_config(**overrides))``
    in eval mode."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(**overrides)).eval()


def tiny_peft_llama(third_adapter: bool = False):
    """A tiny Llama (vocabulary 128, no EOS token) with LoRA adapters "a" (r8, all 7 projections)
    and "b" (r4, q/v only), and with ``third_adapter`` "c" (r2, all 7): the decode tests' model."""
    from peft import LoraConfig, get_peft_model

    base = tiny_llama(0, vocab_size=128)
    base.generation_config.eos_token_id = None
    m = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=LLAMA_LIKE_ALL, init_lora_weights=False),
                       adapter_name="a")
    m.add_adapter("b", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    if third_adapter:
        m.add_adapter("c", LoraConfig(r=2, lora_alpha=2, target_modules=LLAMA_LIKE_ALL, init_lora_weights=False))
    return m.eval()


def _llama():
    return llama_config(**_common(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=64))


def _mistral():
    from transformers import MistralConfig
    return MistralConfig(**_common(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   sliding_window=6))  # shorter than the prompts: the window matters


def _qwen2():
    from transformers import Qwen2Config
    # Qwen2 has biases on q/k/v: the fused base GEMM must carry them
    return Qwen2Config(**_common(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=64,
                                 use_sliding_window=False))


def _qwen3():
    from transformers import Qwen3Config
    # head_dim 16 != hidden / heads (8): q/k/v widths differ from the hidden width
    return Qwen3Config(**_common(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                                 use_sliding_window=False))


def _gemma2():
    from transformers import Gemma2Config
    # Gemma 2: embeddings scaled by sqrt(hidden), attention and final-logit soft-capping,
    # alternating sliding / full attention layers (a small window so it matters for 12 tokens).
    return Gemma2Config(**_common(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                                  sliding_window=6, attn_logit_softcapping=50.0,
                                  final_logit_softcapping=30.0, query_pre_attn_scalar=8,
                                  tie_word_embeddings=True))


def _phi3():
    from transformers import Phi3Config
    # Phi-3 ships qkv_proj and gate_up_proj already fused: plain "linear" sites
    return Phi3Config(**_common(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=64,
                                original_max_position_embeddings=64, rope_scaling=None,
                                eos_token_id=2))


def _gpt2():
    from transformers import GPT2Config
    # GPT-2: Conv1D layers (weight stored (in, out), PEFT sets fan_in_fan_out), tied wte / lm_head
    return GPT2Config(vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=4, n_positions=64,
                      pad_token_id=PAD_ID, bos_token_id=1, eos_token_id=2,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


LLAMA_TARGETS = (
    ["q_proj", "v_proj"],
    LLAMA_LIKE_ALL,
    ["embed_tokens", "k_proj", "o_proj", "gate_proj", "down_proj"],
)
# per arch with 2 layers: 2 qkv + 2 gate_up + 2 o_proj + 2 down_proj + 1 embedding
LLAMA_SITES = {"qkv": 2, "gate_up": 2, "linear": 4, "embedding": 1}

ARCHS: Dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", _llama, LLAMA_TARGETS, LLAMA_SITES),
    "mistral": ArchSpec("mistral", _mistral, LLAMA_TARGETS, LLAMA_SITES),
    "qwen2": ArchSpec("qwen2", _qwen2, LLAMA_TARGETS, LLAMA_SITES),
    "qwen3": ArchSpec("qwen3", _qwen3, LLAMA_TARGETS, LLAMA_SITES),
    "gemma2": ArchSpec("gemma2", _gemma2, LLAMA_TARGETS, LLAMA_SITES),
    "phi3": ArchSpec(
        "phi3", _phi3,
        (["qkv_proj"],
         ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
         ["embed_tokens", "qkv_proj", "gate_up_proj"]),
        # per layer: qkv_proj, o_proj, gate_up_proj, down_proj
        {"linear": 8, "embedding": 1}),
    "gpt2": ArchSpec(
        "gpt2", _gpt2,
        (["c_attn"],
         ["c_attn", "c_proj", "c_fc"],
         ["wte", "c_fc", "c_proj"]),
        # per layer: attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj
        {"linear": 8, "embedding": 1}),
}


def lora_configs(spec: ArchSpec):
    """Three adapters: different ranks, alphas, targets; ``a1`` uses rsLoRA."""
    from peft import LoraConfig
    kw = dict(init_lora_weights=False, lora_dropout=0.0, task_type="CAUSAL_LM")
    return {
        "a0": LoraConfig(r=4, lora_alpha=8, target_modules=list(spec.targets[0]), **kw),
        "a1": LoraConfig(r=8, lora_alpha=6, use_rslora=True, target_modules=list(spec.targets[1]), **kw),
        "a2": LoraConfig(r=2, lora_alpha=3, target_modules=list(spec.targets[2]), **kw),
    }


def build_causal_lm(arch: str, seed: int = 0) -> nn.Module:
    """A tiny random fp32 CausalLM of ``arch`` in eval mode (eager attention everywhere)."""
    from transformers import AutoModelForCausalLM
    config = ARCHS[arch].make_config()
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        # HF initialises biases to zero: randomise them, or a fused GEMM that drops Qwen2's q/k/v
        # biases (or GPT-2's Conv1D ones) would still match
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.1)
    gc = model.generation_config
    gc.pad_token_id, gc.eos_token_id, gc.bos_token_id = PAD_ID, 2, 1
    return model.eval()


def with_sliding_window(size: int):
    """A ``prepare_base`` for ``build_peft_lm``: the model's sliding layers get a window of ``size``."""
    def prepare(model):
        model.config.sliding_window = size
        for m in model.modules():
            if getattr(m, "sliding_window", None):
                m.sliding_window = size
    return prepare


def build_peft_lm(arch: str, seed: int = 0, prepare_base=None):
    """``build_causal_lm`` wrapped by PEFT with the three adapters of ``lora_configs``
    (``prepare_base(model)`` runs on the base model first, e.g. accelerate's dispatch)."""
    import warnings

    from peft import get_peft_model
    model = build_causal_lm(arch, seed)
    if prepare_base is not None:
        prepare_base(model)
    cfgs = lora_configs(ARCHS[arch])
    torch.manual_seed(seed + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tied-embedding and fan_in_fan_out notices
        peft_model = get_peft_model(model, cfgs["a0"], adapter_name="a0")
        for name in ("a1", "a2"):
            peft_model.add_adapter(name, cfgs[name])
    return peft_model.eval()


def left_padded_batch(lengths: Sequence[int], seed: int = 0) -> Dict[str, torch.Tensor]:
    """input_ids / attention_mask for rows of the given lengths, padded on the left."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[i, width - n:] = 1
    return {"input_ids": ids, "attention_mask": mask}


# the parity tests' mixed batch (``e2e/test_parity_models.py``, whose docstring gives the tolerance's
# reasons): every adapter and "__base__", twice each in a different order, rows of different lengths
PARITY_NAMES = ["a0", "__base__", "a1", "a2", "a1", "__base__", "a2", "a0"]
PARITY_LENGTHS = [5, 9, 3, 9, 7, 6, 4, 8]
PARITY_ATOL, PARITY_RTOL = 1e-5, 1e-4  # fp32 logits


# ---- a plain torch MLP for the interleaved-batch oracle -----------------------------------------
class TinyMLP(nn.Module):
    def __init__(self, d_in: int = 24, d_hidden: int = 40, d_out: int = 16):
        super().__init__()
        self.lin0 = nn.Linear(d_in, d_hidden)
        self.act = nn.GELU()
        self.lin1 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.lin1(self.act(self.lin0(x)))


def build_peft_mlp(seed: int = 0, adapters: List[str] = ("adapter0", "adapter1")):
    """A ``TinyMLP`` with two LoRA adapters on ``lin0`` / ``lin1`` (different ranks, B non-zero)."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    base = TinyMLP().eval()
    cfgs = [LoraConfig(r=4, lora_alpha=8, target_modules=["lin0", "lin1"], init_lora_weights=False),
            LoraConfig(r=6, lora_alpha=4, use_rslora=True, target_modules=["lin0", "lin1"],
                       init_lora_weights=False)]
    model = get_peft_model(base, cfgs[0], adapter_name=adapters[0])
    model.add_adapter(adapters[1], cfgs[1])
    return model.eval()
