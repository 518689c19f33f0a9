"""The alerts' validation against the runs' ground truth, one module a job: parsing the runs
(``runs``), scoring each alert and each tier's pages (``scoring``), checking the targets
(``targets``), writing ``validation.md`` (``markdown``) and scoring another rule file's alerts in a
real Prometheus (``foreign``); ``reproduce.judge.validate`` assembles
``validation.json``, replays the runs through the detector and is the command.
"""
