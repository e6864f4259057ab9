"""Chat messages through the model's template, with malformed input refused by field."""
import pytest

from engine.engine_setup import resolve_model
from engine.sampling import InvalidRequest
from engine.tokenizer import Tokenizer, chat_token_ids


def test_chat_messages_render_and_tokenize():
    tok = Tokenizer.from_dir(resolve_model("tiny"))
    ids = chat_token_ids(tok, [{"role": "user", "content": "Hello there"}])
    assert ids == tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hello there"}]))
    assert "Hello there" in tok.decode(ids)


@pytest.mark.parametrize("messages", [[], "hi", [{"role": "user"}], [{"role": 1, "content": "x"}], [["user", "x"]]])
def test_malformed_messages(messages):
    tok = Tokenizer.from_dir(resolve_model("tiny"))
    with pytest.raises(InvalidRequest) as err:
        chat_token_ids(tok, messages)
    assert err.value.field == "messages"
