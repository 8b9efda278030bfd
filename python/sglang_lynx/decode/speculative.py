"""Accept/reject math of Lynx's chain verification (pure torch, no SGLang).

Lifecycle of one verification (one request):

1. While drafting on the anchor-only KV the request produced draft tokens ``d_1 .. d_n`` after the
   exact first token ``t_0``; with temperature > 0 the draft distribution ``q_i`` it sampled ``d_i``
   from is kept.
2. When the residual lands, ONE forward pass on the full KV over the inputs ``t_0, d_1, .., d_{n-1}``
   (optionally also ``d_n``) gives target logits ``z_0 .. z_{m-1}`` with ``m = n`` (or ``n + 1``);
   ``z_i`` scores the token that follows input ``i``, i.e. it is the target's view of ``d_{i+1}``.
3. A function below decides how many drafts survive and which token replaces the first rejected one.

Greedy (:func:`greedy_chain_accept`)::

    k = max { j <= n : argmax z_i == d_{i+1} for all i < j }          (longest agreeing prefix)
    k < n        -> emit d_1..d_k, then c = argmax z_k                (correction at the mismatch)
    k == n, m>n  -> emit d_1..d_n, then b = argmax z_n                (bonus token)
    k == n, m==n -> emit d_1..d_n                                     (nothing more is known)

The emitted stream equals greedy decoding on the full KV, because each emitted token is the full-KV
argmax given exactly the emitted tokens before it.

Near-ties (``tie_margin > 0``): the verify pass runs SGLang's extend kernels, plain decoding runs
its decode kernels, and in 16-bit dtypes the two round differently (measured: ``benchmark/decode``).
Where the target's top-2 logit margin at position ``i`` is ``<= tie_margin`` the extend argmax may
differ from what the decode kernel would pick, and corrections happen precisely at such positions
(the anchor changed the argmax there). So with a margin guard::

    u = min { i : top1(z_i) - top2(z_i) <= tie_margin }                 (first uncertain position)
    k' = min(k, u)  -> emit d_1..d_k'; a correction (or bonus) only if its position is certain

and the decode step after re-admission computes the token at ``k'`` with the decode kernel, as
non-speculative decoding would. ``tie_margin = 0`` is the exact rule above (exact ties only).

Speculative sampling (:func:`speculative_sample_chain`, Leviathan et al. 2023; Chen et al. 2023)::

    for i = 0 .. n-1:  p = p_i (target),  q = q_i (draft),  d = d_{i+1}
        draw r ~ U[0, 1);  accept d if  r * q(d) < p(d)       (i.e. r < min(1, p(d) / q(d)))
        otherwise emit x ~ norm(max(0, p - q)) and stop
    all accepted and m > n: emit x ~ p_n  (bonus)

Why the output follows p: P(emit x) = q(x) min(1, p(x)/q(x)) + beta * max(0, p(x)-q(x)) / Z
= min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x), because the rejection probability
beta = 1 - sum_y min(p(y), q(y)) equals Z = sum_y max(0, p(y) - q(y)).
Edge cases: ``q(d) = 0 < p(d)`` accepts (``0 < p(d)``); if ``Z`` underflows to 0 after a rejection
(p == q up to rounding) the replacement is drawn from ``p`` itself, which is then the same law.

Invariants: inputs are validated (shapes, finite values, probability rows summing to 1); the
result always emits at least one token unless ``n == m == 0``; ``num_accepted <= n``.

Device (issue 17): the functions compute where their inputs are (the logits' device on a GPU server)
and refuse inputs on different devices (drafts, laws, generator); each verdict reads back to the host
in one copy (greedy) or two (sampling: the accept vector, then the one token drawn); no per-element
reads. ``tests/decode/test_device_discipline.py`` runs them under a device guard on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Tolerance on probability rows summing to one.
PROB_SUM_TOLERANCE = 1e-3

#: Greedy tie margin (logits) used when the configuration says "automatic", the model computes in a
#: 16-bit dtype and the verify pass is NOT computed like the decode step (a GPU extend kernel).
#: Measured in bf16 with the torch_native extend (``benchmark/decode/RESULTS.md``, 24 prompts x 32
#: drafts): extend and decode disagreed only where the top-2 margin was 0 or 0.25; with this guard the
#: released tokens equalled plain decoding in 24/24 prompts (14/24 without), at 11.6 instead of 25.3
#: accepted drafts of 32. ``verify_tie_margin = 0`` trades that equality for acceptance.
AUTO_TIE_MARGIN_16BIT = 0.25


def auto_tie_margin(configured: float, dtype: torch.dtype, verify_is_decode_exact: bool = False) -> float:
    """The tie margin to verify with: ``configured`` if >= 0; else 0 where the verify logits are the
    decode step's (``verify_is_decode_exact``: the verify runs as a decode batch with 1-row GEMMs,
    KV and logits bit-identical to decode steps in bf16, ``tests/decode/test_verify_bf16_exact.py``)
    or the dtype is fp32/fp64 (the kernels agree on the argmax there), and
    :data:`AUTO_TIE_MARGIN_16BIT` otherwise."""
    if configured >= 0.0:
        return configured
    if verify_is_decode_exact or dtype in (torch.float32, torch.float64):
        return 0.0
    return AUTO_TIE_MARGIN_16BIT


@dataclass(frozen=True)
class ChainVerdict:
    """Outcome of verifying ``num_drafts`` drafts.

    ``num_accepted`` drafts are kept (a prefix); ``next_token`` is the correction at the first
    mismatch, the bonus after a full accept, or None when a full accept has no bonus logits.
    """

    num_drafts: int
    num_accepted: int
    next_token: int | None

    @property
    def fully_accepted(self) -> bool:
        return self.num_accepted == self.num_drafts

    def emitted(self, drafts: list[int]) -> list[int]:
        """The verified tokens to append after ``t_0``: accepted drafts then ``next_token``."""
        out = list(drafts[: self.num_accepted])
        if self.next_token is not None:
            out.append(self.next_token)
        return out


def _check_chain_shapes(draft_tokens: torch.Tensor, scores: torch.Tensor, what: str) -> int:
    """Shape checks (host metadata only, no device read); returns the number of drafts."""
    if draft_tokens.dim() != 1:
        raise ValueError(f"draft_tokens must be 1-D, got shape {tuple(draft_tokens.shape)}")
    if scores.dim() != 2:
        raise ValueError(f"{what} must be 2-D [positions, vocab], got shape {tuple(scores.shape)}")
    n, m = draft_tokens.numel(), scores.shape[0]
    if m not in (n, n + 1):
        raise ValueError(f"{what} has {m} rows for {n} drafts; expected {n} or {n + 1}")
    if not _same_device(draft_tokens.device, scores.device):
        raise ValueError(f"draft_tokens are on {draft_tokens.device}, {what} on {scores.device}: keep the drafts "
                         "where the logits are")
    return n


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _value_flags(draft_tokens: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``[draft outside the vocabulary, non-finite score]`` as a device tensor (read with the verdict)."""
    vocab = scores.shape[1]
    out_of_vocab = ((draft_tokens < 0) | (draft_tokens >= vocab)).any()
    return torch.stack([out_of_vocab, ~torch.isfinite(scores).all()])


