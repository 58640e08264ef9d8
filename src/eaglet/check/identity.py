"""Checks against the target: a few sampled files are recomputed and every stored slot is matched
against every layer, so a wrong id, order or norm convention is named ("slot 2 matches layer 28,
not 27"); the stored last state (or a compact file's teacher) must predict the next token as the
target does; a target of other weights, or samples longer than its positions, are said first."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eaglet import formats
from eaglet.chat import special_token_ids, template_hash
from eaglet.check.files import Expect, FileResult, mask_template_issues
from eaglet.check.heads import convention_hits, convention_problem
from eaglet.check.report import (
    ERROR,
    LAYER_IDENTITY,
    NOT_CHECKED,
    STORED_TEACHER,
    TOO_LONG,
    WARNING,
    CheckReport,
    Problem,
    SlotIdentity,
)
from eaglet.placement import Placement
from eaglet.heads import TargetHeads
from eaglet.target import (
    base_model,
    decoder_layers,
    input_device,
    load_heads,
    load_target,
    load_tokenizer,
    max_positions,
    parse_dtype,
    pick_device,
    resolve_target,
    whole_target_size,
)

if TYPE_CHECKING:  # transformers' modelling code loads only with a model
    from transformers import PreTrainedModel

# Layer identity: a stored slot "is" a recomputed state when it is this close. bf16 storage
# alone gives rel err ~0.004; a recompute on other hardware / kernels adds a little.
IDENTITY_COS, IDENTITY_REL_ERR = 0.99, 0.1
# ...and it "is another layer" when another candidate is at least this much closer.
IDENTITY_MARGIN = 0.5
TEACHER_AGREEMENT = 0.9  # next-token argmax of the stored last state vs the recomputed one
# A compact file's stored log-probabilities against the recomputed target's, mean over positions:
# fp16 storage and the bf16 last state they were computed from account for a few hundredths.
TEACHER_LOG_PROB_ERR = 0.1


def generation_prompt(tokenizer: Any) -> tuple[list[int], str] | None:
    """The tokens a chat template appends for `add_generation_prompt=True` (e.g. '<|im_start|>assistant\\n')."""
    msgs = [{"role": "user", "content": "Hi"}]
    try:
        with_p = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        without = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    except Exception:
        return None
    if not with_p.startswith(without) or len(with_p) == len(without):
        return None
    text = with_p[len(without) :]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return (list(ids), text) if ids else None


def template_mismatch(recorded: str | None, tokenizer: Any) -> str | None:
    """The recorded chat template's hash against the tokenizer's, when one was recorded."""
    if recorded and recorded != template_hash(tokenizer):
        return (
            f"chat_template_sha256 {recorded} is not the target tokenizer's ({template_hash(tokenizer)}): the "
            "data was prepared with another template"
        )
    return None


def prepared_mask_problem(
    samples: list[formats.TokenizedSample], pconfig: dict[str, Any], tokenizer: Any
) -> str | None:
    """What `eaglet check` finds in a stored file's loss mask, found in prepared samples (train
    --online reads no stored file): a template other than the one recorded, or a mask whose runs are
    not the assistant turns the chat template implies (shifted, inverted, a user turn)."""
    other = template_mismatch(pconfig.get("chat_template_sha256"), tokenizer)
    if other:
        return f"{formats.PREPARE_CONFIG_FILE}: {other}"
    gp = generation_prompt(tokenizer)
    if not gp:  # as check: a template without a separable generation prompt leaves nothing to compare
        return None
    gen, eot_ids = gp[0], frozenset(special_token_ids(tokenizer))
    for s in samples:
        issues = mask_template_issues(s.input_ids, s.loss_mask, gen, eot_ids)
        if issues:
            return f"{formats.PREPARED_FILE} sample {s.sample_id!r}: loss_mask: {issues[0]}"
    return None


def load_target_for_check(
    spec: str, cfg: formats.DataConfig | None, placed: Placement | None = None
) -> tuple[Any, Any, PreTrainedModel | TargetHeads, torch.device]:
    """(ref, tokenizer, model, input device). Recompute in the recorded compute dtype, as
    extraction did; on the default device, or across the devices `placed` maps. A folder that holds
    only the heads gives its heads instead (as stored, on the CPU): what they alone can check."""
    ref = resolve_target(spec)
    tokenizer = load_tokenizer(ref)
    if Path(ref.path).is_dir() and whole_target_size(ref) is None:
        return ref, tokenizer, load_heads(ref), torch.device("cpu")
    dtype = parse_dtype((cfg.compute_dtype if cfg else None) or "fp32")
    model = load_target(ref, dtype, pick_device(None), placed)
    return ref, tokenizer, model, input_device(model)


def target_revision_problem(cfg: formats.DataConfig | None, ref: Any) -> Problem | None:
    """The data records the revision (content hash) of the target it came from; a target of other
    weights explains every identity mismatch that follows, so it is said first, in one line."""
    recorded = cfg.target_revision if cfg else None
    if not recorded or ref.is_revision(recorded):
        return None
    return Problem(
        LAYER_IDENTITY,
        formats.DATA_CONFIG_FILE,
        f"target_revision {recorded} ({(cfg.target if cfg and cfg.target else '?')}) is not the "
        f"revision of the target checked against, {ref.name} ({ref.revision}): other weights, so no "
        "stored state will match; "
        "check against the target the data was extracted with",
    )


def too_long_problems(results: list[FileResult], model: PreTrainedModel | TargetHeads) -> list[Problem]:
    """Samples longer than the target's positions: states the target never makes in use."""
    limit = max_positions(model)
    return [
        Problem(
            TOO_LONG,
            r.path,
            f"{r.length} tokens, the target has {limit} positions "
            f"(max_position_embeddings): prepare with --max-length {limit} or less",
        )
        for r in results
        if r.length is not None and r.length > limit
    ]


