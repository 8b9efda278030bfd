"""Device discipline of the decode-side code (issue 17): run on the CPU under ``DeviceGuard``.

The model-side tensors (logits, the KV row table, sampler outputs) pose as CUDA tensors
(``tests/device_guard.py``); the guard fails on any op that mixes them with a host tensor, on a host
``torch.Generator`` drawing device values, and counts every device-to-host read. What must hold:

- a decode step's sampler hook (a sampling request drafting) reads nothing back to the host and
  keeps the draft law and the token on the logits' device;
- a verification (greedy or speculative sampling) keeps drafts, draft probabilities, the uniforms and
  the generator on the logits' device, and reads back a bounded handful of values (the verdict);
- the verify's forward batch puts every tensor SGLang's model reads on the model's device (but the
  ``*_cpu`` fields SGLang keeps on the host);
- a sampling request's generator is made on the model's device.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from device_guard import DeviceGuard
from sglang_lynx.decode.speculative import greedy_chain_accept, sampling_distribution, speculative_sample_chain
from sglang_lynx.integration.decode import commit as decode_commit
from sglang_lynx.integration.decode import sampling as dsm
from sglang_lynx.integration.decode import tracked as decode_tracked

VOCAB = 32
MAX_VERIFY_READS = 4  # device-to-host reads a whole verification may make (the verdict, validation)


@dataclass
class Params:
    temperature: float = 0.8
    top_k: int = -1
    top_p: float = 0.9
    min_p: float = 0.0
    sampling_seed: int | None = 7


def _logits(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_the_guard_catches_a_host_tensor_a_host_generator_and_host_reads() -> None:
    """The guard itself: what CUDA would refuse is recorded; what it allows is not."""
    with DeviceGuard() as guard:
        dev = guard.put(_logits(2, 0))
        _ = dev.argmax(-1) == torch.tensor([1, 2])  # a host tensor meets a device tensor
        assert guard.violations and "eq" in guard.violations[0]
        guard.reset_counts()
        _ = dev.argmax(-1) == torch.tensor([1, 2], device=dev.device)  # the same on the device: fine
        _ = dev * torch.tensor(2.0)  # a host scalar is allowed (as on CUDA)
        assert guard.violations == [] and dev.device.type == "cuda"
        _ = torch.rand(3, generator=torch.Generator(), device=dev.device)
        assert guard.violations and "generator" in guard.violations[0]
        guard.reset_counts()
        _ = torch.rand(3, generator=guard.generator(1), device=dev.device)
        int(dev.argmax())
        dev.sum().item()
        assert guard.violations == [] and guard.host_reads == ["__int__", "item"]


def _step(laws: dsm.DraftLaws, guard: DeviceGuard, reqs: list[Any], logits: torch.Tensor, tokens: list[int]) -> Any:
    """One decode step through the real hooks, the logits and the sampler's tokens on the device."""
    scheduler = SimpleNamespace(_lynx=SimpleNamespace(laws=laws))
    output = SimpleNamespace(next_token_logits=guard.put(logits.clone()))

    def sampler_forward(sampler: Any, logits_output: Any, sampling_info: Any) -> torch.Tensor:
        logits_output.next_token_logits[:] = torch.softmax(logits_output.next_token_logits, dim=-1)
        return guard.tensor(tokens, dtype=torch.int32)

    def run_batch(scheduler: Any, batch: Any) -> Any:
        return dsm._around_sampler_forward(sampler_forward, None, output, None)

    return dsm._around_run_batch(run_batch, scheduler, SimpleNamespace(reqs=reqs))


@pytest.mark.parametrize("params", [Params(), Params(top_k=4, top_p=1.0), Params(top_k=-1, top_p=1.0)],
                         ids=["top_p", "top_k", "plain"])
