"""Triton kernels for the Lynx codec (each beside its torch reference in sglang_lynx.codec)."""
