"""The drafter families' one declaration (eaglet.families): the stages outside the drafter's own
package and the export layouts read a family's traits and never compare its name."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

import eaglet
from eaglet import families
from eaglet.decode import speculative_generate
from eaglet.drafter.files import load_checkpoint
from eaglet.drafter.p_eagle import PEagleDraft
from eaglet.export import export_drafter
from eaglet.options import DRAFTER_FAMILIES, PARALLEL_METHODS, VLLM_FAMILY_METHODS
from eaglet.training.checkpoints import iter_metrics
from eaglet.training.loop import train
from helpers import FAST, PROMPTS
from references import plain_greedy
from eaglet.options import ExportOptions, TrainOptions

SRC = Path(eaglet.__file__).parent
# where a family's name may still decide behaviour: the declarations themselves, nowhere else
# (the drafters' model code and their export layouts read traits too)
FAMILY_CODE = ("families.py",)
NAMES = "|".join(re.escape(f"{q}{n}{q}") for n in families.FAMILIES for q in "\"'")
COMPARISON = re.compile(
    rf"(==|!=)\s*({NAMES}|EAGLE3\b|P_EAGLE\b|DFLASH\b)|({NAMES}|EAGLE3\b|P_EAGLE\b|DFLASH\b)\s*(==|!=)"
)


def test_no_module_compares_a_family_name():
    found = [
        f"{path.relative_to(SRC)}:{i}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        if not str(path.relative_to(SRC)).startswith(FAMILY_CODE)
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if COMPARISON.search(line)
    ]
    assert not found, "read the family's traits (eaglet.families) instead:\n" + "\n".join(found)


def test_the_comparison_pattern_finds_what_it_is_for():
    assert COMPARISON.search('if cfg.family == "dflash":') and COMPARISON.search("if EAGLE3 != family:")
    assert not COMPARISON.search("EAGLE3_NUM_STATES = 4") and not COMPARISON.search('x = "dflash"')


def test_the_options_are_made_from_the_registry():
    assert DRAFTER_FAMILIES == tuple(families.FAMILIES)
    assert PARALLEL_METHODS == tuple(n for n, f in families.FAMILIES.items() if f.parallel)
    assert set(VLLM_FAMILY_METHODS.values()) == set(families.FAMILIES)


def test_traits_of_the_three_families():
    assert [families.family(n).drafts_per_pass(8) for n in ("p-eagle", "dflash")] == [8, 7]
    assert [families.family(n).first_prediction for n in ("p-eagle", "dflash")] == [2, 1]
    assert families.P_EAGLE.vllm_speculative_config("d", 8) == {
        "method": "eagle3",
        "model": "d",
        "num_speculative_tokens": 8,
        "parallel_drafting": True,
    }
    assert families.DFLASH.vllm_speculative_config("d", 15) == {
        "method": "dflash",
        "model": "d",
        "num_speculative_tokens": 15,
    }
    assert families.EAGLE3.position_name == "TTT step" and families.DFLASH.position_name == "block position"


def test_a_family_is_registered_once_and_an_unknown_one_is_named():
    with pytest.raises(ValueError, match="drafter family 'dflash' is registered twice"):
        families.register(
            families.Family("dflash", "DFlash again", parallel=True, model="eaglet.drafter.dflash:DFlashDraft")
        )
    with pytest.raises(ValueError, match=r"drafter family 'dspark': one of \['eagle3', 'p-eagle', 'dflash'\]"):
        families.family("dspark")


@pytest.fixture
def variant():
    """A family added the way a plug-in adds one: a `Family` registered, nothing else edited.
    DFlash's traits with a block of 6 as its default and its own name."""
    added = families.register(
        dataclasses.replace(families.DFLASH, name="dflash-6", title="DFlash-6", default_block_size=6)
    )
    yield added
    del families.FAMILIES[added.name]


def test_a_family_registered_alone_trains_decodes_exactly_and_exports(variant, dataset, target, tiny_target, tmp_path):
    """Adding a family touches only its registration: training builds, checks and saves it, the
    checkpoint loads back as it, decoding with it equals plain greedy, and it exports for vLLM in
    the layout of the architecture its traits name."""
    opts = {**FAST, "anchor_stride": 2}
    opts.pop("ttt_steps")
    summary = train(
        TrainOptions(dataset_dir=dataset, out_dir=tmp_path / "run", drafter=variant.name, total_steps=3, **opts),
        show_progress=False,
    )
    config = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert (config["drafter"], config["block_size"]) == ("dflash-6", 6)  # its own default
    drafter = load_checkpoint(tmp_path / "run" / "checkpoints" / f"step_{summary.step:08d}")
    assert drafter.config.family == "dflash-6" and "layers.0.self_attn.q_norm.weight" in drafter.state_dict()
    assert len(list(iter_metrics(tmp_path / "run"))[-1]["acc"]) == variant.drafts_per_pass(6) == 5
    for prompt in PROMPTS:
        assert speculative_generate(target, drafter, prompt, 16, mode="chain", depth=5)[0] == plain_greedy(
            target, prompt, 16
        )
    export_drafter(ExportOptions(ckpt=tmp_path / "run", out=tmp_path / "vllm", fmt="speculators"))
    exported = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert exported["speculators_model_type"] == "dflash" and exported["block_size"] == 6


class EvenPEagle(PEagleDraft):
    """A family's own model code, as its package would hold it: P-EAGLE's drafter whose block
    positions all weigh alike in the loss."""

    used: list[int] = []

    @staticmethod
    def position_weights(block_size: int) -> list[float]:
        EvenPEagle.used.append(block_size)
        return [1.0] * block_size


@pytest.fixture
def own_model():
    """A family with a model of its own: its class and a `Family` naming it, nothing else edited."""
    added = families.register(
        dataclasses.replace(
            families.P_EAGLE, name="p-eagle-even", title="P-EAGLE, even", model=f"{__name__}:EvenPEagle"
        )
    )
    yield added
    del families.FAMILIES[added.name]


def test_a_family_with_a_model_of_its_own_trains_and_decodes_with_it(own_model, dataset, target, tmp_path):
    opts = {**FAST, "anchor_stride": 2}
    opts.pop("ttt_steps")
    summary = train(
        TrainOptions(dataset_dir=dataset, out_dir=tmp_path / "run", drafter=own_model.name, total_steps=2, **opts),
        show_progress=False,
    )
    assert EvenPEagle.used and set(EvenPEagle.used) == {8}  # its loss weights, at its family's block
    drafter = load_checkpoint(tmp_path / "run" / "checkpoints" / f"step_{summary.step:08d}")
    assert type(drafter) is EvenPEagle and drafter.config.family == "p-eagle-even"
    for prompt in PROMPTS:
        assert speculative_generate(target, drafter, prompt, 12, mode="chain", depth=8)[0] == plain_greedy(
            target, prompt, 12
        )
