"""Interoperability with the real speculators library (the peer eaglet exports to and imports from).

(a) speculators' own `Eagle3DraftModel.from_pretrained` loads eaglet's `--format speculators`
    export: every tensor lands bit for bit under speculators' names, nothing is left over and
    nothing is missing but what speculators takes from the verifier, the config flags mean the
    same thing, and its training-time forward (all TTT steps, teacher forced, fed through
    speculators' own `shift_batch` data alignment) gives eaglet's per-step logits.
(c) eaglet imports a drafter that speculators' classes built and saved (`save_pretrained`), and
    its logits equal speculators' on the same inputs; a variant eaglet cannot run is refused with
    a message that names it.

Everything is tiny, fp32 and on the CPU: speculators runs with the "eager" or "sdpa" attention
(flex attention needs compilation) and with torch.compile forced off (speculators compiles its
forward when CUDA is present).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

speculators = pytest.importorskip(
    "speculators",
    reason="speculators (the peer library eaglet's drafters interoperate with) is not installed; "
    "./scripts/bootstrap --test installs it from requirements-peers.lock. Without it these "
    "interoperability tests skip",
)

from safetensors.torch import load_file  # noqa: E402
from speculators.config import SpeculatorsConfig, VerifierConfig  # noqa: E402
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig  # noqa: E402
from speculators.models.eagle3.data import shift_batch  # noqa: E402
from speculators.proposals.greedy import GreedyTokenProposalConfig  # noqa: E402
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution  # noqa: E402
from transformers import AutoConfig, LlamaConfig  # noqa: E402

from eaglet.drafter import DraftConfig, Eagle3Draft, build_draft_vocab  # noqa: E402
from eaglet.drafter.files import export_config, load_drafter, target_embeddings  # noqa: E402
from eaglet.export import export_drafter, import_drafter  # noqa: E402
from eaglet.training.checkpoints import save_checkpoint  # noqa: E402
from eaglet.options import ExportOptions, ImportOptions  # noqa: E402

# speculators 0.9.0 calls transformers' LlamaAttention with the deprecated `past_key_values` name.
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

AUX = [2, 4, 5]  # of the 8-layer tiny target
DRAFT_VOCAB = 64  # smaller than the tiny target's vocabulary: d2t/t2d matter
SEQ = 12  # longer than WINDOW
WINDOW = 5
STEPS = 3
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32; the two attentions sum in different orders
# What speculators fills from the verifier rather than from the drafter folder.
FROM_VERIFIER = {"verifier_lm_head.weight", "verifier_norm.weight"}


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Every drafter weight random at a scale that keeps activations O(1): norms around 1 (so a
    swapped or dropped norm changes the logits), matrices ~ 1/sqrt(fan_in), embeddings N(0, 1).
    speculators' verifier_* weights are left alone (they come from the verifier)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("verifier_"):
                continue
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("embed_tokens.weight"):
                p.copy_(noise)
            elif p.dim() == 2:
                p.copy_(noise * p.shape[1] ** -0.5)
            else:
                p.copy_(1.0 + 0.2 * noise)


def random_vocab_freq(vocab: int, seed: int) -> dict[int, int]:
    gen = torch.Generator().manual_seed(seed)
    return {t: int(c) for t, c in enumerate(torch.randint(1, 1000, (vocab,), generator=gen).tolist())}


def inputs(vocab: int, hidden: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [1, SEQ], aux hidden states [1, SEQ, 3H]) at the same positions, eaglet's layout."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, SEQ), generator=gen)
    aux = torch.randn(1, SEQ, 3 * hidden, generator=gen)
    return ids, aux


def eaglet_logits(draft: Eagle3Draft, ids: torch.Tensor, aux: torch.Tensor) -> list[torch.Tensor]:
    """eaglet's TTT unroll (teacher forced): step k at position t is fed token t+1+k."""
    with torch.no_grad():
        return [x.float() for x in draft(ids, aux, steps=STEPS).logits]


