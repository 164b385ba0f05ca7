"""What the gateway knows of the served model: its tokenizer, chat template and context length."""

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from services.gateway.errors import RequestError
from services.gateway.protocol import check_token_ids
from services.gateway.tool_calls import describe_tools
from shared.engine import read_config


@dataclass(slots=True)
class ModelInfo:
    model_dir: str
    served_name: str
    tokenizer: object
    vocab_size: int
    max_model_len: int
    max_chars_per_token: int  # the longest text one token stands for (its vocabulary string bounds it)
    chat_template: str | None = None  # the operator's override (--chat-template); None: the tokenizer's own

    @classmethod
    def load(cls, model_dir: str, served_name: str, chat_template: str | None = None) -> "ModelInfo":
        config = read_config(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        longest = max((len(t) for t in tokens if isinstance(t, str)), default=1)
        return cls(model_dir, served_name, tokenizer, config.vocab_size, config.max_position_embeddings, max(longest, 1),
                   chat_template)

    def encode_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)
        check_token_ids(prompt, self.vocab_size, "prompt")
        return list(prompt)

    @property
    def template_shows_tools(self) -> bool:
        """Whether the chat template renders the `tools` it is given (Hermes-style ones do; many do not)."""
        template = self.chat_template or self.tokenizer.chat_template or ""
        sources = template.values() if isinstance(template, dict) else [template]
        return any("tools" in source for source in sources)

    def encode_chat(self, messages: list[dict], tools: list | None = None, template_kwargs: dict | None = None,
                    add_generation_prompt: bool = True, may_call: bool = False) -> list[int]:
        """The prompt's token ids: `messages` (and the `tools` offered, if any) through the chat template, given
        `template_kwargs` as extra variables. `may_call`: the model may answer with tool calls; a template that
        does not show tools then gets them, and the call format, in the system message."""
        if tools and may_call and not self.template_shows_tools:
            messages = describe_tools(messages, [tool["function"] for tool in tools])
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, tools=tools or None, chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False,
                **(template_kwargs or {}))
        except Exception as exc:  # a template that rejects the conversation (roles, order) or a variable
            raise RequestError(f"the chat template cannot render these messages: {exc}", "messages") from None
        return list(ids)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def read_chat_template(value: str) -> str:
    """`--chat-template`: a file holding a Jinja chat template, or the template itself (as vLLM takes it)."""
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
