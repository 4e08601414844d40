"""The side-channel handshake: preambles, authentication, hellos.

Order of a session's first frames (docs/protocol.md, "Handshake"):

* With a shared secret, both sides send their preamble and an ``AuthChallenge`` at once,
  then the proofs, and only after the peer's proof checked, their ``PeerHello``. Until
  then a frame may hold at most ``PRE_AUTH_MAX_FRAME`` bytes: a stranger cannot make the
  daemon buffer megabytes before it proved anything.
* Without one, the *acceptor* identifies itself first (preamble and hello); the dialer
  reads that and checks the engine it meant to reach before it sends its own hello, so
  D's agent metadata never goes to whoever happens to answer at an address.

The MAC logic is the pure ``protocol/peer_auth.py``; this module does its I/O.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from pushsvc.errors import AuthError, HandshakeError, ProtocolError
from pushsvc.protocol import peer as pp
from pushsvc.protocol.framing import HEADER, PREAMBLE, check_preamble, encode_preamble, frame
from pushsvc.protocol.peer_auth import PeerAuth, Role, new_nonce
from pushsvc.server.session import Session

# AuthChallenge (32-byte nonce, a daemon id) and AuthProof (32-byte MAC) fit with room.
PRE_AUTH_MAX_FRAME = 1024


@dataclass(frozen=True, slots=True)
class PeerIntro:
    """What a finished handshake learned: the peer's hello, and how far to trust it."""

    hello: pp.PeerHello
    minor: int
    authenticated: bool


async def handshake(session: Session, *, daemon_id: str, my_hello: Callable[[], pp.PeerHello],
                    secret: bytes | None, expect_engine: str = "") -> PeerIntro:
    """Run the exchange on a fresh session (the caller bounds it in time)."""
    preamble = encode_preamble(pp.MAGIC, pp.MAJOR, pp.MINOR)
    if secret is not None:
        nonce = new_nonce()
        session.write(preamble + frame(pp.encode(pp.AuthChallenge(nonce=nonce, daemon_id=daemon_id))))
        session.minor = await _read_preamble(session)
        peer_id = await _authenticate(session, secret, daemon_id, nonce)
        session.authenticated = True
        session.send(my_hello())
        hello = await session.read()
        if not isinstance(hello, pp.PeerHello):
            raise ProtocolError(f"expected hello, got {type(hello).__name__}")
        if hello.daemon_id != peer_id:
            raise ProtocolError("hello names another daemon than the one that authenticated")
    elif session.dialed:
        session.write(preamble)
        session.minor = await _read_preamble(session)
        hello = await _first_hello(session)
        if expect_engine and hello.engine_id != expect_engine:
            raise HandshakeError(f"peer is engine {hello.engine_id}, expected {expect_engine}")
        _check_not_self(hello, daemon_id)
        session.send(my_hello())
    else:
        session.write(preamble + frame(pp.encode(my_hello())))
        session.minor = await _read_preamble(session)
        hello = await _first_hello(session)
    _check_not_self(hello, daemon_id)
    return PeerIntro(hello, session.minor, session.authenticated)


async def _read_preamble(session: Session) -> int:
    return check_preamble(await session.reader.readexactly(PREAMBLE.size), pp.MAGIC, pp.MAJOR)


async def _first_hello(session: Session) -> pp.PeerHello:
    msg = await session.read()
    if isinstance(msg, pp.AuthChallenge):
        raise AuthError("auth_required", "peer requires side-channel authentication "
                                         "(set side_channel_secret_file to the deployment's secret)")
    if not isinstance(msg, pp.PeerHello):
        raise ProtocolError(f"expected hello, got {type(msg).__name__}")
    return msg


def _check_not_self(hello: pp.PeerHello, daemon_id: str) -> None:
    if hello.daemon_id == daemon_id:
        raise HandshakeError("connected to ourselves")


async def _read_small(session: Session, what: str) -> pp.PeerMessage:
    """A frame read before the peer authenticated: at most ``PRE_AUTH_MAX_FRAME`` bytes."""
    (length,) = HEADER.unpack(await session.reader.readexactly(HEADER.size))
    if length > PRE_AUTH_MAX_FRAME:
        raise AuthError("auth_missing", f"peer did not authenticate: it sent a {length}-byte frame "
                                        f"where {what} belongs")
    return session.frames.decode(await session.reader.readexactly(length))


async def _authenticate(session: Session, secret: bytes, daemon_id: str, my_nonce: bytes) -> str:
    """The proof exchange; returns the peer's daemon id once its proof checks. Our proof
    goes out before we check theirs, so a wrong secret fails on both sides at once."""
    try:
        msg = await _read_small(session, "its challenge")
    except asyncio.IncompleteReadError:
        # A dialer without the secret reads our challenge first and leaves.
        raise AuthError("auth_missing", "peer closed the connection without authenticating") from None
    if not isinstance(msg, pp.AuthChallenge):
        why = (f"speaks side-channel 1.{session.minor}, without authentication" if session.minor < pp.AUTH_MINOR
               else f"sent {type(msg).__name__}")
        raise AuthError("auth_missing", f"peer did not authenticate: it {why}")
    if msg.daemon_id == daemon_id:
        raise HandshakeError("connected to ourselves")
    auth = PeerAuth(secret, Role.DIALER if session.dialed else Role.ACCEPTOR, daemon_id, my_nonce,
                    msg.daemon_id, msg.nonce)
    session.send(pp.AuthProof(mac=auth.my_proof()))
    reply = await _read_small(session, "its proof")
    if not isinstance(reply, pp.AuthProof):
        raise AuthError("auth_missing", f"peer did not authenticate: it sent {type(reply).__name__}")
    if not auth.check_peer(reply.mac):
        raise AuthError("auth_bad_proof", "peer failed side-channel authentication (another secret?)")
    return msg.daemon_id
