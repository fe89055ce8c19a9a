"""A complete tool-calling agent loop against ``localmoe serve`` with the official openai client.

Start a server, then run this script::

    localmoe serve -m qwen2.5-7b-instruct-q4_k_m.gguf        # any model with a tool template
    python examples/agent_loop.py "What's the weather in Paris and what time is it there?"

The loop: send the conversation and the tool schemas; when the reply has ``tool_calls``, run
each tool locally, append the assistant message and one ``role: "tool"`` message per call (with
its ``tool_call_id``), and ask again; stop when the model answers in plain text (or after
``max_turns``). Nothing here is localmoe-specific: the same code runs against any
OpenAI-compatible endpoint.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from typing import Any, Callable

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "description": "City name"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time",
        "description": "Current time in an IANA time zone, e.g. Europe/Paris.",
        "parameters": {"type": "object",
                       "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}},
]


def _get_weather(city: str) -> dict:
    """A stand-in weather service (deterministic, offline)."""
    return {"city": city, "temp_c": 12 + len(city) % 10, "sky": "clear"}


def _get_time(tz: str = "UTC") -> dict:
    try:
        from zoneinfo import ZoneInfo

        now = _dt.datetime.now(ZoneInfo(tz))
    except Exception:  # unknown zone or no tz database: answer in UTC
        now, tz = _dt.datetime.now(_dt.timezone.utc), "UTC"
    return {"tz": tz, "time": now.strftime("%H:%M")}


DEFAULT_IMPLS: dict[str, Callable[..., Any]] = {"get_weather": _get_weather, "get_time": _get_time}


def run_agent(question: str, *, base_url: str = "http://127.0.0.1:8000/v1", api_key: str = "none",
              model: str | None = None, tools: list[dict] | None = None,
              tool_impls: dict[str, Callable[..., Any]] | None = None, max_turns: int = 6,
              verbose: bool = False, **sampling) -> list[dict]:
    """Run the tool loop until the model answers without calling a tool.

    Args:
        question: the user's request.
        base_url: the server's ``/v1`` URL.
        api_key: the server's key (any string when it has none).
        model: model id; None = the first one ``/v1/models`` lists.
        tools: tool schemas (default :data:`TOOLS`).
        tool_impls: name -> Python callable taking the call's arguments as keywords.
        max_turns: model calls at most.
        **sampling: passed to ``chat.completions.create`` (temperature, max_tokens, ...).

    Returns:
        the transcript: the messages sent and received, as plain dicts.
    """
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key)
    model = model or client.models.list().data[0].id
    tools = TOOLS if tools is None else tools
    impls = {**DEFAULT_IMPLS, **(tool_impls or {})}
    messages: list[dict] = [{"role": "user", "content": question}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=model, messages=messages, tools=tools,
                                               **sampling)
        msg = reply.choices[0].message
        calls = msg.tool_calls or []
        entry: dict[str, Any] = {"role": "assistant", "content": msg.content}
        if calls:
            entry["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.function.name,
                                                 "arguments": c.function.arguments}}
                                   for c in calls]
        messages.append(entry)
        if verbose and msg.content:
            print(f"assistant: {msg.content}")
        if not calls:
            return messages
        for c in calls:
            fn = impls.get(c.function.name)
            try:
                args = json.loads(c.function.arguments or "{}")
                result = fn(**args) if fn else {"error": f"unknown tool {c.function.name}"}
            except Exception as e:  # a tool failure is reported to the model, not raised
                result = {"error": f"{type(e).__name__}: {e}"}
            if verbose:
                print(f"tool {c.function.name}({c.function.arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": c.id,
                             "content": json.dumps(result, ensure_ascii=False)})
    return messages


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("question", nargs="?", default="What's the weather in Paris?")
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--model", default=None)
    ap.add_argument("--temperature", type=float, default=0.2)
    args = ap.parse_args(argv)
    transcript = run_agent(args.question, base_url=args.base_url, api_key=args.api_key,
                           model=args.model, temperature=args.temperature, verbose=True)
    final = transcript[-1]
    if final.get("tool_calls"):
        print("(stopped after max_turns while the model was still calling tools)")
        return 1
    print(final["content"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
