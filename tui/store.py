"""SQLite storage of chat conversations for the terminal UI.

One database file, ``chats.sqlite3``, lives in the localmoe data directory: ``$LOCALMOE_HOME``
when that variable is set, else platformdirs' user data dir for ``localmoe``.

Durability: the database runs in WAL mode and every write is its own committed transaction.
A message is inserted as soon as it exists (the user's prompt when it is sent, an empty
assistant row when generation starts) and the assistant row is updated with the full text so
far after every streamed token, so killing the process loses at most the token in flight.
WAL commits survive a process kill (not necessarily a power cut, which needs
``synchronous=FULL``; the per-token fsync that needs is not worth it here).

The store is used from the UI thread and from the generation worker thread; one connection
is shared behind a lock (``check_same_thread=False``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ChatSettings",
    "Chat",
    "Message",
    "ChatStore",
    "data_dir",
    "default_db_path",
    "chat_to_markdown",
]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS chats (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    model TEXT,
    settings TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    created REAL NOT NULL,
    finish_reason TEXT,
    stats TEXT,
    dropped INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS messages_chat ON messages(chat_id, id);
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


def data_dir() -> Path:
    """The localmoe data directory: ``$LOCALMOE_HOME`` if set, else the platformdirs user
    data dir of ``localmoe`` (e.g. ``~/.local/share/localmoe``). Not created here."""
    home = os.environ.get("LOCALMOE_HOME")
    if home:
        return Path(home).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("localmoe", appauthor=False))


def default_db_path() -> Path:
    """Path of the chat database, ``<data_dir()>/chats.sqlite3``."""
    return data_dir() / "chats.sqlite3"


@dataclass
class ChatSettings:
    """Per-chat generation settings. ``None`` means "use the default" (the model file's
    ``general.sampling.*`` metadata when present, else the engine's SamplingParams default;
    for ``kv_cache`` and ``backend`` the values the app was started with).

    Attributes:
        system_prompt: text of a system message put before the conversation ("" = none).
        temperature, top_p, top_k: sampling parameters.
        max_tokens: cap on generated tokens per answer (None = until the context is full).
        seed: RNG seed for reproducible sampling (None = random).
        kv_cache: KV cache format name (``f16``, ``int8``, ``int4``, ...).
        backend: backend name (``auto``, ``triton``, ``llamacpp``, ``torch``).
    """

    system_prompt: str = ""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    seed: int | None = None
    kv_cache: str | None = None
    backend: str | None = None

    def to_json(self) -> str:
        """Serialize to a JSON object string."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | None) -> "ChatSettings":
        """Parse :meth:`to_json` output; unknown keys are ignored, bad JSON gives defaults."""
        try:
            data = json.loads(text or "{}")
        except ValueError:
            data = {}
        if not isinstance(data, dict):
            data = {}
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class Message:
    """One stored message. ``stats`` holds the generation metrics of an assistant answer
    (ttft_ms, decode_tok_s, prompt_tokens, completion_tokens); ``finish_reason`` is
    ``None`` while it is being streamed (or if the process died mid-stream)."""

    id: int
    chat_id: int
    role: str
    content: str
    created: float
    finish_reason: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    dropped: bool = False


@dataclass
class Chat:
    """One conversation (without its messages)."""

    id: int
    title: str
    model: str | None
    settings: ChatSettings
    created: float
    updated: float
    n_messages: int = 0


