"""Speculative decoding with an EAGLE-3 drafter: EAGLE-2 dynamic trees (or chains), verified exactly.

One decoding cycle, batch size 1:

    committed tokens x_0 .. x_{n-1} sit in the target's KV cache; x_n (the "root") is known
    (the target's own choice from the previous pass) but not yet fed to the target.
    1. the proposer drafts a tree of candidate continuations of x_n (tokens with parents);
    2. ONE target pass over [root, nodes] with a tree attention mask (cache visible to all,
       a node sees its ancestors and itself) and tree positions (n + depth);
    3. walk down from the root: accept the child equal to the target's choice at its parent
       (greedy) or by recursive rejection sampling over siblings (T > 0); the target's choice
       at the last accepted node is the bonus token;
    4. the target's cache keeps prefix + root + accepted path (index-select per layer); the
       proposer is told the new committed tokens and the target's aux states at them.

Accounting (explicit, as asked): the prefill is a target forward and yields the first new
token, so `tau = new_tokens / target_forwards` counts it (plain decoding has tau exactly 1.0).
`tau_verify = (new_tokens - 1) / verify_forwards` is the per-cycle acceptance length the
EAGLE papers report (accepted draft tokens + 1 bonus per verification pass).

The drafter's KV cache only ever holds "step 0" entries (fed with the target's fused aux
states): tree-node keys are scratch for one cycle. After verification, the accepted positions
are recomputed from the verification pass's aux states, as EAGLE-3 does, so nothing of the
drafter's cache needs compaction.

Sampling (temperature > 0, top_p) is exact: siblings are deterministic candidates, so the
rejection rule per sibling is "accept x with probability p(x); on reject zero p(x) and
renormalise; try the next sibling; if all fail, sample from what is left" (SpecInfer / SpecTr
with one-hot drafts). The output distribution equals plain sampling from the processed target
distribution, whatever the drafter proposes.

Proposers: `Eagle3Proposer` (the trained drafter), `NgramProposer` (prompt lookup: the tokens that
followed the context's last n-gram earlier on) and `HybridProposer`, which merges both proposals
into one tree (shared prefixes shared) so one target pass verifies both: on copy-heavy text the
lookup's tokens are accepted, elsewhere the drafter's, without choosing a method per server.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from eaglet.draft_model import allowed_keys

DEFAULT_DEPTH = 7
DEFAULT_TOP_K = 10
DEFAULT_TOTAL_TOKENS = 60

TokenIds = Sequence[int] | torch.Tensor


# ---------------------------------------------------------------------------------------------
# Small pure helpers
# ---------------------------------------------------------------------------------------------

def as_id_list(input_ids: TokenIds) -> list[int]:
    """Token ids from a list, a [L] or a [1, L] tensor (batch size 1 only)."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(f"batch size 1 only, got input_ids of shape {tuple(input_ids.shape)}")
            input_ids = input_ids[0]
        return [int(t) for t in input_ids.tolist()]
    return [int(t) for t in input_ids]


def token_budget(prompt_len: int, max_new_tokens: int, max_positions: int) -> int:
    """How many new tokens may be generated: the prompt plus the output never exceeds the
    target's max_position_embeddings (the same rule for plain and speculative decoding)."""
    if prompt_len < 1:
        raise ValueError("empty prompt")
    if prompt_len > max_positions:
        raise ValueError(f"prompt of {prompt_len} tokens exceeds the target's {max_positions} positions")
    return max(0, min(max_new_tokens, max_positions - prompt_len))


def truncate_at_eos(tokens: list[int], eos_ids: set[int]) -> tuple[list[int], bool]:
    """Tokens up to and including the first EOS, and whether one was found."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: i + 1], True
    return tokens, False


def process_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The sampling distribution (fp32, last dim): softmax(logits / T), cut to the smallest
    most-probable set of mass >= top_p and renormalised. Plain and speculative sampling share it."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep a token while the mass before it is < top_p: the token crossing the threshold stays
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p
        keep_sorted[..., 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def ancestor_matrix(parents: list[int]) -> torch.Tensor:
    """[N, N] bool, row i true at i and its ancestors. parents[i] is -1 (root) or < i."""
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    return anc


def tree_attention_mask(parents: list[int], prefix_len: int, dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor:
    """Additive [1, 1, 1 + N, prefix_len + 1 + N] mask for the verification pass over
    [root, nodes]: the cached prefix is visible to all, the root to all nodes, and a node sees
    its ancestors and itself. Additive 0 / finfo.min works with both Llama's eager attention
    (which adds the mask) and SDPA (float masks are additive); a bool mask would be wrong for eager."""
    n = len(parents)
    # with the root as node 0, every node's parent index shifts by one
    anc = ancestor_matrix([-1] + [p + 1 for p in parents])
    allowed = torch.cat([torch.ones(n + 1, prefix_len, dtype=torch.bool), anc], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def node_depths(parents: list[int]) -> list[int]:
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def children_lists(parents: list[int]) -> list[list[int]]:
    """children[0] are the root's children; children[i + 1] those of node i (in node order)."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        children[p + 1].append(i)
    return children


