"""Speculative sampling (SSp): a drafter proposes k tokens, the target scores them all in one forward, and the
verification rule (``lssp.decoding.verification``) keeps a prefix of them and adds one token of the target's.

Both sides first prefill the prompt but its last token. Between iterations the target's cache holds a prefix of
``seq`` and the drafter keeps its own state in step (``Drafter.commit``); whatever of ``seq`` a model has not seen
yet is fed at its next forward.
"""
from __future__ import annotations

import torch
from transformers import PreTrainedModel

from lssp.decoding import verification
from lssp.decoding.drafting import Drafter, Picker, Proposal
from lssp.decoding.generation import NO_STOP, GenerationOutput, GenerationStats, Stopping, TokenCallback
from lssp.decoding.kv import PrefixCache, drop, prefill, prefill_with_features, scoring_forward
from lssp.decoding.sampling import SamplingParams, warp
from lssp.decoding.timing import Clock
from lssp.models.modules import logit_width, model_device


@torch.inference_mode()
def speculative_decode(target: PreTrainedModel, drafter: Drafter, input_ids: torch.Tensor, max_new_tokens: int,
                       k: int, params: SamplingParams, generator: torch.Generator | None = None,
                       stopping: Stopping = NO_STOP, on_tokens: TokenCallback | None = None, vocab: int | None = None,
                       time_forwards: bool = True, prefix: PrefixCache | None = None) -> GenerationOutput:
    """Sample up to ``max_new_tokens`` tokens from ``target``'s law with ``drafter`` proposing up to ``k`` at a time.
    ``vocab``: the width of the target's law verified against (by default its whole output, as RSp samples it; a
    draft with fewer logits never proposes the tokens beyond its own, and the residual draws them); ``time_forwards``
    and ``prefix`` as in ``generate_regular``."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    device = model_device(target)
    models = [m for m in (target, drafter.model) if m is not None]  # an n-gram drafter has no model
    vocab = vocab or logit_width(target)
    clock = Clock.for_models(*models, per_forward=time_forwards)
    longest = drafter.longest(k)
    stats = GenerationStats(mode="ssp", k=k, drafted_at=[0] * longest, accepted_at=[0] * longest,
                            forwards_timed=clock.per_forward)
    seq, tokens, stopped = input_ids.to(device), [], False
    start = clock.now()
    if drafter.needs_features:
        target_kv, features = prefill_with_features(target, seq, prefix)
    else:
        target_kv, features = prefill(target, seq, prefix), None
    drafter.begin(seq, features, prefix, clock)
    stats.prefill_time_s = clock.now() - start
    while len(tokens) < max_new_tokens and not stopped:
        # 1. The drafter proposes, never past the budget: the iteration then emits at most what is left.
        left = max_new_tokens - len(tokens) - 1 if drafter.ready else 0
        proposal = drafter.propose(seq, Picker(min(k, left), vocab, params, generator, device, min(longest, left)))
        drafted = len(proposal)

        # 2. One target forward scores every draft position and the one after.
        target_in = torch.cat([seq[:, target_kv.get_seq_length():], proposal.tokens.view(1, -1)], dim=1)
        t0 = clock.forward_now()
        logits, features = scoring_forward(target, target_in, target_kv, drafted + 1, drafter.needs_features)
        stats.target_time_s += clock.forward_now() - t0

        # 3. Keep the longest run of drafts that passes, then one token of the target's.
        n, extra = verify_proposal(logits[:, :vocab], proposal, params, generator)

        # 4. Emit, and roll both sides back to what stays valid.
        emitted = torch.cat([proposal.tokens[:n], extra.view(1)])
        drop(target_kv, drafted - n)
        new = emitted.tolist()
        drafter.commit(proposal, n, new, features[:, :target_in.shape[1] - (drafted - n)] if features is not None else None)
        seq = torch.cat([seq, emitted.view(1, -1)], dim=1)

        first_new = len(tokens)
        tokens.extend(new)
        keep = stopping.cut(tokens, first_new)
        if keep is not None:
            stopped = True
            del tokens[keep:]
        count_iteration(stats, proposal, n, len(tokens) - first_new)
        if first_new == 0:  # the first emission: one token, or accepted drafts and one more
            stats.ttft_s, stats.first_emission_tokens = clock.now() - start, len(tokens)
        if on_tokens and len(tokens) > first_new:
            shown = tokens[first_new:]
            on_tokens(shown, [i < n for i in range(len(shown))])
    stats.total_time_s = clock.now() - start
    stats.after_first_s = stats.total_time_s - stats.ttft_s
    stats.new_tokens = len(tokens)
    return GenerationOutput(torch.tensor(tokens, dtype=torch.long), stats, stopped)


def verify_proposal(logits: torch.Tensor, proposal: Proposal, params: SamplingParams,
            generator: torch.Generator | None) -> tuple[int, torch.Tensor]:
    """(accepted drafts, next token) by the rule for these sampling parameters."""
    if params.greedy:
        return verification.greedy_verification(logits, proposal.tokens)
    accept_u, next_u = verification.draw_uniforms(len(proposal), logits.device, generator)
    if params.top_k == 0 and params.top_p == 1.0:
        return verification.tempered_verification(logits, params.temperature, proposal.q, proposal.tokens, accept_u,
                                                  next_u)
    return verification.sampled_verification(warp(logits, params), proposal.q, proposal.tokens, accept_u, next_u)


def count_iteration(stats: GenerationStats, proposal: Proposal, accepted: int, kept: int) -> None:
    """Add one iteration to ``stats``, up to the stop: of its emitted tokens only ``kept`` stay, and drafts past a
    stop token count as neither drafted nor accepted."""
    drafted = len(proposal)
    stats.target_forwards += 1
    stats.draft_forwards += drafted  # the work was done, whatever was kept
    if kept <= accepted:  # the stop fell among the accepted drafts
        drafted = accepted = kept
    stats.draft_time_s += proposal.forward_s
    stats.drafted += drafted
    stats.accepted += accepted
    stats.rejections += int(accepted < drafted)
    stats.looked_up += sum(proposal.looked_up[:drafted])
    stats.looked_up_accepted += sum(proposal.looked_up[:accepted])
    for i in range(drafted):
        stats.drafted_at[i] += 1
        stats.accepted_at[i] += int(i < accepted)
