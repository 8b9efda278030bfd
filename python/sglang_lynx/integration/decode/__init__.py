"""Progressive (``lynx``) decoding inside SGLang's decode scheduler.

``install`` registers the hooks; ``scheduler`` owns the per-request lifecycle (admission on the
anchor, drafting, parking, verify, fallback); ``state`` / ``tracked`` hold the per-server and
per-request state; ``commit`` / ``verify`` / ``row_gemm`` are the chain verify; ``sampling`` the
draft laws for speculative sampling; ``actions``, ``streaming``, ``metrics`` the rest.
"""
