"""`llmctl doctor` checks: the 24-item preflight checklist for an LLM inference host (and `server-ready`, for a running server).

Every check reads the machine only through a `Host` (a filesystem root plus an NVML handle and a
few injectable probes), so tests run it against fake `/proc`, `/sys` trees and a fake NVML.
Nothing here changes the machine: fixes are returned as text, never applied.
"""