# ---------------------------------------------------------------------------------------------
# Recomputing a sample with the target
# ---------------------------------------------------------------------------------------------


@dataclass
class Recomputed:
    states: dict[str, torch.Tensor]  # "layer k" (pre-norm outputs, k = 0..N) and "layer N post-norm", fp32 [T, H]
    logits_fn: Any  # h_post_norm [T, H] -> logits
    norm: Any  # the final norm module, or None
    head: Any = None  # the LM head module (for fp32 log-probabilities)


@torch.inference_mode()
def recompute(model: PreTrainedModel, input_ids: torch.Tensor, device: torch.device) -> Recomputed:
    """Every candidate a stored slot could be: embeddings, each decoder layer's output, the
    last layer's output before and after the final norm. Forward hooks, so no HF convention
    about what `hidden_states[-1]` means is relied on."""
    layers = decoder_layers(model)
    n = len(layers)
    outs: dict[int, torch.Tensor] = {}

    def hook(k: int):
        def f(_m, _a, output):
            outs[k] = (output[0] if isinstance(output, tuple) else output)[0].float().cpu()

        return f

    handles = [layer.register_forward_hook(hook(k + 1)) for k, layer in enumerate(layers)]
    try:
        base = base_model(model)
        ids = input_ids.to(device)[None]
        out = base(input_ids=ids, use_cache=False)
        emb = base.get_input_embeddings()(ids)[0].float().cpu()
    finally:
        for h in handles:
            h.remove()
    states = {
        "layer 0": emb,
        **{f"layer {k}": outs[k] for k in range(1, n + 1)},
        f"layer {n} post-norm": out.last_hidden_state[0].float().cpu(),
    }
    norm = getattr(base, "norm", None)
    head = model.get_output_embeddings()
    dtype = next(model.parameters()).dtype

    def logits_fn(h: torch.Tensor) -> torch.Tensor:
        return head(h.to(device, dtype)).float().cpu()

    return Recomputed(states, logits_fn, norm if isinstance(norm, torch.nn.Module) else None, head)


