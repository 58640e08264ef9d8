"""The drafter and its TTT unroll: draft vocab, every TTT attention kernel vs the naive full-mask
reference (outputs and gradients in fp32), loss bookkeeping."""

from __future__ import annotations

import pytest
import torch
from ttt_reference import NaiveTTTAttention, ttt_mask  # tests/ttt_reference.py: pytest puts tests/ on sys.path

from eaglet.drafter import (
    DiagonalTTTAttention,
    DraftConfig,
    DraftOutput,
    Eagle3Draft,
    Teacher,
    acceptance_length,
    apply_rope,
    build_draft_vocab,
    make_teacher,
    rope_cos_sin,
    stats_summary,
    ttt_loss,
)
from eaglet.drafter.attention import CHUNKED, FLASH, TTT_KERNELS, CausalLogSumExp, default_kernel
from eaglet.drafter.eagle3 import shift_left
from eaglet.drafter.objectives import objective_loss

# Every kernel, named, so the CPU suite runs each (the CPU's default is "flash", a GPU's "chunked").
# The chunked kernel with chunks of 4 over the 13 positions of `random_batch`: chunks 4, 4, 4 and 1.
KERNELS = {
    "flash": dict(kernel=FLASH),
    "chunked-4": dict(kernel=CHUNKED, chunk_size=4),
    "chunked-whole": dict(kernel=CHUNKED),
}


def tiny_config(**kw) -> DraftConfig:
    base = dict(
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
        target_vocab_size=50,
        draft_vocab_size=30,
        aux_layer_ids=[2, 4, 5],
    )
    base.update(kw)
    return DraftConfig(**base)


def test_draft_vocab_most_frequent_and_padded():
    freq = {7: 100, 3: 50, 9: 50, 1: 10, 60: 999}  # 60 is outside the target vocab
    d2t, t2d = build_draft_vocab(freq, target_vocab_size=20, draft_vocab_size=3)
    ids = torch.arange(3) + d2t
    assert ids.tolist() == [3, 7, 9] and d2t.dtype == torch.int64
    assert t2d.dtype == torch.bool and t2d.sum() == 3 and t2d[ids].all()
    # Fewer distinct tokens than the draft vocab: the lowest unused ids fill it.
    d2t, t2d = build_draft_vocab(freq, target_vocab_size=20, draft_vocab_size=6)
    assert (torch.arange(6) + d2t).tolist() == [0, 1, 2, 3, 7, 9]
    assert t2d.sum() == 6
    d2t, _ = build_draft_vocab({}, target_vocab_size=400)
    assert d2t.shape == (400,) and (d2t == 0).all()  # default min(32000, vocab)
    with pytest.raises(ValueError):
        build_draft_vocab(freq, 20, 21)


def test_config_from_target(tiny_target):
    from transformers import AutoConfig

    cfg = DraftConfig.from_target(AutoConfig.from_pretrained(tiny_target), [2, 4, 5])
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 4, 2, 16)
    assert cfg.draft_vocab_size == cfg.target_vocab_size == 400 and cfg.target_hidden_size == 64


