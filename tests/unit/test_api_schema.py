"""The OpenAPI document (router/http/api_schema.py) against the door's parser: the request models
list exactly the fields the parser reads (recorded by running it, so a field added to one and
not the other fails here), carry the served model's limits, and valid bodies pass both."""
from __future__ import annotations

import pytest

from engine.request_checks import check_request, output_room
from engine.sampling import MAX_LOGPROBS, MAX_STOP_TOKEN_IDS
from router.http.api_schema import openapi_document, request_models
from router.http.openai_format import parse_chat, parse_completion

VOCAB, CONTEXT = 100, 64


class Recording(dict):
    """A request body that remembers every key the parser looked at."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def copy(self):  # the chat parser renames fields in a copy: what it reads there counts too
        twin = Recording(self)
        twin.read = self.read
        return twin

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


class Backend:
    model_name, vocab_size, max_model_len = "m", VOCAB, CONTEXT

    def tokenize(self, prompt):
        return [1, 2, 3] if isinstance(prompt, str) else prompt

    def chat_token_ids(self, messages, **template):
        return [1, 2, 3]

    def validate(self, ids, params):
        check_request(ids, params, vocab_size=VOCAB, max_model_len=CONTEXT, block_size=16, num_blocks=64)

    def output_room(self, ids):
        return output_room(ids, max_model_len=CONTEXT, block_size=16, num_blocks=64)


BODIES = {
    "completion": [{"prompt": "hi"}, {"prompt": [1, 2], "max_tokens": 3, "logprobs": 2, "stop": "x",
                                      "stop_token_ids": [4], "seed": 7, "top_k": VOCAB, "stream": True,
                                      "stream_options": {"include_usage": True}, "n": 1, "echo": False},
                   {"prompt": [[5, 6]], "response_format": {"type": "text"}, "user": "anyone"}],
    "chat": [{"messages": [{"role": "user", "content": "hi"}]},
             {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
              "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 3, "chat_template_kwargs": {"x": 1},
              "documents": [{"title": "t"}], "temperature": 0}],
}


def fields(model) -> set[str]:
    return set(model.model_fields)


def test_the_models_list_exactly_the_fields_the_parser_reads() -> None:
    completion, chat = request_models(VOCAB, CONTEXT)
    for parse, model, kind in ((parse_completion, completion, "completion"), (parse_chat, chat, "chat")):
        read: set[str] = set()
        for body in BODIES[kind]:
            recording = Recording(body)
            parse(recording, Backend())
            read |= recording.read
        assert read == fields(model), (kind, read ^ fields(model))


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_valid_bodies_pass_the_models(kind) -> None:
    completion, chat = request_models(VOCAB, CONTEXT)
    model = completion if kind == "completion" else chat
    for body in BODIES[kind]:
        model.model_validate(body)


def test_the_document_carries_the_served_models_limits() -> None:
    doc = openapi_document("m", VOCAB, CONTEXT)
    assert doc["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/openapi.json"} <= set(doc["paths"])
    schemas = doc["components"]["schemas"]
    props = schemas["CompletionRequest"]["properties"]

    def bound(prop: dict, key: str):
        return next(s[key] for s in prop["anyOf"] if key in s)

    assert bound(props["top_k"], "maximum") == VOCAB
    assert bound(props["max_tokens"], "maximum") == CONTEXT - 1
    assert bound(props["logprobs"], "maximum") == MAX_LOGPROBS
    assert bound(props["stop_token_ids"], "maxItems") == MAX_STOP_TOKEN_IDS
    ids = next(s for s in props["prompt"]["anyOf"] if s.get("type") == "array" and s["items"].get("type") == "integer")
    assert ids["items"]["maximum"] == VOCAB - 1 and ids["maxItems"] == CONTEXT - 1
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]
    ref = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert ref == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert "security" not in doc


def test_with_auth_every_route_but_public_health_needs_the_token() -> None:
    doc = openapi_document("m", VOCAB, CONTEXT, auth=True, public_health=True)
    assert doc["security"] == [{"bearer": []}] and doc["paths"]["/health"]["get"]["security"] == []
    private = openapi_document("m", VOCAB, CONTEXT, auth=True, public_health=False)
    assert "security" not in private["paths"]["/health"]["get"]
