"""Speculative decoding with a drafter: EAGLE-3's EAGLE-2 dynamic trees (or chains), a parallel
drafter's blocks, prompt lookup and their hybrid, verified exactly.

The package, from the bottom up (a module imports only those listed before it):

    core       the exact part, the one whose correctness the output rests on: draft trees and
               their attention masks, acceptance (greedy `accept_greedy`; sampling by recursive
               rejection, `accept_sampling`), KV-cache compaction, `DecodeStats`, the decoding
               loop that verifies every proposal with the target
    proposers  the `Proposer` interface, the drafter's `Eagle3Proposer` (chain or EAGLE-2
               dynamic tree, optional floor on draft probabilities) and prompt lookup
               (`NgramProposer`)
    parallel   `ParallelProposer`: a P-EAGLE or DFlash drafter's block from one pass
    fast       `FastTarget`: a Llama-family target's forward as packed matrix products over a
               preallocated KV cache (the target near the machine, on a CPU)
    runner     `target_runner` (the fast target where it applies, else `TargetRunner`: the HF
               target with its cache and aux-layer hooks) and the entry points `plain_generate`
               (the reference) and `speculative_generate`
    hybrid     experimental: `HybridProposer` (the drafter's and the lookup's proposals in one
               tree), admission by measured pass costs, and the calibrations it learns

Importers take these names from `eaglet.decode`.
"""

from eaglet.decode.core import (
    BOTH,
    DRAFTER,
    NGRAM,
    DecodeStats,
    DraftTree,
    accept_greedy,
    accept_sampling,
    ancestor_matrix,
    process_probs,
    token_budget,
    tree_attention_mask,
    truncate_at_eos,
)
from eaglet.decode.hybrid import (
    Calibration,
    HybridProposer,
    admit_by_cost,
    drop_rivals,
    expected_acceptance,
    keep_nodes,
    measure_drafter_pass,
    measure_pass_costs,
    merge_chain,
    path_nodes,
)
from eaglet.decode.parallel import ParallelProposer
from eaglet.decode.proposers import Eagle3Proposer, NgramProposer, Proposer
from eaglet.decode.fast import FAST_TARGET_ENV, FastTarget, fast_target_refused
from eaglet.decode.runner import TargetRunner, plain_generate, speculative_generate, target_runner

__all__ = [
    # core
    "BOTH",
    "DRAFTER",
    "NGRAM",
    "DecodeStats",
    "DraftTree",
    "accept_greedy",
    "accept_sampling",
    "ancestor_matrix",
    "process_probs",
    "token_budget",
    "tree_attention_mask",
    "truncate_at_eos",
    # proposers
    "Eagle3Proposer",
    "NgramProposer",
    "Proposer",
    # parallel
    "ParallelProposer",
    # fast
    "FAST_TARGET_ENV",
    "FastTarget",
    "fast_target_refused",
    # runner
    "TargetRunner",
    "plain_generate",
    "speculative_generate",
    "target_runner",
    # hybrid
    "Calibration",
    "HybridProposer",
    "admit_by_cost",
    "drop_rivals",
    "expected_acceptance",
    "keep_nodes",
    "measure_drafter_pass",
    "measure_pass_costs",
    "merge_chain",
    "path_nodes",
]