class ChatStore:
    """Conversations and messages in one SQLite file.

    Args:
        path: database file; ``None`` uses :func:`default_db_path`. Parent folders are created.

    Raises:
        localmoe.errors.StoreError: the database cannot be opened or is not a chat database
            (and, from the methods that write, a write failed).
    """

    def __init__(self, path: str | os.PathLike | None = None):
        from localmoe.errors import StoreError

        self.path = Path(path) if path is not None else default_db_path()
        self._lock = threading.RLock()
        if self.path.is_dir():  # sqlite says only "unable to open database file"
            raise StoreError(f"cannot open the chat database {self.path}: it is a folder, not a "
                             f"file; move it away or set LOCALMOE_HOME to another folder")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(_SCHEMA)
        except (OSError, sqlite3.Error) as e:
            raise StoreError(
                f"cannot open the chat database {self.path}: {e}; "
                f"check the file's permissions or set LOCALMOE_HOME to another folder"
            ) from e

    @contextlib.contextmanager
    def _writing(self):
        """The lock, around a write: a write that fails (a full disk, a database another
        process keeps locked past the busy timeout) raises StoreError, one line the chat UI
        shows, instead of sqlite3's error."""
        from localmoe.errors import StoreError

        with self._lock:
            try:
                yield
            except sqlite3.Error as e:
                raise StoreError(f"cannot save to the chat database {self.path}: {e}") from e

    # -- chats -------------------------------------------------------------------------

    def create_chat(self, title: str = "New chat", model: str | None = None,
                    settings: ChatSettings | None = None) -> Chat:
        """Insert a new empty chat and return it."""
        now = time.time()
        settings = settings or ChatSettings()
        with self._writing():
            cur = self._db.execute(
                "INSERT INTO chats(title, model, settings, created, updated) VALUES (?,?,?,?,?)",
                (title, model, settings.to_json(), now, now),
            )
            return Chat(cur.lastrowid, title, model, settings, now, now, 0)

    def get_chat(self, chat_id: int) -> Chat | None:
        """The chat with this id, or None."""
        with self._lock:
            row = self._db.execute(
                "SELECT c.*, (SELECT COUNT(*) FROM messages m WHERE m.chat_id=c.id) AS n "
                "FROM chats c WHERE c.id=?",
                (chat_id,),
            ).fetchone()
        return self._chat(row) if row else None

    def list_chats(self) -> list[Chat]:
        """All chats, most recently updated first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT c.*, (SELECT COUNT(*) FROM messages m WHERE m.chat_id=c.id) AS n "
                "FROM chats c ORDER BY c.updated DESC, c.id DESC"
            ).fetchall()
        return [self._chat(r) for r in rows]

    def last_chat(self) -> Chat | None:
        """The most recently updated chat, or None when there is none."""
        chats = self.list_chats()
        return chats[0] if chats else None

    def rename_chat(self, chat_id: int, title: str) -> None:
        """Set a chat's title (stripped; empty titles become "Untitled")."""
        title = title.strip() or "Untitled"
        with self._writing():
            self._db.execute("UPDATE chats SET title=? WHERE id=?", (title, chat_id))

    def set_settings(self, chat_id: int, settings: ChatSettings) -> None:
        """Store a chat's settings."""
        with self._writing():
            self._db.execute("UPDATE chats SET settings=? WHERE id=?", (settings.to_json(), chat_id))

    def set_model(self, chat_id: int, model: str | None) -> None:
        """Record which model a chat uses."""
        with self._writing():
            self._db.execute("UPDATE chats SET model=? WHERE id=?", (model, chat_id))

    def delete_chat(self, chat_id: int) -> None:
        """Delete a chat and all of its messages."""
        with self._writing():
            self._db.execute("DELETE FROM messages WHERE chat_id=?", (chat_id,))
            self._db.execute("DELETE FROM chats WHERE id=?", (chat_id,))

    def touch(self, chat_id: int) -> None:
        """Mark a chat as just updated (moves it to the top of the list)."""
        with self._writing():
            self._db.execute("UPDATE chats SET updated=? WHERE id=?", (time.time(), chat_id))

    # -- messages ----------------------------------------------------------------------

    def add_message(self, chat_id: int, role: str, content: str,
                    finish_reason: str | None = None) -> Message:
        """Append a message to a chat (committed at once) and return it."""
        now = time.time()
        with self._writing():
            cur = self._db.execute(
                "INSERT INTO messages(chat_id, role, content, created, finish_reason) "
                "VALUES (?,?,?,?,?)",
                (chat_id, role, content, now, finish_reason),
            )
            self._db.execute("UPDATE chats SET updated=? WHERE id=?", (now, chat_id))
            return Message(cur.lastrowid, chat_id, role, content, now, finish_reason)

    def update_message(self, message_id: int, content: str, *, finish_reason: str | None = None,
                       stats: dict[str, Any] | None = None) -> None:
        """Replace a message's text (called after every streamed token) and optionally set
        its finish reason and stats. Each call is one committed transaction."""
        with self._writing():
            if finish_reason is None and stats is None:
                self._db.execute("UPDATE messages SET content=? WHERE id=?", (content, message_id))
            else:
                self._db.execute(
                    "UPDATE messages SET content=?, finish_reason=COALESCE(?, finish_reason), "
                    "stats=COALESCE(?, stats) WHERE id=?",
                    (content, finish_reason, json.dumps(stats) if stats is not None else None,
                     message_id),
                )

    def delete_messages_from(self, chat_id: int, message_id: int) -> None:
        """Delete a message and every later message of the same chat (regenerate / edit)."""
        with self._writing():
            self._db.execute("DELETE FROM messages WHERE chat_id=? AND id>=?", (chat_id, message_id))

    def delete_message(self, message_id: int) -> None:
        """Delete one message."""
        with self._writing():
            self._db.execute("DELETE FROM messages WHERE id=?", (message_id,))

    def set_dropped(self, message_ids: list[int], dropped: bool = True) -> None:
        """Mark messages as dropped from the model's context (kept, shown dimmed, not sent)."""
        with self._writing():
            self._db.executemany(
                "UPDATE messages SET dropped=? WHERE id=?", [(int(dropped), i) for i in message_ids]
            )

    def messages(self, chat_id: int) -> list[Message]:
        """A chat's messages, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM messages WHERE chat_id=? ORDER BY id", (chat_id,)
            ).fetchall()
        out = []
        for r in rows:
            try:
                stats = json.loads(r["stats"]) if r["stats"] else {}
            except ValueError:
                stats = {}
            out.append(Message(r["id"], r["chat_id"], r["role"], r["content"], r["created"],
                               r["finish_reason"], stats, bool(r["dropped"])))
        return out

    def recent_prompts(self, limit: int = 200) -> list[str]:
        """The last ``limit`` user prompts over all chats, oldest first (prompt history)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT content FROM messages WHERE role='user' ORDER BY id DESC LIMIT ?", (limit,)
            ).fetchall()
        return [r["content"] for r in reversed(rows)]

    # -- misc --------------------------------------------------------------------------

    def get_meta(self, key: str, default: str | None = None) -> str | None:
        """A value from the key/value table (e.g. ``last_model``)."""
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row["value"] if row else default

    def set_meta(self, key: str, value: str) -> None:
        """Store a value in the key/value table."""
        with self._writing():
            self._db.execute(
                "INSERT INTO meta(key, value) VALUES (?,?) "
                "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                (key, value),
            )

    def export_markdown(self, chat_id: int) -> str:
        """The chat as a Markdown document (see :func:`chat_to_markdown`)."""
        chat = self.get_chat(chat_id)
        if chat is None:
            raise KeyError(chat_id)
        return chat_to_markdown(chat, self.messages(chat_id))

    def close(self) -> None:
        """Close the database connection."""
        with self._lock:
            self._db.close()

    @staticmethod
    def _chat(row: sqlite3.Row) -> Chat:
        return Chat(row["id"], row["title"], row["model"], ChatSettings.from_json(row["settings"]),
                    row["created"], row["updated"], row["n"])


def chat_to_markdown(chat: Chat, messages: list[Message]) -> str:
    """Render a conversation as Markdown: a title heading, the model and system prompt, then
    one ``## User`` / ``## Assistant`` section per message with its text verbatim."""
    lines = [f"# {chat.title}", ""]
    if chat.model:
        lines += [f"*Model:* `{chat.model}`", ""]
    if chat.settings.system_prompt:
        lines += ["## System", "", chat.settings.system_prompt, ""]
    for m in messages:
        heading = {"user": "User", "assistant": "Assistant", "system": "System"}.get(
            m.role, m.role.title())
        note = " (stopped)" if m.finish_reason == "cancelled" else ""
        lines += [f"## {heading}{note}", "", m.content.rstrip(), ""]
    return "\n".join(lines).rstrip() + "\n"


def slugify(title: str) -> str:
    """A file-name-safe version of a chat title (``"Hello, world!"`` -> ``"hello-world"``)."""
    s = re.sub(r"[^A-Za-z0-9]+", "-", title).strip("-").lower()
    return s[:60] or "chat"
