"""DisaggConfig: how a prefill or decode server takes part in a PD pair (issue 17).

Flag names follow SGLang (`--disaggregation-mode`, `--disaggregation-transfer-backend`,
`--disaggregation-bootstrap-port`) so a user can switch without relearning. Timeouts are ours to
keep short in tests; the defaults are SGLang's (bootstrap and waiting-for-KV 300 s, a heartbeat
every 5 s with 2 misses allowed).
"""
from __future__ import annotations

from dataclasses import dataclass

DISAGG_MODES: tuple[str, ...] = ("prefill", "decode")
TRANSFER_BACKENDS: tuple[str, ...] = ("fake", "tcp", "nixl", "mooncake")
IMPLEMENTED_BACKENDS: tuple[str, ...] = ("fake", "tcp", "nixl", "mooncake")


@dataclass(frozen=True)
class DisaggConfig:
    mode: str  # "prefill": runs prompts and sends KV; "decode": receives KV and decodes
    transfer_backend: str = "tcp"
    bootstrap_host: str = "127.0.0.1"  # prefill: the address it binds; decode: unused (the request names it)
    bootstrap_port: int = 8998  # prefill: where the bootstrap server listens; 0: any free port
    bootstrap_timeout_s: float = 300.0  # the two sides must find each other within this
    waiting_timeout_s: float = 300.0  # after that, the KV must start to move within this
    transfer_timeout_s: float = 300.0  # and be all there (and confirmed) within this
    heartbeat_interval_s: float = 5.0  # a side that hears nothing from its peer for
    heartbeat_misses: int = 2  # interval x (misses + 1) presumes it dead and fails its rooms
    chunk_bytes: int = 4 << 20  # tcp: payload bytes per chunk (whole page rows; at least one row)
    window_chunks: int = 8  # tcp: chunks in flight before the sender waits for the receiver's credit

    def __post_init__(self) -> None:
        if self.mode not in DISAGG_MODES:
            raise ValueError(f"mode: one of {DISAGG_MODES}, got {self.mode!r}")
        if self.transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(f"transfer_backend: one of {TRANSFER_BACKENDS}, got {self.transfer_backend!r}")
        if self.transfer_backend not in IMPLEMENTED_BACKENDS:
            raise ValueError(f"transfer_backend: {self.transfer_backend!r} is not implemented yet "
                             f"(have {IMPLEMENTED_BACKENDS})")
        if not isinstance(self.bootstrap_host, str) or not self.bootstrap_host:
            raise ValueError(f"bootstrap_host: a host name or address, got {self.bootstrap_host!r}")
        if not isinstance(self.bootstrap_port, int) or not 0 <= self.bootstrap_port <= 65535:
            raise ValueError(f"bootstrap_port: an int in [0, 65535], got {self.bootstrap_port!r}")
        for name in ("bootstrap_timeout_s", "waiting_timeout_s", "transfer_timeout_s", "heartbeat_interval_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name}: a number of seconds > 0, got {value!r}")
        for name in ("heartbeat_misses", "chunk_bytes", "window_chunks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: an int >= 1, got {value!r}")

    @property
    def peer_silence_s(self) -> float:
        """How long a side waits without a word from its peer before presuming it dead."""
        return self.heartbeat_interval_s * (self.heartbeat_misses + 1)
