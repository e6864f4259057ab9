"""Every string a client sends is text or the request is refused naming the field: the HTTP
door's walk over the parsed JSON body (router/request_text.py) and the gRPC door's locator of a
string field with bytes that are not UTF-8 (router/grpc/wire_text.py)."""
from __future__ import annotations

import json

import pytest
from brigade_client.v1 import brigade_pb2 as pb

from engine.sampling import InvalidRequest
from router.grpc.wire_text import bad_text_field
from router.request_text import check_body_text

LONE = ("\ud800", "\udc80", "\udfff")  # a high surrogate, a low one, the last one
GOOD = "naïve café, 日本語, emoji 😀, RTL עברית, NUL-free combining e\u0301"


def body_with(path: str, value) -> tuple[dict, str]:
    """A chat body with `value` placed at `path`; the field the refusal must name."""
    body = {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                     {"type": "text", "text": "there"}]}],
            "stop": ["a", "b"], "cache_salt": "conv", "user": "u-1", "documents": [{"title": "t", "text": "d"}],
            "chat_template_kwargs": {"enable_thinking": False, "names": ["x", {"deep": ["y"]}]}}
    node, keys = body, path.replace("[", ".").replace("]", "").split(".")
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    last = keys[-1]
    node[int(last) if isinstance(node, list) else last] = value
    return body, path


PATHS = ["prompt", "messages[0].content", "messages[0].role", "messages[1].content[1].text",
         "messages[1].content[0].type", "stop[1]", "cache_salt", "user", "model", "documents[0].text",
         "chat_template_kwargs.enable_thinking", "chat_template_kwargs.names[1].deep[0]"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("lone", LONE)
def test_a_lone_surrogate_anywhere_is_refused_naming_its_path(path: str, lone: str) -> None:
    body, field = body_with(path, f"text {lone} more")
    with pytest.raises(InvalidRequest, match="lone UTF-16 surrogate") as err:
        check_body_text(body)
    assert err.value.field == field
    json.dumps({"error": str(err.value)}, ensure_ascii=False).encode()  # the answer itself is text


def test_a_surrogate_from_a_json_escape_or_raw_bytes_is_caught() -> None:
    """json.loads turns both the escape and the raw (invalid UTF-8) bytes into a lone surrogate."""
    for raw in (rb'{"cache_salt": "\ud800"}', b'{"cache_salt": "\xed\xa0\x80"}'):
        with pytest.raises(InvalidRequest) as err:
            check_body_text(json.loads(raw))
        assert err.value.field == "cache_salt"


def test_a_bad_key_is_named_by_its_object() -> None:
    with pytest.raises(InvalidRequest, match="has a key") as err:
        check_body_text({"chat_template_kwargs": {"ok": 1, "bad\udc80": 2}})
    assert err.value.field == "chat_template_kwargs"
    with pytest.raises(InvalidRequest) as err:
        check_body_text({"\ud800": 1})
    assert err.value.field == "request"


def test_valid_text_passes_in_every_field() -> None:
    for path in PATHS:
        check_body_text(body_with(path, GOOD)[0])
    check_body_text(json.loads(r'{"prompt": "\ud83d\ude00 a pair is one character"}'))  # an escaped pair is fine
    check_body_text({"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.5, "stream": True, "stop": None})


def test_the_first_bad_string_in_document_order_is_named() -> None:
    with pytest.raises(InvalidRequest) as err:
        check_body_text({"prompt": "ok", "stop": ["fine", "\ud800"], "cache_salt": "\udc80"})
    assert err.value.field == "stop[1]"


def test_nesting_far_past_the_recursion_limit_is_walked() -> None:
    deep: object = "\ud800"
    for _ in range(50_000):
        deep = [deep]
    with pytest.raises(InvalidRequest) as err:
        check_body_text({"chat_template_kwargs": {"x": deep}})
    assert err.value.field.startswith("chat_template_kwargs.x[0][0]")


# -- the gRPC wire ------------------------------------------------------------------------------

MARK = b"@@MARK@@"


def generate_with(place: str) -> bytes:
    """A GenerateRequest whose field at `place` holds MARK, so its bytes can be made bad UTF-8."""
    m = "@@MARK@@"
    fields = {"request_id": "r", "cache_salt": "s", "model": "", "session_id": "x"}
    sampling = pb.SamplingParams(stop=["one", "two"], stop_token_ids=[1, 2], max_tokens=3)
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi"),
                                     pb.ChatMessage(role="assistant", content="yo")])
    if place in fields:
        fields[place] = m
    elif place == "sampling.stop[1]":
        sampling.stop[1] = m
    elif place == "chat.messages[1].content":
        chat.messages[1].content = m
    elif place == "chat.messages[0].role":
        chat.messages[0].role = m
    prompt = {"text": m} if place == "text" else {"chat": chat}
    return pb.GenerateRequest(**fields, **prompt, sampling=sampling).SerializeToString()


GRPC_PLACES = ["text", "request_id", "cache_salt", "model", "session_id", "sampling.stop[1]",
               "chat.messages[1].content", "chat.messages[0].role"]


@pytest.mark.parametrize("place", GRPC_PLACES)
def test_the_grpc_field_with_bad_utf8_is_named(place: str) -> None:
    data = generate_with(place).replace(MARK, b"ab\xed\xa0\x80cde")  # a surrogate: UTF-8 cannot hold one
    with pytest.raises(Exception, match="bad UTF-8"):  # what the runtime says: no field named
        pb.GenerateRequest.FromString(data)
    assert bad_text_field(pb.GenerateRequest.DESCRIPTOR, data) == place
    not_utf8 = generate_with(place).replace(MARK, bytes(range(0xF8, 0x100)))  # bytes no UTF-8 text has
    assert bad_text_field(pb.GenerateRequest.DESCRIPTOR, not_utf8) == place


def test_valid_or_otherwise_broken_messages_name_no_text_field() -> None:
    for place in GRPC_PLACES:
        good = generate_with(place).replace(MARK, GOOD[:3].encode().ljust(len(MARK), b"x"))
        pb.GenerateRequest.FromString(good)
        assert bad_text_field(pb.GenerateRequest.DESCRIPTOR, good) is None
    data = generate_with("text")
    assert bad_text_field(pb.GenerateRequest.DESCRIPTOR, data[:-3]) is None  # truncated
    assert bad_text_field(pb.GenerateRequest.DESCRIPTOR, b"\xff" * 20) is None  # a varint that never ends
    tok = pb.TokenizeRequest(text="@@MARK@@").SerializeToString().replace(MARK, b"\xed\xb2\x80" + b"x" * 5)
    assert bad_text_field(pb.TokenizeRequest.DESCRIPTOR, tok) == "text"
