"""The chat template: the tokenizer's, or the operator's (`--chat-template`, a file or the text), given a request's
`chat_template_kwargs` and the tools offered."""

import pytest

from services.gateway.errors import RequestError
from services.gateway.model_info import ModelInfo, read_chat_template

TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if tools %}tools: {{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
            "{% if add_generation_prompt %}[assistant]{{ ' ' ~ mood if mood is defined else '' }}{% endif %}")
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def model(default_model):
    return ModelInfo.load(default_model, "m", chat_template=TEMPLATE)


def text(model: ModelInfo, ids: list[int]) -> str:
    return model.tokenizer.decode(ids, skip_special_tokens=True)


def test_the_operators_template_renders_the_chat_with_the_requests_variables(model):
    assert text(model, model.encode_chat(MESSAGES)) == "[user] hello\n[assistant]"
    assert text(model, model.encode_chat(MESSAGES, template_kwargs={"mood": "cheerful"})) == \
        "[user] hello\n[assistant] cheerful"


def test_tools_offered_are_rendered(model):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert "tools: get_weather" in text(model, model.encode_chat(MESSAGES, tools=tools))


def test_without_an_override_the_tokenizers_template_is_used(default_model, model):
    own = ModelInfo.load(default_model, "m")
    assert own.encode_chat(MESSAGES) == list(own.tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert own.encode_chat(MESSAGES) != model.encode_chat(MESSAGES)


def test_a_template_that_fails_is_a_400_on_messages(default_model):
    failing = ModelInfo.load(default_model, "m", chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(RequestError) as info:
        failing.encode_chat(MESSAGES)
    assert info.value.param == "messages" and "no system role" in info.value.message


def test_the_flag_takes_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert read_chat_template(str(path)) == TEMPLATE
    assert read_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
