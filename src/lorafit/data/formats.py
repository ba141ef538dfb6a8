"""Dataset formats, detected from a record's columns and turned into one conversation form.

The internal form is what chat templates and TRL take: a list of messages `{"role": ..., "content": str}` with
roles system/user/assistant/tool (assistant turns may carry `tool_calls`, tool turns `tool_call_id`/`name`).
A raw-text row becomes one assistant message, so every token of it is trained on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, Literal, NamedTuple, get_args

from lorafit.errors import DataError
from lorafit.messages import say
from lorafit.options import DataFormat as Format  # the formats `data_format` accepts, declared once

FORMATS: tuple[Format, ...] = get_args(Format)
Target = Literal["messages", "alpaca", "sharegpt"]
TARGETS: tuple[Target, ...] = get_args(Target)
ROLES = ("system", "user", "assistant", "tool")

# ShareGPT speakers as the datasets in the wild name them (FastChat, LLaMA-Factory, Axolotl).
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
MESSAGE_ROLES = {role: role for role in ROLES}
SHAREGPT_SPEAKER = {"user": "human", "assistant": "gpt", "system": "system", "tool": "tool"}

# Fields that `--map field=column` can point at another column (or, for the last four, another key inside
# each message of a conversation).
TOP_LEVEL_FIELDS = (
    "instruction",
    "input",
    "output",
    "system",
    "conversations",
    "messages",
    "prompt",
    "completion",
    "text",
)
MESSAGE_FIELDS = ("role", "content", "from", "value")
MAPPABLE_FIELDS = TOP_LEVEL_FIELDS + MESSAGE_FIELDS

# Keys a message keeps besides role/content: chat templates read them for tool use.
TOOL_KEYS = ("tool_calls", "tool_call_id", "name")
# An image-text dataset's images: TRL's and the HF image-text datasets' columns, and the content parts of the
# OpenAI / transformers chat formats. lorafit trains image-text models (Gemma 3, Mistral Small 3.x, Qwen2.5-VL) on
# text only, so a row with an image is refused, never trained with its image silently dropped.
IMAGE_COLUMNS = ("images", "image", "audios", "audio")  # and Gemma 4 E2B / E4B's audio: TRL's audio column names
IMAGE_PARTS = ("image", "image_url", "input_image", "audio", "input_audio")  # transformers' / OpenAI's audio parts

# How many parsed records detection looks at before it decides.
DETECT_SAMPLE = 100


class Issue(NamedTuple):
    """A problem inside one record; the checker adds file, line and row."""

    field: str | None
    message: str
    severity: Literal["error", "warning"] = "error"


Messages = list[dict[str, Any]]


# --- --map --------------------------------------------------------------------------------------------------
def parse_mapping(pairs: Iterable[str] | Mapping[str, str] | None) -> dict[str, str]:
    """`["instruction=question", ...]` -> {"instruction": "question"}; refuses what would do nothing."""
    if pairs is None:
        return {}
    items = list(pairs.items()) if isinstance(pairs, Mapping) else []
    if not isinstance(pairs, Mapping):
        for pair in pairs:
            field, sep, column = str(pair).partition("=")
            if not sep or not field.strip() or not column.strip():
                raise DataError(f"--map {pair!r}: expected FIELD=COLUMN, e.g. --map instruction=question")
            items.append((field.strip(), column.strip()))
    mapping: dict[str, str] = {}
    for field, column in items:
        if field not in MAPPABLE_FIELDS:
            raise DataError(f"--map {field}={column}: unknown field {field!r}; fields: {', '.join(MAPPABLE_FIELDS)}")
        mapping[field] = column
    return mapping


def apply_mapping(record: dict[str, Any], mapping: Mapping[str, str]) -> dict[str, Any]:
    """Rename the user's columns to the field names the formats use (a shallow copy: the input is kept)."""
    if not mapping:
        return record
    renamed = dict(record)
    for field in TOP_LEVEL_FIELDS:
        column = mapping.get(field)
        if column is not None and column in record:
            renamed.pop(column, None)
            renamed[field] = record[column]
    inner = {field: mapping[field] for field in MESSAGE_FIELDS if field in mapping}
    if inner:
        for key in ("messages", "conversations", "prompt", "completion"):
            turns = renamed.get(key)
            if isinstance(turns, list):
                renamed[key] = [_rename_keys(turn, inner) if isinstance(turn, dict) else turn for turn in turns]
    return renamed


def _rename_keys(turn: dict[str, Any], inner: Mapping[str, str]) -> dict[str, Any]:
    renamed = dict(turn)
    for field, column in inner.items():
        if column in turn:
            renamed.pop(column, None)
            renamed[field] = turn[column]
    return renamed


