"""Format detection, conversion to conversations, and the per-row checks, one record at a time."""

from __future__ import annotations

import pytest

from lorafit.data.formats import detect_format, detect_record, from_messages, normalize, parse_mapping
from lorafit.errors import DataError

USER_HI = {"role": "user", "content": "Say hi"}
ASSISTANT_HI = {"role": "assistant", "content": "hi"}


@pytest.mark.parametrize(
    ("record", "fmt", "expected"),
    [
        (
            {"instruction": "Add the numbers", "input": "1 2", "output": "3"},
            "alpaca",
            [{"role": "user", "content": "Add the numbers\n\n1 2"}, {"role": "assistant", "content": "3"}],
        ),
        ({"instruction": "Say hi", "input": "", "output": "hi"}, "alpaca", [USER_HI, ASSISTANT_HI]),
        (
            {"instruction": "Say hi", "output": "hi", "system": "Be brief."},
            "alpaca",
            [{"role": "system", "content": "Be brief."}, USER_HI, ASSISTANT_HI],
        ),
        (
            {
                "conversations": [
                    {"from": "system", "value": "S"},
                    {"from": "human", "value": "Say hi"},
                    {"from": "gpt", "value": "hi"},
                ]
            },
            "sharegpt",
            [{"role": "system", "content": "S"}, USER_HI, ASSISTANT_HI],
        ),
        (
            {"system": "S", "conversations": [{"from": "human", "value": "Say hi"}, {"from": "gpt", "value": "hi"}]},
            "sharegpt",
            [{"role": "system", "content": "S"}, USER_HI, ASSISTANT_HI],
        ),
        ({"messages": [USER_HI, ASSISTANT_HI]}, "messages", [USER_HI, ASSISTANT_HI]),
        ({"prompt": "Say hi", "completion": "hi"}, "prompt_completion", [USER_HI, ASSISTANT_HI]),
        ({"prompt": [USER_HI], "completion": [ASSISTANT_HI]}, "prompt_completion", [USER_HI, ASSISTANT_HI]),
        ({"text": "Once upon a time."}, "text", [{"role": "assistant", "content": "Once upon a time."}]),
    ],
)
def test_each_format_becomes_the_same_conversation_form(record: dict, fmt: str, expected: list) -> None:
    assert detect_record(record) == fmt
    messages, issues = normalize(record, fmt)
    assert issues == []
    assert messages == expected