def speculators_logits(model: Eagle3DraftModel, ids: torch.Tensor, aux: torch.Tensor) -> list[torch.Tensor]:
    """speculators' training forward over STEPS TTT steps on the same sample, aligned by its own
    `shift_batch` (pairs aux state t with token t+1, drops the last position, positions from 1).
    speculators then feeds, at step k, that shifted sequence shifted k further: token t+1+k, as
    eaglet does. The per-step logits are caught on `lm_head` (forward returns only argmaxes)."""
    T, H = aux.shape[1], model.hidden_size
    batch = shift_batch(
        {
            "input_ids": ids[0],
            "hidden_states": aux[0],
            "verifier_last_hidden_states": torch.zeros(T, H),
            "loss_mask": torch.ones(T, dtype=torch.long),
            "lengths": torch.tensor([T]),
            "position_ids": torch.arange(T),
        }
    )
    caught: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: caught.append(out.detach().float()))
    try:
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            model(
                hidden_states=batch["hidden_states"][None],
                input_ids=batch["input_ids"][None],
                document_ids=torch.zeros(1, T - 1, dtype=torch.long),
                position_ids=batch["position_ids"][None],
                ttt_steps=STEPS,
            )
    finally:
        hook.remove()
    assert len(caught) == STEPS, f"speculators ran lm_head {len(caught)} times for ttt_steps={STEPS}"
    return caught


def assert_same_logits(ours: list[torch.Tensor], theirs: list[torch.Tensor], what: str) -> None:
    """Compare each TTT step over the positions both define: speculators' shift_batch drops the
    sample's last position, so eaglet's position t (t < SEQ - 1) is speculators' position t."""
    assert len(ours) == len(theirs) == STEPS, f"{what}: {len(ours)} eaglet steps, {len(theirs)} speculators steps"
    for k, (a, b) in enumerate(zip(ours, theirs)):
        a = a[:, : b.shape[1]]
        assert a.shape == b.shape, f"{what}, TTT step {k}: eaglet logits {list(a.shape)}, speculators {list(b.shape)}"
        diff = (a - b).abs()
        worst = divmod(int(diff.flatten().argmax()), b.shape[-1])
        torch.testing.assert_close(
            b,
            a,
            **TOL,
            msg=lambda m, k=k, d=diff, w=worst: (
                f"{what}, TTT step {k}: speculators' logits differ from eaglet's by up to {d.max().item():.3g} "
                f"(position {w[0]}, draft id {w[1]}; positions over tolerance: "
                f"{sorted(set((d > 1e-5 + 1e-5 * a.abs()).nonzero()[:, 1].tolist()))})\n{m}"
            ),
        )


def target_config(tiny_target: Path):
    return AutoConfig.from_pretrained(tiny_target)


def load_speculators(folder: Path, attn: str = "eager") -> Eagle3DraftModel:
    """speculators' own loader on `folder`, with a CPU attention instead of flex attention."""
    config = Eagle3SpeculatorConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = attn
    model = Eagle3DraftModel.from_pretrained(folder, config=config).eval()
    assert model._attn_impl == attn, f"speculators runs {model._attn_impl!r} attention, not the {attn!r} asked for"
    return model


# ---------------------------------------------------------------------------------------------
# (a) speculators loads eaglet's export
# ---------------------------------------------------------------------------------------------

