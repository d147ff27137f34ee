"""Berth's Python client: one typed method per API method, async (`AsyncClient`, aiohttp) and sync (`Client`).

Answers decode into msgspec Structs (answers.py); refusals raise a BerthError
subclass per code that keeps every structured detail (errors.py); settings
come from flags, the environment or the config file (config.py); a create's
fields are `ReservationRequest` (requests.py). docs/python-client.md lists
the result types and their fields.
"""
from berth.client.aio import WAIT_STEP_MS, AsyncClient
from berth.client.answers import (TERMINAL, AdminNode, AdminPool, AdminTenant, Alternative, Bound, Condition, Confirmation,
                                  DeviceCount, Event, EventPage, ExtendResult, Failure, FreeStep, MovedReservation,
                                  MigProfileCount, NodeAction, NodeBooking, NodeCondition, NodeInventory, NodeSize,
                                  OfferedPool, Operation, OperationWait,
                                  Placement, Quote, Reservation, ReservationPage, ReservationTotal, Resources, Usage,
                                  SshLogin, TenantRoot, UsageLine, Whoami, decode)
from berth.client.config import ConfigError, Settings, default_config_path, read_config_file, resolve_settings
from berth.client.errors import (ERRORS, AccessDenied, BadAnswer, BerthError, ComputeAccessRequired, Conflict,
                                 ConfirmationRequired, InsufficientFunds, InvalidInput, InvalidState, NoCapacity,
                                 NotFound, PriceChanged, ProviderUnavailable, QuotaExceeded, QuoteExpired,
                                 SpendLimitReached, TransportError, Unauthenticated, Unsupported, error_of)
from berth.client.requests import (ReservationRequest, create_body, iso_ms, new_idempotency_key, now_ms,
                                   parse_duration_ms, parse_time, price_text)
from berth.client.sync import Client

__all__ = [
    "WAIT_STEP_MS", "AsyncClient", "TERMINAL", "AdminNode", "AdminPool", "AdminTenant", "DeviceCount", "FreeStep",
    "MigProfileCount", "MovedReservation", "NodeAction", "NodeBooking", "NodeCondition", "NodeInventory", "NodeSize",
    "OfferedPool", "TenantRoot", "Whoami", "Alternative", "Bound", "Condition", "Confirmation", "Event", "EventPage",
    "ExtendResult", "Failure", "Operation", "OperationWait", "Placement", "Quote", "Reservation", "ReservationPage",
    "ReservationTotal", "Resources", "SshLogin", "Usage", "UsageLine", "decode", "ConfigError", "Settings",
    "default_config_path", "read_config_file", "resolve_settings", "ERRORS", "AccessDenied", "BadAnswer",
    "BerthError", "ComputeAccessRequired", "Conflict", "ConfirmationRequired", "InsufficientFunds", "InvalidInput",
    "InvalidState", "NoCapacity", "NotFound", "PriceChanged", "ProviderUnavailable", "QuotaExceeded",
    "QuoteExpired", "SpendLimitReached", "TransportError", "Unauthenticated", "Unsupported", "error_of",
    "ReservationRequest", "create_body", "iso_ms", "new_idempotency_key", "now_ms", "parse_duration_ms", "parse_time",
    "price_text", "Client",
]
