"""Task ``vlm`` on OpenVINO: ``openvino_genai.VLMPipeline`` (LLaVA, Qwen2-VL, Phi-3.5-vision, ...).

A ``VLMPipeline`` serves one generation at a time, so requests run in turn on the model's
:class:`~modelserver.engines.media_base.SerialWorker`. The pipeline's streamer callback
pushes each text delta onto the request's asyncio queue; when the client goes away the
callback answers ``CANCEL`` and the generation stops at the next token. Images sit where
the message put them, as openvino_genai's ``<ov_genai_image_N>`` tags in the turn's text;
the chat template is the model's own (applied by the pipeline to the ``ChatHistory``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import openvino as ov
import openvino_genai as ov_genai
import PIL.Image  # noqa: F401 - modelserver.images decodes with it at the first image: imported with the engine

from modelserver.engines.base import FinishReason, GenerationRequest
from modelserver.engines.context import PromptCounter, configured_context
from modelserver.engines.llm import OPTIONS, chat_history, generation_config, render_chat, request_text
from modelserver.engines.media_base import SerialWorker, VisionRequest
from modelserver.engines.ov_options import one_line, ov_properties, remembered
from modelserver.engines.task_check import check_generative
from modelserver.engines.task_options import ir_folder, task_options
from modelserver.engines.tokens import TokenizerIds
from modelserver.errors import LoadError
from modelserver.modelfiles import context_length
from modelserver.spec import ModelSpec
from modelserver.tools import detect_parser, template_takes_tools

__all__ = ["OpenVINOVisionGenerator", "VisionStream", "load"]

log = logging.getLogger(__name__)

#: ("delta", text) | ("done", prompt_tokens, completion_tokens) | an exception
Event = tuple[Any, ...] | BaseException


class VisionStream:
    """One generation: text deltas from the pipeline thread; counts are final once iteration ends."""

    def __init__(self, events: asyncio.Queue[Event], cancelled: threading.Event, max_tokens: int) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.finish_reason: FinishReason | None = None
        self._events = events
        self._cancelled = cancelled
        self._max_tokens = max_tokens
        self._gen = self._deltas()

    def __aiter__(self) -> AsyncIterator[str]:
        return self._gen

    async def _deltas(self) -> AsyncIterator[str]:
        try:
            while self.finish_reason is None:
                event = await self._events.get()
                if isinstance(event, BaseException):
                    raise event
                if event[0] == "delta":
                    if event[1]:
                        yield event[1]
                    continue
                self.prompt_tokens, self.completion_tokens = event[1], event[2]
                self.finish_reason = "length" if self.completion_tokens >= self._max_tokens else "stop"
        finally:
            if self.finish_reason is None:
                self._cancelled.set()

    async def aclose(self) -> None:
        if self.finish_reason is None:
            self._cancelled.set()
        await self._gen.aclose()  # type: ignore[attr-defined]


class OpenVINOVisionGenerator:
    def __init__(self, spec: ModelSpec, pipe: Any, load_s: float, context: int | None = None,
                 folder: Path | None = None) -> None:
        self._spec = spec
        self._pipe = pipe
        self._defaults = pipe.get_generation_config()
        self._tokenizer = pipe.get_tokenizer()
        self._counter = PromptCounter(self._tokenizer, context, remembered(spec, folder))
        self.context_length = self._counter.context_length
        self.tokens = TokenizerIds(self._tokenizer, self._counter.cap)
        template = self._tokenizer.chat_template
        self._template_tools = template_takes_tools(template)
        self.tool_parser = spec.tool_parser or detect_parser(template)
        self._load_s = load_s
        self._worker = SerialWorker(f"vlm-{spec.name}")
        self.running = 0
        self.completed = 0
        self.cancelled = 0

    def describe(self) -> dict[str, Any]:
        return {
            "engine": "openvino VLMPipeline",
            "device": self._spec.device,
            "eos_token_id": self._defaults.eos_token_id,
            "context_length": self.context_length,
            "load_s": round(self._load_s, 2),
        }

    def stats(self) -> dict[str, Any]:
        return {"running": self.running, "completed": self.completed, "cancelled": self.cancelled}

    def close(self) -> None:
        self._worker.close()

    def chat_prompt(self, request: Any, add_generation_prompt: bool = True) -> str:
        """A chat's messages (and tools) through the model's chat template (each image's tag as text)."""
        return render_chat(self._tokenizer, request, self._template_tools, self.tool_parser, add_generation_prompt)

    def generate(self, request: VisionRequest | GenerationRequest) -> VisionStream:
        """A chat (with images) or, for ``/v1/completions``, a raw prompt without the chat template.

        The context check counts the prompt's text (the chat template applied, each image's tag
        as text): the tokens an image becomes are known only to the pipeline.
        """
        prompt: Any = request.prompt if isinstance(request, GenerationRequest) else None
        param = "prompt" if prompt is not None else "messages"
        self._counter.refuse_huge(request_text(request), request.sampling, param)
        if prompt is None:
            history, tools = chat_history(request, self._template_tools, self.tool_parser)
            text = self.chat_prompt(request)
            _, _, max_new = self._counter.fit(text, False, request.sampling, "messages")
            prompt = ov_genai.ChatHistory(history)
            if tools:
                prompt.set_tools(tools)
        else:
            _, _, max_new = self._counter.fit(prompt, True, request.sampling, "prompt")
        sampling = replace(request.sampling, max_tokens=max_new)
        config = generation_config(sampling, self._defaults, getattr(request, "constraint", None))
        if isinstance(request, GenerationRequest):
            config.apply_chat_template = False
        images = [ov.Tensor(image[None]) for image in getattr(request, "images", ())]
        events: asyncio.Queue[Event] = asyncio.Queue()
        cancelled = threading.Event()
        deliver = _deliverer(asyncio.get_running_loop(), events)
        self._worker.submit(lambda: self._run(prompt, images, config, deliver, cancelled))
        return VisionStream(events, cancelled, max_new)

    def prompt_tokens(self, request: VisionRequest | GenerationRequest) -> int:
        """The prompt's tokens as the context check counts them (each image's tag as text, not the tokens the
        pipeline makes of the image)."""
        if isinstance(request, GenerationRequest) and request.prompt is not None:
            return self._counter.total(request.prompt, True)
        return self._counter.total(self.chat_prompt(request), False)

    def _run(self, prompt: Any, images: list[Any], config: Any, deliver: Callable[[Event], None],
             cancelled: threading.Event) -> None:
        """On the worker thread: the whole generation, reported through ``deliver``."""
        if cancelled.is_set():
            self.cancelled += 1
            return

        def streamer(text: str) -> Any:
            deliver(("delta", text))
            return ov_genai.StreamingStatus.CANCEL if cancelled.is_set() else ov_genai.StreamingStatus.RUNNING

        self.running += 1
        try:
            result = self._pipe.generate(prompt, images=images, generation_config=config, streamer=streamer)
        except Exception as exc:
            deliver(exc)
            return
        finally:
            self.running -= 1
        metrics = result.perf_metrics
        if cancelled.is_set():
            self.cancelled += 1
            log.info("vlm generation cancelled after %d tokens", metrics.get_num_generated_tokens())
        else:
            self.completed += 1
        deliver(("done", int(metrics.get_num_input_tokens()), int(metrics.get_num_generated_tokens())))


def _deliverer(loop: asyncio.AbstractEventLoop, events: asyncio.Queue[Event]) -> Callable[[Event], None]:
    def deliver(event: Event) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass

    return deliver


#: On CPU the VLMPipeline runs its language model as a stateful (SDPA) model rather than through its
#: continuous-batching adapter (PagedAttention, the CPU default): the engine serves one generation at a
#: time, so the adapter's batching buys nothing, and openvino 2026.4's CPU plugin cannot import a
#: PagedAttention blob, so with a cache_dir every start rewrote the language model's blob instead of
#: importing it (llava-tiny: 0.27 s of CPU per load with the adapter's blob rewritten, 0.21 s with all
#: three blobs imported; median of 5 fresh processes, load 4, ``tools/cache_kinds.py``).
CPU_PROPERTIES: dict[str, Any] = {"ATTENTION_BACKEND": "SDPA"}


def load(spec: ModelSpec) -> OpenVINOVisionGenerator:
    started = time.monotonic()
    path = ir_folder(spec, ("openvino_language_model.xml", "openvino_tokenizer.xml"))
    check_generative(spec, path)
    option = task_options(spec, OPTIONS).get("context_length")
    context = configured_context(spec.name, context_length(path), option)
    properties = ov_properties(spec)
    if spec.device.upper().startswith("CPU"):
        properties = {**CPU_PROPERTIES, **properties}  # a model's own ov_config wins
    try:
        pipe = ov_genai.VLMPipeline(str(path), spec.device, **properties)
    except Exception as exc:
        raise LoadError(one_line(exc)) from None
    return OpenVINOVisionGenerator(spec, pipe, time.monotonic() - started, context, path)
