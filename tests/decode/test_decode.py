"""Speculative decoding (eaglet.decode): exact against plain decoding on the tiny random Llama."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from eaglet.decode import (
    BOTH,
    DRAFTER,
    NGRAM,
    Calibration,
    DraftTree,
    Eagle3Proposer,
    HybridProposer,
    NgramProposer,
    accept_greedy,
    accept_sampling,
    admit_by_cost,
    ancestor_matrix,
    drop_rivals,
    expected_acceptance,
    keep_nodes,
    measure_pass_costs,
    merge_chain,
    path_nodes,
    plain_generate,
    process_probs,
    speculative_generate,
    tree_attention_mask,
)
from eaglet.drafter import DraftConfig, Eagle3Draft, allowed_keys
from references import plain_greedy  # tests/references.py
from helpers import AUX_IDS, PROMPTS, REPO

COSTS = (1.0, 1.3, 1.6, 1.9, 2.2, 2.5, 2.8, 3.1)  # pass seconds over 1..8 tokens, for cost-aware admission


def make_drafter(target, seed: int = 0, **overrides) -> Eagle3Draft:
    torch.manual_seed(seed)
    cfg = DraftConfig.from_target(target.config, AUX_IDS, draft_vocab_size=300, **overrides)
    drafter = Eagle3Draft(cfg).eval()
    # a non-trivial draft vocab (all even ids, odd ids below 200), so the d2t mapping matters
    ids = torch.tensor(sorted(set(range(0, 400, 2)) | set(range(1, 200, 2))))
    d2t = ids - torch.arange(300)
    t2d = torch.zeros(400, dtype=torch.bool)
    t2d[ids] = True
    drafter.set_draft_vocab(d2t, t2d)
    return drafter


class OracleProposer:
    """Proposes the target's own greedy continuation (from plain_greedy), so nearly every draft
    token is accepted. With `decoys`, each depth's true token comes after a wrong sibling, which
    the tree walk must skip."""

    aux_layer_ids: list[int] = []

    def __init__(self, full: list[int], vocab: int, decoys: bool = False):
        self.full, self.vocab, self.decoys = full, vocab, decoys
        self.seq: list[int] = []

    def observe(self, seq, aux) -> None:
        assert aux is None
        self.seq = list(seq)

    def propose(self, max_depth: int, top_k: int, total_tokens: int) -> DraftTree:
        n = len(self.seq)
        if self.full[:n] != self.seq:
            return DraftTree.empty()
        truth = self.full[n : n + max_depth]
        if not self.decoys or top_k == 1:
            return DraftTree.chain(truth[:total_tokens])
        tokens, parents, parent = [], [], -1
        for t in truth:
            if len(tokens) + 2 > total_tokens:
                break
            tokens += [(t + 1) % self.vocab, t]
            parents += [parent, parent]
            parent = len(tokens) - 1
        return DraftTree(tokens, parents)


# ---------------------------------------------------------------------------------------------
# Pure pieces
# ---------------------------------------------------------------------------------------------


def test_tree_mask_and_greedy_walk():
    #        root
    #       /    \
    #   0:a       1:b
    #   |   \       \
    #  2:c  3:d     4:e
    parents = [-1, -1, 0, 0, 1]
    anc = ancestor_matrix(parents)
    assert anc[2].tolist() == [True, False, True, False, False]
    assert anc[4].tolist() == [False, True, False, False, True]
    mask = tree_attention_mask(parents, prefix_len=3, dtype=torch.float32, device=torch.device("cpu"))
    assert mask.shape == (1, 1, 6, 9)
    visible = mask[0, 0] == 0
    assert visible[:, :3].all()  # the cached prefix
    assert visible[:, 3].all()  # the root
    assert visible[3].tolist()[3:] == [True, True, False, True, False, False]  # node 2 sees root, 0, itself
    tokens = [10, 11, 12, 13, 14]
    # target choices after [root, n0..n4]: root->11 (node 1), node1 -> 14 (node 4), node4 -> 99 bonus
    assert accept_greedy(tokens, parents, [11, 0, 14, 0, 0, 99]) == ([1, 4], 99)
    assert accept_greedy(tokens, parents, [10, 13, 0, 0, 0, 0]) == ([0, 3], 0)
    assert accept_greedy(tokens, parents, [7, 0, 0, 0, 0, 0]) == ([], 7)
    assert accept_greedy([], [], [5]) == ([], 5)


def test_tree_validation():
    DraftTree([1, 2], [-1, 0]).validate(2, 2)
    with pytest.raises(ValueError):
        DraftTree([1, 1], [-1, -1]).validate(2, 2)  # siblings with one token
    with pytest.raises(ValueError):
        DraftTree([1, 2], [1, -1]).validate(2, 2)  # child before parent
    with pytest.raises(ValueError):
        DraftTree([1, 2, 3], [-1, 0, 1]).validate(2, 3)  # too deep


def test_process_probs_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(process_probs(logits, 1.0, 1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = process_probs(logits, 1.0, 0.7)  # 0.5 < 0.7, 0.5 + 0.3 crosses: keep two
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert process_probs(logits, 1.0, 0.1).tolist() == [1.0, 0.0, 0.0, 0.0]


def chi_square_ok(counts: Counter, expected: dict, n: int) -> tuple[float, int, bool]:
    """Pearson chi-square with cells of expected count < 5 pooled; passes below
    dof + 5 sqrt(2 dof) (about a 1e-4 false alarm rate at these sizes)."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for key, p in expected.items():
        e = p * n
        if e >= 5:
            stat += (counts.get(key, 0) - e) ** 2 / e
            cells += 1
        else:
            pooled_obs += counts.get(key, 0)
            pooled_exp += e
    pooled_obs += sum(c for k, c in counts.items() if k not in expected)
    if pooled_exp >= 1:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    else:
        assert pooled_obs <= 3, "mass outside the expected support"
    dof = max(cells - 1, 1)
    return stat, dof, stat < dof + 5 * math.sqrt(2 * dof)