EXPORT_VARIANTS = {
    "default": {},
    "norm_before_residual": {"norm_before_residual": True},
    "fc_norm+norm_output": {"fc_norm": True, "norm_output": True},  # eaglet's fc_norm = speculators' norm_before_fc
    "sliding_window": {"sliding_window": WINDOW},
    "rope_theta+rms_norm_eps": {"rope_theta": 50000.0, "rms_norm_eps": 1e-2},  # both visible in the logits
    "head_dim": {"head_dim": 8},  # not hidden_size // num_heads
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_target):
    """name -> (export folder, eaglet checkpoint folder); built lazily per variant."""
    cache: dict[str, tuple[Path, Path]] = {}

    def make(name: str) -> tuple[Path, Path]:
        if name not in cache:
            root = tmp_path_factory.mktemp(f"export_{name}")
            cfg = DraftConfig.from_target(
                target_config(tiny_target), AUX, draft_vocab_size=DRAFT_VOCAB, **EXPORT_VARIANTS[name]
            )
            draft = Eagle3Draft(cfg)
            randomize_(draft, seed=list(EXPORT_VARIANTS).index(name) + 1)
            with torch.no_grad():  # the target's, as training gives them (export compares them)
                draft.embed_tokens.weight.copy_(target_embeddings(str(tiny_target)))
            draft.set_draft_vocab(
                *build_draft_vocab(random_vocab_freq(cfg.target_vocab_size, 3), cfg.target_vocab_size, DRAFT_VOCAB)
            )
            ckpt = save_checkpoint(
                root / "checkpoints", 5, draft, export_config(cfg, {"step": 5, "target": str(tiny_target)}), {}
            )
            out = root / "speculators"
            export_drafter(
                ExportOptions(ckpt=ckpt, out=out, fmt="speculators", dtype="fp32", verifier=str(tiny_target))
            )
            cache[name] = (out, ckpt)
        return cache[name]

    return make


@pytest.mark.parametrize("variant", list(EXPORT_VARIANTS))
def test_speculators_loads_the_export_bit_for_bit(exported, variant):
    out, _ = exported(variant)
    model = load_speculators(out)
    stored = load_file(str(out / "model.safetensors"))
    state = model.state_dict()
    unexpected = sorted(stored.keys() - state.keys())
    assert not unexpected, f"{variant}: the export holds tensors speculators has no place for: {unexpected}"
    missing = state.keys() - stored.keys()
    assert missing == FROM_VERIFIER, (
        f"{variant}: speculators' model has tensors the export lacks "
        f"{sorted(missing - FROM_VERIFIER)} (beyond the verifier's {sorted(FROM_VERIFIER)})"
    )
    assert missing <= set(Eagle3DraftModel._keys_to_ignore_on_load_missing), (
        f"{variant}: {sorted(missing)} are not among the keys speculators fills in itself"
    )
    for name, t in stored.items():
        got = state[name]
        assert got.dtype == t.dtype, f"{variant}: {name} loads as {got.dtype}, the export stores {t.dtype}"
        assert torch.equal(got, t), (
            f"{variant}: {name} differs after speculators' load "
            f"(max |diff| {(got.double() - t.double()).abs().max().item():.3g})"
        )

    cfg = load_drafter(out).config
    c = model.config
    assert (c.norm_before_residual, c.norm_before_fc, c.fc_norm, c.norm_output) == (
        cfg.norm_before_residual,
        cfg.fc_norm,
        False,
        cfg.norm_output,
    ), f"{variant}: speculators read norm flags {(c.norm_before_residual, c.norm_before_fc, c.fc_norm, c.norm_output)}"
    assert (model.input_norm is not None) == cfg.fc_norm, f"{variant}: speculators' input_norm vs eaglet fc_norm"
    assert c.eagle_aux_hidden_state_layer_ids == AUX, f"{variant}: aux ids read as {c.eagle_aux_hidden_state_layer_ids}"
    assert model.draft_vocab_size == DRAFT_VOCAB and model.use_draft_vocab, f"{variant}: draft vocab not used"
    window = model.sliding_window if model.uses_sliding_window_attn else None
    assert window == cfg.sliding_window and model.sliding_window_indices == ([0] if window else []), (
        f"{variant}: speculators runs window {window} (layers {model.sliding_window_indices}), eaglet {cfg.sliding_window}"
    )
    layer = c.transformer_layer_config
    read = (
        layer.hidden_size,
        layer.num_attention_heads,
        layer.num_key_value_heads,
        layer.head_dim,
        layer.intermediate_size,
        layer.rms_norm_eps,
        layer.rope_parameters["rope_theta"],
        layer.vocab_size,
        layer.num_hidden_layers,
    )
    want = (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.rms_norm_eps,
        cfg.rope_theta,
        cfg.target_vocab_size,
        1,
    )
    assert read == want, (
        f"{variant}: speculators read (hidden, heads, kv heads, head_dim, intermediate, eps, "
        f"rope_theta, vocab, layers) = {read}, eaglet's drafter has {want}"
    )


