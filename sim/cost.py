"""The roofline cost of one engine step, in place of the model forward.

A step computes `tokens` new tokens over sequences with given contexts. Per TP rank:

    flops = 2 * active_params * tokens + 4 * layers * q_dim * attn_pairs + 2 * hidden * vocab * sampled
    compute = matmul flops / peak + attention over the cached context / (peak * attn_eff)
            + attention among the step's own new tokens / (peak * prompt_attn_eff)
            + a decode step's attention over its context / (peak * decode_attn_eff)
    bytes = weights read (an MoE layer reads only the experts its tokens chose)
          + KV read (context + new tokens of every sequence) + KV written (new tokens)
    step_s = max(compute / compute_eff, bytes / (mem_bw * bw_eff))
           + 2 * layers all-reduces of tokens * hidden (TP > 1) + step_overhead_s
           + seq_overhead_s * sampled (sampling and each sequence's bookkeeping)

A prefill chunk of a few thousand tokens is compute-bound; a decode step of one token per
sequence reads every weight and the whole KV for little arithmetic, so on a GPU it is
memory-bound (a slow CPU in float32 has its ridge below a decode batch of 2).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sim.hardware import DeviceProfile, LinkProfile
from sim.shapes import ModelShape


@dataclass(frozen=True)
class StepWork:
    tokens: int = 0  # new tokens computed this step
    sampled: int = 0  # sequences whose step ends in a sampled token (the LM head runs for them)
    attn_pairs: float = 0.0  # query-key pairs: sum of new * (context + (new + 1) / 2)
    kv_tokens: int = 0  # KV read: sum of context + new
    # Of attn_pairs, those against the context before the step (sum of new * context): a prefix
    # hit's, a later chunk's, every decode step's. They read the paged cache (attn_eff's rate);
    # a fresh prompt's pairs among its own tokens run on the dense causal kernel, at the matmuls'.
    ctx_pairs: float = 0.0
    # Of ctx_pairs, those of sequences adding one token (decodes): a batch of them runs on the
    # decode kernel, a few query rows per KV head over every sequence's gathered blocks, far
    # below a prefix hit's rate on a CPU (decode_attn_eff).
    dec_pairs: float = 0.0

    @classmethod
    def of(cls, items: Iterable[tuple[int, int, bool]]) -> StepWork:
        """From (new tokens, context before, samples) per sequence."""
        tokens = sampled = kv = 0
        pairs = ctx_pairs = dec_pairs = 0.0
        for new, ctx, samples in items:
            tokens += new
            sampled += samples
            pairs += new * (ctx + (new + 1) / 2)
            ctx_pairs += new * ctx
            dec_pairs += ctx if new == 1 else 0
            kv += ctx + new
        return cls(tokens, sampled, pairs, kv, ctx_pairs, dec_pairs)


class Roofline:
    def __init__(self, shape: ModelShape, device: DeviceProfile, tp: int = 1, tp_link: LinkProfile | None = None):
        if tp > 1 and tp_link is None:
            raise ValueError("tensor parallelism needs the link between its ranks (tp_link)")
        self.shape, self.device, self.tp, self.tp_link = shape, device, tp, tp_link
        d = device.dtype_bytes
        self._kv_token = shape.kv_bytes_per_token(d)
        # Every layer's attention, and the LM head (an embedding lookup reads only its rows).
        self._dense_bytes = (shape.layers * shape.attn_params + shape.vocab * shape.hidden) * d
        if not shape.experts:
            self._dense_bytes += shape.layers * shape.mlp_params * d
        # Constants of flops() and bytes(), hoisted: the simulator calls step_s for every step.
        self._token_flops = 2 * shape.layers * (shape.attn_params + shape.active_mlp_params)
        self._pair_flops = 4 * shape.layers * shape.heads * shape.head_dim
        self._head_flops = 2 * shape.hidden * shape.vocab
        self._flops_per_s = device.peak_flops * device.compute_eff
        self._bytes_per_s = device.mem_bw * device.bw_eff
        self._decode_attn_eff = device.attn_eff if device.decode_attn_eff is None else device.decode_attn_eff

    def flops(self, w: StepWork) -> float:
        return (self._token_flops * w.tokens + self._pair_flops * w.attn_pairs + self._head_flops * w.sampled) / self.tp

    def attn_flops(self, w: StepWork) -> float:
        """The query-key part of flops() over the cached context, decodes' included."""
        return self._pair_flops * w.ctx_pairs / self.tp

    def prompt_attn_flops(self, w: StepWork) -> float:
        """The query-key part of flops() among the step's own new tokens (a fresh prompt's, a
        chunk's own): what runs at the device's prompt_attn_eff."""
        return self._pair_flops * (w.attn_pairs - w.ctx_pairs) / self.tp

    def decode_attn_flops(self, w: StepWork) -> float:
        """Of attn_flops(), the decodes' (what runs at the device's decode_attn_eff)."""
        return self._pair_flops * w.dec_pairs / self.tp

    def bytes(self, w: StepWork) -> float:
        weights = self._dense_bytes
        s, d = self.shape, self.device.dtype_bytes
        if s.experts and w.tokens:  # distinct experts touched per layer, tokens routed independently
            touched = s.experts * (1 - (1 - s.experts_per_tok / s.experts) ** w.tokens)
            weights += s.layers * touched * s.expert_params * d
        return (weights + self._kv_token * (w.kv_tokens + w.tokens)) / self.tp

    def compute_s(self, w: StepWork) -> float:
        attn, dec, own = self.attn_flops(w), self.decode_attn_flops(w), self.prompt_attn_flops(w)
        matmuls = self.flops(w) - attn - own
        return (matmuls + own / self.device.prompt_attn_eff + (attn - dec) / self.device.attn_eff
                + dec / self._decode_attn_eff) / self._flops_per_s

    def memory_s(self, w: StepWork) -> float:
        return self.bytes(w) / self._bytes_per_s

    def compute_bound(self, w: StepWork) -> bool:
        return self.compute_s(w) >= self.memory_s(w)

    def step_s(self, w: StepWork) -> float:
        if not w.tokens:
            return 0.0
        d = self.device
        t = max(self.compute_s(w), self.memory_s(w)) + d.step_overhead_s + d.seq_overhead_s * w.sampled
        if self.tp > 1:  # two ring all-reduces of the activations per layer
            size = w.tokens * self.shape.hidden * d.dtype_bytes * 2 * (self.tp - 1) / self.tp
            t += 2 * self.shape.layers * self.tp_link.transfer_s(size)
        return t

    def decode_steps_s(self, batch: int, context: int, steps: int) -> list[float]:
        """step_s of `steps` consecutive decode steps (each adds a token to every sequence).
        Both bounds grow linearly with the context, so while the same one holds at the first
        and the last step the times are exactly linear in between."""
        def work(j: int) -> StepWork:
            kv = context + batch * (j + 1)
            return StepWork(batch, batch, kv, kv, kv - batch, kv - batch)

        a, b = work(0), work(steps - 1)
        if steps < 3 or self.compute_bound(a) != self.compute_bound(b):
            return [self.step_s(work(j)) for j in range(steps)]
        first, slope = self.step_s(a), (self.step_s(b) - self.step_s(a)) / (steps - 1)
        return [first + slope * j for j in range(steps)]

    def kv_bytes(self, tokens: int) -> int:
        """A request's KV, all ranks together (what a prefill-to-decode transfer moves)."""
        return tokens * self._kv_token

    def kv_capacity_tokens(self, memory_fraction: float = 0.9) -> int:
        """Tokens of KV the TP group holds beside its weights."""
        free = self.tp * self.device.mem_bytes * memory_fraction - self.shape.weight_bytes(self.device.dtype_bytes)
        if free <= 0:
            raise ValueError(f"{self.shape.name} ({self.shape.weight_bytes(self.device.dtype_bytes) / 1e9:.0f} GB) "
                             f"does not fit {self.tp} x {self.device.name}; raise the TP size")
        return int(free // self._kv_token)
