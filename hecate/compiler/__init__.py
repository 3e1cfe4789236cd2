"""The backend: options, the pass pipeline, fusion reports, explain, export."""
