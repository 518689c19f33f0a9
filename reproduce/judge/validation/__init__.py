"""The alerts' validation against the runs' ground truth, one module a job: parsing the runs
(``runs``), scoring each alert and each tier's pages (``scoring``), checking the targets
(``targets``) and writing ``validation.md`` (``markdown``); ``reproduce.judge.validate`` assembles
``validation.json``, replays the runs through the detector and is the command.
"""
