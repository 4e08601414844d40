"""The package's own exceptions.

Low-level errors (OSError, msgspec.DecodeError, NIXL's exceptions) are translated into
these at the module boundary that sees them, so callers handle one family.
"""


class PushsvcError(Exception):
    """Base class for every error pushsvc raises on purpose."""


class ConfigError(PushsvcError):
    """A configuration value is missing or invalid; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ProtocolError(PushsvcError):
    """A peer sent bytes that do not form a valid message for the protocol in use."""


class MalformedInput(ProtocolError):
    """Input refused by a decoder that has already counted it in
    ``pushsvc_malformed_inputs``; whoever catches it only closes or carries on."""


class FrameTooLarge(ProtocolError):
    """A length prefix announced more bytes than the configured cap."""


class VersionMismatch(ProtocolError):
    """The peer speaks an incompatible protocol version."""


class DaemonRefused(ProtocolError):
    """The daemon answered the worker's set-up (``Hello``, ``RegisterKV``) with an
    ``Error`` that names no request: it will not serve this worker as it is (rank taken,
    engine id or layout wrong), so retrying the same set-up does not help."""


class HandshakeError(PushsvcError):
    """A daemon-to-daemon handshake failed (unreachable, timed out, incompatible)."""


class AuthError(HandshakeError):
    """Side-channel authentication failed; ``reason`` is the metrics label:
    ``auth_missing`` (the peer did not authenticate), ``auth_bad_proof`` (its proof did
    not check: another secret) or ``auth_required`` (it asks for a secret we lack)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class TransferError(PushsvcError):
    """A NIXL operation (registration, prep, WRITE, notification) failed."""


class LayoutError(PushsvcError):
    """A KV layout or a block list does not fit the registered memory."""


class DaemonUnavailable(PushsvcError):
    """The worker client cannot reach its daemon (socket missing, refused or closed)."""


class DaemonNotListening(DaemonUnavailable):
    """Nothing listens on the daemon's socket: the path does not exist (ENOENT) or no
    process accepts on it (ECONNREFUSED). Whatever daemon served it before is gone."""


class DeviceError(PushsvcError):
    """A CUDA driver or device operation failed (import, allocation, copy), or the GPU
    path is not available in this process."""
