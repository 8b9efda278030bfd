"""SGLang's KV pages seen from the Lynx transport: page indices in, token slots out (pure functions).

Two "pages" meet here and must not be confused:

- **SGLang's page** (``--page-size``, ``ps``; default 1): the KV pool's allocation unit. A pool page
  ``p`` holds the token slots ``p * ps .. p * ps + ps - 1`` (``MHATokenToKVPool.k_buffer[layer]`` is
  indexed by token slot). SGLang's PD transfer works on page indices: the decode's
  ``dst_kv_indices`` (sent in its metadata) and the prefill's ``kv_indices`` of each chunk (every
  chunk but the last ends on a page boundary) are page indices, and the last page of a prompt is
  partial when the prompt length ``T`` is not a multiple of ``ps``.
- **Lynx's codec page** (``LynxConfig.page_tokens``, ``P``, default 256): the unit of the codec's
  page-level normalisation and of the prefill's encoded-page reuse. The codec sees one request as a
  sequence of exactly ``T`` tokens, cut into codec pages of ``P`` (the last one partial); it knows
  nothing of SGLang's pages.

How they relate: both sides turn SGLang's page indices into the request's ``T`` token slots
(:func:`token_slots`, in prompt order; the unused tail of the last SGLang page is never read, encoded,
sent or written), so the encoded streams of a request are the same bytes at every page size, and codec
page ``j`` covers prompt positions ``j*P .. j*P + P - 1``. When ``ps`` divides ``P`` (16 or 64 with
the default 256) every codec-page boundary is an SGLang-page boundary, so a prefix the radix cache
shares (whole SGLang pages) holds whole codec pages, which the prefill reuses encoded. Other page
sizes work the same way; reuse then covers only the codec pages that end inside the shared prefix.

``T`` itself is not in SGLang's page lists: the decode side reads it where SGLang turns the request's
token slots into page indices (``DecodePreallocQueue._transfer_page_indices``, an AFTER hook that
leaves it on the request's receiver) and sends it to the prefill in the Lynx metadata frame
(``tokens``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class PageLayoutError(ValueError):
    """Page indices that cannot hold the request's tokens (a bug or a hostile peer)."""


def pages_for(tokens: int, page_size: int) -> int:
    """How many SGLang pages hold ``tokens`` tokens."""
    if page_size < 1:
        raise PageLayoutError(f"page size must be >= 1, got {page_size}")
    return -(-int(tokens) // page_size)


def token_slots(page_indices: Any, page_size: int, tokens: int | None = None) -> torch.Tensor:
    """The int64 KV-pool token slots of ``tokens`` tokens laid in ``page_indices`` in order: slot of
    token ``i`` = ``page_indices[i // page_size] * page_size + i % page_size``. ``tokens`` defaults to
    every slot of the pages; with fewer the last page is partial (its tail is left out)."""
    pages = torch.from_numpy(np.asarray(page_indices, dtype=np.int64).reshape(-1).copy())
    if page_size < 1:
        raise PageLayoutError(f"page size must be >= 1, got {page_size}")
    if tokens is None:
        tokens = int(pages.numel()) * page_size
    if pages_for(tokens, page_size) != pages.numel():
        raise PageLayoutError(f"{tokens} tokens at page size {page_size} need {pages_for(tokens, page_size)} "
                              f"pages, got {pages.numel()}")
    if page_size == 1:
        return pages
    offsets = torch.arange(page_size, dtype=torch.int64)
    return (pages[:, None] * page_size + offsets[None, :]).reshape(-1)[:tokens]
