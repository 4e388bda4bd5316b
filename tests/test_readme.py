"""README.md stays short, and what it points at exists.

- README.md has at most ``MAX_LINES`` lines;
- every relative link in README.md and docs/*.md names an existing file, and an anchor (``#...``) in a link to
  a Markdown file names one of its headings (GitHub's slugs);
- every command in README's ```bash blocks, and every command-looking inline code span (starting with
  ``make``, ``python``, ``lcv`` or ``bash``), exists: ``make X`` targets are in the Makefile, scripts exist,
  ``lcv SUBCOMMAND --flag`` flags are accepted by the real parser (one subprocess for every ``lcv --help`` the
  README needs) and a script's ``--flags`` appear in its ``--help`` (one subprocess per script, all at once).

The checker is tried on planted bad Markdown too, so a check that silently accepts everything fails.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 250
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("", "kernels", "vision")),
}

# Commands that are not this project's: their first word is enough.
EXTERNAL = {"pip", "pip3", "tensorboard", "git", "cd", "export", "ls", "cat", "uptime"}
LCV_SUBCOMMANDS = {"fit", "validate", "test", "predict"}
DEPLOY_SUBCOMMANDS = {"export", "classify", "serve"}  # plain argparse: `lcv export --help` lists their flags
DEFAULT_RECIPE = "digits-small"  # what `lcv fit --help` shows without --recipe
_FENCE = re.compile(r"^```(\w*)\s*\n(.*?)^```\s*$", re.S | re.M)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


# ---------------------------------------------------------------- links


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _FENCE.sub("", markdown).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def link_problems(markdown: str, where: Path) -> list[str]:
    """Relative links of ``markdown`` (a file in folder ``where``) that name no file, or no heading."""
    problems = []
    for target in _LINK.findall(_FENCE.sub("", markdown)):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (where / path).resolve() if path else None
        if file is not None and not file.exists():
            problems.append(f"{target}: no file {file.relative_to(ROOT) if ROOT in file.parents else file}")
            continue
        if anchor and (file is None or file.suffix == ".md"):
            text = markdown if file is None else file.read_text(encoding="utf-8")
            if anchor not in anchors(text):
                problems.append(f"{target}: no heading #{anchor}")
    return problems


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


# ---------------------------------------------------------------- commands


def commands(markdown: str) -> list[str]:
    """The commands of the ```bash blocks (comments dropped, ``\\`` lines joined) and command-looking code spans."""
    found = []
    for language, body in _FENCE.findall(markdown):
        if language not in ("bash", "sh", "shell"):
            continue
        joined = re.sub(r"\\\n", " ", body)
        for line in joined.splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            if line:
                found.append(line)
    for span in _CODE_SPAN.findall(_FENCE.sub("", markdown)):
        words = span.split()
        words = [w for w in words if not _ENV_ASSIGNMENT.match(w)]
        if (
            len(words) > 1
            and words[0] in ("make", "python", "lcv", "bash")
            and "..." not in span
            and "<" not in span
        ):
            found.append(span)
    return found


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z0-9_.-]+):", text, re.M))


class Command:
    """One command split into the parts the checks need."""

    def __init__(self, line: str) -> None:
        self.line = line
        words = shlex.split(line)
        while words and (_ENV_ASSIGNMENT.match(words[0]) or words[0] in ("/usr/bin/time", "time")):
            words.pop(0)
        self.words = words

    @property
    def program(self) -> str:
        return Path(self.words[0]).name if self.words else ""

    def flags(self) -> list[str]:
        return [w.split("=", 1)[0] for w in self.words if w.startswith("--")]


def lcv_help_key(cmd: Command) -> tuple[str, ...] | None:
    """The ``lcv`` arguments whose ``--help`` lists this command's flags (subcommand and recipe)."""
    if len(cmd.words) > 1 and cmd.words[1] in DEPLOY_SUBCOMMANDS:
        return (cmd.words[1],)
    if len(cmd.words) < 2 or cmd.words[1] not in LCV_SUBCOMMANDS:
        return None
    key = ["fit"]  # validate, test and predict take fit's options (the subcommand is checked on its own)
    recipe = cmd.words[cmd.words.index("--recipe") + 1] if "--recipe" in cmd.words[:-1] else DEFAULT_RECIPE
    if recipe != DEFAULT_RECIPE and not recipe.isupper():  # NAME: a placeholder
        key += ["--recipe", recipe]
    return tuple(key)


def script_of(cmd: Command) -> str | None:
    if cmd.program.startswith("python") and len(cmd.words) > 1 and cmd.words[1].endswith(".py"):
        return cmd.words[1]
    return None


_HELPS = """\
import contextlib, io, json, runpy, sys
from lcv_vision.cli import main
lcv_keys, scripts = json.load(sys.stdin)
out = {"lcv": [], "scripts": []}
def capture(call):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            call()
        except SystemExit:
            pass
    return buf.getvalue()
for argv in lcv_keys:
    out["lcv"].append(capture(lambda: main(argv + ["--help"])))
for script in scripts:
    sys.argv = [script, "--help"]
    out["scripts"].append(capture(lambda: runpy.run_path(script, run_name="__main__")))
sys.stdout.write("\\n" + json.dumps(out) + "\\n")
"""


def helps(
    lcv_keys: list[tuple[str, ...]], scripts: list[str]
) -> tuple[dict[tuple[str, ...], str], dict[str, str]]:
    """``lcv <key> --help`` for every key and ``python SCRIPT --help`` for every script, all from one Python
    process: the parsers' imports (torch, Lightning) cost ~10 s, paid once."""
    keys, names = sorted(set(lcv_keys)), sorted({s for s in scripts if (ROOT / s).is_file()})
    if not keys and not names:
        return {}, {}
    proc = subprocess.run(
        [sys.executable, "-c", _HELPS],
        cwd=ROOT,
        env=ENV,
        input=json.dumps([[list(k) for k in keys], names]),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return dict(zip(keys, out["lcv"], strict=True)), dict(zip(names, out["scripts"], strict=True))


def command_problems(
    lines: list[str],
    get_helps: Callable[
        [list[tuple[str, ...]], list[str]], tuple[dict[tuple[str, ...], str], dict[str, str]]
    ] = helps,
) -> list[str]:
    """What is wrong with each command: a missing make target, script or file, a flag its parser lacks."""
    cmds = [Command(line) for line in lines]
    lcv_keys = [k for c in cmds if c.program == "lcv" and c.flags() and (k := lcv_help_key(c))]
    scripts = [s for c in cmds if (s := script_of(c)) and any(f != "--help" for f in c.flags())]
    lcv_out, script_out = get_helps(lcv_keys, scripts)
    targets = makefile_targets()
    problems = []
    for cmd in cmds:
        where = f"`{cmd.line}`"
        if not cmd.words:
            continue
        if cmd.program == "make":
            problems += [
                f"{where}: no make target {t}"
                for t in cmd.words[1:]
                if not t.startswith("-") and "=" not in t and t not in targets
            ]
        elif cmd.program.startswith("python"):
            if len(cmd.words) > 2 and cmd.words[1] == "-m":
                if cmd.words[2] not in ("pytest", "pip", "lcv_vision.cli"):
                    problems.append(f"{where}: unknown module {cmd.words[2]}")
                problems += [
                    f"{where}: no file {w}"
                    for w in cmd.words[3:]
                    if w.endswith(".py") and not (ROOT / w.split("::")[0]).is_file()
                ]
                continue
            script = script_of(cmd)
            if script is None:
                problems.append(f"{where}: no script named")
            elif not (ROOT / script).is_file():
                problems.append(f"{where}: no script {script}")
            else:
                help_text = script_out.get(script, "")
                problems += [
                    f"{where}: {script} has no {f}"
                    for f in cmd.flags()
                    if f != "--help" and not re.search(re.escape(f) + r"\b", help_text)
                ]
        elif cmd.program == "bash":
            if len(cmd.words) < 2 or not (ROOT / cmd.words[1]).is_file():
                problems.append(f"{where}: no script {cmd.words[1:2]}")
        elif cmd.program == "lcv":
            sub = cmd.words[1] if len(cmd.words) > 1 else ""
            if sub == "recipes":
                continue
            if sub not in LCV_SUBCOMMANDS | DEPLOY_SUBCOMMANDS:
                problems.append(f"{where}: no lcv subcommand {sub!r}")
                continue
            key = lcv_help_key(cmd)
            if key is None or not cmd.flags():
                continue
            help_text = lcv_out[key]
            known = re.sub(r"-\s+", "-", re.sub(r"\s+", " ", help_text))  # help wraps at hyphens
            if len(key) == 3 and not re.search(r"known:[^)]*\b" + re.escape(key[2]) + r"\b", known):
                problems.append(f"{where}: no recipe {key[2]}")
            problems += [
                f"{where}: lcv {sub} has no {f}"
                for f in cmd.flags()
                if f != "--help" and not re.search(re.escape(f) + r"(?![\w.-])", help_text)
            ]
        elif cmd.program not in EXTERNAL:
            problems.append(f"{where}: unknown program {cmd.program}")
    return problems


# ---------------------------------------------------------------- tests


def test_readme_is_at_most_250_lines() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES})"


def test_readme_starts_with_the_two_set_up_commands() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("# ")
    body = [line for line in lines[1:] if line.strip()]
    assert body[0] == "```bash"
    assert body[1].startswith("make run ") and "#" in body[1]
    assert body[2].startswith("make test ") and "#" in body[2]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.name)
