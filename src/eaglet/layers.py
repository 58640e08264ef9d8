"""Which target hidden states a drafter fuses: the aux layer ids, and the one rule they follow.

An off-by-one layer id trains a drafter that loads, runs and is silently never accepted, so
every stage that reads or writes ids (extract, check, train, convert, export, import) asks
this module instead of checking for itself.

Ids follow Hugging Face's `output_hidden_states` indexing: id 0 is the embeddings, id k the
output of decoder layer k-1, id N (of an N-layer target) the last layer's output, which feeds
only the teacher. EAGLE-3 fuses three aux states, low / mid / high, by default [2, N//2, N-3];
stored datasets record the three and then N. vLLM uses the same ids; SGLang's `eagle_config`
counts decoder layers (its id k hooks the output of layer k, our id k+1), and SpecForge /
ModelOpt hook the outputs of layers [1, N//2-1, N-4] — the same tensors.

Beside the ids, the one rule for how many positions a model holds (`config_positions`), which
prepare, extract, check, training, decoding and the drafter's config all read.
"""

from __future__ import annotations

from typing import Any, TypeGuard

NUM_AUX = 3  # low, mid, high
NUM_STORED = NUM_AUX + 1  # ... and the last layer's state, for the teacher
# A config that names no max_position_embeddings: nothing in it bounds a sequence (RoPE computes any
# position), so eaglet does not either.
UNBOUNDED_POSITIONS = 1 << 30


def config_positions(config: Any) -> int:
    """How many positions (prompt + output) a model of this config (an object or a config.json
    dict) holds: max_position_embeddings, `UNBOUNDED_POSITIONS` when the config does not say. That is
    the real limit, what the model computes: the tokenizer's model_max_length is only a hint, a
    placeholder (1e30) in many tokenizers and smaller than the config in others."""
    value = (
        config.get("max_position_embeddings")
        if isinstance(config, dict)
        else getattr(config, "max_position_embeddings", None)
    )
    return int(value or UNBOUNDED_POSITIONS)


def default_aux_ids(num_layers: int) -> list[int]:
    """EAGLE-3's low / mid / high ids for an N-layer target; below 7 layers, where those are not
    three distinct ids, the first, middle and last decoder layer's outputs in 1..N-1."""
    if num_layers < 4:
        raise ValueError(
            f"a target of {num_layers} layers has no three distinct layers in 1..{num_layers - 1} for "
            "EAGLE-3's aux states"
        )
    if num_layers < 7:
        return [1, num_layers // 2, num_layers - 1]
    return [2, num_layers // 2, num_layers - 3]


def default_layer_ids(num_layers: int) -> list[int]:
    """The ids a dataset stores by default: the aux ids, then the last layer N."""
    return [*default_aux_ids(num_layers), num_layers]


def is_id_list(ids: object) -> TypeGuard[list[int] | tuple[int, ...]]:
    return isinstance(ids, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)


def aux_ids_problem(ids: object, num_layers: int | None = None) -> str | None:
    """Why `ids` are not three aux ids (of an N-layer target, when N is given), or None."""
    span = f"in 1..{num_layers - 1} for this {num_layers}-layer target" if num_layers else ">= 1"
    rule = (
        f"expected {NUM_AUX} strictly increasing integer ids {span} (HF hidden_states indexing: id k = output "
        "of decoder layer k-1; the last layer N feeds the teacher)"
    )
    if not is_id_list(ids) or len(ids) != NUM_AUX or any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < 1:
        return rule
    if num_layers is not None and ids[-1] >= num_layers:
        return rule
    return None


def stored_ids_problem(ids: object, num_layers: int | None = None) -> str | None:
    """Why `ids` are not the ids a dataset stores (three aux ids, then N), or None."""
    if not is_id_list(ids) or len(ids) != NUM_STORED:
        return (
            f"expected {NUM_STORED} integer ids: the {NUM_AUX} aux ids EAGLE-3 fuses, then the last layer N "
            "(the teacher's state)"
        )
    problem = aux_ids_problem(list(ids[:NUM_AUX]), num_layers)
    if problem:
        return f"the first {NUM_AUX} (the aux ids {list(ids[:NUM_AUX])}): {problem}"
    if ids[-1] <= ids[NUM_AUX - 1]:
        return "not strictly increasing: the last id N comes after the aux ids"
    if num_layers is not None and ids[-1] != num_layers:
        return f"the last id must be {num_layers} (num_hidden_layers): the last layer's state feeds the teacher"
    return None


def check_aux_ids(ids: object, num_layers: int | None = None, where: str = "aux layer ids") -> list[int]:
    """`ids` as a list, or a ValueError naming `where` (an option, a file and field)."""
    problem = aux_ids_problem(ids, num_layers)
    if problem or not is_id_list(ids):  # (no problem: a list of ids)
        raise ValueError(f"{where} {ids}: {problem}")
    return list(ids)


def check_stored_ids(ids: object, num_layers: int | None = None, where: str = "layer_ids") -> list[int]:
    problem = stored_ids_problem(ids, num_layers)
    if problem or not is_id_list(ids):  # (no problem: a list of ids)
        raise ValueError(f"{where} {ids}: {problem}")
    return list(ids)


def to_sglang(ids: list[int]) -> list[int]:
    """Our ids as SGLang's `eagle_config` counts them (decoder-layer indices whose output it hooks)."""
    return [i - 1 for i in ids]


def from_sglang(ids: list[int]) -> list[int]:
    """SGLang's `eagle_config` ids as ours (sgl-project/sglang#25454): they count decoder layers, so a
    first id of 1 is our 2; ids that already start at 2 were written in HF indexing and are kept."""
    return [i + 1 for i in ids] if ids and ids[0] == 1 else list(ids)
