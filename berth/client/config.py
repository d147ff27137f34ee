"""Where the client sends requests, as whom and trusting what: flags, then the environment, then the config file
(its selected profile, then its top-level keys)."""
from __future__ import annotations

import json
import os
import ssl
import urllib.parse
from dataclasses import dataclass, field as dc_field
from pathlib import Path
from typing import Any, Mapping

from common import tls
from common.argtypes import is_http_url

DEFAULT_URL = "http://127.0.0.1:8080"


def check_url(url: str, source: str = "") -> str:
    """The control plane's base URL as given (without a trailing /); ConfigError unless it is http(s)://HOST..."""
    where = f" (from {source})" if source else ""
    if not is_http_url(url):
        hint = f"http://{url}" if "://" not in url and url else "http://HOST:PORT or https://HOST"
        raise ConfigError(f"url {url!r}{where} is not an http:// or https:// URL of the control plane: give, for "
                          f"example, {hint}")
    if urllib.parse.urlsplit(url).path.rstrip("/").endswith("/api"):  # every call's path starts with /api
        base = url.rstrip("/")[:-len("/api")]
        raise ConfigError(f"url {url!r}{where} ends in /api: give the control plane's base URL, {base}")
    return url.rstrip("/")


class ConfigError(ValueError):
    """The client cannot be configured: the message says what to give."""


# The TLS files: (setting, config file key, environment variable, flag). None of them: the system trust store.
TLS_FILES = (("ca_file", "caFile", "BERTH_CA_FILE", "--ca-file"),
             ("client_cert", "clientCert", "BERTH_CLIENT_CERT", "--client-cert"),
             ("client_key", "clientKey", "BERTH_CLIENT_KEY", "--client-key"))


@dataclass(frozen=True)
class Settings:
    """Where to send requests and as whom, and where each came from (`flag`, `env BERTH_URL`, `file PATH`,
    `file PATH profile NAME`, `default`). The repr leaves the token out.

    ca_file: the CA that signed the server's certificate (None: the system
    trust store); client_cert and client_key: this client's certificate, for a
    control plane that requires one (--tls-client-ca).
    """

    url: str
    token: str = dc_field(repr=False)  # never in a repr, a log line or a traceback's locals
    sources: dict[str, str] = dc_field(default_factory=dict)
    ca_file: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    profile: str | None = None  # the config file's profile these settings read, if any

    def tls_context(self) -> ssl.SSLContext | None:
        """The SSL context for https:// (None: the default, the system trust store); tls.TlsError names the
        flag, variable or config file key at fault."""
        if not (self.ca_file or self.client_cert or self.client_key):
            return None
        names = {name: self._given_as(name, key, var, flag) for name, key, var, flag in TLS_FILES}
        return tls.client_context(self.ca_file, self.client_cert, self.client_key,
                                  flags=tls.Flags(names["client_cert"], names["client_key"], names["ca_file"]))

    def _given_as(self, name: str, key: str, var: str, flag: str) -> str:
        source = self.sources.get(name, "flag")
        if source.startswith("env "):
            return var
        if source.startswith("file "):
            where, _, profile = source.removeprefix("file ").partition(" profile ")
            return f"{f'profiles.{profile}.' if profile else ''}{key} (config file {where})"
        return flag


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
    _check_strings(doc, path, "")
    profiles = doc.get("profiles", {})
    if not isinstance(profiles, dict) or not all(isinstance(p, dict) for p in profiles.values()):
        raise ConfigError(f'config file {path}: profiles must be an object of objects, e.g. '
                          '{"profiles": {"prod": {"url": ..., "token": ...}}}')
    for name, profile in profiles.items():
        _check_strings(profile, path, f"profiles.{name}.")
    if "profile" in doc and not isinstance(doc["profile"], str):
        raise ConfigError(f"config file {path}: profile must be a string (the name of one of its profiles)")
    return doc


SETTING_KEYS = ("url", "token", *(file_key for _, file_key, _, _ in TLS_FILES))


def _check_strings(doc: Mapping[str, Any], path: Path, prefix: str) -> None:
    for key in SETTING_KEYS:
        if key in doc and not isinstance(doc[key], str):
            raise ConfigError(f"config file {path}: {prefix}{key} must be a string")


