"""The main screen: sidebar of chats, the conversation, the prompt and the stats bar.

The screen owns layout only. Widget messages (a prompt submitted, a chat picked in the
sidebar, something copied) are forwarded to the app, which owns the engine and the store.
"""

from __future__ import annotations

from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Label, ProgressBar

from ..widgets.message import MessageView
from ..widgets.prompt import PromptInput
from ..widgets.sidebar import ChatList
from ..widgets.stats import StatsBar

__all__ = ["ChatScreen"]


class ChatScreen(Screen):
    """Layout of the chat UI (ids: ``#sidebar``, ``#chat-list``, ``#chat-log``,
    ``#load-progress``, ``#prompt``, ``#stats``)."""

    def __init__(self, history: list[str] | None = None) -> None:
        super().__init__()
        self._history = history or []

    def compose(self):
        yield Header(show_clock=False)
        with Horizontal(id="main"):
            with Vertical(id="sidebar"):
                yield Label("Chats", classes="sidebar-title")
                yield ChatList(id="chat-list")
            with Vertical(id="chat-pane"):
                yield VerticalScroll(id="chat-log")
                yield ProgressBar(id="load-progress", total=100, show_eta=False)
                yield PromptInput(id="prompt", history=self._history,
                                  placeholder="Ask anything — Enter sends, Ctrl+J new line, "
                                              "Up history, Ctrl+P commands")
        yield StatsBar(id="stats")
        yield Footer()

    async def on_mount(self) -> None:
        self.query_one("#chat-log", VerticalScroll).anchor()
        self.query_one(PromptInput).focus()
        await self.app.screen_ready()

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        event.stop()
        await self.app.send_prompt(event.text)

    async def on_chat_list_chat_chosen(self, event: ChatList.ChatChosen) -> None:
        event.stop()
        await self.app.open_chat(event.chat_id)

    def on_message_view_copied(self, event: MessageView.Copied) -> None:
        event.stop()
        self.app.notify(f"Copied {event.what} to the clipboard.", timeout=2)