def unmatched_mapping(mapping: Mapping[str, str], records: Iterable[Any], source: str) -> str | None:
    """Why a `--map FIELD=COLUMN` matches nothing in `records` (no record has COLUMN, or for role/content/from/
    value no turn has that key), as one line; None if every pair matches. A mapping that matches nothing is a
    typo, not a choice."""
    columns: set[str] = set()
    turn_keys: set[str] = set()
    outer = {field: column for field, column in mapping.items() if field in TOP_LEVEL_FIELDS}
    for record in records:
        if not isinstance(record, dict):
            continue
        columns.update(record)
        renamed = apply_mapping(record, outer)
        for key in ("messages", "conversations", "prompt", "completion"):
            turns = renamed.get(key)
            if isinstance(turns, list):
                turn_keys.update(key for turn in turns if isinstance(turn, dict) for key in turn)
    for field, column in mapping.items():
        inner = field in MESSAGE_FIELDS
        if column in (turn_keys if inner else columns):
            continue
        if inner and not turn_keys:
            return f"--map {field}={column}: {source} has no turns ({field} names a key inside each turn)"
        where, known = ("no turn", turn_keys) if inner else ("no record", columns)
        listed = ", ".join(repr(name) for name in sorted(known)[:8]) + (", ..." if len(known) > 8 else "")
        key = "key" if inner else "column"
        return f"--map {field}={column}: {where} of {source} has a {key} {column!r} (its {key}s: {listed or 'none'})"
    return None


def column_name(field: str, mapping: Mapping[str, str]) -> str:
    """The name the user knows a field by: the mapped column if there is one."""
    return mapping.get(field, field)


# --- detection ----------------------------------------------------------------------------------------------
def detect_record(record: Any) -> Format | None:
    """The format one record looks like, from its columns; None if it matches none."""
    if not isinstance(record, dict):
        return None
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    if "text" in record:
        return "text"
    return None


def detect_format(records: Iterable[Any], source: str = "data") -> Format:
    """The format most of the sampled records match; a DataError naming the columns seen if none does."""
    votes: Counter[Format] = Counter()
    columns: Counter[str] = Counter()
    others: Counter[str] = Counter()  # records that are not objects at all
    for record in records:
        kind = detect_record(record)
        if kind is not None:
            votes[kind] += 1
        elif isinstance(record, dict):
            columns.update(str(key) for key in record)
        else:
            others[_type_name(record)] += 1
    if votes:
        return votes.most_common(1)[0][0]
    if others and not columns:
        kinds = ", ".join(kind for kind, _ in others.most_common())
        example = '{"instruction": ..., "output": ...}'
        raise DataError(say("data.not_records", source=source, kinds=kinds, example=example))
    seen = ", ".join(repr(name) for name, _ in columns.most_common(8)) or "none (every record is {})"
    raise DataError(say("data.format_unknown", name=source, seen=seen, setting_format="--format", setting_map="--map"))


def check_format(name: str | None) -> Format | None:
    if name is None:
        return None
    if name not in FORMATS:
        raise DataError(f"unknown format {name!r}; expected one of {', '.join(FORMATS)}")
    return name  # type: ignore[return-value]


# --- normalisation ------------------------------------------------------------------------------------------
def normalize(
    record: Any, fmt: Format, mapping: Mapping[str, str] | None = None
) -> tuple[Messages | None, list[Issue]]:
    """One record -> (conversation, issues). The conversation is None when any issue is an error."""
    mapping = mapping or {}
    if not isinstance(record, dict):
        return None, [Issue(None, say("row.not_object", type=_type_name(record)))]
    record = apply_mapping(record, mapping)
    issues: list[Issue] = [
        Issue(column, say("row.image_column", column=column)) for column in IMAGE_COLUMNS if record.get(column)
    ]
    if fmt == "alpaca":
        messages = _from_alpaca(record, mapping, issues)
    elif fmt == "sharegpt":
        messages = _from_turns(record, "conversations", mapping, issues, sharegpt=True)
        system = _optional_string(record, "system", mapping, issues)
        if messages is not None and system:
            messages.insert(0, {"role": "system", "content": system})
    elif fmt == "messages":
        messages = _from_turns(record, "messages", mapping, issues, sharegpt=False)
    elif fmt == "prompt_completion":
        messages = _from_prompt_completion(record, mapping, issues)
    else:
        text = _required_string(record, "text", mapping, issues)
        messages = None if text is None else [{"role": "assistant", "content": text}]
    if messages is not None and fmt != "text":
        conversation_field = {"sharegpt": "conversations", "messages": "messages"}.get(fmt)
        shown = column_name(conversation_field, mapping) if conversation_field else None
        issues.extend(check_turns(messages, shown))
    if any(issue.severity == "error" for issue in issues):
        return None, issues
    return messages, issues


