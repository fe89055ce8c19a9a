"""Hostile chat templates (issue 18 item 5): every render ends within its limits, says which
limit stopped it, can be cancelled; input that is not UTF-8 is named where the user wrote it."""

from __future__ import annotations

import threading
import time

import pytest

import localmoe.text.chat_template as ct
from localmoe.errors import InvalidRequestError, TemplateError
from localmoe.text.chat_template import ChatTemplate, TemplateLimitError

MSGS = [{"role": "user", "content": "hi"}]

# template -> the limit that must stop it
HOSTILE = {
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}": "time",
    "{% set r = range(99999) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}": "time",
    "{% macro f() %}{% for i in range(99999) %}{% endfor %}{{ f() }}{% endmacro %}{{ f() }}": "time",
    "{{ lipsum(100000) }}": "size",
    "{{ 'x' * 10**10 }}": "size",
    "{% set a = 10 %}{% set b = 100000000 %}{{ a ** b }}": "size",
    "{{ '%0999999999d' % 1 }}": "size",
    "{{ 'a'|center(10**9) }}": "size",
    "{{ 'a'.center(10**9) }}": "size",
    "{{ 'a'.ljust(10**9) }}": "size",
    "{% set s = 'a' * 1000000 %}{{ s.replace('a', 'aaaaaaaaaaaaaaaaaaaa') }}": "size",
    "{% set s = 'a' * 1000000 %}{{ s|replace('a', 'aaaaaaaaaaaaaaaaaaaa') }}": "size",
    "{{ ('a\n' * 100000)|indent(100000) }}": "size",
    "{{ range(99999)|join('x' * 100000) }}": "size",
    "{{ ('x' * 100000).join(range(99999)|map('string')|list) }}": "time|size",
    "{{ messages|tojson(indent=100000000) }}": "size",
    "{{ '{:>999999999}'.format(1) }}": "size",
    "{% for i in range(99999) %}{{ 'y' * 1000 }}{% endfor %}": "output",
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}{{ ns.s|length }}"): "memory",
}


@pytest.fixture(autouse=True)
def _short_limits(monkeypatch):
    monkeypatch.setattr(ct.LIMITS, "seconds", 0.5)
    monkeypatch.setattr(ct.LIMITS, "max_memory", 256 << 20)


@pytest.mark.parametrize("src", list(HOSTILE), ids=range(len(HOSTILE)))
def test_hostile_template_stops_at_its_limit(src, monkeypatch):
    if HOSTILE[src] == "memory":  # give the memory limit time to be the one hit
        monkeypatch.setattr(ct.LIMITS, "seconds", 20)
    t0 = time.monotonic()
    with pytest.raises(TemplateLimitError) as ei:
        ChatTemplate(src).render(MSGS)
    took = time.monotonic() - t0
    assert ei.value.limit in HOSTILE[src].split("|"), str(ei.value)
    assert isinstance(ei.value, TemplateError) and "\n" not in str(ei.value)
    assert f"template {ei.value.limit} limit" in str(ei.value)
    assert took < 5.0, f"stopped only after {took:.1f} s"


def test_recursion_is_a_template_error():
    with pytest.raises(TemplateError, match="recursed"):
        ChatTemplate("{% macro f(n) %}{{ f(n+1) }}{% endmacro %}{{ f(0) }}").render(MSGS)


def test_render_can_be_cancelled_and_the_thread_is_left_clean(monkeypatch):
    monkeypatch.setattr(ct.LIMITS, "seconds", 60)
    ev = threading.Event()
    threading.Timer(0.2, ev.set).start()
    t0 = time.monotonic()
    with pytest.raises(TemplateLimitError) as ei:
        ChatTemplate(next(iter(HOSTILE))).render(MSGS, cancel=ev)
    # well before the 60 s limit: 0.3-1.8 s alone on the 2-core VM, 3.1 s once inside a full
    # suite run (session 16), so the bound leaves room for a loaded machine
    assert ei.value.limit == "cancelled" and time.monotonic() - t0 < 10
    import sys
    assert sys.gettrace() is None or sys.gettrace() is not ct._Guard.trace
    assert ct._guard() is None


def test_ordinary_templates_render_unchanged():
    src = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
           "{{ [1, 2, 3]|join(', ') }} {{ 'ab'|center(6) }} {{ 'x' * 3 }} {{ 2 ** 10 }} {{ '%05d' % 7 }}"
           "{{ messages|tojson(indent=2)|length > 0 }}{{ lipsum(1)|length > 0 }}")
    out = ChatTemplate(src).render(MSGS)
    assert out == "<|im_start|>user\nhi<|im_end|>\n1, 2, 3   ab   xxx 1024 00007TrueTrue"


def test_non_utf8_message_is_named_where_the_user_wrote_it():
    t = ChatTemplate("{% for m in messages %}<s>{{ m.role }}: {{ m.content }}{% endfor %}")
    with pytest.raises(InvalidRequestError) as ei:
        t.render([{"role": "user", "content": "fine"}, {"role": "user", "content": "abc\ud800"}])
    assert "messages[1].content" in str(ei.value) and "character 3" in str(ei.value)
    assert ei.value.param == "messages[1].content"   # the field, as the server's 400 names it
