"""The web dashboard (`coordinator dashboard`, `coordinator launch --dashboard`): `model` is the pure fold of a
run's files into pages, `server` the HTTP/SSE server on the coordinator's asyncio loop, `static/` the browser side
(with uPlot 1.6.32, MIT, vendored: fleets are often offline)."""
