"""Serving under load: the load spec, the trace and length-dataset files it reads, the client-side
request timelines and the serving metrics."""
