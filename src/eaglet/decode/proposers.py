"""Proposers: what drafts the trees the target verifies (`eaglet.decode.core`).

`Eagle3Proposer` drafts with a trained EAGLE-3 drafter, as a chain or an EAGLE-2 dynamic tree, and
can leave out drafts below a path probability. `NgramProposer` is prompt lookup: the tokens that
followed the context's last n-gram earlier on.

The drafter's KV cache only ever holds "step 0" entries (fed with the target's fused aux
states): tree-node keys are scratch for one cycle. After verification, the accepted positions
are recomputed from the verification pass's aux states, as EAGLE-3 does, so nothing of the
drafter's cache needs compaction.
"""

from __future__ import annotations

import math
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from eaglet.decode.core import DraftTree
from eaglet.drafter import Eagle3Draft, allowed_keys, apply_rope, rope_cos_sin
from eaglet.packed import PackedLinear


# ---------------------------------------------------------------------------------------------
# The proposer interface
# ---------------------------------------------------------------------------------------------


class Proposer(Protocol):
    """What the engine needs from a drafter.

    `aux_layer_ids`: the target's hidden-state ids (HF convention, id k = output of decoder
    layer k-1) the proposer wants after every target pass; empty for none.
    `observe(seq, aux)`: `seq` is the whole committed sequence ending with the root (the token
    the target chose last, not yet fed to it); `aux` [m, sum H] are the target's aux states at
    the m positions the target just processed and kept, i.e. seq[-1-m:-1] (None when no ids).
    `propose(max_depth, top_k, total_tokens)`: a `DraftTree` below the root.
    Optional: `reset()`, called before each sequence; `sources`, the proposer of each node of the
    last tree (a hybrid), else `name`, counted per accepted token in `DecodeStats.accepted_from`.
    """

    aux_layer_ids: list[int]

    def observe(self, seq: list[int], aux: torch.Tensor | None) -> None: ...

    def propose(self, max_depth: int, top_k: int, total_tokens: int) -> DraftTree: ...


# ---------------------------------------------------------------------------------------------
# The EAGLE-3 proposer
# ---------------------------------------------------------------------------------------------


@dataclass
class DrafterProducts:
    """An EAGLE-3 drafter's matrix products, packed for decoding (`eaglet.packed`): q/k/v fused,
    gate/up fused, the LM head and fc. Made from the drafter's weights as they are now."""

    qkv: PackedLinear
    o: PackedLinear
    gate_up: PackedLinear
    down: PackedLinear
    lm_head: PackedLinear
    fc: PackedLinear
    versions: tuple[int, ...]  # the weights' version counters when packed: training changes them in place


def weight_versions(drafter: nn.Module) -> tuple[int, ...]:
    return tuple(p._version for p in drafter.parameters())


_PACKED: weakref.WeakKeyDictionary[nn.Module, DrafterProducts] = weakref.WeakKeyDictionary()


def drafter_products(drafter: Eagle3Draft) -> DrafterProducts:
    """The drafter's packed products, made once per drafter and again after its weights changed
    (held-out evaluation during training decodes with a drafter whose weights move between calls)."""
    versions = weight_versions(drafter)
    packed = _PACKED.get(drafter)
    if packed is None or packed.versions != versions:
        a, m = drafter.midlayer.self_attn, drafter.midlayer.mlp
        with torch.no_grad():
            packed = DrafterProducts(
                PackedLinear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
                PackedLinear(a.o_proj.weight),
                PackedLinear(torch.cat([m.gate_proj.weight, m.up_proj.weight])),
                PackedLinear(m.down_proj.weight),
                PackedLinear(drafter.lm_head.weight),
                PackedLinear(drafter.fc.weight),
                versions,
            )
        _PACKED[drafter] = packed
    return packed


