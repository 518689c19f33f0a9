"""The emulated engine: the engine model (``reproduce.engine``) served over HTTP in wall time.

``retrywatch emulate`` (``cli.py``) serves one preset with vLLM's OpenAI API and its ``/metrics``
names and counting rules: ``driver.py`` steps the engine model paced by the (scaled) wall
clock, ``app.py`` is the ASGI app (streaming, disconnect = abort, queue-cap refusals),
``openai_api.py`` the request and response shapes, ``prompts.py`` prompts as engine segments,
``exposition.py`` the metrics text, ``server.py`` the wiring.
"""

from reproduce.emulate.app import EmulatorApp, EmulatorSettings
from reproduce.emulate.driver import EngineDriver, EngineRefused, Execution, TooManyLive
from reproduce.emulate.server import build_app

__all__ = [
    "EmulatorApp",
    "EmulatorSettings",
    "EngineDriver",
    "EngineRefused",
    "Execution",
    "TooManyLive",
    "build_app",
]
