"""`coordinator hostfile`: MLX's JSON hostfile for the playbook's backend (coordinator/planning/hostfile.py)."""

from __future__ import annotations

from pathlib import Path

import click

from coordinator.cli.common import DEFAULT_PLAYBOOK, handle_errors, load, run_async, with_common
from coordinator.errors import ConfigError, CoordinatorError


@with_common
@click.option("-p", "--playbook", default=DEFAULT_PLAYBOOK, show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Write here (default stdout).")
@handle_errors
def hostfile(inventory: str, limit: str | None, accept_new_host_keys: bool, connect_timeout: float,
             probe_timeout: float, playbook: str, output: Path | None) -> None:
    """Write MLX's JSON hostfile for the playbook's backend (jaccl's rdma matrix from the Thunderbolt facts)."""
    from coordinator.planning.gpuranks import build_rank_nodes, rank_facts
    from coordinator.preflight.pipeline import collect
    from coordinator.run.job import hostfile_for
    from coordinator.views.render import dumps

    inv, pb = load(inventory, playbook, limit)
    assert pb is not None
    # nccl too: a node with several GPUs has one entry per GPU (coordinator.planning.gpuranks).
    needs_facts = pb.backend in ("jaccl", "jaccl-ring", "auto", "nccl")
    facts = {}
    if needs_facts:
        result = run_async(collect(inv, None, connect_timeout=connect_timeout, probe_timeout=probe_timeout,
                                   accept_new_host_keys=accept_new_host_keys))
        missing = [n.name for n in inv.nodes if n.name not in result.facts]
        if missing:
            raise CoordinatorError(f"no facts from {', '.join(missing)}: the {pb.backend} hostfile needs each "
                                   "node's Thunderbolt topology (run `coordinator preflight`)")
        facts = result.facts
    ranks = build_rank_nodes(inv, pb.backend, facts)
    text = dumps(hostfile_for(ranks, pb, rank_facts(facts, ranks.nodes)).to_json()) + "\n"
    if output is None:
        click.echo(text, nl=False)
    else:
        try:
            output.write_text(text, encoding="utf-8")
        except OSError as exc:  # a missing or unwritable directory is a usage error, not a traceback
            raise ConfigError(f"-o {output}: cannot write the hostfile ({exc.strerror})") from None
        click.echo(f"wrote {output}", err=True)


def register(main: click.Group) -> None:
    main.command("hostfile")(hostfile)
