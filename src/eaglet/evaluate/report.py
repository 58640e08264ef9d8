"""What `eaglet eval` reports: each method's sums over a prompt set (`MethodTotals`), their
figures (`summarize`), the table, eval.json and eval.png (`EvalResult`).

Speedup = (method's new tokens / its seconds) / (its reference's new tokens / its seconds), summed
over a prompt set; the reference is plain greedy, or llama.cpp plain for llama.cpp's speculative
methods. At temperature 0 every method must reproduce its reference's tokens; in fp32 they do
exactly, in bf16 matmuls of different shapes round differently, so the share of identical outputs
and the mean position of the first divergence are reported instead of assumed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from eaglet import formats
from eaglet.evaluate.engines import first_draft_line
from eaglet.evaluate.methods import Run
from eaglet.options import BASELINE

RESULTS_FILE = "eval.json"
PLOT_FILE = "eval.png"


# ---------------------------------------------------------------------------------------------
# Sums over a prompt set, and their figures
# ---------------------------------------------------------------------------------------------


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix), None if equal."""
    if list(a) == list(b):
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def add_into(xs: list[int], ys: Sequence[int]) -> None:
    xs.extend([0] * (len(ys) - len(xs)))
    for i, y in enumerate(ys):
        xs[i] += y


@dataclass
class MethodTotals:
    """One method's sums over a prompt set."""

    turns: int = 0
    new_tokens: int = 0
    wall_s: float = 0.0
    target_forwards: int = 0
    verify_forwards: int = 0
    target_s: float = 0.0
    draft_s: float = 0.0
    position_reached: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    identical: int = 0
    divergences: list[int] = field(default_factory=list)
    accepted_from: Counter = field(default_factory=Counter)  # accepted draft tokens by proposer

    def add(self, run: Run, reference: list[int] | None) -> None:
        self.turns += 1
        self.new_tokens += len(run.tokens)
        self.wall_s += run.wall_s
        self.target_forwards += run.target_forwards
        if run.stats is not None:
            self.verify_forwards += run.stats.verify_forwards
            self.target_s += run.stats.target_s
            self.draft_s += run.stats.draft_s
            add_into(self.position_reached, run.stats.position_reached)
            add_into(self.position_accepted, run.stats.position_accepted)
            self.accepted_from.update(run.stats.accepted_from)
        if reference is not None:
            d = first_divergence(run.tokens, reference)
            if d is None:
                self.identical += 1
            else:
                self.divergences.append(d)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self, plain: MethodTotals | None, compared: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "turns": self.turns,
            "new_tokens": self.new_tokens,
            "wall_s": round(self.wall_s, 3),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "target_forwards": self.target_forwards,
            "tau": round(self.new_tokens / self.target_forwards, 4) if self.target_forwards else None,
        }
        if plain is not None and plain.tokens_per_s > 0:
            out["speedup"] = round(self.tokens_per_s / plain.tokens_per_s, 4)
        if self.verify_forwards:
            out["tau_verify"] = round((self.new_tokens - self.turns) / self.verify_forwards, 4)
            out["acceptance_rates"] = [
                round(a / r, 4) if r else None for a, r in zip(self.position_accepted, self.position_reached)
            ]
            out["accepted_from"] = dict(sorted(self.accepted_from.items()))
            # the speedup if everything but the target and drafter passes cost nothing
            if plain is not None and plain.new_tokens and self.target_forwards:
                t_token = plain.wall_s / plain.new_tokens
                t_cycle = (self.target_s + self.draft_s) / self.target_forwards
                out["ceiling_speedup"] = round(out["tau"] * t_token / t_cycle, 4) if t_cycle > 0 else None
        if compared:
            out["identical_share"] = round(self.identical / self.turns, 4) if self.turns else None
            out["mean_first_divergence"] = (
                round(sum(self.divergences) / len(self.divergences), 2) if self.divergences else None
            )
        return out


def summarize(
    totals: dict[str, MethodTotals], compared: bool, references: dict[str, str] | None = None
) -> dict[str, dict[str, Any]]:
    """Each label's figures, speedups against its reference (`references`; default plain
    greedy); `compared`: report identical outputs."""
    references = references if references is not None else {label: BASELINE for label in totals if label != BASELINE}
    out = {
        label: t.summary(totals[references[label]] if label in references else None, compared and label in references)
        for label, t in totals.items()
    }
    for label, ref in references.items():
        if ref != BASELINE:
            out[label]["speedup_over"] = ref
    return out


@dataclass
class EvalResult:
    """What one evaluation found: the run's record, each set's figures by method, one record per
    prompt turn; `save` writes them as eval.json (and eval.png)."""

    config: dict[str, Any]
    sets: dict[str, dict[str, dict[str, Any]]]
    prompts: list[dict[str, Any]]
    json_path: Path | None = None
    plot_path: Path | None = None

    def table(self) -> str:
        return format_table(self.sets) + costs_line(self.config.get("costs"))

    def save(self, out: Path, plot: bool, title: str) -> None:
        formats.make_output(out, "eval")
        self.json_path = out / RESULTS_FILE
        formats.write_json_atomic(self.json_path, {"config": self.config, "sets": self.sets, "prompts": self.prompts})
        if plot:
            self.plot_path = out / PLOT_FILE
            write_plot(self.sets, self.plot_path, title)


