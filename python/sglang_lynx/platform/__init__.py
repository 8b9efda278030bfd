"""Host detection and the pre-import CPU boot shim (imports neither sglang nor torch)."""
