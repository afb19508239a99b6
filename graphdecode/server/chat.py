"""POST /v1/chat/completions: the request, its engine request, and its response, streamed or whole.

`messages` go through the tokenizer's chat template (as LLM.chat renders them, `tools` and
chat_template_kwargs passed on; long conversations in a worker thread), cut to
truncate_prompt_tokens, checked against the context; the constraint (response_format,
guided_*, tool_choice "required" or named) is compiled, and one engine request with n choices
is sent to the core. vLLM's `echo` puts the last message's content before the reply when the
reply continues its role. With tools, each choice's text is parsed into content and OpenAI
`tool_calls` (choices.py, tools.py). A stream starts each choice with a chunk carrying its
role (OpenAI's), then its echo, then a chunk per delta.
"""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from ..generation_defaults import capped_max_tokens
from .choices import Choice, Choices
from .errors import APIError
from .logprobs import prompt_logprobs_json
from .protocol import ChatCompletionRequest
from .reasoning import opened_in_prompt
from .responses import DONE, dumps, error_event, event_stream, json_response
from .serving import INLINE_CHARS, Job, OpenAIServer, off_loop


async def create_chat_completion(server: OpenAIServer, request: Request) -> Response:
    arrival = time.perf_counter()
    server.check_ready()
    req: ChatCompletionRequest = await server.parse(request, ChatCompletionRequest)
    job = await start_chat(server, request, req, arrival, f"chatcmpl-{uuid.uuid4().hex}")
    if req.stream:
        return event_stream(_stream(server, job))
    return await server.unless_client_leaves(request, _whole(server, job))


async def start_chat(server: OpenAIServer, request: Request, req: ChatCompletionRequest, arrival: float,
                     rid: str) -> Job:
    """A chat request's conversation rendered, checked, constrained and sent to the engine: its Job (every
    endpoint that runs as a chat: Chat Completions, Messages, Responses)."""
    lora = server.check_model(req.model)
    conversation = req.conversation()
    truncate = req.truncation(server.max_model_len)
    text, ids = await render_chat(server, req, conversation)
    rendered = text
    if truncate is not None and len(ids) > truncate:
        text, ids = None, req.truncate(ids, truncate)
    # the request's own max_tokens must fit the context (vLLM's rule); the recommended cap need not (past the
    # context the engine stops with "length")
    server.check_length(len(ids), req.requested_max_tokens(), "messages", req.max_tokens_param)
    max_tokens = capped_max_tokens(server.sampling_defaults, req.requested_max_tokens())
    params = req.sampling_params(max_tokens, server.vocab_size, server.sampling_defaults)
    opened = server.reasoning_parser is not None and opened_in_prompt(rendered)
    thinking_off = (req.chat_template_kwargs or {}).get("enable_thinking") is False
    thinks = server.reasoning_parser is not None and not thinking_off
    req.reply_format(server.tool_calls_constrained, thinks, opened)
    if req.tool_mode == "auto" and req.skip_special_tokens is None and server.tool_markers_special:
        params.skip_special_tokens = False  # the format's call marker is a special token ([TOOL_CALLS], ...)
    renames = req.renames()
    await server.constrain(request, req, params, renames)
    prompt = {"prompt_token_ids": ids} if text is None else {"prompt": text, "prompt_token_ids": ids}
    streams = [(rid, server.start(req.salted(prompt), params, rid, renames, req.priority, lora))]
    role = req.response_role
    last = conversation[-1]  # vLLM's echo: the last message, when the reply continues its role
    echo = last["content"] if req.echo and last["role"] == role else ""
    job = server.job(rid, streams, arrival, [ids], params, req, echo, lora)
    job.role = role
    job.prompt_logprobs = req.wants_prompt_logprobs is not None
    job.tool_mode, job.tool_name = req.tool_mode, req.named_function
    job.tool_parser, job.functions = server.tool_call_parser, req.checked_tools
    job.reasoning, job.reasoning_opened = server.reasoning_parser, opened
    return job


async def render_chat(server: OpenAIServer, req: ChatCompletionRequest, conversation: list[dict] | None = None,
                      add_special_tokens: bool = False) -> tuple[str, list[int]]:
    """(text, ids) of the request's conversation through the server's chat template; a long one in a worker
    thread. What a chat completion runs, and what /tokenize counts."""
    if conversation is None:
        conversation = req.conversation()
    size = sum(len(m["content"]) for m in conversation if isinstance(m.get("content"), str))
    return await off_loop(size, INLINE_CHARS, _render, server.tokenizer, server.chat_template, req, conversation,
                          add_special_tokens)


def _render(tokenizer, template: str | None, req: ChatCompletionRequest, conversation: list[dict],
            add_special_tokens: bool = False) -> tuple[str, list[int]]:
    """The conversation through the chat template (`template`, --chat-template's, else the tokenizer's),
    tokenized as LLM.chat does (the template writes its own special tokens: none added, unless asked)."""
    if tokenizer is None:
        raise APIError("this model has no tokenizer; send token ids to /v1/completions", param="messages")
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError("this model has no chat template: start the server with --chat-template, or use "
                       "/v1/completions", param="messages")
    kwargs = dict(req.chat_template_kwargs or {})
    tools = req.template_tools()
    if tools is not None:
        kwargs.setdefault("tools", tools)
    if req.continue_final_message:
        kwargs["continue_final_message"] = True
    try:
        text = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                             add_generation_prompt=bool(req.add_generation_prompt), **kwargs)
    except Exception as exc:  # noqa: BLE001 - the template's own complaint (roles, order) is the message
        raise APIError(f"messages: the chat template failed: {exc}", param="messages") from None
    ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    if not ids:
        raise APIError("messages: the conversation renders to an empty prompt", param="messages")
    return text, ids