def _raise_value_flags(flags: list[int], what: str, vocab: int) -> None:
    if flags[0]:
        raise ValueError(f"a draft token is outside the vocabulary [0, {vocab})")
    if flags[1]:
        raise ValueError(f"{what} contains NaN or Inf")


def _to_host(*parts: torch.Tensor) -> list[list[int]]:
    """Several small device results read back in ONE device-to-host copy (as int lists)."""
    sizes = [int(p.numel()) for p in parts]
    flat = torch.cat([p.reshape(-1).to(torch.int64) for p in parts]).tolist()
    out, at = [], 0
    for size in sizes:
        out.append(flat[at: at + size])
        at += size
    return out


def greedy_chain_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                        tie_margin: float = 0.0) -> ChainVerdict:
    """Longest prefix where the target argmax equals the draft, plus correction or bonus.

    ``target_logits[i]`` scores the token after input ``i`` (see the module docstring); it has
    ``n`` rows (no bonus) or ``n + 1`` rows (bonus after a full accept). With ``tie_margin > 0``
    acceptance also stops at the first position whose top-2 margin is ``<= tie_margin``, and no
    token is emitted for that position (the caller's next decode step computes it).

    Device: everything is computed where the logits are (``draft_tokens`` must be there too) and the
    verdict's inputs come back to the host in one copy.
    """
    n = _check_chain_shapes(draft_tokens, target_logits, "target_logits")
    if not tie_margin >= 0.0:
        raise ValueError(f"tie_margin must be >= 0, got {tie_margin}")
    target = target_logits.argmax(dim=-1).to(torch.long)
    if tie_margin > 0.0 and target_logits.shape[1] > 1:
        top2 = target_logits.float().topk(2, dim=-1).values
        certain = (top2[:, 0] - top2[:, 1]) > tie_margin
    else:
        certain = torch.ones(target_logits.shape[0], dtype=torch.bool, device=target_logits.device)
    agree = target[:n] == draft_tokens.to(torch.long)
    flags, target_h, certain_h, agree_h = _to_host(_value_flags(draft_tokens, target_logits), target, certain, agree)
    _raise_value_flags(flags, "target_logits", target_logits.shape[1])
    k = next((i for i in range(n) if not (agree_h[i] and certain_h[i])), n)
    if k < n:
        return ChainVerdict(n, k, target_h[k] if certain_h[k] else None)
    has_bonus = target_logits.shape[0] > n and bool(certain_h[n])
    return ChainVerdict(n, n, target_h[n] if has_bonus else None)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))`` along the last axis; rows where it vanishes fall back to ``p``."""
    if p.shape != q.shape:
        raise ValueError(f"p and q differ in shape: {tuple(p.shape)} vs {tuple(q.shape)}")
    diff = torch.clamp(p.double() - q.double(), min=0.0)
    total = diff.sum(dim=-1, keepdim=True)
    safe = torch.where(total > 0, diff / torch.where(total > 0, total, torch.ones_like(total)), p.double())
    return safe.to(p.dtype)


def _prob_flags(probs: torch.Tensor) -> torch.Tensor:
    """``[non-finite or negative entry, a row not summing to 1]`` as a device tensor."""
    bad_values = ~torch.isfinite(probs).all() | (probs < 0).any()
    bad_sums = ((probs.double().sum(dim=-1) - 1.0).abs() > PROB_SUM_TOLERANCE).any()
    return torch.stack([bad_values, bad_sums])


def _raise_prob_flags(flags: list[int], probs: torch.Tensor, what: str) -> None:
    if flags[0]:
        raise ValueError(f"{what} must be finite and non-negative")
    if flags[1]:
        raise ValueError(f"{what} rows must sum to 1 (got sums {probs.double().sum(dim=-1).tolist()})")


def _check_generator(generator: torch.Generator | None, device: torch.device) -> None:
    if generator is not None and not _same_device(generator.device, device):
        raise ValueError(f"the generator is on {generator.device}, the probabilities on {device}: make the "
                         "request's generator on the logits' device")


def speculative_sample_chain(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> ChainVerdict:
    """Speculative sampling over a chain: the emitted tokens follow ``target_probs`` exactly.

    ``draft_probs[i]`` is the distribution ``d_{i+1}`` was sampled from (shape ``[n, V]``);
    ``target_probs`` has ``n`` or ``n + 1`` rows (the last one for the bonus token). Both are the
    distributions *after* temperature / top-k / top-p, exactly as the sampler uses them.

    Device: drafts, both laws and ``generator`` live where ``target_probs`` are; the uniforms are drawn
    there and every acceptance test runs there; the host reads the accept vector (with the validity
    flags) once and the one replacement or bonus token once. The random stream is consumed as by a
    token-by-token loop: ``n`` uniforms, then at most one multinomial draw.
    """
    n = _check_chain_shapes(draft_tokens, target_probs, "target_probs")
    if draft_probs.shape != (n, target_probs.shape[1]):
        raise ValueError(
            f"draft_probs must be [{n}, {target_probs.shape[1]}], got {tuple(draft_probs.shape)}"
        )
    device = target_probs.device
    if not _same_device(draft_probs.device, device):
        raise ValueError(f"draft_probs are on {draft_probs.device}, target_probs on {device}")
    _check_generator(generator, device)
    uniforms = torch.rand(n, generator=generator, dtype=torch.float64, device=device)
    vocab = target_probs.shape[1]
    safe = draft_tokens.to(torch.long).clamp(0, max(vocab - 1, 0))  # never index out of range on a device
    rows = torch.arange(n, device=device)
    p_tok = target_probs[:n].double()[rows, safe]
    q_tok = draft_probs.double()[rows, safe]
    accept = uniforms * q_tok < p_tok
    flags, p_flags, q_flags, accept_h = _to_host(_value_flags(draft_tokens, target_probs), _prob_flags(target_probs),
                                                 _prob_flags(draft_probs), accept)
    _raise_value_flags(flags, "target_probs", vocab)
    _raise_prob_flags(q_flags, draft_probs, "draft_probs")
    _raise_prob_flags(p_flags, target_probs, "target_probs")
    k = next((i for i in range(n) if not accept_h[i]), n)
    if k < n:
        residual = residual_distribution(target_probs[k].double(), draft_probs[k].double())
        replacement = int(torch.multinomial(residual, 1, generator=generator))
        return ChainVerdict(n, k, replacement)
    if target_probs.shape[0] > n:
        bonus = int(torch.multinomial(target_probs[n].double(), 1, generator=generator))
        return ChainVerdict(n, n, bonus)
    return ChainVerdict(n, n, None)


def sampling_distribution(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = -1,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """Row-wise distribution a sampler with these parameters draws from (temperature > 0).

    Order and tie rules as in SGLang's torch sampler (``top_k_top_p_min_p_sampling_from_probs_torch``,
    the CPU backend): temperature, softmax, then on the probabilities sorted in descending order drop
    ranks ``>= top_k``, drop entries whose cumulative mass *before* them exceeds ``top_p``, drop
    entries below ``min_p`` times the largest; renormalise. ``top_k <= 0`` or ``>= vocab`` means no
    top-k; ``top_p >= 1`` no top-p; ``min_p <= 0`` no min-p. (FlashInfer's fused GPU sampler filters
    top-k and top-p jointly with the same cut-offs up to ties at the boundary.)
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for a sampling distribution, got {temperature}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [positions, vocab], got shape {tuple(logits.shape)}")
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    vocab = probs.shape[-1]
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if 0 < top_k < vocab:
        keep[:, top_k:] = False
    if top_p < 1.0:
        cumulative_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep &= cumulative_before <= top_p
    if min_p > 0.0:
        keep &= sorted_probs >= min_p * sorted_probs[:, :1]
    keep[:, 0] = True
    masked_sorted = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    masked = torch.zeros_like(probs).scatter(-1, order, masked_sorted)
    return masked / masked.sum(dim=-1, keepdim=True)
