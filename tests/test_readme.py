"""README.md: short, its links lead somewhere, its two commands are the ones CI runs, and its
example on the default model gets a sensible answer."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, re.S)


def test_readme_is_short_and_its_links_exist():
    # ~120 lines, with room for a few more links under "More"
    assert len(README.splitlines()) <= 130, "README.md: keep it to what a user needs; move the rest to docs/"
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert links and "docs/CLI.md" in links
    missing = [l for l in links if not l.startswith("http") and not (ROOT / l).exists()]
    assert not missing, missing
    assert re.search(r"^## More\n", README, re.M)  # where other docs get their link line


def test_readme_install_and_test_commands_are_what_ci_runs():
    """The quickstart and test commands of the README are one line each, and .ci/run installs
    the same extras and runs the same pytest command."""
    blocks = [b.strip() for b in _bash_blocks() if b.strip().startswith("python3 -m venv")]
    assert len(blocks) == 2, blocks
    quick, tests = blocks
    assert quick.endswith('localmoe generate "Why is the sky blue?"')
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -q -e ".[test,llamacpp]"' in ci and '-e ".[test,llamacpp]"' in tests
    test_cmd = tests.split(" && ")[-1]
    assert test_cmd == "TRITON_INTERPRET=1 python -m pytest -q" and test_cmd in ci
    for pull in ("localmoe pull smollm2", "localmoe pull gemma3-270m"):
        assert pull in tests and pull in ci


def test_readme_json_example_answers_sensibly(smollm2_path, tmp_path):
    """The README's greedy --json example on the default model answers the question in a
    sentence (it used to be '2+2=', which the chat model answered with a 343-token essay)."""
    line = next(l for b in _bash_blocks() for l in b.splitlines()
                if l.startswith("localmoe generate --greedy --json"))
    args = shlex.split(line.split("#")[0])[1:]
    r = subprocess.run([sys.executable, "-m", "localmoe", *args[:1], "-m", str(smollm2_path),
                        *args[1:]], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, LOCALMOE_HOME=str(tmp_path)))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["finish_reason"] == "stop" and out["completion_tokens"] <= 40, out
    assert re.search(r"\b4\b|\bfour\b", out["text"], re.I), out["text"]


def test_readme_kv_formats_and_sampling_flags_match_the_cli():
    """The README listed no f32 (which --help accepts) and said serve, chat and bench take
    the sampling flags (serve has no --temperature, chat no --seed, bench's -n is
    --gen-tokens): its KV list and the commands it names for sampling follow --help."""
    from click.testing import CliRunner

    from localmoe.cli import cli

    def help_of(cmd: str) -> str:
        return CliRunner().invoke(cli, [cmd, "--help"], terminal_width=200).output

    listed = re.search(r"`--kv-cache ([a-z0-9|]+)`", README).group(1).split("|")
    accepted = re.search(r"\b(f16\|[a-z0-9|]+)", help_of("generate")).group(1).split("|")
    assert sorted(listed) == sorted(accepted)
    m = re.search(r"sampling\s+flags \(([^)]*)\) only\s+with `(\w+)`", README)
    flags = re.findall(r"`(-[-\w/]+)`", m.group(1))
    assert "--temperature" in flags and "--seed" in flags
    for f in flags:
        assert all(x in help_of(m.group(2)) for x in f.split("/")), f
    for other in ("chat", "serve", "bench"):  # "only": nobody else takes them
        assert "--temperature" not in help_of(other) and "--seed" not in help_of(other)
