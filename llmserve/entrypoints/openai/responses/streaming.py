"""Output items of a response, built whole or streamed as OpenAI's event sequence
(vLLM's ``responses_stream_generator``; event shapes from ``openai.types.responses``).

:class:`OutputBuilder` takes the parsed output in pieces (reasoning text, content text,
tool-call fragments: the ``DeltaMessage`` of chat's :class:`OutputParsing`) and keeps
the output items; with ``stream`` it also writes the SSE events of each piece:

    response.created, response.in_progress,
    per item: response.output_item.added,
      message:   response.content_part.added, response.output_text.delta..., response.output_text.done,
                 response.content_part.done
      reasoning: response.content_part.added, response.reasoning_text.delta..., response.reasoning_text.done,
                 response.content_part.done
      function_call: response.function_call_arguments.delta..., response.function_call_arguments.done
    response.output_item.done, ..., then one of response.completed / response.incomplete /
    response.failed (after an ``error`` event; or, without one, carrying ``status:
    "cancelled"`` when the response was cancelled or its client went away).

A ``background: true`` stream opens with response.created and response.queued (status
"queued"), then response.in_progress when it starts running.

Every event carries ``sequence_number`` (0, 1, 2, ...). With ``include:
["message.output_text.logprobs"]`` the ``output_text`` part holds the tokens' logprobs and
each ``response.output_text.delta`` its own (``logprobs`` is ``[]`` otherwise). The delta
event, the one per token, is written from a preformatted head (no dict, no model): its
cost per token is below chat's chunk (benchmarks/responses_stream_cost.py). A non-streamed response is built
by the same code from the whole parsed output, so streamed and whole outputs agree.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncGenerator, Optional

from llmserve.entrypoints.openai.responses.protocol import (
    FunctionCallItem,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponsesResponse,
)


MAX_LOGGED_EVENTS = 16384  # events kept per streamed response (about one per token)


class EventLog:
    """The SSE events of one streamed, stored response, in order (event i carries
    ``sequence_number`` i), for ``GET /v1/responses/{id}?stream=true``: :meth:`follow`
    replays them from a point and, while the response still runs, waits for the next.

    Memory stays bounded: past ``max_events`` the older half is forgotten (``first`` is
    then the sequence number of the oldest event kept), so a long response keeps its
    newest events, its terminal one included, for followers and resumes; a log dropped by
    its owner (:meth:`drop`, the oldest finished ones past MAX_EVENT_LOGS) keeps nothing
    and is no longer ``replayable``."""

    def __init__(self, max_events: int = MAX_LOGGED_EVENTS) -> None:
        self.events: list[str] = []
        self.first = 0
        self.done = False
        self.replayable = True
        self.max_events = max_events
        self._changed = asyncio.Event()

    @property
    def count(self) -> int:
        """How many events were logged in all (the next event's sequence number)."""
        return self.first + len(self.events)

    def extend(self, events: list[str]) -> None:
        """Append the events just written (each one whole SSE event)."""
        if events and self.replayable:
            self.events.extend(events)
            if len(self.events) > self.max_events:
                cut = len(self.events) - self.max_events // 2  # halving: amortised O(1) an event
                del self.events[:cut]
                self.first += cut
            self._wake()

    def drop(self) -> None:
        """Forget the events (a follower still reading stops at once)."""
        self.replayable = False
        self.events = []
        self.close()

    def close(self) -> None:
        """No more events (the response finished, failed or was cancelled)."""
        self.done = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, starting_after: int = -1) -> AsyncGenerator[str, None]:
        """The events after sequence number ``starting_after``, then the new ones as
        they come, until the log is closed (or a follower fell behind what is kept)."""
        i = starting_after + 1
        while True:
            while self.replayable and self.first <= i < self.count:
                yield self.events[i - self.first]
                i += 1
            if self.done or not self.replayable or i < self.first:
                return
            await self._changed.wait()


def sse_event(event_type: str, payload: dict[str, Any]) -> str:
    """One SSE event as OpenAI writes it: an ``event:`` line then the JSON ``data:``."""
    return f"event: {event_type}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def response_logprobs(entries: Any) -> list[dict[str, Any]]:
    """``output_text.logprobs`` from chat's logprobs content entries (the same
    ``build_chat_logprobs``): ``[{"token", "logprob", "bytes", "top_logprobs": [{"token",
    "logprob", "bytes"}]}]`` (``openai.types.responses.response_output_text.Logprob``)."""
    return [entry.model_dump() for entry in entries]