class Eagle3Proposer:
    """Drafts EAGLE-2 dynamic trees with an `Eagle3Draft`, keeping its own KV cache.

    Context position t holds g_t = fc(aux states at t) with the embedding of token t+1 at RoPE
    position t, and predicts token t+2 (training's step 0). A tree node at depth d is fed its
    parent's output (pre-norm, or post-norm with config.norm_output) and its own token, at RoPE
    position (last context position + d), attending to the context cache and its ancestors
    only: the inference twin of the training-time-test unroll.
    """

    def __init__(self, drafter: Eagle3Draft, min_prob: float = 0.0):
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob {min_prob}: a probability in [0, 1]")
        self.drafter = drafter
        # A draft token whose path probability under the drafter (product along the path) is
        # below min_prob is not proposed: where every extra verified token costs target time (a
        # CPU), an unlikely draft costs more than it is expected to save. A cycle with no draft
        # left is a plain one-token target pass.
        self.min_log_prob = math.log(min_prob) if min_prob > 0 else -math.inf
        cfg = drafter.config
        self.cfg = cfg
        self.aux_layer_ids = list(cfg.aux_layer_ids)
        # draft id i is target id i + d2t[i]: the layer embeds target ids, the head scores draft ids
        self.draft_to_target = drafter.draft_to_target_ids()
        self.products = drafter_products(drafter)
        self.reset()

    def reset(self) -> None:
        # One buffer per K and V [1, kv_heads, capacity, head_dim] (roped keys): the context
        # occupies [0, context_len); a cycle's tree nodes are scratch written right after it,
        # so attention reads a view and nothing is re-concatenated per depth.
        self.k_buf: torch.Tensor | None = None
        self.v_buf: torch.Tensor | None = None
        self.context_len = 0
        self.root_out: torch.Tensor | None = None  # [H] drafter output at the last context position
        self.draft_forwards = 0
        self.path_log_probs: list[float] = []  # of the last tree's nodes: log P(path to the node) under the drafter

    def reserve(self, length: int, live: int) -> None:
        """Room for `length` slots, keeping the first `live` (context + this cycle's tree so far)."""
        cfg, w = self.cfg, self.drafter.fc.weight
        if self.k_buf is not None and self.k_buf.shape[2] >= length:
            return
        cap = max(length, 2 * (0 if self.k_buf is None else self.k_buf.shape[2]), 256)
        k_buf = w.new_zeros(1, cfg.num_kv_heads, cap, cfg.head_dim)
        v_buf = w.new_zeros(1, cfg.num_kv_heads, cap, cfg.head_dim)
        if self.k_buf is not None and self.v_buf is not None:  # made together: both or neither
            k_buf[:, :, :live] = self.k_buf[:, :, :live]
            v_buf[:, :, :live] = self.v_buf[:, :, :live]
        self.k_buf, self.v_buf = k_buf, v_buf

    # -- one pass of the drafter's layer -------------------------------------------------------

    def layer(
        self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, slot: int, allowed: torch.Tensor
    ) -> torch.Tensor:
        """The midlayer for q new queries (fed hidden [q, H], tokens [q]) at RoPE `positions`
        [q]. Their keys/values go to buffer slots [slot, slot + q); they attend to slots
        [0, slot + q) as `allowed` [q, slot + q] says. Returns the outputs [q, H]."""
        d = self.drafter
        ml, cfg = d.midlayer, self.cfg
        q_len = hidden.shape[0]
        self.reserve(slot + q_len, live=slot)
        k_buf, v_buf = self.k_buf, self.v_buf
        assert k_buf is not None and v_buf is not None  # reserve() made them
        hidden = hidden.to(d.fc.weight.dtype)
        embeds = d.embed_tokens(token_ids).to(hidden.dtype)
        normed = ml.hidden_norm(hidden)
        x = torch.cat([ml.input_layernorm(embeds), normed], dim=-1)
        q, k, v = self.products.qkv(x).split(
            [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim], dim=-1
        )
        q = q.view(1, q_len, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = k.view(1, q_len, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = v.view(1, q_len, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        q = apply_rope(q, cos, sin)
        k_buf[:, :, slot : slot + q_len] = apply_rope(k, cos, sin)
        v_buf[:, :, slot : slot + q_len] = v
        o = F.scaled_dot_product_attention(
            q,
            k_buf[:, :, : slot + q_len],
            v_buf[:, :, : slot + q_len],
            attn_mask=allowed[None, None],
            enable_gqa=cfg.num_heads != cfg.num_kv_heads,
        )
        h = ml.residual(hidden, normed) + self.products.o(o.transpose(1, 2).reshape(q_len, -1))
        gate, up = self.products.gate_up(ml.post_attention_layernorm(h)).chunk(2, dim=-1)
        h = h + self.products.down(F.silu(gate) * up)
        self.draft_forwards += 1
        return h

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """g = fc(concat aux) of new context positions [m, 3H] (`Eagle3Draft.fuse`, packed)."""
        if self.cfg.fc_norm:
            aux = self.drafter.fc_norm(aux)
        return self.products.fc(aux.to(self.drafter.fc.weight.dtype))

    def log_probs(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocab log-probabilities of the next token from a layer output [q, H]."""
        return torch.log_softmax(self.products.lm_head(self.drafter.norm(out)).float(), dim=-1)

    def fed_back(self, out: torch.Tensor) -> torch.Tensor:
        """The hidden a node passes to its children (what TTT step k+1 got from step k)."""
        return self.drafter.norm(out) if self.cfg.norm_output else out

    # -- Proposer interface --------------------------------------------------------------------

    def observe(self, seq: list[int], aux: torch.Tensor | None) -> None:
        if aux is None:
            raise ValueError("Eagle3Proposer needs the target's aux states")
        m = aux.shape[0]
        start = self.context_len
        if start + m != len(seq) - 1:
            raise ValueError(f"drafter context {start} + {m} new positions != committed {len(seq) - 1}")
        if m == 0:
            return
        device = self.drafter.fc.weight.device
        g = self.fuse(aux.to(device))
        next_tokens = torch.tensor(seq[start + 1 : start + m + 1], device=device)
        positions = torch.arange(start, start + m, device=device)
        allowed = allowed_keys(positions, torch.arange(start + m, device=device), self.cfg.sliding_window)
        out = self.layer(g, next_tokens, positions, start, allowed)
        self.context_len = start + m
        self.root_out = out[-1]

    def propose(self, max_depth: int, top_k: int, total_tokens: int) -> DraftTree:
        """EAGLE-2: expand the top_k best frontier nodes per depth in one batched pass, score by
        cumulative log-prob, keep the best top_k as the next frontier; finally keep the
        total_tokens best of all candidates (ancestor-closed: a child never outscores its parent,
        and on ties the shallower candidate sorts first)."""
        self.path_log_probs = []
        if max_depth < 1 or total_tokens < 1 or self.root_out is None:
            return DraftTree.empty()
        device = self.root_out.device
        k = min(top_k, self.cfg.draft_vocab_size)
        root_pos = self.context_len - 1

        # candidates, in depth order: draft id, cumulative score, parent candidate (-1 = root)
        lp = self.log_probs(self.root_out[None])[0]
        scores, ids = lp.topk(k)
        if scores[0] < self.min_log_prob:
            return DraftTree.empty()
        cand_ids, cand_scores, cand_parent = [ids], [scores], [torch.full((k,), -1, device=device)]
        n_cand = k
        frontier = torch.arange(k, device=device)  # candidate indices of the frontier
        frontier_scores, frontier_ids = scores, ids
        frontier_hidden = self.fed_back(self.root_out)[None].expand(k, -1)
        anc = torch.zeros(0, 0, dtype=torch.bool, device=device)  # expanded x expanded
        frontier_anc = torch.zeros(k, 0, dtype=torch.bool, device=device)  # ancestors among expanded

        for depth in range(1, max_depth):
            if frontier_scores.max() < self.min_log_prob:  # scores only fall with depth: nothing left to keep
                break
            n_exp = anc.shape[0]
            # the frontier sees its ancestors and itself among expanded nodes
            new_anc = torch.cat([frontier_anc, torch.eye(k, dtype=torch.bool, device=device)], dim=1)
            anc = torch.cat(
                [torch.cat([anc, torch.zeros(n_exp, k, dtype=torch.bool, device=device)], 1), new_anc], dim=0
            )
            positions = torch.full((k,), root_pos + depth, device=device)
            # the window is anchored where the node's chain left the context (training's step-k
            # query at position t sees step-0 keys (t - window, t]), not at its RoPE position
            context = allowed_keys(
                torch.full((k,), root_pos, device=device),
                torch.arange(self.context_len, device=device),
                self.cfg.sliding_window,
            )
            allowed = torch.cat([context, new_anc], dim=1)
            # expanded nodes sit in buffer slots context_len + (their expansion index)
            out = self.layer(
                frontier_hidden, self.draft_to_target[frontier_ids], positions, self.context_len + n_exp, allowed
            )

            child_scores, child_ids = self.log_probs(out).topk(k, dim=-1)  # [k, k]
            child_scores = child_scores + frontier_scores[:, None]
            cand_ids.append(child_ids.reshape(-1))
            cand_scores.append(child_scores.reshape(-1))
            cand_parent.append(frontier.repeat_interleave(k))
            best = child_scores.reshape(-1).topk(k).indices
            par = best // k  # which frontier node each new frontier node hangs under
            frontier = n_cand + best
            n_cand += k * k
            frontier_scores = child_scores.reshape(-1)[best]
            frontier_ids = child_ids.reshape(-1)[best]
            frontier_hidden = self.fed_back(out)[par]
            frontier_anc = anc[n_exp + par]

        return self.select(torch.cat(cand_ids), torch.cat(cand_scores), torch.cat(cand_parent), total_tokens)

    def select(self, ids: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, total_tokens: int) -> DraftTree:
        # stable sort on descending score keeps depth order among ties: parents precede children
        order = torch.sort(scores, descending=True, stable=True).indices[:total_tokens]
        order = order[scores[order] >= self.min_log_prob]  # ancestor-closed: a child never outscores its parent
        if len(order) == 0:
            return DraftTree.empty()
        kept = order.sort().values  # candidate order is depth order: topological
        keep = kept.tolist()
        local = {c: i for i, c in enumerate(keep)}
        parents_l = parents.tolist()
        tokens = self.draft_to_target[ids[kept]].tolist()
        tree_parents = [-1 if parents_l[c] < 0 else local[parents_l[c]] for c in keep]
        self.path_log_probs = scores[kept].tolist()
        return DraftTree(tokens, tree_parents)


# ---------------------------------------------------------------------------------------------
# Prompt lookup (n-gram)
# ---------------------------------------------------------------------------------------------


class NgramProposer:
    """Prompt lookup: proposes, as a chain, the tokens that followed the latest earlier occurrence
    of the sequence's last n tokens, for the longest n in [min_ngram, max_ngram] that occurred
    (in the prompt or the text generated so far). An index of every n-gram grows with the
    sequence, so a lookup costs the same however long the context is.

    With `min_prob` > 0 it proposes only as deep as it expects to be right with at least that
    probability, like `Eagle3Proposer`'s floor: it learns, from the tokens committed after each
    lookup in this sequence, how often a token at depth d after an n-token match was the right one
    (Laplace-smoothed: 1/2 before any evidence), and multiplies along the chain."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, min_prob: float = 0.0):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes: need 1 <= min_ngram {min_ngram} <= max_ngram {max_ngram}")
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob {min_prob}: a probability in [0, 1]")
        self.max_ngram, self.min_ngram, self.min_prob = max_ngram, min_ngram, min_prob
        self.aux_layer_ids: list[int] = []
        self.reset()

    def reset(self) -> None:
        self.seq: list[int] = []
        self.indexed = 0  # seq[:indexed] is in the index
        self.follower: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest occurrence
        self.tried: Counter = Counter()  # (n, depth) -> proposals that reached this depth
        self.hit: Counter = Counter()  # (n, depth) -> ... and were accepted there
        self.pending: tuple[int, int, list[int]] | None = None  # (len(seq), n, chain) of the last proposal
        self.confidence: list[float] = []  # of the last proposal: P(its token at depth d is right | the path to d is)

    def observe(self, seq: list[int], aux: torch.Tensor | None) -> None:
        if len(seq) < self.indexed:
            self.reset()  # another sequence (the engine resets proposers before each one, too)
        self.learn(seq)
        # the n-grams that end at i - 1 and are followed by seq[i]: the last n-gram has no follower yet
        for i in range(max(self.indexed, 1), len(seq)):
            for n in range(self.min_ngram, min(self.max_ngram, i) + 1):
                self.follower[tuple(seq[i - n : i])] = i
        self.seq, self.indexed = seq, len(seq)

    def learn(self, seq: list[int]) -> None:
        """Score the last proposal against the tokens committed after it (accepted ones, then the bonus)."""
        if self.pending is None:
            return
        start, n, chain = self.pending
        self.pending = None
        for d, (proposed, committed) in enumerate(zip(chain, seq[start:])):
            self.tried[n, d] += 1
            if proposed != committed:
                break
            self.hit[n, d] += 1

    def accept_rate(self, n: int, depth: int) -> float:
        return (self.hit[n, depth] + 1) / (self.tried[n, depth] + 2)

    def propose(self, max_depth: int, top_k: int, total_tokens: int) -> DraftTree:
        limit = min(max_depth, total_tokens)
        self.confidence = []
        for n in range(min(self.max_ngram, len(self.seq)), self.min_ngram - 1, -1):
            at = self.follower.get(tuple(self.seq[-n:]))
            if at is not None and limit > 0:
                chain = self.seq[at : at + limit]
                # scored in full, also beyond what is proposed: what the target commits does not depend
                # on the proposal (greedy: the tokens; sampled: their law), so a depth left out still
                # learns, and can come back
                self.pending = (len(self.seq), n, chain)
                proposed = chain[: self.trusted_depth(n, len(chain))] if self.min_prob > 0 else chain
                self.confidence = [self.accept_rate(n, d) for d in range(len(proposed))]
                return DraftTree.chain(proposed)
        return DraftTree.empty()

    def trusted_depth(self, n: int, length: int) -> int:
        """How many tokens of a chain after an n-token match keep the path probability >= min_prob."""
        p = 1.0
        for d in range(length):
            p *= self.accept_rate(n, d)
            if p < self.min_prob:
                return d
        return length
