"""Attribution graphs: the direct effects between the nodes of a prompt's local
replacement model (``attribution.py``, on ``circuits``' replacement model), pruning and
scores (``graph.py``) and the Spark job over many prompts (``job.py``). Heavy: import the
modules, not this package, where torch must not load."""
