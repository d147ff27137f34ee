"""common/tls.py: contexts at TLS 1.2 or later, a CA file trusted alone, and failed handshakes (over real loopback
connections) explained as what to change."""
from __future__ import annotations

import asyncio
import ssl

import pytest
from aiohttp import web

from agent.nodeclient import NodeClient, Unreachable
from common import tls
from tests.pki import DAY, Authority

HOUR = DAY / 24


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    return Authority(tmp_path_factory.mktemp("pki"), "unit")


def test_both_sides_refuse_anything_older_than_tls_1_2(ca):
    server = ca.issue("s", hosts=("127.0.0.1",))
    assert (ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_2) == (
        tls.server_context(str(server.cert), str(server.key)).minimum_version,
        tls.client_context().minimum_version, tls.client_context(str(ca.ca_file)).minimum_version)


def test_a_ca_file_is_trusted_alone_and_the_host_name_is_checked(ca):
    ctx = tls.client_context(str(ca.ca_file))
    assert (1, True, ssl.CERT_REQUIRED) == (ctx.cert_store_stats()["x509_ca"], ctx.check_hostname, ctx.verify_mode)


def test_a_client_ca_makes_the_server_require_client_certificates(ca):
    server = ca.issue("s", hosts=("127.0.0.1",))
    assert ssl.CERT_NONE == tls.server_context(str(server.cert), str(server.key)).verify_mode
    assert ssl.CERT_REQUIRED == tls.server_context(str(server.cert), str(server.key), str(ca.ca_file)).verify_mode


def test_an_encrypted_key_is_refused_without_asking_for_a_password(ca, tmp_path):
    from cryptography.hazmat.primitives import serialization

    server = ca.issue("s", hosts=("127.0.0.1",))
    key = serialization.load_pem_private_key(server.key.read_bytes(), None)
    locked = tmp_path / "locked.key"
    locked.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.BestAvailableEncryption(b"secret")))
    with pytest.raises(tls.TlsError, match=f"--tls-key {locked}: the key is encrypted"):
        tls.server_context(str(server.cert), str(locked))


async def node_call_against(site_context: ssl.SSLContext | None, url_scheme: str, client: ssl.SSLContext) -> str:
    """A heartbeat against a real listener on loopback: the TLS advice of the Unreachable it raises."""
    runner = web.AppRunner(web.Application())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=site_context)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    node = NodeClient(f"{url_scheme}://127.0.0.1:{port}", ssl_context=client, timeout_s=5, token="t")
    try:
        await node.heartbeat()
    except Unreachable as exc:
        return exc.tls or ""
    finally:
        await node.close()
        await runner.cleanup()
    raise AssertionError("the heartbeat was answered")


def test_https_to_a_plain_listener_says_it_does_not_speak_tls(ca):
    advice = asyncio.run(node_call_against(None, "https", tls.client_context(str(ca.ca_file))))
    assert "does not speak TLS there: use http://" in advice


def test_a_certificate_for_another_host_says_so(ca):
    other = ca.issue("elsewhere", hosts=("elsewhere.test",))
    advice = asyncio.run(node_call_against(tls.server_context(str(other.cert), str(other.key)), "https",
                                           tls.client_context(str(ca.ca_file))))
    assert "the server's certificate is not for the host in https://127.0.0.1:" in advice


def test_an_untrusted_certificate_says_to_pass_the_ca_file(ca, tmp_path):
    stranger = Authority(tmp_path, "stranger").issue("s", hosts=("127.0.0.1",))
    advice = asyncio.run(node_call_against(tls.server_context(str(stranger.cert), str(stranger.key)), "https",
                                           tls.client_context(str(ca.ca_file))))
    assert "not trusted" in advice and "pass --ca-file (env BERTH_CA_FILE) with the CA that signed it" in advice


@pytest.mark.parametrize("valid, said", [
    ((-10 * DAY, -DAY), ("error", "the certificate expired on {after}; every peer that checks it refuses")),
    ((DAY, 10 * DAY), ("error", "the certificate is not valid until {before}; peers refuse it until then")),
    ((-DAY, 12 * DAY + HOUR), ("warning", "the certificate expires on {after}, in 12 days: renew it")),
    ((-DAY, HOUR), ("warning", "the certificate expires on {after}, within a day: renew it")),
    ((-DAY, 31 * DAY), None),
    ((-DAY, 30 * 365 * DAY), None),  # notAfter in 2056: a GeneralizedTime (UTCTime stops at 2049)
])
def test_a_certificate_expired_not_yet_valid_or_expiring_within_30_days_is_said_at_start(ca, valid, said):
    from cryptography import x509

    issued = ca.issue("dated", hosts=("localhost",), valid=valid)
    cert = x509.load_pem_x509_certificate(issued.cert.read_bytes())
    assert (cert.not_valid_before_utc, cert.not_valid_after_utc) == tls.validity(issued.cert.read_text())
    got = tls.validity_warning(str(issued.cert), "--tls-cert")
    if said is None:
        assert got is None
        return
    level, sentence = said
    dates = {"after": f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC",
             "before": f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC"}
    assert (level, True) == (got[0], got[1].startswith(f"--tls-cert {issued.cert}: " + sentence.format(**dates))), got


def test_a_certificate_whose_dates_cannot_be_read_is_left_to_loading(tmp_path):
    broken = tmp_path / "broken.pem"
    broken.write_text("-----BEGIN CERTIFICATE-----\nMIIBkTCB+wIJAK\n-----END CERTIFICATE-----\n")
    with pytest.raises(ValueError, match="cannot read the certificate's dates"):
        tls.validity(broken.read_text())
    assert tls.validity_warning(str(broken), "--tls-cert") is None
    assert tls.validity_warning(str(tmp_path / "absent.pem"), "--tls-cert") is None
