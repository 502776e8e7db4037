"""What travels: bytes per client and round, and the upload compressors."""

# the public names of the module this package replaced (communication.py), so
# `from lightning_fedmeta.communication import X` keeps working
from lightning_fedmeta.communication.accounting import (
    Codec,
    PlainCodec,
    RoundTraffic,
    TrafficCounter,
    payload_bytes,
    round_traffic,
    sent_model,
    upload_bytes,
    upload_of_client,
)

__all__ = [
    "Codec",
    "PlainCodec",
    "RoundTraffic",
    "TrafficCounter",
    "payload_bytes",
    "round_traffic",
    "sent_model",
    "upload_bytes",
    "upload_of_client",
]
