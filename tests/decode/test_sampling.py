"""Per-request sampling (``continuous/sampling.py``) and a failing engine step confined to its
requests (``continuous/engine.py``).

The selection math against torch references: the counter-based noise against splitmix64 in
Python integers, draws against the softmax they sample from (deterministic seeds, so a bound
that cannot flake), top-k / top-p cuts, penalties, log-probabilities. Through the engine, each
sampled request's tokens against an oracle built from PEFT: its logits for the request's prefix,
alone, given to the same selection with the request's seed at each position. Greedy requests in
the same steps stay equal to PEFT's ``generate``.
"""

from __future__ import annotations

import math

import pytest
import torch

from peft_fastlora.continuous.sampling import SamplingParams, mix64, select, uniform_noise

from _continuous import cb_config, collect, greedy_config, peft_alone, random_prompts, requires_cb

M64 = (1 << 64) - 1


def _splitmix_reference(x: int) -> int:
    x &= M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


# -- parameters --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature="1"), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(top_k=2.0), "top_k"), (dict(top_k=True), "top_k"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"), (dict(seed=1.5), "seed"),
])
def test_bad_sampling_params_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_plain_params_keep_the_engine_token_and_sampled_ones_get_a_seed():
    assert SamplingParams().plain and SamplingParams(temperature=0.0, top_p=0.5).plain
    assert not SamplingParams(logprobs=0).plain and not SamplingParams(frequency_penalty=0.1).plain
    sampled = SamplingParams(temperature=0.7)
    assert sampled.seed is None and sampled.with_seed().seed is not None
    assert SamplingParams(temperature=0.7, seed=5).with_seed().seed == 5


# -- the noise ---------------------------------------------------------------------------------------
def test_mix64_is_splitmix64():
    g = torch.Generator().manual_seed(0)
    values = torch.randint(-(2**63), 2**63 - 1, (64,), generator=g, dtype=torch.int64).tolist()
    values += [0, 1, -1, 2**63 - 1, -(2**63)]
    mixed = mix64(torch.tensor(values, dtype=torch.int64)).tolist()
    assert [m & M64 for m in mixed] == [_splitmix_reference(v) for v in values]


def test_noise_is_a_pure_function_of_seed_position_and_token():
    seeds, positions = torch.tensor([3, 3, 4]), torch.tensor([0, 1, 0])
    u = uniform_noise(seeds, positions, 1000)
    assert torch.equal(u, uniform_noise(seeds, positions, 1000))
    assert torch.equal(u[:, :10], uniform_noise(seeds, positions, 10))  # a token's noise ignores the vocab size
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert abs(float(u.mean()) - 0.5) < 0.02


# -- selection ---------------------------------------------------------------------------------------
def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def test_draws_follow_the_softmax():
    probs = torch.tensor([0.05, 0.1, 0.15, 0.3, 0.4])
    n = 20000
    logits = (probs.log() * 2.0).expand(n, 5).clone()  # temperature 2 gives back ``probs``
    params = [SamplingParams(temperature=2.0, seed=11)] * n
    tokens, _ = select(logits, params, list(range(n)), [[]] * n)
    freq = _frequencies(tokens, 5)
    # five standard deviations of a binomial frequency: deterministic draws, so no flake
    assert torch.all((freq - probs.double()).abs() <= 5 * (probs * (1 - probs) / n).sqrt().double()), freq


@pytest.mark.parametrize("cut, kept", [(dict(top_k=2), [3, 4]), (dict(top_p=0.5), [3, 4]),
                                       (dict(top_p=0.71), [2, 3, 4]), (dict(top_k=1), [4]),
                                       (dict(top_k=3, top_p=0.5), [3, 4])])
def test_top_k_and_top_p_cut_and_renormalise(cut, kept):
    probs = torch.tensor([0.05, 0.1, 0.15, 0.3, 0.4])
    n = 12000
    params = [SamplingParams(temperature=1.0, seed=s, **cut) for s in range(n)]
    tokens, _ = select(probs.log().expand(n, 5).clone(), params, [0] * n, [[]] * n)
    freq = _frequencies(tokens, 5)
    assert set(torch.nonzero(freq).flatten().tolist()) == set(kept)
    expected = torch.zeros(5, dtype=torch.float64)
    expected[kept] = probs[kept].double() / probs[kept].double().sum()
    assert torch.all((freq - expected).abs() <= 5 * (expected * (1 - expected) / n).sqrt() + 1e-12), freq