def test_checkpoint_key_names():
    keys = set(Eagle3Draft(tiny_config()).state_dict())
    expected = {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "embed_tokens.weight",
        "d2t",
        "t2d",
        "midlayer.hidden_norm.weight",
        "midlayer.input_layernorm.weight",
        "midlayer.post_attention_layernorm.weight",
    }
    expected |= {f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"}
    expected |= {f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert keys == expected
    assert "fc_norm.weight" in Eagle3Draft(tiny_config(fc_norm=True)).state_dict()


def test_ttt_mask_shape():
    m = ttt_mask(4, 2)
    assert m.shape == (4, 12)
    assert m[2].tolist() == [True, True, True, False] + [False, False, True, False] * 2


def random_batch(cfg: DraftConfig, B: int = 2, L: int = 13, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.target_vocab_size, (B, L), generator=g)
    aux = torch.randn(B, L, 3 * cfg.hidden_size, generator=g)
    last = torch.randn(B, L, cfg.hidden_size, generator=g)
    mask = (torch.rand(B, L, generator=g) > 0.2).long()
    return ids, aux, last, mask


def drafter_and_batch(cfg: DraftConfig, seed: int):
    """A random drafter with a 30-token draft vocab, a random batch and a random target head."""
    torch.manual_seed(seed)
    model = Eagle3Draft(cfg)
    d2t, t2d = build_draft_vocab({i: 100 - i for i in range(0, 50, 2)}, 50, 30)
    model.set_draft_vocab(d2t, t2d)
    ids, aux, last, mask = random_batch(cfg)
    head = torch.nn.Linear(cfg.hidden_size, cfg.target_vocab_size, bias=False)
    return model, (d2t, t2d), (ids, aux, last, mask), head


def two_samples_per_row(L: int, first: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(documents, positions) [len(first), L] of rows packed with two samples, row b's first
    `first[b]` long: each position's sample number, and its position within that sample."""
    t = torch.arange(L)
    documents = torch.stack([(t >= n).long() for n in first])
    positions = torch.stack([torch.where(t < n, t, t - n) for n in first])
    return documents, positions


VARIANTS = {
    "plain": ({}, False),
    "eagle3.1": ({"norm_output": True, "fc_norm": True}, False),
    "window": ({"sliding_window": 4, "norm_before_residual": True}, False),
    "packed-window": ({"sliding_window": 4}, True),
}


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
@pytest.mark.parametrize("variant,packed", VARIANTS.values(), ids=VARIANTS.keys())
def test_every_kernel_matches_naive_reference(variant, packed, kernel):
    """Outputs, loss, statistics and every gradient (the drafter's and the aux states') of each
    named kernel equal the naive full-mask reference's over 5 TTT steps, GQA, with a sliding
    window and in packed rows."""
    cfg = tiny_config(**variant)
    model, (d2t, t2d), (ids, aux, last, mask), head = drafter_and_batch(cfg, 0)
    teacher = make_teacher(last, torch.nn.Identity(), head, d2t, t2d)
    documents, positions = two_samples_per_row(ids.shape[1], [5, 8]) if packed else (None, None)

    def run(attention):
        model.zero_grad()
        a = aux.clone().requires_grad_(True)
        out = model(ids, a, steps=5, attention=attention, documents=documents, positions=positions)
        loss, stats = ttt_loss(out, teacher, mask, documents=documents)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        return out, loss, stats, grads, a.grad

    out_e, loss_e, stats_e, grads_e, ga_e = run(lambda: DiagonalTTTAttention(**kernel))
    out_n, loss_n, stats_n, grads_n, ga_n = run(NaiveTTTAttention)
    for a, b in zip(out_e.logits, out_n.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_e, loss_n, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats_e.as_tensor(), stats_n.as_tensor())
    for name in grads_e:
        torch.testing.assert_close(grads_e[name], grads_n[name], rtol=1e-4, atol=1e-6, msg=name)
    torch.testing.assert_close(ga_e, ga_n, rtol=1e-4, atol=1e-6)
    # Later steps really attend to the diagonal: dropping it changes the output.
    assert not torch.allclose(out_e.logits[1], model(ids, aux, steps=2).logits[0])


def test_kernel_is_named_and_defaults_per_device():
    """A core runs the kernel it is given on any device where it runs; unnamed, the device's
    default (the CPU's flash kernel, elsewhere chunked). Unknown names and the flash kernel off
    the CPU are refused, not replaced."""
    assert TTT_KERNELS == (FLASH, CHUNKED)
    assert default_kernel(torch.device("cpu")) == FLASH and default_kernel(torch.device("cuda")) == CHUNKED
    with pytest.raises(ValueError, match="unknown TTT attention kernel"):
        DiagonalTTTAttention("fast")
    core = DiagonalTTTAttention(FLASH)
    q, k = torch.empty(1, 4, 5, 8, device="meta"), torch.empty(1, 2, 5, 8, device="meta")
    core(q, k, k)  # step 0 is plain causal attention, whichever kernel
    with pytest.raises(ValueError, match="CPU"):
        core(q, k, k)


def test_step_k_is_teacher_forced_and_position_shifted():
    """Step 1 at position t sees token t+2 and RoPE position t+1: with one position in the
    sequence changed, only the outputs that may see it change."""
    cfg = tiny_config()
    torch.manual_seed(1)
    model = Eagle3Draft(cfg)
    ids, aux, _, _ = random_batch(cfg, B=1, L=10)
    ids2 = ids.clone()
    ids2[0, 6] = (ids[0, 6] + 1) % cfg.target_vocab_size
    with torch.no_grad():
        a, b = model(ids, aux, steps=2).logits, model(ids2, aux, steps=2).logits
    changed0 = (a[0] - b[0]).abs().amax(-1)[0] > 0
    changed1 = (a[1] - b[1]).abs().amax(-1)[0] > 0
    assert changed0.tolist() == [t >= 5 for t in range(10)]  # step 0 at t embeds token t+1
    assert changed1.tolist() == [t >= 4 for t in range(10)]  # step 1 at t embeds token t+2


def test_loss_counts_masked_positions_and_trains_on_drafted_ones():
    B, L, V = 1, 6, 4
    logp = torch.log_softmax(torch.randn(B, L, V), -1)
    teacher = Teacher(logp, logp.argmax(-1), torch.tensor([[True, True, False, True, True, True]]))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    perfect = DraftOutput([shift_left(logp, 1), shift_left(logp, 2)], torch.nn.Identity())
    loss, stats = ttt_loss(perfect, teacher, mask)
    # step 0 counts t when token t+2 is masked (t in 0..3); the target's choice at t+1 is drafted for t in {0, 2, 3}
    assert stats.count.tolist() == [4.0, 3.0] and stats.loss_count.tolist() == [3.0, 2.0]
    assert stats.correct.tolist() == stats.loss_count.tolist()  # undrafted positions are misses
    s = stats_summary(stats.as_tensor())
    assert s["acc"] == pytest.approx([0.75, 2 / 3]) and s["drafted"] == pytest.approx([0.75, 2 / 3])
    assert acceptance_length([0.5, 0.5, 0.0, 1.0]) == pytest.approx(0.75)


def reference_ttt_loss(
    logits: list[torch.Tensor], log_probs: torch.Tensor, in_draft: torch.Tensor, mask: torch.Tensor, decay: float = 0.8
) -> torch.Tensor:
    """Position by position: step k at t, counted when token t+k+2 is masked and the teacher at
    t+k+1 is drafted; dense soft cross-entropy; mean per step, weighted decay^k."""
    total = torch.zeros(())
    B, L = mask.shape
    for k, z in enumerate(logits):
        terms = [
            -(log_probs[b, t + k + 1].exp() * torch.log_softmax(z[b, t].float(), -1)).sum()
            for b in range(B)
            for t in range(L - k - 2)
            if mask[b, t + k + 2] and in_draft[b, t + k + 1]
        ]
        if terms:
            total = total + decay**k * torch.stack(terms).mean()
    return total


def test_loss_matches_position_by_position_reference_and_sparse_teachers():
    """The loss applies the LM head only at counted positions; it equals a dense per-position
    reference, a sparse teacher with k = vocab equals the dense one, and k = 1 is the hard label."""
    model, (d2t, t2d), (ids, aux, last, mask), head = drafter_and_batch(tiny_config(), 3)
    dense = make_teacher(last, torch.nn.Identity(), head, d2t, t2d)
    out = model(ids, aux, steps=3)
    loss, stats = ttt_loss(out, dense, mask)
    ref = reference_ttt_loss(out.logits, dense.log_probs, dense.in_draft, mask)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    full_k = make_teacher(last, torch.nn.Identity(), head, d2t, t2d, top_k=30)
    torch.testing.assert_close(ttt_loss(out, full_k, mask)[0], loss, rtol=1e-5, atol=1e-6)
    hard = make_teacher(last, torch.nn.Identity(), head, d2t, t2d, top_k=1)
    assert torch.equal(hard.argmax, dense.argmax) and torch.equal(hard.log_probs, torch.zeros_like(hard.log_probs))
    one_hot = torch.full_like(dense.log_probs, -1e4).scatter(-1, dense.argmax[..., None], 0.0)
    torch.testing.assert_close(
        ttt_loss(out, hard, mask)[0],
        reference_ttt_loss(out.logits, one_hot, dense.in_draft, mask),
        rtol=1e-5,
        atol=1e-5,
    )
    for a, b in zip(ttt_loss(out, hard, mask)[1].as_tensor()[1:], stats.as_tensor()[1:]):  # same hits and counts
        assert torch.equal(a, b)


def test_feature_loss_regresses_the_next_last_layer_state():
    cfg = tiny_config()
    torch.manual_seed(4)
    model = Eagle3Draft(cfg)
    ids, aux, last, mask = random_batch(cfg)
    head = torch.nn.Linear(cfg.hidden_size, cfg.target_vocab_size, bias=False)
    d2t, t2d = build_draft_vocab({}, 50, 30)
    teacher = make_teacher(last, torch.nn.Identity(), head, d2t, t2d, features=True)
    assert torch.equal(teacher.features, last)
    out = model(ids, aux, steps=2)
    base, _ = ttt_loss(out, teacher, mask)
    with_features, _ = ttt_loss(out, teacher, mask, feature_weight=1.0)
    expected = sum(
        0.8**k
        * torch.nn.functional.smooth_l1_loss(
            out.hidden[k][:, : -k - 2][mask[:, k + 2 :].bool()], last[:, k + 1 : -1][mask[:, k + 2 :].bool()]
        )
        for k in range(2)
    )
    torch.testing.assert_close(with_features - base, expected, rtol=1e-5, atol=1e-6)


def test_rope_matches_transformers_llama():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    hf_cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=50000.0)
    q, k = torch.randn(2, 4, 9, 16), torch.randn(2, 4, 9, 16)
    pos = torch.arange(3, 12)
    cos, sin = LlamaRotaryEmbedding(hf_cfg)(q, pos[None].expand(2, -1))
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)
    mine_cos, mine_sin = rope_cos_sin(pos, 16, 50000.0)
    torch.testing.assert_close(apply_rope(q, mine_cos, mine_sin), ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_rope(k, mine_cos, mine_sin), ref_k, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 3])
