"""Where the client sends requests and as whom: flags, then the environment, then the config file."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field as dc_field
from pathlib import Path
from typing import Any, Mapping

DEFAULT_URL = "http://127.0.0.1:8080"


class ConfigError(ValueError):
    """The client cannot be configured: the message says what to give."""


@dataclass(frozen=True)
class Settings:
    """Where to send requests and as whom, and where each came from (`flag`, `env BERTH_URL`, `file PATH`, `default`)."""

    url: str
    token: str
    sources: dict[str, str] = dc_field(default_factory=dict)


def default_config_path(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    base = Path(env["XDG_CONFIG_HOME"]) if env.get("XDG_CONFIG_HOME") else Path.home() / ".config"
    return base / "berth" / "config.json"


def read_config_file(path: Path, required: bool) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        if required:
            raise ConfigError(f"--config {path}: no such file") from None
        return {}
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read it: {exc.strerror}") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"config file {path}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f'config file {path}: must be a JSON object like {{"url": ..., "token": ...}}')
    for key in ("url", "token"):
        if key in doc and not isinstance(doc[key], str):
            raise ConfigError(f"config file {path}: {key} must be a string")
    return doc


def resolve_settings(url: str | None = None, token: str | None = None, config_path: str | os.PathLike | None = None,
                     environ: Mapping[str, str] | None = None) -> Settings:
    """url and token from the arguments, then BERTH_URL/BERTH_TOKEN, then the config file, each on its own.

    The file is `config_path` (which must exist), else
    `$XDG_CONFIG_HOME/berth/config.json` or `~/.config/berth/config.json`
    (which may be absent). The URL defaults to http://127.0.0.1:8080; the
    token has no default.
    """
    env = os.environ if environ is None else environ
    path = Path(config_path) if config_path is not None else default_config_path(env)
    doc = read_config_file(path, required=config_path is not None)
    sources: dict[str, str] = {}
    values: dict[str, str | None] = {}
    for key, given, var in (("url", url, "BERTH_URL"), ("token", token, "BERTH_TOKEN")):
        if given:
            values[key], sources[key] = given, "flag"
        elif env.get(var):
            values[key], sources[key] = env[var], f"env {var}"
        elif doc.get(key):
            values[key], sources[key] = doc[key], f"file {path}"
        else:
            values[key] = None
    if values["url"] is None:
        values["url"], sources["url"] = DEFAULT_URL, "default"
    if not values["token"]:
        raise ConfigError(f'no token: give --token, set BERTH_TOKEN, or write {{"token": "..."}} to {path}')
    return Settings(str(values["url"]).rstrip("/"), str(values["token"]), sources)


