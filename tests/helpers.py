"""What several test modules build, in one place: tiny drafters and their checkpoints, chat records
and the tiny training dataset's recipe, foreign-layout copies of a dataset, a head-only copy of a
target, a stand-in GGUF. Fixtures live in conftest.py; the engines' replayed loaders in replays.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import torch
from safetensors.torch import load_file

from conftest import CHATS
from eaglet import formats, heads
from eaglet.drafter import DraftConfig, Eagle3Draft, build_draft_vocab
from eaglet.drafter.files import export_config
from eaglet.training.checkpoints import save_checkpoint
from references import write_flat_v1_sample, write_specforge_sample

REPO = Path(__file__).resolve().parents[1]  # the repository's root

FAST = dict(
    ttt_steps=3, lr=3e-3, warmup_steps=2, eval_every=4, save_every=4, log_every=2, batch_size=2, eval_fraction=0.1
)


AUX_IDS = [2, 4, 5]


PROMPTS = [[5, 17, 99, 3, 42, 7], [1, 200, 201, 202], [300, 12, 12, 12, 12, 88, 91, 150, 2, 77, 31]]


TARGET = "org/tiny-target"


AUX = [2, 4, 5]


TOKENS = [f"tok{i}" for i in range(50)]  # tiny_config's target vocabulary


def run_with_peak_memory(code: str, timeout: float = 300) -> tuple[list[str], float]:
    """Run `code` in a fresh Python; its output lines and its peak memory in MiB. The peak is the
    child's own VmHWM, read at its end: getrusage's ru_maxrss keeps the peak of the (vforked)
    pytest before exec."""
    peak = (
        "\nimport re, pathlib\n"
        "print(re.search(r'VmHWM:\\s+(\\d+) kB', pathlib.Path('/proc/self/status').read_text()).group(1))"
    )
    done = subprocess.run([sys.executable, "-c", code + peak], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    *lines, peak_kib = done.stdout.strip().splitlines()
    return lines, int(peak_kib) / 1024


def chat_records(count: int = 20) -> list[dict]:
    """Chats of mixed lengths, so batches mix lengths."""
    records = []
    for n in range(count):
        chat = [dict(m) for m in CHATS[n % len(CHATS)]]
        chat[-1]["content"] += " " + " ".join(["More words."] * (n % 6))
        records.append({"id": f"chat{n}", "messages": chat})
    return records


def run_weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step:08d}" / "model.safetensors"))


def tiny_config(**kw) -> DraftConfig:
    base = dict(
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
        target_vocab_size=50,
        draft_vocab_size=30,
        aux_layer_ids=list(AUX),
    )
    base.update(kw)
    return DraftConfig(**base)


def random_drafter(cfg: DraftConfig, seed: int = 0) -> Eagle3Draft:
    """Every tensor random (norms too), so a swapped or dropped weight changes the logits."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_()
    freq = {t: int(c) for t, c in enumerate(torch.randint(0, 100, (cfg.target_vocab_size,)).tolist())}
    draft.set_draft_vocab(*build_draft_vocab(freq, cfg.target_vocab_size, cfg.draft_vocab_size))
    return draft.eval()


def write_checkpoint(root: Path, draft: Eagle3Draft) -> Path:
    return save_checkpoint(
        root / "checkpoints", 5, draft, export_config(draft.config, {"step": 5, "target": TARGET}), {}
    )


def head_only_copy(full: Path, out: Path) -> Path:
    """What `huggingface-cli download --include` of the config, tokenizer, index and head shards gives."""
    out.mkdir()
    location = heads.locate_heads(full)
    keep = set(heads.IDENTITY_FILES) | {heads.INDEX_FILE, *location.head_shards}
    for f in full.iterdir():
        if f.name in keep:
            shutil.copy(f, out / f.name)
    return out


def final_norm(target: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from eaglet.target import heads_of_model

    return heads_of_model(AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)).final_norm


def write_foreign(v1: Path, out: Path, layout: str, norm: torch.nn.Module) -> Path:
    """The same samples in another layout, without any side file (speculators' keeps its table)."""
    rows = []
    for i, path in sorted(formats.list_v1_files(v1).items()):
        s = formats.read_v1_sample(path)
        rows.append((s.input_ids, s.loss_mask))
        if layout == formats.FORMAT_V1_FLAT:
            write_flat_v1_sample(out, i, s)
        elif layout == formats.FORMAT_SPECFORGE:
            with torch.no_grad():  # SpecForge stores the last state after the final norm
                last = norm(s.hidden_states[-1])
            write_specforge_sample(
                out, i, s.input_ids, s.loss_mask, last, torch.cat(s.hidden_states[:-1], -1), compressed=i % 2 == 1
            )  # .ckpt and .ckpt.gz side by side
        elif layout == formats.FORMAT_SPECULATORS_ARROW:
            formats.write_speculators_sample(out, i, s.input_ids, s.hidden_states)
        else:
            formats.write_hs_safetensors_sample(out, i, s.input_ids, torch.stack(s.hidden_states, 1), s.loss_mask)
    if layout == formats.FORMAT_SPECULATORS_ARROW:
        formats.write_speculators_rows(out, rows)
    return out


def target_gguf(
    path: Path, n_tokens: int = len(TOKENS), width: int | None = None, tokenizer: Path | None = None
) -> Path:
    """A stand-in for the target's GGUF: just the tokenizer keys the drafter copies (and, given a
    width, the hidden size a real one records): the tokens of the model folder `tokenizer` (padded
    to `n_tokens`, as a converter pads a vocabulary), else tok0, tok1, ..."""
    tokens = [f"tok{i}" for i in range(n_tokens)]
    if tokenizer is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
        own = tok.convert_ids_to_tokens(list(range(len(tok))))
        tokens = [*own, *(f"[PAD{i}]" for i in range(len(own), n_tokens))]
    w = gguf.GGUFWriter(path, "llama")
    if width is not None:
        w.add_embedding_length(width)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
