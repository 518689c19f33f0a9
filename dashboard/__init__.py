"""dashboard: the operators' Plotly Dash app."""
