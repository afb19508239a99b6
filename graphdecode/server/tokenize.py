"""vLLM's POST /tokenize and POST /detokenize: the server's own tokenizer and chat template, for clients that
count or cut prompts before they send them (context budgets, evaluation harnesses, agents trimming history).

/tokenize takes a completion's `prompt` (text; `add_special_tokens` default true) or a chat's `messages`
(rendered through the chat template as /v1/chat/completions renders them: `add_generation_prompt`,
`continue_final_message`, `chat_template_kwargs`, `tools`; `add_special_tokens` default false, the template
writes its own) and answers `{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` with
`return_token_strs`). /detokenize takes `tokens` and answers `{"prompt": text}`. The ids a chat renders to
are exactly those a chat completion with the same fields runs.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from pydantic import Field

from .chat import render_chat
from .errors import APIError
from .protocol import ChatCompletionRequest, ChatMessage, _Base
from .serving import INLINE_CHARS, INLINE_TOKENS, OpenAIServer, off_loop


class TokenizeRequest(_Base):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[int]


async def tokenize(server: OpenAIServer, request: Request) -> dict:
    server.check_ready()
    req: TokenizeRequest = await server.parse(request, TokenizeRequest)
    server.check_model(req.model)
    tokenizer = server.tokenizer
    if tokenizer is None:
        raise APIError("this model has no tokenizer", param="prompt")
    if (req.prompt is None) == (req.messages is None):
        raise APIError("give either prompt (text) or messages (a chat), not both or neither", param="prompt")
    if req.prompt is not None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await off_loop(len(req.prompt), INLINE_CHARS, _encode, tokenizer, req.prompt, special)
    else:
        chat = ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt,
                                     continue_final_message=req.continue_final_message,
                                     chat_template_kwargs=req.chat_template_kwargs, tools=req.tools)
        _, ids = await render_chat(server, chat, add_special_tokens=bool(req.add_special_tokens))
    body = {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids, "token_strs": None}
    if req.return_token_strs:
        body["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return body


async def detokenize(server: OpenAIServer, request: Request) -> dict:
    server.check_ready()
    req: DetokenizeRequest = await server.parse(request, DetokenizeRequest)
    server.check_model(req.model)
    if server.tokenizer is None:
        raise APIError("this model has no tokenizer", param="tokens")
    bad = next((t for t in req.tokens if not 0 <= t < server.vocab_size), None)
    if bad is not None:
        raise APIError(f"tokens: token id {bad} is outside the vocabulary [0, {server.vocab_size})", param="tokens")
    text = await off_loop(len(req.tokens), INLINE_TOKENS, server.tokenizer.decode, req.tokens)
    return {"prompt": text}


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
