"""bench/token_estimate.py (`make bench-tokens`) reads llama.cpp's templates as llama.cpp stores them."""

from __future__ import annotations

from pathlib import Path

from conftest import load_script

# the shape of llama.cpp's tests/test-chat-template.cpp: C string literals, the generation prompt written always
LLAMA_3 = (
    "{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] + '<|eot_id|>' }}{% endfor %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
)
CPP = (
    '        {\n            /* .name= */ "Other",\n            /* .template_str= */ "{{ \'no\' }}",\n        },\n'
    '        {\n            /* .name= */ "Llama-3",\n'
    f'            /* .template_str= */ "{LLAMA_3}",\n'
    '            /* .expected_output= */ "",\n        },\n'
)


def test_a_test_case_template_is_unescaped_and_asks_for_the_generation_prompt_only_when_asked(tmp_path: Path) -> None:
    from jinja2 import Environment

    bench = load_script("bench/token_estimate.py")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test-chat-template.cpp").write_text(CPP)
    text = bench.template_text(tmp_path, "tests/test-chat-template.cpp#Llama-3")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    template = Environment().from_string(text)
    row = (
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nyo<|eot_id|>"
    )
    assert template.render(messages=messages, add_generation_prompt=False) == row
    assert template.render(messages=messages, add_generation_prompt=True) == row + (
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
