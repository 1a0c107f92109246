"""``verify --endpoint``: is a server's SSp lossless? Servers already running (``load --endpoint``'s), one without
speculation (rsp) and others with it, each sampled many times from the same prompts with distinct seeds.

Where SSp is lossless, a server's completions follow the same law as the RSp server's, and so does any function of
them: here the target's tokenizer run over each completion's text (what a server streams back), so that no server
need return token ids. At each position j of a prompt's retokenized completions, among the runs of both servers
whose first j tokens are the commonest such prefix, the j-th tokens of the SSp server and of the RSp server must
come from one law: a chi-square test of homogeneity per position (``chi_square_homogeneity``), the family-wise
level split over the tests (Bonferroni). This needs no copy of the target's weights and no access to its logits:
it compares the servers with each other, so two servers that serve other models, or the same model in other
arithmetic, differ as an SSp bug would. The verdict rule is ``verify``'s: NOT LOSSLESS where a test rejects;
LOSSLESS only where every prompt's position 0 and at least one later position had POWER against a deviation of
Cohen's w = ``effect``; otherwise INCONCLUSIVE, with the runs per prompt that would do.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from lssp.decoding.sampling import SamplingParams
from lssp.engines.endpoint import RSP, Endpoint, completion_body, stream_completion
from lssp.engines.streaming import stream_requests
from lssp.measure.verify import INCONCLUSIVE, LOSSLESS, MIN_SAMPLES, NOT_LOSSLESS
from lssp.report.stats import POWER, chi_square_homogeneity, chi_square_power, chi_square_samples_needed

CONCURRENCY = 4  # requests in flight per server while sampling
SEED_STRIDE = 1_000_000  # the seeds of one server and --seed, apart from every other's
Progress = Callable[[str], None]


@dataclass
class EndpointCheck:
    """One position of one prompt: the two servers' samples sharing the commonest prefix, the test, its power."""

    prompt_index: int
    position: int
    prefix: list[int]
    rsp_samples: int
    ssp_samples: int
    p_value: float
    cells: int
    power: float = float("nan")
    runs_needed: int = 0  # runs per prompt that would give this position POWER (0: it has it)


@dataclass
class EndpointAudit:
    """The audit of one SSp server against the RSp server."""

    label: str
    url: str
    params: SamplingParams
    runs: int  # completions per prompt and server
    depth: int
    significance: float
    effect: float
    prompts: int = 0
    checks: list[EndpointCheck] = field(default_factory=list)
    failed_requests: int = 0
    verdict: str = INCONCLUSIVE
    underpowered: list[str] = field(default_factory=list)
    runs_needed: int = 0

    @property
    def threshold(self) -> float:
        return self.significance / max(1, len(self.checks))

    def rows(self, env: dict[str, str]) -> list[dict[str, Any]]:
        return [{"endpoint": self.label, "url": self.url, **asdict(c), "prefix": " ".join(map(str, c.prefix)),
                 "passed": c.p_value >= self.threshold, "runs": self.runs, **self.params.as_dict(),
                 "significance": self.significance, "effect": self.effect, "verdict": self.verdict, **env}
                for c in self.checks]


def samples(endpoint: Endpoint, ids: list[int], runs: int, tokens: int, params: SamplingParams, seed: int
            ) -> tuple[list[str], int]:
    """``runs`` completions of ``tokens`` tokens (past the end token) from one server, seeds seed, seed + 1, …:
    (their texts, how many failed)."""
    bodies = [completion_body(endpoint, ids, tokens, params, seed + i, True) for i in range(runs)]
    outs, _ = stream_requests(partial(stream_completion, endpoint.url), bodies, CONCURRENCY)
    return [o.text for o in outs if not o.error], sum(bool(o.error) for o in outs)


