"""Draft distributions for speculative sampling (mode ``lynx``, temperature > 0) and who may draft.

Lifecycle of one sampling Lynx request on the decode server:

1. **admission** (``decode.scheduler._track_new``): :func:`speculation_blocker` says whether the
   request may draft at all. Anything that changes the sampler's logits beyond temperature / top-k /
   top-p / min-p (penalties, logit bias, grammar, custom logit processors, min_new_tokens, watermarks)
   or that returns per-token data tied to drafts (logprobs, hidden states) cannot be verified exactly
   by :func:`sglang_lynx.decode.speculative.speculative_sample_chain`; such requests wait for the
   residual and decode normally (lossless, no speed-up). A sampling request that may draft is
   registered with ``DraftLaws.watch`` (its server's :class:`DraftLaws`, owned by the scheduler's
   ``decode.state.DecodeLynxState``).
2. **drafting**: every decode step runs ``Scheduler.run_batch`` -> ... -> ``Sampler.forward`` (in
   the overlap loop a batch with a grammar request samples later, in
   ``Scheduler.launch_batch_sample_if_needed``). The AROUND hooks on ``run_batch`` and
   ``launch_batch_sample_if_needed`` name the batch's requests and its scheduler's records for the
   call; the AROUND hook on ``Sampler.forward`` reads each watched row's logits *before* the
   sampler overwrites them in place, turns them into the exact distribution the sampler draws from
   (:func:`~sglang_lynx.decode.speculative.sampling_distribution`, SGLang's order and tie rules)
   and records it with the token the sampler returned.
3. **verify** (``decode.commit``): ``DraftLaws.draft_probs_for`` returns the recorded rows for the
   request's drafts, or None when the record does not match them token for token (then the verifier
   rejects every draft and samples the first position from the target: still exact, just slower).
4. **done**: ``DraftLaws.forget`` drops the record (after verify, on abort, on finish); before
   every batch ``DraftLaws.retain`` drops the record of any request the scheduler hooks no longer
   track (a request that ended by a path that never reached ``forget`` cannot keep its rows).

Memory bound: a record holds at most ``max_rows`` rows (the request's ``max_draft_tokens``, given to
``DraftLaws.watch``); a row past that marks the record overflowed (its rows are freed, and
``DraftLaws.draft_probs_for`` then returns None: every draft is rejected, still exact). Each row
is kept compact and exact: where the law has few non-zero entries only those are kept (int32 index +
float32 value), else the dense float32 row; ``DraftLaws.draft_probs_for`` rebuilds the dense
``[n, vocab]`` rows bit for bit, so the speculative-sampling math (``decode/speculative.py``) sees
exactly the law the sampler drew from. On the CPU the non-zero entries are found by value (top-k,
top-p and min-p all truncate); on a GPU finding them would read the count back every step, so only a
top-k bound (known from the parameters, ``topk`` needs no read) makes a row compact there.

Device (issue 17): rows and tokens stay on the logits' device; a decode step reads nothing back to
the host (the token is kept as a device scalar, not ``int()``-ed); ``DraftLaws.draft_probs_for``
compares the recorded tokens with the drafts in one read per verification.

Invariants: a record only ever holds rows for tokens the sampler really returned, in order; rows
are float32 on the logits' device; nothing here changes what SGLang samples.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_lynx.decode.speculative import sampling_distribution
from sglang_lynx.integration.decode.tracked import STATE_ATTR

DEFAULT_MAX_ROWS = 64


@dataclass(frozen=True)
class SparseRow:
    """The non-zero entries of one probability row (exact: the same float32 values)."""

    vocab: int
    index: torch.Tensor  # int32
    value: torch.Tensor  # float32

    def dense(self) -> torch.Tensor:
        row = torch.zeros(self.vocab, dtype=torch.float32, device=self.value.device)
        row[self.index.long()] = self.value
        return row


def compact_row(row: torch.Tensor, top_k: int = -1) -> torch.Tensor | SparseRow:
    """``row`` itself, or its non-zero entries when that is smaller (8 bytes per entry vs 4 per token).

    ``top_k``: the sampler's top-k (``<= 0``: none). Off the CPU only that bound is used (module
    docstring): the ``top_k`` largest entries hold every non-zero one, found without a host read."""
    if row.device.type != "cpu":
        if top_k > 0 and 2 * top_k < row.numel():
            top = row.topk(top_k)
            return SparseRow(row.numel(), top.indices.to(torch.int32), top.values.clone())
        return row
    nonzero = torch.nonzero(row, as_tuple=True)[0]
    if 2 * nonzero.numel() >= row.numel():
        return row
    return SparseRow(row.numel(), nonzero.to(torch.int32), row[nonzero].clone())


def dense_row(row: torch.Tensor | SparseRow) -> torch.Tensor:
    return row.dense() if isinstance(row, SparseRow) else row


@dataclass
class DraftRecord:
    """The sampler's output for one request while it drafts: tokens and the rows they came from."""

    token_ids: list[torch.Tensor | int] = field(default_factory=list)  # device scalars from the sampler
    probs: list[torch.Tensor | SparseRow] = field(default_factory=list)
    max_rows: int = DEFAULT_MAX_ROWS
    overflowed: bool = False

    @property
    def tokens(self) -> list[int]:
        """The recorded tokens as ints (one device-to-host read; at verification and in tests)."""
        if not self.token_ids:
            return []
        if not all(isinstance(t, torch.Tensor) for t in self.token_ids):  # ints (or a mix): read one by one
            return [int(t) for t in self.token_ids]
        stacked = torch.stack([t.reshape(()).to(torch.int64) for t in self.token_ids])  # type: ignore[union-attr]
        return [int(t) for t in stacked.tolist()]

    @tokens.setter
    def tokens(self, values: list[int]) -> None:
        self.token_ids = list(values)

    def add(self, token: torch.Tensor | int, row: torch.Tensor, top_k: int = -1) -> None:
        """Record the sampler's ``token`` and the law ``row`` it came from (``top_k``: the request's,
        bounding the row's non-zero entries, see :func:`compact_row`)."""
        if self.overflowed:
            return
        if len(self.token_ids) >= self.max_rows:  # more drafts than the window: no exact record (rejected)
            self.overflowed = True
            self.token_ids, self.probs = [], []
            return
        self.token_ids.append(token)
        self.probs.append(compact_row(row, top_k))

    def nbytes(self) -> int:
        return sum(p.index.numel() * 4 + p.value.numel() * 4 if isinstance(p, SparseRow) else p.numel() * 4
                   for p in self.probs)


