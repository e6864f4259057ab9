"""The roofline: a long prefill chunk is compute-bound, a decode step memory-bound, and the
figures follow from the shapes and the device profile."""
from __future__ import annotations

import json

import pytest

from sim.cost import Roofline, StepWork
from sim.hardware import DeviceProfile, load_device, load_link
from sim.shapes import load_shape


def test_prefill_is_compute_bound_and_decode_memory_bound() -> None:
    r = Roofline(load_shape("Qwen3-32B"), load_device("H200"))
    prefill = StepWork.of([(4096, 0, True)])
    decode = StepWork.of([(1, 2048, True)] * 32)
    assert r.compute_bound(prefill) and not r.compute_bound(decode)
    assert r.step_s(prefill) == pytest.approx(r.compute_s(prefill) + r.device.step_overhead_s)
    assert r.step_s(decode) == pytest.approx(r.memory_s(decode) + r.device.step_overhead_s)


def test_the_switch_happens_where_flops_per_byte_cross_the_device_ridge() -> None:
    r = Roofline(load_shape("Llama-3-70B"), load_device("H100-SXM"))
    ridge = r.device.peak_flops * r.device.compute_eff / (r.device.mem_bw * r.device.bw_eff)
    bound = [r.compute_bound(StepWork.of([(n, 0, True)])) for n in (1, 16, 64, 256, 1024, 4096)]
    assert bound == sorted(bound) and bound[0] is False and bound[-1] is True  # switches once
    # Below the ridge a dense model reads each weight byte for ~1 flop per token: 2 flops / 2 bytes.
    n = next(n for n in range(1, 4096) if r.compute_bound(StepWork.of([(n, 0, True)])))
    assert 0.8 * ridge < n < 1.3 * ridge


def test_decode_time_is_weights_plus_kv_over_bandwidth() -> None:
    shape, dev = load_shape("Qwen2.5-7B"), load_device("H200")
    r = Roofline(shape, dev)
    w = StepWork.of([(1, 1000, True)] * 8)
    kv = shape.kv_bytes_per_token(2) * (8 * 1001 + 8)
    weights = (shape.layers * (shape.attn_params + shape.mlp_params) + shape.vocab * shape.hidden) * 2
    assert r.bytes(w) == pytest.approx(weights + kv)
    assert r.memory_s(w) == pytest.approx((weights + kv) / (dev.mem_bw * dev.bw_eff))


def test_moe_reads_only_the_experts_its_tokens_chose() -> None:
    shape = load_shape("Qwen3-30B-A3B")
    r = Roofline(shape, load_device("H20"))
    one, many = r.bytes(StepWork.of([(1, 0, True)])), r.bytes(StepWork.of([(4096, 0, True)]))
    assert shape.experts == 128 and shape.experts_per_tok == 8
    assert one < 0.25 * shape.weight_bytes(2) < many  # one token touches 8 of 128 experts per layer
    assert r.flops(StepWork.of([(1, 0, False)])) < 0.2 * 2 * shape.params  # ~3B active of 30B


def test_tensor_parallel_splits_the_work_and_pays_all_reduces() -> None:
    shape, dev = load_shape("Llama-3-70B"), load_device("H100-SXM")
    one = Roofline(shape, dev)
    two = Roofline(shape, dev, tp=2, tp_link=load_link("nvlink4"))
    w = StepWork.of([(2048, 0, True)])
    assert two.flops(w) == pytest.approx(one.flops(w) / 2)
    assert one.step_s(w) / 2 < two.step_s(w) < one.step_s(w)
    with pytest.raises(ValueError, match="does not fit"):
        one.kv_capacity_tokens()  # 141 GB of bf16 weights on one 80 GB card
    assert two.kv_capacity_tokens() > 0


def test_unknown_names_say_what_exists() -> None:
    with pytest.raises(ValueError, match="H200"):
        load_device("B300")
    with pytest.raises(ValueError, match="Qwen3-32B"):
        load_shape("no-such-model")


