"""The HTTP door's request bodies as typed models, and the OpenAPI 3.1 document built from them
(served at GET /openapi.json).

The models carry the limits the door enforces: the constants of engine/sampling.py, and the
served model's vocabulary and context (hence built per backend by `request_models`). The door
itself parses bodies with router/http/openai_format.py, which names the offending field the way
OpenAI clients expect; tests/unit/test_api_schema.py holds the two to the same field list, and
a schemathesis run against a real `brigade serve` (tests/integration/test_openapi_fuzz.py)
holds the door to the document. Fields the models do not list are ignored, as OpenAI clients
send many (`user`, ...): the objects allow additional properties.
"""
# No `from __future__ import annotations`: the models' field types are built in request_models().
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

from engine.sampling import (
    MAX_LOGPROBS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_STOP_TOTAL_CHARS,
    MAX_TOKENS_LIMIT,
    SEED_RANGE,
)

OPENAPI_VERSION = "3.1.0"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Open):
    include_usage: bool | None = None


class PlainText(BaseModel):
    model_config = ConfigDict(extra="forbid")  # exactly {"type": "text"}
    type: Literal["text"]


class TextPart(_Open):
    type: Literal["text"]
    text: str


class ChatMessage(_Open):
    role: str = Field(description="system, user, assistant, ...: what the model's chat template accepts")
    content: str | Annotated[list[TextPart], Field(min_length=1)] = Field(
        description="text, or text parts joined in order (null is accepted on a message with tool_calls)")


def request_models(vocab_size: int, max_model_len: int, model_name: str | None = None,
                   ) -> tuple[type[BaseModel], type[BaseModel]]:
    """(CompletionRequest, ChatCompletionRequest) with this model's vocabulary and context (and
    its id, the one `model` a request may name, when given)."""
    ModelName = Literal[model_name] if model_name is not None else str
    TokenId = Annotated[int, Field(ge=0, le=vocab_size - 1)]
    TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=max_model_len - 1)]
    StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
    MaxTokens = Annotated[int, Field(ge=1, le=min(MAX_TOKENS_LIMIT, max_model_len - 1), description=(
        f"prompt tokens + max_tokens must fit the context ({max_model_len}) and the KV pool"))]
    One = Literal[1]
    Neutral = Literal[0]  # accepted only at the value that changes nothing

    class Sampling(_Open):
        model: ModelName | None = Field(None, description="the served model's id (GET /v1/models), or left out")
        max_tokens: MaxTokens | None = None
        temperature: Annotated[float, Field(ge=0, description="0 (or below 1e-5): greedy")] | None = None
        top_p: Annotated[float, Field(gt=0, le=1)] | None = None
        top_k: Annotated[int, Field(ge=-1, le=vocab_size, description="-1 or 0: off")] | None = None
        min_p: Annotated[float, Field(ge=0, le=1)] | None = None
        seed: Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1] - 1)] | None = None
        stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS, description=(
            f"at most {MAX_STOP_TOTAL_CHARS} characters together"))] | None = None
        stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
        ignore_eos: bool | None = None
        speculate: bool | None = Field(None, description=(
            "false: never speculate, even on a server started with --speculative (default true)"))
        stream: bool | None = None
        stream_options: StreamOptions | None = None
        return_token_ids: bool | None = Field(None, description="also answer the generated token ids")
        cache_salt: Annotated[str, Field(min_length=1)] | None = Field(
            None, description="prefixes are shared only between requests with the same salt (and tenant)")
        n: One | None = None
        best_of: One | None = None
        # Refused unless at the value that changes nothing (openai_format.UNSUPPORTED).
        frequency_penalty: Neutral | None = None
        presence_penalty: Neutral | None = None
        logit_bias: Annotated[dict[str, Any], Field(max_length=0)] | None = None
        tools: Annotated[list[Any], Field(max_length=0)] | None = None
        functions: Annotated[list[Any], Field(max_length=0)] | None = None
        response_format: PlainText | None = None

    class CompletionRequest(Sampling):
        prompt: Annotated[str, Field(min_length=1)] | TokenIds | Annotated[
            list[Annotated[str, Field(min_length=1)] | TokenIds], Field(min_length=1, max_length=1)] = Field(
            description="text, token ids, or a batch of one of either")
        logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
            None, description="top-n logprobs per generated token")
        echo: Literal[False] | None = None

    class ChatCompletionRequest(Sampling):
        messages: Annotated[list[ChatMessage], Field(min_length=1)]
        max_completion_tokens: MaxTokens | None = Field(None, description=(
            "wins over max_tokens; without either, the rest of the context (within the KV pool)"))
        logprobs: bool | None = None
        top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
            None, description="needs logprobs: true")
        documents: list[dict[str, Any]] | None = None
        chat_template_kwargs: dict[str, Any] | None = None

    return CompletionRequest, ChatCompletionRequest


