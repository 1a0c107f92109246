"""Option types every command shares, and parsing what users type into them."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from lssp.decoding.sampling import SamplingParams
from lssp.errors import UserError
from lssp.report.results import plural


def flag(*decls: str, help: str) -> Any:
    """A boolean option shown without typer's "<bool>" in --help."""
    return typer.Option(*decls, help=help, metavar="")


KOpt = Annotated[Optional[int], typer.Option(
    "--k", help="Draft tokens per iteration (default: the draft's own k in the registry, else 4).")]
ConfidenceOpt = Annotated[str, typer.Option(
    "--draft-confidence", help="Stop drafting once the draft's own probability of its token falls below this "
    "(K becomes a maximum; a comma list sweeps; 0: always K).")]
LookupOpt = Annotated[int, typer.Option(
    "--lookup", help="Context lookup: where the text's last N tokens occurred before and the draft is unsure, "
    "propose what followed them (0: off).")]
MaxNewOpt = Annotated[int, typer.Option(help="Tokens to generate per prompt.")]
TopKOpt = Annotated[int, typer.Option(help="Keep the k most likely tokens (0: off).")]
TopPOpt = Annotated[float, typer.Option(help="Nucleus sampling mass (1: off).")]
TemperatureOpt = Annotated[float, typer.Option(help="0 is greedy.")]
TargetArg = Annotated[Optional[str], typer.Argument(help="Target model (default: the registry's default_target).")]
EngineOpt = Annotated[str, typer.Option(
    "--engine", help="ours, hf (transformers' generate and assisted generation), vllm (./setup.sh --vllm installs "
    "it), or a comma list such as ours,hf,vllm: all in one interleaved run.")]
DraftArg = Annotated[Optional[str], typer.Argument(help="Draft model (default: the registry's default_draft); "
                                                         "--draft D says the same.")]
# The other form of a command's draft: every command takes its draft as a second name or as --draft (one_draft).
DraftAlsoOpt = Annotated[Optional[str], typer.Option("--draft", help="The draft, as the second name says it.")]
DraftAlsoArg = Annotated[Optional[str], typer.Argument(help="The draft, as --draft says it.", show_default=False)]


def one_draft(positional: str | None, option: str | None) -> str | None:
    """The draft a command was given, as a second name or as --draft; one line where both name different ones."""
    if positional and option and positional != option:
        raise UserError(f"the draft is named twice ({positional!r} and --draft {option!r}): give it once")
    return option or positional
PromptsOpt = Annotated[Optional[Path], typer.Option(
    help="File with one prompt per line, or JSONL in Spec-Bench's question.jsonl shape (category, turns).")]
TaskOpt = Annotated[Optional[str], typer.Option(
    "--task", help="Built-in task categories, comma-separated, or all: chat, translation, summarization, qa, math, rag, "
    "code, stories (the default); or sharegpt: ShareGPT's first human turns (--nb-prompts of them, default 64).")]
IgnoreEosOpt = Annotated[bool, flag("--ignore-eos", help="Run every completion to --max-new-tokens, past the end token "
                                    "(fixed-length runs for hardware timing).")]
NbPromptsOpt = Annotated[Optional[int], typer.Option(help="Use only the first N prompts.")]
JsonOpt = Annotated[Optional[Path], typer.Option("--json", help="Write the run's summary as JSON here.")]
PlotOpt = Annotated[bool, flag(help="Draw this run's charts into the results directory.")]
ChatOpt = Annotated[bool, flag("--chat", help="Feed each prompt as a user turn in the target's chat template.")]
WideOpt = Annotated[bool, flag("--wide", help="Also show a second table: median, TTFT, accepted/drafted, where the "
                               "time went, and the spread of forward times.")]


def sampling_params(temperature: float, top_k: int, top_p: float) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)


def check_positive(name: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise UserError(f"{name} must be at least {minimum}, got {value}")


def check_k_within_budget(ks: list[int] | int, max_new_tokens: int) -> None:
    """A K above the token budget drafts tokens that can never be kept: one line instead (and the budget is positive)."""
    check_positive("--max-new-tokens", max_new_tokens)
    k = max(ks) if isinstance(ks, list) else ks
    if k > max_new_tokens:
        raise UserError(f"--k {k} is more than --max-new-tokens {max_new_tokens}: at most {max_new_tokens} drafts "
                        "could ever be kept")


def _comma_list(name: str, text: str, kind: str) -> list[str]:
    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not part for part in parts):
        raise UserError(f"{name} takes {kind} separated by commas, got {text!r}")
    return parts


def parse_ints(name: str, text: str, minimum: int = 1) -> list[int]:
    try:
        values = [int(part) for part in _comma_list(name, text, "whole numbers")]
    except ValueError:
        raise UserError(f"{name} takes whole numbers separated by commas, got {text!r}") from None
    if any(v < minimum for v in values):
        raise UserError(f"{name} values must be at least {minimum}, got {text!r}")
    return values