def test_causal_logsumexp_gradients(window):
    """The SDPA-based backward of the causal log-sum-exp against finite differences (fp64, GQA,
    chunks), causal and within a sliding window."""
    q = torch.randn(1, 4, 7, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 7, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: CausalLogSumExp.apply(a, b, 3, window), (q, k))
    scores = torch.einsum("bhld,bhsd->bhls", q, k.repeat_interleave(2, dim=1)) / 8**0.5
    allowed = torch.ones(7, 7, dtype=torch.bool).tril()
    if window:
        allowed &= ~torch.ones(7, 7, dtype=torch.bool).tril(-window)
    ref = torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), -1)
    torch.testing.assert_close(CausalLogSumExp.apply(q, k, 3, window), ref)


@pytest.mark.parametrize("window", [None, 2])
def test_causal_logsumexp_gradients_within_documents(window):
    """Packed rows: the log-sum-exp runs over the query's own document only (its mask built here
    by hand), and its gradients pass finite differences; every row has its own documents."""
    q = torch.randn(2, 4, 7, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 7, 8, dtype=torch.float64, requires_grad=True)
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, -1], [0, 0, 0, 0, 0, 1, 1]])
    assert torch.autograd.gradcheck(lambda a, b: CausalLogSumExp.apply(a, b, 3, window, docs), (q, k))
    scores = torch.einsum("bhld,bhsd->bhls", q, k.repeat_interleave(2, dim=1)) / 8**0.5
    t = torch.arange(7)
    allowed = (t[None, :] <= t[:, None])[None] & (docs[:, :, None] == docs[:, None, :])
    if window:
        allowed &= (t[None, :] > t[:, None] - window)[None]
    ref = torch.logsumexp(scores.masked_fill(~allowed[:, None], float("-inf")), -1)
    torch.testing.assert_close(CausalLogSumExp.apply(q, k, 3, window, docs), ref)


