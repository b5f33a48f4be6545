"""Tool calls in each format (Hermes, Llama 3's JSON, Mistral's, DeepSeek-V3's): well-formed calls are read, malformed ones come back
with an explanation, an answer has none."""

from __future__ import annotations

import pytest

from reinforge.agent import TOOL_PARSERS, get_tool_parser, register_tool_parser


def test_reads_calls_in_order_with_object_or_string_arguments():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>\n'
            '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"a\\"}"}</tool_call>')
    calls = get_tool_parser("hermes").parse(text)
    assert [(call.name, call.arguments, call.error) for call in calls] == [
        ("calculator", {"expression": "12*34"}, None), ("lookup", {"key": "a"}, None)]
    # Llama's "parameters" key: the call ran without its arguments
    assert get_tool_parser("hermes").parse('<tool_call>{"name": "c", "parameters": {"x": 1}}</tool_call>')[0].arguments \
        == {"x": 1}


def test_calls_are_read_after_the_reasoning_not_in_it():
    """Qwen3's template takes a reply's content as the text after its last </think>: a tag the thinking mentions, or
    a call it drafts, is not a call."""
    text = ('<think>\nI will write <tool_call> with {"name": "calc"} once I know the numbers.\n'
            '<tool_call>{"name": "draft", "arguments": {}}</tool_call>\n</think>\n\n'
            '<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call>')
    assert [(call.name, call.arguments, call.error) for call in get_tool_parser("hermes").parse(text)] == [
        ("calc", {"expr": "2+3"}, None)]
    assert get_tool_parser("hermes").parse("<think>Maybe <tool_call> the calculator?</think>\n\nIt is 5.") == []


def test_text_without_calls_has_none():
    assert get_tool_parser("hermes").parse("The answer is 408.") == []
    assert get_tool_parser("hermes").parse("</tool_call> is how a call ends.") == []


@pytest.mark.parametrize("text, names", [
    ('<tool_call>{"name": "a", "arguments": {}}', [""]),
    ('<tool_call>{"name": "a"}</tool_call> then <tool_call>{"name": "b"', ["a", ""]),
])
def test_a_call_left_open_is_a_malformed_call_not_a_final_answer(text, names):
    calls = get_tool_parser("hermes").parse(text)
    assert [call.name for call in calls] == names
    assert "was not closed with </tool_call>" in calls[-1].error


@pytest.mark.parametrize("body, message", [
    ('{"name": "calculator", "arguments": {"expression": }', "Invalid JSON in tool call"),
    ('{"arguments": {}}', 'needs a "name"'),
    ('{"name": "calculator", "arguments": [1, 2]}', "must be a JSON object"),
    ('{"name": "calculator", "arguments": "{bad"}', "Invalid JSON in arguments for 'calculator'"),
])
def test_malformed_calls_carry_an_error(body, message):
    (call,) = get_tool_parser("hermes").parse(f"<tool_call>{body}</tool_call>")
    assert call.error is not None and message in call.error


DEEPSEEK_CALLS = ("Let me.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>a\n```json\n{\"x\": 1}\n```"
                  "<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>b\n```json\n{}\n```<｜tool▁call▁end｜>")
DEEPSEEK_END = "<｜tool▁calls▁end｜>"


