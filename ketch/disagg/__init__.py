"""Prefill/decode disaggregation: the KV transport between a prefill and a decode server (README.md)."""
from ketch.disagg.config import DisaggConfig
from ketch.disagg.factory import make_transport
from ketch.disagg.state import KVPoll
from ketch.disagg.transport import Aux, KVReceiver, KVSender, KVTransport

__all__ = ["Aux", "DisaggConfig", "KVPoll", "KVReceiver", "KVSender", "KVTransport", "make_transport"]
