"""tripod console: a live web view of a server or a fleet (``GET /ui``), a playground, and the
benchmark history.

- ``app.py``: ``Console`` (the routes, the key check, the sampler's lifecycle), mounted by
  ``server/app.py`` and ``router/app.py`` with a ``ConsoleSource`` of their own.
- ``sampler.py``: server-side sampling into a ring buffer; ``readings.py``: what is read from a
  Prometheus page, deltas, histogram quantiles.
- ``bench_runs.py``: the runs ``tripod bench`` wrote under ``--bench-dir``; ``history.py``: the
  same settings across dated runs and the regression flag.
- ``models.py``: the typed JSON the page reads. ``static/``: the page (plain HTML/JS/CSS, charts
  drawn on canvas by ``charts.js``; no build step, no third-party code).

Depends on nothing above it: not the engine, the server or the router.
"""
