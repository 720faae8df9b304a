"""`coordinator calibrate`: measure each node and split the global batch by speed (coordinator/run/job.py
`calibrate_fleet`, coordinator/run/calibrate.py, coordinator/planning/plan.py)."""

from __future__ import annotations

from pathlib import Path

import click

from coordinator.cli.common import DEFAULT_PLAYBOOK, handle_errors, job_options, load, run_async, with_common
from coordinator.units import format_share


@with_common
@click.option("-p", "--playbook", default=DEFAULT_PLAYBOOK, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@click.option("--recalibrate", is_flag=True, help="Measure again instead of using cached curves.")
@handle_errors
def calibrate(inventory: str, limit: str | None, accept_new_host_keys: bool, connect_timeout: float,
              probe_timeout: float, playbook: str, as_json: bool, recalibrate: bool) -> None:
    """Measure each node's training throughput and split the playbook's global batch by speed (for a `kind: map`
    playbook: each node's examples/s of the task and the input's shards)."""
    from rich.table import Table

    from coordinator.planning.plan import describe_step, format_split
    from coordinator.run.calibrate import calibration_to_json
    from coordinator.run.job import calibrate_fleet
    from coordinator.run.mapjob import calibrate_map
    from coordinator.views.liveview import RichUI, make_console
    from coordinator.views.render import dumps, render_strategy

    inv, pb = load(inventory, playbook, limit)
    assert pb is not None
    console = make_console(stderr=as_json)
    opts = job_options(Path("runs"), False, recalibrate, None, connect_timeout, accept_new_host_keys)
    if pb.split != "calibrated":
        pb = pb.model_copy(update={"split": "calibrated"})  # `calibrate` always measures and shows the calibrated split
    if pb.kind == "map":
        result = run_async(calibrate_map(inv, pb, opts, RichUI(console, show_preflight=False)))
        if as_json:
            click.echo(dumps(result))
            return
        table = Table(title=f"map calibration: {pb.map.task if pb.map else ''} on {pb.model}, {result['rows']} rows")
        for col in ("node", "examples/s", "shard", "rows", "share"):
            table.add_column(col)
        for row in result["nodes"]:
            table.add_row(row["node"], f"{row['examples_per_s']:,.2f}", f"[{row['shard'][0]}, {row['shard'][1]})",
                          str(row["rows"]), format_share(row["share"]))
        console.print(table)
        return
    plan, cals, choice = run_async(calibrate_fleet(inv, pb, opts, RichUI(console, show_preflight=False)))
    result = calibration_to_json(plan, cals, choice)  # one row per rank node: a node with several GPUs has one per GPU
    if as_json:
        click.echo(dumps(result))
        return
    table = Table(title=f"calibration: {pb.model} at seq {pb.train.max_seq_length}, global batch {plan.global_batch}")
    # Two units: the bench times padded rows (every position), training reports real tokens (padding excluded).
    for col in ("node", "best padded pos/s", "at batch", "planned batch", "share", "predicted real tok/s", "cached"):
        table.add_column(col)
    for name in plan.batch:  # rank nodes: a node with several GPUs has one per GPU
        if name not in cals or plan.mode == "pipeline":
            continue  # a pipeline's stage: the plan below says which blocks it holds
        cal = cals[name]
        table.add_row(name, f"{cal.best.tokens_per_s:,.0f}", str(cal.best.batch), str(plan.batch[name]),
                      format_share(plan.split[name]), f"{plan.node_tokens_per_s(name) or 0:,.0f}",
                      "yes" if cal.cached else "no")
    if plan.mode != "pipeline":
        console.print(table)
        console.print(f"split: [bold]{format_split(plan)}[/bold]; predicted {plan.predicted_tokens_per_s:,.0f} real "
                      "tokens/s for the run (padded positions/s: what the bench timed, padding included)")
        console.print(describe_step(plan), markup=False, highlight=False)
    if choice is not None:
        render_strategy(choice, console)


def register(main: click.Group) -> None:
    main.command("calibrate")(calibrate)
