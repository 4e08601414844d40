"""Transfer engines: the NIXL calls behind one small interface.

``base`` defines it, ``nixl`` is the real one, ``fake`` an in-process stand-in that moves
real bytes with memmove, for unit tests of everything above the engine.
"""

from pushsvc.engine.base import Agent, Engine, XferState

__all__ = ["Agent", "Engine", "XferState"]
