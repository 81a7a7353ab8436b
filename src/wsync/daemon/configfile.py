"""The daemon's config file read as TOML, its relative paths anchored to its directory.

Kept apart from the schema (:mod:`wsync.daemon.config`): reading and anchoring are about the
file, not about what its keys mean, and the schema module is long enough on its own.  A path
given *in the file* is relative to the file, so a config kept in a checkout starts from any
working directory; flags and environment variables must be absolute (the schema says so).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from wsync.errors import UsageError


class ConfigError(UsageError):
    """The configuration cannot be used; exit code 2 like every usage error."""

    template = "config error: {}"


def read_config_file(path: Path) -> dict[str, Any]:
    """The TOML file as a dict, its relative paths anchored to its directory."""
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None
    except UnicodeDecodeError as err:  # tomllib reads the bytes as UTF-8
        raise ConfigError(f"{path}: not UTF-8 (byte {err.start})") from None
    return _anchor_paths(data, path.absolute().parent)


def _anchor(value: Any, base: Path) -> Any:
    """A relative path string → absolute under ``base``; ``~`` and ``~user`` → that home
    (it was left as it was, and then read relative to the daemon's working directory:
    ``--dev`` made a directory named ``~`` there); anything else unchanged."""
    if isinstance(value, str) and value.startswith("~"):
        own = value == "~" or value.startswith("~/")
        if own and not os.environ.get("HOME", "").startswith("/"):
            # expanduser makes "~/x" "/x" where HOME is empty
            raise ConfigError(f"cannot expand {value!r}: HOME is not an absolute path")
        home = os.path.expanduser(value)
        if home.startswith("~"):
            raise ConfigError(f"cannot expand {value!r}: no such user, or no home directory")
        return home
    if isinstance(value, str) and value and not value.startswith("/"):
        return str(base / value)
    return value


def _anchor_list(value: Any, base: Path) -> Any:
    return [_anchor(v, base) for v in value] if isinstance(value, list) else value


def _anchor_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """Anchor the path-valued keys of a config file to the file's directory.

    Only keys whose value is a host path are touched; type errors are left for
    the schema to report with the key's name.
    """
    data = dict(data)
    if "state_dir" in data:
        data["state_dir"] = _anchor(data["state_dir"], base)
    if "engine_dir" in data:
        data["engine_dir"] = _anchor(data["engine_dir"], base)
    if "dest_roots" in data:
        data["dest_roots"] = _anchor_list(data["dest_roots"], base)
    api = data.get("api")
    if isinstance(api, dict):
        api = dict(api)
        if "token_file" in api:
            api["token_file"] = _anchor(api["token_file"], base)
        if "local_roots" in api:
            api["local_roots"] = _anchor_list(api["local_roots"], base)
        listen = api.get("listen")
        if isinstance(listen, str) and listen.startswith("unix:"):
            api["listen"] = "unix:" + _anchor(listen[len("unix:") :], base)
        data["api"] = api
    boxes = data.get("sandboxes")
    if isinstance(boxes, dict):
        anchored: dict[str, Any] = {}
        for name, box in boxes.items():
            if isinstance(box, dict):
                box = dict(box)
                if "dest" in box:
                    box["dest"] = _anchor(box["dest"], base)
                uri = box.get("uri")
                if isinstance(uri, str) and uri.startswith("local:") and uri[6:7] != "/":
                    box["uri"] = "local:" + _anchor(uri[len("local:") :], base)
            anchored[name] = box
        data["sandboxes"] = anchored
    return data