def test_accept_sampling_is_exact_on_a_synthetic_tree():
    """Joint law of (accepted path + bonus) tokens == sampling from the target distributions."""
    V = 4
    gen = torch.Generator().manual_seed(0)
    # target distribution after the root, and after each token as the first / second token
    p_root = torch.tensor([0.1, 0.5, 0.3, 0.1])
    p_after = torch.tensor(
        [[0.7, 0.1, 0.1, 0.1], [0.2, 0.2, 0.5, 0.1], [0.25, 0.25, 0.25, 0.25], [0.05, 0.05, 0.1, 0.8]]
    )
    # tree: root -> {2, 1, 3}; node(2) -> {0, 3}; node(1) -> {2}
    tokens, parents = [2, 1, 3, 0, 3, 2], [-1, -1, -1, 0, 0, 1]
    probs = torch.stack([p_root] + [p_after[t] for t in tokens])
    n = 6000
    counts: Counter = Counter()
    for _ in range(n):
        path, bonus = accept_sampling(tokens, parents, probs, gen)
        seq = [tokens[i] for i in path] + [bonus]
        if len(seq) == 1:  # nothing accepted: the second token would come from the next cycle
            seq.append(-1)
        counts[(seq[0], seq[1])] += 1
    # expected: first token ~ p_root; the second is sampled here only if the first is in the tree
    expected = {}
    for a in range(V):
        if a in (2, 1, 3):
            for b in range(V):
                expected[(a, b)] = float(p_root[a] * p_after[a][b])
        else:
            expected[(a, -1)] = float(p_root[a])
    stat, dof, ok = chi_square_ok(counts, expected, n)
    assert ok, (stat, dof, counts)


# ---------------------------------------------------------------------------------------------
# The drafter's inference pass == its training unroll
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variant", [{}, {"norm_output": True, "fc_norm": True}, {"norm_before_residual": True}, {"sliding_window": 3}]
)
def test_drafter_inference_matches_training_unroll(target, variant):
    drafter = make_drafter(target, **variant)
    L, K, t = 14, 4, 7  # position t, unrolled K steps
    torch.manual_seed(1)
    ids = torch.randint(0, 400, (1, L))
    aux = torch.randn(1, L, 3 * 64)
    with torch.no_grad():
        train = drafter(ids, aux, steps=K).logits
        prop = Eagle3Proposer(drafter)
        seq = ids[0, : t + 2].tolist()  # context 0..t, root = token t+1
        prop.observe(seq, aux[0, : t + 1])
        torch.testing.assert_close(
            prop.log_probs(prop.root_out[None])[0], torch.log_softmax(train[0][0, t], -1), rtol=1e-4, atol=1e-4
        )
        # a chain of teacher-forced nodes: step k feeds token t+1+k at RoPE t+k, sees ctx + chain
        hidden = prop.fed_back(prop.root_out)[None]
        for k in range(1, K):
            slot = prop.context_len + k - 1  # the chain's nodes follow the context in the buffer
            context = allowed_keys(torch.tensor([t]), torch.arange(prop.context_len), drafter.config.sliding_window)
            allowed = torch.cat([context, torch.ones(1, k, dtype=torch.bool)], dim=1)
            out = prop.layer(hidden, ids[0, t + 1 + k : t + 2 + k], torch.tensor([t + k]), slot, allowed)
            torch.testing.assert_close(
                prop.log_probs(out)[0], torch.log_softmax(train[k][0, t], -1), rtol=1e-4, atol=1e-4
            )
            hidden = prop.fed_back(out)


