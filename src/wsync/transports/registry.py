"""URI scheme → transport class, imported lazily.

Adding a backend is one module with a :class:`~wsync.transports.base.Transport`
subclass that has ``from_uri(uri, options)``, plus one line here.  The engine
never imports a transport module directly.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Protocol

from wsync.errors import UsageError
from wsync.transports.base import Transport
from wsync.uri import SandboxURI, parse, unknown_scheme

#: scheme → "module:ClassName"
SCHEMES: dict[str, str] = {
    "local": "wsync.transports.local:LocalTransport",
    "ssh": "wsync.transports.ssh:SshTransport",
    "sprites": "wsync.transports.sprites:SpritesTransport",
    "e2b": "wsync.transports.e2b:E2BTransport",
    "daytona": "wsync.transports.daytona:DaytonaTransport",
    "cloudflare": "wsync.transports.cloudflare:CloudflareTransport",
    "docker": "wsync.transports.docker:DockerTransport",
    "k8s": "wsync.transports.k8s:K8sTransport",
}

#: (scheme, client) → "module:ClassName": another implementation of a scheme, chosen by
#: the ``client`` option (``--ssh-client``)
VARIANTS: dict[tuple[str, str], str] = {
    ("ssh", "openssh"): "wsync.transports.openssh:OpensshTransport",
}
#: the ``client`` option's values per scheme, the default first
CLIENTS: dict[str, tuple[str, ...]] = {"ssh": ("asyncssh", "openssh")}


class TransportFactory(Protocol):
    def from_uri(self, uri: SandboxURI, options: Mapping[str, Any]) -> Transport: ...


def factory_for(scheme: str, client: str | None = None) -> TransportFactory:
    target = SCHEMES.get(scheme)
    if client is not None and target is not None:
        clients = CLIENTS.get(scheme, ())
        if client not in clients:
            what = f"one of {', '.join(clients)}" if clients else "not chosen"
            raise UsageError(f"{scheme}: no client {client!r} (it is {what})")
        target = VARIANTS.get((scheme, client), target)
    if target is None:
        raise unknown_scheme(scheme, SCHEMES)
    module_name, _, class_name = target.partition(":")
    module = importlib.import_module(module_name)
    factory: TransportFactory = getattr(module, class_name)
    return factory


def open_transport(
    raw_or_uri: str | SandboxURI, options: Mapping[str, Any] | None = None
) -> tuple[SandboxURI, Transport]:
    """Parse a sandbox URI and build its transport (no connection is made yet).

    ``options["chaos"]`` (a :class:`wsync.chaos.FaultPlan` spec such as ``"all"``)
    wraps the transport in the fault injector: a demo and testing knob.
    """
    options = options or {}
    uri = parse(raw_or_uri, SCHEMES) if isinstance(raw_or_uri, str) else raw_or_uri
    client = options.get("ssh_client") if uri.scheme == "ssh" else None
    transport = factory_for(uri.scheme, client).from_uri(uri, options)
    chaos = options.get("chaos")
    if chaos:
        from wsync.chaos import wrap

        transport = wrap(transport, chaos)
    return uri, transport
