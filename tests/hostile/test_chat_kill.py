"""A chat UI killed mid-answer (issue 18 item 8): reopened, the cut answer is marked
"interrupted" and an answer killed before its first token leaves no empty message."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tui"))

from tests.tui.test_tui import SIZE, make_app, ready, views  # noqa: E402
from localmoe.tui.store import ChatStore  # noqa: E402


def test_killed_answers_after_restart(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALMOE_HOME", str(tmp_path / "home"))
    db = tmp_path / "chats.sqlite3"
    st = ChatStore(db)
    chat = st.create_chat("c", model="fake-model")
    st.add_message(chat.id, "user", "first")
    st.add_message(chat.id, "assistant", "a partial ans")  # what a kill -9 leaves mid-stream
    st.add_message(chat.id, "user", "second")
    st.add_message(chat.id, "assistant", "")  # killed before the first token
    st.close()

    async def body():
        app = make_app(db, model=None, continue_last=True)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            vs = views(app)
            assert [v.text for v in vs] == ["first", "a partial ans", "second"]
            assert "interrupted" in vs[1]._note

    asyncio.run(body())
