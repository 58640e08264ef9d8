"""The drafter families' one declaration (eaglet.families): the stages outside the drafter's own
package and the export layouts read a family's traits and never compare its name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import eaglet
from eaglet import families
from eaglet.options import DRAFTER_FAMILIES, PARALLEL_METHODS, VLLM_FAMILY_METHODS

SRC = Path(eaglet.__file__).parent
# where a family's name may still decide behaviour: its own model code and its export layouts
FAMILY_CODE = ("drafter/", "formats/drafters.py", "families.py")
NAMES = "|".join(re.escape(f"{q}{n}{q}") for n in families.FAMILIES for q in "\"'")
COMPARISON = re.compile(rf"(==|!=)\s*({NAMES}|EAGLE3\b|P_EAGLE\b|DFLASH\b)|({NAMES}|EAGLE3\b|P_EAGLE\b|DFLASH\b)\s*(==|!=)")


def test_no_stage_compares_a_family_name():
    found = [f"{path.relative_to(SRC)}:{i}: {line.strip()}"
             for path in sorted(SRC.rglob("*.py")) if not str(path.relative_to(SRC)).startswith(FAMILY_CODE)
             for i, line in enumerate(path.read_text().splitlines(), 1) if COMPARISON.search(line)]
    assert not found, "read the family's traits (eaglet.families) instead:\n" + "\n".join(found)


def test_the_comparison_pattern_finds_what_it_is_for():
    assert COMPARISON.search('if cfg.family == "dflash":') and COMPARISON.search("if EAGLE3 != family:")
    assert not COMPARISON.search('EAGLE3_NUM_STATES = 4') and not COMPARISON.search('x = "dflash"')


def test_the_options_are_made_from_the_registry():
    assert DRAFTER_FAMILIES == tuple(families.FAMILIES)
    assert PARALLEL_METHODS == tuple(n for n, f in families.FAMILIES.items() if f.parallel)
    assert set(VLLM_FAMILY_METHODS.values()) == set(families.FAMILIES)


def test_traits_of_the_three_families():
    assert [families.family(n).drafts_per_pass(8) for n in ("p-eagle", "dflash")] == [8, 7]
    assert [families.family(n).first_prediction for n in ("p-eagle", "dflash")] == [2, 1]
    assert families.P_EAGLE.vllm_speculative_config("d", 8) == {
        "method": "eagle3", "model": "d", "num_speculative_tokens": 8, "parallel_drafting": True}
    assert families.DFLASH.vllm_speculative_config("d", 15) == {
        "method": "dflash", "model": "d", "num_speculative_tokens": 15}
    assert families.EAGLE3.position_name == "TTT step" and families.DFLASH.position_name == "block position"


def test_a_family_is_registered_once_and_an_unknown_one_is_named():
    with pytest.raises(ValueError, match="drafter family 'dflash' is registered twice"):
        families.register(families.Family("dflash", "DFlash again", parallel=True))
    with pytest.raises(ValueError, match=r"drafter family 'dspark': one of \['eagle3', 'p-eagle', 'dflash'\]"):
        families.family("dspark")