def test_tool_turns_keep_their_calls() -> None:
    call = [{"type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]
    record = {
        "messages": [
            {"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": None, "tool_calls": call},
            {"role": "tool", "content": "2", "tool_call_id": "c1"},
            {"role": "assistant", "content": "2"},
        ]
    }
    messages, issues = normalize(record, "messages")
    assert issues == []
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": call}
    assert messages[2] == {"role": "tool", "content": "2", "tool_call_id": "c1"}


def test_text_content_parts_are_joined_and_images_are_refused() -> None:
    parts = [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]
    messages, _ = normalize({"messages": [{"role": "user", "content": parts}, ASSISTANT_HI]}, "messages")
    assert messages[0] == USER_HI
    image = [{"type": "image_url", "image_url": {"url": "x.png"}}]
    messages, issues = normalize({"messages": [{"role": "user", "content": image}, ASSISTANT_HI]}, "messages")
    assert messages is None
    assert "image_url" in issues[0].message


@pytest.mark.parametrize(
    ("record", "fmt", "field", "words"),
    [
        ({"instruction": "x"}, "alpaca", "output", "missing"),
        ({"instruction": "  ", "output": "y"}, "alpaca", "instruction", "empty"),
        ({"instruction": 5, "output": "y"}, "alpaca", "instruction", "wrong type"),
        ({"instruction": "x", "input": ["a"], "output": "y"}, "alpaca", "input", "wrong type"),
        ({"messages": "hello"}, "messages", "messages", "wrong type"),
        ({"messages": []}, "messages", "messages", "empty conversation"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages", "messages[0].role", "unknown role"),
        ({"messages": [{"content": "x"}, ASSISTANT_HI]}, "messages", "messages[0].role", "missing"),
        ({"messages": [{"role": "user", "content": 3}, ASSISTANT_HI]}, "messages", "messages[0].content", "wrong type"),
        ({"messages": [{"role": "user", "content": ""}, ASSISTANT_HI]}, "messages", "messages[0].content", "empty"),
        ({"conversations": [{"from": "robot", "value": "x"}]}, "sharegpt", "conversations[0].from", "unknown role"),
        ({"prompt": "x", "completion": None}, "prompt_completion", "completion", "is null"),
        ({"text": ""}, "text", "text", "empty"),
        (["not", "an", "object"], "text", None, "expected an object"),
    ],
)
def test_bad_fields_are_errors_naming_the_field(record: object, fmt: str, field: str | None, words: str) -> None:
    messages, issues = normalize(record, fmt)
    assert messages is None
    errors = [issue for issue in issues if issue.severity == "error"]
    assert errors and errors[0].field == field
    assert words in errors[0].message


@pytest.mark.parametrize(
    ("roles", "words"),
    [
        (["assistant", "user", "assistant"], "starts with assistant"),
        (["user", "user", "assistant"], "two user turns"),
        (["user", "assistant", "assistant"], "two assistant turns"),
        (["system", "assistant", "user", "assistant"], "starts with assistant"),
        (["user", "system", "user", "assistant"], "two user turns in a row at position 2"),
        (["user", "assistant", "system"], "last turn is system"),
        (["user", "tool", "assistant"], "tool turn at position 1 follows user"),
        (["user", "assistant", "user"], "last turn is user"),
    ],
)
def test_turns_out_of_order_are_errors(roles: list[str], words: str) -> None:
    record = {"messages": [{"role": role, "content": f"turn {i}"} for i, role in enumerate(roles)]}
    messages, issues = normalize(record, "messages")
    assert messages is None
    assert any(words in issue.message and issue.field == "messages" for issue in issues)


@pytest.mark.parametrize(
    "roles",
    [
        ["user", "system", "assistant"],
        ["user", "assistant", "system", "user", "assistant"],
        ["system", "user", "assistant", "system", "user", "assistant"],
    ],
)
def test_a_system_turn_after_the_first_is_kept_with_one_warning(roles: list[str]) -> None:
    record = {"messages": [{"role": role, "content": f"turn {i}"} for i, role in enumerate(roles)]}
    messages, issues = normalize(record, "messages")
    assert messages is not None and [m["role"] for m in messages] == roles
    late = roles.index("system", 1)
    assert [(issue.severity, issue.field) for issue in issues] == [("warning", "messages")]
    assert f"system turn at position {late}" in issues[0].message and "--tokenizer" in issues[0].message


def test_an_empty_system_turn_is_only_a_warning() -> None:
    record = {"messages": [{"role": "system", "content": ""}, USER_HI, ASSISTANT_HI]}
    messages, issues = normalize(record, "messages")
    assert messages is not None
    assert [issue.severity for issue in issues] == ["warning"]


def test_mapping_renames_columns_and_problems_use_the_users_names() -> None:
    mapping = parse_mapping(["instruction=question", "output=answer"])
    messages, _ = normalize({"question": "Say hi", "answer": "hi"}, "alpaca", mapping)
    assert messages == [USER_HI, ASSISTANT_HI]
    _, issues = normalize({"question": "Say hi", "answer": ""}, "alpaca", mapping)
    assert issues[0].field == "answer"


def test_mapping_reaches_inside_turns() -> None:
    mapping = parse_mapping(["messages=dialog", "role=speaker", "content=text"])
    record = {"dialog": [{"speaker": "user", "text": "Say hi"}, {"speaker": "assistant", "text": "hi"}]}
    messages, issues = normalize(record, "messages", mapping)
    assert issues == [] and messages == [USER_HI, ASSISTANT_HI]


@pytest.mark.parametrize("pair", ["instruction", "=question", "instruction=", "colour=question"])
def test_bad_mapping_is_refused(pair: str) -> None:
    with pytest.raises(DataError, match="--map"):
        parse_mapping([pair])


def test_detection_takes_the_majority_and_names_columns_when_nothing_matches() -> None:
    records = [{"prompt": "a", "completion": "b"}] * 3 + [{"text": "t"}]
    assert detect_format(records) == "prompt_completion"
    with pytest.raises(DataError, match="'question'.*--map"):
        detect_format([{"question": "q", "answer": "a"}])


def test_writing_other_formats() -> None:
    conversation = [{"role": "system", "content": "S"}, USER_HI, ASSISTANT_HI]
    assert from_messages(conversation, "alpaca") == {
        "instruction": "Say hi",
        "input": "",
        "output": "hi",
        "system": "S",
    }
    assert from_messages(conversation, "sharegpt") == {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "Say hi"},
            {"from": "gpt", "value": "hi"},
        ]
    }
    sharegpt_back, _ = normalize(from_messages(conversation, "sharegpt"), "sharegpt")
    assert sharegpt_back == conversation
    with pytest.raises(ValueError, match="4 turns cannot be written as alpaca"):
        from_messages([USER_HI, ASSISTANT_HI, USER_HI, ASSISTANT_HI], "alpaca")
    with pytest.raises(ValueError, match="tool calls"):
        from_messages([USER_HI, {"role": "assistant", "content": "", "tool_calls": []}], "sharegpt")


def test_a_null_value_is_not_called_a_missing_column() -> None:
    _, issues = normalize({"instruction": None, "output": "x"}, "alpaca")
    assert [(issue.field, issue.message) for issue in issues] == [("instruction", "'instruction' is null")]
    _, issues = normalize({"output": "x"}, "alpaca")
    assert [(issue.field, issue.message) for issue in issues] == [("instruction", "missing column 'instruction'")]
