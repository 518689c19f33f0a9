"""reproduce: engine model, simulator and the harness for the pulse experiments."""
