"""Attribution graphs: a prompt's local replacement model (``local.py``), the direct
effects between its nodes (``attribution.py``), pruning and scores (``graph.py``),
interventions (``interventions.py``) and the Spark job over many prompts (``job.py``).
Heavy: import the modules, not this package, where torch must not load."""
