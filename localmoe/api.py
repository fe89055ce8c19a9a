"""The Python API: :class:`LLM` (``from localmoe import LLM``).

``LLM`` is the :class:`~localmoe.engine.engine.Engine` as users meet it: models are named as
the CLI names them (a path, a store name such as ``"smollm2"``, an ``hf:`` reference or None for
the default model, resolved by :mod:`localmoe.io.store`), and :meth:`LLM.chat` answers with
OpenAI ChatCompletion objects (shaped by :mod:`localmoe.openai`, as the server does).
Generation itself (``generate``, ``chat_stream``, ``stats``, ``close``, ...) is the engine's.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from localmoe.engine.engine import Engine


class LLM(Engine):
    """A loaded model ready to generate (docs/INTERFACES.md, "Engine / Python API").

    Args:
        model: path to a .gguf file (any shard) or HF folder, a store name (``"smollm2"``), an
            ``hf:OWNER/REPO/FILE`` reference, or None for the default model (pulled on first use).
        backend: ``"auto"`` or a backend name (``localmoe backends``).
        n_ctx: context size in tokens; default min(model's training context, 4096).
        kv_cache: KV cache format for K and V (``f16``, ``int8``, ``int4``, ``int3``, ``int2``,
            ``fp4``, ...); ``kv_cache_k`` / ``kv_cache_v`` override one side.
        device: backend device (``"cpu"``, ``"cuda"``, ``"cuda:1"``); None = backend default.
        progress: ``progress(fraction, message)`` called while loading.
        before_load: ``before_load(llm)`` called once the tokenizer, chat template and context
            size are known, before the weights load: ``llm.tokenizer``, ``llm.template``,
            ``llm.n_ctx``, :meth:`prompt_ids`, :meth:`count_tokens` and :meth:`render_chat`
            work there (generation does not yet); an exception it raises stops the load
            (``localmoe generate`` refuses a prompt longer than the context this way).
        **backend_options: options of the backend that runs the model: ``n_threads`` (CPU
            threads; all backends), ``max_seqs`` (concurrent sequences; all), ``n_batch``
            (llamacpp's prefill chunk, and the parameters of ``llama_cpp.Llama``), ``dtype``,
            ``numerics``, ``cuda_graphs`` (triton: False launches the decode step eagerly),
            ``act_precision`` (triton: ``"int8"``, ``"int16"`` or ``"mixed"`` activations in
            the quantized decode kernels), ... (``Backend.options`` of each backend).

    Raises:
        ModelNotFoundError, ModelLoadError, UnsupportedModelError, BackendUnavailableError,
        KVCacheFormatError, InvalidRequestError (a ``model`` that is no str, PathLike,
        ModelFile or None, bad n_ctx or device, a ``$LOCALMOE_THREADS``
        that is no thread count, a backend option that no backend or not the chosen one
        takes), StoreError (pull failed).
    """

    @staticmethod
    def _open(model: Any):
        """The ModelFile of ``model``: a ModelFile as is, else resolved through the store."""
        if hasattr(model, "spec") and hasattr(model, "format"):
            return model  # already a ModelFile
        if model is not None and not isinstance(model, (str, os.PathLike)):  # LLM(5): no name
            from localmoe.errors import InvalidRequestError

            raise InvalidRequestError(
                f"model must be a path or a model name (a str or os.PathLike: a .gguf file, an "
                f"HF folder, a store name such as 'smollm2', an hf:OWNER/REPO/FILE reference) "
                f"or None for the default model, not {type(model).__name__}", param="model")
        from localmoe.io.loader import open_model
        from localmoe.io.store import resolve_model

        return open_model(resolve_model(model))

    @staticmethod
    def _model_name(model: Any, model_file: Any) -> str:
        """The name a user knows the model by (:func:`localmoe.io.store.display_name`)."""
        from localmoe.io.store import display_name

        if model is None or isinstance(model, (str, os.PathLike)):
            return display_name(model)
        return display_name(getattr(model_file, "path", None) or model_file.name)

    def chat(self, messages: list[dict], *, tools: list | None = None, tool_choice: Any = None,
             stream: bool = False, cancel: threading.Event | None = None, **sampling: Any):
        """OpenAI-style chat completion: a ChatCompletion dict, or an iterator of
        ChatCompletionChunk dicts when ``stream`` (shaping and tool-call parsing by
        :mod:`localmoe.openai`).

        Args:
            messages: OpenAI-style message dicts.
            tools, tool_choice: as in the OpenAI API.
            stream: return an iterator of chunks instead of one ChatCompletion.
            cancel: a ``threading.Event`` that stops the generation when set.
            **sampling: OpenAI request fields (temperature, top_p, top_k, min_p, seed, stop,
                max_tokens, response_format, logprobs, top_logprobs, ...); None values are
                left out. ``json_schema=`` (a schema) and ``json_object=True`` are shorthands
                for the two ``response_format`` kinds, as in :meth:`generate`
                (docs/STRUCTURED_OUTPUT.md).

        Raises:
            InvalidRequestError, ContextOverflowError, TemplateError: as
            :func:`localmoe.openai.chat_completion`.
        """
        from localmoe.openai import chat_completion

        _check_chat_fields(sampling)
        request: dict[str, Any] = {"model": self.model_name, "messages": messages,
                                   "stream": bool(stream)}
        if tools is not None:
            request["tools"] = tools
        if tool_choice is not None:
            request["tool_choice"] = tool_choice
        schema = sampling.pop("json_schema", None)
        if sampling.pop("json_object", False):
            request["response_format"] = {"type": "json_object"}
        if schema is not None:
            request["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": schema, "strict": True}}
        request.update({k: v for k, v in sampling.items() if v is not None})
        return chat_completion(self, request, cancel=cancel)


def _check_chat_fields(fields: dict) -> None:
    """Refuse keyword arguments of :meth:`LLM.chat` that are no request field it reads (the
    server ignores unknown body fields, as OpenAI's does; a Python call gets told).

    Raises:
        InvalidRequestError: naming the field and the closest known one.
    """
    import difflib

    from localmoe.errors import InvalidRequestError
    from localmoe.openai.requests import CHAT_FIELDS

    for k in fields:
        if k not in CHAT_FIELDS and k not in ("json_schema", "json_object"):
            close = difflib.get_close_matches(k, sorted(CHAT_FIELDS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise InvalidRequestError(f"unknown chat parameter {k!r}{hint}; known: "
                                      f"{', '.join(sorted(CHAT_FIELDS))}, json_schema, "
                                      f"json_object", param=k)
