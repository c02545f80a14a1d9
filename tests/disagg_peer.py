"""The far side of a PD transfer, in its own OS process (tests/test_disagg_tcp.py spawns these).

Each side builds its pool from a seed (so the test knows every byte without shipping tensors),
runs one room (nixl_pool_main / mooncake_pool_main: only holds a registered pool), and reports
on a queue: ("addr", host:port), ("transferring",), ("stalled",), ("peer", ...), ("final", state
name, failure reason). Wire faults are chosen by name, because a spawned child
cannot be handed a closure: "flip:N" flips one byte of chunk N after its checksum was taken (a
real corruption at the wire boundary), "stall:N" hangs the transport's thread before chunk N (a
process that stops answering; the test then SIGKILLs it).
"""
from __future__ import annotations

import threading
import time

import torch

from ketch.disagg import Aux, DisaggConfig, KVPoll, make_transport


def make_layers(seed: int, num_pages: int, *, num_layers: int = 2, page_size: int = 4, heads: int = 2,
                head_dim: int = 8, dtype: torch.dtype = torch.float32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{name: torch.randn(num_pages, page_size, heads, head_dim, generator=g).to(dtype) for name in ("k", "v")}
            for _ in range(num_layers)]


def wait_until(predicate, timeout_s: float, what: str, step_s: float = 0.005) -> float:
    """Poll `predicate` until true (returns the seconds it took); AssertionError naming `what` at the deadline."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(step_s)
    return time.monotonic() - start


def wire_fault(spec: str | None, out):
    if spec is None:
        return None
    kind, _, n = spec.partition(":")
    target = int(n)

    def hook(seq: int, frames: list) -> list:
        if seq != target:
            return frames
        if kind == "flip":
            damaged = bytearray(frames[0])
            damaged[len(damaged) // 2] ^= 0x40
            return [damaged, *frames[1:]]
        out.put(("stalled",))
        threading.Event().wait()  # hangs this thread for good: the test kills the process
        return frames

    return hook


def prefill_main(config: dict, seed: int, num_pages: int, room: int, src_pages: list[int], first_token: int,
                 fault: str | None, out) -> None:
    from ketch.disagg.tcp_prefill import TcpPrefillTransport
    layers = make_layers(seed, num_pages)
    if fault is None:  # any backend (config's transfer_backend, tcp by default)
        transport = make_transport(DisaggConfig("prefill", **config), layers)
    else:  # a wire fault is a tcp one
        transport = TcpPrefillTransport(DisaggConfig("prefill", **config), layers, wire_hook=wire_fault(fault, out))
    out.put(("addr", transport.bootstrap_addr))
    sender = transport.sender(room)
    sender.init(len(src_pages))
    sender.send(src_pages, Aux(first_token, b"sampling-state"))
    wait_until(lambda: sender.poll() in (KVPoll.Success, KVPoll.Failed), 60, "the sender to end")
    out.put(("final", sender.poll().name, sender.failure))
    transport.close()


def decode_main(config: dict, seed: int, num_pages: int, room: int, addr: str, dst_pages: list[int], out) -> None:
    transport = make_transport(DisaggConfig("decode", **config), make_layers(seed, num_pages))
    receiver = transport.receiver(room, addr)
    receiver.init()
    receiver.post_buffers(dst_pages)
    wait_until(lambda: receiver.poll() != KVPoll.Bootstrapping and receiver.poll() != KVPoll.WaitingForInput,
               60, "the first chunk")
    out.put(("transferring",))
    wait_until(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), 60, "the receiver to end")
    out.put(("final", receiver.poll().name, receiver.failure))
    transport.close()


def nixl_pool_main(seed: int, num_pages: int, out) -> None:
    """A NIXL agent holding a registered pool and nothing else: the test describes it to a decode
    side by hand, then stops or kills this process (a READ from it then cannot complete)."""
    from ketch.disagg.nixl_agent import describe, new_agent, pool_tensors
    layers = make_layers(seed, num_pages)
    agent = new_agent("pool")
    agent.register_memory(pool_tensors(layers))
    out.put(("peer", describe(agent, layers)))
    threading.Event().wait()


def mooncake_pool_main(seed: int, num_pages: int, out) -> None:
    """A Mooncake transfer engine holding a registered pool and nothing else: the test names it
    to a decode side by hand, then stops this process (a READ from it then cannot complete)."""
    from ketch.disagg.mooncake_engine import new_engine, pool_tensors, register_pool
    from ketch.disagg.wire import MooncakePeer
    layers = make_layers(seed, num_pages)
    engine, session = new_engine("127.0.0.1")
    tensors = pool_tensors(layers)
    register_pool(engine, tensors)
    out.put(("peer", MooncakePeer(session, [t.data_ptr() for t in tensors])))
    threading.Event().wait()


def read_between_two_processes(config: dict, num_pages: int, src: list[int], dst: list[int]) -> None:
    """A prefill transport in a spawned process (its pool seeded 1), this process's decode side
    (seeded 2) receiving room 77: the posted pages hold the source's rows byte for byte, every
    other page is untouched, the Aux arrived, and the prefill side saw Success."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=prefill_main, args=(config, 1, num_pages, 77, src, 42, None, out), daemon=True)
    proc.start()
    layers = make_layers(2, num_pages)
    before = [{k: t.clone() for k, t in layer.items()} for layer in layers]
    decode = make_transport(DisaggConfig("decode", **config), layers)
    try:
        _, addr = out.get(timeout=60)
        receiver = decode.receiver(77, addr)
        receiver.init()
        receiver.post_buffers(dst)
        wait_until(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), 30, "the transfer")
        assert receiver.poll() == KVPoll.Success, receiver.failure
        assert receiver.aux == Aux(42, b"sampling-state")
        source = make_layers(1, num_pages)
        untouched = [p for p in range(num_pages) if p not in dst]
        for layer in range(2):
            for name in ("k", "v"):
                assert torch.equal(layers[layer][name][dst], source[layer][name][src])
                assert torch.equal(layers[layer][name][untouched], before[layer][name][untouched])
        assert out.get(timeout=30) == ("final", "Success", None)
    finally:
        decode.close()
        if proc.is_alive():
            proc.kill()
        proc.join(10)
