"""Which `ketch serve` answered, shared by the server and the gateway.

Every answer of a server carries `x-ketch-instance`: a random id its engine drew at start, the
same on all of the server's API processes, a new one after a restart. Addresses do not name a
server (localhost and 127.0.0.1, a DNS name and its IP are one); the id does. The gateway reads
it when a worker joins and refuses a second registration of a server it already routes to: one
server counted twice would get twice its share of requests and have its prefix-cache affinity
split between two trees.
"""
from __future__ import annotations

import uuid

HEADER = b"x-ketch-instance"


def new_instance_id() -> str:
    return uuid.uuid4().hex
