"""Settings for every test."""

from hypothesis import settings
from hypothesis.database import InMemoryExampleDatabase

# Examples are kept in memory: the tests may run as a user who cannot write
# to the checkout (after a root run of `make test`), and hypothesis's default
# on-disk database would then only warn, which the test settings make an error.
# No deadline: hypothesis's default 200 ms per example is a timed assertion,
# and a busy CI machine fails it at random.
settings.register_profile("mtrace-live", database=InMemoryExampleDatabase(), deadline=None)
settings.load_profile("mtrace-live")


# ---- TLS and basic auth for the metrics endpoint's tests -------------------
import subprocess  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import bcrypt  # noqa: E402
import pytest  # noqa: E402

WEB_USER = "prometheus"
WEB_PASSWORD = "s3cret-scrape"


@dataclass(frozen=True)
class WebTls:
    cert: Path  # self-signed for 127.0.0.1 and localhost: also the CA to trust
    key: Path
    config: Path  # a --web.config.file with TLS and the user's bcrypt hash
    user: str = WEB_USER
    password: str = WEB_PASSWORD


@pytest.fixture(scope="session")
def web_tls(tmp_path_factory: pytest.TempPathFactory) -> WebTls:
    """A certificate made by openssl and a web config using it."""
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = tmp / "server.crt", tmp / "server.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "2", "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert),
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    hashed = bcrypt.hashpw(WEB_PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    config = tmp / "web-config.yml"
    config.write_text(
        "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
        f"basic_auth_users:\n  {WEB_USER}: {hashed}\n"
    )
    return WebTls(cert, key, config)
