"""Owns the model and the KV cache on one device; turns a scheduled batch into logits."""
from __future__ import annotations

import torch

from engine.config import CacheConfig
from engine.model_config import ModelConfig
from engine.models import CausalLM
from engine.models.attention import AttentionMetadata, DecodeGroup, PrefillSpan
from engine.models.varlen_attention import default_kernel, varlen_metadata
from engine.scheduler import ScheduledSeq

# Chunks of up to this many tokens that continue a sequence are attended like decodes, grouped by
# length (one call per group): speculative verifications and a draft model catching up.
MAX_GROUPED_QUERIES = 17


def kv_cache_blocks(cfg: CacheConfig, model_cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    per_block = model_cfg.kv_bytes_per_token(dtype) * cfg.block_size
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * cfg.memory_fraction)
    else:
        budget = cfg.cpu_kv_bytes
    return max(2, budget // per_block)


class ModelRunner:
    def __init__(self, model: CausalLM, model_cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.model = model
        self.block_size = block_size
        self.device = device
        # Not None: attention runs the whole batch in one varlen call per layer with this kernel.
        self.varlen_kernel = default_kernel(device, dtype, model_cfg.head_dim)
        # Zeroed so padded decode slots hold finite values (masked, but NaN * 0 is NaN).
        self.kv_cache = torch.zeros(
            2, model_cfg.num_layers, num_blocks, block_size, model_cfg.num_kv_heads, model_cfg.head_dim,
            dtype=dtype, device=device,
        )  # (2, L, NB, bs, Hkv, hd)

    def health(self) -> dict:
        """Extra fields for a worker's health report (a parallel runner reports its group)."""
        return {}

    def close(self) -> None:
        """Release what the runner holds beyond memory (a parallel runner: its group)."""

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy of these blocks: (2, L, len(block_ids), bs, Hkv, hd)."""
        out = torch.empty((*self.kv_cache.shape[:2], len(block_ids), *self.kv_cache.shape[3:]),
                          dtype=self.kv_cache.dtype, device=self.kv_cache.device)
        for i, b, n in _runs(block_ids):
            out[:, :, i : i + n].copy_(self.kv_cache[:, :, b : b + n])
        return out

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        kv = kv.to(self.kv_cache.device, self.kv_cache.dtype)
        for i, b, n in _runs(block_ids):
            self.kv_cache[:, :, b : b + n].copy_(kv[:, :, i : i + n])

    def check_inputs(self, s: ScheduledSeq) -> None:
        """Raise ValueError if one sequence's part of a batch is not what _prepare can read: its
        tokens or block table end before the positions it computes. Checked per sequence before
        the batch is built, so that request fails alone; inside run() it would fail the batch."""
        seq, end = s.seq, s.seq.num_computed + s.num_new_tokens
        if s.num_new_tokens < 1 or end > seq.num_tokens:
            raise ValueError(f"{s.num_new_tokens} tokens scheduled from position {seq.num_computed} "
                             f"of a sequence of {seq.num_tokens}")
        if len(seq.block_table) * self.block_size < end:
            raise ValueError(f"{len(seq.block_table)} KV blocks of {self.block_size} cannot hold {end} positions")

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Compute `batch` (decodes first) and return logits (N, V) for the rows that sample: one per
        sampling sequence, 1 + num_draft for a sequence verifying proposals (engine.spec)."""
        input_ids, positions, meta, sample_rows = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        return self.model.compute_logits(hidden[sample_rows])

    def _prepare(self, batch: list[ScheduledSeq]):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        verifies: list[tuple[int, int, int, list[int]]] = []  # (q_start, q_len, context, table)
        for s in batch:
            seq, start, n = s.seq, s.seq.num_computed, s.num_new_tokens
            q_start = len(ids)
            ids += seq.token_ids[start : start + n]
            pos += range(start, start + n)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            if n == 1:
                decode_tables.append(table[: -(-(start + 1) // bs)])
                decode_lens.append(start + 1)
            elif s.num_draft or (start and n <= MAX_GROUPED_QUERIES):  # a verification, a draft catching up
                verifies.append((q_start, n, start + n, table[: -(-(start + n) // bs)]))
            else:
                nb = -(-(start + n) // bs)
                prefills.append(PrefillSpan(q_start, n, start + n, self._tensor(table[:nb])))
            if s.samples:
                sample_rows += range(len(ids) - 1 - s.num_draft, len(ids))
        meta = AttentionMetadata(slot_mapping=self._tensor(slots), block_size=bs, prefills=prefills)
        if self.varlen_kernel is not None:
            spans = [(s.num_new_tokens, s.seq.num_computed + s.num_new_tokens, s.seq.block_table) for s in batch]
            meta.varlen = varlen_metadata(spans, bs, self.device, self.varlen_kernel)
            return self._tensor(ids), self._tensor(pos), meta, self._tensor(sample_rows)
        meta.decodes = [self._decode_group(start, decode_tables[start:end], decode_lens[start:end])
                        for start, end in _groups(decode_lens)]
        meta.decodes += self._verify_groups(verifies)
        return self._tensor(ids), self._tensor(pos), meta, self._tensor(sample_rows)

    def _decode_group(self, start: int, tables: list[list[int]], lens: list[int]) -> DecodeGroup:
        width = max(len(t) for t in tables)
        mask = None
        if min(lens) != width * self.block_size:
            keys = torch.arange(width * self.block_size, device=self.device)
            mask = (keys[None, :] < self._tensor(lens)[:, None])[:, None, None, :]  # (D, 1, 1, S)
        first = None
        if len(tables) == 1 and tables[0] == list(range(tables[0][0], tables[0][0] + width)):
            first = tables[0][0]
        return DecodeGroup(start, self._tensor([t + [0] * (width - len(t)) for t in tables]), mask, first)

    def _verify_groups(self, verifies: list[tuple[int, int, int, list[int]]]) -> list[DecodeGroup]:
        """Short continuing chunks (speculative verifications, engine/spec) packed back to back with
        the same q_len, in one attention call each: each query sees its history and the new
        tokens up to itself."""
        groups: list[DecodeGroup] = []
        i = 0
        while i < len(verifies):
            j = i
            while j < len(verifies) and verifies[j][1] == verifies[i][1] and \
                    verifies[j][0] == verifies[i][0] + (j - i) * verifies[i][1]:
                j += 1
            run = verifies[i:j]
            q_len = run[0][1]
            width = max(len(v[3]) for v in run)
            keys = torch.arange(width * self.block_size, device=self.device)
            ctx = self._tensor([v[2] for v in run])  # (D,)
            qpos = ctx[:, None] - q_len + torch.arange(q_len, device=self.device)[None, :]  # (D, Q)
            mask = (keys[None, None, :] <= qpos[:, :, None])[:, None]  # (D, 1, Q, S)
            tables = self._tensor([v[3] + [0] * (width - len(v[3])) for v in run])
            groups.append(DecodeGroup(run[0][0], tables, mask, None, q_len))
            i = j
        return groups

    def _tensor(self, values) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.long)
        return t.to(self.device, non_blocking=True) if self.device.type != "cpu" else t


def _runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(position, first block, length) of each run of consecutive block ids. Slice copies of
    runs are ~3x faster than one index_put over scattered ids, and allocations from the free
    list mostly come in runs."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, b, 1))
    return runs


def _groups(lens: list[int], min_size: int = 8, spread: float = 1.5) -> list[tuple[int, int]]:
    """Split decodes (sorted by context length) into [start, end) groups whose longest
    context is at most `spread` x their shortest: each group gathers and attends over its own
    longest context, so padding (copied and computed for nothing) stays small, while groups
    of at least `min_size` keep the number of attention calls low."""
    groups: list[tuple[int, int]] = []
    start = 0
    for i, n in enumerate(lens):
        if i - start >= min_size and n > spread * lens[start]:
            groups.append((start, i))
            start = i
    if lens:
        groups.append((start, len(lens)))
    return groups
