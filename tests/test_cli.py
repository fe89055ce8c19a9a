"""CLI: click CliRunner for wiring and errors, subprocess end to end on the real SmolLM2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest
from click.testing import CliRunner

from localmoe.cli import cli

from tests.conftest import has_llamacpp


def run(args, **kw):
    return CliRunner().invoke(cli, args, catch_exceptions=False, **kw)


def lm(*args, stdin=None, timeout=300, env=None):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "localmoe", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout, env=e)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALMOE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def assert_one_line_error(r, *needles, status=1):
    assert r.returncode == status if hasattr(r, "returncode") else r.exit_code == status
    err = r.stderr
    assert "Traceback" not in err
    lines = [l for l in err.splitlines() if l.strip()]
    assert lines and lines[-1].startswith("error: "), err
    for n in needles:
        assert n in lines[-1], (n, lines[-1])


def test_help_is_fast_and_imports_nothing_heavy():
    code = ("import sys, localmoe.cli\n"
            "heavy = [m for m in ('torch', 'numpy', 'llama_cpp', 'textual', 'fastapi') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    r = run(["--help"])
    assert r.exit_code == 0
    for cmd in ("generate", "chat", "serve", "pull", "models", "rm", "info", "backends"):
        assert cmd in r.output


def test_model_default_in_help_is_what_each_command_loads():
    """Without -m, generate/serve/bench load the store's default model; chat reopens the
    continued chat's model, else the model it loaded last (tui/app.py), and only then the
    default. Each command's -m help says so (chat's claimed plain smollm2)."""
    from localmoe.io.store import DEFAULT_MODEL

    def model_help(cmd):
        out = " ".join(run([cmd, "--help"]).output.split())
        return out.split("-m, --model MODEL", 1)[1].split(" --backend", 1)[0]

    for cmd in ("generate", "serve", "bench"):
        assert model_help(cmd).endswith(f"Default: {DEFAULT_MODEL} (pulled on first use)."), cmd
    chat = model_help("chat")
    assert f"Default: {DEFAULT_MODEL}" not in chat, chat
    assert "--continue" in chat and "last" in chat and DEFAULT_MODEL in chat, chat


def test_errors_are_one_line_with_exit_1(home, tmp_path):
    # a real process: exit status and stderr exactly as a user sees them
    r = lm("generate", "-m", str(tmp_path / "missing.gguf"), "hi")
    assert_one_line_error(r, "does not exist")
    # in-process for the rest (catch_exceptions=False: a traceback would fail the test)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOTAGGUF" * 10)
    for args, needle in ((["generate", "-m", "no-such-model", "hi"], "no-such-model"),
                         (["generate", "-m", str(bad), "hi"], ""),
                         (["info", "no-such-model"], "no-such-model"),
                         (["rm", "nothing-here"], "nothing-here")):
        r = run(args)
        assert r.exit_code == 1, (args, r.output)
        assert_one_line_error(types.SimpleNamespace(returncode=1, stderr=r.stderr), needle)


def test_empty_kv_cache_option_is_a_one_line_error(home, tmp_path, monkeypatch):
    """A doubled or trailing comma in --kv-cache is refused like any bad option: one line,
    exit 2 (a usage error), before any model is resolved (generate, chat) or the server starts
    (serve)."""
    import localmoe.tui.app as tui_app
    import localmoe.serve.server as server

    opened = []
    monkeypatch.setattr(tui_app, "run_chat", lambda *a, **kw: opened.append("chat"))
    monkeypatch.setattr(server, "run_server", lambda *a, **kw: opened.append("serve"))
    for cmd in (["generate", "-m", str(tmp_path / "missing.gguf"), "hi"],
                ["chat", "-m", str(tmp_path / "missing.gguf")], ["serve"]):
        for kv in ("int4,,", "int4,", "int2,,sinks=4"):
            r = run([*cmd, "--kv-cache", kv])
            assert_one_line_error(types.SimpleNamespace(returncode=r.exit_code, stderr=r.stderr),
                                  "Invalid value for '--kv-cache'", "empty KV cache option",
                                  repr(kv), status=2)
    assert not opened


def test_malformed_kv_cache_spec_is_a_one_line_error(home, tmp_path, monkeypatch):
    """A trailing or doubled ':' after the format ran as the plain format; an option with no
    value is refused naming the option. One line, exit 2, before any model is resolved."""
    import localmoe.tui.app as tui_app
    import localmoe.serve.server as server

    opened = []
    monkeypatch.setattr(tui_app, "run_chat", lambda *a, **kw: opened.append("chat"))
    monkeypatch.setattr(server, "run_server", lambda *a, **kw: opened.append("serve"))
    missing = str(tmp_path / "missing.gguf")
    for cmd in (["generate", "-m", missing, "hi"], ["chat", "-m", missing], ["serve"]):
        for args, needle in ((["--kv-cache", "int4:"], "empty KV format option in 'int4:'"),
                             (["--kv-cache", "int4::c"], "empty KV format option"),
                             (["--kv-cache-k", "int4:"], "empty KV format option"),
                             (["--kv-cache", "int4,sinks="], "'sinks=' in 'int4,sinks=' has no "
                                                             "value")):
            r = run([*cmd, *args])
            assert_one_line_error(types.SimpleNamespace(returncode=r.exit_code, stderr=r.stderr),
                                  f"Invalid value for '{args[0]}'", needle, status=2)
            assert "missing.gguf" not in r.stderr
    assert not opened


def test_empty_kv_cache_format_is_a_one_line_error(home, tmp_path, monkeypatch):
    """An empty --kv-cache / -k / -v value or an empty k=/v= in the string silently meant f16;
    it is an error naming the accepted formats, before any model is resolved or loaded, in
    every command (a usage error, exit 2), the Python API and the server."""
    import localmoe.tui.app as tui_app
    import localmoe.serve.server as server
    from localmoe.api import LLM
    from localmoe.errors import KVCacheFormatError

    missing = str(tmp_path / "missing.gguf")
    for kw in ({"kv_cache": ""}, {"kv_cache": "k=int4,v="}, {"kv_cache_k": ""},
               {"kv_cache_v": ""}):
        with pytest.raises(KVCacheFormatError, match="empty KV cache format"):
            LLM(missing, **kw)
        with pytest.raises(KVCacheFormatError, match="empty KV cache format"):
            server.run_server(missing, **kw)
    opened = []
    monkeypatch.setattr(tui_app, "run_chat", lambda *a, **kw: opened.append("chat"))
    monkeypatch.setattr(server, "run_server", lambda *a, **kw: opened.append("serve"))
    for cmd in (["generate", "-m", missing, "hi"], ["chat", "-m", missing], ["serve"]):
        for kv in (["--kv-cache", ""], ["--kv-cache", "k=int4,v="], ["--kv-cache", "k="],
                   ["--kv-cache-k", ""], ["--kv-cache-v", ""]):
            r = run([*cmd, *kv])
            assert_one_line_error(types.SimpleNamespace(returncode=r.exit_code, stderr=r.stderr),
                                  "empty KV cache format", "int4", status=2)
            assert "missing.gguf" not in r.stderr
    assert not opened


def _kv_commands():
    """Every command with the KV flags (generate, chat, serve, bench today)."""
    import importlib

    from localmoe.cli import COMMANDS

    names = []
    for name, (module, attr) in sorted(COMMANDS.items()):
        cmd = getattr(importlib.import_module(f"localmoe.cli.{module}"), attr)
        if {"kv_cache", "kv_cache_k", "kv_cache_v"} <= {p.name for p in cmd.params}:
            names.append(name)
    assert {"generate", "chat", "serve", "bench"} <= set(names), names
    return names


def test_bad_kv_cache_value_is_a_usage_error(home, tmp_path, monkeypatch):
    """`--kv-cache int7` (or -k/-v) exited 1 while every other bad flag value is a click usage
    error: it is one now in every command that takes the KV flags, exit 2, one line naming the
    flag and the accepted formats, before any model is resolved or the UI/server starts. The
    three flags are checked together: an override that makes the string valid is accepted, one
    that makes it invalid names the flags."""
    import localmoe.serve.server as server
    import localmoe.tui.app as tui_app

    opened = []
    monkeypatch.setattr(tui_app, "run_chat", lambda *a, **kw: opened.append("chat"))
    monkeypatch.setattr(server, "run_server", lambda *a, **kw: opened.append("serve"))
    missing = str(tmp_path / "missing.gguf")
    formats = "choose one of: f32, f16, bf16, int8, int4, int3, int2, fp4"
    for cmd in _kv_commands():
        argv = [cmd, "-m", missing] + (["hi"] if cmd == "generate" else [])
        for args, flag, needle in (
                (["--kv-cache", "int7"], "--kv-cache", f"unknown KV cache format 'int7'; {formats}"),
                (["--kv-cache-k", "int7"], "--kv-cache-k", "'int7'"),
                (["--kv-cache-v", "int5"], "--kv-cache-v", "'int5'"),
                # -k's own error, not the rest of the string that it makes look wrong
                (["--kv-cache-v", "int4", "--kv-cache", "f16,sinks=4", "--kv-cache-k", "f16:c"],
                 "--kv-cache-k", "'f16:c'"),
                # each valid alone, not together: every flag given is named
                (["--kv-cache", "int4,outliers=0.04", "--kv-cache-k", "f16", "--kv-cache-v",
                  "f16"], "--kv-cache' / '--kv-cache-k' / '--kv-cache-v", "outliers=")):
            r = run([*argv, *args])
            assert r.exit_code == 2, (cmd, args, r.output)
            lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
            assert len(lines) == 1 and "Traceback" not in r.stderr, (cmd, args, r.stderr)
            assert lines[0].startswith(f"error: Invalid value for '{flag}': "), lines
            assert needle in lines[0] and lines[0].endswith(f" {cmd} --help')"), lines
            assert "missing.gguf" not in r.stderr
        # a string that only the override makes valid (sinks= needs a quantized side) is
        # accepted: the next error is the missing model's (exit 1; serve's is the server's)
        r = run([*argv, "--kv-cache", "f16,sinks=4", "--kv-cache-v", "int4"])
        assert r.exit_code == (0 if cmd == "serve" else 1), (cmd, r.output)
        assert "Invalid value" not in r.stderr, (cmd, r.output)
    assert opened == ["serve"]
    # as a user runs it: exit status 2 and the one line
    r = lm("generate", "-m", missing, "--kv-cache", "int7", "hi")
    assert r.returncode == 2 and r.stderr.startswith("error: Invalid value for '--kv-cache': "
                                                     "unknown KV cache format 'int7'"), r.stderr


@pytest.mark.parametrize("args,needle", [(["--temperature", "-1"], "temperature"),
                                         (["--temp", "nan"], "temperature"),
                                         (["--top-p", "1.5"], "top_p"),
                                         (["--min-p", "2"], "min_p"),
                                         (["--top-k", "-3"], "top_k"),
                                         (["--presence-penalty", "5"], "presence_penalty"),
                                         (["--seed", str(2**64)], "seed")])
def test_bad_sampling_values_fail_before_the_model_loads(home, tmp_path, args, needle):
    """Out-of-range sampling values are refused before the model is even resolved (they were
    reported only after the weights had loaded): the error names the parameter, not the
    missing model file. They are usage errors, exit status 2 as a bad -c or -n (they were 1),
    in click's words naming the flag."""
    r = run(["generate", "-m", str(tmp_path / "missing.gguf"), *args, "hi"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    flag = "--temperature" if args[0] == "--temp" else args[0]
    assert lines[0].startswith(f"error: Invalid value for '{flag}': {needle} must be "), lines
    assert lines[0].endswith(" generate --help')"), lines
    assert "missing.gguf" not in r.stderr


@pytest.mark.parametrize("stops", [[""], ["###", ""]])
def test_empty_stop_string_is_a_usage_error(home, tmp_path, stops):
    """`--stop ''` exited 1 (a LocalMoEError after the other checks): it is a usage error,
    exit status 2 and one line naming --stop, before the model is resolved; the server
    refuses `"stop": ""` with a 400 the same way (tests/serve/test_server.py)."""
    args = [a for s in stops for a in ("--stop", s)]
    r = run(["generate", "-m", str(tmp_path / "missing.gguf"), *args, "hi"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("error: Invalid value for '--stop': ") and "empty" in lines[0], lines
    assert "missing.gguf" not in r.stderr


def test_kv_group_size_larger_than_the_head_is_refused_before_loading(tmp_path):
    """`--kv-cache int4:g4096` ran with groups of the head size (64) and was reported as
    int4:g4096 in --json; `int4:g1` was accepted. Both are one error line: exit status 1 for
    the size the model's heads refuse, 2 (a usage error) for one no model takes."""
    from localmoe.testing.synthetic import write_gguf

    m = str(write_gguf(tmp_path / "m.gguf", "tiny-llama"))    # head_dim 64
    for kv, needle, status in (("int4:g4096", "KV group size 4096 of the values (int4:g4096) "
                                              "is larger than this model's head size (64 "
                                              "channels)", 1),
                               ("int4:g1", "KV group size must be a power of two from 16 up", 2)):
        r = run(["generate", "-m", m, "--backend", "torch", "--json", "--kv-cache", kv, "hi"])
        assert_one_line_error(types.SimpleNamespace(returncode=r.exit_code, stderr=r.stderr),
                              needle, status=status)
        assert r.stdout == ""
    r = run(["generate", "-m", m, "--backend", "torch", "--json", "-n", "1", "--kv-cache",
             "int4:g64", "hi"])
    assert r.exit_code == 0 and json.loads(r.stdout)["kv_cache"] == "int4:g64", r.output


def test_usage_errors_exit_2():
    r = CliRunner().invoke(cli, ["generate", "--max-tokens", "0", "hi"])
    assert r.exit_code == 2
    r = CliRunner().invoke(cli, ["generate", "-m", "x.gguf"], input="   ")
    assert r.exit_code == 2 and "empty" in r.output


@pytest.mark.parametrize("args,needle,cmd", [
    (["generate", "--bogus", "hi"], "No such option '--bogus'", "localmoe generate"),
    (["generate", "-n", "x", "hi"], "'x' is not a valid integer", "localmoe generate"),
    (["bogus"], "No such command 'bogus'", "localmoe"),
    (["--bogus"], "No such option '--bogus'", "localmoe"),
    (["serve", "--port", "0"], "--port", "localmoe serve")])
def test_click_usage_errors_are_one_line(args, needle, cmd):
    """click printed 4 lines (usage, 'Try --help', a blank, 'Error: ...'); every usage error
    is one line 'error: MESSAGE (see 'localmoe CMD --help')', exit status 2."""
    r = CliRunner().invoke(cli, args, prog_name="localmoe")
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and needle in lines[0], lines
    assert lines[0].endswith(f"(see '{cmd} --help')"), lines


def test_missing_or_empty_prompt_is_one_error_line(monkeypatch):
    """Our own usage errors (no prompt, an empty one) printed click's usage block and
    'Error: ...'; they are the project's one line 'error: ...' (exit status 2 still)."""
    import click.testing

    for args, stdin, needle in ((["generate", "-m", "x.gguf"], "   ", "the prompt is empty"),
                                (["generate", "-m", "x.gguf", ""], None, "the prompt is empty"),
                                (["generate", "-m", "x.gguf"], None, "no prompt")):
        with monkeypatch.context() as mp:
            if stdin is None:  # a terminal on stdin: nothing piped
                mp.setattr(click.testing._NamedTextIOWrapper, "isatty", lambda self: True)
            r = CliRunner().invoke(cli, args, input=stdin)
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        assert r.exit_code == 2 and len(lines) == 1, (args, r.stderr)
        assert lines[0].startswith(f"error: {needle}; give a PROMPT argument"), lines


def test_backends_lists_every_backend():
    r = run(["backends"])
    assert r.exit_code == 0
    assert "torch" in r.output and "llamacpp" in r.output
    assert "auto for gguf:" in r.output
    auto = [l for l in r.output.splitlines() if l.startswith("auto for")]
    assert auto and all(l.count("(") == l.count(")") for l in auto), auto
    if not has_llamacpp():
        assert "llama-cpp-python not installed" in r.output


def test_pull_models_rm_local_file(home, tmp_path):
    from localmoe.testing.synthetic import write_gguf

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 100)
    r = run(["pull", str(bad)])
    assert r.exit_code == 1 and "error:" in r.output  # a file that could not load stays out
    src = write_gguf(tmp_path / "tiny.gguf", "tiny-llama")
    r = run(["pull", str(src)])
    assert r.exit_code == 0 and "tiny:" in r.output
    r = run(["models"])
    assert "tiny" in r.output and str(home) in r.output
    r = run(["models", "--json"])
    assert json.loads(r.output)[0]["name"] == "tiny"
    r = run(["rm", "tiny"])
    assert r.exit_code == 0 and "removed tiny" in r.output
    assert "tiny " not in run(["models"]).output


def test_rm_of_an_entry_naming_a_file_outside_the_store_frees_nothing(home, tmp_path):
    """A manifest entry edited by hand to name a file outside the store: `rm` removes the
    entry, leaves that file in place and says so; it said the file's size was freed."""
    from localmoe.io.store import format_size
    from localmoe.testing.synthetic import write_gguf

    src = write_gguf(tmp_path / "tiny.gguf", "tiny-llama")
    assert run(["pull", str(src)]).exit_code == 0
    outside = tmp_path / "elsewhere" / "outside.gguf"
    outside.parent.mkdir()
    outside.write_bytes(src.read_bytes())
    manifest = home / "models" / "manifest.json"
    data = json.loads(manifest.read_text())
    stored = home / "models" / data["tiny"]["files"][0]
    data["tiny"]["files"] = [str(outside)]
    manifest.write_text(json.dumps(data))
    r = run(["rm", "tiny"])
    assert r.exit_code == 0 and "Traceback" not in r.output
    assert r.output.strip() == (f"removed tiny (0 B freed; left in place outside the store: "
                                f"{outside})"), r.output
    assert outside.read_bytes() == src.read_bytes() and stored.exists()  # nothing deleted
    assert "tiny" not in json.loads(manifest.read_text())
    # an entry of the store's own file still frees it
    stored.unlink()
    assert run(["pull", str(src)]).exit_code == 0
    r = run(["rm", "tiny"])
    assert r.output.strip() == f"removed tiny ({format_size(src.stat().st_size)} freed)"
    assert not stored.exists()


def test_chat_and_serve_are_wired(monkeypatch, tmp_path):
    calls = {}
    fake_server = types.ModuleType("localmoe.serve.server")
    fake_server.run_server = lambda model, **kw: calls.setdefault("serve", (model, kw))
    monkeypatch.setitem(sys.modules, "localmoe.serve.server", fake_server)
    import localmoe.serve

    monkeypatch.setattr(localmoe.serve, "server", fake_server, raising=False)
    r = run(["serve", "-m", "smollm2", "--port", "9001", "--api-key", "k", "--kv-cache", "int8",
             "--kv-cache-v", "int4", "-c", "2048", "--backend", "torch"])
    assert r.exit_code == 0, r.output
    model, kw = calls["serve"]
    assert model == "smollm2"
    assert kw == dict(host="127.0.0.1", port=9001, api_key="k", backend="torch", n_ctx=2048,
                      kv_cache="int8", kv_cache_k=None, kv_cache_v="int4")
    r = CliRunner().invoke(cli, ["serve", "--kv-cache", "bogus"])
    assert r.exit_code == 2 and "bogus" in r.output
    # an empty or blank key would lock every client out (or let "Bearer " in): a usage error
    for args, env in ((["--api-key", ""], {}), (["--api-key", "  "], {}),
                      ([], {"LOCALMOE_API_KEY": "   "})):
        calls.pop("serve", None)
        r = CliRunner().invoke(cli, ["serve", "-m", "smollm2", *args], env=env)
        assert r.exit_code == 2 and "empty or blank" in r.output and "serve" not in calls, args
    r = run(["serve", "-m", "smollm2", "--api-key", " k2 "])   # spaces a client cannot send
    assert r.exit_code == 0 and calls["serve"][1]["api_key"] == "k2", r.output
    # a key an HTTP header cannot carry (non-ASCII, control characters) locked every client
    # out: curl's UTF-8 bytes never matched, the openai client raised UnicodeEncodeError
    for key in ("ключ", "k\tey", "k\x7f"):
        calls.pop("serve", None)
        r = CliRunner().invoke(cli, ["serve", "-m", "smollm2", "--api-key", key])
        assert r.exit_code == 2 and "printable ASCII" in r.output and "serve" not in calls, key

    import localmoe.tui.app as tui_app

    monkeypatch.setattr(tui_app, "list_chats_text", lambda: "CHATS-TABLE")
    monkeypatch.setattr(tui_app, "run_chat", lambda model, **kw: calls.setdefault("chat", (model, kw)))
    r = run(["chat", "--list"])
    assert r.exit_code == 0 and "CHATS-TABLE" in r.output
    r = run(["chat", "-m", str(tmp_path / "missing.gguf")])
    assert r.exit_code == 1 and "chat" not in calls  # checked before the UI opens
    from localmoe.testing.synthetic import write_gguf

    m = str(write_gguf(tmp_path / "m.gguf", "tiny-llama"))
    r = run(["chat", "-m", m, "--continue", "--kv-cache", "int4", "-c", "512"])
    assert r.exit_code == 0
    assert calls["chat"] == (m, dict(backend="auto", n_ctx=512, kv_cache="int4",
                                     continue_last=True))


def test_chat_list_and_continue_together_are_a_usage_error(monkeypatch):
    """`chat --list --continue` listed the chats and ignored --continue: a usage error now (exit
    2, one line), before the UI or the chat list is touched, in either order."""
    import localmoe.tui.app as tui_app

    calls = []
    monkeypatch.setattr(tui_app, "list_chats_text", lambda: calls.append("list") or "CHATS")
    monkeypatch.setattr(tui_app, "run_chat", lambda model, **kw: calls.append("chat"))
    for args in (["--list", "--continue"], ["--continue", "--list"]):
        r = run(["chat", *args], prog_name="localmoe")
        assert r.exit_code == 2 and not calls and not r.stdout, r.output
        assert r.stderr.strip() == (
            "error: --list and --continue cannot be combined (--list lists the saved chats and "
            "exits); give one of them (see 'localmoe chat --help')"), r.stderr


def test_chat_takes_the_kv_and_device_options_of_generate(monkeypatch, tmp_path):
    """chat has generate's --kv-cache-k/--kv-cache-v (and the comma options) and --device,
    passes them on to the engine, and refuses bad values before the UI opens."""
    import localmoe.tui.app as tui_app
    from localmoe.kv.spec import KVSpec
    from localmoe.testing.synthetic import write_gguf

    calls = []
    monkeypatch.setattr(tui_app, "run_chat", lambda model, **kw: calls.append((model, kw)))
    m = str(write_gguf(tmp_path / "m.gguf", "tiny-llama"))
    help_text = run(["chat", "--help"]).output
    for flag in ("--kv-cache-k", "--kv-cache-v", "--device", "--kv-cache"):
        assert flag in help_text
    for args, want in (
            (["--kv-cache-k", "int4", "--kv-cache-v", "int2"], KVSpec.parse("f16", "int4", "int2")),
            (["--kv-cache", "int8", "--kv-cache-v", "int4:g64"], KVSpec.parse("int8", None, "int4:g64")),
            (["--kv-cache", "int2,sinks=4,window=32"], KVSpec.parse("int2,sinks=4,window=32")),
            (["--kv-cache", "k=int8,v=int4", "--kv-cache-k", "int4:t"],
             KVSpec.parse("k=int8,v=int4", "int4:t"))):
        calls.clear()
        r = run(["chat", "-m", m, "--device", "cpu", *args])
        assert r.exit_code == 0, r.output
        (model, kw), = calls
        assert model == m and kw["device"] == "cpu"
        assert KVSpec.parse(kw["kv_cache"]) == want, (args, kw["kv_cache"])
    calls.clear()
    for args, needle, status in ((["--kv-cache-k", "int9"], "int9", 2),
                                 (["--kv-cache-v", "int4:c"], "values", 2),
                                 (["--kv-cache", "int2,sinks=-1"], "sink", 2),
                                 (["--device", "tpu"], "tpu", 2),
                                 (["--backend", "nope"], "nope", 2),
                                 (["-c", "999999"], "training context", 1),
                                 (["--kv-cache", "int4:g128"], "use ':g64' or less", 1)):
        r = CliRunner().invoke(cli, ["chat", "-m", m, *args])
        assert r.exit_code == status and needle in r.output and "Traceback" not in r.output, \
            (args, r.output)
    assert not calls  # every bad value was refused before the UI (and any weights)
    r = CliRunner().invoke(cli, ["generate", "-m", m, "--backend", "torch", "--device", "tpu", "hi"])
    assert r.exit_code == 2 and "unknown device 'tpu'" in r.output  # was a torch traceback


def test_no_cuda_graph_flag_reaches_the_triton_runner(monkeypatch, tmp_path):
    """--no-cuda-graph (every command that loads a model) turns the triton runner's decode
    graphs off through LOCALMOE_CUDA_GRAPHS, which the runner reads when it loads."""
    import localmoe.tui.app as tui_app
    from localmoe.testing.synthetic import write_gguf

    m = str(write_gguf(tmp_path / "m.gguf", "tiny-llama"))
    monkeypatch.setattr(tui_app, "run_chat", lambda model, **kw: None)
    for cmd in ("generate", "chat", "serve", "bench"):
        assert "--no-cuda-graph" in run([cmd, "--help"]).output, cmd
    monkeypatch.setenv("LOCALMOE_CUDA_GRAPHS", "1")    # restored after the test
    assert run(["chat", "-m", m, "--device", "cpu"]).exit_code == 0
    assert os.environ["LOCALMOE_CUDA_GRAPHS"] == "1"
    assert run(["chat", "-m", m, "--device", "cpu", "--no-cuda-graph"]).exit_code == 0
    assert os.environ["LOCALMOE_CUDA_GRAPHS"] == "0"


def test_missing_cuda_device_is_a_one_line_error(monkeypatch, tmp_path):
    """--device cuda:7 on a machine with 2 GPUs, or cuda without any, is one error line before
    the UI opens, the server starts or any weights load (generate, chat, serve)."""
    import torch
    import uvicorn

    import localmoe.backends.torch_backend as tb
    import localmoe.tui.app as tui_app
    import localmoe.serve.server as server
    from localmoe.testing.synthetic import write_gguf

    opened = []
    monkeypatch.setattr(tui_app, "run_chat", lambda *a, **kw: opened.append("chat"))
    monkeypatch.setattr(server, "_check_port_free", lambda *a: opened.append("serve"))
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: opened.append("uvicorn"))
    monkeypatch.setattr(tb.TorchBackend, "load", lambda *a, **kw: opened.append("weights"))
    m = str(write_gguf(tmp_path / "m.gguf", "tiny-llama"))
    for n, dev, needle in ((2, "cuda:7", "'cuda:7' does not exist: 2 CUDA devices"),
                           (0, "cuda", "no CUDA device is visible")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        for cmd in (["generate", "hi"], ["chat"], ["serve"]):
            r = run([*cmd, "-m", m, "--backend", "torch", "--device", dev])
            assert_one_line_error(types.SimpleNamespace(returncode=r.exit_code, stderr=r.stderr),
                                  needle)
    assert not opened


def test_indexed_device_strings_are_accepted(monkeypatch, tmp_path):
    """--device cpu:0 (torch's name for the CPU) was refused as an unknown device; it runs as
    cpu in generate, chat and serve and in the Python API. cpu:N past 0 and nonsense stay one
    error line before anything loads."""
    import uvicorn

    import localmoe.serve.server as server
    import localmoe.tui.app as tui_app
    from localmoe.engine.options import check_device
    from localmoe.errors import InvalidRequestError
    from localmoe.testing.synthetic import write_gguf

    assert check_device("cpu:0") == check_device(" CPU:0 ") == "cpu"
    assert check_device("cuda:1") == "cuda:1"
    for bad in ("cpu:1", "cpu:", "cpu:x", "cuda:x", "cpu0"):
        with pytest.raises(InvalidRequestError):
            check_device(bad)
    m = str(write_gguf(tmp_path / "m.gguf", "tiny-llama"))
    r = run(["generate", "-m", m, "--backend", "torch", "--device", "cpu:0", "-n", "2", "hi"])
    assert r.exit_code == 0, r.output
    opened = []
    monkeypatch.setattr(tui_app, "run_chat", lambda model, **kw: opened.append(kw["device"]))
    monkeypatch.setattr(server, "_check_port_free", lambda *a: opened.append("serve"))
    monkeypatch.setattr(uvicorn.Server, "run", lambda *a, **kw: None)
    assert run(["chat", "-m", m, "--backend", "torch", "--device", "cpu:0"]).exit_code == 0
    r = run(["serve", "-m", m, "--backend", "torch", "--device", "cpu:0"])
    assert opened == ["cpu:0", "serve"], (opened, r.output)
    opened.clear()
    for cmd in (["generate", "hi"], ["chat"], ["serve"]):
        r = run([*cmd, "-m", m, "--backend", "torch", "--device", "cpu:1"])
        assert_one_line_error(types.SimpleNamespace(returncode=r.exit_code, stderr=r.stderr),
                              "'cpu:1' does not exist")
    assert not opened


@pytest.mark.parametrize("dev", ["tpu", "cuda:abc", "cuda:", "cpu0", ""])
def test_a_malformed_device_is_a_usage_error(dev, tmp_path):
    """--device tpu / cuda:abc name no device at all: a usage error (exit status 2, as
    docs/CLI.md says of bad flag values; it exited 1) in every command with --device, before
    anything loads. Well-formed devices that are not here (cuda:7, cpu:1) stay exit status 1
    (the tests above)."""
    from localmoe.engine.options import device_syntax_error
    from localmoe.testing.synthetic import write_gguf

    assert device_syntax_error(dev) and not device_syntax_error("cuda:7")
    m = str(write_gguf(tmp_path / "m.gguf", "tiny-llama"))
    for cmd in (["generate", "hi"], ["chat"], ["serve"], ["bench"]):
        r = run([*cmd, "-m", m, "--backend", "torch", "--device", dev])
        assert_one_line_error(types.SimpleNamespace(returncode=r.exit_code, stderr=r.stderr),
                              f"Invalid value for '--device': unknown device {dev!r}",
                              status=2)


@pytest.mark.parametrize("args", [["--raw"], [], ["--system", "Be brief."]])
def test_prompt_over_the_context_is_refused_before_weights_load(monkeypatch, tmp_path, args):
    """A prompt longer than the context was reported only after the weights had loaded (the
    count needs the tokenizer, which the GGUF metadata alone gives): it is refused before, as
    a plain completion and as a chat turn (template, system message), with the count the
    generation would prefill."""
    import localmoe.backends.torch_backend as tb
    from localmoe.api import LLM
    from localmoe.testing.synthetic import write_gguf

    loads = []
    real_load = tb.TorchBackend.load
    monkeypatch.setattr(tb.TorchBackend, "load",
                        lambda self, *a, **kw: loads.append(1) or real_load(self, *a, **kw))
    m = str(write_gguf(tmp_path / "m.gguf", "tiny-llama"))
    prompt = "one two three four five six seven eight nine ten"
    r = run(["generate", "-m", m, "--backend", "torch", "-c", "8", *args, prompt])
    assert_one_line_error(types.SimpleNamespace(returncode=r.exit_code, stderr=r.stderr),
                          "context holds 8")
    assert not loads
    n = int(r.stderr.split("prompt is ")[1].split()[0])
    llm = LLM(m, backend="torch", n_ctx=64)  # the count is what generation prefills
    msgs = ([{"role": "system", "content": args[1]}] if args[1:] else []) + \
           [{"role": "user", "content": prompt}]
    assert n == len(llm.prompt_ids(prompt) if args == ["--raw"] else llm.prompt_ids(messages=msgs))
    # a prompt that fills the context exactly would end at once with nothing printed: refused
    loads.clear()
    r = run(["generate", "-m", m, "--backend", "torch", "-c", str(n), *args, prompt])
    assert_one_line_error(types.SimpleNamespace(returncode=r.exit_code, stderr=r.stderr),
                          f"fills the whole context ({n})")
    assert not loads
    # a prompt that fits still loads and runs
    loads.clear()
    r = run(["generate", "-m", m, "--backend", "torch", "-c", "256", "-n", "1", *args, prompt])
    assert r.exit_code == 0, r.output
    assert loads == [1]


@pytest.mark.slow
def test_info_real_model(smollm2_path):
    r = lm("info", str(smollm2_path))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    import re

    assert re.search(r"^architecture +llama$", out, re.M)
    assert re.search(r"^chat template +yes$", out, re.M)
    assert "none (dense)" in out
    for fmt in ("f16", "int8", "int4", "int2"):
        assert f"  {fmt} " in out
    r = lm("info", "--json", str(smollm2_path))
    d = json.loads(r.stdout)
    assert d["architecture"] == "llama" and d["n_experts"] == 0
    assert 100e6 < d["params_total"] < 200e6 and d["params_active"] == d["params_total"]
    kv = d["kv_bytes_per_token"]
    # SmolLM2-135M: 30 layers x 3 kv heads x 64 dims x (K+V) x 2 bytes = 23040 B/token in f16
    assert kv["f16"] == 30 * 3 * 64 * 2 * 2
    assert kv["int4"] < kv["int8"] < kv["f16"]
    assert "Q4_1" in d["quant_mix"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", pytest.param("llamacpp", marks=pytest.mark.llamacpp)])
def test_generate_end_to_end(smollm2_path, backend):
    n = "2" if backend == "torch" else "4"
    r = lm("generate", "-m", str(smollm2_path), "--backend", backend, "--greedy", "-n", n,
           "--json", "Why is the sky blue?")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["backend"] == backend and d["completion_tokens"] >= 1 and d["text"].strip()
    assert d["finish_reason"] in ("length", "stop")
    assert d["timings"]["ttft_ms"] > 0
    if backend == "torch":
        return  # the rest is backend-independent CLI behaviour; the torch reference is slow
    # streamed plain text from stdin, raw completion
    r2 = lm("generate", "-m", str(smollm2_path), "--backend", backend, "--greedy", "-n", "4",
            "--raw", stdin="The capital of France is")
    assert r2.returncode == 0, r2.stderr
    assert r2.stdout.strip() and "Traceback" not in r2.stderr
    # prompt over the context: a user error with both numbers
    r3 = lm("generate", "-m", str(smollm2_path), "--backend", backend, "-c", "8",
            "one two three four five six seven eight nine ten eleven twelve")
    assert_one_line_error(r3, "context holds 8")


@pytest.mark.slow
@pytest.mark.llamacpp
def test_ctrl_c_stops_cleanly(smollm2_path):
    p = subprocess.Popen([sys.executable, "-m", "localmoe", "generate", "-m", str(smollm2_path),
                          "--backend", "llamacpp", "--raw", "-n", "2000", "Once upon a time"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = p.stdout.read(1)  # generation has started
        assert first
        time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err


def test_undecodable_prompt_bytes_are_a_one_line_error(smollm2_path):
    """A prompt with bytes that are not UTF-8 (argv and stdin) exits 1 with one error line."""
    r = subprocess.run([sys.executable, "-m", "localmoe", "generate", "-m", str(smollm2_path),
                        "--backend", "torch", "--raw", "-n", "2", b"caf\xe9"],
                       capture_output=True, timeout=300)
    r.stderr = r.stderr.decode("utf-8", "replace")
    assert_one_line_error(r, "the prompt is not valid UTF-8")
    r = subprocess.run([sys.executable, "-m", "localmoe", "generate", "-m", str(smollm2_path),
                        "--backend", "torch", "-n", "2"], input=b"\xff\xfe hello",
                       capture_output=True, timeout=300)
    r.stderr = r.stderr.decode("utf-8", "replace")
    assert_one_line_error(r, "the prompt is not valid UTF-8")
    # the same bytes in --system or --stop: refused before the weights load, naming the option
    for flag, want in (("--system", "--system is not valid UTF-8"),
                       ("--stop", "is not valid UTF-8")):
        r = subprocess.run([sys.executable, "-m", "localmoe", "generate", "-m", str(smollm2_path),
                            "--backend", "torch", "-n", "2", flag, b"caf\xe9", "hello"],
                           capture_output=True, timeout=300)
        r.stderr = r.stderr.decode("utf-8", "replace")
        assert_one_line_error(r, want)
        assert flag in r.stderr


def test_ctrl_c_during_start_up_exits_130_without_a_traceback(smollm2_path):
    """Ctrl-C while the CLI imports torch and loads the model (no generation yet) exits at once
    with 130 and one 'interrupted' line, at any moment of the start-up."""
    for delay in (0.3, 0.8, 1.5):
        p = subprocess.Popen([sys.executable, "-m", "localmoe", "generate", "-m",
                              str(smollm2_path), "--backend", "torch", "-n", "400", "hi"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(delay)
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
        if p.returncode == 0:  # finished before the signal (a very fast box): nothing to test
            continue
        assert p.returncode == 130, (delay, err)
        assert "interrupted" in err and "Traceback" not in err and "terminate" not in err, err


_SIGINT_WHILE_LOADING = """
import os, signal, sys, time
import localmoe.api as api
real_open = api.LLM._open
def _open(model):  # Ctrl-C as the model is being opened: the start-up phase's handler runs
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)
    return real_open(model)
api.LLM._open = staticmethod(_open)
from localmoe.cli import main
main(sys.argv[1:])
"""


def test_ctrl_c_while_loading_with_json_prints_a_cancelled_object(tmp_path, monkeypatch):
    """`generate --json` interrupted while the model loads printed nothing on stdout (only
    'interrupted' on stderr): a script got no JSON to read. It prints the object of a
    cancelled run (finish_reason "cancelled", no text yet; what the load would have told is
    null) and exits 130, in a real process (the start-up phase's SIGINT handler) and when
    the KeyboardInterrupt is raised in-process."""
    from localmoe.testing.synthetic import write_gguf

    m = str(write_gguf(tmp_path / "m.gguf", "tiny-qwen3moe"))
    r = subprocess.run([sys.executable, "-c", _SIGINT_WHILE_LOADING, "generate", "-m", m,
                        "--backend", "torch", "--json", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 130, r.stderr
    assert "interrupted" in r.stderr and "Traceback" not in r.stderr, r.stderr
    want = {"model": "m", "backend": None, "n_ctx": None, "kv_cache": None, "text": "",
            "finish_reason": "cancelled"}
    assert [json.loads(l) for l in r.stdout.splitlines()] == [want], r.stdout
    # in-process (no start-up handler): the KeyboardInterrupt out of the load
    import localmoe.api

    def interrupted(model):
        raise KeyboardInterrupt
    monkeypatch.setattr(localmoe.api.LLM, "_open", staticmethod(interrupted))
    r = run(["generate", "-m", m, "--backend", "torch", "--json", "hi"])
    assert r.exit_code == 130 and [json.loads(l) for l in r.stdout.splitlines()] == [want], \
        r.output
    r = run(["generate", "-m", m, "--backend", "torch", "hi"])  # no --json: no JSON
    assert r.exit_code == 130 and r.stdout == "", r.output


_SIGTERM_DURING = """
import os, signal, sys, time
import localmoe.api as api
import localmoe.cli.generate as g
when = sys.argv.pop(1)
if when == "loading":  # SIGTERM as the model is being opened (the start-up phase)
    real_open = api.LLM._open
    def _open(model):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        return real_open(model)
    api.LLM._open = staticmethod(_open)
else:  # SIGTERM once some text was generated
    real_stream = g._stream
    def _stream(llm, events, as_json):
        def first_then_sigterm():
            try:
                for ev in events:
                    yield ev
                    if not ev.done:
                        print("DELTA " + repr(ev.delta), file=sys.stderr, flush=True)
                        os.kill(os.getpid(), signal.SIGTERM)
                        time.sleep(30)
            finally:
                events.close()
        return real_stream(llm, first_then_sigterm(), as_json)
    g._stream = _stream
from localmoe.cli import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize("when", ["loading", "generating"])
@pytest.mark.parametrize("as_json", [True, False])
def test_sigterm_stops_generate_as_ctrl_c_does_with_status_143(tmp_path, when, as_json):
    """`timeout 5 localmoe generate ...` (SIGTERM) exited 143 with nothing said and, with
    --json, nothing on stdout: the text generated so far was lost. SIGTERM now does what
    Ctrl-C does (the text so far; --json: the "cancelled" object) with 'terminated' on stderr
    and status 143 (128 + 15), while the model loads and while it generates."""
    from localmoe.testing.synthetic import write_gguf

    m = str(write_gguf(tmp_path / "m.gguf", "tiny-qwen3moe"))
    r = subprocess.run([sys.executable, "-c", _SIGTERM_DURING, when, "generate", "-m", m,
                        "--backend", "torch", "--raw", "--greedy", "-n", "200", "hi"]
                       + (["--json"] if as_json else []),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 143, r.stderr
    assert "terminated" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "interrupted" not in r.stderr, r.stderr
    delta = ""
    if when == "generating":
        deltas = [l for l in r.stderr.splitlines() if l.startswith("DELTA ")]
        assert len(deltas) == 1, r.stderr
        delta = eval(deltas[0][len("DELTA "):])
    if not as_json:
        assert r.stdout in (delta, delta + "\n"), (r.stdout, delta)
        return
    objs = [json.loads(l) for l in r.stdout.splitlines()]
    assert len(objs) == 1, r.stdout
    d = objs[0]
    assert d["finish_reason"] == "cancelled" and d["text"] == delta and d["model"] == "m", d
    if when == "loading":
        assert d["backend"] is None and d["n_ctx"] is None, d
    else:
        assert d["backend"] == "torch" and d["n_ctx"], d


def test_sigterm_handler_is_restored_and_ctrl_c_keeps_130(tmp_path, monkeypatch):
    """In-process (CliRunner, the main thread): a command that ends leaves SIGTERM's handler as
    it was, and a Ctrl-C after a SIGTERM'd run is still 'interrupted' / 130."""
    from localmoe.testing.synthetic import write_gguf

    m = str(write_gguf(tmp_path / "m.gguf", "tiny-qwen3moe"))
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as in a fresh `localmoe` process
    try:
        _sigterm_in_process(m, monkeypatch)
    finally:
        signal.signal(signal.SIGTERM, before)


def _sigterm_in_process(m, monkeypatch):
    import localmoe.api

    def terminated(model):  # what a SIGTERM delivered now runs (never os.kill: pytest's own)
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler), handler
        handler(signal.SIGTERM, None)
        raise AssertionError("SIGTERM did not stop the load")
    monkeypatch.setattr(localmoe.api.LLM, "_open", staticmethod(terminated))
    r = run(["generate", "-m", m, "--backend", "torch", "--json", "hi"])
    assert r.exit_code == 143 and "terminated" in r.stderr, r.output
    assert json.loads(r.stdout)["finish_reason"] == "cancelled", r.output
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL

    def interrupted(model):
        raise KeyboardInterrupt
    monkeypatch.setattr(localmoe.api.LLM, "_open", staticmethod(interrupted))
    r = run(["generate", "-m", m, "--backend", "torch", "hi"])
    assert r.exit_code == 130 and "interrupted" in r.stderr, r.output
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


@pytest.mark.slow
@pytest.mark.llamacpp
def test_kv_cache_flags_on_llamacpp(smollm2_path):
    r = lm("generate", "-m", str(smollm2_path), "--backend", "llamacpp", "--kv-cache", "int2",
           "hi")
    assert_one_line_error(r, "int2")
    r = lm("generate", "-m", str(smollm2_path), "--backend", "llamacpp", "--kv-cache-k", "int8",
           "--kv-cache-v", "int4", "--greedy", "-n", "3", "--json", "hi")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["kv_cache"] == "k=int8,v=int4"


def test_info_moe_counts_active_params(tmp_path):
    """Synthetic tiny Qwen3-MoE: experts reported, active = dense + top_k/n_experts of experts."""
    from localmoe.cli import model_info
    from localmoe.io.loader import open_model
    from localmoe.testing.synthetic import write_gguf

    p = write_gguf(tmp_path / "tiny-qwen3moe.gguf", "tiny-qwen3moe", quant="mixed")
    d = model_info(open_model(p))
    assert d["architecture"] == "qwen3moe" and d["n_experts"] == 8 and d["top_k"] == 2
    mf = open_model(p)
    expert = 0
    for n in mf.tensor_names():
        if "_exps." in n:
            e = 1
            for s in mf.tensor_info(n).shape:
                e *= s
            expert += e
    assert expert > 0
    assert d["params_active"] == d["params_total"] - expert + expert * 2 // 8
    assert d["chat_template"] is True
    r = run(["info", str(p)])
    assert r.exit_code == 0 and "8 experts, top-2" in r.output


def test_info_names_the_model_as_the_other_commands_do(tmp_path):
    """`info` showed the file's general.name ("synthetic tiny-qwen3moe", "Smollm2 135M 8k
    Lc100K Mix1 Ep2") as the model, a name no command takes and none reports: the model row
    is the name generate --json and serve report (the file name without .gguf, or the store
    name given), and the file's own name has a row of its own (JSON: "model" and "name")."""
    import re

    from localmoe.testing.synthetic import write_gguf

    p = write_gguf(tmp_path / "m.gguf", "tiny-qwen3moe")
    r = run(["info", str(p)])
    assert r.exit_code == 0, r.output
    assert re.search(rf"^model +m  \({re.escape(str(p))}\)$", r.output, re.M), r.output
    assert re.search(r"^name in file +synthetic tiny-qwen3moe$", r.output, re.M), r.output
    d = json.loads(run(["info", "--json", str(p)]).output)
    assert d["model"] == "m" and d["name"] == "synthetic tiny-qwen3moe"
    g = json.loads(run(["generate", "-m", str(p), "--backend", "torch", "--json", "-n", "1",
                        "hi"]).stdout)
    assert g["model"] == d["model"]


def test_info_shows_both_key_groupings(tmp_path):
    """`info` lists per-channel (the int4/int3/int2 default) and per-token keys side by side."""
    import re

    from localmoe.cli import model_info
    from localmoe.kv.spec import KVSpec
    from localmoe.io.loader import open_model
    from localmoe.testing.synthetic import write_gguf

    p = write_gguf(tmp_path / "t.gguf", "tiny-llama")
    spec = open_model(p).spec
    d = model_info(open_model(p))
    kv, grouping = d["kv_bytes_per_token"], d["kv_key_grouping"]
    for name in ("int4", "int3", "int2"):
        assert grouping[name] == "channel" and grouping[f"{name}:t"] == "token"
        assert kv[name] == KVSpec.parse(f"{name}:c").bytes_per_token(spec)
        assert kv[f"{name}:t"] == KVSpec.parse(f"{name}:t").bytes_per_token(spec) != kv[name]
    assert grouping["int8"] == "token" and grouping["int8:c"] == "channel"
    assert grouping["f16"] is None
    r = run(["info", str(p)])
    assert r.exit_code == 0
    for name, keys in (("int4", "per channel"), ("int4:t", "per token"), ("int8", "per token"),
                       ("int8:c", "per channel"), ("int2:t", "per token"), ("f16", "-")):
        b = kv[name]
        assert re.search(rf"^  {re.escape(name)} +{keys} +{b:,.0f} ", r.output, re.M), (name, r.output)
    assert f"{d['n_ctx_default']} tok" in r.output
    # the tiny file's training context is the default context: one size column, not two
    assert d["context"] == d["n_ctx_default"]
    header = next(line for line in r.output.splitlines() if "bytes/token" in line)
    assert header.count(" tok") == 1, header
    assert json.loads(run(["info", "--json", str(p)]).output)["kv_bytes_per_token"]["int4:t"] == kv["int4:t"]


def test_stdin_prompt_loses_its_trailing_newline(monkeypatch):
    import localmoe.cli.options as cli_options

    seen = {}

    class StopHere(Exception):
        pass

    class FakeLLM:
        template = None

        def generate(self, prompt, **kw):
            seen["prompt"] = prompt
            raise StopHere

        def close(self):
            pass

    monkeypatch.setattr(cli_options, "load_llm", lambda *a, **k: FakeLLM())
    r = CliRunner().invoke(cli, ["generate", "-m", "x.gguf", "--raw"], input="Hello there\n\n")
    assert isinstance(r.exception, StopHere)
    assert seen["prompt"] == "Hello there"


def test_piped_stdin_beside_a_prompt_argument_gets_a_note(tmp_path):
    """`echo hi | localmoe generate x` answered x and dropped the piped text without a word:
    one `note:` line on stderr says so (exit status 0 still). Nothing is read from stdin to
    find out and nothing waits on it: an empty pipe and a pipe whose writer is still open with
    nothing written get no note."""
    from localmoe.testing.synthetic import write_gguf

    m = str(write_gguf(tmp_path / "m.gguf", "tiny-llama"))
    note = ("note: the piped stdin was ignored because a PROMPT argument was given (give '-' "
            "as the PROMPT to read the prompt from stdin)")
    (tmp_path / "in.txt").write_text("from a file\n")

    def gen(stdin):
        return subprocess.run([sys.executable, "-m", "localmoe", "generate", "-m", m,
                               "--backend", "torch", "-n", "1", "--greedy", "x"],
                              stdin=stdin, capture_output=True, text=True, timeout=120)

    def pipe(data: bytes | None):   # written (and closed, unless None) before the command runs
        r, w = os.pipe()
        if data is not None:
            os.write(w, data)
            os.close(w)
        return r, w

    r_fd, _ = pipe(b"piped text\n")
    with open(tmp_path / "in.txt") as f:
        for stdin in (r_fd, f):
            r = gen(stdin)
            assert r.returncode == 0, r.stderr
            assert [l for l in r.stderr.splitlines() if l.startswith("note:")] == [note], r.stderr
    os.close(r_fd)
    empty, _ = pipe(b"")
    waiting, w = pipe(None)
    try:
        for stdin in (empty, waiting):
            r = gen(stdin)
            assert r.returncode == 0 and "stdin" not in r.stderr, (stdin, r.stderr)
    finally:
        for fd in (empty, waiting, w):
            os.close(fd)


def test_system_without_chat_template_warns_and_uses_the_transcript(monkeypatch):
    """--system on a model without a chat template: a clear warning and the same plain
    System:/User:/Assistant: transcript chat and serve use (no longer silently glued on)."""
    import localmoe.cli.options as cli_options
    from localmoe.api import LLM
    from tests.engine.test_engine import BYTE0, FakeRunner, FakeTokenizer

    seen = {}
    llm = LLM.from_parts(FakeRunner(chain={}, default_next=9), FakeTokenizer(), model_name="base")
    orig = llm.render_chat
    llm.render_chat = lambda msgs, tools=None: seen.setdefault("prompt", orig(msgs, tools))
    monkeypatch.setattr(cli_options, "load_llm", lambda *a, **k: llm)
    r = CliRunner().invoke(cli, ["generate", "-m", "x.gguf", "--system", "Be brief.", "-n", "2",
                                 "Hi"])
    assert r.exit_code == 0, r.output
    assert seen["prompt"] == "System: Be brief.\nUser: Hi\nAssistant:"
    assert "warning: base has no chat template" in r.stderr and "--system" in r.stderr
    assert r.stdout == " the the\n"
    # without --system it stays a plain completion, with a one-line note saying so
    seen.clear()
    llm2 = LLM.from_parts(FakeRunner(chain={}, default_next=9), FakeTokenizer(), model_name="b")
    monkeypatch.setattr(cli_options, "load_llm", lambda *a, **k: llm2)
    r = CliRunner().invoke(cli, ["generate", "-m", "x.gguf", "-n", "1", "Hi"])
    assert r.exit_code == 0 and "warning" not in r.stderr
    assert r.stderr == "note: b has no chat template; the prompt is completed as plain text " \
        "(as with --raw)\n"
    assert llm2.runner.calls[0][1] == [0, BYTE0 + ord("H"), BYTE0 + ord("i")]
    # --raw: asked for, so no note
    llm3 = LLM.from_parts(FakeRunner(chain={}, default_next=9), FakeTokenizer(), model_name="c")
    monkeypatch.setattr(cli_options, "load_llm", lambda *a, **k: llm3)
    r = CliRunner().invoke(cli, ["generate", "-m", "x.gguf", "--raw", "-n", "1", "Hi"])
    assert r.exit_code == 0 and r.stderr == ""
    # --raw --system: the system text is not silently lost
    r = CliRunner().invoke(cli, ["generate", "-m", "x.gguf", "--raw", "--system", "S", "-n", "1",
                                 "Hi"])
    assert "warning: --system is ignored with --raw" in r.stderr


def test_bench_refuses_unwritable_json_path_before_loading(tmp_path, monkeypatch):
    import localmoe.cli.options as cli_options

    monkeypatch.setattr(cli_options, "load_llm", lambda *a, **k: pytest.fail("loaded the model"))
    r = CliRunner().invoke(cli, ["bench", "-m", "x.gguf", "--json",
                                 str(tmp_path / "missing-dir" / "x.json")])
    assert r.exit_code == 1 and "cannot write" in r.output and "Traceback" not in r.output


def test_bench_refuses_an_empty_or_read_only_json_file_before_loading(tmp_path, monkeypatch):
    """``--json ''`` is a usage error (it was ignored: no JSON, exit 0); an existing file that
    cannot be opened for writing is refused before the benchmark, not after it."""
    import localmoe.cli.options as cli_options

    monkeypatch.setattr(cli_options, "load_llm", lambda *a, **k: pytest.fail("loaded the model"))
    r = CliRunner().invoke(cli, ["bench", "-m", "x.gguf", "--json", ""])
    assert r.exit_code == 2 and "--json needs a file name" in r.output
    import localmoe.cli.bench as bench_mod

    ro = tmp_path / "ro.json"
    ro.write_text("keep")

    def refusing(modes: str, err: OSError):   # open() failing for the given modes
        def fake(path, mode="r", *a, **k):
            if any(c in mode for c in modes):
                raise err
            return open(path, mode, *a, **k)
        return fake

    # as a read-only or immutable file does (root too)
    monkeypatch.setattr(bench_mod, "open", refusing("+w", PermissionError(13, "Permission denied")),
                        raising=False)
    r = CliRunner().invoke(cli, ["bench", "-m", "x.gguf", "--json", str(ro)])
    assert r.exit_code == 1 and "cannot write" in r.output and "Permission denied" in r.output
    assert ro.read_text() == "keep"
    # a new file where the folder's mode says yes but creating fails (/proc as root, a
    # read-only mount): refused before the benchmark, nothing left behind
    new = tmp_path / "new.json"
    monkeypatch.setattr(bench_mod, "open", refusing("xw", OSError(30, "Read-only file system")),
                        raising=False)
    r = CliRunner().invoke(cli, ["bench", "-m", "x.gguf", "--json", str(new)])
    assert r.exit_code == 1 and "cannot write" in r.output and "Read-only" in r.output
    assert not new.exists()
    monkeypatch.setattr(bench_mod, "open", open, raising=False)

    def stop(*a, **k):
        raise RuntimeError("reached the load")

    monkeypatch.setattr(cli_options, "load_llm", stop)
    r = CliRunner().invoke(cli, ["bench", "-m", "x.gguf", "--json", str(new)])
    assert isinstance(r.exception, RuntimeError) and not new.exists()   # checked, removed


def test_bench_refuses_an_existing_file_that_takes_no_data_before_loading(tmp_path, monkeypatch):
    """An existing file that opens for writing but refuses the data (/proc/version as root:
    Input/output error on write) failed only after the whole benchmark; it is one error line
    up front. A regular file checked so is left as it was."""
    import io

    import localmoe.cli.bench as bench_mod
    import localmoe.cli.options as cli_options

    monkeypatch.setattr(cli_options, "load_llm", lambda *a, **k: pytest.fail("loaded the model"))
    r = run(["bench", "-m", "x.gguf", "--json", "/proc/version"])   # root or not, on Linux
    if os.path.exists("/proc/version"):
        assert_one_line_error(types.SimpleNamespace(returncode=r.exit_code, stderr=r.stderr),
                              "cannot write /proc/version")

    class NoData(io.RawIOBase):   # as a /proc file opened by root
        def writable(self):
            return True

        def write(self, b):
            raise OSError(5, "Input/output error")

    def fake(path, mode="r", *a, **k):
        return NoData() if "+" in mode or "w" in mode else open(path, mode, *a, **k)

    f = tmp_path / "taken.json"
    f.write_text("keep")
    monkeypatch.setattr(bench_mod, "open", fake, raising=False)
    r = run(["bench", "-m", "x.gguf", "--json", str(f)])
    assert_one_line_error(types.SimpleNamespace(returncode=r.exit_code, stderr=r.stderr),
                          f"cannot write {f}: Input/output error")
    monkeypatch.setattr(bench_mod, "open", open, raising=False)
    mtime = f.stat().st_mtime_ns

    def stop(*a, **k):
        raise RuntimeError("reached the load")

    monkeypatch.setattr(cli_options, "load_llm", stop)
    r = CliRunner().invoke(cli, ["bench", "-m", "x.gguf", "--json", str(f)])
    assert isinstance(r.exception, RuntimeError)   # a writable file passes the check ...
    assert f.read_text() == "keep" and f.stat().st_mtime_ns == mtime   # ... untouched


def test_bench_over_the_context_is_refused_before_the_weights_load(tmp_path, monkeypatch):
    """-p + -n past the context: one error line with the numbers, and no backend ever loads."""
    from localmoe.backends import torch_backend
    from localmoe.testing.synthetic import write_gguf

    path = write_gguf(tmp_path / "t.gguf", "tiny-llama")
    monkeypatch.setattr(torch_backend.TorchBackend, "load",
                        lambda *a, **k: pytest.fail("loaded the weights"))
    r = CliRunner().invoke(cli, ["bench", "-m", str(path), "--backend", "torch", "-c", "64",
                                 "-p", "60", "-n", "8"])
    assert r.exit_code == 1, r.output
    assert "prompt 60 + 8 tokens exceed the context 64" in r.output
    assert "Traceback" not in r.output


def test_bench_json_dash_puts_the_json_on_stdout(tmp_path):
    """``bench --json -``: one JSON object on stdout (the table goes to stderr), no file."""
    from localmoe.testing.synthetic import write_gguf

    path = write_gguf(tmp_path / "t.gguf", "tiny-llama")
    r = CliRunner().invoke(cli, ["bench", "-m", str(path), "--backend", "torch", "-p", "4",
                                 "-n", "2", "-r", "1", "-t", "1", "--json", "-"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["prompt_tokens"] == 4 and d["gen_tokens"] == 2
    assert "tpot_ms_median" in r.stderr and not (tmp_path / "-").exists()


def test_info_takes_the_model_as_an_argument_or_with_m(tmp_path):
    from localmoe.testing.synthetic import write_gguf

    path = write_gguf(tmp_path / "t.gguf", "tiny-llama")
    a, b = run(["info", "--json", str(path)]), run(["info", "--json", "-m", str(path)])
    assert a.exit_code == b.exit_code == 0 and json.loads(a.output) == json.loads(b.output)
    for args, needle in ((["info"], "give the model"), (["info", "x", "-m", "y"], "two models")):
        r = run(args, prog_name="localmoe")
        assert r.exit_code == 2 and needle in r.stderr and "localmoe info --help" in r.stderr


def test_an_option_missing_its_value_names_the_commands_help():
    """click raises "requires an argument" without a context: the line still names the
    command whose flag it is, as other usage errors do."""
    for cmd, flag in (("generate", "--top-k"), ("bench", "--json")):
        r = run([cmd, flag], prog_name="localmoe")
        assert r.exit_code == 2, r.output
        assert f"requires an argument. (see 'localmoe {cmd} --help')" in r.stderr, r.stderr


def test_unknown_backend_is_a_usage_error_listing_auto_too(tmp_path):
    """A name no backend is registered under was exit status 1 (an error of the load); it is
    a usage error (exit 2, as `--device tpu` and `--kv-cache int7`) of every command with
    --backend, refused before anything loads or listens, naming the valid names."""
    from localmoe.testing.synthetic import write_gguf

    path = write_gguf(tmp_path / "t.gguf", "tiny-llama")
    for args in (["generate", "-m", str(path), "--backend", "foo", "hi"],
                 ["chat", "-m", str(path), "--backend", "foo"],
                 ["serve", "-m", str(path), "--backend", "foo"],
                 ["bench", "-m", str(path), "--backend", "foo"]):
        r = run(args, prog_name="localmoe")
        assert r.exit_code == 2, (args, r.output)
        # (the list goes on with backends other tests register, e.g. the server's scripted one)
        err = r.stderr.strip()
        assert err.startswith(
            "error: Invalid value for '--backend': unknown backend 'foo'; choose one of: auto, "
            "triton, llamacpp, torch") and err.endswith(f"(see 'localmoe {args[0]} --help')"), err


def test_backend_names_ignore_case_and_greedy_refuses_a_temperature(tmp_path):
    from localmoe.testing.synthetic import write_gguf

    path = write_gguf(tmp_path / "t.gguf", "tiny-llama")
    r = CliRunner().invoke(cli, ["generate", "-m", str(path), "--backend", "TORCH", "-n", "2",
                                 "--greedy", "hi"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["generate", "-m", str(path), "--backend", "torch", "--greedy",
                                 "--temperature", "0.7", "hi"])
    assert r.exit_code == 2 and "--greedy and --temperature 0.7 contradict" in r.output
    r = CliRunner().invoke(cli, ["generate", "-m", str(path), "--backend", "torch", "--greedy",
                                 "--temperature", "0", "-n", "2", "hi"])
    assert r.exit_code == 0, r.output
    # --seed -1 is llama.cpp's "a fresh seed": no seed reaches the sampler
    from localmoe.cli.options import sampling_kwargs

    assert "seed" not in sampling_kwargs({"seed": -1}) and sampling_kwargs({"seed": 7})["seed"] == 7
    # a sampling value out of range names the flag as well as the API's parameter
    r = CliRunner().invoke(cli, ["generate", "-m", str(path), "--backend", "torch", "--top-p",
                                 "2", "hi"])
    assert r.exit_code == 2 and "'--top-p': top_p must be <= 1.0, got 2" in r.output, r.output


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["backends"], ["--help"], ["models"]])
def test_output_to_a_full_disk_is_one_error_line(args, tmp_path):
    """`localmoe ... > /dev/full` (no space left) prints one error line, no traceback."""
    env = dict(os.environ, LOCALMOE_HOME=str(tmp_path / "home"))
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "localmoe", *args], stdout=full,
                           stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == ["error: cannot write the output: No space left on device"]


def test_generate_with_stdout_closed_is_refused_before_loading(tmp_path):
    """`localmoe generate ... >&-` says stdout is closed (exit 1) instead of a traceback after
    the model loaded."""
    env = dict(os.environ, LOCALMOE_HOME=str(tmp_path / "home"))
    r = subprocess.run([sys.executable, "-c",
                        "import os, sys; os.close(1); sys.stdout = None; "
                        "from localmoe.cli import main; main(['generate', '-n', '2', 'hi'])"],
                       stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "error: standard output is closed: there is nowhere to write the answer"]
    assert not (tmp_path / "home" / "models").exists()  # nothing was pulled or loaded


def test_commands_run_with_stderr_closed(tmp_path):
    """`exec 2>&-; localmoe ...`: Python starts with sys.stderr None. The commands still run
    (they exited 1 with no output: sys.stderr.isatty() in the store), and what they would
    have said on stderr is dropped, never written on stdout instead (print(file=None) and
    click.echo(file=None) mean stdout)."""
    from localmoe.testing.synthetic import write_gguf

    tiny = str(write_gguf(tmp_path / "tinymodel.gguf", "tiny-llama"))
    env = dict(os.environ, LOCALMOE_HOME=str(tmp_path / "home"))

    def lm_no_stderr(*args):
        return subprocess.run([sys.executable, "-m", "localmoe", *args], stdout=subprocess.PIPE,
                              text=True, env=env, timeout=300, preexec_fn=lambda: os.close(2))

    r = lm_no_stderr("info", tiny)
    assert r.returncode == 0 and "architecture   llama" in r.stdout, r.stdout
    r = lm_no_stderr("generate", "-m", tiny, "--backend", "torch", "-n", "3", "--raw", "hi")
    assert r.returncode == 0 and r.stdout.strip(), r.stdout
    r = lm_no_stderr("pull", tiny)
    assert r.returncode == 0 and r.stdout.startswith("tinymodel: "), r.stdout
    r = lm_no_stderr("models")
    assert r.returncode == 0 and "tinymodel" in r.stdout, r.stdout
    # errors keep their exit status and stay off stdout
    for args, status in ((["info", "no-such-model"], 1), (["generate", "-m", tiny, ""], 2),
                         (["generate", "--bogus"], 2)):
        r = lm_no_stderr(*args)
        assert (r.returncode, r.stdout) == (status, ""), (args, r.returncode, r.stdout)


def test_generate_json_schema_and_json_object(smollm2_path, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"answer": {"type": "integer"},
                                               "sure": {"type": "boolean"}},
              "required": ["answer", "sure"]}
    f = tmp_path / "schema.json"
    f.write_text(json.dumps(schema))
    r = lm("generate", "-m", str(smollm2_path), "--json-schema", str(f), "-n", "40", "--seed",
           "1", "What is 2+2? Answer as JSON.")
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), schema)
    r = lm("generate", "-m", str(smollm2_path), "--json-object", "--json", "-n", "60",
           "--greedy", "Describe a cat.")
    d = json.loads(r.stdout)
    assert d["text"].startswith("{")
    if d["finish_reason"] == "stop":
        assert isinstance(json.loads(d["text"]), dict)


def test_generate_json_cut_by_max_tokens_warns(smollm2_path):
    """A constrained answer cut at -n is invalid JSON: it was printed with exit 0 and no
    word; stdout keeps it as is and one warning line goes to stderr."""
    schema = '{"type": "object", "properties": {"description": {"type": "string"}}, ' \
             '"required": ["description"]}'  # more than 3 tokens at the least
    r = lm("generate", "-m", str(smollm2_path), "--json-schema", schema, "-n", "3", "--greedy",
           "Describe a cat.")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("{")
    assert ("warning: the answer was cut at --max-tokens (3); the JSON is incomplete"
            in r.stderr.splitlines()), r.stderr


def test_generate_bad_json_schema_is_one_error_line_before_loading(tmp_path):
    """A schema that is not JSON or not a usable JSON Schema, inline or in FILE, is a malformed
    flag: a usage error (exit 2, `Invalid value for '--json-schema'`; it was exit 1), checked
    before the model (the grammar engine compiles it without the tokenizer). A FILE that
    cannot be read stays exit 1, as a missing model file is."""
    missing_model = str(tmp_path / "missing.gguf")  # the schema is checked before the model
    flag = "Invalid value for '--json-schema'"
    r = run(["generate", "-m", missing_model, "--json-schema", '{"type": "array", '
             '"uniqueItems": true}', "hi"])
    assert_one_line_error(types.SimpleNamespace(returncode=r.exit_code, stderr=r.stderr),
                          flag, '"uniqueItems"', status=2)
    r = run(["generate", "-m", missing_model, "--json-schema", str(tmp_path / "nope.json"), "hi"])
    assert_one_line_error(types.SimpleNamespace(returncode=r.exit_code, stderr=r.stderr),
                          "cannot read the JSON schema", "nope.json")
    r = run(["generate", "-m", missing_model, "--json-schema", " ", "hi"])
    assert_one_line_error(types.SimpleNamespace(returncode=r.exit_code, stderr=r.stderr),
                          flag, "is empty", status=2)
    (tmp_path / "bad.json").write_text("{not json")
    r = run(["generate", "-m", missing_model, "--json-schema", str(tmp_path / "bad.json"), "hi"])
    assert_one_line_error(types.SimpleNamespace(returncode=r.exit_code, stderr=r.stderr),
                          flag, "not valid JSON", "bad.json", status=2)
    for schema, needle in (("{bad", "the schema is not valid JSON"),
                           ('{"type":"wat"}', 'unknown type "wat"')):
        r = run(["generate", "-m", missing_model, "--json-schema", schema, "hi"])
        assert_one_line_error(types.SimpleNamespace(returncode=r.exit_code, stderr=r.stderr),
                              flag, needle, status=2)
    r = run(["generate", "-m", missing_model, "--json-object", "--json-schema", "{}", "hi"])
    assert r.exit_code == 2 and "not both" in r.stderr


@pytest.mark.parametrize("schema,needle", [
    ("[1,2]", "the schema must be a JSON object"),  # was "No such file or directory"
    ("42", "the schema must be a JSON object"),
    ('{"type":"string","pattern":"(("}', "regex parse error: unclosed group")])
def test_generate_json_schema_errors_are_one_line(tmp_path, schema, needle):
    r = run(["generate", "-m", str(tmp_path / "missing.gguf"), "--json-schema", schema, "hi"])
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Invalid value for '--json-schema'" in lines[0], lines
    assert needle in lines[0] and "No such file" not in lines[0], lines


def test_generate_cut_by_a_full_context_says_so(tmp_path):
    """Generation that stops because the context is full (not at -n) printed the cut answer
    with no word on the terminal (only --json's finish_reason told): one note on stderr names
    the context size; stdout keeps the text, exit 0. Stopping at -n adds no note."""
    from localmoe.testing.synthetic import write_gguf

    m = str(write_gguf(tmp_path / "m.gguf", "tiny-llama"))
    r = run(["generate", "-m", m, "--backend", "torch", "-c", "12", "-n", "50", "--raw",
             "--seed", "1", "one two three"])
    assert r.exit_code == 0, r.output
    notes = [ln for ln in r.stderr.splitlines() if "is full" in ln]
    assert len(notes) == 1 and "context (12 tokens)" in notes[0] and "--ctx-size" in notes[0], \
        r.stderr
    r = run(["generate", "-m", m, "--backend", "torch", "-c", "64", "-n", "2", "--raw",
             "--seed", "1", "one two three"])
    assert r.exit_code == 0, r.output
    assert "is full" not in r.stderr


def test_ollama_names_and_an_empty_backend(home, tmp_path):
    """`localmoe list` / `ls` (Ollama's names for `models`) and `show` (for `info`) were
    "No such command"; `--n-ctx` (the Python API's name) was "Did you mean --json-object?";
    `--backend ''` ran as auto while `--device ''` was an error: now one error line naming
    the backend."""
    from localmoe.testing.synthetic import write_gguf

    for alias in ("list", "ls"):
        r = run([alias, "--json"])
        assert r.exit_code == 0 and r.stdout == run(["models", "--json"]).stdout, r.output
    assert "list" not in run(["--help"]).stdout.split("Commands:")[1]   # aliases stay unlisted
    m = str(write_gguf(tmp_path / "m.gguf", "tiny-llama"))
    r = run(["show", m, "--json"])
    assert r.exit_code == 0 and r.stdout == run(["info", m, "--json"]).stdout
    r = run(["generate", "-m", m, "--backend", "torch", "--n-ctx", "96", "--json", "-n", "1",
             "--greedy", "hi"])
    assert r.exit_code == 0 and json.loads(r.stdout)["n_ctx"] == 96, r.output
    r = run(["generate", "-m", m, "--backend", " ", "-n", "1", "hi"])
    assert r.exit_code == 2 and "backend must not be empty" in r.stderr, r.stderr


def test_a_model_whose_chat_template_does_not_compile_runs_raw_and_refuses_chat(
        home, tmp_path, monkeypatch):
    """A GGUF whose chat template has a syntax error could not be used at all: generate
    --raw and bench printed `error: the chat template has a syntax error ...` (exit 1). Now
    they run, with one `warning:` line naming the error (said once); what needs the template
    (generate without --raw, chat) is refused with that error as one line, as before."""
    import localmoe.tui.app as tui_app
    from localmoe.testing.synthetic import write_gguf

    bad = str(write_gguf(tmp_path / "bad.gguf", "tiny-llama",
                         chat_template="{% for m in messages %}{{ m.content }"))
    syntax = "the chat template has a syntax error at line 1: unexpected '}'"
    # a real process: stderr exactly as a user sees it (no log set up: a `warning:` line)
    r = lm("generate", "-m", bad, "--backend", "torch", "--raw", "-n", "3", "--greedy", "hi",
           timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [
        f"warning: bad: {syntax}; loaded without it: plain completions work, chat with this "
        f"model fails"], r.stderr
    assert r.stdout.strip()
    r = run(["bench", "-m", bad, "--backend", "torch", "-p", "4", "-n", "2", "-r", "1", "-t", "1"])
    assert r.exit_code == 0, r.output
    # info says so (it said "yes")
    r = run(["info", bad])
    assert r.exit_code == 0 and f"does not compile ({syntax}): plain completions only" in r.output
    assert json.loads(run(["info", "--json", bad]).output)["chat_template_error"] == syntax
    # the chat template is needed: the error itself, one line, before any weights load
    from localmoe.backends import torch_backend

    monkeypatch.setattr(torch_backend.TorchBackend, "load",
                        lambda *a, **k: pytest.fail("loaded the weights"))
    r = run(["generate", "-m", bad, "--backend", "torch", "-n", "3", "hi"])
    assert_one_line_error(types.SimpleNamespace(returncode=r.exit_code, stderr=r.stderr), syntax)
    assert "warning" not in r.stderr
    monkeypatch.setattr(tui_app, "run_chat", lambda *a, **kw: pytest.fail("opened the chat UI"))
    r = run(["chat", "-m", bad])
    assert_one_line_error(types.SimpleNamespace(returncode=r.exit_code, stderr=r.stderr), syntax)


def test_threads_over_the_cpu_count_warns(home, tmp_path, monkeypatch):
    """`--threads 64` on a 2-CPU machine was taken silently and decoded ~20x slower: one
    `warning:` line on stderr names the count and the CPUs; the command goes on. A count
    within the CPUs says nothing."""
    import localmoe.cpu.threads as threads

    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    monkeypatch.setenv("LOCALMOE_THREADS", "")  # -t sets it in this process: restored after
    missing = str(tmp_path / "missing.gguf")
    for cmd in ("generate", "bench"):
        r = run([cmd, "-m", missing, "--threads", "64"] + (["hi"] if cmd == "generate" else []))
        warn = [l for l in r.stderr.splitlines() if l.startswith("warning:")]
        assert warn == ["warning: --threads 64 exceeds the 2 CPUs of this machine; decode may "
                        "be much slower"], r.stderr
        assert r.exit_code == 1 and "does not exist" in r.stderr  # it went on to the load
    r = run(["generate", "-m", missing, "-t", "2", "hi"])
    assert r.exit_code == 1 and "warning" not in r.stderr, r.stderr


@pytest.mark.parametrize("kv", [["--kv-cache", "int3"], ["--kv-cache", "fp4"],
                                ["--kv-cache-k", "int4", "--kv-cache-v", "int2"]])
def test_auto_says_when_the_kv_format_passes_llamacpp_over(home, tmp_path, monkeypatch, kv):
    """With llama.cpp installed, `auto` picks llamacpp on a CPU, but a KV format llama.cpp
    lacks (int3, fp4, int2) fell back to the slower torch backend without a word: one `note:`
    line on stderr says which backend runs and why, once, for generate, bench, chat and
    serve, never in the JSON on stdout. A named backend gets no note."""
    import localmoe.serve.server as server
    import localmoe.tui.app as tui_app
    from localmoe.backends.llamacpp_backend import LlamaCppBackend
    from localmoe.errors import LocalMoEError
    from localmoe.testing.synthetic import write_gguf

    monkeypatch.setattr(LlamaCppBackend, "available", lambda self: None)  # as if installed
    monkeypatch.setattr(tui_app, "run_chat", lambda *a, **kw: None)

    def no_app(*a, **kw):
        raise LocalMoEError("stopped before the bind")

    monkeypatch.setattr(server, "create_app", no_app)
    m = str(write_gguf(tmp_path / "m.gguf", "tiny-llama"))
    fmt = "k=int4,v=int2" if kv[0] == "--kv-cache-k" else kv[1]
    want = (f"note: the llamacpp backend cannot run the {fmt} KV cache; using the torch "
            f"backend (slower on a CPU)")
    for args in (["generate", "--json", "-n", "2", "--greedy", "hi"],
                 ["bench", "-p", "4", "-n", "2", "-r", "1", "--json", "-"],
                 ["chat"], ["serve", "--port", "18517"]):
        r = run([*args, "-m", m, "-t", "1", *kv])
        notes = [ln for ln in r.stderr.splitlines() if ln.startswith("note:")]
        assert notes == [want], (args, r.stderr)
        if "--json" in args:
            assert r.exit_code == 0, r.output
            assert json.loads(r.stdout)["backend"] == "torch"
    r = run(["chat", *kv])   # no -m: the store's kind of model (GGUF), found by the UI
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("note:")] == [want], r.stderr
    r = run(["generate", "--json", "-n", "2", "--greedy", "hi", "-m", m, "-t", "1",
             "--backend", "torch", *kv])
    assert r.exit_code == 0 and "note:" not in r.stderr, r.stderr


def test_the_auto_note_names_a_key_grouping_llamacpp_lacks(home, tmp_path, monkeypatch):
    """`--kv-cache int4:c` passes llamacpp over for its per-channel keys alone; the note said
    "cannot run the int4 KV cache" (str() drops the default ':c'), as if llama.cpp had no int4
    KV cache, which plain `--kv-cache int4` runs (per-token q4_0)."""
    from localmoe.backends.llamacpp_backend import LlamaCppBackend
    from localmoe.testing.synthetic import write_gguf

    monkeypatch.setattr(LlamaCppBackend, "available", lambda self: None)  # as if installed
    m = str(write_gguf(tmp_path / "m.gguf", "tiny-llama"))
    r = run(["generate", "--json", "-n", "2", "--greedy", "hi", "-m", m, "-t", "1",
             "--kv-cache", "int4:c"])
    notes = [ln for ln in r.stderr.splitlines() if ln.startswith("note:")]
    assert notes == ["note: the llamacpp backend cannot run the int4 KV cache with keys "
                     "grouped per channel; using the torch backend (slower on a CPU)"], r.stderr
    assert r.exit_code == 0 and json.loads(r.stdout)["backend"] == "torch", r.output


_SIGTERM_SERVE_STARTING = """
import os, signal, sys, time
import localmoe.io.loader as loader
real_open = loader.open_model
def open_model(path):  # SIGTERM while the model file is opened, before the port opens
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
    return real_open(path)
loader.open_model = open_model
from localmoe.cli import main
main(sys.argv[1:])
"""


def test_sigterm_while_serve_starts_says_terminated(tmp_path):
    """`serve` sent SIGTERM before its port opened (the model checked, pulled or imported)
    died of the signal, status 143 with nothing on stderr, where `generate` says
    `terminated`: it says so too (once serving, SIGTERM drains and exits 0 as before)."""
    from localmoe.testing.synthetic import write_gguf

    m = str(write_gguf(tmp_path / "m.gguf", "tiny-llama"))
    r = subprocess.run([sys.executable, "-c", _SIGTERM_SERVE_STARTING, "serve", "-m", m,
                        "--backend", "torch", "--port", "18519"],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, LOCALMOE_HOME=str(tmp_path / "home")))
    assert r.returncode == 143, r.stderr
    assert r.stderr.split() == ["terminated"], r.stderr
    assert r.stdout == "", r.stdout