@pytest.mark.parametrize("variant,attn", [(v, "eager") for v in EXPORT_VARIANTS] + [("default", "sdpa")])
def test_speculators_logits_equal_eaglets_on_the_export(exported, variant, attn):
    out, ckpt = exported(variant)
    draft = load_drafter(out)
    model = load_speculators(out, attn)
    ids, aux = inputs(draft.config.target_vocab_size, draft.config.hidden_size)
    ours = eaglet_logits(draft, ids, aux)
    assert all(torch.equal(a, b) for a, b in zip(ours, eaglet_logits(load_drafter(ckpt), ids, aux))), (
        f"{variant}: eaglet's export loads back with logits other than its checkpoint's"
    )
    assert_same_logits(ours, speculators_logits(model, ids, aux), f"{variant} export ({attn} attention)")


def test_the_window_matters_at_this_length(exported):
    """The sliding-window case is only a test if the window changes the logits at SEQ tokens."""
    out, _ = exported("sliding_window")
    draft = load_drafter(out)
    ids, aux = inputs(draft.config.target_vocab_size, draft.config.hidden_size)
    windowed = eaglet_logits(draft, ids, aux)
    draft.config.sliding_window = None
    full = eaglet_logits(draft, ids, aux)
    assert not torch.allclose(windowed[0][:, WINDOW:], full[0][:, WINDOW:], **TOL), (
        f"a window of {WINDOW} does not change the logits of a {SEQ}-token sequence"
    )


# ---------------------------------------------------------------------------------------------
# (c) eaglet imports a drafter speculators' own classes saved
# ---------------------------------------------------------------------------------------------

SPECULATORS_VARIANTS = {
    "default": ({}, {}),
    "norm_before_residual": ({"norm_before_residual": True}, {}),
    "sliding_window": ({}, {"sliding_window": WINDOW, "layer_types": ["sliding_attention"]}),
    "norm_before_fc": ({"norm_before_fc": True}, {}),
    "norm_output": ({"norm_output": True}, {}),
    "norm_before_fc+norm_output+residual": (
        {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True},
        {},
    ),
    "rope_theta+rms_norm_eps": (
        {},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}, "rms_norm_eps": 1e-2},
    ),
    "head_dim": ({}, {"head_dim": 8}),
}


def speculators_drafter(tiny_target: Path, flags: dict, layer: dict, seed: int = 11) -> Eagle3DraftModel:
    """An Eagle3DraftModel built with speculators' classes only, every drafter weight random."""
    tc = target_config(tiny_target)
    sizes = dict(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.hidden_size // tc.num_attention_heads,
        rms_norm_eps=tc.rms_norm_eps,
        max_position_embeddings=tc.max_position_embeddings,
    )
    layer_config = LlamaConfig(**{**sizes, **layer})
    layer_config._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config,
        draft_vocab_size=DRAFT_VOCAB,
        eagle_aux_hidden_state_layer_ids=AUX,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=STEPS)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(str(tiny_target)),
        ),
        **flags,
    )
    model = Eagle3DraftModel(config)
    d2t, t2d = build_vocab_mappings_from_distribution(
        random_vocab_freq(tc.vocab_size, seed), DRAFT_VOCAB, tc.vocab_size
    )
    model.load_vocab_mappings(t2d, d2t)
    randomize_(model, seed)
    model.load_verifier_weights()  # what speculators does after building; keeps the random drafter weights
    return model.eval()


def eaglet_name(name: str) -> str:
    """speculators' tensor name -> eaglet's (written here from the two models, not eaglet's formats package)."""
    for old, new in (("layers.0.", "midlayer."), ("input_norm.", "fc_norm.")):
        if name.startswith(old):
            return new + name[len(old) :]
    return name


