"""A Bearer-token service on 127.0.0.1 for the real docker-registry, as ghcr.io and Docker Hub run
one.

The registry (``auth: token:``) answers 401 with ``Bearer realm=…,service=…,scope=…``; the
client asks the realm for a token with Basic credentials; this service checks them and
returns an RS256 JWT whose header carries its signing certificate (``x5c``). The registry
trusts it only because that self-signed certificate is in its ``rootcertbundle``; a token
signed by any other key is refused by the registry itself.
"""

from __future__ import annotations

import base64
import datetime
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

ISSUER = "kvsnap-test-token-issuer"
SERVICE = "kvsnap-test-registry"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass
class SigningKey:
    """An RSA key and a self-signed certificate for it (digital signature usage, as the registry
    requires)."""

    key: rsa.RSAPrivateKey
    cert: x509.Certificate

    @classmethod
    def make(cls, name: str) -> "SigningKey":
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def jwt(self, claims: dict) -> str:
        header = {
            "typ": "JWT",
            "alg": "RS256",
            "x5c": [base64.b64encode(self.cert.public_bytes(serialization.Encoding.DER)).decode()],
        }
        signing_input = (
            f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        )
        signature = self.key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing_input}.{_b64url(signature)}"


def claims_for(
    subject: str, scopes: list[str], service: str = SERVICE, lifetime_s: int = 300
) -> dict:
    """Grant every action asked for on each repository scope (``repository:NAME:ACTIONS``)."""
    access = []
    for scope in scopes:
        kind, _, rest = scope.partition(":")
        name, _, actions = rest.rpartition(":")
        if kind == "repository" and name:
            access.append(
                {"type": kind, "name": name, "actions": [a for a in actions.split(",") if a]}
            )
    now = int(time.time())
    return {
        "iss": ISSUER,
        "sub": subject,
        "aud": service,
        "exp": now + lifetime_s,
        "nbf": now - 10,
        "iat": now,
        "jti": uuid.uuid4().hex,
        "access": access,
    }


@dataclass
class TokenService:
    """Serves ``GET /token`` on 127.0.0.1; ``calls`` records (user, query pairs) of every
    request."""

    users: dict[str, str]
    signer: SigningKey = field(default_factory=lambda: SigningKey.make("kvsnap test token issuer"))
    calls: list = field(default_factory=list)

    def __post_init__(self):
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                url = urlsplit(self.path)
                query = parse_qsl(url.query)
                user = service.basic_user(self.headers.get("Authorization", ""))
                service.calls.append((user, query))
                if url.path != "/token":
                    return self._reply(404, {"errors": [{"code": "NOT_FOUND"}]})
                if user is None:
                    return self._reply(
                        401,
                        {
                            "errors": [
                                {"code": "UNAUTHORIZED", "message": "bad or missing credentials"}
                            ]
                        },
                    )
                claims = claims_for(
                    user, [v for k, v in query if k == "scope"], dict(query).get("service", "")
                )
                token = service.signer.jwt(claims)
                self._reply(200, {"token": token, "access_token": token, "expires_in": 300})

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # keep pytest's output clean
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=self.server.serve_forever, name="token-service", daemon=True
        )
        self.thread.start()

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/token"

    def basic_user(self, header: str) -> str | None:
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            user, _, password = base64.b64decode(value).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return None
        return user if self.users.get(user) == password else None

    def write_bundle(self, path: Path) -> Path:
        path.write_bytes(self.signer.pem())
        return path

    def registry_auth_yaml(self, bundle: Path) -> str:
        return (
            f"auth:\n  token:\n    realm: {self.realm}\n    service: {SERVICE}\n    issuer: "
            f"{ISSUER}\n    rootcertbundle: {bundle}\n"
        )

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
