"""`eaglet eval` (eaglet.evaluate): prompt sets, exactness report, sums, table, JSON and plot."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace

import pytest
import torch

from eaglet import formats
from eaglet.chat import chat_prompt_ids
from eaglet.decode import DecodeStats
from eaglet.drafter import DraftConfig, Eagle3Draft
from eaglet.evaluate import DecodeSettings, MethodTotals, Run, evaluate, format_table, load_prompt_set
from eaglet.evaluate.engines import gap_verdict
from eaglet.evaluate.methods import engine_proposer, variants_for, with_pass_costs
from eaglet.evaluate.report import first_divergence
from eaglet.drafter.files import export_config
from eaglet.training.checkpoints import save_checkpoint

from conftest import LLAMA_STAND_IN_PREAMBLE, llama_server_stand_in, write_jsonl
from helpers import run_with_peak_memory, target_gguf
from eaglet.options import EvalOptions


@pytest.fixture(scope="module")
def drafter_ckpt(tiny_target, tmp_path_factory):
    """A random-weight drafter saved as an eaglet checkpoint for the tiny target (whose embeddings
    it carries, as training gives it)."""
    from transformers import AutoConfig

    from eaglet.drafter.files import target_embeddings

    torch.manual_seed(0)
    cfg = DraftConfig.from_target(AutoConfig.from_pretrained(tiny_target), [2, 4, 5], draft_vocab_size=300)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target_embeddings(str(tiny_target)))
    root = tmp_path_factory.mktemp("run") / "checkpoints"
    return save_checkpoint(root, 1, draft, export_config(cfg, {"target": str(tiny_target)}), {})


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models are per-op overhead; a second thread only spins
    yield
    torch.set_num_threads(threads)


def test_embedded_prompt_sets():
    mt = load_prompt_set("mtbench", None)
    assert len(mt) == 80 and all(len(p.turns) == 1 for p in mt)
    both = load_prompt_set("mtbench-2turn", 5)
    assert len(both) == 5 and all(len(p.turns) == 2 for p in both)
    assert both[0].turns[0] == mt[0].turns[0]
    he = load_prompt_set("humaneval", None)
    assert len(he) == 164 and he[0].id == "HumanEval/0" and "def " in he[0].turns[0]


def test_jsonl_prompts_and_errors(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"id": "a", "prompt": "hi"},
            {"turns": ["one", "two"]},
            {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}]},
        ],
    )
    a, b, c = load_prompt_set(str(path), None)
    assert (a.id, a.turns) == ("a", ["hi"]) and b.turns == ["one", "two"]
    assert c.context == [{"role": "system", "content": "be brief"}] and c.turns == ["q"]
    assert len(load_prompt_set(str(path), 2)) == 2

    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1.jsonl:2: not UTF-8"):
        load_prompt_set(str(latin1), None)

    bad = write_jsonl(
        tmp_path / "bad.jsonl",
        [{"prompt": "ok"}, {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}],
    )
    with pytest.raises(ValueError, match=r"bad.jsonl:2: field 'messages': the last message must be the user's"):
        load_prompt_set(str(bad), None)
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"text": "x"}])
    with pytest.raises(ValueError, match=r"odd.jsonl:1: expected a 'prompt'"):
        load_prompt_set(str(odd), None)
    with pytest.raises(ValueError, match="not one of mtbench"):
        load_prompt_set("no-such-set", None)


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_totals_arithmetic():
    """tau, speedup and per-position acceptance from known counts."""
    plain = MethodTotals()
    plain.add(Run([1] * 10, wall_s=2.0, target_forwards=10), None)
    spec = MethodTotals()
    stats = DecodeStats(
        new_tokens=10,
        target_forwards=4,
        verify_forwards=3,
        position_reached=[3, 2, 1],
        position_accepted=[2, 1, 0],
        target_s=0.4,
        draft_s=0.1,
    )
    spec.add(Run([1] * 10, wall_s=0.5, target_forwards=4, stats=stats), reference=[1] * 10)
    other = [1] * 9 + [2]
    spec.add(Run(other, wall_s=0.5, target_forwards=4, stats=stats), reference=[1] * 10)
    r = spec.summary(plain, compared=True)
    assert r["tau"] == 2.5 and r["speedup"] == 4.0  # 20 tok/s vs 5 tok/s
    assert r["tau_verify"] == 3.0  # (20 - 2 prefill tokens) / 6 verifications
    assert r["acceptance_rates"] == [round(2 / 3, 4), 0.5, 0.0]
    assert r["identical_share"] == 0.5 and r["mean_first_divergence"] == 9
    # ceiling: tau 2.5 * 0.2 s per plain token / (1.0 s of passes / 8 forwards)
    assert r["ceiling_speedup"] == 4.0


def test_eval_end_to_end_fp32_is_exact(tiny_target, drafter_ckpt, tmp_path, one_thread):
    """Every method reproduces plain greedy token for token in fp32, on single- and two-turn
    prompts; the JSON, table and plot are written."""
    prompts = write_jsonl(
        tmp_path / "prompts.jsonl",
        [
            {"id": "x", "prompt": "Write a function that adds two numbers."},
            {"id": "y", "turns": ["Hello there", "And then?"]},
        ],
    )
    out = tmp_path / "eval"
    result = evaluate(
        EvalOptions(
            drafter_path=drafter_ckpt,
            target=str(tiny_target),
            prompt_sets=[str(prompts)],
            methods=["chain", "tree", "hybrid", "ngram", "prompt-lookup", "hf-greedy"],
            max_new_tokens=12,
            depth=3,
            top_k=3,
            total_tokens=8,
            chain_depth=3,
            dtype="fp32",
            device="cpu",
            out=out,
        ),
        progress=False,
    )
    r = result.sets["prompts"]
    assert r["plain"]["turns"] == 3 and r["plain"]["tau"] == 1.0
    for m in ("chain", "tree", "hybrid", "ngram", "prompt-lookup", "hf-greedy"):
        assert r[m]["identical_share"] == 1.0, (m, r[m])
        assert r[m]["new_tokens"] == r["plain"]["new_tokens"]
        assert r[m]["speedup"] > 0
    assert len(r["tree"]["acceptance_rates"]) >= 1
    assert set(r["hybrid"]["accepted_from"]) <= {"drafter", "ngram", "both"}
    assert set(r["ngram"]["accepted_from"]) <= {"ngram"} and set(r["chain"]["accepted_from"]) <= {"drafter"}
    saved = formats.read_json(out / "eval.json")
    assert saved["sets"] == json.loads(json.dumps(result.sets))
    # hybrid and ngram admitted tokens by cost, with the target's pass times measured before decoding
    costs = saved["config"]["pass_costs_s"]
    assert saved["config"]["hybrid"]["admission"] == "cost" and len(costs) >= 2 and costs == sorted(costs)
    assert [(p["id"], p["turn"]) for p in saved["prompts"]] == [("x", 0), ("y", 0), ("y", 1)]
    # the second turn's prompt holds the first turn's answer, so it is longer than turn 0's
    assert saved["prompts"][2]["prompt_tokens"] > saved["prompts"][1]["prompt_tokens"] + 12
    assert (out / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = format_table(result.sets)
    assert "prompt-lookup" in table and "100%" in table


def test_eval_refuses_a_drafter_for_another_target(tiny_target, tmp_path, one_thread):
    from transformers import AutoConfig

    cfg = DraftConfig.from_target(AutoConfig.from_pretrained(tiny_target), [2, 4, 5], draft_vocab_size=300)
    cfg.target_hidden_size = 32  # trained on another model's hidden states
    ckpt = save_checkpoint(tmp_path / "checkpoints", 1, Eagle3Draft(cfg), export_config(cfg, {}), {})
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    with pytest.raises(ValueError, match="hidden size 32 vs the target's 64"):
        evaluate(
            EvalOptions(
                drafter_path=ckpt, target=str(tiny_target), prompt_sets=[str(prompts)], dtype="fp32", device="cpu"
            ),
            progress=False,
        )


def test_a_recorded_target_that_is_no_target_is_named_with_its_file(tiny_target, tmp_path, one_thread):
    """A checkpoint's eaglet.target of 123 ended in a TypeError; one of a folder gone since blamed
    --target, an option nobody gave."""
    from transformers import AutoConfig

    cfg = DraftConfig.from_target(AutoConfig.from_pretrained(tiny_target), [2, 4, 5], draft_vocab_size=300)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    for i, (recorded, said) in enumerate(
        [
            (
                123,
                r"config\.json: field eaglet\.target 123 is not a model folder or hub id; write the target's "
                r"folder or id there, or pass --target",
            ),
            (str(tmp_path / "gone"), r"step_\d+: the target its config\.json records .*gone: not a local folder"),
            (str(tiny_target), r"config\.json: field eaglet\.target_revision \[1\] is not a revision"),
        ]
    ):
        extra = {"target": recorded, **({"target_revision": [1]} if i == 2 else {})}
        ckpt = save_checkpoint(tmp_path / f"c{i}", 1, Eagle3Draft(cfg), export_config(cfg, extra), {})
        with pytest.raises((ValueError, FileNotFoundError), match=said):
            evaluate(
                EvalOptions(drafter_path=ckpt, prompt_sets=[str(prompts)], dtype="fp32", device="cpu"), progress=False
            )


def test_prompts_longer_than_the_target_are_skipped_and_counted(drafter_ckpt, tiny_target, tmp_path, one_thread):
    """A prompt the target cannot hold (1,024 positions here) is skipped with its later turns,
    counted and listed; the rest of the set is measured. A set with nothing that fits is an error."""
    prompts = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"id": "short", "prompt": "hi"},
            {"id": "long", "prompt": "word " * 1500},
            {"id": "late", "turns": ["hi", "x " * 1100]},
        ],
    )
    result = evaluate(
        EvalOptions(
            drafter_path=drafter_ckpt,
            target=str(tiny_target),
            prompt_sets=[str(prompts)],
            methods=["chain"],
            max_new_tokens=4,
            dtype="fp32",
            device="cpu",
        ),
        progress=False,
    )
    assert result.sets["p"]["plain"]["turns"] == 2
    assert result.config["skipped_turns"] == 2
    assert [(r["id"], r["turn"]) for r in result.prompts if "skipped" in r] == [("long", 0), ("late", 1)]
    only_long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "word " * 1500}])
    with pytest.raises(ValueError, match="every prompt is too long for the target's 1024 positions"):
        evaluate(
            EvalOptions(
                drafter_path=drafter_ckpt,
                target=str(tiny_target),
                prompt_sets=[str(only_long)],
                methods=["chain"],
                max_new_tokens=4,
                dtype="fp32",
                device="cpu",
            ),
            progress=False,
        )


def test_a_prompt_far_beyond_the_positions_costs_memory_by_what_they_hold(drafter_ckpt, tiny_target, tmp_path):
    """A 40 MB prompt, first in its set (the pass-cost prompt and the warm-up read it too): tokenized
    only up to what the target's 1,024 positions could span, then skipped as too long, with the
    process's peak near its baseline (a 60 MB prompt once took 13.4 GB and three minutes)."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "huge", "prompt": "The quick brown fox. " * 2_000_000}])
    with open(prompts, "a") as f:
        f.write(json.dumps({"id": "short", "prompt": "hi"}) + "\n")
    options = (
        f"EvalOptions(drafter_path={str(drafter_ckpt)!r}, target={str(tiny_target)!r}, "
        f"prompt_sets=[{str(prompts)!r}], methods=['chain'], max_new_tokens=4, dtype='fp32', device='cpu', "
        f"out={str(tmp_path / 'eval')!r}, plot=False)"
    )
    (skipped,), peak_mib = run_with_peak_memory(
        "import torch\ntorch.set_num_threads(1)\n"
        "from eaglet.evaluate import evaluate\nfrom eaglet.options import EvalOptions\n"
        f"result = evaluate({options}, progress=False)\n"
        "print('|'.join(r.get('skipped', '-') for r in result.prompts))"
    )
    assert re.fullmatch(r"prompt of over \d+ tokens leaves no room in the target's 1024 positions\|-", skipped), skipped
    assert peak_mib < 1500, f"peak {peak_mib:.0f} MiB"