def test_relative_links_point_at_files_and_headings(path: Path) -> None:
    assert link_problems(path.read_text(encoding="utf-8"), path.parent) == []


def test_readme_commands_exist() -> None:
    found = commands(README.read_text(encoding="utf-8"))
    assert any(c.startswith("make run") for c in found) and any(c.startswith("lcv fit") for c in found)
    assert command_problems(found) == []


PLANTED = """\
# Planted

See [the docs](docs/compiler.md), [a missing page](docs/no-such-page.md),
[a missing heading](docs/compiler.md#no-such-heading), [here](#planted) and [the web](https://example.com).

```bash
make run                                    # fine
make no-such-target                         # bad target
python benchmarks/no_such_script.py         # bad script
python benchmarks/loader.py --repeats 5 --no-such-flag 3
lcv fit --recipe digits-small --no.such_flag 1
lcv fit --recipe no-such-recipe --trainer.max_epochs 1
lcv frobnicate
rm -rf /                                    # not a known program
```

Inline: `make also-missing`.
"""


def test_the_link_checker_finds_planted_bad_links() -> None:
    problems = link_problems(PLANTED, ROOT)
    assert len(problems) == 2, problems
    assert "docs/no-such-page.md" in problems[0] and "#no-such-heading" in problems[1]


def test_the_command_checker_finds_planted_bad_commands() -> None:
    # The parsers' help comes from stand-ins here: the real ones are exercised by test_readme_commands_exist.
    def fake_helps(
        keys: list[tuple[str, ...]], scripts: list[str]
    ) -> tuple[dict[tuple[str, ...], str], dict[str, str]]:
        lcv = "--recipe RECIPE (known: digits-small, cifar10-\n   airbench)\n --trainer.max_epochs N"
        return {k: lcv for k in keys}, {s: "usage: [--repeats REPEATS] [--cpu-time]" for s in scripts}

    lines = commands(PLANTED)
    problems = command_problems(lines, fake_helps)
    expected = [
        "no make target no-such-target",
        "no script benchmarks/no_such_script.py",
        "has no --no-such-flag",
        "has no --no.such_flag",
        "no recipe no-such-recipe",
        "no lcv subcommand 'frobnicate'",
        "unknown program rm",
        "no make target also-missing",
    ]
    for text in expected:
        assert any(text in p for p in problems), (text, problems)
    assert len(problems) == len(expected), problems


def test_slugs_follow_github() -> None:
    assert slug("Recipes and the `lcv` command") == "recipes-and-the-lcv-command"
    assert slug("Accuracy on real CIFAR-10 (`benchmarks/cifar10_accuracy.py`)") == (
        "accuracy-on-real-cifar-10-benchmarkscifar10_accuracypy"
    )
    assert slug('Compile or eager: `compile="auto"`') == "compile-or-eager-compileauto"
