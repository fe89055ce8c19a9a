"""The sidebar: the list of saved chats, most recent first."""

from __future__ import annotations

from textual.message import Message
from textual.widgets import Label, ListItem, ListView

from ..store import Chat

__all__ = ["ChatList", "ChatItem"]


class ChatItem(ListItem):
    """One chat in the sidebar."""

    def __init__(self, chat: Chat) -> None:
        super().__init__(Label(chat.title, classes="chat-title", markup=False))
        self.chat_id = chat.id
        self.title_text = chat.title


class ChatList(ListView):
    """Saved chats; Enter or a click posts :class:`ChatList.ChatChosen`."""

    class ChatChosen(Message):
        """The user picked chat ``chat_id``."""

        def __init__(self, chat_id: int) -> None:
            super().__init__()
            self.chat_id = chat_id

    async def set_chats(self, chats: list[Chat], current: int | None) -> None:
        """Replace the items and highlight the current chat (without posting ChatChosen)."""
        await self.clear()
        await self.extend([ChatItem(c) for c in chats])
        for i, c in enumerate(chats):
            if c.id == current:
                self.index = i
                break

    def on_list_view_selected(self, event: ListView.Selected) -> None:
        event.stop()
        if isinstance(event.item, ChatItem):
            self.post_message(self.ChatChosen(event.item.chat_id))
