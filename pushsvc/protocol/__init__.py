"""Wire protocols: framing, worker <-> daemon, daemon <-> daemon, NIXL notifications."""
