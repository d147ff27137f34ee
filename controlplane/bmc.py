"""The out-of-band reset of a node through its BMC (Redfish, with the sushy client), for `cleaning: redfish`.

Owns the node declaration's `bmc: {redfishUrl, systemId, credentialsFile, caFile}`:

- `credentialsFile` is JSON `{"username": ..., "password": ...}`, readable by
  the control plane's user only (mode 0600 or 0400): it is checked when a
  `Bmc` is made, and the message says what to fix. The password is kept in
  memory only for the call, never logged, never put into an error message
  (any text that comes back from the BMC or the HTTP stack is scrubbed of
  it), and `repr(Bmc)` does not show it.
- An https BMC's certificate is verified: against the system's CAs, or
  against `caFile`, a PEM bundle of the private CA that signed it (the usual
  case for BMCs), checked when the `Bmc` is made. There is no way to turn
  verification off: the credentials go to whoever answers.
- `reset(boot_override)` sets a one-time boot source override when asked
  (e.g. "Pxe", for a re-image by the network) and then resets the system:
  ForceRestart (PowerCycle where the BMC offers no ForceRestart), or On when
  the system is off. It returns what was issued and the power states seen
  before and after (`BmcResult`). sushy is synchronous; `reset_async` runs
  the same call in a worker thread.
- Every failure is one `BmcError` naming the BMC URL (and the system) and
  what to check: the URL and the network path, the credentials, the
  systemId (with the systems the BMC lists), the allowed values.
"""
from __future__ import annotations

import asyncio
import json
import os
import ssl
import stat
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import structlog

try:
    import sushy
    from sushy import auth as sushy_auth
    from sushy import exceptions as sushy_exc
except ImportError:  # pragma: no cover - sushy is a dependency; this says so if it is missing
    sushy = None

log = structlog.get_logger("berth.controlplane.bmc")

SYSTEMS = "/redfish/v1/Systems/"


class BmcError(Exception):
    """The BMC could not be used as asked; the message names the BMC and what to check (never a credential)."""


@dataclass(frozen=True)
class BmcResult:
    """What reset issued: the boot override (or None), the reset type, and the power state before and after."""

    redfish_url: str
    system_id: str
    boot_override: str | None
    reset: str
    power_before: str | None
    power_after: str | None


@dataclass(frozen=True, repr=False)
class _Credentials:
    username: str
    password: str

    def __repr__(self) -> str:
        return f"_Credentials(username={self.username!r}, password=***)"


def read_credentials(path: str | Path) -> _Credentials:
    """The BMC credentials file, checked: present, not group/world accessible, JSON with username and password."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise BmcError(f"the BMC credentials file {path} does not exist: create it as JSON "
                       '{"username": ..., "password": ...} with mode 0600') from None
    except OSError as exc:
        raise BmcError(f"cannot read the BMC credentials file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise BmcError(f"the BMC credentials file {path} is not a regular file")
    if st.st_mode & 0o077:
        raise BmcError(f"the BMC credentials file {path} has mode {stat.filemode(st.st_mode)}, open to group or "
                       f"others: `chmod 600 {path}` (and make it owned by the control plane's user)")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise BmcError(f"cannot read the BMC credentials file {path}: {exc.strerror}") from None
    except (ValueError, UnicodeDecodeError):
        raise BmcError(f"the BMC credentials file {path} is not JSON: write "
                       '{"username": ..., "password": ...}') from None
    if not isinstance(doc, dict) or not all(isinstance(doc.get(k), str) and doc.get(k) for k in ("username",
                                                                                                 "password")):
        raise BmcError(f"the BMC credentials file {path} needs non-empty string fields \"username\" and "
                       "\"password\"")
    return _Credentials(doc["username"], doc["password"])


def check_ca_file(path: Path, redfish_url: str) -> None:
    """bmc.caFile: for an https BMC, a readable PEM bundle holding at least one CA certificate."""
    if not redfish_url.startswith("https://"):
        raise BmcError(f"bmc.caFile is for an https BMC; bmc.redfishUrl {redfish_url!r} is http: give the BMC's "
                       "https URL, or leave caFile out")
    try:
        ssl.create_default_context(cafile=str(path))
    except FileNotFoundError:
        raise BmcError(f"bmc.caFile {path} does not exist: give the PEM file of the CA that signed the BMC's "
                       "certificate") from None
    except OSError as exc:  # ssl.SSLError is one: not PEM, or no certificate in it
        reason = (exc.reason or str(exc)).lower().replace("_", " ") if isinstance(exc, ssl.SSLError) else exc.strerror
        raise BmcError(f"bmc.caFile {path} is not a PEM bundle of CA certificates ({reason}): give the file with "
                       "the -----BEGIN CERTIFICATE----- block of the CA that signed the BMC's certificate") from None


def _reason(text: str) -> str:
    """The TLS library's own words in a requests error, e.g. 'self-signed certificate in certificate chain'."""
    start = text.find("certificate verify failed")
    if start < 0:
        return "certificate verify failed"
    end = min((i for i in (text.find(")", start), text.find("'", start), text.find('"', start)) if i > 0),
              default=len(text))
    return text[start:end].strip(" :")


