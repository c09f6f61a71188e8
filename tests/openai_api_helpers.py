"""What tests/test_openai_api.py and tests/test_openai_responses.py share: a stand-in
byte tokenizer (one token per character code) and `job`, a request body parsed as the
server parses it for a model of VOCAB tokens and MAX_LEN positions."""

from pagedjax import openai_api as api
from pagedjax.chat import normalize_messages

VOCAB, MAX_LEN = 256, 64


class CharTokenizer:
    """Token id = character code; chat: "<role>content\\n" per message, then "<assistant>"."""

    chat_template = "(stand-in)"
    chat_template_source = "the stand-in template"
    special_ids = frozenset()

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        return [ord(c) for c in text]  # (no BOS either way)

    def decode(self, ids, skip_special_tokens: bool = True, context=()) -> str:
        return "".join(map(chr, ids))  # one char a token: the context changes nothing

    def decode_each(self, ids, skip_special_tokens: bool = True, context=()) -> list[str]:
        return list(map(chr, ids))

    def encode_chat(
        self, messages, *, add_generation_prompt=True, continue_final_message=False, add_bos=False
    ) -> list[int]:
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message=True with add_generation_prompt=True")
        messages = normalize_messages(messages)  # (as the real one's render does)
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        text = text[:-1] if continue_final_message else text  # the last message left open
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


TOK = CharTokenizer()


def job(body: dict, *, chat: bool = False, tokenizer=TOK, **kw) -> api.Job:
    """(`kw`: more `parse_job` arguments, e.g. loras.)"""
    return api.parse_job(
        body,
        chat=chat,
        model_name="tiny",
        tokenizer=tokenizer,
        vocab_size=VOCAB,
        max_model_len=MAX_LEN,
        **kw,
    )
