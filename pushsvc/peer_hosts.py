"""Which hosts a daemon may dial: the ``allowed_peer_hosts`` decision, with no I/O.

Both legs of a transfer make the daemon connect where someone else says: D dials the P
host a client request's ``kv_transfer_params`` name, P dials the D host a ``PUSH_REG``
names. Unchecked, that lets anyone who can send a request make the daemon open TCP
connections anywhere its network reaches. ``PeerHostPolicy`` decides from a host name and
the addresses it resolved to; it does no DNS itself, so the caller resolves once, asks,
and connects to an address it asked about (a second lookup could answer differently).

Entries are IP addresses, CIDR networks (``10.0.0.0/8``, ``fd00::/8``), host names
(compared case-insensitively, a trailing dot ignored) or ``"*"`` (any host). Loopback
(127.0.0.0/8, ::1) is always allowed, so an empty list means loopback only. IPv6 zone ids
(``%eth0``) are ignored. An IPv4-mapped address (``::ffff:10.0.0.5``) is the IPv4 address it
carries, since that is where a connection to it goes; so is an IPv4-mapped network of /96
or longer, while a wider IPv6 network (``::/0``) holds IPv6 addresses only.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

ANY_HOST = "*"

_LOOPBACK: tuple[Network, ...] = (ipaddress.IPv4Network("127.0.0.0/8"), ipaddress.IPv6Network("::1/128"))
_LOOPBACK_NAMES = frozenset({"localhost"})
_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")
# RFC 1123 labels, plus "_", which some internal DNS zones use.
_LABEL = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?")
_MAX_NAME = 253


class InvalidPeerHost(ValueError):
    """An entry is none of: an IP address, a CIDR network, a host name, ``"*"``."""


@dataclass(frozen=True)
class PeerHostPolicy:
    """Allowed peers: any host, or these names and networks (plus loopback)."""

    any_host: bool
    names: frozenset[str]
    networks: tuple[Network, ...]

    @classmethod
    def build(cls, entries: Iterable[str]) -> PeerHostPolicy:
        """Parse ``allowed_peer_hosts``; raise ``InvalidPeerHost`` for the first bad entry."""
        any_host = False
        names: set[str] = set()
        networks: list[Network] = []
        for entry in entries:
            if entry == ANY_HOST:
                any_host = True
            elif "/" in entry:
                networks.append(_parse_network(entry))
            elif (address := parse_address(entry)) is not None:
                networks.append(ipaddress.ip_network(address))
            else:
                names.add(_parse_name(entry))
        return cls(any_host=any_host, names=frozenset(names), networks=tuple(networks))

    def allows(self, name: str, addresses: Sequence[str]) -> bool:
        """May the daemon dial ``name``, which resolved to ``addresses``?

        Yes if any host is allowed, if ``name`` itself is listed, or if every address lies
        in a listed network or address or in loopback. An IP literal given as ``name``
        counts as one of its own addresses. No address at all (nothing resolved) is a no,
        and so is an address that does not parse.
        """
        if self.any_host:
            return True
        if (normalized := _normalize_name(name)) and normalized in self.names:
            return True
        checked = list(addresses)
        if parse_address(name) is not None:
            checked.append(name)
        return bool(checked) and all(self._allows_address(a) for a in checked)

    def _allows_address(self, text: str) -> bool:
        address = parse_address(text)
        if address is None:
            return False
        return any(address in net for net in _LOOPBACK) or any(address in net for net in self.networks)

    def __repr__(self) -> str:
        if self.any_host:
            return "<PeerHostPolicy any host>"
        listed = sorted(self.names) + [str(n) for n in self.networks]
        return f"<PeerHostPolicy loopback + {listed}>"


def is_loopback_host(host: str) -> bool:
    """Is ``host``, a bind address, reachable from this machine only?

    ``localhost`` and addresses in 127.0.0.0/8 or ::1 are. A wildcard (``0.0.0.0``, ``::``,
    ``""``) is not: it listens on every interface. Other names are not either: deciding
    would take a DNS lookup, and a name can resolve elsewhere tomorrow.
    """
    if _normalize_name(host) in _LOOPBACK_NAMES:
        return True
    address = parse_address(host)
    return address is not None and any(address in net for net in _LOOPBACK)


def parse_address(text: str) -> Address | None:
    """``text`` as an IP address (zone id dropped, IPv4-mapped unwrapped), or None."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address.scope_id is not None:
            return ipaddress.IPv6Address(address.packed)
    return address


def _invalid(entry: str) -> InvalidPeerHost:
    hint = (' (wildcard patterns are not supported: list the names, a network, or "*" for any host)'
            if "*" in entry else "")
    return InvalidPeerHost(f"{entry!r} is not an IP address, a CIDR network (10.0.0.0/8, fd00::/8) "
                           f'or a host name, nor "*"{hint}')


def _parse_network(entry: str) -> Network:
    address, _, prefix = entry.partition("/")
    if parse_address(address) is None or not prefix:
        raise _invalid(entry)
    bare = f"{address.split('%', 1)[0]}/{prefix}"  # zone ids are ignored
    try:
        network = ipaddress.ip_network(bare)
    except ValueError as exc:
        if "has host bits set" in str(exc):
            loose = ipaddress.ip_network(bare, strict=False)
            raise InvalidPeerHost(f"{entry!r} has host bits set; did you mean {loose}?") from None
        raise _invalid(entry) from None
    if isinstance(network, ipaddress.IPv6Network) and network.prefixlen >= 96 and network.subnet_of(_MAPPED):
        # ::ffff:10.0.0.0/104 is 10.0.0.0/8; addresses are compared unwrapped.
        v4 = network.network_address.ipv4_mapped
        assert v4 is not None
        return ipaddress.IPv4Network(f"{v4}/{network.prefixlen - 96}")
    return network


def _parse_name(entry: str) -> str:
    name = _normalize_name(entry)
    labels = name.split(".")
    # An all-numeric last label is a mistyped address (10.0.0.256, 10.1), not a name.
    if not name or len(name) > _MAX_NAME or not all(map(_LABEL.fullmatch, labels)) or labels[-1].isdigit():
        raise _invalid(entry)
    return name


def _normalize_name(name: str) -> str:
    """Lower case, one trailing dot dropped; "" for a name that is not ASCII.

    Non-ASCII never matches: ``str.lower`` folds some of it into ASCII (the Kelvin sign
    becomes "k"), while the resolver IDNA-encodes it into another name altogether.
    """
    if not name.isascii():
        return ""
    name = name.lower()
    return name[:-1] if name.endswith(".") else name
