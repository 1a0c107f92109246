"""`compare`: stream RSp then SSp completions of each prompt, with wall times and the speedup."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Annotated, Optional

import typer
from rich.text import Text

from lssp.cli.common import (
    ChatOpt, DraftArg, KOpt, LookupOpt, MaxNewOpt, TargetArg, TemperatureOpt, TopKOpt, TopPOpt, app, check_positive,
    console, err_console, fmt, k_label, load_pair, sampling_params, settings,
)


@app.command()
def compare(
    ctx: typer.Context,
    target: TargetArg = None,
    draft: DraftArg = None,
    prompt: Annotated[Optional[list[str]], typer.Option(help="Prompt(s); otherwise read from stdin or a > prompt.")] = None,
    k: KOpt = 4,
    max_new_tokens: MaxNewOpt = 64,
    temperature: TemperatureOpt = 0.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    chat: ChatOpt = False,
    lookup: LookupOpt = 0,
) -> None:
    """Stream RSp then SSp completions of each prompt, with wall times and the speedup."""
    import torch

    from lssp.generation import generate_regular, generate_speculative
    from lssp.prompts import WARMUP_PROMPT

    s = settings(ctx)
    check_positive("--k", k)
    check_positive("--max-new-tokens", max_new_tokens)
    check_positive("--lookup", lookup, minimum=0)
    params = sampling_params(temperature, top_k, top_p)
    t, d, vocab = load_pair(s, target, draft)

    def run_one(text: str, index: int) -> None:
        ids = t.encode(text, chat=chat)
        console.print(Text(f"\n=> Regular sampling with {t.name}", style="bold"))
        stream = TokenStream(t.tokenizer, text)
        rsp = generate_regular(t.model, ids, max_new_tokens, params, torch.Generator(t.device).manual_seed(s.seed + index),
                               on_tokens=stream.show)
        console.print(Text(f"\n   {rsp.stats.total_time_s:.2f}s, {_ms_per_token(rsp.stats):.1f} ms/token", style="bold red"))
        console.print(Text(f"=> Speculative sampling with {t.name} helped by {d.name} (K={k_label(k, 0, lookup)}); ",
                           style="bold") + Text("draft tokens accepted", style="green") + Text(" / ")
                      + Text("made by the target", style="bold blue"))
        stream = TokenStream(t.tokenizer, text)
        ssp = generate_speculative(t.model, d.model, ids, max_new_tokens, k, params,
                                   torch.Generator(t.device).manual_seed(s.seed + index), vocab_size=vocab,
                                   on_tokens=stream.show, lookup=lookup)
        console.print(Text(f"\n   {ssp.stats.total_time_s:.2f}s, {_ms_per_token(ssp.stats):.1f} ms/token, acceptance "
                           f"{fmt(ssp.stats.acceptance_rate, 0, pct=True)}, {ssp.stats.tokens_per_target_forward:.2f} "
                           "tokens per target forward", style="bold green"))
        speedup = _ms_per_token(rsp.stats) / _ms_per_token(ssp.stats)
        console.print(Text(f"   speedup {speedup:.2f}×", style="bold green" if speedup > 1 else "bold red"))

    try:
        with err_console.status("Warming up…"):
            generate_speculative(t.model, d.model, t.encode(WARMUP_PROMPT), 8, k, params, vocab_size=vocab, lookup=lookup)
            generate_regular(t.model, t.encode(WARMUP_PROMPT), 8, params)
        console.print(f"Comparing {t.name} RSp with SSp helped by {d.name}. Ctrl-C or EOF (Ctrl-D) ends.")
        for index, text in enumerate(prompt_source(prompt)):
            run_one(text, index)
    except KeyboardInterrupt:
        err_console.print("\ninterrupted")
        raise typer.Exit(130) from None


def _ms_per_token(stats) -> float:
    """Wall time of the whole completion, prefill included, per token (what a user waits for)."""
    return stats.total_time_s * 1000 / max(1, stats.new_tokens)


def prompt_source(prompts: list[str] | None) -> Iterator[str]:
    """The --prompt options, or lines from stdin (with a "> " prompt on a terminal) until EOF."""
    if prompts:
        yield from prompts
        return
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except EOFError:
            return
        if not interactive and line == "":
            return
        line = line.rstrip("\n")
        if line.strip():
            yield line


class TokenStream:
    """Prints each new token's text as it arrives, coloured by who produced it."""

    def __init__(self, tokenizer, prompt: str) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.shown = ""
        console.print(Text(prompt, style="dim"), end="")

    def show(self, tokens: list[int], drafted: list[bool]) -> None:
        for token, from_draft in zip(tokens, drafted):
            self.tokens.append(token)
            text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
            piece, self.shown = text[len(self.shown):], text
            console.print(Text(piece, style="green" if from_draft else "bold blue"), end="")
        console.file.flush()