def parse_fractions(name: str, text: str, with_one: bool = False) -> list[float]:
    """Numbers in [0, 1) (``with_one``: [0, 1]), comma-separated."""
    try:
        values = [float(part) for part in _comma_list(name, text, "numbers")]
    except ValueError:
        raise UserError(f"{name} takes numbers separated by commas, got {text!r}") from None
    if any(not (0 <= v <= 1 if with_one else 0 <= v < 1) for v in values):
        raise UserError(f"{name} values must be in [0, {1 if with_one else '1)'}{']' if with_one else ''}, got {text!r}")
    return values


def parse_engines(value: str, allowed: tuple[str, ...] = ("ours", "vllm")) -> list[str]:
    """--engine: a comma list of known engines, each once."""
    engines = [e.strip() for e in value.split(",") if e.strip()]
    unknown = [e for e in engines if e not in allowed]
    if unknown or not engines or len(set(engines)) < len(engines):
        raise UserError(f"--engine {value!r}: expected one or more of {', '.join(allowed)}, comma-separated, each once")
    return engines


def read_prompt_list(prompts_file: Path | None, nb_prompts: int | None) -> list[str]:
    """Prompts as text: the file's lines (the first turn of each JSONL prompt) or the built-in list."""
    from lssp.workloads.prompts import LATENCY_PROMPTS, read_prompts
    from lssp.workloads.tasks import is_jsonl, read_jsonl

    if prompts_file and is_jsonl(prompts_file):
        prompts = [p.text for p in read_jsonl(prompts_file)]
    else:
        prompts = read_prompts(prompts_file) if prompts_file else list(LATENCY_PROMPTS)
    return _first(prompts, nb_prompts, prompts_file)


def _first(prompts: list, nb_prompts: int | None, source: Path | str | None) -> list:
    """The first ``nb_prompts`` of ``prompts`` (all of them for None); more than there are is a mistake."""
    if nb_prompts is None:
        return prompts
    check_positive("--nb-prompts", nb_prompts)
    if nb_prompts > len(prompts):
        raise UserError(f"--nb-prompts {nb_prompts}: {source or 'the built-in list'} has only "
                        f"{plural(len(prompts), 'prompt')}" + ("" if source else " (give more with --prompts FILE)"))
    return prompts[:nb_prompts]


def read_task_prompts(tasks: str | None, prompts_file: Path | None, nb_prompts: int | None, chat: bool) -> list:
    """The TaskPrompts a latency run times: built-in tasks (``--nb-prompts`` of each), a file (lines or
    Spec-Bench JSONL), or by default the reference's story openings."""
    from lssp.measure.latency import as_task_prompts
    from lssp.workloads.tasks import is_jsonl, load_tasks, parse_tasks, read_jsonl, task_prompts

    if tasks is not None and prompts_file is not None:
        raise UserError("--task and --prompts: give one of them")
    if tasks is not None:
        if nb_prompts is not None:
            check_positive("--nb-prompts", nb_prompts)
        return load_tasks(parse_tasks(tasks), nb_prompts)
    if prompts_file is not None and is_jsonl(prompts_file):
        return _first(read_jsonl(prompts_file), nb_prompts, prompts_file)
    if prompts_file is not None:
        return as_task_prompts(read_prompt_list(prompts_file, nb_prompts), chat)
    return _first(list(task_prompts("stories")), nb_prompts, None)


EndpointOpt = Annotated[Optional[list[str]], typer.Option(
    "--endpoint", metavar="LABEL=URL", help="Servers already running anywhere (OpenAI-compatible /v1/completions: "
    "vLLM, SGLang, llama.cpp, a cluster's gateway), one labelled rsp without speculation and others with it, e.g. "
    "--endpoint rsp=http://h:8000 --endpoint eagle=http://h:8001 (URL#MODEL: one model of a gateway; "
    "URL,metrics=URL: the server behind a gateway whose /metrics counts; URL,prompt=text: prompts as text, not "
    "token ids; URL,api=chat: the chat API; a key from LLAMASSP_API_KEY); TARGET names the tokenizer.")]


def given_options(ctx: typer.Context, options: dict[str, str]) -> list[str]:
    """Which of ``options`` (parameter name: how the user writes it) the command line set."""
    return [option for name, option in options.items()
            if getattr(ctx.get_parameter_source(name), "name", "DEFAULT") != "DEFAULT"]  # typer's own click


def refuse_beside_endpoints(ctx: typer.Context, options: dict[str, str]) -> None:
    """One line where the command line set one of ``options`` beside --endpoint: the servers' own settings."""
    given = given_options(ctx, options)
    if given:
        raise UserError(f"--endpoint: {', '.join(given)} would be the servers' own settings, set where they run "
                        "(each --endpoint is one configuration)")
