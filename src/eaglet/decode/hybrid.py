"""Experimental: the hybrid of the drafter and prompt lookup, and admission by cost.

`HybridProposer` merges the drafter's proposal and prompt lookup's continuation into one tree
(shared prefixes shared), so one target pass verifies both: on copy-heavy text the lookup's tokens
are accepted, elsewhere the drafter's, without choosing a method per server. With the seconds a
target pass costs on this machine (`measure_pass_costs`), it verifies only the nodes expected to
pay for themselves (`admit_by_cost`), from probabilities calibrated on the committed tokens
(`Calibration`). Whatever it proposes, the core's verification keeps the output exact.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from eaglet.decode.core import BOTH, DRAFTER, NGRAM, DraftTree, children_lists, node_depths
from eaglet.decode.fast import HFModel
from eaglet.decode.parallel import ParallelProposer
from eaglet.decode.proposers import Eagle3Proposer, NgramProposer, Proposer
from eaglet.decode.runner import target_runner
from eaglet.drafter import DraftModel, ParallelDraft, predicted_positions
from eaglet.target import max_positions


# ---------------------------------------------------------------------------------------------
# One tree from two proposals
# ---------------------------------------------------------------------------------------------


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
    dropped = {
        i
        for d in depths
        if d < min(len(chain), len(under))
        for i, (p, t) in enumerate(zip(tree.parents, tree.tokens))
        if p == under[d] and t != chain[d]
    }
    if not dropped:
        return tree
    for i, p in enumerate(tree.parents):  # parents come first: a subtree follows its root
        if p in dropped:
            dropped.add(i)
    return keep_nodes(tree, [i for i in range(len(tree)) if i not in dropped])


def keep_nodes(tree: DraftTree, keep: list[int]) -> DraftTree:
    """The subtree of the nodes `keep` (sorted, ancestor-closed), parents renumbered."""
    index = {i: k for k, i in enumerate(keep)}
    return DraftTree(
        [tree.tokens[i] for i in keep], [-1 if tree.parents[i] < 0 else index[tree.parents[i]] for i in keep]
    )


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


# ---------------------------------------------------------------------------------------------
# Calibration and admission by cost
# ---------------------------------------------------------------------------------------------


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


def admit_by_cost(
    parents: list[int],
    expected: list[float],
    pass_costs: Sequence[float],
    spent: float = 0.0,
    max_nodes: int | None = None,
) -> list[int]:
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
def measure_pass_costs(
    model: HFModel, context: int = 256, max_q: int = 8, repeats: int = 5, seed: int = 0
) -> list[float]:
    """Median seconds of a target pass over q = 1..max_q new tokens after `context` cached tokens,
    as the decoder runs it (`target_runner`: the fast target where it applies). Each round times
    every q once, so drift of the machine spreads over all of them."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    context = min(context, max_positions(model) - max_q)
    runner = target_runner(model)
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


@torch.inference_mode()
def measure_drafter_pass(
    drafter: DraftModel, context: int = 256, depth: int = 1, repeats: int = 9, seed: int = 0
) -> float:
    """Median seconds of one drafting cycle after `context` committed positions: the drafter fed
    one new position, then its proposal (an EAGLE-3 chain of `depth`, a parallel drafter's block),
    as decoding runs it each cycle."""
    cfg = drafter.config
    assert cfg.target_hidden_size is not None  # DraftConfig sets it
    g = torch.Generator().manual_seed(seed)
    dtype = next(drafter.parameters()).dtype
    aux = torch.randn(context + 1, 3 * cfg.target_hidden_size, generator=g).to(dtype)
    seq = torch.randint(0, cfg.target_vocab_size, (context + 2,), generator=g).tolist()
    proposer = ParallelProposer(drafter) if isinstance(drafter, ParallelDraft) else Eagle3Proposer(drafter)
    if isinstance(drafter, ParallelDraft):
        depth = predicted_positions(cfg)
    times = []
    for r in range(repeats + 1):  # round 0 warms up
        proposer.reset()
        proposer.observe(seq[: context + 1], aux[:context])
        t0 = time.perf_counter()
        proposer.observe(seq[: context + 2], aux[context : context + 1])
        proposer.propose(depth, 1, depth)
        if r > 0:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


# ---------------------------------------------------------------------------------------------
# The hybrid proposer
# ---------------------------------------------------------------------------------------------


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

    def __init__(
        self,
        drafter: Proposer | None,
        lookup: NgramProposer,
        drafter_limits: tuple[int, int, int],
        lookup_tokens: int,
        drop_rivals: bool = False,
        pass_costs: Sequence[float] | None = None,
        explore_runs: int = 8,
    ):
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
            if p is not None and hasattr(p, "reset"):
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
            assert self.drafter is not None  # only a drafter's aux states are kept
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
        committed = seq[d.start :]
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
        assert costs is not None  # asked in cost mode only
        if nodes + 1 >= len(costs):
            return False
        without = tokens / costs[nodes]
        with_drafter = sum(
            share * max(tokens / (costs[nodes] + d), (tokens + (1.0 - lookup_first) * right) / (costs[nodes + 1] + d))
            for share, right in outcomes
        )
        return with_drafter > without

    def propose(self, max_depth: int, top_k: int, total_tokens: int) -> DraftTree:
        lookup_depth = min(self.lookup_tokens, max_depth)
        chain = self.lookup.propose(lookup_depth, 1, lookup_depth).tokens
        if self.pass_costs is None:
            return self.propose_all(chain, max_depth)
        chain_right = list(self.lookup.confidence)
        chain_parents = list(range(-1, len(chain) - 1))
        tree, spent = DraftTree.empty(), 0.0
        drafter_right: list[float] = []
        if self.drafter is not None and max_depth > 0:
            expected = expected_acceptance(chain_parents, chain_right)
            plan = admit_by_cost(chain_parents, expected, self.pass_costs, max_nodes=total_tokens)
            explore = self.explore_runs > 0 and (
                self.drafter_runs < self.explore_runs or self.skipped >= self.explore_runs
            )
            if explore or self.drafter_pays(
                chain_right[0] if chain else 0.0, 1.0 + sum(expected[i] for i in plan), len(plan)
            ):
                tree, drafter_right, spent = self.run_drafter(max_depth)
            else:
                self.skipped += 1
        merged, sources = merge_chain(tree, chain)
        right = drafter_right + [0.0] * (len(merged) - len(tree))
        for d, node in enumerate(path_nodes(merged, chain)):  # the lookup's calibrated rate (shared: the higher)
            right[node] = max(right[node], chain_right[d])
        keep = admit_by_cost(
            merged.parents, expected_acceptance(merged.parents, right), self.pass_costs, spent, total_tokens
        )
        self.sources = [sources[i] for i in keep]
        return keep_nodes(merged, keep)

    def run_drafter(self, max_depth: int) -> tuple[DraftTree, list[float], float]:
        """The drafter's tree, each node's calibrated P(right | parent right), and the seconds it took."""
        assert self.drafter is not None  # run only with one
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
