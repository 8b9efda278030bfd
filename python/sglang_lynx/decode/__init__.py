"""Progressive speculative decoding, pure logic (no SGLang import).

- ``speculative``: greedy chain acceptance and speculative sampling (accept/reject math).
- ``state``: per-request phase enum, checked transitions, releasable-token count, ``next_action``
  decision function and the ``LandingProgress`` protocol the transport implements.
"""
