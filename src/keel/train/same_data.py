"""Every process trains on the rows rank 0 prepared: checked once, after all have prepared.

Each process prepares (or reads from its node's cache) the data itself. A node that read
other files (no shared storage), a Hub dataset's branch that moved between two nodes'
downloads, or another library version would give its processes other rows than rank 0's,
and the run would go on, silently training each rank on other data.
"""

from __future__ import annotations

import socket

from keel.distributed.process_group import DistContext
from keel.errors import DataError


def check_same_data(fingerprint: str, dist: DistContext) -> None:
    """Every rank prepared the same rows. A node that read other files (no shared storage),
    a Hub dataset's branch that moved between two nodes' downloads, or another library
    version would otherwise train each rank on other data, silently: refused, naming them."""
    if not dist.distributed:
        return
    seen = dist.gather_objects((fingerprint, socket.gethostname()), slow=True)
    want, main_host = seen[0]
    other = [(rank, found, host) for rank, (found, host) in enumerate(seen) if found != want]
    if not other:
        return
    rank, found, host = other[0]
    raise DataError(
        f"rank {rank} (host {host}) prepared other data than rank 0 (host {main_host}): "
        f"data fingerprint {found[:12]} there, {want[:12]} on rank 0 ({len(other)} of "
        f"{len(seen)} ranks differ). Every rank must train on the same rows: give every node "
        f"the same data files (shared storage, or identical copies), pin a Hub dataset's "
        f"data.datasets[].revision to a commit (a branch may move between two nodes' "
        f"downloads), and install the same keel, transformers and datasets everywhere"
    )