# ---------------------------------------------------------------------------------------------
# Table and plot
# ---------------------------------------------------------------------------------------------


def fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(sets: dict[str, dict[str, dict[str, Any]]]) -> str:
    # each method's dtype / threads where eval chose them per method (evaluate.tuning)
    configs = any("config" in r for methods in sets.values() for r in methods.values())
    config_head = f" {'config':<17}" if configs else ""
    head = (
        f"{'prompt set':<16} {'method':<16}{config_head} {'turns':>5} {'tokens':>7} {'tok/s':>8} {'speedup':>8} "
        f"{'ceiling':>8} {'tau':>6} {'identical':>9} {'1st diff':>8}  acceptance per position"
    )
    lines = [head, "-" * len(head)]
    for name, methods in sets.items():
        for m, r in methods.items():
            acc = " ".join(fmt(a, ".2f") for a in r.get("acceptance_rates", []))
            sources = r.get("accepted_from", {})
            if len(sources) > 1:  # a hybrid: who proposed the accepted tokens
                total = sum(sources.values())
                acc += "  (accepted: " + ", ".join(f"{k} {v / total:.0%}" for k, v in sources.items()) + ")"
            config = f" {r.get('config', '-'):<17}" if configs else ""
            lines.append(
                f"{name:<16} {m:<16}{config} {r['turns']:>5} {r['new_tokens']:>7} {r['tokens_per_s']:>8.2f} "
                f"{fmt(r.get('speedup'), '.2f') + 'x' if 'speedup' in r else '-':>8} "
                f"{fmt(r.get('ceiling_speedup'), '.2f') + 'x' if r.get('ceiling_speedup') else '-':>8} "
                f"{fmt(r.get('tau'), '.2f'):>6} {fmt(r.get('identical_share'), '.0%'):>9} "
                f"{fmt(r.get('mean_first_divergence'), '.1f'):>8}  {acc}"
            )
        lines += [first_draft_line(name, m, r) for m, r in methods.items() if "first_acceptance_gap" in r]
    return "\n".join(lines)


def costs_line(costs: dict[str, Any] | None) -> str:
    """The line under the table: what a target pass and a drafter pass cost on plain's lane."""
    if not costs:
        return ""
    target = costs["target_pass_s"]
    line = (
        f"\npass costs ({costs['config']}, {costs['runner']}): target over 1..{len(target)} new tokens "
        + " ".join(f"{1000 * c:.1f}" for c in target)
        + f" ms (4 tokens: {target[3] / target[0]:.2f}x one)"
    )
    if "drafter_pass_s" in costs:
        line += (
            f"; drafter cycle {1000 * costs['drafter_pass_s']:.1f} ms "
            f"({costs['drafter_pass_s'] / target[0]:.2f}x a one-token target pass)"
        )
    return line


def write_plot(sets: dict[str, dict[str, dict[str, Any]]], path: Path, title: str) -> None:
    """Left: acceptance rate per draft position (one line per set and mode). Right: speedup
    over plain greedy (llama.cpp's methods: over llama.cpp's plain decoding, said in the legend)
    per set and method, each bar labelled with its tau."""
    import matplotlib  # slow to import, and only the plot needs it

    matplotlib.use("Agg")  # before pyplot: no display is needed to write a PNG
    import matplotlib.pyplot as plt  # after the backend is chosen
    import matplotlib.ticker  # the axis locators below

    fig, (ax_acc, ax_speed) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, by_method in sets.items():
        for m, r in by_method.items():
            rates = r.get("acceptance_rates")
            if rates:
                ax_acc.plot(
                    range(1, len(rates) + 1),
                    [x if x is not None else float("nan") for x in rates],
                    marker="o",
                    label=f"{name} {m}",
                )
    ax_acc.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1), title="acceptance per position")
    ax_acc.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax_acc.grid(alpha=0.3)
    if ax_acc.lines:
        ax_acc.legend(fontsize=8)

    names = list(sets)
    methods = [m for m in dict.fromkeys(m for ms in sets.values() for m in ms) if m != BASELINE]
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(names))]
        ys = [sets[n].get(m, {}).get("speedup") or 0.0 for n in names]
        over = next((sets[n][m]["speedup_over"] for n in names if sets[n].get(m, {}).get("speedup_over")), None)
        bars = ax_speed.bar(xs, ys, width, label=f"{m} (vs {over})" if over else m)
        for b, n in zip(bars, names):
            tau = sets[n].get(m, {}).get("tau")
            if tau is not None:
                ax_speed.annotate(
                    f"τ {tau:.2f}",
                    (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
    ax_speed.axhline(1.0, color="gray", lw=1, ls="--")
    ax_speed.set_xticks(range(len(names)), names)
    ax_speed.set(ylabel="speedup over plain greedy (or the method in the legend)", title="speedup (bar label: tau)")
    ax_speed.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with formats.atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