@pytest.mark.parametrize("kernel", KERNELS.values(), ids=KERNELS.keys())
@pytest.mark.parametrize("window", [None, 4])
def test_packed_rows_train_as_the_samples_alone(window, kernel):
    """Samples packed into rows (`training.data.pack`) give, at every counted position, the loss
    and accuracy sums each sample gives alone, with each TTT kernel and with the naive full-mask
    reference: no attention, RoPE position or target crosses a sample's end."""
    from eaglet import formats
    from eaglet.training.data import collate, pack

    torch.manual_seed(0)
    draft = Eagle3Draft(tiny_config(sliding_window=window)).double()
    head, norm = torch.nn.Linear(32, 50, bias=False).double(), torch.nn.RMSNorm(32).double()
    samples = [
        formats.TrainingSample(
            torch.randint(0, 50, (n,)),
            torch.randn(n, 96, dtype=torch.float64),
            torch.randn(n, 32, dtype=torch.float64),
            torch.randint(0, 2, (n,)),
        )
        for n in (7, 12, 5, 9)
    ]

    def sums(batch, attention=lambda: DiagonalTTTAttention(**kernel)):
        out = draft(
            batch.input_ids,
            batch.aux_hidden,
            steps=3,
            attention=attention,
            documents=batch.documents,
            positions=batch.positions,
        )
        teacher = make_teacher(batch.last_hidden, norm, head, draft.d2t, draft.t2d)
        return ttt_loss(out, teacher, batch.loss_mask, documents=batch.documents)[1].as_tensor()

    packed = pack([samples[:2], samples[2:]], 20, [0, 1, 2, 3])
    assert packed.input_ids.shape == (2, 20) and packed.docs == [[7, 12], [5, 9]]
    alone = sum(sums(collate([s], None)) for s in samples)
    torch.testing.assert_close(sums(packed), alone)
    torch.testing.assert_close(sums(packed, NaiveTTTAttention), alone)
    unmasked = ttt_loss(
        draft(packed.input_ids, packed.aux_hidden, steps=3, documents=packed.documents, positions=packed.positions),
        make_teacher(packed.last_hidden, norm, head, draft.d2t, draft.t2d),
        packed.loss_mask,
    )[1]
    assert (unmasked.count > alone[2]).all()  # without `documents` the loss would count targets of the next sample