def _chunk(head: bytes, body: dict, job: Job, choices: Choices, choice: Choice, first: bool = False) -> bytes:
    chunk = head + dumps(body).encode() + b"]"
    if first and job.token_ids:  # vLLM's: the prompt's ids ride on the first chunk of each choice
        chunk += b',"prompt_token_ids":' + dumps(job.prompt_ids[0]).encode()
    if job.continuous:
        chunk += b',"usage":' + dumps(choices.running_usage(choice)).encode()
    return chunk + b"}\n\n"


async def _stream(server: OpenAIServer, job: Job):
    """Per choice a role chunk (and the echo), then a chunk per delta, then the usage (include_usage)."""
    head = (f'data: {{"id":"{job.rid}","object":"chat.completion.chunk","created":{job.created},'
            f'"model":{job.model_json},"choices":[').encode()
    fmt = job.logprobs
    choices = Choices(job, server.prefix_caching)
    first_content = None if job.tool_mode in ("required", "named") else ""  # a reply of calls has no content
    try:
        for choice in choices:  # OpenAI's first chunk of a choice carries the role
            first = {"index": choice.index, "delta": {"role": job.role, "content": first_content}, "logprobs": None,
                     "finish_reason": None}
            yield _chunk(head, first, job, choices, choice, first=True)
        if job.echo:
            for choice in choices:
                echoed = {"index": choice.index, "delta": {"content": job.echo}, "logprobs": None,
                          "finish_reason": None}
                yield _chunk(head, echoed, job, choices, choice)
        async for p, out in server.outputs(job):
            for choice, delta in choices.fold(p, out):
                if not delta.text and not delta.token_ids and delta.finish_reason is None:
                    continue
                thought, content, calls, finish_reason = choice.parts(delta)
                if choice.tools is None and choice.reasoning is None:
                    message = {"content": content}
                else:  # reasoning, content and tool calls parsed out of the text as it comes
                    message = {}
                    if thought:
                        message["reasoning_content"] = thought
                    if content:
                        message["content"] = content
                    if calls:
                        message["tool_calls"] = calls
                    if not message and finish_reason is None and not job.token_ids and not (
                            fmt is not None and delta.token_ids):
                        continue  # text held back, nothing else to say
                body = {"index": choice.index, "delta": message, "logprobs": None, "finish_reason": finish_reason}
                if fmt is not None and delta.token_ids:
                    body["logprobs"] = {"content": fmt.chat(delta.token_ids, delta.logprobs)}
                if delta.finish_reason is not None:
                    body["stop_reason"] = delta.stop_reason
                if job.token_ids:
                    body["token_ids"] = list(delta.token_ids)
                yield _chunk(head, body, job, choices, choice)
        if job.include_usage:
            yield head + b'],"usage":' + dumps(choices.usage()).encode() + b"}\n\n"
    except Exception as exc:  # noqa: BLE001 - the stream has started: the error goes in it
        yield error_event(exc)
    yield DONE


async def _whole(server: OpenAIServer, job: Job) -> Response:
    """One body once every choice is done; with tools, each choice's whole text parsed once."""
    choices = await server.collect(job, {"prompt": "messages"})
    body = {
        "id": job.rid, "object": "chat.completion", "created": job.created, "model": job.model,
        "choices": whole_choices(job, choices), "usage": choices.usage(), "prompt_logprobs": None,
        "prompt_token_ids": None,
    }
    if job.prompt_logprobs:
        body["prompt_logprobs"] = prompt_logprobs_json(choices.prompt_logprobs.get(0))
    if job.token_ids:
        body["prompt_token_ids"] = job.prompt_ids[0]
    return json_response(body)


def whole_choices(job: Job, choices: Choices, first_index: int = 0) -> list[dict]:
    """A whole response's choices (message, logprobs, finish and stop reasons), indexed from first_index."""
    out_choices = []
    for choice in choices:
        thought, content, calls, finish_reason = choice.whole_parts()
        message = {"role": job.role, "content": job.echo + content}
        if choice.reasoning is not None:
            message["reasoning_content"] = thought or None
        if choice.tools is not None:
            message["content"] = (job.echo + content) or None
            if calls:
                message["tool_calls"] = calls
        body = {"index": first_index + choice.index, "message": message,
                "logprobs": ({"content": job.logprobs.chat(choice.token_ids, choice.logprobs)}
                             if job.logprobs is not None else None),
                "finish_reason": finish_reason, "stop_reason": choice.stop_reason,
                "token_ids": choice.token_ids if job.token_ids else None}  # vLLM's optional fields: null
        out_choices.append(body)
    return out_choices
