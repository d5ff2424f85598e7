"""Chat messages to prompt token ids with the model's own chat template (transformers'
`apply_chat_template`), or with a Jinja template given by `--chat-template FILE`.

The front renders to token ids, not text, so the template's own special tokens (a BOS it
writes, say) are not added a second time by tokenizing the text again.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from specwire.openai_http.protocol import invalid
from transformers import AutoTokenizer, PreTrainedTokenizerBase

log = logging.getLogger("specwire")


class ChatTemplate:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, source: str, template: str | None = None) -> None:
        """`tokenizer` loaded from `source` (None: it could not be); `template` overrides its own."""
        self.tokenizer = tokenizer
        self.source = source
        self.template = template

    @classmethod
    def load(cls, source: str, template_file: str | None) -> ChatTemplate:
        template = None
        if template_file:
            try:
                template = Path(template_file).read_text()
            except OSError as error:
                raise SystemExit(f"--chat-template: cannot read {template_file}: {error.strerror}") from None
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as error:
            log.warning("no tokenizer from %r (%s): chat completions will be refused", source, error)
            tokenizer = None
        return cls(tokenizer, source, template)

    def render(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt's token ids, ending with the assistant's turn opened (`add_generation_prompt`)."""
        if self.tokenizer is None:
            raise invalid("messages", f"no tokenizer could be loaded from {self.source!r}: start the front with --tokenizer DIR_OR_HUB_ID")
        if not (self.template or self.tokenizer.chat_template):
            raise invalid("messages", "the model's tokenizer has no chat template: start the front with --chat-template FILE (Jinja)")
        try:
            encoded: Any = self.tokenizer.apply_chat_template(
                messages, chat_template=self.template, add_generation_prompt=True, tokenize=True, return_dict=True
            )
        except TemplateError as error:  # the template's own checks, e.g. roles that must alternate
            raise invalid("messages", f"the chat template refused them: {error}") from None
        return [int(i) for i in encoded["input_ids"]]
