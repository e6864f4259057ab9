"""The checks a request passes before it runs: where it is built (a door, or an engine used
directly) against the engine's shape, and on the worker against its own KV pool."""
from __future__ import annotations

from engine.sampling import MAX_TOKENS_LIMIT, InvalidRequest, SamplingParams


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
    check_texts(params.stop, "stop")
    if params.resumed_tokens >= len(token_ids):
        raise InvalidRequest("resumed_tokens", f"{params.resumed_tokens} resumed tokens leave no prompt of the "
                                               f"{len(token_ids)} tokens")
    check_fits(token_ids, params, block_size=block_size, num_blocks=num_blocks, vocab_size=vocab_size)


def output_room(token_ids: list[int], *, max_model_len: int, block_size: int, num_blocks: int) -> int:
    """The most output tokens this prompt leaves room for: the rest of the context, within a
    KV pool of `num_blocks` (what a chat request that names no max_tokens may generate, as
    OpenAI's and vLLM's chat endpoints do). At least 1, so an over-long prompt fails its own
    check (naming the prompt) rather than this one."""
    return max(1, min(max_model_len, block_size * num_blocks, len(token_ids) + MAX_TOKENS_LIMIT) - len(token_ids))


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


def check_text(value: object, field_name: str, what: str = "is") -> None:
    """Raise InvalidRequest unless `value` is a str that is valid Unicode text: a lone UTF-16
    surrogate ("\\ud800") is a str Python holds but UTF-8 cannot encode, so the tokenizer,
    the detokenizer's stop search and every encoder after it would fail on it. `what` begins
    the error after the field's name ("has a key that is": the text was one of its keys)."""
    if not isinstance(value, str):
        raise InvalidRequest(field_name, f"must be a string, got {type(value).__name__}")
    if value.isascii():  # the common case, without building the encoded copy
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(field_name, f"{what} not valid Unicode text: a lone UTF-16 surrogate "
                                         f"U+{ord(value[exc.start]):04X} at character {exc.start}; "
                                         "send UTF-8 text") from None


def check_texts(values: tuple[str, ...], field_name: str) -> None:
    for value in values:
        check_text(value, field_name)


def check_strings(prompt: object, params: SamplingParams, cache_salt: object) -> None:
    """The request's strings are valid text: refused at submission, they cannot fail in a step
    (the tokenizer, stop-string search, block hashes) or kill the engine there."""
    if isinstance(prompt, str):
        check_text(prompt, "prompt")
    check_texts(params.stop, "stop")
    if cache_salt is not None:
        check_text(cache_salt, "cache_salt")
