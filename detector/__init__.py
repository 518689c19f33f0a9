"""detector: signals, alert rules, episodes, notifications and the detector API.

Public entry points:
- ``detector.thresholds``: the one definition of every alert (``ALERTS``), rendered to PromQL by
  ``rules/generate.py``;
- ``detector.signals``: signal names, units, recording rules and their Python computation;
- ``detector.evaluator.Evaluator``: Prometheus' ``for`` / ``keep_firing_for`` state machine;
- ``detector.replay.replay_run``: a reproduce run's series through the detector, as fast as possible;
  ``replay_reproduce_run``: one run of a reproduce output in its own seconds, as validation
  and the dashboard judge it;
- ``detector.service.Detector`` + ``detector.api.create_app``: the running detector and its API;
- ``retrywatch detect`` (``detector.cli``).
"""
