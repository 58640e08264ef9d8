"""The exact core of speculative decoding: draft trees, their verification by the target, acceptance.

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

Sampling (temperature > 0, top_p) is exact: siblings are deterministic candidates, so the
rejection rule per sibling is "accept x with probability p(x); on reject zero p(x) and
renormalise; try the next sibling; if all fail, sample from what is left" (SpecInfer / SpecTr
with one-hot drafts). The output distribution equals plain sampling from the processed target
distribution, whatever the drafter proposes.

Whatever a proposer drafts, the output is the target's: acceptance keeps only what the target
chose, and `DraftTree.validate` checks a tree's shape before it is verified. The proposers
(`eaglet.decode.proposers`, `eaglet.decode.hybrid`) and the target runner (`eaglet.decode.runner`)
build on this module, never the other way round.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch
from transformers.cache_utils import CacheLayerMixin

if TYPE_CHECKING:  # annotations only: the runner and the proposers import this module
    from transformers import DynamicCache

    from eaglet.decode.fast import FastTarget
    from eaglet.decode.proposers import Proposer
    from eaglet.decode.runner import TargetRunner

# EAGLE-2's tree (depth 7, top 10 per depth, 60 nodes): the GPU defaults; `eaglet eval` has CPU-tuned ones
DEFAULT_DEPTH = 7
DEFAULT_TOP_K = 10
DEFAULT_TOTAL_TOKENS = 60

TokenIds = Sequence[int] | torch.Tensor

# Who proposed a node: the keys of `DecodeStats.accepted_from` (a proposer without a `name` or
# per-node `sources` counts as the drafter).
DRAFTER, NGRAM, BOTH = "drafter", "ngram", "both"


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


# ---------------------------------------------------------------------------------------------
# Tree attention masks and acceptance
# ---------------------------------------------------------------------------------------------


def ancestor_matrix(parents: list[int]) -> torch.Tensor:
    """[N, N] bool, row i true at i and its ancestors. parents[i] is -1 (root) or < i."""
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    return anc


def tree_attention_mask(parents: list[int], prefix_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
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


def accept_sampling(
    tokens: list[int], parents: list[int], probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[list[int], int]:
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
# The draft tree a proposer returns
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


def tree_limits(mode: str, depth: int, top_k: int, total_tokens: int) -> tuple[int, int, int]:
    """The checked (depth, top_k, total_tokens) of a draft mode: a chain is one token per depth."""
    if mode == "chain":
        return depth, 1, depth
    if mode != "tree":
        raise ValueError(f"mode must be 'tree' or 'chain', not {mode!r}")
    if depth < 1 or top_k < 1 or total_tokens < 1:
        raise ValueError("depth, top_k and total_tokens must be >= 1")
    return depth, top_k, total_tokens


# ---------------------------------------------------------------------------------------------
# The target's side: positions and KV-cache compaction
# ---------------------------------------------------------------------------------------------


def keep_cache_entries(cache: DynamicCache, start: int, rel: list[int], device: torch.device) -> None:
    """Keep cache entries [0, start) + start + rel (rel sorted), dropping rejected tree nodes.

    Per layer on `.layers[i].keys/.values` (DynamicLayer, transformers 5): a slice when the
    kept entries are a prefix (chains), an index-select otherwise, with the index on each layer's
    own device (under a device map a layer's cache lives where the layer runs)."""
    contiguous = rel == list(range(len(rel)))
    idx = None if contiguous else torch.tensor(list(range(start)) + [start + r for r in rel], device=device)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
            raise NotImplementedError(f"KV compaction of {type(layer).__name__} cache layers")
        # a layer with keys is an attention layer's (DynamicLayer), filled by the passes so far
        assert isinstance(layer, CacheLayerMixin) and layer.keys is not None and layer.values is not None
        if idx is None:  # contiguous
            layer.keys = layer.keys[..., : start + len(rel), :]
            layer.values = layer.values[..., : start + len(rel), :]
        else:
            layer.keys = layer.keys.index_select(-2, idx.to(layer.keys.device))
            layer.values = layer.values.index_select(-2, idx.to(layer.values.device))


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
        for xs, n in (
            (self.accept_counts, accepted + 1),
            (self.position_reached, tree_depth),
            (self.position_accepted, tree_depth),
        ):
            xs.extend([0] * (n - len(xs)))
        self.accept_counts[accepted] += 1
        # position d counts only when the previous d were accepted and the tree reached depth d+1
        for d in range(min(accepted + 1, tree_depth)):
            self.position_reached[d] += 1
            if d < accepted:
                self.position_accepted[d] += 1

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            tau=self.tau,
            tau_verify=self.tau_verify,
            acceptance_rates=self.acceptance_rates,
            tokens_per_s=self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0,
        )
        return d


def verify(
    runner: TargetRunner | FastTarget,
    root: int,
    tree: DraftTree,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> tuple[list[int], int, torch.Tensor | None]:
    """One target pass over [root, nodes] after the cached prefix, with the tree's mask and
    positions. Returns the accepted nodes, the bonus token and the target's aux states at the
    root and the accepted nodes, the only entries of this pass its cache keeps."""
    prefix = runner.cached  # every committed token but the root
    depths = node_depths(tree.parents)
    mask = tree_attention_mask(tree.parents, prefix, runner.dtype, runner.device) if len(tree) else None
    logits, aux_all = runner.forward([root] + tree.tokens, [prefix] + [prefix + d for d in depths], mask)
    if temperature > 0:
        probs = process_probs(logits, temperature, top_p)
        path, bonus = accept_sampling(tree.tokens, tree.parents, probs, generator)
    else:
        path, bonus = accept_greedy(tree.tokens, tree.parents, logits.argmax(-1).tolist())
    kept = [0] + [i + 1 for i in path]  # root + accepted nodes, in [root, nodes] order
    runner.keep(prefix, kept)
    return path, bonus, aux_all[kept] if aux_all is not None else None


def decode_loop(
    runner: TargetRunner | FastTarget,
    proposer: Proposer,
    prompt: list[int],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    limits: tuple[int, int, int],
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> tuple[list[int], DecodeStats]:
    """`speculative_generate`'s decoding on a fresh `runner` (its caller closes it): the prefill,
    then cycles of propose, `verify` and commit until EOS, `max_new_tokens` or the target's
    positions. `limits` are the checked (depth, top_k, total_tokens) of `tree_limits`."""
    depth, top_k, total_tokens = limits
    sampling = temperature > 0
    stats = DecodeStats()
    out: list[int] = []  # the new tokens so far (counted in `stats` however the loop ends)
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
        out.append(choose(logits[-1]))
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

            path, bonus, aux = verify(runner, seq[-1], tree, temperature, top_p, generator)
            stats.verify_forwards += 1
            stats.record(len(path), max(node_depths(tree.parents), default=0))
            for i in path:  # which proposer each accepted token came from
                source = proposer.sources[i] if hasattr(proposer, "sources") else getattr(proposer, "name", DRAFTER)
                stats.accepted_from[source] = stats.accepted_from.get(source, 0) + 1

            new, _ = truncate_at_eos([tree.tokens[i] for i in path] + [bonus], eos)
            new = new[: budget - len(out)]
            out += new
            seq += new
            # tokens cut after an EOS or the budget are never fed again: the loop stops next
    finally:
        stats.new_tokens = len(out)
        stats.target_forwards = runner.forwards
        stats.target_s = runner.seconds
        stats.draft_forwards = getattr(proposer, "draft_forwards", 0)
        stats.wall_s = time.perf_counter() - t_start
    return out, stats
