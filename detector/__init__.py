"""detector: signals, alert rules, episodes, notifications and the detector API."""
