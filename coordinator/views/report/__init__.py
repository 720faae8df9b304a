"""`coordinator report`: a run directory turned into one self-contained HTML page with PNG plots.

    files.read_run_files(run_dir)   the only file I/O: summary.json, plan.json, events.jsonl as decoded JSON values
    model.build_report(files)       pure: read through coordinator.run.rundir -> a typed `Report` (series, tables,
                                    problems)
    plots.render_plots(report)      pure: PNG bytes per plot (matplotlib's Agg canvas, no pyplot global state)
    page.render_html(report, pngs)  pure: the page, plots embedded as base64 data URIs (readable without a server)
    page.build_page(files)          the three above, RunFiles -> HTML

A map run's report is coordinator/views/report_map.py (which also writes either kind: `write_report`).

Everything in a run directory may be missing or partial (a coordinator killed mid-run writes no summary, a run
that failed before its first step has no step events, a relaunch appends a second attempt to events.jsonl):
each gap becomes a line of text in the report (`Report.problems` or a "nothing recorded" note), never an
exception. Only a RUN_ID that names no run directory at all is an error (`ReportError`, exit 2).
"""

from coordinator.run.rundir import assign_attempts
from coordinator.views.report.files import ReportError, RunFiles, parse_events, read_run_files
from coordinator.views.report.model import Report, build_report
from coordinator.views.report.page import build_page, render_html
from coordinator.views.report.plots import Plot, render_plots

__all__ = ["Plot", "Report", "ReportError", "RunFiles", "assign_attempts", "build_page", "build_report",
           "parse_events", "read_run_files", "render_html", "render_plots"]
