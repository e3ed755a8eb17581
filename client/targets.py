"""Where a client connects: one server, or replicas that gRPC balances call by call.

`channel_target` turns what the user gave into one gRPC target:

- a gRPC target URI (`dns:///pollen-headless.search:50051`, `ipv4:10.0.0.1:50051,10.0.0.2:50051`,
  `unix:/run/pollen.sock`, ...) or one `host:port`: as it is. gRPC's resolver finds every address
  of a name (a Kubernetes headless Service's name resolves to one per ready pod) and looks again
  when connections fail;
- several `host:port` (a list, or one string with commas): an `ipv4:` list of their addresses
  (`ipv6:` when not every one has an IPv4 address); names among them are resolved once, here.

Every channel gets `SERVICE_CONFIG`: the round_robin policy, which connects to every address and
sends each call to the next ready one, and retries for the unary calls that fail UNAVAILABLE (a
replica that went away: the retry goes to another). A stream is one call on one replica;
embed_stream (client/ordering.py) sends its unanswered messages again on a new stream, which
round_robin places on a replica that is up.
"""
from __future__ import annotations

import json
import socket
from collections.abc import Sequence

# Reconnect quickly after a server restart (gRPC's default back-off grows to two minutes). No
# channelz: per-call statistics for a debug service nobody reads from a client (the server's
# frontends turn it off for the same reason, server/process/frontend.py).
CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000),
                   ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1),
                   ("grpc.enable_channelz", 0))

# Targets gRPC parses itself (a scheme, then its own syntax).
URI_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:", "xds:", "google-c2p:")

_RETRIED = ("Embed", "Tokenize", "Info")  # answers computed again cost time, never correctness
SERVICE_CONFIG = json.dumps({
    "loadBalancingConfig": [{"round_robin": {}}],
    "methodConfig": [{
        "name": [{"service": "pollen.v1.Embedder", "method": m} for m in _RETRIED],
        "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "1s",
                        "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
    }],
})


def describe(target: str | Sequence[str]) -> str:
    """The user's target as one string, for messages."""
    return target if isinstance(target, str) else ",".join(target)


def channel_target(target: str | Sequence[str]) -> str:
    """One gRPC target for `target` (see the module docstring)."""
    if isinstance(target, str):
        if target.startswith(URI_SCHEMES) or "," not in target:
            return target
        target = target.split(",")
    addresses = [a.strip() for a in target if a.strip()]
    if not addresses:
        raise ValueError("no server address given")
    if len(addresses) == 1:
        return channel_target(addresses[0])
    if any(a.startswith(URI_SCHEMES) for a in addresses):
        raise ValueError(f"a list of replicas takes host:port entries, not gRPC target URIs: {addresses!r} "
                         "(one URI such as dns:///name:port or ipv4:a:p,b:p stands alone)")
    return address_list([resolve(a) for a in addresses])


def split_address(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"a replica address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def resolve(address: str) -> tuple[list[str], list[str]]:
    """The IPv4 and IPv6 addresses of one 'host:port', each as gRPC writes it ('1.2.3.4:p', '[::1]:p')."""
    host, port = split_address(address)
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve replica {address!r}: {exc}") from None
    v4 = [f"{sa[0]}:{port}" for family, *_, sa in found if family == socket.AF_INET]
    v6 = [f"[{sa[0]}]:{port}" for family, *_, sa in found if family == socket.AF_INET6]
    return list(dict.fromkeys(v4)), list(dict.fromkeys(v6))


def address_list(resolved: list[tuple[list[str], list[str]]]) -> str:
    """An ipv4: target when every replica has an IPv4 address, else ipv6: when every one has an
    IPv6 address (a gRPC target has one address family)."""
    for scheme, index in (("ipv4:", 0), ("ipv6:", 1)):
        if all(r[index] for r in resolved):
            return scheme + ",".join(dict.fromkeys(a for r in resolved for a in r[index]))
    raise ValueError("the replicas' addresses mix IPv4-only and IPv6-only hosts; one gRPC channel takes one "
                     "family (list addresses of one family, or use a dns:/// name)")


def channel_options(extra: Sequence[tuple] = ()) -> list[tuple]:
    """The options every client channel gets; the caller's `extra` come last and win."""
    return [*CHANNEL_OPTIONS, ("grpc.service_config", SERVICE_CONFIG), *extra]