def compare(stored: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """(mean row cosine, relative Frobenius error, max abs error). Cosine alone cannot tell a
    state from its RMS-normed self (a norm with unit weights only rescales rows), so the
    relative error, which sees the scale, decides; cosine and max abs error are reported."""
    s, r = stored.float(), ref.float()
    cos = float(torch.nn.functional.cosine_similarity(s, r, dim=-1, eps=1e-12).mean())
    rel = float(torch.linalg.vector_norm(s - r) / torch.linalg.vector_norm(r).clamp_min(1e-30))
    return cos, rel, float((s - r).abs().max())


def expected_labels(layer_ids: list[int], last_convention: str, n: int) -> list[str]:
    labels = [f"layer {k}" for k in layer_ids]
    if labels and layer_ids[-1] == n and last_convention == formats.LAST_STATE_POST_NORM:
        labels[-1] = f"layer {n} post-norm"
    return labels


def slot_identity_problem(
    j: int,
    num_slots: int,
    expected: str,
    best: str,
    stats: dict[str, tuple[float, float, float]],
    last_convention: str,
    rel: str,
) -> Problem | None:
    """Name what a slot really holds when it is not what the config records."""
    e_cos, e_rel, _ = stats[expected]
    b_cos, b_rel, _ = stats[best]
    expected_ok = e_cos >= IDENTITY_COS and e_rel <= IDENTITY_REL_ERR
    clearly_other = best != expected and b_rel < IDENTITY_MARGIN * e_rel and b_rel <= IDENTITY_REL_ERR
    if expected_ok and not clearly_other:
        return None
    name = f"slot {j} (last)" if j == num_slots - 1 else f"slot {j}"
    detail = f"(rel err {b_rel:.3g} vs {e_rel:.3g}, cos {b_cos:.4f} vs {e_cos:.4f})"
    if clearly_other:
        if best.split(" post-norm")[0] == expected.split(" post-norm")[0]:  # same layer, other side of the norm
            what = "post-norm" if best.endswith("post-norm") else "pre-norm"
            return Problem(
                LAYER_IDENTITY,
                rel,
                f"{name} matches {best.split(' post-norm')[0]} {what}, recorded {last_convention} {detail}",
            )
        return Problem(LAYER_IDENTITY, rel, f"{name} matches {best}, not {expected.removeprefix('layer ')} {detail}")
    return Problem(
        LAYER_IDENTITY,
        rel,
        f"{name} matches no layer of the target: recorded {expected} has rel err "
        f"{e_rel:.3g}, cos {e_cos:.4f}; closest is {best} (rel err {b_rel:.3g})",
    )


# ---------------------------------------------------------------------------------------------
# The teacher: the stored last state's (or stored top-K's) next-token predictions
# ---------------------------------------------------------------------------------------------


def teacher_accuracy(
    rec: Recomputed,
    stored_last: torch.Tensor | formats.StoredTeacher,
    last_convention: str,
    ids: torch.Tensor,
    mask: torch.Tensor | None,
    n: int,
) -> tuple[int, int, int, int] | None:
    """(positions, stored correct, recomputed correct, agreeing) for next-token argmax on masked
    positions; the stored argmax is lm_head(norm(stored last)), or a compact file's first teacher id."""
    if rec.norm is None:
        return None
    with torch.inference_mode():
        pred_ref = rec.logits_fn(rec.states[f"layer {n} post-norm"]).argmax(-1)
        if isinstance(stored_last, formats.StoredTeacher):
            pred_stored = stored_last.ids[:, 0].long()
        else:
            param = next(rec.norm.parameters(), None)
            dev = param.device if param is not None else torch.device("cpu")
            dt = param.dtype if param is not None else torch.float32
            h = stored_last.to(dev, dt)
            h = rec.norm(h) if last_convention == formats.LAST_STATE_PRE_NORM else h
            pred_stored = rec.logits_fn(h).argmax(-1)
    pos = (mask[1:] == 1) if mask is not None else torch.ones(len(ids) - 1, dtype=torch.bool)
    nxt = ids[1:]
    ps, pr = pred_stored[:-1][pos], pred_ref[:-1][pos]
    return int(pos.sum()), int((ps == nxt[pos]).sum()), int((pr == nxt[pos]).sum()), int((ps == pr).sum())


@torch.inference_mode()
def log_probs_at(h: torch.Tensor, head: torch.nn.Linear, ids: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """fp32 log_softmax(head(h)) at `ids` [T, K], whatever the head's dtype, a slice of the
    vocabulary at a time (neither a [T, vocab] tensor nor an fp32 copy of the head)."""
    w, bias = head.weight, getattr(head, "bias", None)
    h = h.to(w.device, torch.float32)
    lse = torch.full((h.shape[0],), float("-inf"), device=w.device)
    for v in range(0, w.shape[0], chunk):
        logits = h @ w[v : v + chunk].float().T + (0 if bias is None else bias[v : v + chunk].float())
        lse = torch.logaddexp(lse, logits.logsumexp(-1))
    idx = ids.to(w.device).long()
    picked = (h[:, None, :] * w[idx].float()).sum(-1) + (0 if bias is None else bias[idx].float())
    return (picked - lse[:, None]).cpu()


def stored_log_prob_problem(rec: Recomputed, t: formats.StoredTeacher, n: int, rel: str) -> Problem | None:
    """A compact file's stored log-probabilities against the recomputed target's at the same ids."""
    ref = log_probs_at(rec.states[f"layer {n} post-norm"], rec.head, t.ids)
    err = (ref - t.log_probs.float()).abs().mean().item()
    if err <= TEACHER_LOG_PROB_ERR:
        return None
    return Problem(
        STORED_TEACHER,
        rel,
        f"teacher_log_probs differ from the recomputed target's by {err:.3f} nats on "
        f"average (at most {TEACHER_LOG_PROB_ERR} expected): another model, or a "
        "post-norm state normed twice",
    )


# ---------------------------------------------------------------------------------------------
# Layer identity over sampled files
# ---------------------------------------------------------------------------------------------


def pick_identity_files(results: list[FileResult], k: int) -> list[FileResult]:
    """Evenly spread over the dataset (first, last, between): deterministic and representative."""
    ok = sorted((r for r in results if r.schema_ok and r.length), key=lambda r: r.index)
    if len(ok) <= k:
        return ok
    return [ok[round(i * (len(ok) - 1) / max(k - 1, 1))] for i in range(k)]


def slot_identities(
    report: CheckReport,
    sample: formats.FileStates,
    rec: Recomputed,
    labels: list[str],
    last_convention: str,
    rel: str,
    worst: dict[int, SlotIdentity],
) -> None:
    """Match each stored slot of one file against every recomputed state: its problems go to the
    report, and `worst` keeps, per slot, the file where the recorded layer matched least."""
    slots = len(sample.states) + (sample.teacher is not None)  # compact: the last slot is the teacher
    for j, h in enumerate(sample.states[: len(labels)]):
        stats = {name: compare(h, ref) for name, ref in rec.states.items()}
        best = min(stats, key=lambda name: stats[name][1])
        expected = labels[j]
        p = slot_identity_problem(j, slots, expected, best, stats, last_convention, rel)
        if p:
            report.problems.append(p)
        e_cos, e_rel, e_abs = stats[expected]
        cur = worst.get(j)
        if cur is None or e_rel > cur.rel_err:
            worst[j] = SlotIdentity(j, expected, best, e_cos, e_rel, e_abs, stats[best][0], stats[best][1])


def identity_check(
    report: CheckReport,
    root: Path,
    exp: Expect,
    model: PreTrainedModel,
    files: list[FileResult],
    layer_ids: list[int],
    last_convention: str,
    device: torch.device,
) -> None:
    n = model.config.num_hidden_layers
    labels = expected_labels(layer_ids, last_convention, n)
    worst: dict[int, SlotIdentity] = {}
    acc = [0, 0, 0, 0]
    least: tuple[float, str] | None = None  # (agreement, path) of the file that agrees least
    for r in files:
        sample = sampled_states(root, exp, r)
        rec = recompute(model, sample.input_ids, device)
        slot_identities(report, sample, rec, labels, last_convention, r.path, worst)
        mask = sample.loss_mask if isinstance(sample.loss_mask, torch.Tensor) else None
        if sample.teacher is not None:
            p = stored_log_prob_problem(rec, sample.teacher, n, r.path)
            if p:
                report.problems.append(p)
        t = teacher_accuracy(rec, sample.teacher or sample.states[-1], last_convention, sample.input_ids, mask, n)
        if t:
            acc = [a + b for a, b in zip(acc, t)]
            if t[0] and (least is None or t[3] / t[0] < least[0]):
                least = (t[3] / t[0], r.path)
    report.identity = [worst[j] for j in sorted(worst)]
    report.identity_files = [r.path for r in files]
    if acc[0]:
        report.next_token_accuracy = {
            "positions": acc[0],
            "stored_last": acc[1] / acc[0],
            "recomputed": acc[2] / acc[0],
            "agreement": acc[3] / acc[0],
        }
        if acc[3] / acc[0] < TEACHER_AGREEMENT:
            assert least is not None  # acc[0] > 0: some file had positions
            report.problems.append(
                Problem(
                    LAYER_IDENTITY,
                    least[1],
                    f"the stored next-token argmax agrees with the recomputed target on only "
                    f"{acc[3] / acc[0]:.1%} of masked positions ({len(files)} sampled files; this file "
                    f"agrees least, on {least[0]:.1%})",
                )
            )


def layer_identity_problems(
    root: Path,
    fmt: str | formats.Layout,
    sample: Path,
    model: PreTrainedModel,
    layer_ids: list[int],
    last_convention: str,
) -> list[Problem]:
    """The layer-identity errors `eaglet check --target` would report for one file, with the
    target already loaded: train runs this before spending hours on states whose recorded
    layer ids are not what the files hold (an edited data_config.json trains a drafter that the
    engines feed other layers, and that is then never accepted)."""
    report = CheckReport(str(root))
    probe = FileResult(0, str(sample.relative_to(root)), 0, schema_ok=True, length=1)
    with torch.inference_mode():
        identity_check(
            report,
            root,
            Expect(formats.layout(fmt)),
            model,
            [probe],
            layer_ids,
            last_convention,
            next(model.parameters()).device,
        )
    return [p for p in report.problems if p.kind == LAYER_IDENTITY and p.severity == ERROR]


def sampled_states(root: Path, exp: Expect, r: FileResult) -> formats.FileStates:
    """A sampled file's states: the file read well in the first pass (files with problems are not sampled)."""
    sample, _ = exp.layout.file_states(exp.layout.read_raw(root / r.path), r.path)
    if sample is None:
        raise ValueError(f"{root / r.path}: unreadable on a second read (was it changed during the check?)")
    return sample


def heads_check(
    report: CheckReport,
    root: Path,
    exp: Expect,
    target_heads: TargetHeads,
    files: list[FileResult],
    last_convention: str,
) -> None:
    """With the heads alone: the stored last state's next-token accuracy read as recorded and read
    the other way, on the sampled files; the layer identity is said to be not checked, and how."""
    positions, hits = 0, {c: 0 for c in formats.LAST_STATE_CONVENTIONS}
    for r in files:
        sample = sampled_states(root, exp, r)
        if sample.teacher is not None:
            continue  # a compact file: the stored teacher is its last slot
        mask = sample.loss_mask if isinstance(sample.loss_mask, torch.Tensor) else None
        n, h = convention_hits(sample.states[-1], sample.input_ids, mask, target_heads)
        positions, hits = positions + n, {c: hits[c] + h[c] for c in hits}
        p = convention_problem(n, h, last_convention, r.path)
        if p:
            report.problems.append(p)
    if positions:
        other = next(c for c in formats.LAST_STATE_CONVENTIONS if c != last_convention)
        report.next_token_accuracy = {
            "positions": positions,
            "stored_last": hits[last_convention] / positions,
            f"stored_last_read_{other}": hits[other] / positions,
        }
    report.identity_files = [r.path for r in files]
    report.problems.append(
        Problem(
            NOT_CHECKED,
            "",
            f"layer identity not checked: {target_heads.source}; the heads "
            "checked the last state and the sizes. For the layers, "
            f"`eaglet check {root} --target FULL_TARGET [--device-map auto]`",
            WARNING,
        )
    )
