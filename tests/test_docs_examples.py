"""Every shell example in README.md and docs/ runs as written (issue 11, "Done means").

A reader copies commands from the documentation; one that fails costs trust.  So the
blocks are extracted from the Markdown and run, unchanged, by ``bash -euo pipefail``
(a failing line fails the block), in a fresh directory, with ``wsync`` on PATH meaning
this checkout.  Conventions, written as HTML comments just above a block (invisible
when the Markdown is rendered):

* ``<!-- no-test: why -->`` (or ``<!-- not run: why -->``, docs/daemon.md's spelling):
  the block cannot run here (real cloud accounts, the test run itself).  The test
  counts these and keeps the list short;
* ``<!-- test: daemon -->``: run with a local daemon started for the block, a
  configured sandbox ``agent1`` (a ``local:`` workspace) and ``$WSYNC_URL`` /
  ``$WSYNC_API_TOKEN`` pointing at it;
* ``<!-- test: fresh-copy -->``: run in a copy of the checkout's tracked files (the
  install command creates ``.venv`` there; it needs the package index, as CI has);
* ``<!-- expect: TEXT -->``: TEXT must appear in the block's stdout or stderr.

A block is an example when its fence says ``sh``/``bash``/``shell``/``console``, or when
an untagged block starts with a ``wsync``/``curl`` command.  ``docs/daemon.md``'s
blocks build on each other (start a daemon, then ask it), so ``tests/test_daemon_docs.py``
runs them in order as one script (``DELEGATED``).  ``docs/backends/`` pages carry no
markers; their blocks that need a real cloud account are listed in ``ELSEWHERE`` with
the reason, keyed by first line.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_daemon_harness import TOKEN, running

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_LANGS = {"sh", "bash", "shell", "console"}
COMMANDS = ("wsync ", "curl ")
MARKER = re.compile(r"^<!--\s*(no-test|not run|test|expect):\s*(.*?)\s*-->\s*$")

# Files whose examples another test runs, because they build on each other (a daemon
# started in one block is asked in the next): they run there in order as one script.
DELEGATED = {
    "docs/daemon.md": "run in order as one script by tests/test_daemon_docs.py",
}

# Blocks in files this test's author does not own, that cannot run as written here.
# Keyed by (file, first line of the block).
ELSEWHERE: dict[tuple[str, str], str] = {
    (
        "docs/backends/cloudflare.md",
        "wsync pull cloudflare://SANDBOX_ID/workspace/project ./project",
    ): "needs a real Cloudflare Sandbox Bridge",
    (
        "docs/backends/daytona.md",
        "wsync pull daytona://SANDBOX_ID/home/daytona/workspace ./out",
    ): "needs a real Daytona sandbox",
    (
        "docs/backends/e2b.md",
        "wsync pull e2b://SANDBOX_ID/home/user/project ./project",
    ): "needs a real E2B sandbox",
    (
        "docs/backends/docker.md",
        "wsync pull docker://CONTAINER/workspace ./workspace",
    ): "needs a running Docker daemon and container",
}
MAX_NO_TEST = 3  # honest and short: raise it only with a reason in the Markdown


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced example: where it is, its text, and the markers above it."""

    file: str
    line: int
    text: str
    mode: str = "local"
    skip: str = ""
    expect: tuple[str, ...] = ()

    @property
    def first_line(self) -> str:
        return self.text.splitlines()[0].strip() if self.text.strip() else ""


def blocks_of(path: Path, root: Path = ROOT) -> Iterator[Block]:
    """The example blocks of one Markdown file, with the markers just above each."""
    rel = path.relative_to(root).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    markers: dict[str, list[str]] = {}
    i = 0
    while i < len(lines):
        line = lines[i]
        match = MARKER.match(line.strip())
        if match:
            markers.setdefault(match.group(1), []).append(match.group(2))
            i += 1
            continue
        fence = re.match(r"^(```+|~~~+)\s*([\w-]*)", line)
        if not fence:
            if line.strip():
                markers = {}  # markers belong to the block right below them
            i += 1
            continue
        close, lang = fence.group(1), fence.group(2).lower()
        start = i + 1
        i += 1
        while i < len(lines) and not lines[i].startswith(close):
            i += 1
        body = "\n".join(lines[start:i]) + "\n"
        i += 1
        first = next((b.strip() for b in body.splitlines() if b.strip()), "")
        if lang in SHELL_LANGS or (not lang and first.startswith(COMMANDS)):
            skip = (markers.get("no-test") or markers.get("not run") or [""])[0]
            if rel in DELEGATED:
                skip = f"delegated: {DELEGATED[rel]}"
            if not skip:
                skip = ELSEWHERE.get((rel, body.splitlines()[0].strip()), "")
            yield Block(
                file=rel,
                line=start,
                text=body,
                mode=(markers.get("test") or ["local"])[0],
                skip=skip,
                expect=tuple(markers.get("expect", [])),
            )
        markers = {}


ALL_BLOCKS = [block for path in DOCS for block in blocks_of(path)]


