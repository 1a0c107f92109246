"""Greedy acceptance of a written draft on held-out prompts, measured through the registry loader."""
from __future__ import annotations

from pathlib import Path

from lssp.decoding.sampling import SamplingParams
from lssp.measure.latency import run_latency_ours
from lssp.models.loading import LoadedModel, check_compatible, load_model
from lssp.models.registry import ModelSpec
from lssp.workloads.prompts import LATENCY_PROMPTS, WARMUP_PROMPT

HELD_OUT_ACCEPTANCE = "latency prompts 1-4, greedy, K=4, 32 tokens"  # the measurement's name in a DistillReport


def held_out_acceptance(target: LoadedModel, draft_dir: Path, seed: int, device: str | None = None) -> dict[str, float]:
    """``{HELD_OUT_ACCEPTANCE: rate}``: the bfloat16 draft (or feature head; dynamically quantized where the target is) in ``draft_dir`` proposing K=4 greedy tokens
    for ``target`` over 32 new tokens on the first four latency prompts (none of them training prompts).

    Raises IncompatibleModelsError when the draft's tokenizer is not the target's.
    """
    draft_dir = Path(draft_dir)
    # A dynamically quantized target's output layer, which a feature head shares, takes float inputs: the head
    # is loaded the way the target is (as the registry's entries for the shipped head do).
    quantization = target.spec.quantization if target.spec.quantization.startswith("dynamic") else "none"
    drafted = load_model(ModelSpec(name=draft_dir.name, path=str(draft_dir.resolve()), dtype="bfloat16",
                                   quantization=quantization), device, draft=True, target=target)
    vocab = check_compatible(target, drafted)
    run = run_latency_ours(target, drafted, LATENCY_PROMPTS[:4], WARMUP_PROMPT, [4], SamplingParams(0), 32, seed,
                      baseline=False, vocab_size=vocab, ignore_eos=True)
    return {HELD_OUT_ACCEPTANCE: run.summaries[0].acceptance_rate}