@pytest.mark.parametrize("variant", list(SPECULATORS_VARIANTS))
def test_eaglet_imports_speculators_drafter_with_equal_logits(tmp_path, tiny_target, variant):
    flags, layer = SPECULATORS_VARIANTS[variant]
    model = speculators_drafter(tiny_target, flags, layer)
    folder, back = tmp_path / "speculators", tmp_path / "imported"
    model.save_pretrained(folder)
    saved = load_file(str(folder / "model.safetensors"))
    assert not saved.keys() & FROM_VERIFIER, f"speculators saved {sorted(saved.keys() & FROM_VERIFIER)}"

    summary = import_drafter(ImportOptions(src=folder, out=back))
    assert summary.source_format == "speculators", f"{variant}: read as {summary.source_format}"
    cfg = summary.config
    window = layer.get("sliding_window")
    assert (cfg.norm_before_residual, cfg.fc_norm, cfg.norm_output, cfg.sliding_window, cfg.aux_layer_ids) == (
        model.config.norm_before_residual,
        model.config.norm_before_fc,
        model.config.norm_output,
        window,
        AUX,
    ), (
        f"{variant}: eaglet read norm_before_residual/fc_norm/norm_output/sliding_window/aux ids as "
        f"{(cfg.norm_before_residual, cfg.fc_norm, cfg.norm_output, cfg.sliding_window, cfg.aux_layer_ids)}"
    )
    lc = model.config.transformer_layer_config
    want = (
        lc.hidden_size,
        lc.num_attention_heads,
        lc.num_key_value_heads,
        lc.head_dim,
        lc.intermediate_size,
        lc.rms_norm_eps,
        lc.rope_parameters["rope_theta"],
        lc.vocab_size,
        model.config.draft_vocab_size,
        lc.hidden_size,
    )
    read = (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.rms_norm_eps,
        cfg.rope_theta,
        cfg.target_vocab_size,
        cfg.draft_vocab_size,
        cfg.target_hidden_size,
    )
    assert read == want, (
        f"{variant}: eaglet read (hidden, heads, kv heads, head_dim, intermediate, eps, rope_theta, "
        f"vocab, draft vocab, target hidden) = {read}, speculators' drafter has {want}"
    )

    imported = load_file(str(back / "model.safetensors"))
    renamed = {eaglet_name(k): v for k, v in saved.items()}
    assert renamed.keys() == imported.keys(), (
        f"{variant}: eaglet's import has {sorted(imported.keys() - renamed.keys())} "
        f"extra and lacks {sorted(renamed.keys() - imported.keys())}"
    )
    for name, t in renamed.items():
        assert torch.equal(imported[name], t), f"{variant}: {name} changed on import"

    draft = load_drafter(back)
    ids, aux = inputs(cfg.target_vocab_size, cfg.hidden_size)
    theirs = speculators_logits(model, ids, aux)
    assert_same_logits(eaglet_logits(draft, ids, aux), theirs, f"{variant} speculators drafter imported")
    # speculators reading its own folder back gives the same logits (the folder is what eaglet imported).
    reloaded = speculators_logits(load_speculators(folder), ids, aux)
    assert all(torch.equal(a, b) for a, b in zip(reloaded, theirs)), (
        f"{variant}: speculators' own save/load changed its logits"
    )


def test_eaglet_refuses_per_layer_fc_norm_clearly(tmp_path, tiny_target):
    """speculators' fc_norm (one RMSNorm per aux state) is not eaglet's fc_norm (one over the concat)."""
    model = speculators_drafter(tiny_target, {"fc_norm": True}, {})
    folder = tmp_path / "speculators"
    model.save_pretrained(folder)
    assert any(k.startswith("fc_norm.") for k in load_file(str(folder / "model.safetensors")))
    with pytest.raises(ValueError) as e:
        import_drafter(ImportOptions(src=folder, out=tmp_path / "imported"))
    message = str(e.value)
    assert "config.json" in message and "fc_norm = True" in message and "per-layer" in message, (
        f"the refusal does not name the file, the field and why: {message}"
    )
    assert not (tmp_path / "imported").exists(), "a refused import left a folder behind"
    assert json.loads((folder / "config.json").read_text())["fc_norm"] is True
