"""The nixl backend, decode side: on Ready, one NIXL READ of its rows from the prefill side's
registered pool straight into the posted pages. A room's Readys (parts sent while the prompt ran,
then the last with the Aux) are read one after the other; the last READ done → Success, Received.

The READ is this side's own operation, so its completion means the rows are here (no checksum
of ours: the bytes never pass through Python). It is recorded on the room before it starts:
an abort, a timeout or a silent peer then waits until the READ is cancelled or over before the
room is Failed, so the engine never hands on pages a READ may still write. A prefill side that
restarts is another agent (Welcome names it): the old one is dropped and the new one loaded.
The control plane is decode_side.py's.
"""
from __future__ import annotations

import logging

import torch

from ketch.disagg.config import DisaggConfig
from ketch.disagg.decode_side import Connection, DecodeReceiver, DecodeSide
from ketch.disagg.nixl_agent import mem_type_of, new_agent, pool_tensors, row_descs
from ketch.disagg.state import KVPoll
from ketch.disagg.wire import NixlPeer, Ready, Welcome

log = logging.getLogger(__name__)

_STARTING = "starting"  # r.op while the READ is being posted: already counts as in flight


class NixlDecodeTransport(DecodeSide):
    backend = "nixl"

    def __init__(self, config: DisaggConfig, layers: list[dict[str, torch.Tensor]], model: str = "") -> None:
        super().__init__(config, layers, model)
        self.agent = new_agent("decode")
        self.registered = self.agent.register_memory(pool_tensors(layers))
        self.mem_type, self.device_id = mem_type_of(layers)
        self.bases = [t.data_ptr() for t in pool_tensors(layers)]
        self.reading: dict[DecodeReceiver, tuple[Connection, Ready]] = {}  # READs in flight -> (conn, their Ready)
        self.start()

    def _on_welcome(self, conn: Connection, msg: Welcome) -> str | None:
        peer = msg.nixl
        if peer is None:
            return "the prefill side's Welcome carries no NIXL agent"
        if isinstance(conn.peer, NixlPeer) and conn.peer.agent == peer.agent:
            return None
        try:
            if isinstance(conn.peer, NixlPeer):  # a restarted prefill side: forget the old agent
                self.agent.remove_remote_agent(conn.peer.agent)
            self.agent.add_remote_agent(peer.metadata)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own types; the room fails with the reason
            conn.peer = None
            return f"nixl: cannot load the prefill side's agent {peer.agent}: {e}"
        conn.peer = peer
        return None

    def _on_data(self, conn: Connection, r: DecodeReceiver, msg: object, frames: list) -> None:
        if isinstance(msg, Ready) and self._queue_ready(r, msg, isinstance(conn.peer, NixlPeer)) and r.op is None:
            self._next(conn, r)

    def _read(self, conn: Connection, r: DecodeReceiver, msg: Ready) -> None:
        peer = conn.peer
        with r.state.lock:  # first: an abort from now on waits for the READ
            if r.state.terminal:
                return
            r.op = _STARTING
            r.state.advance(KVPoll.Transferring)
        dst_pages = r.dst_pages[msg.page_start:msg.page_start + len(msg.src_pages)]
        try:
            local = self.agent.get_xfer_descs(row_descs(self.layout, self.bases, dst_pages, self.device_id),
                                              self.mem_type)
            remote = self.agent.get_xfer_descs(row_descs(self.layout, peer.bases, msg.src_pages, peer.device_id),
                                               peer.mem_type)
            handle = self.agent.initialize_xfer("READ", local, remote, peer.agent)
            started = self.agent.transfer(handle)
        except Exception as e:  # noqa: BLE001 - nothing was posted: the pages are quiet
            with r.state.lock:
                r.op = None
            self._fail(r, f"nixl: the READ could not start: {e}", tell=True)
            return
        with r.state.lock:
            r.op = handle
        self.reading[r] = (conn, msg)
        if started == "ERR":
            log.warning("nixl READ of room %d failed at once", r.room)

    def busy(self) -> bool:
        return bool(self.reading)

    def pump(self) -> None:
        super().pump()  # rooms failing: _cancel below
        for r, (conn, msg) in list(self.reading.items()):
            if r.failing is not None or r.op is None:
                continue
            status = self.agent.check_xfer_state(r.op)
            if status == "PROC":
                continue
            self._release(r)
            if status == "DONE" and msg.aux is not None:
                self._succeed(conn, r, msg.aux)
            elif status == "DONE":
                self._next(conn, r)  # a part is here: the next one, if it came
            else:
                self._fail(r, "nixl: the READ failed", tell=True)

    def _cancel(self, r: DecodeReceiver) -> bool:
        if r.op is None:
            return True
        if r.op is not _STARTING and self.agent.check_xfer_state(r.op) == "PROC":
            try:  # NIXL cancels an active transfer if it can; if not it raises and the READ goes on
                self.agent.release_xfer_handle(r.op)
            except Exception:  # noqa: BLE001 - still in flight: try again on the next pump
                return False
            with r.state.lock:
                r.op = None
            self.reading.pop(r, None)
            return True
        self._release(r)
        return True

    def _release(self, r: DecodeReceiver) -> None:
        handle = r.op
        self.reading.pop(r, None)
        with r.state.lock:
            r.op = None
        if handle is not None and handle is not _STARTING:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception as e:  # noqa: BLE001 - a finished READ's handle: only memory is at stake
                log.warning("nixl: releasing a finished READ's handle failed: %s", e)

    def _on_silent(self, conn: Connection) -> None:
        if isinstance(conn.peer, NixlPeer):
            try:
                self.agent.remove_remote_agent(conn.peer.agent)
            except Exception as e:  # noqa: BLE001
                log.warning("nixl: dropping the silent prefill agent %s failed: %s", conn.peer.agent, e)
            conn.peer = None

    def close(self) -> None:
        super().close()
        if self.registered is not None:  # once: close may be called again
            self.agent.deregister_memory(self.registered)
            self.registered = None
