"""Shell completion, the man page and the --help texts, all from the one parser (issue 11).

The completion scripts are run, not only read: bash sources the script and
calls its completion function the way readline would (COMP_WORDS /
COMP_CWORD), and the candidates must be wsync's real subcommands and
options.  zsh and fish are checked the same way when they are installed.
The man page must render through ``man -l`` (or groff) without warnings.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from wsync.cli import main
from wsync.cliargs import build_parser

REPO = Path(__file__).resolve().parents[1]
SUBCOMMANDS = ["pull", "doctor", "demo", "daemon", "status", "jobs", "completion", "man"]


def wsync(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "COLUMNS": "100"}
    return subprocess.run(
        [sys.executable, "-m", "wsync", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    proc = wsync("completion", "bash")
    assert proc.returncode == 0, proc.stderr
    path = tmp_path_factory.mktemp("completion") / "wsync.bash"
    path.write_text(proc.stdout, encoding="utf-8")
    return path


def bash_complete(script: Path, words: list[str]) -> list[str]:
    """Candidates bash offers after ``words`` (the last one is being completed)."""
    array = " ".join(f"'{w}'" for w in words)
    line = " ".join(words)
    program = (
        f"source {script}\n"
        f"COMP_WORDS=({array}); COMP_CWORD={len(words) - 1}\n"
        f"COMP_LINE='{line}'; COMP_POINT=${{#COMP_LINE}}\n"
        '_shtab_wsync; printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    proc = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", program],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return [x for x in proc.stdout.splitlines() if x]


def test_bash_script_is_valid_and_completes_subcommands(bash_script: Path) -> None:
    syntax = subprocess.run(
        ["bash", "-n", str(bash_script)], capture_output=True, text=True, timeout=60, check=False
    )
    assert syntax.returncode == 0, syntax.stderr
    assert bash_complete(bash_script, ["wsync", ""]) == SUBCOMMANDS
    assert bash_complete(bash_script, ["wsync", "st"]) == ["status"]


def test_bash_completes_options_of_every_command_including_the_daemon_ones(
    bash_script: Path,
) -> None:
    assert bash_complete(bash_script, ["wsync", "pull", "--max"]) == ["--max-files", "--max-bytes"]
    # the daemon commands are parsed by their own modules; their options are in too
    assert bash_complete(bash_script, ["wsync", "status", "--con"]) == ["--config"]
    assert bash_complete(bash_script, ["wsync", "daemon", "--d"]) == ["--dev"]
    assert bash_complete(bash_script, ["wsync", "jobs", "--state", ""]) == [
        "queued",
        "running",
        "succeeded",
        "failed",
        "cancelled",
    ]
    assert bash_complete(bash_script, ["wsync", "completion", ""]) == ["bash", "zsh", "fish"]


def test_bash_completes_host_paths_but_not_guest_paths(bash_script: Path) -> None:
    text = bash_script.read_text(encoding="utf-8")
    assert "_shtab_wsync_pull___state_dir_COMPGEN=_shtab_compgen_dirs" in text
    assert "_shtab_wsync_pull___ssh_key_COMPGEN=_shtab_compgen_files" in text
    assert "_shtab_wsync_daemon___config_COMPGEN=_shtab_compgen_files" in text
    # --staging-dir names a directory in the guest: no host completion
    assert "staging_dir_COMPGEN" not in text


def test_zsh_and_fish_scripts(tmp_path: Path) -> None:
    zsh = wsync("completion", "zsh")
    fish = wsync("completion", "fish")
    assert zsh.returncode == fish.returncode == 0
    assert zsh.stdout.startswith("#compdef wsync")
    for name in SUBCOMMANDS:
        assert name in zsh.stdout and name in fish.stdout
    assert "--max-files" in zsh.stdout and "max-files" in fish.stdout
    if shutil.which("zsh"):
        path = tmp_path / "_wsync"
        path.write_text(zsh.stdout, encoding="utf-8")
        check = subprocess.run(["zsh", "-n", str(path)], capture_output=True, timeout=60)
        assert check.returncode == 0, check.stderr
    if shutil.which("fish"):
        path = tmp_path / "wsync.fish"
        path.write_text(fish.stdout, encoding="utf-8")
        check = subprocess.run(["fish", "--no-execute", str(path)], capture_output=True, timeout=60)
        assert check.returncode == 0, check.stderr
        got = subprocess.run(
            ["fish", "--no-config", "-c", f"source {path}; complete -C 'wsync '"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        offered = {line.split("\t")[0] for line in got.stdout.splitlines()}
        assert set(SUBCOMMANDS) <= offered, got.stdout + got.stderr


def test_man_page_renders_with_every_command_and_option(tmp_path: Path) -> None:
    out = tmp_path / "wsync.1"
    proc = wsync("man", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    roff = out.read_text(encoding="utf-8")
    assert roff.startswith('.TH WSYNC "1"')
    assert wsync("man").stdout == roff
    if shutil.which("man"):
        render = ["man", "--warnings", "-l", str(out)]
        env = {**os.environ, "MANWIDTH": "80", "MANPAGER": "cat", "PAGER": "cat"}
    elif shutil.which("groff"):
        render, env = ["groff", "-man", "-Tutf8", "-ww", str(out)], dict(os.environ)
    else:
        pytest.skip("neither man nor groff is installed")
    shown = subprocess.run(render, capture_output=True, text=True, timeout=60, env=env)
    assert shown.returncode == 0, shown.stderr
    assert not shown.stderr.strip(), shown.stderr  # no roff warnings
    text = shown.stdout.replace("\u2010", "-").replace("\u2011", "-")
    text = " ".join(text.replace("-\n", "").split())  # undo hyphenation and filling
    assert "NAME wsync - pull an agent's workspace" in text
    for name in SUBCOMMANDS:
        assert f"wsync {name}" in text
    for option in ("--max-files", "--config", "--dev", "--wait", "--token-file"):
        assert option in text
    # the subcommands' epilogs, which argparse-manpage alone leaves out
    assert "SANDBOX forms: local:PATH" in text
    assert "cloudflare://SANDBOX_ID/PATH" in text
    assert "WSYNC STATUS, WSYNC JOBS Finding the daemon and its token" in text
    assert "SEE ALSO docs/daemon.md" in text
    # the exit codes under man-pages(7)'s heading (argparse-manpage says COMMENTS)
    assert "EXIT STATUS 0 success: DEST holds exactly" in text and "COMMENTS" not in text


def _all_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found += _all_parsers(child)
    return found


def test_every_option_of_every_command_has_help_text() -> None:
    """``--max-files``, ``-v`` and ``--debug`` under ``wsync pull`` had none."""
    missing = [
        f"{p.prog} {'/'.join(a.option_strings) or a.dest}"
        for p in _all_parsers(build_parser(full=True))
        for a in p._actions
        if not a.help and not isinstance(a, argparse._SubParsersAction)
    ]
    assert not missing


def test_pull_help_explains_max_files_verbose_and_debug() -> None:
    text = wsync("pull", "--help").stdout
    block = " ".join(text.split())
    assert "--max-files N refuse archives with more than this many entries" in block
    assert "-v, --verbose log more: each retry" in block
    assert "--debug log everything -v does plus every guest call" in block


@pytest.mark.parametrize("command", ["status", "jobs"])
def test_daemon_client_help_is_plain_text(command: str) -> None:
    proc = wsync(command, "--help")
    assert proc.returncode == 0
    assert "``" not in proc.stdout and ":class:" not in proc.stdout
    assert "--config FILE" in proc.stdout
    assert "WSYNC_API_TOKEN" in proc.stdout


def test_completion_needs_a_known_shell(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["completion", "tcsh"])
    assert exc.value.code == 2
    assert "invalid choice: 'tcsh'" in capsys.readouterr().err