def position_checks(index: int, rsp: Sequence[Sequence[int]], ssp: Sequence[Sequence[int]], depth: int
                    ) -> list[EndpointCheck]:
    """One prompt's tests: at each position, the tokens of both servers' runs whose earlier tokens are the
    commonest prefix of that length (a position too few runs reach is left untested)."""
    checks = []
    for position in range(depth):
        prefixes = Counter(tuple(s[:position]) for s in (*rsp, *ssp) if len(s) > position)
        if not prefixes:
            break
        prefix = list(prefixes.most_common(1)[0][0])
        a = [s[position] for s in rsp if len(s) > position and list(s[:position]) == prefix]
        b = [s[position] for s in ssp if len(s) > position and list(s[:position]) == prefix]
        if min(len(a), len(b)) >= MIN_SAMPLES:
            test = chi_square_homogeneity(b, a)
            checks.append(EndpointCheck(index, position, prefix, len(a), len(b), test.p_value, test.cells))
    return checks


def judge(audit: EndpointAudit) -> None:
    """The verdict, each check's power and, short of it, the runs per prompt that would do (``verify``'s rule)."""
    for c in audit.checks:
        n = c.rsp_samples * c.ssp_samples / (c.rsp_samples + c.ssp_samples)  # the two-sample effective size
        c.power = chi_square_power(n, c.cells - 1, audit.effect, audit.threshold)
        if c.power < POWER:
            share = min(c.rsp_samples, c.ssp_samples) / audit.runs
            c.runs_needed = math.ceil(2 * chi_square_samples_needed(c.cells - 1, audit.effect, audit.threshold) / share)
    if any(c.p_value < audit.threshold for c in audit.checks):
        audit.verdict = NOT_LOSSLESS
        return
    needed = []
    for index in range(audit.prompts):
        first = next((c for c in audit.checks if c.prompt_index == index and c.position == 0), None)
        if first is None or first.power < POWER:
            audit.underpowered.append(f"prompt {index + 1} position 0 has power "
                                      f"{first.power if first else 0.0:.2f}")
            needed.append(first.runs_needed if first else 2 * audit.runs)
    later = [c for c in audit.checks if c.position > 0]
    if audit.depth > 1 and not any(c.power >= POWER for c in later):
        audit.underpowered.append(f"no later position has power {POWER:.0%}")
        needed.append(min([c.runs_needed for c in later if c.runs_needed] or [2 * audit.runs]))
    if audit.failed_requests:
        audit.underpowered.append(f"{audit.failed_requests} requests failed")
    audit.runs_needed = max(needed, default=0)
    audit.verdict = INCONCLUSIVE if audit.underpowered else LOSSLESS


def verify_endpoints(endpoints: Sequence[Endpoint], prompts: Sequence[list[int]],
                     retokenize: Callable[[str], list[int]], params: SamplingParams, runs: int, depth: int, seed: int, significance: float = 0.01,
                     effect: float = 0.5, progress: Progress | None = None) -> list[EndpointAudit]:
    """Each SSp server against the RSp server (``endpoints``, one labelled rsp), ``runs`` completions of ``depth``
    tokens per prompt and server at ``params`` (T > 0), each server with seeds of its own: an SSp server that draws
    as its RSp twin does would otherwise repeat the RSp server's samples, and the test needs independent ones."""
    audits = [EndpointAudit(e.label, e.url, params, runs, depth, significance, effect, len(prompts))
              for e in endpoints if e.label != RSP]
    for index, ids in enumerate(prompts):
        got = {}
        for number, endpoint in enumerate(endpoints):
            if progress:
                progress(f"prompt {index + 1}/{len(prompts)}: {runs} runs of {endpoint.label}")
            first_seed = SEED_STRIDE * (seed * 64 + number) + index * runs
            texts, failed = samples(endpoint, ids, runs, depth, params, first_seed)
            got[endpoint.label] = [retokenize(text)[:depth] for text in texts]
            for audit in audits:
                audit.failed_requests += failed if endpoint.label in (RSP, audit.label) else 0
        for audit in audits:
            audit.checks += position_checks(index, got[RSP], got[audit.label], depth)
    for audit in audits:
        judge(audit)
    return audits
