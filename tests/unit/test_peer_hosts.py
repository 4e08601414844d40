"""PeerHostPolicy and is_loopback_host: every entry kind, every refusal, and properties
checked against ``ipaddress`` directly. Pure: no DNS, no sockets."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pushsvc.peer_hosts import InvalidPeerHost, PeerHostPolicy, is_loopback_host, parse_address

LOOPBACK = ["127.0.0.1", "127.255.255.254", "127.0.1.1", "::1", "::ffff:127.0.0.1"]
EMPTY = PeerHostPolicy.build([])

# ---------------------------------------------------------------- building


@pytest.mark.parametrize(
    "entry",
    ["10.0.0.5", "10.0.0.0/8", "fd00::/8", "fd00::5", "2001:db8::/32", "0.0.0.0/0", "::/0", "192.168.1.0/24",
     "10.0.0.0/255.0.0.0", "fe80::1%eth0", "fe80::/10", "::ffff:10.0.0.0/104", "*",
     "decode-0", "decode-0.example.internal", "Decode-0.Example.Internal.", "_svc.example", "a" * 63 + ".b",
     "x1", "host.123abc"],
)
def test_valid_entries_build(entry: str) -> None:
    PeerHostPolicy.build([entry])


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ("", "is not an IP address, a CIDR network"),
        (" 10.0.0.1", "is not an IP address, a CIDR network"),
        ("10.0.0.256", "is not an IP address, a CIDR network"),
        ("10.1", "is not an IP address, a CIDR network"),
        ("10.0.0.0/33", "is not an IP address, a CIDR network"),
        ("10.0.0.0/", "is not an IP address, a CIDR network"),
        ("/8", "is not an IP address, a CIDR network"),
        ("10.0.0.0/8/8", "is not an IP address, a CIDR network"),
        ("host/8", "is not an IP address, a CIDR network"),
        ("fd00::/129", "is not an IP address, a CIDR network"),
        ("10.0.0.1/8", "has host bits set; did you mean 10.0.0.0/8?"),
        ("fd00::1/8", "did you mean fd00::/8?"),
        ("*.example.com", "wildcard patterns are not supported"),
        ("10.0.0.0/8,10.1.0.0/16", "is not an IP address, a CIDR network"),
        ("**", "wildcard patterns are not supported"),
        ("[fd00::1]", "is not an IP address, a CIDR network"),
        ("host:8472", "is not an IP address, a CIDR network"),
        ("http://host", "is not an IP address, a CIDR network"),
        ("-host", "is not an IP address, a CIDR network"),
        ("host-", "is not an IP address, a CIDR network"),
        ("a..b", "is not an IP address, a CIDR network"),
        (".", "is not an IP address, a CIDR network"),
        ("a" * 64, "is not an IP address, a CIDR network"),
        (("a" * 60 + ".") * 5, "is not an IP address, a CIDR network"),
        ("host name", "is not an IP address, a CIDR network"),
        ("h\u00f6st", "is not an IP address, a CIDR network"),
        ("\u212a8s.local", "is not an IP address, a CIDR network"),  # the Kelvin sign lowercases to "k"
        ("a\x00b", "is not an IP address, a CIDR network"),
    ],
)
def test_invalid_entries_are_refused_with_a_reason(entry: str, words: str) -> None:
    with pytest.raises(InvalidPeerHost) as info:
        PeerHostPolicy.build(["10.0.0.0/8", entry])
    assert words in str(info.value)
    assert repr(entry) in str(info.value)


def test_invalid_peer_host_is_a_value_error() -> None:
    assert issubclass(InvalidPeerHost, ValueError)


# ---------------------------------------------------------------- deciding


def test_empty_allows_loopback_only() -> None:
    for address in LOOPBACK:
        assert EMPTY.allows("localhost", [address])
        assert EMPTY.allows(address, [])
    assert not EMPTY.allows("10.0.0.5", [])
    assert not EMPTY.allows("decode-0", ["10.0.0.5"])
    assert not EMPTY.allows("0.0.0.0", [])  # a wildcard dials this host, but it is not loopback
    assert not EMPTY.allows("::", [])


def test_nothing_resolved_is_refused() -> None:
    assert not EMPTY.allows("localhost", [])
    assert not PeerHostPolicy.build(["10.0.0.0/8"]).allows("decode-0", [])


def test_any_host() -> None:
    policy = PeerHostPolicy.build(["*"])
    assert policy.allows("anything.example", ["203.0.113.9"])
    assert policy.allows("anything", [])
    assert policy.allows("not even parseable", ["garbage"])
    assert PeerHostPolicy.build(["10.0.0.0/8", "*"]).allows("x", ["198.51.100.1"])


def test_networks_and_addresses() -> None:
    policy = PeerHostPolicy.build(["10.0.0.0/8", "192.168.7.9", "fd00::/8", "2001:db8::1"])
    assert policy.allows("d", ["10.1.2.3"])
    assert policy.allows("d", ["10.255.255.255", "10.0.0.0"])
    assert not policy.allows("d", ["11.0.0.1"])
    assert policy.allows("d", ["192.168.7.9"])
    assert not policy.allows("d", ["192.168.7.10"])
    assert policy.allows("d", ["fd12:3456::1"])
    assert not policy.allows("d", ["fe80::1"])
    assert policy.allows("d", ["2001:db8::1"])
    assert not policy.allows("d", ["2001:db8::2"])
    # IP literals given as the name count as their own address.
    assert policy.allows("10.9.9.9", [])
    assert not policy.allows("11.9.9.9", [])
    assert not policy.allows("10.9.9.9", ["11.0.0.1"])


def test_every_resolved_address_must_be_allowed() -> None:
    # A name that resolves into the allowed network and elsewhere could be dialled at the
    # other address: refused.
    policy = PeerHostPolicy.build(["10.0.0.0/8"])
    assert policy.allows("d", ["10.0.0.1", "10.0.0.2"])
    assert not policy.allows("d", ["10.0.0.1", "172.16.0.1"])
    assert not policy.allows("d", ["172.16.0.1", "10.0.0.1"])
    assert policy.allows("d", ["10.0.0.1", "127.0.0.1", "::1"])


def test_unparseable_addresses_are_refused() -> None:
    policy = PeerHostPolicy.build(["0.0.0.0/0", "::/0"])
    assert policy.allows("d", ["10.0.0.1", "fd00::1"])
    for bad in ["", "10.0.0.256", "10.1", "host", "[::1]", " 10.0.0.1", "10.0.0.1:80"]:
        assert not policy.allows("d", [bad]), bad
        assert not policy.allows("d", ["10.0.0.1", bad]), bad


def test_listed_names_match_case_insensitively_whatever_they_resolve_to() -> None:
    policy = PeerHostPolicy.build(["Decode-0.Example.Internal."])
    for name in ["decode-0.example.internal", "DECODE-0.EXAMPLE.INTERNAL", "decode-0.example.internal."]:
        assert policy.allows(name, ["203.0.113.5"])
        assert policy.allows(name, [])
    assert not policy.allows("decode-1.example.internal", ["203.0.113.5"])
    assert not policy.allows("decode-0.example", ["203.0.113.5"])
    assert not policy.allows("evil.decode-0.example.internal", ["203.0.113.5"])
    assert not policy.allows("decode-0.example.internal.evil", ["203.0.113.5"])
    assert not policy.allows("decode-0.example.internal..", ["203.0.113.5"])


def test_non_ascii_names_never_match() -> None:
    # str.lower folds the Kelvin sign into "k"; the resolver would IDNA-encode the name
    # into a different one altogether.
    policy = PeerHostPolicy.build(["k8s.local"])
    assert policy.allows("K8S.local", ["203.0.113.5"])
    assert not policy.allows("\u212a8s.local", ["203.0.113.5"])


def test_names_do_not_allow_addresses_and_addresses_do_not_allow_names() -> None:
    by_name = PeerHostPolicy.build(["decode-0"])
    assert not by_name.allows("other", ["10.0.0.1"])
    by_address = PeerHostPolicy.build(["10.0.0.1"])
    assert by_address.allows("decode-0", ["10.0.0.1"])
    assert not by_address.allows("decode-0", ["10.0.0.2"])


def test_ipv4_mapped_addresses_compare_as_ipv4() -> None:
    policy = PeerHostPolicy.build(["10.0.0.0/8"])
    assert policy.allows("d", ["::ffff:10.1.2.3"])
    assert not policy.allows("d", ["::ffff:11.1.2.3"])
    mapped_entry = PeerHostPolicy.build(["::ffff:10.0.0.0/104"])
    assert mapped_entry.allows("d", ["10.1.2.3"]) and mapped_entry.allows("d", ["::ffff:10.1.2.3"])
    assert not mapped_entry.allows("d", ["11.0.0.1"])
    assert PeerHostPolicy.build(["::ffff:10.0.0.5"]).allows("d", ["10.0.0.5"])
    # A connection to a mapped address goes over IPv4: an IPv6 network does not hold it.
    assert not PeerHostPolicy.build(["::/0"]).allows("d", ["::ffff:10.0.0.1"])
    assert PeerHostPolicy.build(["::/0"]).allows("d", ["2001:db8::1"])


def test_zone_ids_are_ignored() -> None:
    assert PeerHostPolicy.build(["fe80::/10"]).allows("d", ["fe80::1%eth0"])
    assert PeerHostPolicy.build(["fe80::1%eth0"]).allows("d", ["fe80::1%eth1", "fe80::1"])
    assert not PeerHostPolicy.build(["fe80::1%eth0"]).allows("d", ["fe80::2%eth0"])


def test_repr_shows_the_policy() -> None:
    assert repr(PeerHostPolicy.build(["*"])) == "<PeerHostPolicy any host>"
    assert repr(PeerHostPolicy.build(["b", "10.0.0.0/8"])) == "<PeerHostPolicy loopback + ['b', '10.0.0.0/8']>"


# ---------------------------------------------------------------- loopback bind hosts


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "::1", "localhost", "LOCALHOST", "localhost.",
                                  "::ffff:127.0.0.1", "0:0:0:0:0:0:0:1"])
def test_loopback_hosts(host: str) -> None:
    assert is_loopback_host(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.0.0.5", "128.0.0.1", "::2", "fe80::1",
                                  "myhost", "localhost.example", "localhost6", "127.0.0.1.", " 127.0.0.1",
                                  "[::1]", "2130706433", "\u212aocalhost", "l\u043ecalhost"])
def test_not_loopback_hosts(host: str) -> None:
    assert not is_loopback_host(host)


# ---------------------------------------------------------------- properties

ipv4 = st.ip_addresses(v=4)
ipv6 = st.ip_addresses(v=6)
addresses = st.one_of(ipv4, ipv6)


MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")


@st.composite
def networks(draw: st.DrawFn) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    address = draw(addresses)
    prefix = draw(st.integers(0, address.max_prefixlen))
    if isinstance(address, ipaddress.IPv4Address) and draw(st.booleans()):
        return ipaddress.ip_network(f"::ffff:{address}/{96 + prefix}", strict=False)  # IPv4-mapped
    return ipaddress.ip_network(f"{address}/{prefix}", strict=False)


def _unmapped(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _contains(network: ipaddress.IPv4Network | ipaddress.IPv6Network, address) -> bool:
    """The spec: IPv4-mapped addresses, and IPv4-mapped networks of /96 or longer, are IPv4."""
    if isinstance(network, ipaddress.IPv6Network) and network.prefixlen >= 96 and network.subnet_of(MAPPED):
        v4 = network.network_address.ipv4_mapped
        network = ipaddress.IPv4Network(f"{v4}/{network.prefixlen - 96}")
    return _unmapped(address) in network


def _is_loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return _unmapped(address).is_loopback


entries = st.one_of(
    st.text(max_size=20),
    st.text(alphabet="abcdefXYZ0123456789.-_*/:%", max_size=20),
    addresses.map(str),
    networks().map(str),
    st.just("*"),
)


@given(st.lists(entries, max_size=4))
def test_build_refuses_only_with_invalid_peer_host(items: list[str]) -> None:
    try:
        policy = PeerHostPolicy.build(items)
    except InvalidPeerHost as exc:
        assert str(exc)
        return
    assert policy.any_host == ("*" in items)


@given(st.lists(networks(), max_size=3), addresses)
def test_an_address_is_allowed_iff_loopback_or_in_a_listed_network(nets, address) -> None:
    policy = PeerHostPolicy.build([str(n) for n in nets])
    expected = _is_loopback(address) or any(_contains(n, address) for n in nets)
    assert policy.allows("unlisted-name", [str(address)]) is expected
    assert policy.allows(str(address), []) is expected


@given(st.lists(entries, max_size=4), st.lists(addresses, max_size=3), st.text(max_size=12))
def test_allowed_means_every_address_allowed_and_loopback_always_is(items, addrs, name) -> None:
    try:
        policy = PeerHostPolicy.build(items)
    except InvalidPeerHost:
        return
    texts = [str(a) for a in addrs]
    for loopback in LOOPBACK:
        assert policy.allows("unlisted-name", [loopback])
    listed = policy.any_host or (name.isascii() and name.lower().removesuffix(".") in policy.names)
    if not listed and parse_address(name) is None:
        each = [policy.allows(name, [t]) for t in texts]
        assert policy.allows(name, texts) is (bool(texts) and all(each))


@given(st.lists(entries, max_size=4), st.lists(entries, max_size=2), st.text(max_size=12),
       st.lists(addresses.map(str), max_size=3))
def test_more_entries_never_allow_less(items, more, name, addrs) -> None:
    try:
        smaller = PeerHostPolicy.build(items)
        larger = PeerHostPolicy.build(items + more)
    except InvalidPeerHost:
        return
    if smaller.allows(name, addrs):
        assert larger.allows(name, addrs)


@given(addresses)
def test_is_loopback_host_agrees_with_ipaddress(address) -> None:
    assert is_loopback_host(str(address)) is _is_loopback(address)
    assert is_loopback_host(address.exploded) is _is_loopback(address)


@given(st.text(max_size=30))
def test_is_loopback_host_and_allows_never_raise(text: str) -> None:
    is_loopback_host(text)
    EMPTY.allows(text, [text])