def test_rows_keep_their_own_settings_in_one_call():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 50, generator=g)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.5, seed=3,
                                                                                         top_k=5),
              SamplingParams(logprobs=2)]
    tokens, logprobs = select(logits, params, [0, 0, 7, 0], [[]] * 4)
    alone = [select(logits[i:i + 1], [params[i]], [[0, 0, 7, 0][i]], [[]])[0].item() for i in range(4)]
    assert tokens.tolist() == alone
    assert tokens[0] == logits[0].argmax() and tokens[3] == logits[3].argmax()
    assert logprobs[:3] == [None, None, None] and logprobs[3] is not None


def test_penalties_as_openai_defines_them():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 30, generator=g)
    outputs = [[logits[0].argmax().item()] * 3 + [4], [7, 7]]
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=1.0), SamplingParams(presence_penalty=-2.0)]
    tokens, _ = select(logits, params, [4, 2], outputs)
    expected = logits.clone()
    for row, (p, out) in enumerate(zip(params, outputs)):
        for t in set(out):
            expected[row, t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    assert tokens.tolist() == expected.argmax(-1).tolist()


def test_logprobs_are_the_models_log_softmax():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 40, generator=g)
    params = [SamplingParams(logprobs=3), SamplingParams(temperature=0.8, seed=9, logprobs=0)]
    tokens, logprobs = select(logits, params, [0, 5], [[], []])
    reference = torch.log_softmax(logits, -1)
    for row, entry in enumerate(logprobs):
        assert entry.token == tokens[row].item()
        assert math.isclose(entry.logprob, reference[row, entry.token].item(), rel_tol=1e-6, abs_tol=1e-6)
    top = reference[0].topk(3)
    assert [t for t, _ in logprobs[0].top] == top.indices.tolist()
    assert logprobs[1].top == []


# -- through the engine -----------------------------------------------------------------------------
@pytest.fixture
def pair_options():
    return dict(cuda_graphs="emulate")  # the ``pair`` fixture (conftest) patched with emulated graphs


def _oracle(ref, prompt, adapter: str, params: SamplingParams, new_tokens: int):
    """The request's tokens from PEFT's logits of each prefix alone, selected like the engine's rows."""
    out = []
    for position in range(new_tokens):
        ids = torch.tensor([list(prompt) + out])
        with torch.no_grad():
            logits = ref(input_ids=ids, adapter_names=[adapter]).logits[0, -1:].float()
        token, _ = select(logits, [params], [position], [list(out)])
        out.append(int(token))
    return out


@requires_cb
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "emulated-graphs"])
def test_sampled_requests_equal_the_oracle_and_greedy_ones_peft(pair, graphs):
    model, ref = pair
    new = 6
    prompts = random_prompts([5, 9, 3, 7, 4], seed=5)
    adapters = ["a0", "a1", "__base__", "a2", "a0"]
    params = [SamplingParams(temperature=0.9, seed=1), None, SamplingParams(temperature=1.3, top_k=20, seed=2),
              SamplingParams(temperature=0.7, top_p=0.8, frequency_penalty=0.5, seed=3),
              SamplingParams(frequency_penalty=1.0, presence_penalty=0.5)]
    config = cb_config(use_cuda_graph=True) if graphs else cb_config()
    manager = model.init_continuous_batching(generation_config=greedy_config(new), continuous_batching_config=config)
    manager.start()
    try:
        ids = [manager.add_request(p, adapter_name=a, max_new_tokens=new, sampling=s)
               for p, a, s in zip(prompts, adapters, params)]
        got = collect(manager, ids)
        if graphs:
            assert manager.fastlora_graphs is not None and manager.fastlora_graphs.stats["graphed_steps"] > 0
    finally:
        manager.stop(block=True, timeout=30)
    for rid, prompt, adapter, p in zip(ids, prompts, adapters, params):
        expected = peft_alone(ref, prompt, adapter, new) if p is None else _oracle(ref, prompt, adapter, p, new)
        assert got[rid] == expected, (adapter, p)