def _base_url(redfish_url: str) -> str:
    """scheme://host[:port] of a redfishUrl (a trailing /redfish/v1 is allowed); BmcError if it is not one."""
    parts = urllib.parse.urlsplit(redfish_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BmcError(f"bmc.redfishUrl {redfish_url!r} is not an http(s) URL such as https://bmc.example:443")
    if parts.username is not None or parts.password is not None:
        raise BmcError("bmc.redfishUrl carries credentials: put them in bmc.credentialsFile, not in the URL")
    if parts.path.rstrip("/") not in ("", "/redfish/v1", "/redfish") or parts.query or parts.fragment:
        raise BmcError(f"bmc.redfishUrl {redfish_url!r}: give the BMC's address only (scheme://host[:port])")
    return f"{parts.scheme}://{parts.netloc}"


class Bmc:
    """One node's BMC: `reset()` (blocking) and `reset_async()` (in a thread)."""

    def __init__(self, redfish_url: str, system_id: str, credentials_file: str | Path, *,
                 ca_file: str | Path | None = None, timeout_s: float = 30.0) -> None:
        if sushy is None:
            raise BmcError("cleaning: redfish needs the sushy package: `pip install sushy`")
        self.redfish_url = _base_url(redfish_url)
        if not system_id or "/" in system_id.removeprefix(SYSTEMS).strip("/"):
            raise BmcError(f"bmc.systemId {system_id!r} must be the Redfish system's id (the last part of "
                           f"{SYSTEMS}<id>)")
        self.system_id = system_id.removeprefix(SYSTEMS).strip("/")
        self.credentials_file = Path(credentials_file)
        self.ca_file = Path(ca_file) if ca_file is not None else None
        if self.ca_file is not None:
            check_ca_file(self.ca_file, self.redfish_url)
        self.timeout_s = timeout_s
        read_credentials(self.credentials_file)  # fail at declaration time, not at the first cleaning

    @property
    def verify(self) -> bool | str:
        """What requests verifies the BMC's certificate against: the CA bundle given, or the system's."""
        return str(self.ca_file) if self.ca_file is not None else True

    def __repr__(self) -> str:
        return f"Bmc({self.redfish_url!r}, {self.system_id!r}, {str(self.credentials_file)!r})"

    @property
    def system_path(self) -> str:
        return SYSTEMS + urllib.parse.quote(self.system_id, safe="")

    def reset(self, boot_override: str | None = None) -> BmcResult:
        """Set a one-time boot override (when given), then ForceRestart the system (On when it is off)."""
        creds = read_credentials(self.credentials_file)
        where = f"the BMC at {self.redfish_url} (system {self.system_id})"
        auth = sushy_auth.SessionOrBasicAuth(username=creds.username, password=creds.password)
        root = None
        target = None
        try:
            try:
                root = sushy.Sushy(self.redfish_url, auth=auth, verify=self.verify, read_timeout=self.timeout_s,
                                   connect_timeout=min(10.0, self.timeout_s), server_side_retries=2,
                                   server_side_retries_delay=1)
                system = self._system(root)
                before = _value(system.power_state)
                if boot_override is not None:
                    target = self._boot_target(system, boot_override)
                    system.set_system_boot_options(target=target, enabled=sushy.BootSourceOverrideEnabled.ONCE)
                reset = self._reset_type(system, before)
                system.reset_system(reset)
                system.refresh(force=True)
                after = _value(system.power_state)
            except BmcError:
                raise
            except sushy_exc.AccessError as exc:
                raise BmcError(f"{where} refused the credentials of {self.credentials_file} "
                               f"(HTTP {exc.status_code}): check the username and password there, and that the "
                               "account may reset systems") from None
            except sushy_exc.ResourceNotFoundError:
                raise BmcError(f"{where}: there is no system {self.system_id!r}; check bmc.systemId"
                               f"{self._listed(root)}") from None
            except sushy_exc.ConnectionError as exc:
                text = _scrub(exc, creds)
                if "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text:
                    trusted = f"the CA bundle {self.ca_file}" if self.ca_file else "the system's CAs"
                    raise BmcError(f"{where}: its certificate is not trusted by {trusted} ({_reason(text)}); "
                                   "give the PEM file of the CA that signed it in bmc.caFile") from None
                raise BmcError(f"cannot reach {where}: {text}; check bmc.redfishUrl, the network "
                               "path to the BMC and (https) its certificate") from None
            except sushy_exc.SushyError as exc:
                raise BmcError(f"{where} failed the reset: {_scrub(exc, creds)}") from None
            except Exception as exc:  # noqa: BLE001 - requests/urllib3 errors sushy does not wrap
                raise BmcError(f"talking to {where} failed ({type(exc).__name__}: {_scrub(exc, creds)}); check "
                               "bmc.redfishUrl and the network path to the BMC") from None
        finally:
            try:
                auth.close()
            except Exception:  # noqa: BLE001 - closing a session is best effort
                pass
        result = BmcResult(self.redfish_url, self.system_id, _value(target) if target else None, _value(reset),
                           before, after)
        log.info("bmc.reset", redfish_url=self.redfish_url, system_id=self.system_id,
                 boot_override=result.boot_override, reset=result.reset, power_before=before, power_after=after)
        return result

    async def reset_async(self, boot_override: str | None = None) -> BmcResult:
        """reset() in a worker thread (sushy blocks)."""
        return await asyncio.to_thread(self.reset, boot_override)

    # -- pieces -----------------------------------------------------------------------------------------------

    def _system(self, root):
        return root.get_system(self.system_path)

    def _listed(self, root) -> str:
        if root is None:
            return ""
        try:
            ids = [m.rstrip("/").rsplit("/", 1)[-1] for m in root.get_system_collection().members_identities]
        except Exception:  # noqa: BLE001 - only a hint for the message
            return ""
        return f" (the BMC lists: {', '.join(sorted(ids)) or 'none'})"

    def _boot_target(self, system, boot_override: str):
        by_value = {s.value.lower(): s for s in sushy.BootSource}
        target = by_value.get(boot_override.lower())
        allowed = system.get_allowed_system_boot_source_values()
        if target is None or target not in allowed:
            names = ", ".join(sorted(s.value for s in allowed))
            raise BmcError(f"the BMC at {self.redfish_url} (system {self.system_id}) offers no boot source "
                           f"{boot_override!r}: it offers {names}")
        return target

    def _reset_type(self, system, power_before: str | None):
        allowed = system.get_allowed_reset_system_values()
        if power_before == _value(sushy.PowerState.OFF):
            wanted = [sushy.ResetType.ON]
        else:
            wanted = [sushy.ResetType.FORCE_RESTART, sushy.ResetType.POWER_CYCLE]
        for reset in wanted:
            if reset in allowed:
                return reset
        names = ", ".join(sorted(r.value for r in allowed))
        raise BmcError(f"the BMC at {self.redfish_url} (system {self.system_id}, power {power_before}) offers "
                       f"none of {', '.join(r.value for r in wanted)} to reset it: it offers {names}")


def _value(v) -> str | None:
    return None if v is None else getattr(v, "value", str(v))


def _scrub(exc: BaseException, creds: _Credentials) -> str:
    text = str(exc) or type(exc).__name__
    return text.replace(creds.password, "***") if creds.password else text