class DraftLaws:
    """One decode server's draft-law records, by rid (owned by its ``decode.state.DecodeLynxState``)."""

    def __init__(self) -> None:
        self.records: dict[str, DraftRecord] = {}

    def watch(self, rid: str, max_rows: int = DEFAULT_MAX_ROWS) -> None:
        self.records[rid] = DraftRecord(max_rows=max_rows)

    def forget(self, rid: str) -> None:
        self.records.pop(rid, None)

    def retain(self, rids: Any) -> None:
        """Drop every record whose request is not in ``rids`` (the requests still tracked)."""
        for rid in [r for r in self.records if r not in rids]:
            del self.records[rid]

    def draft_probs_for(self, rid: str, drafts: list[int]) -> torch.Tensor | None:
        """``[n, vocab]`` rows the drafts were sampled from, or None if the record does not match."""
        record = self.records.get(rid)
        if record is None or record.overflowed or not drafts or len(record.token_ids) != len(drafts):
            return None
        if record.tokens != list(drafts):
            return None
        return torch.stack([dense_row(p) for p in record.probs])


# The batch the current thread's ``Scheduler.run_batch`` is running, while it runs: its scheduler's
# records and its requests in row order (set and reset by _around_run_batch; the sampler hook reads it).
# Per call, not per server: each SGLang scheduler runs its batches in its own thread.
_RUNNING: ContextVar[tuple[DraftLaws, list[Any]] | None] = ContextVar("lynx_sampled_batch", default=None)


def laws_of(scheduler: Any) -> DraftLaws | None:
    """The draft-law records of ``scheduler``'s Lynx state (``decode.state``), None without one."""
    laws = getattr(getattr(scheduler, STATE_ATTR, None), "laws", None)
    return laws if isinstance(laws, DraftLaws) else None


