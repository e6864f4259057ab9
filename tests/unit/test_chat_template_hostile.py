"""Chat template inputs a hostile client sends: names that would shadow the renderer's own,
values nested past the recursion limit, and renders that would take seconds and gigabytes.
Each is a 400-style InvalidRequest naming the field, refused before it costs the memory."""
from __future__ import annotations

import json
import logging
import shutil
import time
import tracemalloc

import pytest

from engine.chat_template import RESERVED, TemplateRefused, render
from engine.engine_setup import resolve_model
from engine.sampling import InvalidRequest
from engine.tokenizer import Tokenizer, chat_token_ids

HI = [{"role": "user", "content": "hi"}]


def tokenizer_with(tmp_path, template: str) -> Tokenizer:
    shutil.copy(resolve_model("tiny") / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "</s>"}))
    return Tokenizer.from_dir(tmp_path)


def nested(depth: int) -> object:
    value: object = []
    for i in range(depth - 1):
        value = {"a": value} if i % 2 else [value]
    return value


def test_variables_named_like_the_renderers_arguments_are_plain_variables(tmp_path):
    """`template`, `special_tokens` and `variables` were (or are) keyword arguments of the render call (a
    TypeError, 500): they reach the template as any other variable."""
    tok = tokenizer_with(tmp_path, "{{ template }}|{{ special_tokens }}|{{ variables }}|{{ messages[0]['content'] }}")
    kwargs = {"template": "x", "special_tokens": {}, "variables": 1}
    assert tok.decode(chat_token_ids(tok, HI, template_kwargs=kwargs)).startswith("x|{}|1|hi")


@pytest.mark.parametrize("key", ["self", "raise_exception", "namespace", "range", "messages", "bos_token",
                                 "pad_token", "eos_token", "loop"])
def test_a_variable_that_would_shadow_the_renderers_own_names_is_refused_naming_it(key):
    """Names the template relies on (its globals, inputs and special tokens, set by the model
    or not: tiny sets pad_token and eos_token, leaves bos_token unset) cannot be replaced."""
    tok = Tokenizer.from_dir(resolve_model("tiny"))
    with pytest.raises(InvalidRequest) as err:
        chat_token_ids(tok, HI, template_kwargs={key: "x"})
    assert err.value.field == "chat_template_kwargs" and repr(key) in str(err.value)
    assert key in RESERVED


def test_reserved_names_cannot_reach_the_template_through_render_either():
    with pytest.raises(TemplateRefused) as err:
        render("{{ raise_exception }}", HI, variables={"raise_exception": 1})
    assert err.value.field == "chat_template_kwargs"


@pytest.mark.parametrize("field", ["messages", "tools", "documents", "chat_template_kwargs"])
def test_values_nested_500_deep_are_refused_naming_the_field_without_logging(field, caplog):
    """A RecursionError (and a 134 KB traceback, logged twice) before: now a refusal naming the field."""
    tok = Tokenizer.from_dir(resolve_model("tiny"))
    inputs = {"messages": [{"role": "user", "content": "x", "extra": nested(500)}] if field == "messages" else HI,
              "tools": [{"a": nested(500)}] if field == "tools" else None,
              "documents": [{"a": nested(500)}] if field == "documents" else None,
              "template_kwargs": {"a": nested(500)} if field == "chat_template_kwargs" else None}
    with caplog.at_level(logging.DEBUG), pytest.raises(InvalidRequest) as err:
        chat_token_ids(tok, **inputs)
    assert err.value.field == field and "nested deeper than 32 levels" in str(err.value)
    assert not caplog.records


def test_values_up_to_32_levels_render():
    assert render("{{ x|tojson }}", HI, variables={"x": nested(31)}).count("[") > 10  # 32 with the kwargs object


def test_a_template_recursing_without_end_is_refused():
    with pytest.raises(TemplateRefused, match="recursed too deeply") as err:
        render("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", HI)
    assert err.value.field == "messages"


def refused_within(template: str, variables: dict | None = None, memory_mb: float = 64) -> TemplateRefused:
    """The refusal, checked to have cost less than `memory_mb` of Python allocations."""
    tracemalloc.start()
    try:
        with pytest.raises(TemplateRefused) as err:
            render(template, HI, variables=variables)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < memory_mb * 2**20, f"{peak / 2**20:.0f} MiB"
    return err.value


@pytest.mark.parametrize("template", [
    "{{ 'x' * 200000000 }}",  # 1 GB and 1.9 s before
    "{{ ['x'] * 200000000 }}",
    "{{ '%0200000000d' % 1 }}",
    "{{ '{:>200000000}'.format(1) }}",
    "{{ 'a'|center(200000000) }}",
    "{{ 'x'.ljust(200000000) }}",
    "{{ range(100000)|join('x' * 100000) }}",
    "{{ 'ab'|replace('', 'x' * 10000000) }}",
    "{{ ['x']|batch(200000000, 'y')|list }}",
    "{{ 10 ** (10 ** 9) }}",
    "{{ messages|tojson(indent=200000000) }}",
])
def test_a_step_over_the_size_budget_is_refused_before_it_allocates(template):
    assert refused_within(template).field == "messages"


def test_doubling_a_string_in_a_namespace_stops_at_the_budget():
    refused_within("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                   "{% endfor %}{{ ns.s|length }}", memory_mb=128)


def test_output_over_the_size_budget_is_refused():
    """100,000 copies of a 1,000-character value: 100 MB of text, stopped at the budget."""
    refused_within("{% for i in range(100000) %}{{ v }}{% endfor %}", {"v": "y" * 1000}, memory_mb=128)


def test_a_render_past_its_time_budget_is_refused():
    """10^10 loop steps would run for hours: the deadline is checked at each operation."""
    start = time.monotonic()
    err = refused_within("{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}")
    assert "render budget" in str(err) and time.monotonic() - start < 60  # nothing hangs


def test_a_budget_spent_by_the_callers_variables_names_them():
    """The same template refuses the messages' fault as `messages`, the variables' as `chat_template_kwargs`."""
    template = "{{ messages[0]['content'] * (n or 1) }}"
    err = refused_within(template, {"n": 200000000})
    assert err.field == "chat_template_kwargs"
    assert render(template, HI, variables={"n": 3}) == "hihihi"


def test_large_real_inputs_stay_within_the_budget():
    """The budget grows with the input: a 4 MiB message renders through the tiny model's template."""
    tok = Tokenizer.from_dir(resolve_model("tiny"))
    text = tok.apply_chat_template([{"role": "user", "content": "x" * (4 << 20)}])
    assert len(text) > 4 << 20