def _from_alpaca(record: dict[str, Any], mapping: Mapping[str, str], issues: list[Issue]) -> Messages | None:
    instruction = _required_string(record, "instruction", mapping, issues)
    extra_input = _optional_string(record, "input", mapping, issues)
    output = _required_string(record, "output", mapping, issues)
    system = _optional_string(record, "system", mapping, issues)
    if instruction is None or output is None:
        return None
    prompt = f"{instruction}\n\n{extra_input}" if extra_input else instruction
    messages: Messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
    return messages


def _from_prompt_completion(record: dict[str, Any], mapping: Mapping[str, str], issues: list[Issue]) -> Messages | None:
    """Plain strings, or TRL's conversational form where both columns hold lists of messages."""
    prompt, completion = record.get("prompt"), record.get("completion")
    if isinstance(prompt, list) or isinstance(completion, list):
        head = _from_turns(record, "prompt", mapping, issues, sharegpt=False)
        tail = _from_turns(record, "completion", mapping, issues, sharegpt=False)
        return None if head is None or tail is None else head + tail
    prompt_text = _required_string(record, "prompt", mapping, issues)
    completion_text = _required_string(record, "completion", mapping, issues)
    if prompt_text is None or completion_text is None:
        return None
    return [{"role": "user", "content": prompt_text}, {"role": "assistant", "content": completion_text}]


def _from_turns(
    record: dict[str, Any], key: str, mapping: Mapping[str, str], issues: list[Issue], sharegpt: bool
) -> Messages | None:
    shown = column_name(key, mapping)
    if key not in record:
        issues.append(Issue(shown, say("row.missing_column", column=shown)))
        return None
    turns = record[key]
    if not isinstance(turns, list):
        issues.append(Issue(shown, say("row.turns_type", type=_type_name(turns))))
        return None
    if not turns:
        issues.append(Issue(shown, say("row.empty_conversation")))
        return None
    messages: Messages = []
    failed = False
    for index, turn in enumerate(turns):
        message = _turn(turn, f"{shown}[{index}]", mapping, issues, sharegpt)
        if message is None:
            failed = True
        else:
            messages.append(message)
    return None if failed else messages


def _turn(turn: Any, where: str, mapping: Mapping[str, str], issues: list[Issue], sharegpt: bool) -> dict | None:
    if not isinstance(turn, dict):
        issues.append(Issue(where, say("row.turn_type", type=_type_name(turn))))
        return None
    # ShareGPT says from/value; some ShareGPT files use role/content, and so do messages.
    role_key, content_key = (
        ("from", "value") if sharegpt and ("from" in turn or "value" in turn) else ("role", "content")
    )
    role_shown, content_shown = column_name(role_key, mapping), column_name(content_key, mapping)
    if role_key not in turn:
        issues.append(Issue(f"{where}.{role_shown}", say("row.missing_role", key=role_shown)))
        return None
    raw_role = turn[role_key]
    if not isinstance(raw_role, str):
        issues.append(Issue(f"{where}.{role_shown}", say("row.role_type", type=_type_name(raw_role))))
        return None
    known = SHAREGPT_ROLES if sharegpt else MESSAGE_ROLES
    role = known.get(raw_role.strip().lower())
    if role is None:
        expected = ", ".join(sorted(set(known))) if sharegpt else ", ".join(ROLES)
        issues.append(Issue(f"{where}.{role_shown}", say("row.unknown_role", role=raw_role, expected=expected)))
        return None
    extras = {key: turn[key] for key in TOOL_KEYS if turn.get(key) is not None}
    content = turn.get(content_key)
    if content is None and "tool_calls" not in extras:
        issues.append(Issue(f"{where}.{content_shown}", say("row.missing_content", key=content_shown, role=role)))
        return None
    if isinstance(content, list):
        content = _join_text_parts(content, f"{where}.{content_shown}", issues)
        if content is None:
            return None
    elif content is None:
        content = ""  # an assistant turn that only calls tools
    elif not isinstance(content, str):
        issues.append(Issue(f"{where}.{content_shown}", say("row.content_type", type=_type_name(content))))
        return None
    if not content.strip() and "tool_calls" not in extras:
        severity = "warning" if role == "system" else "error"
        issues.append(Issue(f"{where}.{content_shown}", say("row.empty_content", role=role), severity))
        if severity == "error":
            return None
    return {"role": role, "content": content, **extras}


