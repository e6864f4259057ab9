"""The checks a request passes before it runs: where it is built (a door, or an engine used
directly) against the engine's shape, and on the worker against its own KV pool."""
from __future__ import annotations

from engine.sampling import InvalidRequest, SamplingParams


def check_request(token_ids: list[int], params: SamplingParams, *, vocab_size: int, max_model_len: int,
                  block_size: int, num_blocks: int) -> None:
    """Raise InvalidRequest naming the field if the request can never run on an engine of this
    shape. The request's one check, where it is built: the cluster's doors (Backend.validate,
    where no engine lives), or LLMEngine.add_request / import_kv when the engine is used
    directly. Workers trust the GenerateRequest and run only check_fits, on their own pool."""
    if not token_ids:
        raise InvalidRequest("prompt", "prompt is empty")
    check_token_range(token_ids, vocab_size)
    if len(token_ids) >= max_model_len:
        raise InvalidRequest("prompt", f"prompt has {len(token_ids)} tokens; this model's context is "
                                       f"{max_model_len} (prompt + output must fit)")
    total = len(token_ids) + params.max_tokens
    if total > max_model_len:
        raise InvalidRequest("max_tokens", f"prompt ({len(token_ids)}) + max_tokens ({params.max_tokens}) "
                                           f"exceeds the context length {max_model_len}")
    if params.top_k > vocab_size:
        raise InvalidRequest("top_k", f"must be at most the vocabulary size {vocab_size}, got {params.top_k}")
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise InvalidRequest("stop_token_ids", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if params.resumed_tokens >= len(token_ids):
        raise InvalidRequest("resumed_tokens", f"{params.resumed_tokens} resumed tokens leave no prompt of the "
                                               f"{len(token_ids)} tokens")
    check_fits(token_ids, params, block_size=block_size, num_blocks=num_blocks, vocab_size=vocab_size)


def check_token_range(token_ids: list[int], vocab_size: int) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


def check_fits(token_ids: list[int], params: SamplingParams, *, block_size: int, num_blocks: int,
               vocab_size: int) -> None:
    """Raise InvalidRequest if the prompt and its whole output can never be in a pool of
    `num_blocks`: the part of the request check a worker runs, since only it knows its pool. The
    token range again too (cheap): an id outside the embedding would fail the forward pass of
    the whole batch, so a request that reached a worker without a door's check cannot kill it."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        check_token_range(token_ids, vocab_size)
    total = len(token_ids) + params.max_tokens
    if -(-total // block_size) > num_blocks:
        raise InvalidRequest("max_tokens", f"needs {-(-total // block_size)} KV blocks; "
                                           f"the pool has {num_blocks}")