def test_drafted_tokens_are_fed_back_as_target_ids(target):
    """Each depth embeds its parent's token as a target id (the head scores draft ids; this
    drafter's d2t maps draft id i >= 200 to target id 2i - 200), and a top-1 chain is the greedy
    path of the training unroll fed those tokens."""
    drafter = make_drafter(target, seed=5)
    with torch.no_grad():  # draft ids >= 200 win: fed-back tokens then differ from their draft ids
        drafter.lm_head.weight[200:].add_(drafter.lm_head.weight[200:].sign() * 0.05)
    L, K, t = 16, 5, 8
    torch.manual_seed(2)
    ids = torch.randint(0, 400, (1, L))
    aux = torch.randn(1, L, 3 * 64)
    with torch.no_grad():
        prop = Eagle3Proposer(drafter)
        prop.observe(ids[0, : t + 2].tolist(), aux[0, : t + 1])
        fed: list[list[int]] = []
        layer = prop.layer
        prop.layer = lambda hidden, token_ids, *a: fed.append(token_ids.tolist()) or layer(hidden, token_ids, *a)
        chain = prop.propose(K, 1, K).tokens
        assert len(chain) == K and any(c >= 200 and c % 2 == 0 for c in chain[:-1])
        assert fed == [[c] for c in chain[:-1]]  # depth d is fed the token drafted at depth d - 1
        full = torch.tensor([ids[0, : t + 2].tolist() + chain])
        pad = torch.randn(1, full.shape[1] - (t + 1), 3 * 64)  # later positions do not reach position t
        logits = drafter(full, torch.cat([aux[:, : t + 1], pad], dim=1), steps=K).logits
        assert chain == [int(prop.draft_to_target[torch.argmax(logits[k][0, t])]) for k in range(K)]


def test_eagle3_tree_shape(target):
    drafter = make_drafter(target)
    prop = Eagle3Proposer(drafter)
    with torch.no_grad():
        prop.observe([5, 6, 7, 8], torch.randn(3, 192))
        tree = prop.propose(max_depth=4, top_k=3, total_tokens=10)
        tree.validate(4, 10)
        assert len(tree) == 10
        t2d = drafter.t2d
        assert all(bool(t2d[t]) for t in tree.tokens)  # mapped back to target ids in the draft vocab
        chain = prop.propose(max_depth=5, top_k=1, total_tokens=5)
        assert chain.parents == [-1, 0, 1, 2, 3]


def test_eagle3_buffer_growth_mid_tree(target):
    """The drafter's KV buffer (256 slots at first) may grow while a tree is being drafted."""
    drafter = make_drafter(target)
    torch.manual_seed(2)
    seq, aux = torch.randint(0, 400, (252,)).tolist(), torch.randn(251, 192)
    trees, keys = [], []
    for presize in (False, True):
        prop = Eagle3Proposer(drafter)
        if presize:
            prop.reserve(2048, live=0)
        with torch.no_grad():
            prop.observe(seq, aux)
            trees.append(prop.propose(max_depth=4, top_k=3, total_tokens=12))
        keys.append(prop.k_buf[:, :, : 251 + 3 * 3].clone())  # context + 3 expansions of 3 nodes
    assert prop.k_buf.shape[2] == 2048
    assert trees[0] == trees[1]
    torch.testing.assert_close(keys[0], keys[1])


def test_min_prob_keeps_only_likely_drafts(target):
    """The floor prunes by path probability (product along the path), keeps the tree
    ancestor-closed, and leaves nothing to verify when even the best first draft is below it."""
    drafter = make_drafter(target)
    seq, aux = [5, 6, 7, 8], torch.randn(3, 192)
    full = Eagle3Proposer(drafter)
    with torch.no_grad():
        full.observe(seq, aux)
        tree = full.propose(max_depth=4, top_k=3, total_tokens=20)
        root_lp = full.log_probs(full.root_out[None])[0]
    best = float(root_lp.max().exp())
    for floor, expect_empty in ((best * 1.01, True), (best * 0.99, False)):
        gated = Eagle3Proposer(drafter, min_prob=floor)
        with torch.no_grad():
            gated.observe(seq, aux)
            kept = gated.propose(max_depth=4, top_k=3, total_tokens=20)
        assert (len(kept) == 0) == expect_empty
        if len(kept):
            kept.validate(4, 20)
            assert set(kept.tokens) <= set(tree.tokens) and len(kept) < len(tree)
    with pytest.raises(ValueError, match="min_prob"):
        Eagle3Proposer(drafter, min_prob=1.5)