def _join_text_parts(parts: list[Any], where: str, issues: list[Issue]) -> str | None:
    """OpenAI content parts: all-text lists are joined; lorafit does not train on images or audio."""
    texts = []
    for part in parts:
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else _type_name(part)
            if kind in IMAGE_PARTS:
                issues.append(Issue(where, say("row.image_part", kind=kind)))
            else:
                issues.append(Issue(where, say("row.part_unsupported", kind=kind)))
            return None
    return "".join(texts)


def _required_string(record: dict[str, Any], field: str, mapping: Mapping[str, str], issues: list[Issue]) -> str | None:
    shown = column_name(field, mapping)
    if field not in record:
        issues.append(Issue(shown, say("row.missing_column", column=shown)))
        return None
    value = record[field]
    if value is None:  # the column is there (Parquet, a JSON null): the value is missing
        issues.append(Issue(shown, say("row.null", column=shown)))
        return None
    if not isinstance(value, str):
        issues.append(Issue(shown, say("row.column_type", column=shown, type=_type_name(value))))
        return None
    if not value.strip():
        issues.append(Issue(shown, say("row.empty_column", column=shown)))
        return None
    return value


def _optional_string(record: dict[str, Any], field: str, mapping: Mapping[str, str], issues: list[Issue]) -> str:
    value = record.get(field)
    if value is None:
        return ""
    if not isinstance(value, str):
        shown = column_name(field, mapping)
        issues.append(Issue(shown, say("row.column_type", column=shown, type=_type_name(value))))
        return ""
    return value


def check_turns(messages: Messages, field: str | None) -> list[Issue]:
    """The order chat templates and assistant-only loss expect: [system] user assistant (tool* assistant).

    A system turn is an instruction, not a speaker: it does not break user/assistant alternation, so the turn
    after it is checked against the turn before it. One after the first turn is legal in most chat templates
    (Llama 3, Qwen, ChatML) but refused by others (Llama 2, Mistral, Gemma): a warning.
    """
    issues: list[Issue] = []
    where = field or "turns"
    previous: str | None = None  # the last user, assistant or tool turn
    for index, message in enumerate(messages):
        role = message["role"]
        if role == "system":
            if index != 0:
                issues.append(
                    Issue(
                        where,
                        say("row.system_late", index=index, setting="--tokenizer"),
                        "warning",
                    )
                )
            continue
        if previous is None:
            if role != "user":
                issues.append(Issue(where, say("row.order_start", role=role)))
        elif role == "tool" and previous not in ("assistant", "tool"):
            issues.append(Issue(where, say("row.order_tool", index=index, previous=previous)))
        elif role == previous and role in ("user", "assistant"):
            issues.append(Issue(where, say("row.order_twice", role=role, index=index)))
        elif previous == "tool" and role == "user":
            issues.append(
                Issue(
                    where,
                    say("row.order_user", index=index),
                )
            )
        previous = role
    last = messages[-1]["role"] if messages else None
    if last != "assistant":
        issues.append(Issue(where, say("row.last_turn", last=last)))
    return issues


# --- writing other formats ----------------------------------------------------------------------------------
def from_messages(messages: Messages, to: Target) -> dict[str, Any]:
    """A conversation as one record of `to`; ValueError (with the reason) where `to` cannot hold it."""
    if to == "messages":
        return {"messages": messages}
    if any("tool_calls" in message or message["role"] == "tool" for message in messages):
        raise ValueError(f"tool calls cannot be written as {to}")
    if to == "sharegpt":
        return {"conversations": [{"from": SHAREGPT_SPEAKER[m["role"]], "value": m["content"]} for m in messages]}
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    turns = messages[1:] if system is not None else messages
    if len(turns) != 2 or turns[0]["role"] != "user" or turns[1]["role"] != "assistant":
        raise ValueError(f"a conversation of {len(turns)} turns cannot be written as alpaca (one question, one answer)")
    record: dict[str, Any] = {"instruction": turns[0]["content"], "input": "", "output": turns[1]["content"]}
    if system:
        record["system"] = system
    return record


def plain_text(messages: Messages, fmt: Format | None = None) -> str:
    """What gets tokenized when there is no chat template: raw text as is, else 'role: content' turns."""
    if fmt == "text":
        return messages[0]["content"]
    return "\n\n".join(f"{message['role']}: {message['content']}" for message in messages)


def _type_name(value: Any) -> str:
    return {
        dict: say("type.object"),
        list: say("type.list"),
        str: say("type.string"),
        bool: say("type.boolean"),
        int: say("type.number"),
        float: say("type.number"),
        type(None): say("type.null"),
    }.get(type(value), type(value).__name__)