def test_cost_admission_needs_measured_pass_costs(tiny_target):
    from transformers import AutoModelForCausalLM

    from eaglet.decode import HybridProposer, NgramProposer

    with pytest.raises(ValueError, match="pass costs"):
        engine_proposer("ngram", None, DecodeSettings())
    with pytest.raises(ValueError, match="--admission"):
        DecodeSettings(admission="some")
    with pytest.raises(ValueError, match="--drop-rivals"):
        DecodeSettings(drop_rivals=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    settings = DecodeSettings(lookup_tokens=3, hybrid_chain_depth=2)
    variants = with_pass_costs(variants_for(["ngram", "hybrid", "chain"], settings), model)
    # one measurement, as long as the largest tree a variant verifies (+ the root)
    assert (
        len(variants["hybrid"][1].pass_costs) == 6
        and variants["ngram"][1].pass_costs == variants["hybrid"][1].pass_costs
    )
    assert variants["chain"][1].pass_costs == ()
    proposer, limits = engine_proposer("ngram", None, variants["ngram"][1])
    assert isinstance(proposer, HybridProposer) and proposer.drafter is None and limits == (3, 1, 3)
    lookup, _ = engine_proposer("ngram", None, replace(settings, admission="all"))
    assert isinstance(lookup, NgramProposer)


ENGINE_STAND_IN = (
    LLAMA_STAND_IN_PREAMBLE
    + """\
spec = args[args.index("--spec-type") + 1] if "--spec-type" in args else "none"
# prompts answered with a known answer (eaglet's plain greedy); every other prompt gets the formula below
ANSWERS = {tuple(p): a for p, a in json.loads(os.environ.get("STAND_IN_ANSWERS", "[]"))}
with open(os.environ["STAND_IN_RUNS"], "a") as f:
    f.write(json.dumps({"pid": os.getpid(), "spec": spec, "argv": args[1:]}) + "\\n")
# per request: drafts, accepted at position 0, at position 1; and ms per token
PER = {"draft-eagle3": (4, 3, 1), "ngram-simple": (2, 1, 0), "none": (0, 0, 0)}[spec]
MS = {"draft-eagle3": 5.0, "ngram-simple": 8.0, "none": 10.0}[spec]
counts = [0, 0, 0]
class H(Replies):
    def do_GET(self):
        if self.path != "/metrics":
            return self.reply({"status": "ok"})
        text = ""
        if counts[0]:
            text = (f"llamacpp:spec_decode_num_drafts_total {counts[0]}\\n"
                    f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {counts[1]}\\n'
                    f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="1"}} {counts[2]}\\n')
        self.reply(text.encode(), "text/plain")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n, prompt = body["n_predict"], body["prompt"]
        for i, c in enumerate(PER):
            counts[i] += c
        timings = {"prompt_n": len(prompt), "prompt_ms": 0.0, "predicted_n": n, "predicted_ms": MS * n}
        if PER[0]:
            timings.update(draft_n=2 * PER[0], draft_n_accepted=PER[1] + PER[2])
        tokens = ANSWERS.get(tuple(prompt)) or [20 + (sum(prompt) + 3 * i) % 300 for i in range(n)]
        self.reply({"tokens": tokens, "stop_type": "limit", "timings": timings})
HTTPServer(("127.0.0.1", port), H).serve_forever()
"""
)


def greedy_answer(folder, text: str, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """A one-turn chat's prompt ids and Hugging Face generate's greedy answer to it in fp32: plain
    greedy's answer, found without eaglet's decoding loop."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = chat_prompt_ids(AutoTokenizer.from_pretrained(folder), [{"role": "user", "content": text}])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False)
    return ids, out[0, len(ids) :].tolist()


def test_eval_runs_llama_cpp_methods_beside_eaglets(
    tiny_target, drafter_ckpt, tmp_path, one_thread, monkeypatch, caplog
):
    """llama.cpp's methods through stand-in llama-servers (one per method, exported drafter
    passed to draft-eagle3): speedups over llama.cpp plain, acceptance from the counters, the
    first-draft line beside eaglet's chain (implied), loud on a gap; every server stopped. llama.cpp
    plain answers prompt x with plain greedy's own answer and y with another: half its outputs equal
    eaglet's plain greedy, prompt by prompt."""
    import os

    runs = tmp_path / "runs.jsonl"
    llama_server_stand_in(tmp_path, ENGINE_STAND_IN, monkeypatch)
    monkeypatch.setenv("STAND_IN_RUNS", str(runs))
    x_ids, x_answer = greedy_answer(tiny_target, "Add two numbers.", 6)
    assert len(x_answer) == 6  # no early stop: the stand-in's timings count 6 tokens a turn
    monkeypatch.setenv("STAND_IN_ANSWERS", json.dumps([[x_ids, x_answer]]))
    gguf = target_gguf(tmp_path / "target.gguf", 400, tokenizer=tiny_target)
    prompts = write_jsonl(
        tmp_path / "prompts.jsonl", [{"id": "x", "prompt": "Add two numbers."}, {"id": "y", "prompt": "Say hello."}]
    )
    out = tmp_path / "eval"
    result = evaluate(
        EvalOptions(
            drafter_path=drafter_ckpt,
            target=str(tiny_target),
            prompt_sets=[str(prompts)],
            methods=["llama.cpp-eagle3", "llama.cpp-ngram"],
            max_new_tokens=6,
            chain_depth=3,
            dtype="fp32",
            device="cpu",
            out=out,
            target_gguf=gguf,
        ),
        progress=False,
    )
    r = result.sets["prompts"]
    assert list(r) == ["plain", "chain", "llama.cpp", "llama.cpp-eagle3", "llama.cpp-ngram"]
    eagle3, ngram = r["llama.cpp-eagle3"], r["llama.cpp-ngram"]
    assert eagle3["speedup_over"] == ngram["speedup_over"] == "llama.cpp" and "speedup_over" not in r["llama.cpp"]
    assert eagle3["speedup"] == 2.0 and ngram["speedup"] == 1.25  # 10 vs 5 and 8 ms a token
    assert eagle3["acceptance_rates"] == [0.75, round(1 / 3, 4)] and ngram["acceptance_rates"] == [0.5, 0.0]
    assert eagle3["tau"] == round(12 / (12 - 8), 4)  # 6 tokens a turn, 4 accepted: 2 passes a turn
    assert eagle3["identical_share"] == 1.0 and r["llama.cpp"]["identical_share"] == 0.5
    assert [p["methods"]["llama.cpp"]["identical"] for p in result.prompts] == [True, False]
    assert eagle3["eaglet_first_acceptance"] == r["chain"]["acceptance_rates"][0]
    assert eagle3["first_acceptance_gap"] == round(0.75 - r["chain"]["acceptance_rates"][0], 4)
    assert "llama.cpp-eagle3 first-draft acceptance 0.750 vs eaglet's chain" in result.table()
    if abs(eagle3["first_acceptance_gap"]) > 0.05:  # a random drafter: eaglet's chain accepts little
        assert "MISMATCH" in result.table() and "beyond 0.05" in caplog.text
    started = [json.loads(line) for line in runs.read_text().splitlines()]
    assert sorted(s["spec"] for s in started) == ["draft-eagle3", "ngram-simple", "none"]
    eagle3_argv = next(s["argv"] for s in started if s["spec"] == "draft-eagle3")
    assert eagle3_argv[eagle3_argv.index("-md") + 1] == str(out / "drafter.gguf") and (out / "drafter.gguf").is_file()
    assert eagle3_argv[eagle3_argv.index("--spec-draft-n-max") + 1] == "3"
    config = formats.read_json(out / "eval.json")["config"]["llama_cpp"]
    assert config["server"] == "version: 0 (stand-in)" and config["target_gguf"] == str(gguf)
    for s in started:  # all stopped
        with pytest.raises(ProcessLookupError):
            os.kill(s["pid"], 0)


def test_llama_cpp_methods_need_the_target_gguf(tiny_target, drafter_ckpt, tmp_path, one_thread, monkeypatch):
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\nexit 1\n")
    exe.chmod(0o755)
    monkeypatch.setenv("EAGLET_LLAMA_SERVER", str(exe))
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "Hi"}])
    with pytest.raises(ValueError, match="not the embedded one; pass --target-gguf"):
        evaluate(
            EvalOptions(
                drafter_path=drafter_ckpt,
                target=str(tiny_target),
                prompt_sets=[str(prompts)],
                methods=["llama.cpp"],
                dtype="fp32",
                device="cpu",
            ),
            progress=False,
        )