@pytest.mark.parametrize("floor", [0.02, 1.0])
def test_min_prob_drafter_is_exact(target, floor):
    """Fewer drafts never change greedy output; at floor 1 nothing is drafted: one target pass per token."""
    drafter = make_drafter(target)
    for prompt in PROMPTS:
        ref = plain_greedy(target, prompt, 20)
        out, stats = speculative_generate(
            target, drafter, prompt, 20, mode="tree", depth=3, top_k=3, total_tokens=8, min_prob=floor
        )
        assert out == ref
        if floor == 1.0:
            assert stats.target_forwards == 20 and stats.acceptance_rates == []


# ---------------------------------------------------------------------------------------------
# Greedy exactness against plain decoding
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_random_drafter_is_exact(target, mode):
    drafter = make_drafter(target)
    for prompt in PROMPTS:
        ref = plain_greedy(target, prompt, 24)
        out, stats = speculative_generate(target, drafter, prompt, 24, mode=mode, depth=4, top_k=4, total_tokens=12)
        assert out == ref
        assert stats.new_tokens == 24 and stats.stopped == "max_new_tokens"
        assert stats.target_forwards == stats.verify_forwards + 1
        assert sum(stats.accept_counts) == stats.verify_forwards


def test_norm_output_drafter_is_exact(target):
    drafter = make_drafter(target, seed=3, norm_output=True, fc_norm=True)
    ref = plain_greedy(target, PROMPTS[0], 16)
    out, _ = speculative_generate(target, drafter, PROMPTS[0], 16, depth=3, top_k=3, total_tokens=8)
    assert out == ref


@pytest.mark.parametrize("mode,decoys", [("chain", False), ("tree", False), ("tree", True)])
def test_oracle_is_exact_and_accepts_everything(target, mode, decoys):
    depth, new = 4, 41
    for prompt in PROMPTS:
        ref = plain_greedy(target, prompt, new)
        oracle = OracleProposer(prompt + ref, 400, decoys=decoys)
        out, stats = speculative_generate(
            target, oracle, prompt, new, mode=mode, depth=depth, top_k=3, total_tokens=2 * depth
        )
        assert out == ref
        # 1 token from the prefill, then full cycles of depth + 1: 40 / 5 = 8 verifications
        assert stats.verify_forwards == math.ceil((new - 1) / (depth + 1))
        assert stats.tau_verify == pytest.approx(depth + 1)
        assert stats.acceptance_rates == [1.0] * depth


def test_eos_stop(target):
    prompt = PROMPTS[1]
    ref = plain_greedy(target, prompt, 30)
    # an EOS that first occurs mid-output, in the middle of an accepted path
    pos = next(i for i in range(3, 30) if ref[i] not in ref[:i])
    eos = [ref[pos]]
    ref_eos = plain_greedy(target, prompt, 30, eos_ids=eos)
    assert ref_eos == ref[: pos + 1]
    oracle = OracleProposer(prompt + ref, 400)
    out, stats = speculative_generate(target, oracle, prompt, 30, eos_ids=eos, mode="chain", depth=6)
    assert out == ref_eos and stats.stopped == "eos"
    out, _ = speculative_generate(
        target, make_drafter(target), prompt, 30, eos_ids=eos, depth=3, top_k=3, total_tokens=8
    )
    assert out == ref_eos


@pytest.mark.parametrize("new", [1, 2, 5, 7])
def test_max_new_tokens_stop(target, new):
    prompt = PROMPTS[0]
    ref = plain_greedy(target, prompt, new)
    assert len(ref) == new
    oracle = OracleProposer(prompt + plain_greedy(target, prompt, 20), 400)
    out, stats = speculative_generate(target, oracle, prompt, new, mode="chain", depth=4)
    assert out == ref and stats.new_tokens == new


def test_context_limit(target):
    """Never past max_position_embeddings: the tree shrinks near the end, output == plain."""
    limit = target.config.max_position_embeddings
    target.config.max_position_embeddings = 20
    try:
        prompt = PROMPTS[2]  # 11 tokens: 9 more fit
        ref = plain_greedy(target, prompt, 50)
        assert len(ref) == 9
        oracle = OracleProposer(prompt + ref, 400)
        out, stats = speculative_generate(target, oracle, prompt, 50, mode="chain", depth=6)
        assert out == ref and stats.stopped == "context"
        out, _ = speculative_generate(target, make_drafter(target), prompt, 50, depth=6, top_k=3, total_tokens=10)
        assert out == ref
        assert speculative_generate(target, oracle, list(range(20)), 5)[0] == []
        with pytest.raises(ValueError):
            speculative_generate(target, oracle, list(range(21)), 5)
    finally:
        target.config.max_position_embeddings = limit


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------


