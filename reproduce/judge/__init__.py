"""What a run did: its outcomes (``outcomes``), its ground truth over time (``groundtruth``),
DIR/summary.json (``summary``), the alerts scored against it (``validate``) and the report
(``report``)."""