def accept_greedy(tokens: list[int], parents: list[int], target_choice: list[int]) -> tuple[list[int], int]:
    """Longest path whose every token equals the target's greedy choice at its parent.

    target_choice[0] is the argmax after the root, target_choice[i + 1] after node i. Returns
    the accepted node indices (root excluded) and the bonus token."""
    children = children_lists(parents)
    path: list[int] = []
    at = 0  # position in [root, nodes]
    while True:
        want = target_choice[at]
        nxt = next((c for c in children[at] if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        at = nxt + 1


def accept_sampling(tokens: list[int], parents: list[int], probs: torch.Tensor,
                    generator: torch.Generator | None) -> tuple[list[int], int]:
    """Recursive rejection sampling over siblings; probs [1 + N, V] are the processed target
    distributions after the root and after each node. Siblings are tried in node order (the
    drafter's order, fixed before the target's randomness), each accepted with the current
    residual probability of its token; a rejected token's mass is zeroed and the rest
    renormalised. Exact: the emitted tokens are distributed as plain sampling from probs."""
    children = children_lists(parents)
    path: list[int] = []
    at = 0
    while True:
        p = probs[at].clone()
        accepted = None
        for c in children[at]:
            pc = float(p[tokens[c]])
            if pc > 0.0 and float(torch.rand((), generator=generator)) < pc:
                accepted = c
                break
            p[tokens[c]] = 0.0
            total = float(p.sum())
            if total <= 0.0:  # cannot happen with pc < 1 rejected, but never divide by zero
                break
            p = p / total
        if accepted is None:
            return path, sample_from(p, generator)
        path.append(accepted)
        at = accepted + 1


# ---------------------------------------------------------------------------------------------
# The proposer interface
# ---------------------------------------------------------------------------------------------

@dataclass
class DraftTree:
    """Candidate tokens (target ids) below the root; parents[i] is -1 for the root's children,
    else an index < i (parents come first). Siblings must hold distinct tokens."""

    tokens: list[int]
    parents: list[int]

    def __len__(self) -> int:
        return len(self.tokens)

    @staticmethod
    def empty() -> DraftTree:
        return DraftTree([], [])

    @staticmethod
    def chain(tokens: list[int]) -> DraftTree:
        return DraftTree(list(tokens), list(range(-1, len(tokens) - 1)))

    def validate(self, max_depth: int, max_nodes: int) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("draft tree: tokens and parents differ in length")
        if len(self.tokens) > max_nodes:
            raise ValueError(f"draft tree: {len(self.tokens)} nodes > budget {max_nodes}")
        if any(not -1 <= p < i for i, p in enumerate(self.parents)):
            raise ValueError("draft tree: every parent must come before its child")
        if self.tokens and max(node_depths(self.parents)) > max_depth:
            raise ValueError(f"draft tree deeper than {max_depth}")
        pairs = set(zip(self.parents, self.tokens))
        if len(pairs) != len(self.tokens):
            raise ValueError("draft tree: siblings must hold distinct tokens")


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

class Eagle3Proposer:
    """Drafts EAGLE-2 dynamic trees with an `Eagle3Draft`, keeping its own KV cache.

    Context position t holds g_t = fc(aux states at t) with the embedding of token t+1 at RoPE
    position t, and predicts token t+2 (training's step 0). A tree node at depth d is fed its
    parent's output (pre-norm, or post-norm with config.norm_output) and its own token, at RoPE
    position (last context position + d), attending to the context cache and its ancestors
    only: the inference twin of the training-time-test unroll.
    """

    def __init__(self, drafter: nn.Module, min_prob: float = 0.0):
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
        if self.k_buf is not None:
            k_buf[:, :, :live] = self.k_buf[:, :, :live]
            v_buf[:, :, :live] = self.v_buf[:, :, :live]
        self.k_buf, self.v_buf = k_buf, v_buf

    # -- one pass of the drafter's layer -------------------------------------------------------

    def layer(self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, slot: int,
              allowed: torch.Tensor) -> torch.Tensor:
        """The midlayer for q new queries (fed hidden [q, H], tokens [q]) at RoPE `positions`
        [q]. Their keys/values go to buffer slots [slot, slot + q); they attend to slots
        [0, slot + q) as `allowed` [q, slot + q] says. Returns the outputs [q, H]."""
        from eaglet.draft_model import apply_rope, rope_cos_sin

        d = self.drafter
        ml, attn, cfg = d.midlayer, d.midlayer.self_attn, self.cfg
        q_len = hidden.shape[0]
        self.reserve(slot + q_len, live=slot)
        hidden = hidden.to(d.fc.weight.dtype)
        embeds = d.embed_tokens(token_ids).to(hidden.dtype)
        normed = ml.hidden_norm(hidden)
        x = torch.cat([ml.input_layernorm(embeds), normed], dim=-1)[None]
        q = attn.q_proj(x).view(1, q_len, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, q_len, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(1, q_len, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        q = apply_rope(q, cos, sin)
        self.k_buf[:, :, slot: slot + q_len] = apply_rope(k, cos, sin)
        self.v_buf[:, :, slot: slot + q_len] = v
        o = F.scaled_dot_product_attention(q, self.k_buf[:, :, : slot + q_len], self.v_buf[:, :, : slot + q_len],
                                           attn_mask=allowed[None, None],
                                           enable_gqa=cfg.num_heads != cfg.num_kv_heads)
        h = ml.residual(hidden, normed) + attn.o_proj(o.transpose(1, 2).reshape(1, q_len, -1))[0]
        h = h + ml.mlp(ml.post_attention_layernorm(h))
        self.draft_forwards += 1
        return h

    def log_probs(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocab log-probabilities of the next token from a layer output [q, H]."""
        return torch.log_softmax(self.drafter.lm_head(self.drafter.norm(out)).float(), dim=-1)

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
        g = self.drafter.fuse(aux.to(device)[None])[0]
        next_tokens = torch.tensor(seq[start + 1: start + m + 1], device=device)
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
            anc = torch.cat([torch.cat([anc, torch.zeros(n_exp, k, dtype=torch.bool, device=device)], 1),
                             new_anc], dim=0)
            positions = torch.full((k,), root_pos + depth, device=device)
            # the window is anchored where the node's chain left the context (training's step-k
            # query at position t sees step-0 keys (t - window, t]), not at its RoPE position
            context = allowed_keys(torch.full((k,), root_pos, device=device),
                                   torch.arange(self.context_len, device=device), self.cfg.sliding_window)
            allowed = torch.cat([context, new_anc], dim=1)
            # expanded nodes sit in buffer slots context_len + (their expansion index)
            out = self.layer(frontier_hidden, self.draft_to_target[frontier_ids], positions,
                             self.context_len + n_exp, allowed)

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
# Prompt lookup (n-gram) and the hybrid of both proposers
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
                self.follower[tuple(seq[i - n: i])] = i
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
                chain = self.seq[at: at + limit]
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


DRAFTER, NGRAM, BOTH = "drafter", "ngram", "both"


def path_nodes(tree: DraftTree, path: list[int]) -> list[int]:
    """The nodes of `tree` that spell the longest prefix of `path` from the root, in depth order."""
    child_of = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens))}
    nodes: list[int] = []
    for token in path:
        node = child_of.get((nodes[-1] if nodes else -1, token))
        if node is None:
            break
        nodes.append(node)
    return nodes


def drop_rivals(tree: DraftTree, chain: list[int], depths: set[int]) -> DraftTree:
    """`tree` without the nodes (and their subtrees) that hang where `chain` goes at one of
    `depths` but hold another token: two siblings cannot both be right, so where the chain's token
    is right with probability p, a rival is right with at most 1 - p."""
    under = [-1] + path_nodes(tree, chain)  # the chain's depth-d token hangs under under[d]
    dropped = {i for d in depths if d < min(len(chain), len(under))
               for i, (p, t) in enumerate(zip(tree.parents, tree.tokens)) if p == under[d] and t != chain[d]}
    if not dropped:
        return tree
    for i, p in enumerate(tree.parents):  # parents come first: a subtree follows its root
        if p in dropped:
            dropped.add(i)
    return keep_nodes(tree, [i for i in range(len(tree)) if i not in dropped])


def keep_nodes(tree: DraftTree, keep: list[int]) -> DraftTree:
    """The subtree of the nodes `keep` (sorted, ancestor-closed), parents renumbered."""
    index = {i: k for k, i in enumerate(keep)}
    return DraftTree([tree.tokens[i] for i in keep],
                     [-1 if tree.parents[i] < 0 else index[tree.parents[i]] for i in keep])


def merge_chain(tree: DraftTree, chain: list[int]) -> tuple[DraftTree, list[str]]:
    """`tree` with `chain` (a path below the same root) added: where a node with the chain's next
    token already hangs under the current node, the chain goes on through it; elsewhere new
    nodes are appended. Returns the merged tree and each node's source (DRAFTER, NGRAM, BOTH)."""
    tokens, parents = list(tree.tokens), list(tree.parents)
    sources = [DRAFTER] * len(tokens)
    child_of = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))}
    at = -1
    for token in chain:
        node = child_of.get((at, token))
        if node is None:
            node = len(tokens)
            tokens.append(token)
            parents.append(at)
            sources.append(NGRAM)
            child_of[(at, token)] = node
        elif sources[node] == DRAFTER:
            sources[node] = BOTH
        at = node
    return DraftTree(tokens, parents), sources


@dataclass
class DraftedTree:
    """A drafter's tree as proposed, kept to learn from: `start` = len(seq) when proposed."""
    start: int
    tokens: list[int]
    parents: list[int]
    depths: list[int]  # 1 = below the root
    probs: list[float]  # P(node | parent) under the drafter
    first: int | None  # its likeliest first token


class Calibration:
    """How often a draft token proposed with probability p was right, per tenth of p, learnt from
    the committed tokens: (hits + w p) / (tries + w), i.e. the proposer's own p until evidence says
    otherwise (a drafter's probabilities are not calibrated by training)."""

    def __init__(self, buckets: int = 10, prior_weight: float = 2.0):
        self.buckets, self.prior_weight = buckets, prior_weight
        self.hits = [0] * buckets
        self.tries = [0] * buckets
        self.p_sum = [0.0] * buckets

    def bucket(self, p: float) -> int:
        return min(int(p * self.buckets), self.buckets - 1)

    def rate(self, p: float) -> float:
        b = self.bucket(p)
        return (self.hits[b] + self.prior_weight * p) / (self.tries[b] + self.prior_weight)

    def record(self, p: float, hit: bool) -> None:
        b = self.bucket(p)
        self.tries[b] += 1
        self.hits[b] += hit
        self.p_sum[b] += p

    def outcomes(self) -> list[tuple[float, float]]:
        """(share of the proposals, how often right) per tenth of p seen so far."""
        total = sum(self.tries)
        return [(n / total, self.rate(ps / n)) for n, ps in zip(self.tries, self.p_sum) if n]


def expected_acceptance(parents: list[int], right: list[float]) -> list[float]:
    """P(node accepted) per node, from P(node right | its parent accepted) per node (`right`).
    Siblings exclude each other (one token comes next), so their conditional probabilities are
    capped to sum to at most 1, the likeliest sibling first."""
    capped = list(right)
    for kids in children_lists(parents):
        left = 1.0
        for i in sorted(kids, key=lambda i: -right[i]):
            capped[i] = min(right[i], left)
            left -= capped[i]
    expected: list[float] = []
    for i, p in enumerate(parents):  # parents come first
        expected.append(capped[i] * (1.0 if p < 0 else expected[p]))
    return expected


def admit_by_cost(parents: list[int], expected: list[float], pass_costs: Sequence[float], spent: float = 0.0,
                  max_nodes: int | None = None) -> list[int]:
    """The nodes worth verifying: a cycle yields 1 + sum(expected of verified nodes) tokens for
    pass_costs[q - 1] + spent seconds (q - 1 nodes verified, `spent` already paid for drafting). Nodes
    join likeliest first while they raise tokens per second; the result is ancestor-closed
    (a child is never likelier than its parent) and sorted."""
    limit = min(len(pass_costs) - 1, len(parents) if max_nodes is None else max_nodes)
    kept: list[int] = []
    tokens = 1.0
    for i in sorted(range(len(parents)), key=lambda i: -expected[i]):  # stable: parents first on ties
        if len(kept) >= limit:
            break
        now, then = pass_costs[len(kept)] + spent, pass_costs[len(kept) + 1] + spent
        if (tokens + expected[i]) * now <= tokens * then:
            break  # the likeliest node left does not pay: no later one does (convex costs)
        kept.append(i)
        tokens += expected[i]
    return sorted(kept)


@torch.inference_mode()
def measure_pass_costs(model: nn.Module, context: int = 256, max_q: int = 8, repeats: int = 5,
                       seed: int = 0) -> list[float]:
    """Median seconds of a target pass over q = 1..max_q new tokens after `context` cached tokens,
    as the decoder runs it (`TargetRunner`). Each round times every q once, so drift of the
    machine spreads over all of them."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    context = min(context, max_positions(model) - max_q)
    runner = TargetRunner(model)
    try:
        runner.forward(torch.randint(0, vocab, (context,), generator=g).tolist())
        times: list[list[float]] = [[] for _ in range(max_q)]
        for r in range(repeats + 1):  # round 0 warms up
            for q in range(1, max_q + 1):
                ids = torch.randint(0, vocab, (q,), generator=g).tolist()
                t0 = time.perf_counter()
                runner.forward(ids, positions=list(range(context, context + q)))
                if r > 0:
                    times[q - 1].append(time.perf_counter() - t0)
                runner.keep(context, [])  # drop the q new entries: every pass sees the same cache
    finally:
        runner.close()
    medians = [sorted(t)[len(t) // 2] for t in times]
    # a pass over more tokens never costs less: noise must not make verifying more look free
    return [max(medians[: q + 1]) for q in range(max_q)]


class HybridProposer:
    """The drafter's chain or tree and prompt lookup's continuation in one tree, verified in one
    target pass: whichever proposer guessed right, its tokens are accepted. The drafter keeps its
    own limits (depth, top_k, total_tokens); the lookup adds up to `lookup_tokens` tokens, most of
    them free where it agrees with the drafter (shared nodes). `sources` names the proposer(s) of
    each node of the last tree.

    With `pass_costs` (seconds of a target pass over q = 1, 2, ... tokens on this machine,
    `measure_pass_costs`) the hybrid verifies only what pays: every candidate node gets the
    probability that it will be accepted, from calibrated probabilities (the lookup's per n-gram
    size and depth, the drafter's per tenth of its own probability, both learnt from the committed
    tokens), and nodes join while they raise expected tokens per second (`admit_by_cost`). The
    drafter runs only when it can pay for itself: not when the lookup's next token is trusted
    enough that even a right drafted rival would not repay the drafter's time (measured) and the
    extra verified token. Skipped cycles still feed the drafter later, in one catch-up pass. So that
    an unlucky start cannot silence a good drafter, it runs in the first `explore_runs` cycles of a
    sequence and then at least once every `explore_runs` cycles (its tokens still admitted by cost;
    0: no exploration, the calibration alone decides).
    `drafter` None: prompt lookup alone under the same rule.

    Without `pass_costs`, every proposed node is verified (floors, if any, are the proposers' own).
    With `drop_rivals` and a lookup floor, where the lookup is right with probability >= 1 - floor a
    drafted rival could at best just reach the floor and is left out (off by default: on SmolLM2
    and 2 CPU cores it did not pay)."""

    def __init__(self, drafter: Proposer | None, lookup: NgramProposer, drafter_limits: tuple[int, int, int],
                 lookup_tokens: int, drop_rivals: bool = False, pass_costs: Sequence[float] | None = None,
                 explore_runs: int = 8):
        if lookup_tokens < 1:
            raise ValueError(f"lookup_tokens {lookup_tokens}: must be >= 1")
        if pass_costs is not None and (len(pass_costs) < 2 or min(pass_costs) <= 0):
            raise ValueError(f"pass_costs {list(pass_costs)}: seconds of passes over 1, 2, ... tokens, all > 0")
        self.drafter, self.lookup, self.drop_rivals = drafter, lookup, drop_rivals
        self.drafter_limits, self.lookup_tokens = drafter_limits, lookup_tokens
        self.pass_costs = None if pass_costs is None else list(pass_costs)
        self.explore_runs = explore_runs
        self.aux_layer_ids = [] if drafter is None else list(drafter.aux_layer_ids)
        self.sources: list[str] = []
        self.reset()

    @property
    def limits(self) -> tuple[int, int, int]:
        """(depth, top_k, total_tokens) for the engine: room for both proposals."""
        depth, top_k, total = self.drafter_limits if self.drafter is not None else (0, 1, 0)
        return max(depth, self.lookup_tokens), top_k, total + self.lookup_tokens

    @property
    def draft_forwards(self) -> int:
        return getattr(self.drafter, "draft_forwards", 0)

    def reset(self) -> None:
        for p in (self.drafter, self.lookup):
            if hasattr(p, "reset"):
                p.reset()
        self.seq: list[int] = []
        self.unseen: list[torch.Tensor | None] = []  # aux states the drafter has not been fed yet (cost mode)
        self.calibration = Calibration()  # the drafter's P(right | parent right) -> how often it was right
        self.drafted: DraftedTree | None = None  # the drafter's last tree, to score against what is committed
        self.first = Calibration()  # the drafter's likeliest first token, when it ran: how sure, how often right
        self.drafter_seconds: float | None = None  # moving average of a drafter run (catch-up + propose)
        self.drafter_runs = 0
        self.skipped = 0  # cycles since the drafter last ran

    def observe(self, seq: list[int], aux: torch.Tensor | None) -> None:
        self.lookup.observe(seq, aux)
        self.seq = seq
        if self.drafter is None:
            return
        self.learn(seq)
        self.unseen.append(aux)
        if self.pass_costs is None or self.drafter_seconds is None:
            self.catch_up()  # every cycle without a cost model; the prompt before the drafter is timed

    def catch_up(self) -> None:
        """Feed the drafter every aux state it has not seen, in one pass."""
        if self.unseen:
            chunks = [a for a in self.unseen if a is not None]
            self.drafter.observe(self.seq, torch.cat(chunks) if chunks else None)
            self.unseen = []

    def learn(self, seq: list[int]) -> None:
        """Score the drafter's last tree against the committed tokens: every node whose parent's
        path was committed, verified or not (what the target commits does not depend on the
        proposal, greedy or sampled)."""
        if self.drafted is None:
            return
        d, self.drafted = self.drafted, None
        committed = seq[d.start:]
        on_path: list[bool] = []  # per node: its path equals the committed tokens
        for i, (parent, token, depth) in enumerate(zip(d.parents, d.tokens, d.depths)):
            reached = (parent < 0 or on_path[parent]) and depth - 1 < len(committed)
            on_path.append(reached and token == committed[depth - 1])
            if reached:
                self.calibration.record(d.probs[i], on_path[i])
        if d.first is not None and len(committed) > 0:
            self.first.record(d.probs[d.first], on_path[d.first])

    def drafter_pays(self, lookup_first: float, tokens: float, nodes: int) -> bool:
        """Whether running the drafter is expected to raise tokens per second over the lookup's plan
        (`tokens` expected from `nodes` verified nodes): its time is paid every run, while its
        first token adds to the cycle only where it is sure enough to be worth one more verified
        token and the lookup's own first token would be wrong. Averaged over how sure it has been
        (each tenth of its probability with its calibrated rate), not over its mean rate: a
        drafter that is mostly unsure but right when sure still pays where it is sure."""
        outcomes = self.first.outcomes()
        if self.drafter_seconds is None or not outcomes:
            return True  # not measured yet
        costs, d = self.pass_costs, self.drafter_seconds
        if nodes + 1 >= len(costs):
            return False
        without = tokens / costs[nodes]
        with_drafter = sum(share * max(tokens / (costs[nodes] + d),
                                       (tokens + (1.0 - lookup_first) * right) / (costs[nodes + 1] + d))
                           for share, right in outcomes)
        return with_drafter > without

    def propose(self, max_depth: int, top_k: int, total_tokens: int) -> DraftTree:
        lookup_depth = min(self.lookup_tokens, max_depth)
        chain = self.lookup.propose(lookup_depth, 1, lookup_depth).tokens
        if self.pass_costs is None:
            return self.propose_all(chain, max_depth)
        chain_right = list(self.lookup.confidence)
        chain_parents = list(range(-1, len(chain) - 1))
        tree, drafter_right, spent = DraftTree.empty(), [], 0.0
        if self.drafter is not None and max_depth > 0:
            expected = expected_acceptance(chain_parents, chain_right)
            plan = admit_by_cost(chain_parents, expected, self.pass_costs, max_nodes=total_tokens)
            explore = self.explore_runs > 0 and (self.drafter_runs < self.explore_runs
                                                 or self.skipped >= self.explore_runs)
            if explore or self.drafter_pays(chain_right[0] if chain else 0.0, 1.0 + sum(expected[i] for i in plan),
                                            len(plan)):
                tree, drafter_right, spent = self.run_drafter(max_depth)
            else:
                self.skipped += 1
        merged, sources = merge_chain(tree, chain)
        right = drafter_right + [0.0] * (len(merged) - len(tree))
        for d, node in enumerate(path_nodes(merged, chain)):  # the lookup's calibrated rate (shared: the higher)
            right[node] = max(right[node], chain_right[d])
        keep = admit_by_cost(merged.parents, expected_acceptance(merged.parents, right), self.pass_costs, spent,
                             total_tokens)
        self.sources = [sources[i] for i in keep]
        return keep_nodes(merged, keep)

    def run_drafter(self, max_depth: int) -> tuple[DraftTree, list[float], float]:
        """The drafter's tree, each node's calibrated P(right | parent right), and the seconds it took."""
        t0 = time.perf_counter()
        self.catch_up()
        depth, d_top_k, d_total = self.drafter_limits
        tree = self.drafter.propose(min(depth, max_depth), d_top_k, d_total)
        spent = time.perf_counter() - t0
        self.drafter_runs += 1
        self.skipped = 0
        self.drafter_seconds = spent if self.drafter_seconds is None else 0.7 * self.drafter_seconds + 0.3 * spent
        # a proposer without path probabilities (a test's oracle) is taken at its word
        log_probs = getattr(self.drafter, "path_log_probs", None) or [0.0] * len(tree)
        probs = [math.exp(lp - (0.0 if p < 0 else log_probs[p])) for lp, p in zip(log_probs, tree.parents)]
        roots = [i for i, p in enumerate(tree.parents) if p < 0]
        first = max(roots, key=lambda i: probs[i]) if roots else None
        self.drafted = DraftedTree(len(self.seq), tree.tokens, tree.parents, node_depths(tree.parents), probs, first)
        return tree, [self.calibration.rate(p) for p in probs], spent

    def propose_all(self, chain: list[int], max_depth: int) -> DraftTree:
        """Every proposed node (no cost model)."""
        tree = DraftTree.empty()
        if self.drafter is not None:
            depth, d_top_k, d_total = self.drafter_limits
            tree = self.drafter.propose(min(depth, max_depth), d_top_k, d_total)
        floor = self.lookup.min_prob
        if floor > 0 and self.drop_rivals:
            tree = drop_rivals(tree, chain, {d for d, p in enumerate(self.lookup.confidence) if p >= 1 - floor})
        merged, self.sources = merge_chain(tree, chain)
        return merged


# ---------------------------------------------------------------------------------------------
# The target side
# ---------------------------------------------------------------------------------------------

def max_positions(model: nn.Module) -> int:
    """How many positions (prompt + output) the target holds; unbounded when its config does not say."""
    return int(getattr(model.config, "max_position_embeddings", None) or 1 << 30)


class TargetRunner:
    """The HF target with its DynamicCache and (optionally) hooks on the aux layers."""

    def __init__(self, model: nn.Module, aux_layer_ids: list[int] | None = None):
        from transformers import DynamicCache

        from eaglet.extract import LayerCapture
        from eaglet.target import decoder_layers

        impl = getattr(model.config, "_attn_implementation", None)
        if impl not in (None, "sdpa", "eager"):
            raise ValueError(f"tree verification needs a custom 4D attention mask: load the target with "
                             f"attn_implementation 'sdpa' or 'eager', not {impl!r}")
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.max_positions = max_positions(model)
        self.cache = DynamicCache(config=model.config)
        self.capture = LayerCapture(decoder_layers(model), aux_layer_ids) if aux_layer_ids else None
        self.forwards = 0
        self.seconds = 0.0

    def close(self) -> None:
        if self.capture is not None:
            self.capture.remove()

    @property
    def cached(self) -> int:
        return self.cache.get_seq_length()

    def forward(self, token_ids: list[int], positions: list[int] | None = None,
                mask: torch.Tensor | None = None, last_only: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [q or 1, V] (fp32) and the aux states [q, sum H] of the fed tokens."""
        t0 = time.perf_counter()
        ids = torch.tensor([token_ids], device=self.device)
        pos = None if positions is None else torch.tensor([positions], device=self.device)
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, cache=self.cache, use_cache=True,
                         logits_to_keep=1 if last_only else 0)
        aux = torch.cat(self.capture.take(), dim=-1)[0] if self.capture is not None else None
        self.forwards += 1
        self.seconds += time.perf_counter() - t0
        return out.logits[0].float(), aux

    def keep(self, start: int, rel: list[int]) -> None:
        """Keep cache entries [0, start) + start + rel (rel sorted), dropping rejected tree nodes.

        Per layer on `.layers[i].keys/.values` (DynamicLayer, transformers 5): a slice when the
        kept entries are a prefix (chains), an index-select otherwise."""
        contiguous = rel == list(range(len(rel)))
        idx = None if contiguous else torch.tensor(list(range(start)) + [start + r for r in rel], device=self.device)
        for layer in self.cache.layers:
            if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
                raise NotImplementedError(f"KV compaction of {type(layer).__name__} cache layers")
            if contiguous:
                layer.keys = layer.keys[..., : start + len(rel), :]
                layer.values = layer.values[..., : start + len(rel), :]
            else:
                layer.keys = layer.keys.index_select(-2, idx)
                layer.values = layer.values.index_select(-2, idx)


# ---------------------------------------------------------------------------------------------
# Plain decoding (the reference)
# ---------------------------------------------------------------------------------------------

@torch.inference_mode()
def plain_generate(target: nn.Module, input_ids: TokenIds, max_new_tokens: int, eos_ids: Sequence[int] = (),
                   temperature: float = 0.0, top_p: float = 1.0,
                   generator: torch.Generator | None = None) -> tuple[list[int], dict[str, Any]]:
    """Token by token with the KV cache: greedy at temperature 0, else sampling from
    `process_probs`. Returns the new tokens (ending at the first EOS, if any) and stats."""
    prompt = as_id_list(input_ids)
    runner = TargetRunner(target)
    budget = token_budget(len(prompt), max_new_tokens, runner.max_positions)
    eos = set(eos_ids)
    out: list[int] = []
    t0 = time.perf_counter()
    feed = prompt
    while len(out) < budget:
        logits, _ = runner.forward(feed, last_only=True)
        tok = (int(logits[-1].argmax()) if temperature <= 0
               else sample_from(process_probs(logits[-1], temperature, top_p), generator))
        out.append(tok)
        if tok in eos:
            break
        feed = [tok]
    wall = time.perf_counter() - t0
    return out, {"new_tokens": len(out), "target_forwards": runner.forwards, "wall_s": wall,
                 "tokens_per_s": len(out) / wall if wall > 0 else 0.0}


def plain_greedy(target: nn.Module, input_ids: TokenIds, max_new_tokens: int,
                 eos_ids: Sequence[int] = ()) -> list[int]:
    return plain_generate(target, input_ids, max_new_tokens, eos_ids)[0]


# ---------------------------------------------------------------------------------------------
# Speculative decoding
# ---------------------------------------------------------------------------------------------

@dataclass
class DecodeStats:
    new_tokens: int = 0
    target_forwards: int = 0  # prefill included
    verify_forwards: int = 0
    draft_forwards: int = 0  # batched drafter layer passes
    accept_counts: list[int] = field(default_factory=list)  # [m] cycles that accepted m draft tokens
    position_reached: list[int] = field(default_factory=list)  # [d] cycles whose tree had depth > d
    position_accepted: list[int] = field(default_factory=list)  # [d] cycles that accepted > d tokens
    target_s: float = 0.0
    draft_s: float = 0.0
    wall_s: float = 0.0
    stopped: str = ""  # "eos" | "max_new_tokens" | "context"
    accepted_from: dict[str, int] = field(default_factory=dict)  # accepted draft tokens by proposer

    @property
    def tau(self) -> float:
        """new tokens / target forwards, the prefill counted as one (plain decoding: 1.0)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tau_verify(self) -> float:
        """Tokens per verification pass (accepted + bonus), the prefill's token excluded."""
        return (self.new_tokens - 1) / self.verify_forwards if self.verify_forwards else 0.0

    @property
    def acceptance_rates(self) -> list[float]:
        """Per draft position d (0-based): P(accept d | reached d with a node at depth d+1)."""
        return [a / r if r else 0.0 for a, r in zip(self.position_accepted, self.position_reached)]

    def record(self, accepted: int, tree_depth: int) -> None:
        for xs, n in ((self.accept_counts, accepted + 1), (self.position_reached, tree_depth),
                      (self.position_accepted, tree_depth)):
            xs.extend([0] * (n - len(xs)))
        self.accept_counts[accepted] += 1
        # position d counts only when the previous d were accepted and the tree reached depth d+1
        for d in range(min(accepted + 1, tree_depth)):
            self.position_reached[d] += 1
            if d < accepted:
                self.position_accepted[d] += 1

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(tau=self.tau, tau_verify=self.tau_verify, acceptance_rates=self.acceptance_rates,
                 tokens_per_s=self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0)
        return d


def tree_limits(mode: str, depth: int, top_k: int, total_tokens: int) -> tuple[int, int, int]:
    if mode == "chain":
        return depth, 1, depth
    if mode != "tree":
        raise ValueError(f"mode must be 'tree' or 'chain', not {mode!r}")
    if depth < 1 or top_k < 1 or total_tokens < 1:
        raise ValueError("depth, top_k and total_tokens must be >= 1")
    return depth, top_k, total_tokens


@torch.inference_mode()
def speculative_generate(target: nn.Module, drafter: nn.Module | Proposer, input_ids: TokenIds,
                         max_new_tokens: int, eos_ids: Sequence[int] = (), mode: str = "tree",
                         depth: int = DEFAULT_DEPTH, top_k: int = DEFAULT_TOP_K,
                         total_tokens: int = DEFAULT_TOTAL_TOKENS, temperature: float = 0.0, top_p: float = 1.0,
                         generator: torch.Generator | None = None, min_prob: float = 0.0) -> tuple[list[int], DecodeStats]:
    """Generate like `plain_generate` (token for token at T=0, in distribution at T>0) with
    drafts verified by the target. `drafter` is an `Eagle3Draft` or any `Proposer`; an
    `Eagle3Draft` proposes only tokens whose path probability is >= `min_prob`."""
    depth, top_k, total_tokens = tree_limits(mode, depth, top_k, total_tokens)
    if hasattr(drafter, "propose"):
        if min_prob > 0:
            raise ValueError("min_prob applies to an Eagle3Draft; give a Proposer its own threshold")
        proposer: Proposer = drafter
    else:
        proposer = Eagle3Proposer(drafter, min_prob)
    if hasattr(proposer, "reset"):
        proposer.reset()
    sampling = temperature > 0
    prompt = as_id_list(input_ids)
    runner = TargetRunner(target, proposer.aux_layer_ids)
    stats = DecodeStats()
    t_start = time.perf_counter()
    try:
        budget = token_budget(len(prompt), max_new_tokens, runner.max_positions)
        if budget == 0:
            stats.stopped = "context" if max_new_tokens > 0 else "max_new_tokens"
            return [], stats

        def choose(logits_row: torch.Tensor) -> int:
            if sampling:
                return sample_from(process_probs(logits_row, temperature, top_p), generator)
            return int(logits_row.argmax())

        logits, aux = runner.forward(prompt, last_only=True)
        out = [choose(logits[-1])]
        eos = set(eos_ids)
        seq = prompt + out
        while True:
            if out[-1] in eos:
                stats.stopped = "eos"
                break
            if len(out) >= budget:
                stats.stopped = "max_new_tokens" if budget == max_new_tokens else "context"
                break
            t0 = time.perf_counter()
            proposer.observe(seq, aux)
            # a cycle adds accepted + 1 tokens: drafting deeper than budget - 1 is wasted work,
            # and this bound also keeps every tree position below max_position_embeddings
            max_depth = min(depth, budget - len(out) - 1)
            tree = proposer.propose(max_depth, top_k, total_tokens) if max_depth > 0 else DraftTree.empty()
            stats.draft_s += time.perf_counter() - t0
            tree.validate(max_depth, total_tokens)

            prefix = runner.cached  # == len(seq) - 1: everything but the root
            depths = node_depths(tree.parents)
            mask = tree_attention_mask(tree.parents, prefix, runner.dtype, runner.device) if len(tree) else None
            logits, aux_all = runner.forward([seq[-1]] + tree.tokens, [prefix] + [prefix + d for d in depths], mask)
            stats.verify_forwards += 1
            if sampling:
                probs = process_probs(logits, temperature, top_p)
                path, bonus = accept_sampling(tree.tokens, tree.parents, probs, generator)
            else:
                path, bonus = accept_greedy(tree.tokens, tree.parents, logits.argmax(-1).tolist())
            stats.record(len(path), max(depths, default=0))
            for i in path:  # which proposer each accepted token came from
                source = proposer.sources[i] if hasattr(proposer, "sources") else getattr(proposer, "name", DRAFTER)
                stats.accepted_from[source] = stats.accepted_from.get(source, 0) + 1

            kept = [0] + [i + 1 for i in path]  # root + accepted nodes, in [root, nodes] order
            runner.keep(prefix, kept)
            aux = aux_all[kept] if aux_all is not None else None
            new, _ = truncate_at_eos([tree.tokens[i] for i in path] + [bonus], eos)
            new = new[: budget - len(out)]
            out += new
            seq += new
            # tokens cut after an EOS or the budget are never fed again: the loop stops next
    finally:
        runner.close()
        stats.new_tokens = len(out) if "out" in locals() else 0
        stats.target_forwards = runner.forwards
        stats.target_s = runner.seconds
        stats.draft_forwards = getattr(proposer, "draft_forwards", 0)
        stats.wall_s = time.perf_counter() - t_start
    return out, stats


__all__ = ["DraftTree", "Proposer", "Eagle3Proposer", "NgramProposer", "HybridProposer", "merge_chain", "drop_rivals",
           "TargetRunner", "DecodeStats", "plain_generate",
           "plain_greedy", "speculative_generate", "process_probs", "accept_greedy", "accept_sampling",
           "tree_attention_mask", "token_budget"]
