"""Snapshot tests (pytest-textual-snapshot) of the chat TUI's main screens.

The SVG snapshots live in tests/tui/__snapshots__/test_tui_snapshots/. After an intended visual
change, review and update them with ``pytest tests/tui/test_tui_snapshots.py --snapshot-update``.
The app runs on the scripted fake engine (tests/tui/tui_fakes.py), so the pictures are stable.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tui_fakes import CODE_REPLY, FakeEngine, FakeFactory  # noqa: E402

from localmoe.errors import ContextOverflowError, ModelNotFoundError  # noqa: E402
from localmoe.tui.app import ChatApp  # noqa: E402
from localmoe.tui.store import ChatStore  # noqa: E402
from localmoe.tui.widgets.prompt import PromptInput  # noqa: E402

SIZE = (100, 30)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALMOE_HOME", str(tmp_path / "home"))


async def _until(pilot, cond, limit: float = 20.0) -> None:
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end, "app did not reach the expected state"
        await pilot.pause(0.01)


async def _settle(pilot) -> None:
    """Stable picture: no toasts, no blinking cursor, everything laid out."""
    app = pilot.app
    await pilot.pause()
    app.clear_notifications()
    for ta in app.screen.query("TextArea"):
        ta.cursor_blink = False
    for p in app.screen_stack[0].query(PromptInput):
        p.cursor_blink = False
    await pilot.pause()
    await pilot.wait_for_scheduled_animations()
    # on a loaded machine a widget can still be laying out or rendering (a Markdown reply, a
    # dialog mounting its fields): wait until two screenshots a moment apart are the same
    end = time.monotonic() + 20.0
    last = app.export_screenshot()
    while time.monotonic() < end:
        await pilot.pause(0.05)
        now = app.export_screenshot()
        if now == last:
            break
        last = now


async def _send(pilot, text: str) -> None:
    app = pilot.app
    await _until(pilot, lambda: app.engine is not None)
    prompt = app.screen.query_one(PromptInput)
    prompt.load_text(text)
    await pilot.press("enter")
    await _until(pilot, lambda: not app.generating)
    await pilot.pause()


def _app(tmp_path, engine=None, factory=None, model="fake-model") -> ChatApp:
    return ChatApp(model, engine_factory=factory or FakeFactory(engine or FakeEngine()),
                   store=ChatStore(tmp_path / "chats.sqlite3"))


def test_snapshot_empty_chat(snap_compare, tmp_path):
    async def before(pilot):
        await _until(pilot, lambda: pilot.app.engine is not None)
        await _settle(pilot)

    assert snap_compare(_app(tmp_path), run_before=before, terminal_size=SIZE)


def test_snapshot_conversation_with_code(snap_compare, tmp_path):
    async def before(pilot):
        await _send(pilot, "How do I add two numbers in Python?")
        await _settle(pilot)

    assert snap_compare(_app(tmp_path, FakeEngine([CODE_REPLY])), run_before=before,
                        terminal_size=SIZE)


def test_snapshot_settings_dialog(snap_compare, tmp_path):
    eng = FakeEngine(metadata={"general.sampling.temp": 0.6, "general.sampling.top_p": 0.9})

    async def before(pilot):
        from localmoe.tui.screens.dialogs import SettingsScreen

        await _send(pilot, "hello")
        # this picture is about the dialog: the stats bar behind it is pinned to the reply's
        # figures (the fake engine's) and painted before the modal keeps the chat screen's last
        # frame. Unpinned, about half the runs painted the bar without them (a paint race, or
        # a reset of the stats after a new chat's first reply: not settled yet)
        await pilot.pause(0.1)
        bar = pilot.app._statsbar()
        bar.show(ttft_ms=12.0, tok_s=42.0, ctx_used=15)
        await _until(pilot, lambda: "tok/s" in str(bar.render()))
        await pilot.pause(0.1)
        await pilot.press("f3")
        # on a loaded machine the dialog can mount after two pauses: wait for it
        await _until(pilot, lambda: isinstance(pilot.app.screen, SettingsScreen))
        await pilot.wait_for_scheduled_animations()
        await _settle(pilot)

    assert snap_compare(_app(tmp_path, eng), run_before=before, terminal_size=(100, 40))


def test_snapshot_context_full_dialog(snap_compare, tmp_path):
    eng = FakeEngine(raise_on_stream=ContextOverflowError(5000, 4096))

    async def before(pilot):
        await _send(pilot, "a very long question")
        await _until(pilot, lambda: pilot.app.screen.__class__.__name__ == "ContextFullScreen")
        await _settle(pilot)

    assert snap_compare(_app(tmp_path, eng), run_before=before, terminal_size=SIZE)


def test_snapshot_model_missing_error(snap_compare, tmp_path):
    err = ModelNotFoundError("no model named 'qwen9'; run `localmoe list` to see local models "
                             "or `localmoe pull NAME` to fetch one")

    async def before(pilot):
        await _until(pilot, lambda: pilot.app.load_error is not None)
        await _settle(pilot)

    assert snap_compare(_app(tmp_path, factory=FakeFactory(error=err), model="qwen9"),
                        run_before=before, terminal_size=SIZE)


def test_snapshot_loading_progress(snap_compare, tmp_path):
    gate = threading.Event()

    async def before(pilot):
        await _until(pilot, lambda: "50%" in pilot.app.screen.query_one("#stats").stats.status)
        await _settle(pilot)

    try:
        assert snap_compare(_app(tmp_path, factory=FakeFactory(gate=gate)), run_before=before,
                            terminal_size=SIZE)
    finally:
        gate.set()
