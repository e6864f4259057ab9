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


# -- real templates, rendered as transformers renders them ----------------------------------
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "18C, sunny"},
    {"role": "user", "content": "Thanks! Caf\u00e9?"},
]
DOCUMENTS = [{"title": "Menu", "text": "Croissant 2 EUR"}]


def qwen25_dir(header, tmp_path):
    """Qwen2.5-Coder's tokenizer files from its GGUF header (what the converter writes)."""
    import json

    from gguf import GGUFReader

    from engine.gguf.vocab import build_tokenizer

    text, cfg = build_tokenizer(GGUFReader(str(header)))
    (tmp_path / "tokenizer.json").write_text(text, encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return tmp_path


@pytest.fixture(scope="module")
def real_templates(request, tmp_path_factory):
    """name -> (transformers' tokenizer, ours), each loaded once (Qwen's vocabulary is 151k)."""
    from transformers import AutoTokenizer

    smollm2 = request.getfixturevalue("smollm2")
    qwen3 = request.getfixturevalue("qwen3_tokenizer")
    qwen25 = qwen25_dir(request.getfixturevalue("qwen25_header"), tmp_path_factory.mktemp("qwen25"))
    return {name: (AutoTokenizer.from_pretrained(path), Tokenizer.from_dir(path))
            for name, path in {"smollm2": smollm2, "qwen2.5": qwen25, "qwen3": qwen3}.items()}


@pytest.mark.parametrize("name", ["smollm2", "qwen2.5", "qwen3"])
@pytest.mark.parametrize("case", ["plain", "tools", "documents", "no-thinking", "no-generation-prompt"])
def test_real_templates_render_as_transformers_does(real_templates, name, case):
    hf, ours = real_templates[name]
    messages = CONVERSATION if case != "plain" else CONVERSATION[:2]
    kwargs = {"tools": TOOLS} if case == "tools" else {"documents": DOCUMENTS} if case == "documents" else {}
    template_kwargs = {"enable_thinking": False} if case == "no-thinking" else {}
    gen = case != "no-generation-prompt"
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kwargs, **template_kwargs)
    assert ours.apply_chat_template(messages, add_generation_prompt=gen, **kwargs, **template_kwargs) == want
    ids = chat_token_ids(ours, messages, kwargs.get("tools"), kwargs.get("documents"),
                         {**template_kwargs, "add_generation_prompt": gen})
    want_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, **kwargs, **template_kwargs)
    assert ids == list(getattr(want_ids, "input_ids", want_ids))
    if name != "smollm2" and case == "tools":
        assert "get_weather" in want  # the template really used them
    if name == "qwen3" and case == "no-thinking":
        assert want.endswith("<think>\n\n</think>\n\n")


def test_a_templates_raise_exception_is_a_messages_error(tmp_path):
    import json
    import shutil

    shutil.copy(resolve_model("tiny") / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}")}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.decode(chat_token_ids(tok, [{"role": "user", "content": "hi"}])) == "hi"
    with pytest.raises(InvalidRequest) as err:
        chat_token_ids(tok, [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}])
    assert err.value.field == "messages" and "roles must alternate" in str(err.value)


@pytest.mark.parametrize("field, kwargs", [
    ("tools", {"tools": "get_weather"}), ("documents", {"documents": [1, 2]}),
    ("chat_template_kwargs", {"template_kwargs": [1]}), ("chat_template_kwargs", {"template_kwargs": {"messages": 1}}),
])
def test_malformed_template_inputs_name_their_field(field, kwargs):
    tok = Tokenizer.from_dir(resolve_model("tiny"))
    with pytest.raises(InvalidRequest) as err:
        chat_token_ids(tok, [{"role": "user", "content": "hi"}], **kwargs)
    assert err.value.field == field


def test_openai_chat_request_passes_documents_and_chat_template_kwargs(real_templates):
    """The HTTP door's parsing hands documents and chat_template_kwargs to the template (tools are
    refused there: no tool-call parser turns an answer into tool_calls)."""
    from router.http.openai_format import parse_chat

    tok = real_templates["qwen3"][1]

    class Backend:  # the door's Backend protocol over the real tokenizer; no model needed
        model_name, max_model_len = "qwen3", 1 << 15

        def chat_token_ids(self, messages, **template):
            return chat_token_ids(tok, messages, **template)

        def validate(self, ids, params):
            pass

        def output_room(self, ids):
            return 16

    body = {"model": "qwen3", "messages": CONVERSATION[:2], "chat_template_kwargs": {"enable_thinking": False}}
    got = parse_chat(body, Backend()).prompt_ids
    want = tok.encode(tok.apply_chat_template(CONVERSATION[:2], enable_thinking=False))
    assert got == want and tok.decode(got).endswith("</think>\n\n")
    assert parse_chat({**body, "chat_template_kwargs": None}, Backend()).prompt_ids != got  # thinking on
    assert parse_chat({**body, "documents": DOCUMENTS}, Backend()).prompt_ids == tok.encode(
        tok.apply_chat_template(CONVERSATION[:2], documents=DOCUMENTS, enable_thinking=False))
    with pytest.raises(InvalidRequest) as err:
        parse_chat({**body, "chat_template_kwargs": {"tools": 1}}, Backend())
    assert err.value.field == "chat_template_kwargs"