def test_a_decode_step_records_the_draft_law_on_the_device_with_no_host_read(params: Params) -> None:
    laws = dsm.DraftLaws()
    laws.watch("w")
    reqs = [SimpleNamespace(rid="other", sampling_params=params), SimpleNamespace(rid="w", sampling_params=params)]
    with DeviceGuard() as guard:
        for step in range(3):
            _step(laws, guard, reqs, _logits(2, step), [step, step + 1])
        assert guard.violations == []
        assert guard.host_reads == [], "a decode step must not read back from the device"
        probs = laws.draft_probs_for("w", [1, 2, 3])
        assert probs is not None and guard.on_device(probs) and guard.violations == []
        assert len(guard.host_reads) <= 1  # comparing the recorded tokens with the drafts, once per verify
    want = torch.stack([sampling_distribution(_logits(2, s)[1:2], params.temperature, top_k=params.top_k,
                                              top_p=params.top_p)[0].float() for s in range(3)])
    assert torch.equal(probs, want)  # the exact law, rebuilt bit for bit
    assert laws.draft_probs_for("w", [1, 2, 4]) is None


class _Req:
    def __init__(self, prompt_len: int, out: list[int]) -> None:
        n = len(out) - 1
        self.rid, self.origin_input_ids, self.output_ids = "r", list(range(prompt_len)), list(out)
        self.kv = SimpleNamespace(req_pool_idx=3, kv_allocated_len=prompt_len + n, kv_committed_len=prompt_len + n,
                                  )
        self.finished_reason: Any = None
        self.finished_len: Any = None
        self.sampling_params = Params()

    def finished(self) -> bool:
        return self.finished_reason is not None

    def update_finish_state(self) -> None:
        pass


class _Cache:
    def free_kv_row(self, kv: Any, ranges: Any) -> None:
        pass


class _Progress:
    def upgrade_kv(self) -> None:
        pass


def _verify(monkeypatch: pytest.MonkeyPatch, guard: DeviceGuard, logits: torch.Tensor, out: list[int],
            sampling: Any = None) -> decode_commit.VerifyOutcome:
    monkeypatch.setattr(decode_commit, "chain_verify_logits",
                        lambda runner, row, prefix, ids, gemm=None, last_rows=None, attention=None:
                        guard.put(logits.clone()))
    req = _Req(10, out)
    return decode_commit.verify_parked_request(req, SimpleNamespace(dtype=torch.float32), _Cache(), _Progress(),
                                               "verify", sampling, 0.0)