def test_examples_are_found_and_the_no_test_list_stays_short() -> None:
    """The extractor sees the README's examples, and few are excused (and each says why)."""
    readme = [b for b in ALL_BLOCKS if b.file == "README.md"]
    assert len(readme) >= 5, readme
    assert sum(1 for b in readme if not b.skip) >= 3
    marked = [
        b
        for b in ALL_BLOCKS
        if b.skip and (b.file, b.first_line) not in ELSEWHERE and b.file not in DELEGATED
    ]
    assert len(marked) <= MAX_NO_TEST, [f"{b.file}:{b.line}" for b in marked]
    assert all(b.skip.strip() for b in marked)
    assert {b.mode for b in ALL_BLOCKS} <= {"local", "daemon", "fresh-copy"}


def _wsync_shim(bin_dir: Path) -> None:
    """``wsync`` on PATH is this checkout, run by the interpreter running the tests."""
    bin_dir.mkdir()
    shim = bin_dir / "wsync"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m wsync "$@"\n', encoding="utf-8")
    shim.chmod(0o755)


def _base_env(tmp: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("WSYNC_", "PYTEST_", "SPRITES_", "E2B_", "DAYTONA_", "CLOUDFLARE_", "DOCKER_")
        )
    }
    (tmp / "home").mkdir()
    env.update(HOME=str(tmp / "home"), XDG_STATE_HOME=str(tmp / "state"), TERM="dumb")
    return env


def _run(block: Block, cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.text],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return proc.returncode, proc.stdout + proc.stderr


def _copy_checkout(dest: Path) -> None:
    """The checkout's tracked files, as a fresh clone would have them (no .venv)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False, timeout=60
    )
    if listed.returncode == 0 and listed.stdout:
        for name in listed.stdout.decode().split("\0"):
            src = ROOT / name
            if name and src.is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / name)
    else:  # not a git checkout (e.g. an sdist): copy all but the local artefacts
        ignore = shutil.ignore_patterns(".venv", ".git", "*.egg-info", "__pycache__", ".*_cache")
        shutil.copytree(ROOT, dest, ignore=ignore, dirs_exist_ok=True)


@pytest.mark.parametrize("block", [pytest.param(b, id=f"{b.file}:{b.line}") for b in ALL_BLOCKS])
def test_example_runs_as_written(block: Block, tmp_path: Path) -> None:
    if block.skip:
        pytest.skip(f"no-test: {block.skip}")
    env = _base_env(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    if block.mode == "fresh-copy":
        _copy_checkout(work)
        code, out = _run(block, work, env, timeout=600)
    else:
        _wsync_shim(tmp_path / "bin")
        env["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")])
        )
        if block.mode == "daemon":
            workspace = tmp_path / "agent1-workspace"
            (workspace / "src").mkdir(parents=True)
            (workspace / "src" / "main.py").write_text("print('hi')\n", encoding="utf-8")
            config = f"""
state_dir = "{tmp_path}/daemon/state"
dest_roots = ["{tmp_path}/roots"]

[api]
listen = "127.0.0.1:0"

[sandboxes.agent1]
uri = "local:{workspace}"
dest = "{tmp_path}/roots/agent1"
"""
            (tmp_path / "daemon").mkdir()
            with running(tmp_path / "daemon", config) as daemon:
                env.update(WSYNC_URL=daemon.url, WSYNC_API_TOKEN=TOKEN)
                code, out = _run(block, work, env, timeout=300)
            assert (tmp_path / "roots" / "agent1" / "src" / "main.py").is_file()
        else:
            code, out = _run(block, work, env, timeout=300)
    assert code == 0, f"{block.file}:{block.line} exited {code}:\n{block.text}\n---\n{out}"
    for text in block.expect:
        assert text in out, f"{block.file}:{block.line}: {text!r} not in output:\n{out}"


def test_extractor_binds_markers_to_the_next_block_only(tmp_path: Path) -> None:
    """Markers bind to the block right below; prose between them cuts the binding."""
    doc = tmp_path / "probe.md"
    doc.write_text(
        "<!-- no-test: real cloud -->\n"
        "```sh\nwsync pull e2b://x/y ./y\n```\n\n"
        "<!-- expect: hello -->\nsome prose\n"
        "```bash\necho hello\n```\n"
        "```\nwsync doctor local:.\n```\n"
        "```text\nwsync pull SANDBOX DEST\n```\n"
        "```toml\nkey = 1\n```\n",
        encoding="utf-8",
    )
    found = list(blocks_of(doc, tmp_path))
    assert [(b.first_line, b.skip, b.expect) for b in found] == [
        ("wsync pull e2b://x/y ./y", "real cloud", ()),
        ("echo hello", "", ()),
        ("wsync doctor local:.", "", ()),
    ]


def test_a_failing_example_fails_the_test(tmp_path: Path) -> None:
    """The runner really sees a failing line (``set -e``/``pipefail``), not only the last."""
    env = _base_env(tmp_path)
    bad = Block(file="x.md", line=1, text="false | cat\necho after\n")
    code, _ = _run(bad, tmp_path, env, timeout=60)
    assert code != 0


def test_readme_states_every_exit_code_and_ci_runs_its_test_command() -> None:
    """The README's exit-code table is errors.py's, and .ci/run is the README's test command."""
    from wsync.errors import EXIT_CODES

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("### Exit codes", 1)[1].split("\n## ", 1)[0]
    stated = {int(m) for m in re.findall(r"^\| (\d+) \|", table, flags=re.MULTILINE)}
    assert stated == {0, *EXIT_CODES}
    test_command = next(
        b for b in ALL_BLOCKS if b.file == "README.md" and "scripts/test.sh" in b.text
    )
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert f"exec {test_command.text.strip()}\n" in ci
