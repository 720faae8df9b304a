"""The one error hierarchy of the coordinator.

Library code raises these; only `coordinator.cli` turns them into messages and exit codes.
Per-node failures during fan-out are *results* (see `transport.RemoteResult`), not exceptions.
"""

from __future__ import annotations


class CoordinatorError(Exception):
    """Base of every error the coordinator raises on purpose."""

    exit_code = 1


class ConfigError(CoordinatorError):
    """Bad user input: an inventory, playbook or flag. Carries `file:line` where there is one."""

    exit_code = 2

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None) -> None:
        self.message = message
        self.path = path
        self.line = line
        super().__init__(self.location_message())

    def location_message(self) -> str:
        if self.path is None:
            return self.message
        if self.line is None:
            return f"{self.path}: {self.message}"
        return f"{self.path}:{self.line}: {self.message}"


class TransportError(CoordinatorError):
    """A node could not be reached, authenticated or answered in time."""

    def __init__(self, node: str, message: str, *, kind: str = "error") -> None:
        self.node = node
        self.kind = kind  # connect | auth | host_key | timeout | error
        super().__init__(f"{node}: {message}")


class HostKeyError(TransportError):
    """The node's host key is unknown (and not accepted) or differs from known_hosts."""

    def __init__(self, node: str, message: str) -> None:
        super().__init__(node, message, kind="host_key")
