"""A draft folder's files and model card, and reading back how an earlier draft was made."""
from __future__ import annotations

import json
import subprocess
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

from lssp.distill.collection import REPEAT_CUE, REPEAT_WINDOW
from lssp.distill.config import DistillReport
from lssp.models.draft_head import subset_head
from lssp.models.eagle import FeatureHead, save_feature_head
from lssp.models.eagle3 import AUX_KEY, Eagle3Head, save_eagle3_head


def write_draft(draft: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, out: Path, report: DistillReport,
                command: str) -> None:
    """safetensors weights in bf16, the tokenizer, and a model card with how it was made."""
    draft.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "distill_report.json").write_text(json.dumps(asdict(report), indent=1))
    head = subset_head(draft)
    output_layer = (f"an output layer over the target's {len(head.token_ids)} most frequent tokens, "
                    f"{report.head_coverage:.1%} of the target tokens it was trained on (the others are never proposed), "
                    f"and a {draft.config.vocab_size}-token input embedding" if head else
                    f"tied {draft.config.vocab_size}-token embedding")
    lineage = _lineage(report)
    written_by = (f"{report.data_tokens - report.draft_written_tokens} written by the target and {report.draft_written_tokens} "
                 f"by the starting draft (on-policy, scored by the target in one forward per batch)," if report.draft_written_tokens
                 else "all written by the target,")
    if report.repeat_tokens:
        written_by += (f" {report.repeat_tokens} of them the target's continuations of contexts that end by repeating"
                      f" {REPEAT_CUE} tokens of the {REPEAT_WINDOW} before (to teach the draft to copy),")
    (out / "README.md").write_text(f"""# Draft for {report.target}, made by `llamassp distill`

A {draft.config.num_hidden_layers}-layer Llama (hidden {draft.config.hidden_size}, {report.parameters / 1e6:.1f}M parameters,
{output_layer}) sharing {report.target}'s tokenizer. Weights in bfloat16.

Made with: `{command}`

- data: {report.data_tokens} tokens of continuations (collected in {report.collect_seconds / 60:.1f} min), {written_by}
  with the target's top-{report.config['top_k_saved']} log-probabilities at every position
- training: {report.steps} steps in {report.train_seconds / 60:.1f} min{_in(report)}; loss = soft cross-entropy to the target's
  top-k distribution + {report.config['hard_weight']} x cross-entropy on the target's argmax; final loss {report.final_loss:.3f}
- {_prompts_line(report)}
{lineage}
{_curves(report)}""")


def _lineage(report: DistillReport) -> str:
    """One line per earlier training the weights went on from, latest first."""
    lineage, earlier = "", report.started_from
    while earlier:
        at_commit = f" as of commit {earlier['commit']}" if earlier.get("commit") else ""
        lineage += (f"- started from the weights of `{earlier['path']}`{at_commit}, which had been trained {earlier.get('steps')} steps "
                    f"({(earlier.get('train_seconds') or 0) / 60:.1f} min) on {earlier.get('data_tokens')} target tokens"
                    f" ({(earlier.get('collect_seconds') or 0) / 60:.1f} min of collection)"
                    + (f" by `{earlier['command']}`" if earlier.get("command") else "") + "\n")
        earlier = earlier.get("started_from") or {}
    return lineage


def distinct_tokens(report: dict | DistillReport) -> int:
    """Target-written tokens a training read, its own collection's and its --also-data's (not its predecessors'), but
    those written again from token ids (``--tokens-from``: text a collection held before, counted where it was
    first collected)."""
    get = report.get if isinstance(report, dict) else lambda key, default=None: getattr(report, key, default)
    others = get("also_data") or []
    return (int(get("data_tokens") or 0) - int(get("rebuilt_tokens") or 0)
            + sum(int(c.get("tokens", 0)) - int(c.get("rebuilt_tokens", 0)) for c in others))


def learning_curve(report: DistillReport) -> str:
    """Held-out agreement against the target-written tokens trained on so far, over this training and the ones it went
    on from (each measured on its own collection's held-out answers; a row per training's start and end)."""
    chain, earlier = [], report.started_from
    while earlier:
        chain.append(earlier)
        earlier = earlier.get("started_from") or {}
    rows, total = [], 0
    for done in reversed(chain):
        total += int(done.get("distinct_tokens") or done.get("data_tokens") or 0)
        final = f"{done['agreement_curve'][-1][2]:.3f} (its own held-out answers)" if done.get("agreement_curve") else "-"
        rows.append(f"| `{done['path']}` | {total} | {final} |")
    curve = report.agreement_curve
    if curve:
        rows.append(f"| this training, before its first step | {total} | {curve[0][2]:.3f} |")
        rows.append(f"| this training, at its end | {total + distinct_tokens(report)} | {curve[-1][2]:.3f} |")
    return ("| training | distinct target-written tokens trained on so far | held-out top-1 agreement |\n|---|---|---|\n"
            + "\n".join(rows) + "\n") if chain and curve else ""