class TargetTreeProposer:
    """Drafts from the target itself: its 2nd to 4th most likely tokens after the root (so the
    residual after rejections often has to produce the top token), and the top-2 after each of
    them, so sibling rejections and depth-2 acceptances both happen often."""

    aux_layer_ids: list[int] = []

    def __init__(self, model):
        self.model = model
        self.memo: dict[tuple, DraftTree] = {}  # the same few contexts recur across samples

    def observe(self, seq, aux) -> None:
        self.seq = list(seq)

    def propose(self, max_depth: int, top_k: int, total_tokens: int) -> DraftTree:
        key = (tuple(self.seq), max_depth)
        if key not in self.memo:
            self.memo[key] = self.draft(max_depth)
        return self.memo[key]

    def draft(self, max_depth: int) -> DraftTree:
        first = self.model(torch.tensor([self.seq])).logits[0, -1].topk(4).indices[1:].tolist()
        if max_depth < 2:
            return DraftTree(first, [-1, -1, -1])
        batch = torch.tensor([self.seq + [t] for t in first])
        second = self.model(batch).logits[:, -1].topk(2).indices.tolist()
        tokens, parents = list(first), [-1, -1, -1]
        for i, pair in enumerate(second):
            tokens += pair
            parents += [i, i]
        return DraftTree(tokens, parents)


@pytest.mark.parametrize("hybrid", [None, "all", "cost"])
def test_sampling_matches_target_distribution(target, hybrid):
    """With `hybrid`, prompt lookup adds the target's top token (7 follows 7 here) beside the
    drafted siblings: rejection sampling over the merged tree's siblings must stay exact, and
    admitting only what pays ("cost") changes which nodes are verified, never the law."""
    T, top_p, n = 0.05, 0.9, 500
    prompt = PROMPTS[0]
    with torch.no_grad():
        p1 = process_probs(target(torch.tensor([prompt])).logits[0, -1], T, top_p)
        support = p1.nonzero().flatten().tolist()
        p2 = process_probs(target(torch.tensor([prompt + [a] for a in support])).logits[:, -1], T, top_p)
    expected = {
        (a, b): float(p1[a] * p2[i, b]) for i, a in enumerate(support) for b in p2[i].nonzero().flatten().tolist()
    }
    gen = torch.Generator().manual_seed(0)
    proposer = TargetTreeProposer(target)
    depth, top_k, total = 2, 3, 9
    if hybrid:
        proposer = HybridProposer(
            proposer,
            NgramProposer(3),
            (depth, top_k, total),
            lookup_tokens=2,
            pass_costs=COSTS if hybrid == "cost" else None,
        )
        depth, top_k, total = proposer.limits
    counts: Counter = Counter()
    accepted: Counter = Counter()
    sources: Counter = Counter()
    for _ in range(n):
        # 4 tokens: 1 from the prefill, then a depth-2 tree (its max with 3 tokens left)
        out, stats = speculative_generate(
            target,
            proposer,
            prompt,
            4,
            temperature=T,
            top_p=top_p,
            generator=gen,
            depth=depth,
            top_k=top_k,
            total_tokens=total,
        )
        counts[(out[0], out[1])] += 1
        accepted.update({m: c for m, c in enumerate(stats.accept_counts)})
        sources.update(stats.accepted_from)
    stat, dof, ok = chi_square_ok(counts, expected, n)
    assert ok, (stat, dof)
    # rejections, depth-1 and depth-2 acceptances were all exercised
    assert min(accepted[0], accepted[1], accepted[2] if hybrid != "cost" else 31) > 30, accepted
    if hybrid == "all":  # and both proposers' siblings were accepted
        assert min(sources[NGRAM], sources[DRAFTER]) > 30, sources
    # and plain sampling draws from the same law (a check of the reference itself)
    gen = torch.Generator().manual_seed(1)
    plain = Counter(
        tuple(plain_generate(target, prompt, 2, temperature=T, top_p=top_p, generator=gen)[0]) for _ in range(200)
    )
    assert chi_square_ok(plain, expected, 200)[2]


