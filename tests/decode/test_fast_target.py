"""The target near the machine (`eaglet.decode.fast`) against Hugging Face's forward: the same
logits in fp32 (bit for bit where the same kernels run), the same aux states, the same KV-cache
compaction after a tree, the same greedy tokens, for every architecture it claims (Llama, Mistral,
Qwen2 with its q/k/v biases, Qwen3 with its per-head q/k norms); the packed matrix products against
`F.linear`; and the cases it hands to Hugging Face's forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eaglet.decode import (
    FAST_TARGET_ENV,
    FastTarget,
    TargetRunner,
    plain_generate,
    speculative_generate,
    target_runner,
    tree_attention_mask,
)
from eaglet.decode.fast import fast_target_refused
from eaglet.packed import PackedLinear
from references import plain_greedy  # tests/references.py

PROMPT = [5, 17, 99, 3, 42, 7, 11, 250, 31, 64, 8, 140]


def tiny(kind: str, **extra):
    """A random 4-layer model of `kind` (vocabulary 300, hidden 64, GQA 4 over 2)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        kind,
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        **extra,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


ARCHITECTURES = {"llama": {}, "mistral": {"sliding_window": None}, "qwen2": {}, "qwen3": {}}


@pytest.mark.parametrize("kind", list(ARCHITECTURES))
def test_logits_and_aux_states_equal_hugging_faces(kind):
    model = tiny(kind, **ARCHITECTURES[kind])
    assert fast_target_refused(model) is None
    fast, hf = FastTarget(model, [1, 2, 3]), TargetRunner(model, [1, 2, 3])
    with torch.inference_mode():
        a, a_aux = fast.forward(PROMPT)
        b, b_aux = hf.forward(PROMPT)
        assert torch.equal(a, b) and torch.equal(a_aux, b_aux)  # the prefill: the same kernels, bit for bit
        for q in (1, 3, 5):  # decode and verification passes over the cache
            a, a_aux = fast.forward(PROMPT[:q])
            b, b_aux = hf.forward(PROMPT[:q])
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a_aux, b_aux, rtol=1e-5, atol=1e-5)
            assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_a_tree_pass_and_its_compaction_equal_hugging_faces():
    """A verification pass over a tree (its mask and tree positions), then the cache kept for one
    accepted branch: the next pass sees the same cache in both."""
    model = tiny("llama")
    parents = [-1, 0, 0, 1, 2]
    nodes = [40, 41, 42, 43, 44]
    fast, hf = FastTarget(model), TargetRunner(model)
    with torch.inference_mode():
        for r in (fast, hf):
            r.forward(PROMPT)
        prefix = len(PROMPT)
        depths = [1, 2, 2, 3, 3]
        mask = tree_attention_mask(parents, prefix, torch.float32, torch.device("cpu"))
        a, _ = fast.forward([9] + nodes, [prefix] + [prefix + d for d in depths], mask)
        b, _ = hf.forward([9] + nodes, [prefix] + [prefix + d for d in depths], mask)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for r in (fast, hf):
            r.keep(prefix, [0, 2, 4])  # root, node 42, node 44: a branch that is no prefix of the fed order
        assert fast.cached == hf.cached == prefix + 3
        a, _ = fast.forward([77])
        b, _ = hf.forward([77])
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_greedy_decoding_is_hugging_faces_token_for_token(tiny_target):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    assert isinstance(target_runner(model), FastTarget)
    for prompt in ([5, 17, 99, 3], PROMPT):
        assert plain_generate(model, prompt, 40)[0] == plain_greedy(model, prompt, 40)


def test_the_kv_cache_grows_past_its_first_size(monkeypatch):
    monkeypatch.setattr("eaglet.decode.fast.INITIAL_CACHE", 8)
    model = tiny("llama")
    prompt = (PROMPT * 3)[:30]
    assert plain_generate(model, prompt, 20)[0] == plain_greedy(model, prompt, 20)


def test_what_the_fast_target_does_not_run_goes_through_hugging_face(monkeypatch):
    assert fast_target_refused(tiny("mistral", sliding_window=8)).startswith("sliding-window attention")
    assert "model type 'gpt2'" in fast_target_refused(
        type("M", (), {"config": type("C", (), {"model_type": "gpt2"})()})()
    )
    model = tiny("llama")
    monkeypatch.setenv(FAST_TARGET_ENV, "0")
    assert isinstance(target_runner(model), TargetRunner)
    monkeypatch.setenv(FAST_TARGET_ENV, "yes")
    with pytest.raises(ValueError, match="EAGLET_FAST_TARGET='yes': set it to 1"):
        target_runner(model)


def test_speculative_decoding_on_the_fast_target_is_exact():
    from eaglet.decode import NgramProposer

    model = tiny("qwen3")
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]  # repeats: the lookup drafts, some of it accepted
    out, stats = speculative_generate(
        model, NgramProposer(3), prompt, 30, mode="chain", depth=3, top_k=1, total_tokens=3
    )
    assert out == plain_greedy(model, prompt, 30) and stats.verify_forwards > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 9, 16, 20])
def test_packed_products_equal_f_linear(dtype, rows):
    torch.manual_seed(rows)
    w, b = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype)
    x = torch.randn(rows, 64, dtype=dtype)
    for bias in (None, b):
        got, ref = PackedLinear(w, bias)(x), F.linear(x, w, bias)
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-4)