PROMPTS = {
    "sharegpt": "ShareGPT conversations up to a human turn, in the target's chat template "
                "(`lssp/distill/conversations.py`); none of the first 1,000 of the `--task sharegpt` draw",
    "built-in": "written by `lssp/distill/data.py`",
    "documents": "ShareGPT answers to summarize, answer questions from, translate or rewrite "
                 "(`lssp/distill/documents.py`); none of the first 1,000 of the `--task sharegpt` draw",
}


def _prompts_line(report: DistillReport) -> str:
    """Where the card's prompts came from, and the other collections it was trained on."""
    sources = dict.fromkeys([report.config.get("source", "built-in")] + [c["source"] for c in report.also_data])
    described = "; ".join(PROMPTS[s] for s in sources if s in PROMPTS)
    line = f"prompts: {described}; none of the `latency`, `compare` or `eval` prompts"
    for c in report.also_data:
        line += (f"\n- also trained on the {c['tokens']} tokens of the collection in `{c['path']}` ({c['source']} prompts, "
                 f"{c['seconds'] / 60:.1f} min of collection)")
    return line


def _collected(report: DistillReport) -> str:
    """How the collection came to be: collected, or (some of it) written again from token ids."""
    minutes = f"{report.collect_seconds / 60:.1f} min"
    if not report.rebuilt_tokens:
        return f"collected in {minutes}"
    return (f"{report.rebuilt_tokens} of them written again from a collection's token ids by teacher forcing "
            f"(`--tokens-from`, text the target wrote before); {minutes} in all")


def _in(report: DistillReport) -> str:
    return " in bf16 (autocast, fp32 weights)" if report.precision == "bf16" else " in fp32" if report.precision else ""