def test_verify_cost_bench_break_even(target):
    """bench/verify_cost.py: the break-even acceptance solves 1 + p + ... + p^d = cost ratio, and
    its timing loop runs passes of 1..MAX_Q tokens through the decoder's TargetRunner."""
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    import verify_cost

    assert verify_cost.break_even_acceptance(1.15, 1) == pytest.approx(0.15, abs=1e-9)
    p = verify_cost.break_even_acceptance(1.59, 2)
    assert 1 + p + p * p == pytest.approx(1.59, abs=1e-9)
    assert verify_cost.break_even_acceptance(2.5, 1) is None  # one draft yields at most 2 tokens
    costs = measure_pass_costs(target, context=12, max_q=verify_cost.MAX_Q, repeats=1)
    assert len(costs) == verify_cost.MAX_Q and all(c > 0 for c in costs)
    assert costs == sorted(costs)  # a longer pass never looks cheaper


# ---------------------------------------------------------------------------------------------
# Prompt lookup and the hybrid proposer
# ---------------------------------------------------------------------------------------------


def test_ngram_lookup_takes_the_longest_latest_match():
    p = NgramProposer(max_ngram=3)
    seq = [1, 2, 9, 1, 2, 7, 5, 1, 2]
    p.observe(seq, None)
    assert p.propose(3, 1, 3).tokens == [7, 5, 1]  # [1, 2] last seen before 7 (not the first, before 9)
    seq += [7, 5]
    p.observe(seq, None)  # the index grows with the sequence: [2, 7, 5] now matches at length 3
    assert p.propose(4, 1, 4).tokens == [1, 2, 7, 5]
    assert p.propose(2, 1, 4).tokens == [1, 2]  # within max_depth
    p.observe([4, 4, 3], None)  # a shorter sequence is another sequence
    assert p.propose(3, 1, 3).tokens == []  # 3 never occurred before
    assert NgramProposer(2, 2).propose(3, 1, 3).tokens == []


def test_merge_chain_shares_prefixes_and_names_sources():
    tree = DraftTree([5, 6, 9], [-1, 0, -1])
    merged, sources = merge_chain(tree, [5, 7, 8])
    assert merged.tokens == [5, 6, 9, 7, 8] and merged.parents == [-1, 0, -1, 0, 3]
    assert sources == [BOTH, DRAFTER, DRAFTER, NGRAM, NGRAM]
    merged.validate(max_depth=3, max_nodes=5)
    same, sources = merge_chain(DraftTree.chain([5, 6]), [5, 6])
    assert same == DraftTree.chain([5, 6]) and sources == [BOTH, BOTH]
    assert merge_chain(DraftTree.empty(), [3, 4]) == (DraftTree.chain([3, 4]), [NGRAM, NGRAM])
    assert path_nodes(merged, [5, 7, 8, 1]) == [0, 3, 4]  # the chain's nodes, up to where it leaves the tree
    assert path_nodes(merged, [9, 6]) == [2] and path_nodes(merged, [1]) == []


def test_drop_rivals_removes_siblings_of_a_confident_chain_with_their_subtrees():
    tree = DraftTree([5, 6, 9, 8, 4], [-1, 0, -1, 2, 0])  # 5 -> (6, 4); 9 -> 8
    assert drop_rivals(tree, [5, 7], {0}) == DraftTree([5, 6, 4], [-1, 0, 0])  # 9 and its child go
    assert drop_rivals(tree, [5, 7], {1}) == DraftTree([5, 9, 8], [-1, -1, 1])  # 6 and 4 rival 7 under 5
    assert drop_rivals(tree, [3, 7], {1}) == tree  # the chain left the tree at depth 0
    assert drop_rivals(tree, [5, 7], set()) == tree


COPY_PROMPT = [300, 12, 13, 14, 88, 91, 150, 2, 77, 31] * 3 + [300, 12]  # copy-heavy: lookup finds the rest


@pytest.mark.parametrize("mode,floor", [("chain", 0.0), ("tree", 0.0), ("tree", 0.3)])
def test_hybrid_is_exact_and_both_proposers_contribute(target, mode, floor):
    limits = (2, 1, 2) if mode == "chain" else (3, 2, 5)
    drafter = make_drafter(target)
    used: Counter = Counter()
    for prompt in [*PROMPTS, COPY_PROMPT]:
        ref = plain_greedy(target, prompt, 24)
        hybrid = HybridProposer(
            Eagle3Proposer(drafter, floor / 10),
            NgramProposer(3, min_prob=floor),
            limits,
            lookup_tokens=4,
            drop_rivals=floor > 0,
        )
        depth, top_k, total = hybrid.limits
        out, stats = speculative_generate(target, hybrid, prompt, 24, depth=depth, top_k=top_k, total_tokens=total)
        assert out == ref
        assert sum(stats.accepted_from.values()) == sum(m * c for m, c in enumerate(stats.accept_counts))
        used.update(stats.accepted_from)
    assert used[NGRAM] > 0, used  # the random drafter alone would accept next to nothing here


