"""Inline styles shared by the pages (no CSS files, so nothing extra to package)."""

from __future__ import annotations

from dash import dcc

from dashboard.figures import BLUISH_GREEN, GREY, ORANGE, VERMILLION

FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif"

PAGE = {"fontFamily": FONT, "margin": "0 auto", "maxWidth": "1400px", "padding": "6px 14px", "color": "#222"}
NAV = {"display": "flex", "gap": "18px", "alignItems": "baseline", "borderBottom": "1px solid #ddd"}
NAV_LINK = {"fontSize": "15px", "textDecoration": "none", "color": "#0072B2", "fontWeight": "600"}
TITLE = {"fontSize": "18px", "margin": "6px 0", "fontWeight": "700"}
CONTROLS = {"display": "flex", "gap": "22px", "alignItems": "center", "flexWrap": "wrap", "margin": "8px 0"}
LABEL = {"fontSize": "13px", "fontWeight": "600", "marginRight": "6px"}
DROPDOWN = {"width": "280px", "fontSize": "13px"}
STATUS = {"fontSize": "12px", "color": "#555"}
GRID = {"display": "grid", "gridTemplateColumns": "repeat(auto-fit, minmax(560px, 1fr))", "gap": "6px"}
NOTE = {"fontSize": "14px", "color": "#555", "padding": "18px 0"}

SEVERITY_BG = {"critical": VERMILLION, "warning": ORANGE, "info": "#56B4E9", "nodata": GREY}

BANNER_HIDDEN = {"display": "none"}


def banner(severity: str, *, resolving: bool = False) -> dict[str, str]:
    """A banner's style: the worst firing severity's colour, dark or white text for contrast;
    when every alert shown is resolving, a white banner with a border of that colour."""
    colour = SEVERITY_BG.get(severity, GREY)
    if resolving:
        return {**banner(severity), "background": "#fff", "color": "#111", "border": f"3px dashed {colour}"}
    return {
        "display": "block",
        "background": colour,
        "color": "#fff" if severity in ("critical", "nodata") else "#111",
        "padding": "8px 12px",
        "borderRadius": "4px",
        "fontSize": "14px",
        "margin": "6px 0",
    }


def tile(status: str) -> dict[str, str]:
    border = {"ok": BLUISH_GREEN, "alert": VERMILLION, "nodata": GREY}.get(status, GREY)
    return {
        "border": f"2px solid {border}",
        "borderLeft": f"8px solid {border}",
        "borderRadius": "4px",
        "padding": "6px 10px",
        "minWidth": "180px",
        "flex": "1",
    }


TILES = {"display": "flex", "gap": "8px", "flexWrap": "wrap", "margin": "6px 0"}
TILE_VALUE = {"fontSize": "26px", "fontWeight": "700"}
TILE_DETAIL = {"fontSize": "16px", "fontWeight": "600"}
TILE_LABEL = {"fontSize": "13px", "fontWeight": "600"}
TILE_HELP = {"fontSize": "11px", "color": "#555"}

CHIP = {
    "display": "inline-block",
    "padding": "2px 8px",
    "margin": "2px 4px 2px 0",
    "borderRadius": "10px",
    "fontSize": "12px",
    "border": "1px solid #999",
}


def chip(severity: str | None) -> dict[str, str]:
    if severity is None:
        return {**CHIP, "borderColor": BLUISH_GREEN}
    return {
        **CHIP,
        "background": SEVERITY_BG.get(severity, GREY),
        "color": "#fff" if severity == "critical" else "#111",
    }


TABLE = {"borderCollapse": "collapse", "fontSize": "12px", "width": "100%"}
TH = {"textAlign": "left", "borderBottom": "2px solid #999", "padding": "3px 6px"}
TD = {"borderBottom": "1px solid #ddd", "padding": "3px 6px", "verticalAlign": "top"}

# A time panel's toolbar keeps only what it needs (zoom, pan, reset, download), so it is short
# and stays clear of the panel's title at the top left.
GRAPH_CONFIG: dcc.Graph.Config = {
    "displaylogo": False,
    "modeBarButtonsToRemove": ["select2d", "lasso2d", "autoScale2d", "zoomIn2d", "zoomOut2d"],
}
