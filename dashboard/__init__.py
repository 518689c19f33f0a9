"""dashboard: the operators' Plotly Dash app (``retrywatch dashboard``).

- ``figures.py``: pure figure builders (also used by ``retrywatch reproduce report``);
- ``tiles.py``: the live page's at-a-glance ratios, coloured by the detector's alerts;
- ``data.py``: the detector API client (the one place that knows its JSON shapes);
- ``prometheus.py``: the same signals from Prometheus' recording rules (``--prometheus``);
- ``runs.py``: reproduce outputs for the Experiments page (``--runs DIR``);
- ``app.py`` and ``pages/``: the app, routing, and the Live, History and Experiments pages;
- ``cli.py``: the click command.
"""