def test_hybrid_with_an_oracle_drafter_accepts_everything(target):
    depth, new = 3, 33
    for prompt in [PROMPTS[0], COPY_PROMPT]:
        ref = plain_greedy(target, prompt, new)
        hybrid = HybridProposer(OracleProposer(prompt + ref, 400), NgramProposer(3), (depth, 1, depth), 2)
        out, stats = speculative_generate(target, hybrid, prompt, new, depth=depth, top_k=1, total_tokens=depth + 2)
        assert out == ref and stats.acceptance_rates == [1.0] * depth


def test_ngram_floor_learns_how_deep_to_trust_the_lookup():
    """With a floor, depth d is proposed only while the learned path probability stays above it;
    depths left out keep learning from the committed tokens, so trust can grow and shrink."""
    p = NgramProposer(max_ngram=1, min_prob=0.35)
    seq = [1, 2, 3, 4, 5, 1]
    p.observe(seq, None)
    assert p.propose(4, 1, 4).tokens == [2]  # no evidence yet: 1/2 at depth 0, 1/4 for two tokens
    for _ in range(3):  # the text repeats: every looked-up depth was right
        seq += [2, 3, 4, 5, 1]
        p.observe(seq, None)
        p.propose(4, 1, 4)
    assert p.accept_rate(1, 3) == (3 + 1) / (3 + 2)
    assert p.propose(4, 1, 4).tokens == [2, 3, 4, 5]
    for k in range(10):  # now 1 is followed by something new each time: depth 0 is wrong every time
        seq += [100 + k, 1]
        p.observe(seq, None)
        tokens = p.propose(4, 1, 4).tokens
    assert p.accept_rate(1, 0) == (3 + 1) / (13 + 2) and tokens == []


# ---------------------------------------------------------------------------------------------
# Cost-aware admission (hybrid / ngram with pass costs)
# ---------------------------------------------------------------------------------------------


def test_expected_acceptance_multiplies_down_paths_and_caps_siblings():
    # root -> a (0.7), b (0.6: capped to 0.3, the two cannot both be right); a -> c (0.5)
    e = expected_acceptance([-1, -1, 0], [0.7, 0.6, 0.5])
    assert e == pytest.approx([0.7, 0.3, 0.35])


def test_admit_by_cost_keeps_what_raises_tokens_per_second():
    costs = [1.0, 1.5, 2.1, 2.9]
    # a 2-token pass costs 1.5: a node pays when 1 + e > 1.5, i.e. e > 0.5
    assert admit_by_cost([-1], [0.6], costs) == [0]
    assert admit_by_cost([-1], [0.4], costs) == []
    # a chain: 0.95 pays (1.95/1.5 > 1), 0.85 too (2.8/2.1 > 1.95/1.5), 0.425 not (3.225/2.9 < 2.8/2.1)
    assert admit_by_cost([-1, 0, 1], [0.95, 0.85, 0.425], costs) == [0, 1]
    assert admit_by_cost([-1, 0, 1], [0.9, 0.72, 0.36], costs) == [0]  # 2.62/2.1 < 1.9/1.5
    # likeliest first, ancestor-closed, sorted; within max_nodes and the measured costs
    assert admit_by_cost([-1, -1, 1], [0.3, 0.95, 0.9], costs) == [1, 2]
    assert admit_by_cost([-1, 0, 1, 2, 3], [1.0] * 5, [1.0, 1.1, 1.2, 1.3]) == [0, 1, 2]  # 3 nodes measured
    assert admit_by_cost([-1, 0, 1], [1.0] * 3, costs, max_nodes=1) == [0]
    # time already spent drafting makes a longer pass relatively cheaper
    assert admit_by_cost([-1], [0.45], costs, spent=1.0) == [0]
    assert keep_nodes(DraftTree([5, 6, 7], [-1, -1, 1]), [1, 2]) == DraftTree([6, 7], [-1, 0])


def test_calibration_starts_at_the_proposers_word_and_learns():
    c = Calibration()
    assert c.rate(0.83) == pytest.approx(0.83)
    for _ in range(18):
        c.record(0.85, False)
    assert c.rate(0.83) < 0.1  # a drafter sure of itself and wrong is not trusted
    assert c.rate(0.35) == pytest.approx(0.35)  # other tenths are untouched


