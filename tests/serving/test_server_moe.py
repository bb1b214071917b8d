"""The endpoint over a mixture-of-experts model: Qwen3-MoE-shaped, adapters on attention and on
the routed experts, greedy completions per adapter equal to PEFT alone with that adapter active,
and an expert adapter loaded and unloaded through the API."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import peft_fastlora as fastlora  # noqa: E402
from transformers import ContinuousBatchingConfig, GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from _continuous import requires_cb  # noqa: E402
from _moe import EXPERTS, peft_row_by_row, with_expert_adapters  # noqa: E402
from _server import AppServer  # noqa: E402

pytestmark = requires_cb

VOCAB = 64
ADAPTERS = (("both", ["q_proj", "v_proj"], EXPERTS, 4), ("routed", None, EXPERTS, 8))
C = "/v1/completions"


def _model(adapters=ADAPTERS, seed: int = 0):
    torch.manual_seed(seed)
    base = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                              moe_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
                                              decoder_sparse_step=1, max_position_embeddings=128)).eval()
    base.generation_config.eos_token_id = None
    return with_expert_adapters(base, adapters, b_scale=4.0)


def _tokenizer():
    """Token ids as words ``t0 .. t63``: prompts go as ids, answers come back as those words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i} ": i for i in range(VOCAB)}, unk_token="t3 "))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t3 ", pad_token="t0 ")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from peft_fastlora.server import ServerConfig, create_app

    root = tmp_path_factory.mktemp("adapters")
    donor = _model((("extra", ["q_proj"], EXPERTS, 16),), seed=3)
    donor.save_pretrained(str(root))  # one adapter not named "default": into root / "extra"
    model, ref = _model(), _model()
    fastlora.patch(model)
    gen = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    app = create_app(model, _tokenizer(), ServerConfig(adapter_root=str(root), max_tokens_default=4),
                     generation_config=gen, continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=32))
    server = AppServer(app)
    yield server, ref, root
    server.stop()


def _peft(ref, prompt, name, n) -> str:
    """PEFT's greedy answer for ``prompt`` alone with ``name`` active, as the server decodes text."""
    tokens = peft_row_by_row(ref, torch.tensor([prompt]), [name], new_tokens=n)[0, len(prompt):].tolist()
    return _tokenizer().decode(tokens, skip_special_tokens=True)


def test_each_adapter_answers_as_peft_alone(served):
    server, ref, _ = served
    for i, name in enumerate(["both", "routed", "base"]):
        prompt = [int(t) for t in torch.randint(3, VOCAB, (5 + i,), generator=torch.Generator().manual_seed(i))]
        status, _, content = server.post(C, {"model": name, "prompt": prompt, "max_tokens": 5})
        assert status == 200, content
        assert content["choices"][0]["text"] == _peft(ref, prompt, "__base__" if name == "base" else name, 5)


def test_an_expert_adapter_loaded_and_unloaded_through_the_api(served):
    server, ref, root = served
    status, _, content = server.post("/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": "extra"})
    assert status == 200, content
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref.load_adapter(str(root / "extra"), adapter_name="extra")
    ref.eval()
    prompt = [5, 9, 12, 40]
    status, _, content = server.post(C, {"model": "extra", "prompt": prompt, "max_tokens": 5})
    assert status == 200, content
    assert content["choices"][0]["text"] == _peft(ref, prompt, "extra", 5)
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "extra"})[0] == 200
    assert server.post(C, {"model": "extra", "prompt": prompt, "max_tokens": 2})[0] == 404
