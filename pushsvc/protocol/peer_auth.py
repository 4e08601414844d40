"""Side-channel authentication: HMAC-SHA256 proofs over a nonce exchange. No I/O.

Both daemons share a secret. After the preamble each sends a fresh nonce and its daemon
id (``AuthChallenge``); each then proves knowledge of the secret with a MAC over a
transcript that names the prover's role, both nonces and both daemon ids
(``AuthProof``). The role is what stops reflection: a proof made as the dialer never
verifies as the acceptor's, so a peer cannot echo our own proof (or our challenge) back
at us. The fresh nonces stop replay across connections. The wire format of the
transcript is fixed by the known-answer tests; changing it is a protocol change.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass, field

NONCE_LEN = 32
MAC_LEN = hashlib.sha256().digest_size
MIN_SECRET_LEN = 16
LABEL = b"pushsvc side-channel auth v1"

_LEN = struct.Struct(">I")


class Role(enum.Enum):
    DIALER = "dialer"
    ACCEPTOR = "acceptor"

    @property
    def other(self) -> Role:
        return Role.ACCEPTOR if self is Role.DIALER else Role.DIALER


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_LEN)


def transcript(role: Role, dialer_nonce: bytes, acceptor_nonce: bytes, dialer_id: str, acceptor_id: str) -> bytes:
    """What the prover in ``role`` MACs. Every part is length-prefixed, so no two
    different sets of parts can produce the same bytes."""
    parts = (LABEL, role.value.encode(), dialer_nonce, acceptor_nonce, dialer_id.encode(), acceptor_id.encode())
    return b"".join(_LEN.pack(len(p)) + p for p in parts)


def proof(secret: bytes, role: Role, dialer_nonce: bytes, acceptor_nonce: bytes, dialer_id: str,
          acceptor_id: str) -> bytes:
    return hmac.new(secret, transcript(role, dialer_nonce, acceptor_nonce, dialer_id, acceptor_id),
                    hashlib.sha256).digest()


@dataclass(frozen=True)
class PeerAuth:
    """One side's view of one exchange, once both challenges are known."""

    secret: bytes = field(repr=False)
    role: Role
    my_id: str
    my_nonce: bytes
    peer_id: str
    peer_nonce: bytes

    def _proof_for(self, role: Role) -> bytes:
        # Nonces and ids are always ordered dialer first, whoever computes the MAC.
        if self.role is Role.DIALER:
            return proof(self.secret, role, self.my_nonce, self.peer_nonce, self.my_id, self.peer_id)
        return proof(self.secret, role, self.peer_nonce, self.my_nonce, self.peer_id, self.my_id)

    def my_proof(self) -> bytes:
        return self._proof_for(self.role)

    def check_peer(self, mac: bytes) -> bool:
        """Whether ``mac`` is the peer's proof for this exchange (constant-time compare)."""
        return hmac.compare_digest(mac, self._proof_for(self.role.other))
