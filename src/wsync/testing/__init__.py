"""Harnesses for tests and benchmarks: real components on loopback, throwaway keys.

Nothing in the ``wsync`` runtime imports this package; it exists so the test
suite, ``bench/`` scripts and the demo can share one way of starting a real
OpenSSH server instead of each growing its own.
"""

from wsync.testing.sshd import SshdServer, SshdUnavailable

__all__ = ["SshdServer", "SshdUnavailable"]
