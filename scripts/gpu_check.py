"""The prepared GPU check (issue 17): what of sglang-lynx can run on a bare CUDA machine, in one run.

Run it through ``scripts/gpu_check.sh OUT_DIR`` (a bare machine needs only torch and triton: no SGLang,
no Mooncake, no pytest). Four parts, each recorded in ``OUT_DIR/gpu_check.json`` with a pass flag:

1. ``kernels``: the Triton encode / decode-into-pool against the torch reference (on the CPU), for the
   lynx codecs, keys and values, bf16 and fp16 input and pool, full and partial pages, the layer
   trailer: streams byte-identical, decoded values identical (anchor-only and full); the page-range
   encode (a streaming prefill's) against the reference page encoder;
2. ``throughput``: encode and decode (anchor-only, full) GB/s of bf16 KV against a device-to-device
   copy of the same bytes in the same run (the issue's target: >= 50% of the copy);
3. ``decode_math``: the decode side on device tensors: greedy accept (device verdicts equal the
   host's), speculative sampling with a device generator (chi-square of the emitted token against
   the target law), and the real sampler hook + verify (``integration.decode``: draft laws recorded on
   the device, one verification) with no device error;
4. ``pool_layout``: a whole request through the transport codec (``integration.transport.codec``):
   the streams staged to the device, anchor-only decode into scattered pool slots, then the upgrade,
   against the reference pools; the same for the runtime's fallback (the reference on the CPU, copied
   into the device pool); the reference run on CUDA tensors is recorded, not required.

``--device cpu`` runs the same code on the CPU with the Triton kernels interpreted
(``TRITON_INTERPRET=1``, set here before triton is imported) at small sizes: the CI test
``tests/foundation/test_gpu_check.py`` runs it so, so the script is known to work before a GPU sees it.
The JSON also records that neither ``sglang`` nor ``mooncake`` was imported.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def setup_imports(device: str) -> None:
    """``python/`` on the path and ``sglang_lynx.kernels`` = ``kernels/`` (as the install maps it)."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    sys.path.insert(0, str(ROOT / "python"))
    import sglang_lynx

    if importlib.util.find_spec("sglang_lynx.kernels") is None:
        spec = importlib.util.spec_from_file_location(
            "sglang_lynx.kernels", ROOT / "kernels" / "__init__.py", submodule_search_locations=[str(ROOT / "kernels")])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["sglang_lynx.kernels"] = module
        spec.loader.exec_module(module)
        sglang_lynx.kernels = module  # type: ignore[attr-defined]


_STARTED = time.monotonic()
_VERBOSE = False