@pytest.mark.parametrize("drafted", ["random", "oracle", None])
def test_cost_aware_hybrid_is_exact(target, drafted):
    """Greedy output equals plain greedy's whatever is admitted, also when drafter cycles are skipped
    and caught up later; the drafter runs only while it pays."""
    runs = []
    for prompt in [*PROMPTS, COPY_PROMPT]:
        ref = plain_greedy(target, prompt, 24)
        drafter = {
            "random": lambda: Eagle3Proposer(make_drafter(target)),
            "oracle": lambda: OracleProposer(prompt + ref, 400),
            None: lambda: None,
        }[drafted]()
        hybrid = HybridProposer(drafter, NgramProposer(3), (2, 1, 2), lookup_tokens=4, pass_costs=COSTS)
        depth, top_k, total = hybrid.limits
        out, stats = speculative_generate(target, hybrid, prompt, 24, depth=depth, top_k=top_k, total_tokens=total)
        assert out == ref
        assert sum(stats.accepted_from.values()) == sum(m * c for m, c in enumerate(stats.accept_counts))
        runs.append((hybrid.drafter_runs, stats.verify_forwards, stats.accepted_from))
    if drafted == "oracle":  # always right: where it runs its tokens are taken
        assert all(a.get(DRAFTER, 0) + a.get(BOTH, 0) > 0 for *_, a in runs)
    if drafted == "random":  # next to never right: after learning so, it is mostly not run
        assert sum(r for r, *_ in runs) < sum(v for _, v, _ in runs)


def test_cost_aware_hybrid_skips_the_drafter_where_the_lookup_is_trusted(target):
    """On text that repeats, the lookup's tokens are trusted and a drafter that is right half the
    time cannot pay for itself: it stops running, and when it runs again it has seen every token."""
    prompt = [300, 12, 13, 14, 88, 91, 150, 2, 77, 31] * 6
    ref = plain_greedy(target, prompt + [300], 40)

    class Periodic(OracleProposer):  # right at depth 1 every other cycle, and slow
        calls = 0

        def propose(self, max_depth, top_k, total_tokens):
            Periodic.calls += 1
            tree = super().propose(1, 1, 1)
            return tree if Periodic.calls % 2 else DraftTree.chain([(tree.tokens[0] + 1) % 400])

    hybrid = HybridProposer(Periodic(prompt + [300] + ref, 400), NgramProposer(3), (1, 1, 1), 4, pass_costs=COSTS)
    seen = []
    original = hybrid.drafter.observe
    hybrid.drafter.observe = lambda seq, aux: (seen.append(len(seq)), original(seq, aux))
    out, stats = speculative_generate(target, hybrid, prompt + [300], 40, depth=4, top_k=1, total_tokens=5)
    assert out == ref
    assert hybrid.drafter_runs < stats.verify_forwards / 2, (hybrid.drafter_runs, stats.verify_forwards)
    assert stats.accepted_from.get(NGRAM, 0) > 10
    assert seen and all(a < b for a, b in zip(seen, seen[1:]))  # catch-ups only move forward


def test_an_unlucky_start_does_not_silence_a_good_drafter(target):
    """The drafter's first proposal is wrong and unsure, every later one right and sure: after one
    run the calibration alone would never run it again; exploration keeps it running, it learns,
    and its tokens are taken."""
    prompt = PROMPTS[0]
    ref = plain_greedy(target, prompt, 40)

    class SlowStarter(OracleProposer):
        def propose(self, max_depth, top_k, total_tokens):
            tree = super().propose(1, 1, 1)
            first = not hasattr(self, "path_log_probs")
            self.path_log_probs = [math.log(0.05 if first else 0.95)] * len(tree)
            return DraftTree.chain([(tree.tokens[0] + 1) % 400]) if first and tree.tokens else tree

    runs = {}
    for explore in (0, 8):
        hybrid = HybridProposer(
            SlowStarter(prompt + ref, 400), NgramProposer(3), (1, 1, 1), 2, pass_costs=COSTS, explore_runs=explore
        )
        out, stats = speculative_generate(target, hybrid, prompt, 40, depth=2, top_k=1, total_tokens=3)
        assert out == ref
        runs[explore] = (hybrid.drafter_runs, stats.accepted_from.get(DRAFTER, 0) + stats.accepted_from.get(BOTH, 0))
    assert runs[0] == (1, 0)  # judged on one unlucky sample
    assert runs[8][0] > 8 and runs[8][1] > 5, runs  # later, where the lookup is trusted, it rests


def test_hybrid_refuses_bad_pass_costs():
    with pytest.raises(ValueError, match="pass_costs"):
        HybridProposer(None, NgramProposer(3), (1, 1, 1), 2, pass_costs=[1.0])
    with pytest.raises(ValueError, match="pass_costs"):
        HybridProposer(None, NgramProposer(3), (1, 1, 1), 2, pass_costs=[1.0, 0.0])