def test_the_per_sequence_overhead_is_paid_per_sampled_sequence() -> None:
    dev = load_device("cpu-2core")
    plain = Roofline(load_shape("bench"), dev)
    served = Roofline(load_shape("bench"), dev.model_copy(update={"seq_overhead_s": 0.002}))
    decode = StepWork.of([(1, 300, True)] * 4)
    chunk = StepWork.of([(64, 0, False)])  # a prefill chunk that samples nothing
    assert served.step_s(decode) == pytest.approx(plain.step_s(decode) + 4 * 0.002)
    assert served.step_s(chunk) == pytest.approx(plain.step_s(chunk))
    # decode_steps_s stays exact with it (a constant per step for a fixed batch).
    assert served.decode_steps_s(4, 300, 10) == pytest.approx(
        [served.step_s(StepWork.of([(1, 300 // 4 + j, True)] * 4)) for j in range(10)])


def test_prompt_attn_eff_slows_only_a_steps_attention_among_its_own_new_tokens() -> None:
    dev = load_device("cpu-2core")
    slow = dev.model_copy(update={"prompt_attn_eff": 0.25})
    shape = load_shape("bench")
    plain, r = Roofline(shape, dev), Roofline(shape, slow)
    fresh, hit, decode = StepWork.of([(512, 0, True)]), StepWork.of([(1, 512, True)]), StepWork.of([(1, 300, True)] * 4)
    own = r.prompt_attn_flops(fresh)
    assert own == pytest.approx(4 * shape.layers * shape.heads * shape.head_dim * 512 * 513 / 2)
    assert r.compute_s(fresh) == pytest.approx(plain.compute_s(fresh) + 3 * own / dev.peak_flops)
    # a decode's or a hit's new token attends to itself too: its own pair only, the context at its own rate
    pair = 4 * shape.layers * shape.heads * shape.head_dim
    assert r.prompt_attn_flops(hit) == pytest.approx(pair) and r.prompt_attn_flops(decode) == pytest.approx(4 * pair)
    assert r.compute_s(decode) == pytest.approx(plain.compute_s(decode), rel=0.01)


def test_attention_below_the_matmuls_rate_slows_only_pairs_against_the_cached_context() -> None:
    """A fresh prompt's causal attention among its own tokens runs on the dense kernel (the
    matmuls' rate); a prefix hit's and a decode step's read the paged cache (attn_eff)."""
    shape = load_shape("bench")
    fast = load_device("cpu-2core")
    slow = fast.model_copy(update={"attn_eff": 0.25})
    fresh, hit = StepWork.of([(1024, 0, True)]), StepWork.of([(32, 1024, True)])
    assert hit.ctx_pairs == 32 * 1024 and fresh.ctx_pairs == 0
    assert Roofline(shape, slow).compute_s(fresh) == pytest.approx(Roofline(shape, fast).compute_s(fresh))
    assert Roofline(shape, slow).compute_s(hit) > Roofline(shape, fast).compute_s(hit)
    r = Roofline(shape, slow)
    steps = r.decode_steps_s(4, 4 * 300, 5)  # the steady path's steps equal the step-by-step ones
    assert steps == pytest.approx([r.step_s(StepWork.of([(1, 300 + j, True)] * 4)) for j in range(5)])


def test_a_decode_batchs_attention_runs_at_its_own_rate() -> None:
    """decode_attn_eff slows a decode's pairs against its context, not a prefix hit's; unset,
    they run at attn_eff."""
    shape = load_shape("bench")
    base = load_device("cpu-2core").model_copy(update={"attn_eff": 0.75})
    slow = base.model_copy(update={"decode_attn_eff": 0.1})
    decode, hit = StepWork.of([(1, 1000, True)] * 8), StepWork.of([(32, 1024, True)])
    assert decode.dec_pairs == 8 * 1000 and hit.dec_pairs == 0
    assert Roofline(shape, slow).compute_s(hit) == pytest.approx(Roofline(shape, base).compute_s(hit))
    extra = Roofline(shape, base).attn_flops(decode) * (1 / 0.1 - 1 / 0.75) / base.peak_flops
    assert Roofline(shape, slow).compute_s(decode) == pytest.approx(Roofline(shape, base).compute_s(decode) + extra)
    same = base.model_copy(update={"decode_attn_eff": 0.75})
    assert Roofline(shape, same).compute_s(decode) == pytest.approx(Roofline(shape, base).compute_s(decode))
    r = Roofline(shape, slow)
    assert r.decode_steps_s(4, 4 * 300, 5) == pytest.approx([r.step_s(StepWork.of([(1, 300 + j, True)] * 4))
                                                             for j in range(5)])


def test_a_slowed_device_takes_every_cost_times_the_factor() -> None:
    dev = load_device("cpu-2core").model_copy(update={"seq_overhead_s": 0.001, "attn_eff": 0.5})
    slow = dev.slowed(1.25)
    assert slow.seq_overhead_s == pytest.approx(0.00125) and slow.step_overhead_s == pytest.approx(1.25 * 0.005)
    assert slow.attn_eff == 0.5 and slow.mem_bytes == dev.mem_bytes  # a ratio and a size, not costs
    assert dev.slowed(1.0) is dev
    shape = load_shape("bench")
    for w in (StepWork.of([(512, 0, True)]), StepWork.of([(1, 700, True)] * 6), StepWork.of([(32, 1024, True)])):
        assert Roofline(shape, slow).step_s(w) == pytest.approx(1.25 * Roofline(shape, dev).step_s(w))
    with pytest.raises(ValueError, match=">= 1"):
        dev.slowed(0.8)


def test_a_profile_file_with_fields_that_describe_no_device_is_refused(tmp_path) -> None:
    """A profile JSON from a calibration that also measured a serving path: the fields are
    named, and what to do next."""
    path = tmp_path / "old.json"
    path.write_text(json.dumps({**load_device("cpu-2core").model_dump(), "host_cores": 2.0, "corun_wait_s": 0.01}))
    with pytest.raises(ValueError, match="corun_wait_s, host_cores.*calibrate again"):
        load_device(str(path))
    path.write_text(load_device("cpu-2core").model_dump_json())
    assert load_device(str(path)) == load_device("cpu-2core")


def test_a_device_profile_holds_only_what_describes_a_device() -> None:
    """Rates, efficiencies, per-step costs, memory, precision and links: nothing of a serving
    path or of a machine's cores shared between workers."""
    assert set(DeviceProfile.model_fields) == {
        "name", "peak_flops", "mem_bw", "mem_bytes", "compute_eff", "bw_eff", "attn_eff", "decode_attn_eff",
        "prompt_attn_eff", "step_overhead_s", "seq_overhead_s", "dtype_bytes", "intra_link", "inter_link"}