def _delta_logprob(entry: dict[str, Any]) -> dict[str, Any]:
    """An entry as the delta/done events carry it: no ``bytes``."""
    return {"token": entry["token"], "logprob": entry["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in entry["top_logprobs"]]}


class OutputBuilder:
    """The output items of one response (see the module docstring).

    stream: write events (each method returns the SSE strings of its piece; [] when not
    streaming)."""

    def __init__(self, stream: bool = False) -> None:
        self.stream = stream
        self.sequence_number = 0
        self._items: list[OutputItem] = []
        self._open: Optional[OutputItem] = None
        self._tool_index: Optional[int] = None
        self._pieces: list[str] = []  # the open message's text, joined when it closes
        self._delta_head = ""

    @property
    def items(self) -> list[OutputItem]:
        """The output items so far (an open message holds the text added so far)."""
        if isinstance(self._open, OutputMessage):
            self._open.content[0].text = "".join(self._pieces)
        return self._items

    # ---- events --------------------------------------------------------------------
    def event(self, event_type: str, **fields: Any) -> list[str]:
        """The SSE string of one event (numbered), or [] when not streaming."""
        if not self.stream:
            return []
        payload = {"type": event_type, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return [sse_event(event_type, payload)]

    def response_event(self, event_type: str, response: ResponsesResponse) -> list[str]:
        """``response.created`` / ``in_progress`` / ``completed`` / ... with the object."""
        return self.event(event_type, response=response.model_dump(mode="json"))

    def _index(self) -> int:
        return len(self._items) - 1

    # ---- pieces ----------------------------------------------------------------------
    def add(self, delta: Any, logprobs: Optional[list[dict[str, Any]]] = None) -> list[str]:
        """One parsed piece (a DeltaMessage: ``reasoning``, ``content``, ``tool_calls``);
        ``logprobs`` go with its content (see :meth:`text`)."""
        events: list[str] = []
        if delta is None:
            return events
        if getattr(delta, "reasoning", None):
            events += self.reasoning(delta.reasoning)
        if delta.content:
            events += self.text(delta.content, logprobs)
        for call in delta.tool_calls or ():
            events += self.tool_call(call.index, call.id, call.function.name if call.function else None,
                                     call.function.arguments if call.function else None)
        return events

    def reasoning(self, text: str) -> list[str]:
        events: list[str] = []
        if not isinstance(self._open, ReasoningItem):
            events += self._open_item(ReasoningItem(status="in_progress"))
            self._open.content.append(ReasoningText(text=""))
            events += self._part_event("response.content_part.added", {"type": "reasoning_text", "text": ""})
        self._open.content[0].text += text
        return events + self.event("response.reasoning_text.delta", item_id=self._open.id, output_index=self._index(),
                                   content_index=0, delta=text)

    def text(self, text: str, logprobs: Optional[list[dict[str, Any]]] = None) -> list[str]:
        """Text of the assistant message; ``logprobs`` (``include`` logprobs): the entries
        of its tokens (``token``, ``logprob``, ``bytes``, ``top_logprobs``: see
        :func:`response_logprobs`), kept on the ``output_text`` part and sent on the delta
        event (without ``bytes``, as OpenAI's ``ResponseTextDeltaEvent``)."""
        events: list[str] = []
        if not isinstance(self._open, OutputMessage):
            events += self._open_item(OutputMessage(status="in_progress"))
            self._open.content.append(OutputText(text=""))
            self._pieces = []
            events += self._part_event("response.content_part.added", OutputText(text="").model_dump())
            self._delta_head = (f'event: response.output_text.delta\ndata: {{"type":"response.output_text.delta",'
                                f'"item_id":"{self._open.id}","output_index":{self._index()},"content_index":0,'
                                '"sequence_number":')
        self._pieces.append(text)
        if logprobs:
            self._open.content[0].logprobs.extend(logprobs)
        if not self.stream:
            return events
        # the one event per token: written by hand (no dict, no model), as cheap as chat's chunk
        tail = json.dumps([_delta_logprob(lp) for lp in logprobs], ensure_ascii=False) if logprobs else "[]"
        events.append(f'{self._delta_head}{self.sequence_number},"delta":{json.dumps(text, ensure_ascii=False)},'
                      f'"logprobs":{tail}}}\n\n')
        self.sequence_number += 1
        return events

    def tool_call(self, index: int, call_id: Optional[str], name: Optional[str],
                  arguments: Optional[str]) -> list[str]:
        """A fragment of tool call ``index``: its first fragment names it (``name``)."""
        events: list[str] = []
        if not isinstance(self._open, FunctionCallItem) or index != self._tool_index:
            from llmserve.entrypoints.openai.common.protocol import random_uuid

            events += self._open_item(FunctionCallItem(call_id=call_id or f"call_{random_uuid()}", name=name or "",
                                                       arguments="", status="in_progress"))
            self._tool_index = index
        elif name:
            self._open.name += name
        if arguments:
            self._open.arguments += arguments
            events += self.event("response.function_call_arguments.delta", item_id=self._open.id,
                                 output_index=self._index(), delta=arguments)
        return events

    def finish(self, status: str = "completed") -> list[str]:
        """Close the open item (items still open end with ``status``: "completed", or
        "incomplete" when the output was cut). An output with no item gets an empty message."""
        events: list[str] = []
        if not self._items:
            events += self.text("")
        return events + self._close(status)

    def stop(self) -> list[str]:
        """Close the open item as "incomplete" (the response was cancelled mid-output)."""
        return self._close("incomplete")

    # ---- items -----------------------------------------------------------------------
    def _open_item(self, item: OutputItem) -> list[str]:
        events = self._close("completed")
        self._items.append(item)
        self._open = item
        return events + self.event("response.output_item.added", output_index=self._index(),
                                   item=item.model_dump(mode="json"))

    def _part_event(self, event_type: str, part: dict[str, Any]) -> list[str]:
        return self.event(event_type, item_id=self._open.id, output_index=self._index(), content_index=0, part=part)

    def _close(self, status: str) -> list[str]:
        item, events = self._open, []
        if item is None:
            return events
        i = self._index()
        if isinstance(item, OutputMessage):
            part = item.content[0]
            part.text = "".join(self._pieces)
            events += self.event("response.output_text.done", item_id=item.id, output_index=i, content_index=0,
                                 text=part.text, logprobs=[_delta_logprob(lp) for lp in part.logprobs])
            events += self._part_event("response.content_part.done", part.model_dump(mode="json"))
        elif isinstance(item, ReasoningItem):
            part = item.content[0]
            events += self.event("response.reasoning_text.done", item_id=item.id, output_index=i, content_index=0,
                                 text=part.text)
            events += self._part_event("response.content_part.done", part.model_dump(mode="json"))
        else:
            events += self.event("response.function_call_arguments.done", item_id=item.id, output_index=i,
                                 name=item.name, arguments=item.arguments)
        item.status = status
        self._open = None
        return events + self.event("response.output_item.done", output_index=i, item=item.model_dump(mode="json"))
