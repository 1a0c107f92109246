"""Verification: which drafts the target keeps, and the token it adds, as pure functions.

Chen et al. 2023 (Alg. 2) / Leviathan et al. 2022 (Alg. 1): draft i is kept with probability min(1, p_i(x)/q_i(x)),
the first rejection is replaced by a draw from norm(max(0, p - q)), and a full acceptance earns a bonus token from
p_{k+1}. Greedy decoding is that rule with one-hot p and q, so it runs on argmaxes. The uniforms come in as
arguments (``draw_uniforms``), so a verification is a function of its inputs alone.
"""
from __future__ import annotations

import torch

from lssp.decoding.sampling import SamplingParams, argmax, inverse_cdf, on_kernel, warp


def draw_uniforms(k: int, device: torch.device, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The uniforms one verification of ``k`` drafts uses: k for the acceptance tests (none drawn for k = 0), then
    one (float64) for the token that follows."""
    accept = torch.rand(k, device=device, generator=generator) if k else torch.empty(0, device=device)
    return accept, torch.rand(1, 1, dtype=torch.float64, device=device, generator=generator)


def accepted_prefix(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, uniforms: torch.Tensor) -> int:
    """How many leading drafts pass: draft i is kept where uniforms[i] · q_i(x) < p_i(x)."""
    k = drafts.shape[0]
    if k == 0:
        return 0
    rows = torch.arange(k, device=drafts.device)
    # On the host (a few floats, one synchronization): float32 products are exact in Python's float64.
    for n, (u, q_x, p_x) in enumerate(zip(uniforms.tolist(), q[rows, drafts].tolist(), p[rows, drafts].tolist())):
        if not u * q_x < p_x:
            return n
    return k


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): the law of the token that replaces a rejected draft."""
    residual = (p - q).clamp_(min=0)
    total = residual.sum()
    # p == q up to rounding leaves no residual mass; p itself is then the right law (no host sync).
    return torch.where(total > 0, residual / total.clamp_min(torch.finfo(p.dtype).tiny), p)


def residual_draw(p: torch.Tensor, q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token uniform ``u`` picks from norm(max(0, p - q)) (as ``inverse_cdf`` picks), in one pass of our CPU
    kernel where it samples, without building the residual."""
    if on_kernel(p) and on_kernel(q):
        return torch.tensor(torch.ops.lssp.draw_from(p, q, float(u)))
    return inverse_cdf(residual_distribution(p, q), u)


def sampled_verification(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, accept_u: torch.Tensor,
                         next_u: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(accepted drafts n, the next token) from the target's probabilities ``p`` (k+1, V), the draft's ``q`` (k, V)
    of its ``drafts`` (k,), and the uniforms: the token is drawn from the residual where draft n was rejected, else
    from p_{k+1} (the bonus)."""
    k = drafts.shape[0]
    n = accepted_prefix(p, q, drafts, accept_u)
    return n, (residual_draw(p[n], q[n], next_u) if n < k else inverse_cdf(p[k], next_u)).reshape(())


def tempered_verification(logits: torch.Tensor, temperature: float, q: torch.Tensor, drafts: torch.Tensor,
                          accept_u: torch.Tensor, next_u: torch.Tensor) -> tuple[int, torch.Tensor]:
    """``sampled_verification`` of p = softmax(logits / temperature) (k+1, V): on a CPU our kernel's one call
    (``verify_sampled``: the same numbers, the rows past the first rejection never computed), else through ``warp``."""
    if on_kernel(logits) and on_kernel(q):
        n, token = torch.ops.lssp.verify_sampled(logits, q, drafts, accept_u, float(next_u), temperature)
        return n, torch.tensor(token)
    return sampled_verification(warp(logits, SamplingParams(temperature)), q, drafts, accept_u, next_u)


def greedy_verification(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The rule with one-hot p and q: drafts pass while they are the target's argmax, and the next token is the
    target's argmax where the run stopped (or after it). On a CPU our kernel's one call (``verify_greedy``)."""
    if on_kernel(logits):
        n, token = torch.ops.lssp.verify_greedy(logits, drafts)
        return n, torch.tensor(token)
    return greedy_rule(logits, drafts)


def greedy_rule(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[int, torch.Tensor]:
    """``greedy_verification`` step by step: every row's argmax, then the leading run of drafts equal to them."""
    best = argmax(logits)
    n = 0
    for draft, top in zip(drafts.tolist(), best.tolist()):  # on the host: a few ints, no tensor operations
        if draft != top:
            break
        n += 1
    return n, best[n]
