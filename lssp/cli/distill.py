"""`distill`: make a small Llama draft for a target from the target's own continuations."""
from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from lssp.cli.app import app, settings
from lssp.cli.loaders import load
from lssp.cli.options import TargetArg, check_positive
from lssp.cli.output import console, err_console, exit_interrupted
from lssp.cli.progress import phase_progress
from lssp.errors import UserError

if TYPE_CHECKING:
    import torch

    from lssp.cli.app import Settings
    from lssp.distill.config import DistillConfig, DistillReport
    from lssp.models.loading import LoadedModel


FEATURE_LAYERS_HELP = ("--kind eagle: the head also reads the target's hidden states after these layers (comma-separated, "
                       "e.g. 2,15: EAGLE-3's fused features); by default those --init-draft's head reads, else none. "
                       "--kind eagle3: the three layers (default: after 1, L/2-1 and L-4, the states vLLM gives).")


@app.command()
def distill(
    ctx: typer.Context,
    target: TargetArg = None,
    out: Annotated[Path, typer.Option(help="Output folder for the draft (and its checkpoints).")] = Path("drafts/draft"),
    kind: Annotated[str, typer.Option(help="draft: a small Llama; eagle: a feature head (EAGLE) over the target's "
                                      "final hidden states, at the target's width; eagle3: an EAGLE-3 head (three "
                                      "target layers, its own output layer) in the layout vLLM and llama.cpp "
                                      "load.")] = "draft",
    hidden_size: Annotated[int, typer.Option(help="Draft width (--kind draft).")] = 256,
    layers: Annotated[Optional[int], typer.Option(help="Decoder layers (default: 4 for a draft, 1 for a head); with --init-draft, a head with fewer "
                                             "grows to this many, the new layers starting as the identity.")] = None,
    heads: Annotated[int, typer.Option(help="Attention heads.")] = 4,
    intermediate_size: Annotated[int, typer.Option(help="MLP width.")] = 768,
    data_tokens: Annotated[int, typer.Option(help="Target tokens to collect.")] = 100_000,
    batch_prompts: Annotated[int, typer.Option(help="Prompts generated together.")] = 16,
    new_tokens: Annotated[int, typer.Option(help="Tokens the target generates per prompt.")] = 96,
    train_minutes: Annotated[float, typer.Option(help="Training time budget.")] = 10.0,
    max_steps: Annotated[int, typer.Option(help="Stop after this many steps (0: time budget only).")] = 0,
    epochs: Annotated[float, typer.Option(help="Passes over the data at most.")] = 4.0,
    lr: Annotated[float, typer.Option(help="Peak learning rate.")] = 3e-3,
    hard_weight: Annotated[float, typer.Option(help="Weight of cross-entropy on the target's argmax (rest: soft top-k).")] = 0.3,
    data_dir: Annotated[Optional[Path], typer.Option(help="Where collected data and checkpoints go (default: OUT/work).")] = None,
    init_draft: Annotated[Optional[Path], typer.Option(help="Go on training this draft (or, with --kind eagle, this head) on the "
                                                               "collection: its shape wins over the size options, but --layers deepens a head.")] = None,
    head_tokens: Annotated[int, typer.Option(help="Output layer over the target's N most frequent tokens only (0: all).")] = 0,
    on_policy: Annotated[float, typer.Option(help="Share of newly collected shards written by --init-draft and scored by "
                                             "the target in one teacher-forced forward (on-policy data).")] = 0.0,
    repeat_share: Annotated[float, typer.Option(help="Share of newly collected shards the target continues from "
                                                "contexts that repeat a cue of earlier text (teaches the draft to copy).")] = 0.0,
    source: Annotated[str, typer.Option(help="Prompts the target answers: built-in (written for lssp), sharegpt "
                                        "(real conversations' human turns, in the chat template; ./setup.sh installs "
                                        "them) or documents (ShareGPT's answers to summarize, answer from, translate "
                                        "or rewrite).")] = "built-in",
    max_prompt_tokens: Annotated[int, typer.Option(help="--source sharegpt or documents: leave out longer "
                                                   "contexts.")] = 384,
    max_seq_len: Annotated[int, typer.Option(help="Training sequences: the answer and as much of its context as "
                                             "fits.")] = 160,
    precision: Annotated[str, typer.Option(help="Training's arithmetic: bf16 (autocast; weights stay fp32), fp32, or "
                                           "auto: bf16 where the GPU or CPU computes it natively.")] = "auto",
    also_data: Annotated[Optional[list[Path]], typer.Option(help="Also train on the collection in this folder (an "
                                                            "earlier --data-dir for the same target, only read; "
                                                            "repeatable).")] = None,
    unroll: Annotated[int, typer.Option(help="--kind eagle: drafting steps the head is trained on, each fed its own "
                                        "guesses and attending as a draft does (EAGLE-3's training-time test; the "
                                        "loss of step s weighs 0.8^s).")] = 2,
    feature_layers: Annotated[str, typer.Option(help=FEATURE_LAYERS_HELP)] = "",
    tokens_from: Annotated[Optional[Path], typer.Option(help="Write the collection's first shards again from the "
                                                       "token ids in this file (a collection's data/tokens.npz: "
                                                       "teacher forcing, no generation), then go on collecting.")] = None,
    collect_only: Annotated[bool, typer.Option("--collect-only", help="Collect --data-tokens into --data-dir and "
                                               "stop (a long collection, resumed by the same command; train later "
                                               "with the same --data-dir).")] = False,
) -> None:
    """Make a small Llama draft for TARGET from its own continuations (resumable)."""
    from lssp import distill as dst

    s = settings(ctx)
    layers = layers if layers is not None else 4 if kind == "draft" else 1
    cfg = dst.DistillConfig(kind=kind, hidden_size=hidden_size, layers=layers, heads=heads, intermediate_size=intermediate_size,
                            data_tokens=data_tokens, batch_prompts=batch_prompts, new_tokens=new_tokens,
                            train_minutes=train_minutes, max_steps=max_steps, epochs=epochs, lr=lr,
                            hard_weight=hard_weight, seed=s.seed, init_from=str(init_draft) if init_draft else None,
                            head_tokens=head_tokens, on_policy=on_policy, repeat_share=repeat_share, source=source,
                            max_prompt_tokens=max_prompt_tokens, max_seq_len=max_seq_len, precision=precision,
                            also_data=tuple(str(folder) for folder in also_data or ()), unroll=unroll,
                            feature_layers=_feature_layers(feature_layers, kind, init_draft))
    _check(cfg)
    work = data_dir or out / "work"
    others = _other_collections(cfg, work)
    t = load(s, s.registry.target_name(target))
    if cfg.kind == "eagle3" and not cfg.feature_layers:  # vLLM's default layers for the target
        cfg.feature_layers = dst.default_taps(t.hf_model)
    if t.tokenizer is None:
        raise UserError(f"model {t.name!r} has no tokenizer to share with a draft")
    work.mkdir(parents=True, exist_ok=True)
    rep = dst.DistillReport(target=t.name, config=asdict(cfg), also_data=others)
    if init_draft:
        rep.started_from = dst.earlier_training(init_draft)
    try:
        model = _collect_and_train(s, t, work, cfg, rep, collect_only, tokens_from)
    except KeyboardInterrupt:
        exit_interrupted(f"interrupted: what was collected and trained so far is kept in {work}; "
                         "the same command goes on from there")
    if model is None:  # --collect-only
        return
    _write(s, t, model, out, rep, kind)


