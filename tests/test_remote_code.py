"""No code from a model folder runs unless asked: a target whose config names its own code
(`auto_map`) is refused by every loader with the option that allows it, the code never runs, and
with `eaglet --trust-remote-code` (EAGLET_TRUST_REMOTE_CODE=1) it is the folder's code that runs; a
model type transformers does not know gets a message that says what is missing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eaglet.cli import main
from eaglet.options import REMOTE_CODE_ENV
from eaglet.target import load_target, load_tokenizer, resolve_target

CONFIG_CODE = """\
from pathlib import Path
from transformers import LlamaConfig
Path(MARKER).write_text("the folder's code ran")
class CustomConfig(LlamaConfig):
    model_type = "custom_llama"
"""


def custom_folder(tiny_target: Path, tmp_path: Path, auto_map: bool) -> Path:
    folder = tmp_path / ("with_code" if auto_map else "unknown_type")
    shutil.copytree(tiny_target, folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "custom_llama"
    if auto_map:
        config["auto_map"] = {"AutoConfig": "configuration_custom.CustomConfig"}
        (folder / "configuration_custom.py").write_text(CONFIG_CODE.replace("MARKER", repr(str(folder / "RAN"))))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_target_with_its_own_code_is_refused_and_its_code_never_runs(tiny_target, tmp_path, monkeypatch):
    monkeypatch.delenv(REMOTE_CODE_ENV, raising=False)
    folder = custom_folder(tiny_target, tmp_path, auto_map=True)
    ref = resolve_target(str(folder))
    assert load_tokenizer(ref).is_fast  # its tokenizer needs no code: read as data
    with pytest.raises(ValueError, match=r"needs the model folder's own code \(auto_map\); .*--trust-remote-code"):
        load_target(ref, torch.float32, torch.device("cpu"))
    assert not (folder / "RAN").exists()


def test_the_command_line_says_so_and_allows_it_by_name(tiny_target, tmp_path, chats_jsonl, monkeypatch, capsys):
    monkeypatch.delenv(REMOTE_CODE_ENV, raising=False)
    folder = custom_folder(tiny_target, tmp_path, auto_map=True)
    assert main(["prepare", "--target", str(folder), "--data", str(chats_jsonl), "--out", str(tmp_path / "prep")]) == 0
    args = ["extract", "--prepared", str(tmp_path / "prep"), "--out", str(tmp_path / "data")]
    assert main(args) == 2
    assert "--trust-remote-code" in capsys.readouterr().err and not (folder / "RAN").exists()
    main(["--trust-remote-code", *args])  # transformers then has no model class for the type: it fails after
    assert (folder / "RAN").exists()  # allowed by name: the folder's code is what ran


def test_an_unknown_model_type_says_what_is_missing(tiny_target, tmp_path, monkeypatch):
    monkeypatch.delenv(REMOTE_CODE_ENV, raising=False)
    ref = resolve_target(str(custom_folder(tiny_target, tmp_path, auto_map=False)))
    with pytest.raises(ValueError, match=r"model_type 'custom_llama' is not one transformers knows"):
        load_target(ref, torch.float32, torch.device("cpu"))


class RunsOnLoad:
    """A pickled object that would run a command when unpickled without weights_only."""

    def __reduce__(self):
        import os

        return (os.system, ("true",))


def test_a_pickled_weight_file_with_code_is_refused_naming_it(tiny_target, tmp_path):
    """The probe's pytorch_model.bin holding an os.system call: refused (never run) in torch's
    words, which named no file and suggested turning weights_only off."""
    folder = Path(shutil.copytree(tiny_target, tmp_path / "bin_target"))
    from safetensors.torch import load_file

    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save({**state, "payload": RunsOnLoad()}, folder / "pytorch_model.bin")
    with pytest.raises(
        ValueError, match=r"target .*bin_target: pytorch_model\.bin: holds Python objects beyond tensors"
    ) as e:
        load_target(resolve_target(str(folder)), torch.float32, torch.device("cpu"))
    assert "weights_only=False" not in str(e.value) and "weights_only set to False" not in str(e.value)
