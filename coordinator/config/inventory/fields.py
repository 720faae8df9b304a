"""The node fields every inventory format checks alike (host, user, port, IPs, paths, labels): pydantic
annotated types, so each format reports a bad value with its file:line."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict

from coordinator.config.yamlsrc import (
    format_value,
    scalar_to_str,
)

# Letters, digits and the punctuation of DNS names, IPv4/IPv6 addresses (':' and '%zone'), ssh_config aliases.
_HOST_PATTERN = re.compile(r"[A-Za-z0-9_.:%-]+")


_USER_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def check_host(value: Any) -> Any:
    """An ssh target without user: non-empty, no whitespace or shell metacharacters, not starting with '-'."""
    if not isinstance(value, str):
        return value  # the str type check reports it
    if not value:
        raise ValueError("host must not be empty")
    if value.startswith("-"):
        raise ValueError(f"host {format_value(value)} starts with '-': ssh would read it as an option")
    if "@" in value:
        raise ValueError(f"host {format_value(value)} contains '@': put the user in `user:`")
    if not _HOST_PATTERN.fullmatch(value):
        raise ValueError(f"host {format_value(value)} contains whitespace or characters not allowed in a host name "
                         "or address")
    return value


def check_user(value: Any) -> Any:
    """A login name: letters, digits, '_', '.', '-', not starting with '-' or '.'."""
    value = scalar_to_str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if isinstance(value, str) and not _USER_PATTERN.fullmatch(value):
        raise ValueError(f"invalid user {format_value(value)}: use letters, digits, '_', '.', '-' (not first)")
    return value


def check_port(value: Any) -> Any:
    """An int 1..65535 (a string of digits is accepted: Ansible INI vars are strings)."""
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.strip().isdigit():
        number = int(value.strip())
    if number is None or not 1 <= number <= 65535:
        raise ValueError(f"must be an integer 1..65535 (got {format_value(value)})")
    return number


def check_ip(value: Any) -> Any:
    """An IPv4 or IPv6 address (for the data plane: ring needs addresses, not names)."""
    if not isinstance(value, str):
        raise ValueError(f"must be an IP address (got {format_value(value)})")
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(f"{format_value(value)} is not a valid IP address") from None
    return value


def one_or_many(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


def _check_path_string(value: Any) -> Any:
    if isinstance(value, str):
        if not value:
            raise ValueError("must not be empty")
        if any(ord(ch) < 32 for ch in value):
            raise ValueError(f"{format_value(value)} contains a control character")
    return value


def _label_key(value: Any) -> Any:
    value = scalar_to_str(value)
    if isinstance(value, str) and not value:
        raise ValueError("label name must not be empty")
    return value


def _label_value(value: Any) -> Any:
    value = scalar_to_str(value)
    if not isinstance(value, str):
        raise ValueError(f"label value must be a string, number or boolean (got {format_value(value)})")
    return value


Host = Annotated[str, BeforeValidator(check_host)]


User = Annotated[str, BeforeValidator(check_user)]


Port = Annotated[int, BeforeValidator(check_port)]


IpAddress = Annotated[str, BeforeValidator(check_ip)]


PathString = Annotated[str, BeforeValidator(_check_path_string)]


LabelKey = Annotated[str, BeforeValidator(_label_key)]


LabelValue = Annotated[str, BeforeValidator(_label_value)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