def test_norm_before_residual_takes_the_normalised_state_as_residual():
    """speculators' default layout: h = hidden_norm(g) + attention(...), checked against the
    plain layer run on a pre-normalised g with a unit-weight hidden_norm (RMSNorm is idempotent)."""
    plain = Eagle3Draft(tiny_config())
    variant = Eagle3Draft(tiny_config(norm_before_residual=True))
    variant.load_state_dict(plain.state_dict())
    g = torch.randn(2, 5, 32) * 3
    embeds = torch.randn(2, 5, 32)
    cos, sin = rope_cos_sin(torch.arange(5), 8, 10000.0)
    with torch.no_grad():
        ml_plain, ml_variant = plain.midlayer, variant.midlayer
        ml_plain.hidden_norm.weight.fill_(1.0)
        ml_variant.hidden_norm.weight.fill_(1.0)
        normed = ml_plain.hidden_norm(g)
        expected = ml_plain(normed, embeds, cos, sin, DiagonalTTTAttention())  # a fresh core: step 0
        torch.testing.assert_close(
            ml_variant(g, embeds, cos, sin, DiagonalTTTAttention()), expected, rtol=1e-4, atol=1e-4
        )
        assert not torch.allclose(ml_plain(g, embeds, cos, sin, DiagonalTTTAttention()), expected, atol=1e-2)


def test_lk_objectives_against_their_definitions():
    """-log(overlap) and the KL/TV blend, computed here from full softmaxes: dense and sparse
    teachers agree with them, a one-hot teacher makes LK the cross-entropy, gradients are finite."""
    torch.manual_seed(0)
    z = torch.randn(6, 30, dtype=torch.float32, requires_grad=True)
    p = torch.softmax(torch.randn(6, 30, dtype=torch.float32) * 2, -1)
    q = torch.softmax(z, -1)
    overlap = torch.minimum(p, q).sum(-1)
    kl = (p * (p.log() - q.log())).sum(-1)
    weight = torch.exp(-3 * overlap.detach())
    torch.testing.assert_close(objective_loss(z, p.log(), None, "lk"), -overlap.log())
    torch.testing.assert_close(
        objective_loss(z, p.log(), None, "lk-hybrid"), weight * kl + (1 - weight) * (1 - overlap)
    )
    torch.testing.assert_close(objective_loss(z, p.log(), None, "ce"), -(p * q.log()).sum(-1))
    top, ids = p.log().topk(5, -1)  # sparse: mass only on the k ids
    sparse_p = torch.zeros_like(p).scatter(-1, ids, (top - top.logsumexp(-1, keepdim=True)).exp())
    sparse_overlap = torch.minimum(sparse_p, q).sum(-1)
    torch.testing.assert_close(
        objective_loss(z, top - top.logsumexp(-1, keepdim=True), ids, "lk"), -sparse_overlap.log()
    )
    hard = torch.zeros(6, 1, dtype=torch.float32)
    torch.testing.assert_close(objective_loss(z, hard, ids[:, :1], "lk"), objective_loss(z, hard, ids[:, :1], "ce"))
    objective_loss(z, p.log(), None, "lk-hybrid").sum().backward()
    assert torch.isfinite(z.grad).all()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("rms_norm_eps", -1.0, "rms_norm_eps -1.0: must be > 0 and finite"),
        ("max_position_embeddings", 0, "max_position_embeddings 0: must be whole numbers >= 1"),
        ("norm_output", "yes", "norm_output 'yes': must be true or false"),
    ],
)
def test_a_drafter_config_of_impossible_numbers_is_refused(field, value, message):
    """An edited config.json once passed import, export and eval with these."""
    base = dict(
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
        target_vocab_size=50,
        draft_vocab_size=30,
        aux_layer_ids=[1, 2, 3],
    )
    DraftConfig(**base)
    with pytest.raises(ValueError, match=message):
        DraftConfig(**{**base, field: value})