@pytest.mark.parametrize("format, text, expected", [
    ("llama3_json", '{"name": "calc", "parameters": {"expr": "2;3"}}', [("calc", {"expr": "2;3"}, None)]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}',
     [("a", {}, None), ("b", {"x": 1}, None)]),
    ("llama3_json", "The answer is 5.", []),
    ("llama3_json", '{"answer": 5}', []),  # a JSON answer, not a call
    ("llama3_json", '{"name": "calc", "parameters": {"expr": ', [("", {}, "Invalid JSON in tool call")]),  # cut
    ("llama3_json", '{"name": "calc", "parameters": [1]}', [("calc", {}, "must be a JSON object")]),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": "{}"}]',
     [("a", {"x": 1}, None), ("b", {}, None)]),
    ("mistral", '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}', [("a", {"x": 1}, None), ("b", {}, None)]),
    ("mistral", '[TOOL_CALLS]a[CALL_ID]k3Jd9sA0q[ARGS]{"x": 1}', [("a", {"x": 1}, None)]),  # its id, not in its name
    ("mistral", "No call here.", []),
    ("mistral", '[TOOL_CALLS] [{"name": "a", "arguments": {"x": ', [("", {}, "Invalid JSON in tool call")]),
    ("mistral", "[TOOL_CALLS]a[ARGS]{bad", [("a", {}, "Invalid JSON in arguments for 'a'")]),
    ("mistral", '[TOOL_CALLS] [{"arguments": {}}]', [("", {}, 'needs a "name"')]),
    ("deepseek_v3", DEEPSEEK_CALLS + DEEPSEEK_END, [("a", {"x": 1}, None), ("b", {}, None)]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>a<｜tool▁sep｜>{\"x\": 1}<｜tool▁call▁end｜><｜tool▁call▁begin｜>"
                    "b<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", [("a", {"x": 1}, None), ("b", {}, None)]),  # V3.1
    ("deepseek_v3", "<｜tool▁call▁begin｜>a<｜tool▁call▁end｜>", [("", {}, "needs <｜tool▁sep｜> before its name")]),
    ("deepseek_v3", DEEPSEEK_CALLS[:-30], [("a", {"x": 1}, None), ("", {}, "was not closed")]),  # cut
    ("deepseek_v3", DEEPSEEK_CALLS.replace('{"x": 1}', '{"x": '), [("a", {}, "Invalid JSON in arguments for 'a'"),
                                                                    ("b", {}, None)]),
])
def test_each_format_reads_its_calls_and_explains_malformed_ones(format, text, expected):
    calls = get_tool_parser(format).parse(text)
    assert [(call.name, call.arguments) for call in calls] == [(name, arguments) for name, arguments, _ in expected]
    for call, (_, _, error) in zip(calls, expected, strict=True):
        assert call.error is None if error is None else error in call.error


@pytest.mark.parametrize("format, text", [
    ("hermes", "<tool_call>" + "[" * 5000 + "</tool_call>"),
    ("hermes", '<tool_call>{"name": "a", "arguments": "' + "[" * 5000 + '"}</tool_call>'),
    ("llama3_json", '{"name": "a", "parameters": ' + "[" * 5000),
    ("mistral", "[TOOL_CALLS]" + "[" * 5000),
    ("deepseek_v3", DEEPSEEK_CALLS.replace('{"x": 1}', "[" * 5000)),
])
def test_json_nested_past_the_recursion_limit_is_a_malformed_call(format, text):
    # a model repeating "[" sampled a RecursionError, which stopped the rollout
    calls = get_tool_parser(format).parse(text)
    assert any(call.error is not None and "nested too deeply" in call.error for call in calls)


@pytest.mark.parametrize("format, text", [
    ("hermes", '<tool_call>{"name": "a", "arguments": {"x": ' + "1" * 5000 + "}}</tool_call>"),
    ("llama3_json", '{"name": "a", "parameters": {"x": ' + "1" * 5000 + "}}"),
    ("mistral", '[TOOL_CALLS]a[ARGS]{"x": ' + "1" * 5000 + "}"),
    ("deepseek_v3", DEEPSEEK_CALLS.replace('{"x": 1}', '{"x": ' + "1" * 5000 + "}")),
])
def test_an_integer_longer_than_python_reads_is_a_malformed_call(format, text):
    # a model repeating a digit: json raised a plain ValueError (Python's 4300-digit limit), which stopped the rollout
    calls = get_tool_parser(format).parse(text)
    assert any(call.error is not None and "a number too long to read" in call.error for call in calls)


def test_a_turn_repeating_the_opening_tag_is_read_in_linear_time():
    import time

    start = time.perf_counter()
    calls = get_tool_parser("hermes").parse("<tool_call>" * 20000)  # a regex took 40 s, the event loop waiting
    assert time.perf_counter() - start < 1
    assert len(calls) == 1 and "was not closed" in calls[0].error


def test_unknown_format_lists_the_known_ones():
    with pytest.raises(ValueError, match="format='xml' is not a known tool-call format; known: deepseek_v3, hermes, "
                                         "llama3_json, mistral"):
        get_tool_parser("xml")


def test_parsers_are_pluggable():
    @register_tool_parser("test_upper")
    class Upper:
        def parse(self, text):
            from reinforge.agent import ToolCall

            return [ToolCall(word.lower()) for word in text.split() if word.isupper()]

    try:
        assert [call.name for call in get_tool_parser("test_upper").parse("call SEARCH now")] == ["search"]
    finally:
        del TOOL_PARSERS["test_upper"]