def _error_response(description: str) -> dict:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}

# Every route may answer these besides its own.
COMMON = {"401": _error_response("missing or unknown bearer token (auth on)"),
          "503": _error_response("starting, draining, no live worker, or too many connections (Retry-After)")}
GENERATION = {"400": _error_response("invalid request; `param` names the field"),
              "404": _error_response("another model or no such route"),
              "408": _error_response("the body did not arrive in time"),
              "413": _error_response("body over frontdoor.max_message_bytes"),
              "429": _error_response("the router's queue is full (Retry-After)")}


def _generation(summary: str, model: str) -> dict:
    return {"post": {
        "summary": summary, "operationId": model,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}}}},
        "responses": {"200": {"description": "the answer; with stream: true, server-sent events ending in [DONE]",
                              "content": {"application/json": {"schema": {"type": "object"}},
                                          "text/event-stream": {"schema": {"type": "string"}}}},
                      **GENERATION, **COMMON}}}


def _get(summary: str, operation_id: str, content_type: str = "application/json", **extra: Any) -> dict:
    schema = {"type": "object"} if content_type == "application/json" else {"type": "string"}
    return {"get": {"summary": summary, "operationId": operation_id, **extra,
                    "responses": {"200": {"description": summary, "content": {content_type: {"schema": schema}}},
                                  **COMMON}}}


def openapi_document(model_name: str, vocab_size: int, max_model_len: int, auth: bool = False,
                     public_health: bool = True) -> dict:
    """The OpenAPI 3.1 document of the HTTP API for this served model; with `auth`, every route
    needs a bearer token (/health too unless `public_health`)."""
    models = request_models(vocab_size, max_model_len, model_name)
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    schemas = {**defs["$defs"], "Error": ERROR_SCHEMA}
    model_param = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    paths = {
        "/v1/completions": _generation("text completion (OpenAI's legacy completions API)", "CompletionRequest"),
        "/v1/chat/completions": _generation("chat completion through the model's chat template",
                                            "ChatCompletionRequest"),
        "/v1/models": _get("the served model", "listModels"),
        "/v1/models/{model}": _get("one model by id (404 for another)", "getModel", parameters=[model_param]),
        "/health": _get("200 when every role has a live worker, else 503", "health"),
        "/metrics": _get("Prometheus text", "metrics", "text/plain"),
        "/openapi.json": _get("this document", "openapi"),
    }
    paths["/v1/models/{model}"]["get"]["responses"]["404"] = _error_response("another model")
    doc = {"openapi": OPENAPI_VERSION,
           "info": {"title": "Brigade", "version": "1",
                    "description": f"OpenAI-compatible API serving {model_name} (context {max_model_len} tokens, "
                                   f"vocabulary {vocab_size})"},
           "paths": paths, "components": {"schemas": schemas}}
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
        if public_health:
            paths["/health"]["get"]["security"] = []
    return doc