def _curves(report: DistillReport) -> str:
    """The card's measured acceptance, loss curve and held-out agreement curve."""
    curve = "\n".join(f"| {s} | {t} | {loss:.3f} |" for s, t, loss in report.loss_curve[:: max(1, len(report.loss_curve) // 12)])
    accept = "\n".join(f"| {k} | {v:.3f} |" for k, v in report.acceptance.items())
    agreement = "\n".join(f"| {s} | {t} | {a:.3f} |" for s, t, a in report.agreement_curve)
    return f"""## Measured acceptance (greedy, held-out prompts)
| prompts | acceptance rate |
|---|---|
{accept}

## Loss curve
| step | target tokens seen | loss |
|---|---|---|
{curve}

## Held-out top-1 agreement (teacher-forced, a proxy for greedy acceptance)
| step | target tokens seen | agreement |
|---|---|---|
{agreement}
"""


def write_head(head: FeatureHead, tokenizer: PreTrainedTokenizerBase, out: Path, report: DistillReport,
               command: str) -> None:
    """A feature head in EAGLE's layout (bf16 safetensors and config.json, readable by vLLM's ``eagle``), its
    report and a model card. No tokenizer, embeddings or output layer: the target's are used."""
    from lssp.distill.head_training import FEATURE_NOISE, REGRESSION_WEIGHT, STEP_DECAY

    save_feature_head(head, out)
    (out / "distill_report.json").write_text(json.dumps(asdict(report), indent=1))
    c = head.config
    ids = head.token_ids
    unroll = report.config.get("unroll", 2)
    curve = learning_curve(report)
    learning = f"## Learning curve across trainings\n{curve}\n" if curve else ""
    output = (f"the target's output rows for its {len(ids)} most frequent tokens, {report.head_coverage:.1%} of the "
              "tokens it was trained on (the others are never proposed)" if ids else "the target's whole output layer")
    taps = head.feature_layers
    feature = (f"`fuse` ({(len(taps) + 1) * c.hidden_size} -> {c.hidden_size}) over the target's hidden states after its layers "
               f"{', '.join(map(str, taps))} (each RMS-normalized) and its final hidden state at t (EAGLE-3's fused "
               "features; the head's guesses stand in for that while drafting)"
               if taps else "the target's final hidden state at t")
    layout = ("EAGLE's layout plus `fuse` and `feature_layers` in config.json (ours: vLLM's and llama.cpp's EAGLE "
              "methods do not load it)" if taps else "EAGLE's published layout")
    (out / "README.md").write_text(f"""# Feature head (EAGLE) for {report.target}, made by `llamassp distill --kind eagle`

{c.num_hidden_layers} Llama decoder layer(s) at the target's width ({c.hidden_size}; {c.num_attention_heads} heads,
{c.num_key_value_heads} key/value heads, MLP {c.intermediate_size}) behind `fc` ({2 * c.hidden_size} -> {c.hidden_size}) over
the embedding of token t+1 and {feature}, {report.parameters / 1e6:.1f}M parameters in bfloat16.
It reads {report.target}'s input embeddings and, through {output}, turns its guess of the next feature into
logits. The files follow {layout} (`fc`, `layers.0` without input norm, no final norm).

Made with: `{command}`

- data: {report.data_tokens} tokens of continuations written by the target ({_collected(report)}),
  with its {"hidden states after layers " + ", ".join(map(str, taps)) + " and its final ones" if taps else "final hidden states"} at every position (prompt and continuation)
- training: {report.steps} steps in {report.train_seconds / 60:.1f} min{_in(report)}; loss = cross-entropy to the target's distribution over
  the head's tokens + {REGRESSION_WEIGHT} x smooth-L1 to the target's next feature, on the features (with uniform noise of
  {FEATURE_NOISE} x their RMS) and on the head's own guesses over {unroll} drafting steps (the training-time test: each
  step attends as a draft does; step s weighs {STEP_DECAY}^s); final loss {report.final_loss:.3f}
- {_prompts_line(report)}
{_lineage(report)}
{learning}{_curves(report)}""")


def write_eagle3_head(head: Eagle3Head, tokenizer: PreTrainedTokenizerBase, out: Path, report: DistillReport,
                      command: str) -> None:
    """An EAGLE-3 head in its published layout (vLLM's ``eagle3`` and llama.cpp's converter read it), its report and
    a model card."""
    from lssp.distill.head_training import STEP_DECAY

    save_eagle3_head(head, out)
    (out / "distill_report.json").write_text(json.dumps(asdict(report), indent=1))
    c, vocab = head.config, len(head.d2t)
    layers = ", ".join(map(str, head.aux_ids))
    curve = learning_curve(report)
    learning = f"## Learning curve across trainings\n{curve}\n" if curve else ""
    (out / "README.md").write_text(f"""# EAGLE-3 head for {report.target}, made by `llamassp distill --kind eagle3`

One decoder layer at the target's width ({c.hidden_size}; {c.num_attention_heads} heads, {c.num_key_value_heads} key/value heads,
MLP {c.intermediate_size}) whose attention reads the embedding of token t+1 and `fc` ({len(head.aux_ids) * c.hidden_size} -> {c.hidden_size}) over the
target's hidden states entering its layers {layers} at t (EAGLE-3's fused features), each normalized; its own `norm` and
`lm_head` over a draft vocabulary of {vocab} tokens ({report.head_coverage:.1%} of the tokens it was trained on; `d2t` maps
them to the target's), {report.parameters / 1e6:.1f}M parameters in bfloat16 with the target's embeddings. The files follow
the published layout (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`; `eagle_config.{AUX_KEY}`).

Made with: `{command}`

- data: {report.data_tokens} tokens of continuations written by the target ({_collected(report)}), with its hidden
  states after layers {", ".join(str(i - 1) for i in head.aux_ids)} and its final ones at every position
- training: {report.steps} steps in {report.train_seconds / 60:.1f} min{_in(report)}; loss = cross-entropy to the target's distribution
  over the draft vocabulary, on the fused features and on the head's own outputs over {report.config.get("unroll", 2)} drafting steps (the
  training-time test; step s weighs {STEP_DECAY}^s); final loss {report.final_loss:.3f}
- {_prompts_line(report)}
{_lineage(report)}
{learning}{_curves(report)}""")

def earlier_training(folder: str | Path) -> dict:
    """What a draft folder's own card says of how it was made: its report and command, where present."""
    folder = Path(folder)
    found: dict = {"path": str(folder)}
    try:  # a draft kept in git: the last commit that changed it names these exact weights
        log = subprocess.run(["git", "log", "-1", "--format=%h", "--", "."], cwd=folder, capture_output=True, text=True, timeout=5)
        if log.returncode == 0 and log.stdout.strip():
            found["commit"] = log.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    report = folder / "distill_report.json"
    if report.exists():
        earlier = json.loads(report.read_text())
        found.update({key: earlier.get(key) for key in ("data_tokens", "collect_seconds", "steps", "train_seconds",
                                                        "agreement_curve")})
        found["distinct_tokens"] = distinct_tokens(earlier)
        found["started_from"] = earlier.get("started_from") or {}
    card = folder / "README.md"
    if card.exists():
        made_with = [line for line in card.read_text().splitlines() if line.startswith("Made with:")]
        if made_with:
            found["command"] = made_with[0].removeprefix("Made with:").strip().strip("`")
    return found
