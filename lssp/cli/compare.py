"""`compare`: stream RSp then SSp completions of each prompt, with wall times and the speedup."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Annotated, Any, Optional

import typer
from rich.text import Text

from lssp.cli.app import app, settings
from lssp.cli.loaders import check_ssp, heads_run, start_engine
from lssp.cli.options import (
    ChatOpt,
    DraftAlsoOpt,
    DraftArg,
    IgnoreEosOpt,
    KOpt,
    LookupOpt,
    MaxNewOpt,
    NbPromptsOpt,
    TargetArg,
    TaskOpt,
    TemperatureOpt,
    TopKOpt,
    TopPOpt,
    check_k_within_budget,
    check_positive,
    one_draft,
    parse_engines,
    read_task_prompts,
    refuse_beside_endpoints,
    sampling_params,
)
from lssp.cli.output import console, err_console, exit_interrupted, fmt, k_label, say_busy, table
from lssp.engines import Request, engine_class, request_seed
from lssp.errors import UserError
from lssp.report.contention import cpu_snapshot, others_share
from lssp.report.results import plural

CompareEndpointOpt = Annotated[Optional[list[str]], typer.Option(
    "--endpoint", metavar="LABEL=URL", help="Two servers already running (OpenAI /v1/completions): rsp=URL without "
    "speculation and NAME=URL with it, streamed side by side; see docs/endpoints.md; TARGET names the tokenizer.")]
# --endpoint: the servers' own settings, refused beside it (parameter: how the user writes it)
SERVER_SETTINGS = {"draft": "DRAFT", "draft_option": "--draft", "k": "--k", "lookup": "--lookup",
                   "engine": "--engine"}


@app.command()
def compare(
    ctx: typer.Context,
    target: TargetArg = None,
    draft: DraftArg = None,
    draft_option: DraftAlsoOpt = None,
    prompt: Annotated[Optional[list[str]], typer.Option(help="Prompt(s); otherwise read from stdin or a > prompt.")] = None,
    k: KOpt = None,
    max_new_tokens: MaxNewOpt = 64,
    temperature: TemperatureOpt = 0.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    chat: ChatOpt = False,
    lookup: LookupOpt = 0,
    task: TaskOpt = None,
    nb_prompts: NbPromptsOpt = None,
    ignore_eos: IgnoreEosOpt = False,
    engine: Annotated[str, typer.Option("--engine", help="ours, vllm or llamacpp (./setup.sh --vllm or --llamacpp "
                                        "installs them).")] = "ours",
    endpoint: CompareEndpointOpt = None,
) -> None:
    """Stream RSp then SSp completions of each prompt, with wall times and the speedup."""
    from lssp.decoding.generation import Stopping
    from lssp.measure.latency import complete_turns, uses_chat_template
    from lssp.models.loading import conversation
    from lssp.workloads.prompts import WARMUP_PROMPT
    from lssp.workloads.tasks import TaskPrompt

    s = settings(ctx)
    chosen, k = _engine_and_k(s, engine, draft := one_draft(draft, draft_option), k, ctx, endpoint)
    params = _checked(k, max_new_tokens, lookup, temperature, top_k, top_p, task, nb_prompts, prompt)
    # --nb-prompts alone: the first N of the default workload (the reference's story openings), not stdin.
    task_list = read_task_prompts(task, None, nb_prompts, chat) if task or nb_prompts else None
    kind = engine_class(chosen)
    alone = bool(lookup) and not kind.takes_lookup  # the engine's n-gram drafter, no draft model
    t, d, runner, modes = (_endpoints(s, target, endpoint) if endpoint else
                           _start(s, chosen, target, draft, k, lookup, alone))
    stopping = Stopping() if ignore_eos else Stopping(token_ids=t.eos_ids)

    def stream(prompt, index: int, mode: str):
        """Complete every turn of ``prompt`` in ``mode``, printing each turn and streaming its answer (vLLM stepped
        by hand, each step's tokens shown as they come)."""
        turns = iter(enumerate(prompt.turns))

        def generate(ids, messages):
            number, text = next(turns)
            shown = TokenStream(t.tokenizer, ("\n\n" if number else "") + text)
            return runner.complete(modes[mode], Request(ids, max_new_tokens, params, request_seed(s.seed, index),
                                                        stopping, on_tokens=shown.show, messages=messages))

        stats, _, _ = complete_turns(t, prompt, uses_chat_template(t, prompt, chat), generate)
        return stats

    via, helper = _described(kind, d, alone, modes["ssp"], k, lookup)
    done: list[tuple[str, Any, Any]] = []  # (label, RSp stats, SSp stats) per prompt, for the summary

    def run_one(prompt, index: int) -> None:
        console.print(Text(f"\n=> Regular sampling with {t.name}{via}" + (f" ({prompt.task})" if task else ""),
                           style="bold"))
        before = cpu_snapshot()
        rsp = stream(prompt, index, "rsp")
        console.print(Text(f"\n   {rsp.total_time_s:.2f}s, {_ms_per_token(rsp):.1f} ms/token", style="bold red"))
        console.print(Text(f"=> Speculative sampling with {t.name}{via} helped by {helper}; ", style="bold") + Text("draft tokens accepted", style="green") + Text(" / ")
                      + Text("made by the target", style="bold blue"))
        ssp = stream(prompt, index, "ssp")
        if alone:
            console.print(Text(f"\n   ({kind.label}'s n-gram steps: drafts not shown)", style="dim"), end="")
        console.print(Text(f"\n   {ssp.total_time_s:.2f}s, {_ms_per_token(ssp):.1f} ms/token, acceptance "
                           f"{fmt(ssp.acceptance_rate, 0, pct=True)}, {ssp.tokens_per_target_forward:.2f} "
                           "tokens per target forward", style="bold green"))
        speedup = _ms_per_token(rsp) / _ms_per_token(ssp)
        console.print(Text(f"   speedup {speedup:.2f}×", style="bold green" if speedup > 1 else "bold red"))
        say_busy(others_share(before, cpu_snapshot()) if kind.checks_busy else float("nan"), "this prompt: ")
        done.append((prompt.turns[0], rsp, ssp))

    try:
        with err_console.status("Warming up…"):
            for mode in modes.values():
                runner.complete(mode, Request(t.encode(WARMUP_PROMPT), 8, params, request_seed(s.seed, -1),
                                              messages=conversation((WARMUP_PROMPT,))))
        console.print(f"Comparing {t.name} RSp with SSp helped by {helper}{via}. Ctrl-C or EOF (Ctrl-D) ends.")
        prompts = task_list if task_list is not None else (
            TaskPrompt("prompts", (text,), chat) for text in prompt_source(prompt))
        for index, one in enumerate(prompts):
            run_one(one, index)
    except KeyboardInterrupt:
        _summary(done)
        exit_interrupted("\ninterrupted: the completions shown above are all there is (compare writes no files)")
    _summary(done)


def _described(kind, d, alone: bool, ssp, k: int, lookup: int) -> tuple[str, str]:
    """(where it runs, what helps SSp) for the headers: "" and the draft with its K on our engine; " in vLLM" and
    its n-gram lookup; a server already running by its label."""
    if kind.names_modes:
        return " on servers already running", f"the server {ssp.draft!r} (its own drafts, not coloured)"
    via = "" if kind.reference else f" in {kind.label}" + ("" if kind.marks_drafts else
                                                           " (whole answers: drafted tokens not coloured)")
    helper = f"{d.name}" if d is not None and not alone else f"{kind.label}'s n-gram lookup"
    return via, f"{helper} (K={k_label(k, 0, lookup)})"


def _endpoints(s, target: str | None, values: list[str]):
    """(the target as a tokenizer, no draft, the engine over the two servers, {"rsp": .., "ssp": ..}) for
    ``compare --endpoint``."""
    from lssp.cli.loaders import endpoints_and_tokenizer
    from lssp.engines.endpoint import EndpointEngine

    t, endpoints = endpoints_and_tokenizer(s, target, values)
    return t, None, EndpointEngine(endpoints, t.tokenizer), {e.mode.mode: e.mode for e in endpoints}


def _checked(k: int, max_new_tokens: int, lookup: int, temperature: float, top_k: int, top_p: float,
             task: str | None, nb_prompts: int | None, prompt: list[str] | None):
    """The sampling parameters, once every input a user can get wrong is checked (one line each)."""
    for option, value, least in (("--k", k, 1), ("--max-new-tokens", max_new_tokens, 1), ("--lookup", lookup, 0)):
        check_positive(option, value, minimum=least)
    check_k_within_budget(k, max_new_tokens)
    if (task or nb_prompts) and prompt:
        raise UserError(f"{'--task' if task else '--nb-prompts'} and --prompt: give one of them")
    return sampling_params(temperature, top_k, top_p)


def _engine_and_k(s, engine: str, draft: str | None, k: int | None, ctx: typer.Context,
                  endpoints: list[str] | None) -> tuple[str, int]:
    """The one engine ``--engine`` names (compare streams one at a time), and K: ``k``, else the draft's own; with
    --endpoint, the servers' (two: one labelled rsp), their own settings refused in one line."""
    if endpoints:
        from lssp.engines.endpoint import ENGINE, parse_endpoints

        refuse_beside_endpoints(ctx, SERVER_SETTINGS)
        if len(parse_endpoints(endpoints)) != 2:
            raise UserError("compare --endpoint streams two servers: one labelled rsp and one with speculation")
        return ENGINE, 1
    (chosen,) = parse_engines(engine, ("ours", "vllm", "llamacpp")) if "," not in engine else (None,)
    if chosen is None:
        raise UserError(f"--engine {engine!r}: compare streams one engine at a time (ours, vllm or llamacpp)")
    return chosen, s.registry.draft_k(draft, heads_run([chosen])) if k is None else k


def _start(s, chosen: str, target: str | None, draft: str | None, k: int, lookup: int, alone: bool):
    """(target, draft, engine, {"rsp": its RSp mode, "ssp": its SSp mode}): the one engine compare streams, started
    for both."""
    from lssp.measure.latency import latency_modes

    check_ssp("compare", chosen, [k], lookup, has_draft=not alone)
    modes = dict(zip(("rsp", "ssp"), latency_modes([chosen], [] if alone else ["draft"], [k], (0.0,), [lookup]),
                     strict=True))
    t, d, runner = start_engine(s, chosen, [engine_class(chosen).key(m) for m in modes.values()], target, draft,
                                need_draft=not alone or draft is not None)
    return t, d, runner, modes


def _summary(done: list[tuple[str, Any, Any]]) -> None:
    """Per prompt and overall: RSp's and SSp's ms/token (whole completions) and the speedup."""
    from lssp.report.stats import ratio_interval

    if not done:
        return
    out = table("compare: wall time per token, prefill included", [("prompt", "left"), ("RSp ms/token", "right"),
                                                                   ("SSp ms/token", "right"), ("accepted", "right"),
                                                                   ("speedup", "right")])
    out.columns[0].no_wrap, out.columns[0].overflow, out.columns[0].max_width = True, "ellipsis", 24  # one line each
    for label, rsp, ssp in done:
        out.add_row(" ".join(label.split()), f"{_ms_per_token(rsp):.1f}", f"{_ms_per_token(ssp):.1f}",
                    fmt(ssp.acceptance_rate, 0, pct=True), f"{_ms_per_token(rsp) / _ms_per_token(ssp):.2f}×")
    rsp_ms = 1000 * sum(r.total_time_s for _, r, _ in done) / max(1, sum(r.new_tokens for _, r, _ in done))
    ssp_ms = 1000 * sum(s.total_time_s for _, _, s in done) / max(1, sum(s.new_tokens for _, _, s in done))
    drafted = sum(s.drafted for _, _, s in done)
    out.add_row(f"all {plural(len(done), 'prompt')}", f"{rsp_ms:.1f}", f"{ssp_ms:.1f}",
                fmt(sum(s.accepted for _, _, s in done) / drafted if drafted else float("nan"), 0, pct=True),
                f"{rsp_ms / ssp_ms:.2f}×", style="bold")
    console.print()
    console.print(out)
    interval = ratio_interval([(_ms_per_token(rsp), _ms_per_token(ssp)) for _, rsp, ssp in done])
    if interval.low == interval.low:  # two prompts or more
        console.print(f"  per prompt: {interval.estimate:.2f}× [{interval.low:.2f}–{interval.high:.2f}] (geometric "
                      "mean, 95% t interval); one pass each, RSp then SSp: `latency` interleaves passes for figures "
                      "to cite")


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