def _write(s: Settings, t: LoadedModel, model: torch.nn.Module, out: Path, rep: DistillReport, kind: str) -> None:
    """The draft's files and card, its greedy acceptance on held-out prompts measured through the real loader (what
    the card promises), and one line saying so."""
    from lssp import distill as dst

    rep.parameters = sum(p.numel() for p in model.parameters())
    command = "python llamassp.py " + " ".join(sys.argv[1:]) if sys.argv and "llamassp" in sys.argv[0] else "llamassp distill …"
    write = {"eagle": dst.write_head, "eagle3": dst.write_eagle3_head}.get(kind, dst.write_draft)
    write(model, t.tokenizer, out, rep, command)
    with err_console.status("Measuring acceptance on held-out prompts…"):
        rep.acceptance.update(dst.held_out_acceptance(t, out, s.seed, s.device))
    write(model, t.tokenizer, out, rep, command)
    what = {"eagle": "Feature head", "eagle3": "EAGLE-3 head"}.get(kind, "Draft")
    console.print(f"{what} written to {out}: {rep.parameters / 1e6:.1f}M "
                  f"parameters, {rep.data_tokens} data tokens, {rep.steps} steps, final loss {rep.final_loss:.3f}, "
                  f"greedy acceptance {rep.acceptance[dst.HELD_OUT_ACCEPTANCE]:.1%}")

def _collector(s: Settings, t: LoadedModel) -> torch.nn.Module:
    """The forward collection runs: the target itself, or a copy of it in a form that runs batches faster."""
    from lssp import distill as dst
    from lssp.models.loading import load_model
    from lssp.models.modules import model_device

    faster = dst.collection_spec(s.registry.get(t.name), model_device(t.hf_model))
    if faster is None:
        return dst.collection_model(t.model)
    with err_console.status(f"Loading {t.name} for collection ({faster.dtype}, plain weights)…"):
        return dst.collection_model(load_model(faster, s.device).model)


