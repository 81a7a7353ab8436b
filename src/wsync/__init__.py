"""wsync: pull an agent's workspace out of a remote sandbox, exactly.

See ``DESIGN`` in the README: the guest runs ``tar | zstd`` into a staged,
chunk-indexed file; the host pulls the chunks back with many short exec reads,
each verified, journals them durably, and extracts with a confined extractor.
"""

__version__ = "0.1.0"