def progress(message: str) -> None:
    """One line per step with ``--verbose`` (seconds since start): where a slow or hung run is."""
    if _VERBOSE:
        print(f"[gpu_check +{time.monotonic() - _STARTED:7.2f} s] {message}", flush=True)


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_kernels(device: Any, small: bool) -> dict[str, Any]:
    import torch
    from sglang_lynx.kernels import lynx_triton as lt

    from sglang_lynx.codec.layout import LayoutParams
    from sglang_lynx.codec.registry import get_codec

    params_sets = {"default": LayoutParams(), "small-pages": LayoutParams(page_tokens=32, chunk_tokens=8,
                                                                        recent_tokens=4, sink_tokens=2)}
    shapes = {"default": [(300, 1, 32)], "small-pages": [(70, 2, 32)]} if small else {
        "default": [(70, 2, 64), (1000, 4, 128), (4096, 8, 128)], "small-pages": [(70, 2, 64), (1000, 4, 128)]}
    dtypes = (torch.bfloat16, torch.float16)
    cases, failures = 0, []
    gen = torch.Generator().manual_seed(0)
    for pname, params in params_sets.items():
        for tokens, heads, dim in shapes[pname]:
            for in_dtype in dtypes:
                x = (torch.randn(tokens, heads, dim, generator=gen) * 2).to(in_dtype)
                # small (the interpreted CPU run): each codec in one dtype, to stay within a CI minute
                names = [n for i, n in enumerate(("lynx", "lynx-int8", "lynx-int4"))
                         if not small or dtypes[i % 2] == in_dtype]
                for name in names:
                    codec = get_codec(name, **vars(params))
                    for kind in ("k", "v"):
                        cases += 1
                        where = f"{pname} {name} {kind} {in_dtype} {tokens}x{heads}x{dim}"
                        progress(f"kernels case {cases}: {where}")
                        want = codec.encode(x, kind)
                        got = lt.encode(x.to(device), kind, params=params, codec_name=name)
                        _sync(device)
                        progress("  encoded (reference, then Triton)")
                        if not (torch.equal(got.anchor.cpu(), want.anchor)
                                and torch.equal(got.residual.cpu(), want.residual)):
                            failures.append(f"encode {where}")
                            continue
                        pages = -(-tokens // params.page_tokens)
                        if pages > 1 and not _page_ranges_equal(lt, codec, x, kind, params, name, pages, device):
                            failures.append(f"encode_pages_into {where}")
                        slots = torch.randperm(tokens + 9, generator=gen)[:tokens]
                        for full in (False, True) if name != "lynx-int4" else (False,):
                            pool = torch.full((tokens + 9, heads, dim), 7.0, dtype=in_dtype, device=device)
                            lt.decode_into(want.anchor.to(device), want.residual.to(device) if full else None, pool,
                                           slots.to(device), kind=kind, params=params)
                            ref = codec.decode(want, with_residual=full, dtype=in_dtype)
                            if not torch.equal(pool.cpu()[slots], ref):
                                failures.append(f"decode{' full' if full else ' anchor'} {where}")
    return {"passed": not failures, "cases": cases, "failures": failures[:20]}


def _page_ranges_equal(lt: Any, codec: Any, x: Any, kind: str, params: Any, name: str, pages: int,
                       device: Any) -> bool:
    """Pages [0, 1) then [1, pages) through the Triton page-range encode (what a streaming CUDA prefill
    runs) write the reference page encoder's bytes (on the CPU) and nothing else."""
    import torch

    from sglang_lynx.codec.layout import stream_bytes
    from sglang_lynx.codec.page_reuse_encode import ReferencePageEncoder

    tokens, heads, dim = (int(n) for n in x.shape)
    a_len, r_len = stream_bytes("lynx", tokens, heads, dim, kind, params)
    got_a, got_r = (torch.full((n,), 0xAB, dtype=torch.uint8, device=device) for n in (a_len, r_len))
    want_a, want_r = (torch.full((n,), 0xAB, dtype=torch.uint8) for n in (a_len, r_len))
    for first, count in ((0, 1), (1, pages - 1)):
        lt.encode_pages_into(x.to(device), kind, first, count, got_a, got_r, params=params, codec_name=name)
        ReferencePageEncoder(codec).blocks_into(x, kind, first, count, None, want_a, want_r)
    return torch.equal(got_a.cpu(), want_a) and torch.equal(got_r.cpu(), want_r)


def _timed(fn: Any, device: Any, iters: int) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU, wall clock on the CPU), after one warm-up."""
    import torch

    fn()
    _sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def throughput(device: Any, small: bool) -> dict[str, Any]:
    import torch
    from sglang_lynx.kernels import lynx_triton as lt

    from sglang_lynx.codec.layout import LayoutParams

    tokens, heads, dim = (256, 1, 64) if small else (32768, 8, 128)
    iters = 1 if small else 20
    params = LayoutParams()
    x = torch.randn(tokens, heads, dim, device=device).bfloat16()
    nbytes = x.numel() * x.element_size()
    dst = torch.empty_like(x)
    out: dict[str, Any] = {"tokens": tokens, "heads": heads, "head_dim": dim, "bytes": nbytes, "iters": iters}
    copy_s = _timed(lambda: dst.copy_(x), device, iters)
    out["copy_gbps"] = nbytes / copy_s / 1e9
    pool = torch.empty(tokens + 64, heads, dim, dtype=torch.bfloat16, device=device)
    slots = torch.randperm(tokens + 64, device=device)[:tokens]
    for kind in ("k", "v"):
        progress(f"throughput {kind}")
        enc = lt.encode(x, kind, params=params)
        out[f"encode_{kind}_gbps"] = nbytes / _timed(lambda k=kind: lt.encode(x, k, params=params), device, iters) / 1e9
        for label, res in (("anchor", None), ("full", enc.residual)):
            def decode(r: Any = res, k: str = kind, e: Any = enc) -> Any:
                return lt.decode_into(e.anchor, r, pool, slots, kind=k, params=params)

            seconds = _timed(decode, device, iters)
            out[f"decode_{label}_{kind}_gbps"] = nbytes / seconds / 1e9
    rates = {k: v for k, v in out.items() if k.endswith("_gbps") and k != "copy_gbps"}
    out["fraction_of_copy"] = {k[: -len("_gbps")]: v / out["copy_gbps"] for k, v in rates.items()}
    out["target_fraction"] = 0.5
    out["meets_target"] = all(f >= 0.5 for f in out["fraction_of_copy"].values())
    out["passed"] = True  # a measurement; meets_target says whether the target is met
    return out


def _chi_square_critical(dof: int, z: float = 3.0902) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: false alarm 1e-3)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def decode_math(device: Any, small: bool) -> dict[str, Any]:
    import torch

    from sglang_lynx.decode.speculative import greedy_chain_accept, sampling_distribution, speculative_sample_chain
    from sglang_lynx.integration.decode import commit
    from sglang_lynx.integration.decode import sampling as dsm

    gen = torch.Generator().manual_seed(1)
    greedy_cases, greedy_bad = 0, 0
    for n in (1, 5, 64):
        for _ in range(10):
            logits = torch.randn(n + 1, 1000, generator=gen)
            drafts = logits.argmax(-1)[:n].clone()
            if n > 1:
                i = int(torch.randint(n, (1,), generator=gen))
                drafts[i] = (drafts[i] + 1) % 1000
            for margin in (0.0, 0.5):
                greedy_cases += 1
                host = greedy_chain_accept(drafts, logits, margin)
                dev = greedy_chain_accept(drafts.to(device), logits.to(device), margin)
                greedy_bad += host != dev
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], dtype=torch.float64)
    q = torch.tensor([0.1, 0.1, 0.2, 0.2, 0.2, 0.2], dtype=torch.float64)
    trials = 600 if small else 4000
    dgen = torch.Generator(device=device).manual_seed(2)
    drafts = torch.multinomial(q, trials, replacement=True, generator=gen)
    counts = torch.zeros(6, dtype=torch.float64)
    p_dev, q_dev = p.to(device)[None], q.to(device)[None]
    for d in drafts.tolist():
        verdict = speculative_sample_chain(torch.tensor([d], device=device), q_dev, p_dev, dgen)
        counts[d if verdict.num_accepted == 1 else verdict.next_token] += 1
    expected = p * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    critical = _chi_square_critical(5)
    # the real decode hooks on device tensors: record draft laws through the sampler hook, then verify
    params = SimpleNamespace(temperature=0.8, top_k=50, top_p=0.9, min_p=0.0)
    laws = dsm.DraftLaws()
    laws.watch("r")
    req = SimpleNamespace(rid="r", sampling_params=params)
    vocab, drafted = 4096, []
    for _ in range(4):
        logits = torch.randn(1, vocab, generator=gen).to(device) * 3
        token = int(logits.argmax())
        drafted.append(token)
        output = SimpleNamespace(next_token_logits=logits)

        def forward(sampler: Any, lo: Any, info: Any, t: int = token) -> Any:
            return torch.tensor([t], device=device)

        dsm._around_run_batch(lambda s, b, f=forward, o=output: dsm._around_sampler_forward(f, None, o, None),
                              SimpleNamespace(_lynx=SimpleNamespace(laws=laws)), SimpleNamespace(reqs=[req]))
    probs = laws.draft_probs_for("r", drafted)
    target = torch.randn(4, vocab, generator=gen).to(device)
    saved = commit.chain_verify_logits
    commit.chain_verify_logits = lambda *a, **k: target  # the forward is SGLang's; the rest is ours
    try:
        kv = SimpleNamespace(req_pool_idx=0, kv_allocated_len=14, kv_committed_len=14)
        vreq = SimpleNamespace(rid="r", origin_input_ids=list(range(10)), output_ids=[1, *drafted], kv=kv,
                               finished_reason=None, finished_len=None, sampling_params=params,
                               finished=lambda: False, update_finish_state=lambda: None)
        sampling = commit.SamplingVerify(params, probs, torch.Generator(device=device).manual_seed(3))
        outcome = commit.verify_parked_request(vreq, SimpleNamespace(dtype=torch.float32, device=str(device)),
                                               SimpleNamespace(free_kv_row=lambda kv, r: None),
                                               SimpleNamespace(upgrade_kv=lambda: None), "verify", sampling, 0.0)
    finally:
        commit.chain_verify_logits = saved
    hook_ok = probs is not None and probs.device.type == device.type and outcome.num_drafts == 4
    law = sampling_distribution(torch.zeros(1, 8, device=device), 1.0)
    return {"passed": greedy_bad == 0 and chi2 < critical and hook_ok and law.device.type == device.type,
            "greedy_cases": greedy_cases, "greedy_mismatches": greedy_bad,
            "sampling_trials": trials, "sampling_chi2": chi2, "sampling_chi2_critical_1e-3": critical,
            "hooks_and_verify": {"draft_laws_on_device": hook_ok, "drafts": outcome.num_drafts,
                                 "accepted": outcome.num_accepted}}


def pool_layout(device: Any, small: bool) -> dict[str, Any]:
    import torch
    from sglang_lynx.kernels import lynx_triton as lt

    from sglang_lynx.codec.registry import get_codec
    from sglang_lynx.codec.request import decode_request_into, encode_request, upgrade_request_into
    from sglang_lynx.config import LynxConfig
    from sglang_lynx.integration.transport.codec import decode_with_kernels, encode_with_kernels, stage_on

    layers, tokens, heads, dim = (2, 300, 2, 64) if small else (8, 5000, 8, 128)
    config = LynxConfig(mode="lynx")
    codec = get_codec(config.codec_name, **config.codec_params())
    gen = torch.Generator().manual_seed(4)
    k = [torch.randn(tokens, heads, dim, generator=gen).bfloat16() for _ in range(layers)]
    v = [torch.randn(tokens, heads, dim, generator=gen).bfloat16() for _ in range(layers)]
    want = encode_request(k, v, codec)
    anchor, residual = encode_with_kernels(lt, [x.to(device) for x in k], [x.to(device) for x in v], codec, config)
    streams_equal = torch.equal(anchor.cpu(), want.anchor) and torch.equal(residual.cpu(), want.residual)
    slots = torch.randperm(tokens + 100, generator=gen)[:tokens]
    results = {}
    # kernels: the Triton path; reference_fallback: what a server without usable kernels runs (the reference
    # on the CPU, copied into the device pool); reference_on_device: the reference run on CUDA tensors, not
    # used by the runtime (the first H200 run found it differs from the CPU), recorded, not required
    for label in ("kernels", "reference_fallback", "reference_on_device"):
        pools = [torch.zeros(tokens + 100, heads, dim, dtype=torch.bfloat16, device=device) for _ in range(2 * layers)]
        a, r, s = stage_on(device, want.anchor, want.residual, slots)
        if label == "reference_fallback":
            a, r, s = want.anchor, want.residual, slots
        if label == "kernels":
            decode_with_kernels(lt, a, None, pools[:layers], pools[layers:], s, codec, config)
            anchor_only = [p.cpu().clone() for p in pools]
            decode_with_kernels(lt, a, r, pools[:layers], pools[layers:], s, codec, config)
        else:
            decode_request_into((a, None), pools[:layers], pools[layers:], s, with_residual=False, codec=codec)
            anchor_only = [p.cpu().clone() for p in pools]
            upgrade_request_into((a, r), pools[:layers], pools[layers:], s, codec=codec)
        ref = [torch.zeros(tokens + 100, heads, dim, dtype=torch.bfloat16) for _ in range(2 * layers)]
        decode_request_into((want.anchor, None), ref[:layers], ref[layers:], slots, with_residual=False, codec=codec)
        anchor_ok = all(torch.equal(g, w) for g, w in zip(anchor_only, ref, strict=True))
        upgrade_request_into((want.anchor, want.residual), ref[:layers], ref[layers:], slots, codec=codec)
        full_ok = all(torch.equal(g.cpu(), w) for g, w in zip(pools, ref, strict=True))
        results[label] = {"anchor_only_equal": anchor_ok, "upgrade_equal": full_ok}
    passed = streams_equal and all(all(results[label].values()) for label in ("kernels", "reference_fallback"))
    return {"passed": passed, "layers": layers, "tokens": tokens, "streams_equal": streams_equal, **results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="directory for gpu_check.json")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (Triton interpreted, small sizes)")
    parser.add_argument("--small", action="store_true", help="small sizes (implied by --device cpu)")
    parser.add_argument("--commit", default=os.environ.get("LYNX_COMMIT", ""), help="commit under test (recorded)")
    parser.add_argument("--verbose", action="store_true", help="a line per step, with the seconds since start")
    parser.add_argument("--stacks-every", type=float, default=0.0,
                        help="dump every thread's stack to OUT/stacks.txt each this many seconds (0: never)")
    args = parser.parse_args(argv)
    global _VERBOSE
    _VERBOSE = args.verbose
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stacks_every > 0:
        import faulthandler

        stacks = (args.out / "stacks.txt").open("w")
        faulthandler.dump_traceback_later(args.stacks_every, repeat=True, file=stacks)
    setup_imports(args.device)
    import torch
    import triton

    device = torch.device(args.device)
    small = args.small or device.type == "cpu"
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here (use --device cpu for the CPU run)")
    result: dict[str, Any] = {
        "commit": args.commit, "device": str(device), "small": small, "python": platform.python_version(),
        "torch": torch.__version__, "triton": triton.__version__, "host": platform.node(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    started = time.monotonic()
    for name, part in (("kernels", check_kernels), ("decode_math", decode_math), ("pool_layout", pool_layout),
                       ("throughput", throughput)):
        t0 = time.monotonic()
        progress(f"part {name}")
        try:
            result[name] = part(device, small)
        except Exception as exc:  # every part reports; one failing part does not hide the others
            result[name] = {"passed": False, "error": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback.format_exc()[-3000:]}
        result[name]["seconds"] = round(time.monotonic() - t0, 2)
        print(f"[gpu_check] {name}: {'ok' if result[name]['passed'] else 'FAILED'} ({result[name]['seconds']} s)",
              flush=True)
        (args.out / "gpu_check.partial.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    result["imported_sglang_or_mooncake"] = sorted(m for m in sys.modules if m.split(".")[0] in ("sglang", "mooncake"))
    result["seconds"] = round(time.monotonic() - started, 2)
    result["passed"] = all(result[p]["passed"] for p in ("kernels", "decode_math", "pool_layout", "throughput")) \
        and not result["imported_sglang_or_mooncake"]
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"[gpu_check] {'PASSED' if result['passed'] else 'FAILED'} in {result['seconds']} s -> "
          f"{args.out / 'gpu_check.json'}", flush=True)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