@requires_cb
def test_a_seeded_request_draws_the_same_tokens_alone_and_in_company(pair):
    model, _ = pair
    prompt = random_prompts([6], seed=8)[0]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    manager = model.init_continuous_batching(generation_config=greedy_config(8), continuous_batching_config=cb_config())
    manager.start()
    try:
        alone = manager.add_request(prompt, adapter_name="a1", max_new_tokens=8, sampling=params)
        first = collect(manager, [alone])[alone]
        others = [manager.add_request(p, adapter_name="a0", max_new_tokens=12,
                                      sampling=SamplingParams(temperature=1.0, seed=i))
                  for i, p in enumerate(random_prompts([4, 8, 11], seed=9))]
        again = manager.add_request(prompt, adapter_name="a1", max_new_tokens=8, sampling=params)
        other_seed = manager.add_request(prompt, adapter_name="a1", max_new_tokens=8,
                                         sampling=SamplingParams(temperature=1.0, top_p=0.95, seed=4321))
        got = collect(manager, others + [again, other_seed])
    finally:
        manager.stop(block=True, timeout=30)
    assert got[again] == first
    assert got[other_seed] != first  # another seed, another draw (fixed seeds: no flake)


@requires_cb
def test_logprobs_through_the_engine(pair):
    model, ref = pair
    prompt = random_prompts([5], seed=12)[0]
    manager = model.init_continuous_batching(generation_config=greedy_config(4), continuous_batching_config=cb_config())
    manager.start()
    try:
        rid = manager.add_request(prompt, adapter_name="a2", max_new_tokens=4, sampling=SamplingParams(logprobs=2))
        tokens = collect(manager, [rid])[rid]
        entries = manager.fastlora_sampling.logprobs(rid)
    finally:
        manager.stop(block=True, timeout=30)
    assert tokens == peft_alone(ref, prompt, "a2", 4) and [e.token for e in entries] == tokens
    for position, entry in enumerate(entries):
        ids = torch.tensor([list(prompt) + tokens[:position]])
        with torch.no_grad():
            expected = torch.log_softmax(ref(input_ids=ids, adapter_names=["a2"]).logits[0, -1].float(), -1)
        assert math.isclose(entry.logprob, expected[entry.token].item(), abs_tol=1e-4)
        assert [t for t, _ in entry.top] == expected.topk(2).indices.tolist()


@requires_cb
def test_sampling_must_be_sampling_params(pair):
    model, _ = pair
    manager = model.init_continuous_batching(generation_config=greedy_config(2), continuous_batching_config=cb_config())
    with pytest.raises(TypeError, match="SamplingParams"):
        manager.add_request([5, 6], adapter_name="a0", sampling={"temperature": 1.0})


@requires_cb
def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(pair):
    model, ref = pair
    embed = model.get_input_embeddings()
    poison = 3

    def hook(module, args):
        if bool((args[0] == poison).any()):
            raise RuntimeError("injected failure")

    manager = model.init_continuous_batching(generation_config=greedy_config(5), continuous_batching_config=cb_config())
    manager.start()
    handle = embed.register_forward_pre_hook(hook)
    try:
        bad = manager.add_request([4, poison, 6], adapter_name="a0", max_new_tokens=5)
        result = None
        while result is None or not result.is_finished():
            result = manager.get_result(request_id=bad, timeout=10)
        assert result.error is not None and "injected failure" in result.error
        handle.remove()
        prompts = random_prompts([4, 6], seed=2)
        ids = [manager.add_request(p, adapter_name=a, max_new_tokens=5) for p, a in zip(prompts, ["a1", "__base__"])]
        got = collect(manager, ids)
        assert manager.is_running()
    finally:
        handle.remove()
        manager.stop(block=True, timeout=30)
    for rid, p, a in zip(ids, prompts, ["a1", "__base__"]):
        assert got[rid] == peft_alone(ref, p, a, 5)