def _collect_and_train(s: Settings, t: LoadedModel, work: Path, cfg: DistillConfig, rep: DistillReport,
                       collect_only: bool, tokens_from: Path | None = None) -> torch.nn.Module | None:
    """Collect into ``work`` (first its shards from ``tokens_from``'s token ids), keep the collection's token ids
    in ``work/data/tokens.npz``, then train there (None after --collect-only)."""
    from lssp import distill as dst
    from lssp.distill.tokens import rebuild_shards, save_tokens
    from lssp.models.eagle import check_feature_layers
    from lssp.models.modules import model_device

    with phase_progress() as progress:
        # Collection runs the target under the compact forward where it can (faster, and it gives the features a
        # head learns from); training reads the transformers model's weights.
        writer = dst.load_initial_draft(t.hf_model, cfg).to(model_device(t.hf_model)).eval() if cfg.on_policy else None
        collector = _collector(s, t)
        if cfg.kind in ("eagle", "eagle3"):
            check_feature_layers(collector, cfg.feature_layers)
            collector.feature_layers = cfg.feature_layers
        if tokens_from:
            rebuild_shards(collector, tokens_from, work / "data", progress, cfg.data_tokens, cfg.source)
        got = dst.collect(collector, t.tokenizer, work, cfg, progress, draft=writer,
                          notice=lambda line: err_console.print(f"[yellow]{line}[/yellow]"))
        save_tokens(work / "data")
        rep.data_tokens, rep.collect_seconds, rep.rebuilt_tokens = got.tokens, got.seconds, got.rebuilt_tokens
        rep.draft_written_tokens, rep.repeat_tokens = got.draft_tokens, got.repeat_tokens
        if collect_only:
            console.print(f"Collected {got.tokens} target-written tokens (and {got.held_out_tokens} held out) in "
                          f"{work / 'data'}: {got.seconds / 3600:.2f} h of collection, "
                          f"{(got.tokens + got.held_out_tokens) / max(got.seconds, 1e-9):.0f} tokens/s")
            return None
        train = {"eagle": dst.train_head, "eagle3": dst.train_eagle3_head}.get(cfg.kind, dst.train)
        model = train(t.hf_model, work, cfg, rep, progress)
    return model


def _other_collections(cfg: DistillConfig, work: Path) -> list[dict]:
    """What each --also-data collection holds (``collection_summary``); the --data-dir itself is refused."""
    from lssp import distill as dst

    if any(Path(folder).resolve() == work.resolve() for folder in cfg.also_data):
        raise UserError(f"--also-data {work}: that is the --data-dir itself")
    return [dst.collection_summary(Path(folder)) for folder in cfg.also_data]


def _feature_layers(given: str, kind: str, init_draft: Path | None) -> tuple[int, ...]:
    """``--feature-layers`` as sorted layer numbers; when not given, those the --init-draft head reads."""
    from lssp.models.eagle import head_feature_layers, is_feature_head
    from lssp.models.eagle3 import AUX_KEY, is_eagle3_head

    if not given.strip():
        if kind == "eagle3" and init_draft and is_eagle3_head(init_draft):
            return tuple(i - 1 for i in json.loads((init_draft / "config.json").read_text())["eagle_config"][AUX_KEY])
        return head_feature_layers(init_draft) if kind == "eagle" and init_draft and is_feature_head(init_draft) else ()
    if kind not in ("eagle", "eagle3"):
        raise UserError("--feature-layers is for --kind eagle or eagle3 (a head reads the target's hidden states)")
    try:
        return tuple(sorted({int(part) for part in given.split(",") if part.strip()}))
    except ValueError:
        raise UserError(f"--feature-layers {given!r}: expected layer numbers separated by commas, e.g. 2,15") from None


def _check(cfg: DistillConfig) -> None:
    """One line for each setting a user can get wrong."""
    if cfg.kind not in ("draft", "eagle", "eagle3"):
        raise UserError(f"--kind {cfg.kind!r}: expected draft, eagle or eagle3")
    if cfg.kind != "draft" and cfg.on_policy:
        raise UserError("--on-policy is for --kind draft (a head drafts from the target's features)")
    if cfg.precision not in ("auto", "bf16", "fp32"):
        raise UserError(f"--precision {cfg.precision!r}: expected auto, bf16 or fp32")
    from lssp.distill.config import SOURCES

    if cfg.source not in SOURCES:
        raise UserError(f"--source {cfg.source!r}: expected one of {', '.join(SOURCES)}")
    for name, value in [("--hidden-size", cfg.hidden_size), ("--layers", cfg.layers), ("--data-tokens", cfg.data_tokens),
                        ("--batch-prompts", cfg.batch_prompts), ("--new-tokens", cfg.new_tokens),
                        ("--max-prompt-tokens", cfg.max_prompt_tokens), ("--max-seq-len", cfg.max_seq_len),
                        ("--unroll", cfg.unroll)]:
        check_positive(name, value)
    if cfg.hidden_size % cfg.heads:
        raise UserError(f"--hidden-size {cfg.hidden_size} must be a multiple of --heads {cfg.heads}")
    if cfg.head_tokens < 0:
        raise UserError(f"--head-tokens must be >= 0, got {cfg.head_tokens}")
    for name, share in [("--on-policy", cfg.on_policy), ("--repeat-share", cfg.repeat_share)]:
        if not 0.0 <= share <= 1.0:
            raise UserError(f"{name} must be in [0, 1], got {share}")
    if cfg.on_policy and not cfg.init_from:
        raise UserError("--on-policy needs --init-draft: the draft that writes the on-policy data")