def test_gap_verdict_tells_quantization_from_a_mismatch():
    assert gap_verdict({"first_acceptance_gap": -0.03, "engine_target_weights": "Q4_1"}) == "within 0.05"
    assert "Q4_1" in gap_verdict({"first_acceptance_gap": -0.26, "engine_target_weights": "Q4_1"})
    assert "--engine-f32" in gap_verdict({"first_acceptance_gap": -0.26, "engine_target_weights": "Q4_1"})
    for weights in ("F32", "BF16", None):
        assert gap_verdict({"first_acceptance_gap": 0.2, "engine_target_weights": weights}).startswith("MISMATCH")
    floored = gap_verdict({"first_acceptance_gap": -0.09, "engine_target_weights": "F32", "min_draft_prob": 0.35})
    assert "--min-draft-prob 0.35" in floored and "renormalised" in floored and "MISMATCH" not in floored


# ---------------------------------------------------------------------------------------------
# Each method at its fastest configuration (--dtype auto --threads auto)
# ---------------------------------------------------------------------------------------------


def test_tuning_picks_per_method_the_configuration_cheapest_for_its_pass():
    from eaglet.evaluate.settings import DecodeSettings
    from eaglet.evaluate.tuning import Config, candidates, choose, verify_tokens

    one, two = Config("bf16", 1), Config("fp32", 2)
    # a one-token pass is cheapest on one thread, a four-token pass on two
    costs = {one: [1.0, 1.9, 2.8, 3.7, 4.6], two: [1.2, 1.4, 1.6, 1.8, 2.0]}
    s = DecodeSettings(chain_depth=3, lookup_tokens=2, hybrid_chain_depth=1)
    chosen = choose(
        {"plain": ("plain", s), "chain": ("chain", s), "hybrid": ("hybrid", s), "llama.cpp": ("llama.cpp", s)},
        costs,
        None,
    )
    assert chosen == {"plain": one, "chain": two, "hybrid": two}  # llama.cpp's servers keep their own
    assert verify_tokens("plain", s, None) == 1 and verify_tokens("chain", s, None) == 4
    assert verify_tokens("hybrid", s, None) == 4 and verify_tokens("prompt-lookup", s, None) == 11
    assert candidates("fp32", 1, "cpu") == [Config("fp32", 1)]
    assert {c.dtype for c in candidates("auto", 1, "cpu")} == {"bf16", "fp32"}
    assert candidates("auto", "auto", "cuda") == [Config("bf16", None)]
    assert {c.threads for c in candidates("fp32", "auto", "cpu")} == {1, os.cpu_count() or 1}


