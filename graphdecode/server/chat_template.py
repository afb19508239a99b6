"""`--chat-template` (vLLM's): the server's chat template, from a file or written inline.

A model directory whose tokenizer has no chat template (base models, many conversions) cannot answer
/v1/chat/completions; one that has the wrong one answers badly. `--chat-template` replaces it for every
chat-shaped endpoint (chat, batch chat, Responses, Messages). The value is a file's path, or, if no such
file exists and it looks like Jinja (it has `{` or `}`), the template itself, with `\\n` and `\\t` written
as escapes turned into a newline and a tab (as vLLM reads an inline template). It is compiled when the
server starts, in the sandbox transformers renders templates in: a syntax error stops start-up with one
line naming the flag, not the first chat request.
"""

from __future__ import annotations

import os


def load_chat_template(value: str | None) -> str | None:
    """The template's text (None: the tokenizer's own); a ValueError naming --chat-template if it is neither a
    readable file nor a template, or does not compile."""
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template: {value!r} cannot be read as UTF-8 text ({e})") from None
    elif "{" in value or "}" in value:
        template = value.replace("\\n", "\n").replace("\\t", "\t")
    else:
        raise ValueError(f"--chat-template: {value!r} is not a file, nor a Jinja template (no '{{' in it)")
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).parse(template)
    except TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: the template does not compile: {e.message} (line {e.lineno})") from None
    return template
