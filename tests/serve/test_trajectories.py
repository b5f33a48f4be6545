"""The token-in/token-out rule: a call extending a segment shares its tokens; a rewritten history starts another."""

from __future__ import annotations

import pytest

from reinforge.agent.runner import agent_metrics
from reinforge.config.schema import MultiTurnConfig
from reinforge.rollout.base import SamplingParams
from reinforge.serve.chat import CallRecord, ChatCodec, RequestError, normalize_message
from reinforge.serve.trajectories import TrajectorySession, assemble_segments


def record(prompt, sampled, finish="stop"):
    return CallRecord([], None, list(prompt), list(sampled), [-0.5] * len(sampled), finish,
                      {"role": "assistant", "content": ""})


def test_a_call_that_extends_a_segment_appends_its_new_tokens_with_mask_0_and_its_samples_with_mask_1():
    segments, last = assemble_segments([record([1, 2], [3, 4]), record([1, 2, 3, 4, 9, 9], [5])])
    assert len(segments) == 1 and last == 0
    segment = segments[0]
    assert segment.prompt_ids == [1, 2]
    assert segment.response_ids == [3, 4, 9, 9, 5]
    assert segment.response_mask == [1, 1, 0, 0, 1]
    assert segment.log_probs == [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert (segment.assistant_turns, segment.user_turns) == (2, 1)


def test_a_rewritten_history_starts_a_new_segment_and_the_last_calls_segment_is_trained():
    records = [record([1, 2], [3, 4]), record([1, 2, 7], [8]), record([1, 2, 3, 4, 9], [5])]
    segments, last = assemble_segments(records)
    assert [segment.prompt_ids for segment in segments] == [[1, 2], [1, 2, 7]]
    assert last == 0 and segments[0].response_ids == [3, 4, 9, 5]  # the third call extends the first segment
    session = TrajectorySession(SamplingParams(max_tokens=50), MultiTurnConfig())
    session.records = records
    output = session.output()
    assert output.prompt_ids == [1, 2] and output.response_mask == [1, 1, 0, 1]
    assert output.metrics["num_segments"] == 2.0
    single = TrajectorySession(SamplingParams(max_tokens=50), MultiTurnConfig())
    single.records = records[:1]
    logged = agent_metrics([output, single.output()])
    assert (logged["agent/num_segments/max"], logged["agent/num_segments/mean"]) == (2.0, 1.5)


def test_budgets_end_the_trajectory_as_tool_agent_does():
    session = TrajectorySession(SamplingParams(max_tokens=6, seed=1), MultiTurnConfig(max_assistant_turns=2))
    first = session.turn_sampling([1, 2], None, None, (99,))
    assert first.max_tokens == 6 and 99 in first.stop_token_ids and first.seed != 1
    session.records.append(record([1, 2], [3, 4]))
    second = session.turn_sampling([1, 2, 3, 4, 9], 0, None, ())
    assert second.max_tokens == 3  # 6 minus the 2 sampled and 1 appended tokens
    session.records.append(record([1, 2, 3, 4, 9], [5]))
    with pytest.raises(RequestError, match=r"ended \(max_turns\)"):
        session.turn_sampling([1, 2, 3, 4, 9, 5, 9], 1, None, ())
    assert session.ended == "max_turns"
    overflowing = TrajectorySession(SamplingParams(max_tokens=4), MultiTurnConfig())
    overflowing.records.append(record([1, 2], [3, 4]))
    with pytest.raises(RequestError, match="tool_overflow"):
        overflowing.turn_sampling([1, 2, 3, 4, 9, 9], 0, None, ())


def test_a_continued_conversation_is_its_earlier_tokens_plus_the_template_increment():
    from reinforge.models.tiny import TOOL_CHAT_TEMPLATE, build_char_tokenizer

    tokenizer = build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)
    codec = ChatCodec(tokenizer)
    session = TrajectorySession(SamplingParams(), MultiTurnConfig())
    messages = [normalize_message({"role": "user", "content": "hi"})]
    prompt, continues = codec.prompt_ids(session, messages, None)
    assert continues is None and prompt == codec.render(messages, None)
    sampled = tokenizer("a  b", add_special_tokens=False)["input_ids"]
    reply, _ = codec.reply(sampled + codec.renderer.eos_ids)
    session.records.append(CallRecord(messages, None, prompt, sampled + codec.renderer.eos_ids, [0.0] * 5, "stop",
                                      reply))
    sent_back = {"role": "assistant", "content": reply["content"]}
    later = messages + [normalize_message(sent_back), normalize_message({"role": "tool", "content": "42"})]
    prompt2, continues2 = codec.prompt_ids(session, later, None)
    assert continues2 == 0
    assert prompt2[:len(prompt) + 5] == prompt + sampled + codec.renderer.eos_ids
    assert tokenizer.decode(prompt2) == tokenizer.apply_chat_template(later, tokenize=False, add_generation_prompt=True)
    edited = messages + [normalize_message({"role": "assistant", "content": "other"}), later[-1]]
    assert codec.prompt_ids(session, edited, None)[1] is None


def test_a_call_the_model_ended_with_a_token_its_template_writes_continues_without_another_end_of_turn():
    """Llama 3.1's ``<|eom_id|>`` closes a built-in tool's call turn in its template: the tool turn follows it
    directly; a call stopped at a stop token is closed with ``<|eot_id|>`` first, as ``tool_agent`` does."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "agent"))
    from family_templates import LLAMA31, family_tokenizer

    tokenizer = family_tokenizer("llama3.1")
    tokenizer.chat_template = LLAMA31.replace('{{- "}" }}{{- "<|eot_id|>" }}', '{{- "}" }}{{- "<|eom_id|>" }}')
    codec = ChatCodec(tokenizer)
    eom, eot = tokenizer.convert_tokens_to_ids(["<|eom_id|>", "<|eot_id|>"])
    tool_turn = [{"role": "tool", "content": "408"}]
    increment = codec.renderer.increment(tool_turn)
    assert codec.increment(record([1, 2], [5, 6, eom]), tool_turn) == increment
    assert codec.increment(record([1, 2], [5, 6]), tool_turn) == [eot, *increment]


def test_a_later_tool_turn_of_a_served_conversation_is_written_as_its_template_writes_it_there():
    """DeepSeek-V3's template opens only a conversation's first tool outputs with <｜tool▁outputs▁begin｜>; the
    endpoint rendered every continued tool turn as a first one."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "agent"))
    from family_templates import family_tokenizer

    tokenizer = family_tokenizer("deepseek-v3")
    codec = ChatCodec(tokenizer, tool_format="deepseek_v3")
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "calc", "arguments": "{}"}, "id": "a"}]}
    earlier = [{"role": "user", "content": "x"}, call, {"role": "tool", "content": "1", "tool_call_id": "a"}, call]
    end = tokenizer.convert_tokens_to_ids("<｜end▁of▁sentence｜>")
    second = CallRecord(earlier, None, [1, 2], [3, end], [-0.5] * 2, "stop", {"role": "assistant", "content": ""})
    tool_turn = [{"role": "tool", "content": "2", "tool_call_id": "a"}]
    opening = tokenizer.convert_tokens_to_ids("<｜tool▁outputs▁begin｜>")
    assert opening in codec.renderer.increment(tool_turn)  # a conversation's first tool turn opens them
    assert opening not in codec.increment(second, tool_turn)
    assert codec.increment(second, tool_turn) == codec.renderer.increment(tool_turn, [[tool_turn[0] | {"content": "1"}]])