def test_a_greedy_verification_keeps_the_drafts_on_the_logits_device(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = _logits(4, 1)
    target = logits.argmax(-1).tolist()
    drafts = [target[0], target[1], (target[2] + 1) % VOCAB, target[3]]
    with DeviceGuard() as guard:
        outcome = _verify(monkeypatch, guard, logits, [5, *drafts])
    assert guard.violations == []
    assert len(guard.host_reads) <= MAX_VERIFY_READS, guard.host_reads
    assert (outcome.num_drafts, outcome.num_accepted) == (4, 2)


def test_a_sampling_verification_keeps_drafts_laws_and_uniforms_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = _logits(4, 2)
    params = Params()
    q = sampling_distribution(_logits(4, 3), params.temperature, top_p=params.top_p).float()
    drafts = [int(torch.multinomial(q[i], 1, generator=torch.Generator().manual_seed(i))) for i in range(4)]
    for with_record in (True, False):
        with DeviceGuard() as guard:
            sampling = decode_commit.SamplingVerify(params, guard.put(q.clone()) if with_record else None,
                                                    guard.generator(11))
            outcome = _verify(monkeypatch, guard, logits, [5, *drafts], sampling)
        assert guard.violations == [], (with_record, guard.violations)
        assert len(guard.host_reads) <= MAX_VERIFY_READS, (with_record, guard.host_reads)
        assert outcome.num_drafts == 4


def test_the_chain_math_on_device_tensors_matches_the_host_result() -> None:
    logits = _logits(6, 4)
    drafts = logits.argmax(-1)[:5].clone()
    drafts[3] = (drafts[3] + 1) % VOCAB
    p = sampling_distribution(logits, 0.7)
    q = sampling_distribution(_logits(5, 5), 0.7)
    host_greedy = greedy_chain_accept(drafts, logits, 0.1)
    host_sampled = speculative_sample_chain(drafts, q, p, torch.Generator().manual_seed(3))
    with DeviceGuard() as guard:
        dev_greedy = greedy_chain_accept(guard.put(drafts.clone()), guard.put(logits.clone()), 0.1)
        reads_greedy = len(guard.host_reads)
        gen = guard.generator(0)
        gen.manual_seed(3)
        dev_sampled = speculative_sample_chain(guard.put(drafts.clone()), guard.put(q.clone()),
                                               guard.put(p.clone()), gen)
    assert guard.violations == []
    assert reads_greedy <= 2 and len(guard.host_reads) - reads_greedy <= 3, guard.host_reads
    assert (dev_greedy, dev_sampled) == (host_greedy, host_sampled)  # same decisions, same random stream


def test_a_generator_on_another_device_than_the_probabilities_is_refused() -> None:
    with DeviceGuard() as guard:
        p = guard.put(sampling_distribution(_logits(2, 6), 1.0))
        with pytest.raises(ValueError, match="generator"):
            speculative_sample_chain(guard.tensor([1]), p[:1].clone(), p, torch.Generator())


def test_a_sampling_request_gets_its_generator_on_the_model_device(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Any] = []

    class Recorder:
        def __init__(self, device: Any = "cpu") -> None:
            made.append(torch.device(device))

        def manual_seed(self, seed: int) -> Recorder:
            return self

    monkeypatch.setattr(decode_tracked, "torch", SimpleNamespace(Generator=Recorder, device=torch.device))
    req = SimpleNamespace(sampling_params=Params(sampling_seed=5))
    decode_tracked.generator_for(req, device=torch.device("cuda", 1))
    decode_tracked.generator_for(req, device="cpu")
    assert made == [torch.device("cuda", 1), torch.device("cpu")]


def test_the_verify_forward_batch_lives_on_the_model_device() -> None:
    pytest.importorskip("sglang")
    from sglang_lynx.integration.decode import verify as decode_verify

    with DeviceGuard() as guard:
        req_to_token = guard.put(torch.arange(1, 8 * 64 + 1, dtype=torch.int32).reshape(8, 64))
        runner = SimpleNamespace(device="cuda", req_to_token_pool=SimpleNamespace(req_to_token=req_to_token))
        for build, prefix in ((decode_verify._build_decode_batch, 10), (decode_verify._build_extend_batch, 0)):
            guard.reset_counts()
            batch = build(runner, 2, prefix, [4, 5, 6])
            for name in ("input_ids", "req_pool_indices", "seq_lens", "out_cache_loc", "positions"):
                assert guard.on_device(getattr(batch, name)), (build.__name__, name)
            assert not guard.on_device(batch.seq_lens_cpu)
            assert guard.violations == [] and len(guard.host_reads) <= 1, guard.host_reads


@pytest.mark.parametrize(("device", "dtype", "margin"), [("cpu", torch.bfloat16, 0.0), ("cuda", torch.bfloat16, 0.25),
                                                         ("cuda", torch.float32, 0.0)])
def test_a_gpu_verify_in_16_bits_guards_near_ties(monkeypatch: pytest.MonkeyPatch, device: str, dtype: torch.dtype,
                                                  margin: float) -> None:
    """Bit-identity of the verify with decode steps is measured on the CPU backend only (verify.py)."""
    used: list[float] = []
    monkeypatch.setattr(decode_commit, "chain_verify_logits", lambda *a, **k: _logits(3, 8))
    monkeypatch.setattr(decode_commit, "greedy_chain_accept",
                        lambda d, lg, tie_margin=0.0: used.append(tie_margin) or greedy_chain_accept(d, lg, tie_margin))
    runner = SimpleNamespace(dtype=dtype, device=device)
    decode_commit.verify_parked_request(_Req(10, [5, 1, 2, 3]), runner, _Cache(), _Progress(), "verify", None, -1.0)
    assert used == [margin]
