"""The drafter families, each declared once: what the stages outside `eaglet.drafter` need to know
of a family (training, decoding, eval, export, recipes) is a field here, never a comparison with
its name. Light on purpose (no torch): the command line reads it to list `--drafter` choices.

A family's code is a package of its own under `eaglet.drafter` (`eagle3`, `p_eagle`, `dflash`): its
model, the layout of its training blocks, their loss weights and its decoding pass. A new family is
such a package and a `Family(...)` naming its model, passed to `register` (from its own package, or
here for the built-ins, which the command line lists without importing torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Version = tuple[int, ...]


@dataclass(frozen=True)
class Family:
    name: str  # the --drafter word, and the `family` a drafter's config.json records
    title: str  # how prose names it
    parallel: bool  # a block of drafts from one pass (else EAGLE-3's chain: one draft a pass, TTT in training)
    model: str  # "module:Class" of the model in its package (eaglet.drafter.build imports it when first built)
    default_block_size: int | None = None  # a parallel family's block when --block-size is not given
    # a parallel family's decoder layers when --draft-layers is not given: the first multi-layer
    # size (a CPU pays for every layer at every pass)
    default_draft_layers: int = 2
    default_anchor_stride: int = 8  # a parallel family trains a block at every N-th position by default
    # the block's first position is the anchor itself (DFlash: B positions, B - 1 drafts, the first
    # prediction at anchor + 1) rather than the token after it (P-EAGLE: K drafts from anchor + 2)
    anchor_in_block: bool = False
    # the target's fused states are injected as context into every layer, whose keys/values they
    # begin (DFlash); else they enter as EAGLE-3's hidden input of the first layer (P-EAGLE)
    injects_context: bool = False
    layer_model_type: str = "llama"  # the transformer layer its exports declare (DFlash's are Qwen3's)
    speculators_type: str = ""  # speculators_model_type of its speculators export
    speculators_architecture: str = ""
    vllm_method: str = ""  # vLLM's speculative-config method that serves its export
    vllm_parallel_drafting: bool = False  # ... with parallel_drafting on (P-EAGLE as EAGLE-3)
    vllm_served: tuple[Version | None, Version | None] = (None, None)  # (first, last) vLLM that serves it
    sglang_algorithm: str | None = None  # SGLang's --speculative-algorithm for its `eagle` export
    llama_cpp: bool = False  # llama.cpp serves its GGUF export

    def parallel_defaults(self) -> dict[str, int | None]:
        """The parallel options (train's --draft-layers, --block-size, --anchor-stride) left unset."""
        return {
            "draft_layers": self.default_draft_layers,
            "block_size": self.default_block_size,
            "anchor_stride": self.default_anchor_stride,
        }

    @property
    def position_name(self) -> str:
        """What one column of its per-position statistics is."""
        return "block position" if self.parallel else "TTT step"

    @property
    def qk_norm(self) -> bool:
        """Its layers normalise each head's queries and keys (Qwen3's layers do)."""
        return self.layer_model_type == "qwen3"

    @property
    def first_prediction(self) -> int:
        """Offset from a block's anchor of the first token the block predicts."""
        return 1 if self.anchor_in_block else 2

    def drafts_per_pass(self, block_size: int) -> int:
        """Drafts one pass proposes: P-EAGLE's K, DFlash's block minus its anchor."""
        return block_size - 1 if self.anchor_in_block else block_size

    def vllm_speculative_config(self, model: str, drafts: int) -> dict[str, Any]:
        """vLLM's --speculative-config for its export at `model`, `drafts` tokens a step."""
        config: dict[str, Any] = {"method": self.vllm_method, "model": model, "num_speculative_tokens": drafts}
        if self.vllm_parallel_drafting:
            config["parallel_drafting"] = True
        return config


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    if family.name in FAMILIES:
        raise ValueError(f"drafter family {family.name!r} is registered twice")
    FAMILIES[family.name] = family
    return family


def defaults_text(option: str) -> str:
    """How the parallel families default a train option, for its help: 'p-eagle 2, dflash 2'."""
    return ", ".join(f"{f.name} {f.parallel_defaults()[option]}" for f in FAMILIES.values() if f.parallel)


def is_family(name: Any) -> bool:
    """Whether `name` names a registered family (registered now: a plug-in registers at import)."""
    return isinstance(name, str) and name in FAMILIES


def family(name: str) -> Family:
    """The family called `name`, or a ValueError that lists the ones there are."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"drafter family {name!r}: one of {list(FAMILIES)}") from None


EAGLE3 = register(
    Family(
        "eagle3",
        "EAGLE-3",
        parallel=False,
        model="eaglet.drafter.eagle3:Eagle3Draft",
        speculators_type="eagle3",
        speculators_architecture="Eagle3Speculator",
        vllm_method="eagle3",
        sglang_algorithm="EAGLE3",
        llama_cpp=True,
    )
)
# P-EAGLE's K = 8 and DFlash's block of 16 are the papers'. vLLM serves P-EAGLE (`parallel_drafting`
# on an eagle3 config) from 0.32.0 to 0.33.x: 0.34.0's transformers_utils/configs/speculators/algos.py
# (update_peagle) raises "P-EAGLE (parallel drafting EAGLE-3) is not supported".
P_EAGLE = register(
    Family(
        "p-eagle",
        "P-EAGLE",
        parallel=True,
        model="eaglet.drafter.p_eagle:PEagleDraft",
        default_block_size=8,
        speculators_type="peagle",
        speculators_architecture="PEagleSpeculator",
        vllm_method="eagle3",
        vllm_parallel_drafting=True,
        vllm_served=((0, 32), (0, 33)),
    )
)
DFLASH = register(
    Family(
        "dflash",
        "DFlash",
        parallel=True,
        model="eaglet.drafter.dflash:DFlashDraft",
        default_block_size=16,
        anchor_in_block=True,
        injects_context=True,
        layer_model_type="qwen3",
        speculators_type="dflash",
        speculators_architecture="DFlashSpeculator",
        vllm_method="dflash",
        vllm_served=((0, 32), None),
        sglang_algorithm="DFLASH",
    )
)
