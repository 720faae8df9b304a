"""Operator verbs (status, monitor, nettest, report, ...), one module each.

Every module here defines click commands and a `register(main: click.Group) -> None`; `coordinator.cli`
registers them all, so a verb's code is one hop from `coordinator --help`.
"""