def test_eval_auto_runs_each_method_at_a_measured_configuration(tiny_target, drafter_ckpt, tmp_path):
    """Which configuration wins is this machine's business; that every method ran at one of the
    timed ones, said in the table and eval.json, is not."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": "x", "prompt": "Write a function."}])
    result = evaluate(
        EvalOptions(
            drafter_path=drafter_ckpt,
            target=str(tiny_target),
            prompt_sets=[str(prompts)],
            methods=["chain", "hybrid"],
            max_new_tokens=6,
            chain_depth=2,
            device="cpu",
            out=tmp_path / "eval",
        ),
        progress=False,
    )
    timed = result.config["pass_costs_by_config_s"]
    assert {label.split("/")[0] for label in timed} == {"bf16", "fp32"}
    assert set(result.config["configs"]) == {"plain", "chain", "hybrid"}
    assert all(c in timed for c in result.config["configs"].values())
    r = result.sets["prompts"]
    assert all(r[m]["config"] == result.config["configs"][m] for m in r)
    assert "config" in result.table().splitlines()[0]


def test_a_prompts_file_with_a_bom_is_read(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "hello"}\n')
    assert [p.turns for p in load_prompt_set(str(path), None)] == [["hello"]]


def test_prompt_files_are_checked_before_any_model_loads(tmp_path):
    """Two files both named p.jsonl had their results merged under one set; a turn of null was
    decoded as the text "None"; a content that was no string failed after the target loaded."""
    from eaglet.evaluate import prompt_sets_by_name

    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "p.jsonl").write_text('{"prompt": "hi"}\n')
    with pytest.raises(ValueError, match=r"--prompts .*a/p.jsonl and .*b/p.jsonl: both sets are named 'p'"):
        prompt_sets_by_name([str(tmp_path / "a" / "p.jsonl"), str(tmp_path / "b" / "p.jsonl")], None)
    for line, said in (
        ('{"turns": [null, "x"]}', "field 'turns': every turn is a non-empty string"),
        ('{"messages": [{"role": "user", "content": 42}]}', "a 'content' string"),
        ('{"messages": [{"role": "wizard", "content": "x"}, {"role": "user", "content": "y"}]}', "needs a 'role'"),
        ('{"prompt": ""}', "field 'prompt' is empty"),  # as an empty turn: nothing to answer
        ('{"prompt": " \\n\\t "}', "field 'prompt' is empty"),
        ('{"turns": ["hi", "  "]}', "field 'turns': every turn is a non-empty string"),
        ('{"messages": [{"role": "user", "content": ""}]}', "the last message must be the user's, and not empty"),
        # a lone surrogate: a raw TypeError from the tokenizer, no file named
        ('{"prompt": "Hi \\ud800 there"}', "holds a lone surrogate"),
        (
            '{"messages": [{"role": "system", "content": "\\udc00"}, {"role": "user", "content": "y"}]}',
            "holds a lone surrogate",
        ),
    ):
        (tmp_path / "odd.jsonl").write_text(line + "\n")
        with pytest.raises(ValueError, match=rf"odd.jsonl:1: .*{said}"):
            prompt_sets_by_name([str(tmp_path / "odd.jsonl")], None)


def test_eval_refuses_a_drafter_whose_embeddings_are_not_the_targets(tiny_target, drafter_ckpt, tmp_path):
    """A checkpoint whose (frozen) embeddings were replaced was measured as if it were the target's
    drafter: refused, and measured only when asked with --other-target."""
    import shutil

    from safetensors.torch import save_file

    ckpt = tmp_path / "ckpt"
    shutil.copytree(drafter_ckpt, ckpt)
    weights = formats.read_safetensors(ckpt / formats.DRAFTER_WEIGHTS_FILE)
    weights["embed_tokens.weight"] = torch.randn_like(weights["embed_tokens.weight"])
    save_file(weights, str(ckpt / formats.DRAFTER_WEIGHTS_FILE))
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": "x", "prompt": "Hello"}])
    options = EvalOptions(
        drafter_path=ckpt,
        target=str(tiny_target),
        prompt_sets=[str(prompts)],
        methods=["chain"],
        max_new_tokens=4,
        dtype="fp32",
        device="cpu",
        plot=False,
    )
    with pytest.raises(ValueError, match=r"its embed_tokens\.weight is not the target's embeddings .*--other-target"):
        evaluate(options, progress=False)
    assert evaluate(replace(options, other_target=True), progress=False).sets["prompts"]["chain"]["turns"] == 1
