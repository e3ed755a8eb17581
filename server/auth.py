"""API keys: who may call the Embedder service and the HTTP door.

With --api-key, POLLEN_API_KEY or --api-key-file, a client presents one of the keys as a bearer
token: HTTP `Authorization: Bearer KEY`, gRPC metadata `authorization: Bearer KEY`. Without one it
gets HTTP 401 (an OpenAI-style error, with WWW-Authenticate) or gRPC UNAUTHENTICATED. Every method
of pollen.v1.Embedder and every HTTP route but /health (and /metrics, unless --metrics-auth) needs
a key; the gRPC health and reflection services stay open, so probes and grpcurl's `list` work.

Keys are secrets, kept so:
- never logged, echoed in an error or reported by Info; only their count is logged;
- compared in constant time: each presented token is hashed (SHA-256) and its digest compared
  with every key's digest by hmac.compare_digest, so neither the matching key nor any key's
  length shows in the time taken; a frontend holds the digests only;
- never on a command line: the supervisor reads them once (`hand_down`: flag, variable, file),
  checks them and puts them in the environment its frontends inherit (KEYS_ENV), which only the
  same user can read; ServeConfig.to_dict(), which becomes each child's argv, leaves them out.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os

log = logging.getLogger("pollen.auth")

# The keys, one a line, for the frontends to inherit; set (or removed) by hand_down in the supervisor.
KEYS_ENV = "_POLLEN_FRONTEND_API_KEYS"
REALM = 'Bearer realm="pollen"'


class ApiKeys:
    """The accepted keys, as SHA-256 digests. False when there are none (no authentication)."""

    __slots__ = ("_digests",)

    def __init__(self, keys: list[str]):
        self._digests = tuple(hashlib.sha256(k.encode()).digest() for k in keys)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._digests)} keys)"

    def accepts(self, token: str) -> bool:
        """Whether `token` is one of the keys, in time independent of which key and of their lengths."""
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        found = False
        for known in self._digests:  # every key, no early exit
            found |= hmac.compare_digest(known, digest)
        return found

    def check(self, authorization: str | None) -> str | None:
        """None when `authorization` ("Bearer KEY") carries a key; else why not, for the client."""
        if not authorization:
            return "this server needs an API key: send it as Authorization: Bearer KEY"
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "the Authorization header (or metadata) must be Bearer KEY"
        if not self.accepts(token.strip()):
            return "the API key is not valid"
        return None


def read_keys(api_key: str | None, api_key_file: str | None) -> list[str]:
    """The keys of --api-key (comma-separated) and --api-key-file (one a line, # for comments).
    ValueError, never quoting a key, when a source holds none or a key cannot travel in a header."""
    keys: list[str] = []
    if api_key is not None:
        given = [k.strip() for k in api_key.split(",") if k.strip()]
        if not given:
            raise ValueError("--api-key (or POLLEN_API_KEY) is set but holds no key")
        keys += _checked(given, "--api-key (or POLLEN_API_KEY)")
    if api_key_file:
        try:
            with open(api_key_file, encoding="utf-8") as f:
                lines = [line.strip() for line in f]
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--api-key-file {api_key_file}: cannot read it: {exc}") from None
        given = [line for line in lines if line and not line.startswith("#")]
        if not given:
            raise ValueError(f"--api-key-file {api_key_file} holds no key (one a line; # starts a comment)")
        keys += _checked(given, f"--api-key-file {api_key_file}")
    return keys


def _checked(keys: list[str], source: str) -> list[str]:
    for n, key in enumerate(keys, 1):
        if not all(33 <= ord(c) <= 126 and c != "," for c in key):
            raise ValueError(f"{source}: key {n} holds a character other than printable ASCII (no spaces, no "
                             "commas): keys travel in HTTP headers and gRPC metadata")
    return keys


def hand_down(cfg) -> ApiKeys:
    """In the supervisor, before any child starts: read and check cfg's keys and put them where
    the frontends find them (KEYS_ENV); none: the variable is removed and nothing is checked."""
    keys = read_keys(cfg.api_key, cfg.api_key_file)
    if cfg.metrics_auth and not keys:
        raise ValueError("--metrics-auth needs API keys: --api-key, POLLEN_API_KEY or --api-key-file")
    if keys:
        os.environ[KEYS_ENV] = "\n".join(keys)
        log.info("API keys: %d; the Embedder service and /v1/*%s need one", len(keys),
                 " and /metrics" if cfg.metrics_auth else "")
    else:
        os.environ.pop(KEYS_ENV, None)
    return ApiKeys(keys)


def without_keys(environ) -> dict[str, str]:
    """An environment for a child that needs no keys (a worker): the keys' variables left out."""
    return {k: v for k, v in environ.items() if k not in (KEYS_ENV, "POLLEN_API_KEY")}


def inherited() -> ApiKeys:
    """In a frontend: the keys the supervisor handed down (none: no authentication)."""
    return ApiKeys([k for k in os.environ.get(KEYS_ENV, "").split("\n") if k])
