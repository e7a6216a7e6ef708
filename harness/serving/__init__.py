"""Serving under load: the load spec, the client-side request timelines and the serving metrics."""
