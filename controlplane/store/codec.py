"""Encoding of stored documents (reservations, operations, catalog objects) as JSON with msgspec."""
from __future__ import annotations

import msgspec

from controlplane.domain.model import Confirmation, Operation, Reservation

_encoder = msgspec.json.Encoder(decimal_format="string")
_reservation = msgspec.json.Decoder(Reservation)
_operation = msgspec.json.Decoder(Operation)
_confirmation = msgspec.json.Decoder(Confirmation)

encode = _encoder.encode


def decode_reservation(doc: bytes | str) -> Reservation:
    return _reservation.decode(doc)


def decode_operation(doc: bytes | str) -> Operation:
    return _operation.decode(doc)


def decode_confirmation(doc: bytes | str) -> Confirmation:
    return _confirmation.decode(doc)


def decode_as(doc: bytes | str, type_):
    return msgspec.json.decode(doc, type=type_)
