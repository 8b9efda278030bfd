"""The Lynx KV transport inside SGLang's PD path, by side.

- ``kv_manager``: the hooks on SGLang's PD path (``get_kv_class``, registration and metadata frames,
  pool hand-over, KV frees, the server-info block) and ``install_transport_hooks``;
  ``kv_classes``: the KV manager and receiver subclasses ``get_kv_class`` returns (staging reservation).
- ``prefill_side`` / ``decode_side``: what each server does with a request's streams. The prefill side
  is one class over four modules: ``prefill_base`` (its state, arena and scheduler callbacks),
  ``prefill_buffered`` (whole-request encode after the last chunk), ``prefill_streaming`` (parts
  encoded while the prefill runs; per-request states in ``prefill_stream``) and ``prefill_peers``
  (which request a chunk belongs to, how a chunk is refused).
- ``codec`` (encode/decode against the KV pool), ``page_cache`` (radix-aware encoded-page reuse),
  ``arena`` (staging arenas sized from the model), ``wire`` (frames), ``inbound`` (landed streams),
  ``exact_prefetch`` (``lynx-exact``: the BF16 KV restored on the decode while the parts land),
  ``faults`` (test-only fault injection, inert unless ``SGLANG_LYNX_TEST_HOOKS=1``).
"""
