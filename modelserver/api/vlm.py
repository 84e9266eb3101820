"""``/v1/chat/completions`` with images (task vlm), and ``/v1/completions`` as for an LLM.

Content parts of type ``image_url`` (``{"url": "data:image/png;base64,..."}`` or the
bare string) are decoded here and replaced by an image tag at their place in the turn's
text; ``http(s)`` URLs are refused (this server makes no outbound calls). Everything
after that (stop strings, streaming, usage, errors) is the chat handler of the LLM task.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modelserver.api import chat
from modelserver.api.common import engine_as, note, read_body, spec
from modelserver.api.toolplan import chat_plan
from modelserver.engines.base import ChatTurn, GenerationRequest, SamplingParams, TextGenerator
from modelserver.engines.media_base import IMAGE_TAG, VisionRequest, image_tag
from modelserver.errors import RequestError, UnsupportedParameter
from modelserver.images import decode_data_url
from modelserver.protocol import ChatCompletionRequest, ChatMessage, ChatShape, ContentPart

__all__ = ["plan_generation", "routes", "vision_request", "vision_turns"]


def _image_url(part: ContentPart, where: str) -> str:
    value: Any = (part.model_extra or {}).get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise RequestError(f'{where}.image_url: expected {{"url": "data:image/...;base64,..."}}', param="messages")
    return url


def _text(text: str, where: str) -> str:
    """User text, which must not smuggle in openvino_genai's own image markers."""
    if IMAGE_TAG.search(text):
        raise RequestError(
            f"{where}: text must not contain image markers like '<ov_genai_image_0>'; send images as image_url parts",
            param="messages",
        )
    return text


def _turn(message: ChatMessage, index: int, images: list[Any]) -> ChatTurn:
    role = "system" if message.role == "developer" else message.role
    calls = tuple(chat.template_call(call, index, j) for j, call in enumerate(message.tool_calls or ()))
    extra = (calls, message.tool_call_id, message.name if role == "tool" else None)
    if message.content is None or isinstance(message.content, str):
        return ChatTurn(role, _text(message.content or "", f"messages[{index}].content"), *extra)
    pieces = []
    for j, part in enumerate(message.content):
        where = f"messages[{index}].content[{j}]"
        if part.type == "text" and part.text is not None:
            pieces.append(_text(part.text, where))
        elif part.type == "image_url":
            used_px = sum(image.shape[0] * image.shape[1] for image in images)
            images.append(decode_data_url(_image_url(part, where), f"{where}.image_url.url", used_px))
            pieces.append(image_tag(len(images) - 1))
        else:
            raise UnsupportedParameter(
                f"{where}: content part of type {part.type!r} is not supported; send 'text' and 'image_url' parts",
                param="messages",
            )
    return ChatTurn(role, "\n".join(pieces), *extra)


def vision_turns(messages: list[ChatMessage]) -> tuple[tuple[ChatTurn, ...], tuple[Any, ...]]:
    """Turns with image tags, and the decoded images in tag order; 400 for anything undecodable."""
    images: list[Any] = []
    turns = tuple(_turn(message, i, images) for i, message in enumerate(messages))
    return turns, tuple(images)


#: What a text or vision engine generates from.
Generation = GenerationRequest | VisionRequest


async def vision_request(request: Request, body: ChatCompletionRequest, tools: tuple[dict[str, Any], ...],
                         constraint: Any, sampling: SamplingParams | None = None) -> VisionRequest:
    """The generation ``body`` asks for, its images decoded (off the event loop)."""
    turns, images = await asyncio.to_thread(vision_turns, body.messages)
    note(request, images=len(images))
    sampling = sampling or chat.sampling(body, spec(request).default_max_tokens)
    return VisionRequest(sampling, turns, images, tools, constraint)


async def plan_generation(request: Request, body: ChatCompletionRequest,
                          sampling: SamplingParams | None = None) -> tuple[Generation, str | None]:
    """The engine's request for a chat body on this model — a :class:`VisionRequest` on task vlm — and the tool
    parser its answer goes through (None: no tools). The protocols translated to chat (Responses, Messages,
    Ollama) all plan their generation here; ``sampling`` defaults to the chat route's."""
    generator = engine_as(request, TextGenerator)
    tools, constraint, parse = chat_plan(body, generator.tool_parser)
    parser = generator.tool_parser if parse else None
    if spec(request).task == "vlm":
        return await vision_request(request, body, tools, constraint, sampling), parser
    sampling = sampling or chat.sampling(body, spec(request).default_max_tokens)
    return GenerationRequest(sampling, chat.chat_turns(body.messages), tools=tools, constraint=constraint,
                             continue_final=body.continue_final_message), parser


async def vlm_chat_completions(request: Request) -> Response:
    body = await read_body(request, ChatCompletionRequest)
    body.refuse_unsupported(spec(request).max_n)
    if body.logprobs:
        raise UnsupportedParameter("logprobs: the vlm engine does not report logprobs", param="logprobs")
    tools, constraint, parse = chat_plan(body, engine_as(request, TextGenerator).tool_parser)
    generation = await vision_request(request, body, tools, constraint)
    parser = engine_as(request, TextGenerator).tool_parser if parse else None
    shape = chat.shape_for(request, ChatShape, body)
    return await chat._respond(request, body, [generation], shape, parser)  # type: ignore[list-item]


routes = [
    Route("/v1/chat/completions", vlm_chat_completions, methods=["POST"]),
    *(route for route in chat.routes if isinstance(route, Route) and route.path == "/v1/completions"),
]