def select_profile(doc: Mapping[str, Any], path: Path, name: str | None,
                   environ: Mapping[str, str]) -> tuple[str | None, Mapping[str, Any]]:
    """The profile these settings read (--profile, else BERTH_PROFILE, else the file's "profile") and its keys;
    (None, {}) when none is selected: the file's top-level keys are the default profile."""
    if name:
        chosen, given_as = name, "--profile"
    elif environ.get("BERTH_PROFILE"):
        chosen, given_as = environ["BERTH_PROFILE"], "BERTH_PROFILE"
    else:
        chosen, given_as = doc.get("profile"), "profile"
    if not chosen:
        return None, {}
    profiles = doc.get("profiles", {})
    if chosen not in profiles:
        there = ", ".join(sorted(profiles)) if profiles else "none"
        raise ConfigError(f"{given_as} {chosen}: no such profile in config file {path} (its profiles: {there})")
    return chosen, profiles[chosen]


def resolve_settings(url: str | None = None, token: str | None = None, config_path: str | os.PathLike | None = None,
                     environ: Mapping[str, str] | None = None, *, ca_file: str | None = None,
                     client_cert: str | None = None, client_key: str | None = None,
                     profile: str | None = None) -> Settings:
    """Each setting from the arguments, then the environment, then the config file's profile, then the file's
    top-level keys, each on its own.

    url: BERTH_URL or "url"; token: BERTH_TOKEN or "token"; ca_file:
    BERTH_CA_FILE or "caFile"; client_cert, client_key: BERTH_CLIENT_CERT,
    BERTH_CLIENT_KEY or "clientCert", "clientKey" (a relative path in the file
    is relative to the file). The file is `config_path` (which must exist),
    else `$XDG_CONFIG_HOME/berth/config.json` or `~/.config/berth/config.json`
    (which may be absent). The file may hold named profiles,
    `{"profiles": {"prod": {"url": ..., "token": ...}}, "profile": "prod"}`:
    the one named by `profile`, else BERTH_PROFILE, else the file's "profile"
    is read before the top-level keys; an unknown name is a ConfigError naming
    the profiles there are. The URL defaults to http://127.0.0.1:8080; the
    token has no default.
    """
    env = os.environ if environ is None else environ
    path = Path(config_path) if config_path is not None else default_config_path(env)
    doc = read_config_file(path, required=config_path is not None)
    chosen, profile_doc = select_profile(doc, path, profile, env)
    layers = [(profile_doc, f"file {path} profile {chosen}"), (doc, f"file {path}")]
    given = {"url": url, "token": token, "ca_file": ca_file, "client_cert": client_cert, "client_key": client_key}
    sources: dict[str, str] = {}
    values: dict[str, str | None] = {}
    for name, key, var in (("url", "url", "BERTH_URL"), ("token", "token", "BERTH_TOKEN"),
                           *((name, key, var) for name, key, var, _ in TLS_FILES)):
        if given[name]:
            values[name], sources[name] = given[name], "flag"
        elif env.get(var):
            values[name], sources[name] = env[var], f"env {var}"
        else:
            layer = next(((d, label) for d, label in layers if d.get(key)), None)
            values[name] = None
            if layer is not None:
                in_file = str(layer[0][key])
                values[name], sources[name] = (in_file if name in ("url", "token") else str(path.parent / in_file),
                                               layer[1])
    if values["url"] is None:
        values["url"], sources["url"] = DEFAULT_URL, "default"
    if not values["token"]:
        where = f'to profile {chosen} in {path}' if chosen else f"to {path}"
        raise ConfigError(f'no token: give --token, set BERTH_TOKEN, or write {{"token": "..."}} {where}')
    token = str(values["token"])
    if not (token.isascii() and token.isprintable()):  # a header carries printable ASCII (a CRLF file's token)
        bad = next(ch for ch in token if not (ch.isascii() and ch.isprintable()))
        raise ConfigError(f"the token (from {sources['token']}) holds {bad!r}, which no token has (a line ending "
                          "copied with it?): give it as printable ASCII only")
    return Settings(check_url(str(values["url"]), sources["url"]), str(values["token"]), sources, ca_file=values["ca_file"],
                    client_cert=values["client_cert"], client_key=values["client_key"], profile=chosen)


