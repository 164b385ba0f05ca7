"""What the gateway knows of the served model: its tokenizer and context length."""

from dataclasses import dataclass

from transformers import AutoTokenizer

from services.gateway.errors import RequestError
from services.gateway.protocol import check_token_ids
from shared.engine.model_loader import read_config


@dataclass(slots=True)
class ModelInfo:
    model_dir: str
    served_name: str
    tokenizer: object
    vocab_size: int
    max_model_len: int
    max_chars_per_token: int  # the longest text one token stands for (its vocabulary string bounds it)

    @classmethod
    def load(cls, model_dir: str, served_name: str) -> "ModelInfo":
        config = read_config(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        longest = max((len(t) for t in tokens if isinstance(t, str)), default=1)
        return cls(model_dir, served_name, tokenizer, config.vocab_size, config.max_position_embeddings, max(longest, 1))

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        check_token_ids(prompt, self.vocab_size, "prompt")
        return list(prompt)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception as exc:  # a template that rejects the conversation (roles, order)
            raise RequestError(f"the chat template cannot render these messages: {exc}", "messages") from None
        return list(ids)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
