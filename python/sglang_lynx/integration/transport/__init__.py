"""The Lynx KV transport inside SGLang's PD path, by side.

- ``kv_manager``: the KV manager and receiver classes swapped into SGLang (``get_kv_class``);
  registration, metadata, staging reservation and the server-info block.
- ``prefill_side`` / ``decode_side``: what each server does with a request's streams.
- ``codec`` (encode/decode against the KV pool), ``page_cache`` (radix-aware encoded-page reuse),
  ``arena`` (staging arenas sized from the model), ``wire`` (frames), ``inbound`` (landed streams),
  ``faults`` (test-only fault injection, inert unless ``SGLANG_LYNX_TEST_HOOKS=1``).
"""
