"""The `coordinator` command line: the ONLY place that prints errors for users and chooses exit codes.

Exit codes: 0 ok, 1 a check failed / the job failed, 2 usage or configuration error (or a run another live
coordinator supervises), 128 + the signal that stopped a job: 130 SIGINT (Ctrl-C), 143 SIGTERM, 129 SIGHUP.

One module per verb (`coordinator/cli/<verb>.py`, each with `register(main)`), the helpers they share in
`coordinator/cli/common.py`. Each verb is a thin wrapper: the behaviour behind it is one hop away, in the module
its imports name. A verb's module is imported only when that verb runs (or `--help` lists them all): `coordinator
preflight` must not pay for importing the launcher, the live view and the Prometheus client.
"""

from __future__ import annotations

import gc
import importlib
import pkgutil

import click

# Modules of this package that are not verbs.
NOT_VERBS = frozenset({"common"})


def entry() -> None:
    """The `coordinator` console script.

    A verb's start-up imports (asyncssh, pydantic, yaml: ~0.25 s, before the first node is contacted) allocate
    a few hundred thousand objects that live as long as the process, and the cyclic garbage collector would
    walk them again at every threshold: ~12% of the start-up. So it is off until `run_async` starts the verb's
    event loop, which freezes what exists by then out of the collector's sight and turns it back on. A verb that
    never starts a loop is short-lived. (Not in `main`: tests call that in-process, and must keep their GC.)"""
    gc.disable()
    main()


def verb_modules() -> list[str]:
    """The verbs: every module of this package but the shared helpers."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in NOT_VERBS)


class LazyGroup(click.Group):
    """The top-level group. Each verb lives in coordinator/cli/<name>.py and adds the command `<name>` with its
    `register(main)` (the one way to add a verb); a module is imported only when its verb is named."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return verb_modules()

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in verb_modules():
            importlib.import_module(f"{__name__}.{cmd_name}").register(self)
        return super().get_command(ctx, cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mlx-coordinator")
def main() -> None:
    """Cluster coordinator for distributed MLX training on Apple Silicon Macs."""
