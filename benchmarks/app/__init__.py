"""The app itself (``python app.py``) through its API: latency, a soak with many visitors, a Space's cold start."""
