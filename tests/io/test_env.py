"""The on/off LOCALMOE_* switches: one parser (localmoe.io.env.env_flag) for all of them outside
the GPU kernels, taking the same words, and one logged line for a value it does not know."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

import localmoe.io.env as env
from localmoe.io.env import env_flag

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh_warnings():
    env._warn.cache_clear()
    yield
    env._warn.cache_clear()


@pytest.mark.parametrize("value,want", [
    ("1", True), ("true", True), ("YES", True), (" on ", True),
    ("0", False), ("false", False), ("No", False), ("OFF\n", False)])
@pytest.mark.parametrize("default", [True, False, None])
def test_on_and_off_words(monkeypatch, caplog, value, want, default):
    monkeypatch.setenv("LOCALMOE_TEST_SWITCH", value)
    with caplog.at_level(logging.WARNING):
        assert env_flag("LOCALMOE_TEST_SWITCH", default) is want
    assert not caplog.records


@pytest.mark.parametrize("default", [True, False, None])
def test_unset_or_empty_keeps_the_default_silently(monkeypatch, caplog, default):
    with caplog.at_level(logging.WARNING):
        monkeypatch.delenv("LOCALMOE_TEST_SWITCH", raising=False)
        assert env_flag("LOCALMOE_TEST_SWITCH", default) is default
        for blank in ("", "  "):
            monkeypatch.setenv("LOCALMOE_TEST_SWITCH", blank)
            assert env_flag("LOCALMOE_TEST_SWITCH", default) is default
    assert not caplog.records


@pytest.mark.parametrize("default,assumed", [(True, "on"), (False, "off"), (None, "automatic")])
def test_an_unknown_value_is_one_logged_line_once(monkeypatch, caplog, recwarn, default, assumed):
    """Not a Python warning (which printed 'file:line: UserWarning:' and the source line): one
    line through logging naming the variable, the value and what is assumed, once per value."""
    monkeypatch.setenv("LOCALMOE_TEST_SWITCH", "enabled")
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert env_flag("LOCALMOE_TEST_SWITCH", default) is default
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("localmoe.io.env", logging.WARNING,
         f"LOCALMOE_TEST_SWITCH='enabled' is not 1/true/yes/on or 0/false/no/off; assuming the "
         f"default ({assumed})")]
    assert not recwarn.list


def test_switches_outside_the_kernels_are_read_through_env_flag():
    """A LOCALMOE_* variable read straight from os.environ outside kernels/ and
    backends/triton/ is one that takes a number, a path, a URL or a mode, never an on/off
    switch (those parsed 1/0 only, or any non-empty value as on)."""
    not_switches = {"LOCALMOE_HOME", "LOCALMOE_INDEX_URL", "LOCALMOE_KERNEL_CACHE",
                    "LOCALMOE_ACT_PRECISION"}
    read = re.compile(r"""(?:environ\.get|getenv)\(\s*["'](LOCALMOE_\w+)["']"""
                      r"""|environ\[\s*["'](LOCALMOE_\w+)["']\s*\](?!\s*=[^=])""")
    found = {}
    for folder in ("localmoe", "backends", "models", "tui"):
        for p in (ROOT / folder).rglob("*.py"):
            if "triton" in p.relative_to(ROOT).parts:
                continue
            for m in read.finditer(p.read_text()):
                found.setdefault(m.group(1) or m.group(2), []).append(str(p.relative_to(ROOT)))
    assert "LOCALMOE_HOME" in found   # the scan sees direct reads
    assert {k: v for k, v in found.items() if k not in not_switches} == {}