def speculation_blocker(req: Any) -> str | None:
    """Why ``req`` must not draft (a reason for ``meta_info``), or None when it may."""
    sp = req.sampling_params
    checks = (
        (float(getattr(sp, "frequency_penalty", 0.0) or 0.0) != 0.0, "frequency_penalty"),
        (float(getattr(sp, "presence_penalty", 0.0) or 0.0) != 0.0, "presence_penalty"),
        (float(getattr(sp, "repetition_penalty", 1.0) or 1.0) != 1.0, "repetition_penalty"),
        (int(getattr(sp, "min_new_tokens", 0) or 0) > 0, "min_new_tokens"),
        (getattr(sp, "logit_bias", None) is not None, "logit_bias"),
        (getattr(sp, "watermark", None) is not None, "watermark"),
        (getattr(req, "grammar", None) is not None, "a grammar (json_schema / regex / ebnf)"),
        (getattr(req, "custom_logit_processor", None) is not None, "a custom logit processor"),
        (bool(getattr(req, "return_logprob", False)), "return_logprob"),
        (bool(getattr(req, "return_hidden_states", False)), "return_hidden_states"),
    )
    reasons = [name for blocked, name in checks if blocked]
    if reasons:
        return "no speculation: " + ", ".join(reasons) + " (drafts could not be verified exactly)"
    return None


def is_greedy(req: Any) -> bool:
    sp = req.sampling_params
    return int(getattr(sp, "top_k", -1)) == 1 or float(getattr(sp, "temperature", 1.0)) == 0.0


def row_distribution(logits_row: torch.Tensor, sampling_params: Any) -> torch.Tensor:
    """The distribution SGLang's sampler draws one token from, for one row of raw logits."""
    return sampling_distribution(
        logits_row.reshape(1, -1),
        float(sampling_params.temperature),
        top_k=int(sampling_params.top_k),
        top_p=float(sampling_params.top_p),
        min_p=float(sampling_params.min_p),
    )[0].to(torch.float32)


def _around_run_batch(original: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    laws = laws_of(scheduler)
    if laws is None or not laws.records or batch is None:
        return original(scheduler, batch, *args, **kwargs)
    token = _RUNNING.set((laws, list(getattr(batch, "reqs", []) or [])))
    try:
        return original(scheduler, batch, *args, **kwargs)
    finally:
        _RUNNING.reset(token)


def _around_delayed_sample(original: Any, scheduler: Any, batch_result: Any, cur_batch: Any, *args: Any,
                           **kwargs: Any) -> Any:
    """Overlap loop: a batch whose sampling SGLang delays (``delay_sample_func``: a grammar in the
    batch) samples here, after ``run_batch`` returned; name the batch for the sampler hook the same way."""
    laws = laws_of(scheduler)
    delayed = getattr(batch_result, "delay_sample_func", None) is not None
    if laws is None or not laws.records or cur_batch is None or not delayed:
        return original(scheduler, batch_result, cur_batch, *args, **kwargs)
    token = _RUNNING.set((laws, list(getattr(cur_batch, "reqs", []) or [])))
    try:
        return original(scheduler, batch_result, cur_batch, *args, **kwargs)
    finally:
        _RUNNING.reset(token)


def _around_sampler_forward(original: Any, sampler: Any, logits_output: Any, sampling_info: Any,
                            *args: Any, **kwargs: Any) -> Any:
    running = _RUNNING.get()
    laws, reqs = running if running is not None else (None, [])
    logits = getattr(logits_output, "next_token_logits", None)
    if laws is None or not reqs or logits is None or logits.dim() != 2 or logits.shape[0] != len(reqs):
        return original(sampler, logits_output, sampling_info, *args, **kwargs)
    rows = {i: req for i, req in enumerate(reqs) if req.rid in laws.records}
    probs = {i: row_distribution(logits[i], req.sampling_params) for i, req in rows.items()}
    next_ids = original(sampler, logits_output, sampling_info, *args, **kwargs)
    tokens = next_ids[0] if isinstance(next_ids, tuple) else next_ids
    for i, req in rows.items():
        record = laws.records.get(req.rid)
        if record is not None:  # the token stays where the sampler put it (no per-step host read)
            token = tokens[i].clone() if isinstance(tokens, torch.Tensor) else int(tokens[i])
            record.add(token, probs[i], int(getattr(req.sampling_params, "top_k", -1) or -1))
    return next_ids


SAMPLING_HOOKS = (
    ("sglang.srt.managers.scheduler.Scheduler.run_batch", _around_run_batch, "around"),
    ("sglang.srt.managers.scheduler.Scheduler.launch_batch_sample_if_needed", _around_delayed_sample, "around"),
    ("sglang.srt.layers.sampler.Sampler.forward", _around_sampler_forward, "around"),
)
