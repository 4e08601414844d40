"""Device memory for the GPU path: CUDA IPC imports, owned allocations, gather copies.

``base.py`` is the interface the daemon is written against, ``cuda.py`` the real one
(driver calls through ``driver.py``, kernels and events through torch), ``fake.py`` host
memory standing in for a device in unit tests.
"""
